"""Bundle manifest YAML: an alias bomb ("billion laughs") and over-long integers are refused
with a ManifestError naming file and field, before any value is formatted (break report 3, 6).
Plain aliases stay allowed: PyYAML's safe_dump writes them for shared objects."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sim_backend.bundle.manifest import DEFAULT_BUNDLE_DIR, MAX_EXPANDED_NODES, MAX_INT_DIGITS, _short, load_bundle
from sim_backend.errors import ManifestError


def _copy(tmp_path: Path) -> Path:
    d = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, d)
    return d


def _laughs(levels: int = 5) -> str:
    """A "billion laughs" prefix: ``levels`` levels of 9 aliases (the break report's bomb has 9).
    In-process tests use 5 (9**6 leaves), so a regression fails in seconds, not gigabytes."""
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_alias_bomb_in_the_manifest_is_refused_at_compose_time(tmp_path):
    d = _copy(tmp_path)
    mf = d / "calbin.yaml"
    mf.write_text(_laughs() + mf.read_text().replace("device_name: calculet0", "device_name: *l5"))
    with pytest.raises(ManifestError) as ei:
        load_bundle(d)
    e = ei.value
    assert e.file == str(mf) and e.field == "<yaml>" and len(str(e)) < 300
    assert f"more than {MAX_EXPANDED_NODES:,} values once YAML aliases are expanded" in e.message
    assert "(line 6," in e.message  # where the expansion passed the bound: l5, not the use far below


def test_plain_anchors_and_aliases_still_load(tmp_path):
    d = _copy(tmp_path)
    mf = d / "calbin.yaml"
    text = mf.read_text().replace("name: qwen3-30b-a3b", "name: &n qwen3-30b-a3b")
    mf.write_text(text + "note: *n\n")
    assert load_bundle(d).name == "qwen3-30b-a3b"


def test_alias_bomb_in_the_tokenizer_config_names_that_file(tmp_path):
    d = _copy(tmp_path)
    tc = d / "tokenizer_config.yaml"
    tc.write_text(_laughs() + tc.read_text().replace("model_max_length: 131072", "model_max_length: *l5"))
    with pytest.raises(ManifestError) as ei:
        load_bundle(d)
    assert ei.value.file == str(tc) and "aliases are expanded" in ei.value.message


@pytest.mark.parametrize("file, old, field", [
    ("calbin.yaml", "  n_layers: 48", "model.n_layers"),
    ("tokenizer_config.yaml", "model_max_length: 131072", "model_max_length"),
])
def test_integer_of_5000_digits_names_the_field(tmp_path, file, old, field):
    d = _copy(tmp_path)
    key = old.split(":")[0]
    _replace(d / file, old, f"{key}: {'9' * 5000}")
    with pytest.raises(ManifestError) as ei:
        load_bundle(d)
    e = ei.value
    assert e.field == field and "an integer of 5000 characters" in e.message and len(str(e)) < 300


def test_integers_up_to_the_digit_bound_still_reach_the_range_check(tmp_path):
    d = _copy(tmp_path)
    _replace(d / "calbin.yaml", "  n_layers: 48", "  n_layers: " + "9" * MAX_INT_DIGITS)
    with pytest.raises(ManifestError) as ei:
        load_bundle(d)
    assert ei.value.field == "model.n_layers" and "must be at most" in ei.value.message


def test_cli_model_with_the_9_level_bomb_exits_2_in_bounded_memory(tmp_path):
    d = _copy(tmp_path)
    mf = d / "calbin.yaml"
    mf.write_text(_laughs(9) + mf.read_text().replace("device_name: calculet0", "device_name: *l9"))
    code = ("import resource, sys; from calconsole.cli import main; "
            "soft = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + (1 << 30); "
            "resource.setrlimit(resource.RLIMIT_DATA, (soft, resource.RLIM_INFINITY)); "
            "sys.exit(main(['model', '--bundle', sys.argv[1]]))")
    r = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and "aliases are expanded" in r.stderr


def test_short_is_bounded_for_nested_and_huge_values():
    shared = ["x" * 1000] * 9
    for _ in range(6):
        shared = [shared] * 9  # 9**7 references, what an alias bomb builds
    assert len(_short(shared)) <= 60
    assert len(_short("y" * 100_000)) <= 60
    assert _short(10 ** 5000) == "<int>"
