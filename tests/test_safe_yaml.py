"""The one hardened YAML loader (sim_backend.safe_yaml) and the files that read through it: an alias
bomb, anchors where none belong, absurd nesting and over-long integers are refused while composing,
with the line, before anything large is built."""

from __future__ import annotations

import time

import pytest
import yaml

from calconsole.layout import LayoutError, load_layout
from calconsole.settings import SettingsError, load_settings
from sim_backend import safe_yaml

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))


def test_plain_data_loads():
    doc = safe_yaml.load("a: 1\nb: [x, 2.5, true, null]\nc: {d: 2026-12-01}\n")
    assert doc["a"] == 1 and doc["b"] == ["x", 2.5, True, None] and str(doc["c"]["d"]) == "2026-12-01"


def test_python_tags_are_not_constructed():
    with pytest.raises(yaml.YAMLError):
        safe_yaml.load("!!python/object/apply:os.system ['true']")


def test_an_alias_bomb_is_refused_while_composing():
    t0 = time.process_time()
    with pytest.raises(safe_yaml.YAMLRefused, match="aliases are expanded") as e:
        safe_yaml.load(BOMB)
    assert e.value.problem_mark.line >= 1
    assert time.process_time() - t0 < 5.0  # 9**9 references are never built (bound: CPU s, generous)


def test_a_few_aliases_are_allowed_unless_refused():
    assert safe_yaml.load("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}
    with pytest.raises(safe_yaml.YAMLRefused, match="not allowed in a layout"):
        safe_yaml.load("a: &x [1, 2]\nb: *x\n", aliases=False, what="a layout")


def test_nesting_and_long_integers_are_bounded():
    with pytest.raises(safe_yaml.YAMLRefused, match="nested deeper than 8 levels"):
        safe_yaml.load("[" * 9 + "]" * 9, max_depth=8)
    with pytest.raises(safe_yaml.YAMLRefused, match="nested deeper"):
        safe_yaml.load("[" * 5000 + "]" * 5000)  # would hit the recursion limit without the bound
    v = safe_yaml.load("n: " + "9" * 5000)["n"]
    assert isinstance(v, safe_yaml.LongInt) and v.n_chars == 5000


def test_settings_file_refuses_an_alias_bomb_with_its_line(tmp_path):
    p = tmp_path / "config.yaml"
    p.write_text(BOMB)
    with pytest.raises(SettingsError, match="anchors and aliases") as e:
        load_settings(p, environ={})
    assert "line 1" in str(e.value)


def test_layout_refuses_deep_nesting(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text("columns: " + "[" * 40 + "]" * 40 + "\n")
    with pytest.raises(LayoutError, match="nested deeper"):
        load_layout(str(p))
