"""Hardware YAML (``--hardware``): an alias bomb is refused while composing and an over-long
integer names its field; error text never formats a value whole (the break report's finding 3
and 6, same loader as the bundle manifest)."""

from __future__ import annotations

import re

import pytest

from calconsole.cli import main
from sim_backend.errors import ManifestError
from sim_backend.model.hwspec import DEFAULT_HW_PATH, HardwareSpec


def _laughs(levels: int = 5) -> str:
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _hw(tmp_path, value: str, prefix: str = ""):
    text = re.sub(r"(?m)^(\s*param_file_gib:).*$", lambda m: f"{m.group(1)} {value}", DEFAULT_HW_PATH.read_text())
    p = tmp_path / "hw.yaml"
    p.write_text(prefix + text)
    return p


def test_alias_bomb_is_refused(tmp_path):
    p = _hw(tmp_path, "*a5", _laughs())
    with pytest.raises(ManifestError, match="aliases are expanded") as e:
        HardwareSpec.load(p)
    assert len(str(e.value)) < 300


def test_shared_list_within_the_bound_is_not_formatted_whole(tmp_path):
    p = _hw(tmp_path, "*a3", _laughs(3))  # 9**4 shared leaves: under the bound, wrong shape
    with pytest.raises(ManifestError) as e:
        HardwareSpec.load(p)
    assert e.value.field == "memory.param_file_gib" and len(str(e.value)) < 300


def test_5000_digit_integer_names_the_field(tmp_path, capsys):
    p = _hw(tmp_path, "[" + "9" * 5000 + ", 1.0]")
    with pytest.raises(ManifestError) as e:
        HardwareSpec.load(p)
    assert e.value.field == "memory.param_file_gib[0]" and "an integer of 5000 characters" in str(e.value)
    assert main(["model", "--hardware", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "memory.param_file_gib[0]" in err and "Traceback" not in err
