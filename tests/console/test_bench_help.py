"""``calconsole bench --help`` lists every bench under its group (the device's capacity and performance apart
from diagnostics of this program); every bench lives in calconsole/bench/NAME.py and its own --help works."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import calconsole.bench
from calconsole.cli import main
from calconsole.commands.bench import BENCH_MODULES, GROUPS

ROOT = Path(__file__).resolve().parents[2]


def _bench_modules() -> list[str]:
    """The modules of calconsole.bench that are benches (they register a parser); the rest is shared code."""
    names = []
    for m in pkgutil.iter_modules(calconsole.bench.__path__):
        if hasattr(importlib.import_module(f"calconsole.bench.{m.name}"), "register"):
            names.append(m.name)
    return sorted(names)


def _help(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


def _sections(text: str) -> dict[str, list[str]]:
    """Each heading of a help text (a line at column 0 ending in ':') -> the names listed under it."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            out[current] = []
        elif current is not None and line.startswith("  ") and not line.startswith("   "):
            out[current].append(line.split()[0])
    return out


def test_every_bench_is_in_exactly_one_group_and_has_no_home_in_commands():
    grouped = [n for _, names in GROUPS for n in names]
    assert len(grouped) == len(set(grouped))
    assert sorted(grouped) == _bench_modules() == sorted(BENCH_MODULES)
    assert sorted(p.name for p in (ROOT / "calconsole" / "commands").glob("bench_*.py")) == []


@pytest.mark.parametrize("columns", ["80", "160"])
def test_bench_help_lists_every_bench_under_its_group(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch, columns: str) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    sections = _sections(_help(capsys, ["bench", "--help"]))
    assert [t for t in sections if t in dict(GROUPS)] == [t for t, _ in GROUPS]
    for title, names in GROUPS:
        assert sections[title] == list(names)


@pytest.mark.parametrize("name", BENCH_MODULES)
def test_each_bench_has_its_own_help(capsys: pytest.CaptureFixture[str], name: str) -> None:
    out = _help(capsys, ["bench", name, "--help"])
    assert out.startswith(f"usage: calconsole bench {name} ")


def test_python_m_calconsole_bench_help_groups_the_benches() -> None:
    env = {**os.environ, "COLUMNS": "120", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "calconsole", "bench", "--help"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    sections = _sections(p.stdout)
    for title, names in GROUPS:
        assert sections[title] == list(names)
