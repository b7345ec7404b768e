"""sim_backend never imports Textual: statically (no import statement) and at run time; BF16 has one home."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_textual_import_statement_in_sim_backend():
    offenders = []
    for py in (ROOT / "sim_backend").rglob("*.py"):
        tree = ast.parse(py.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                if n == "textual" or n.startswith("textual.") or n.startswith("calconsole"):
                    offenders.append(f"{py.relative_to(ROOT)}: {n}")
    assert offenders == []


def test_headless_stack_runs_without_textual_loaded():
    code = (
        "import sys\n"
        "from sim_backend.compose import build_system\n"
        "from sim_backend.planes import ChatRequest\n"
        "s = build_system(numerics=False, maintenance=True, audit_path=sys.argv[1])\n"
        "r = s.inference.generate(ChatRequest.from_prompt('hi', max_tokens=2))\n"
        "s.observation.snapshot().to_dict()\n"
        "s.close()\n"
        "assert r.status == 'finished', r\n"
        "bad = [m for m in sys.modules if m == 'textual' or m.startswith('textual.')]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / ".pytest_audit_tmp.jsonl")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    (ROOT / ".pytest_audit_tmp.jsonl").unlink(missing_ok=True)
    assert out.returncode == 0, out.stderr


def test_bf16_bit_shift_lives_only_in_the_bf16_module():
    shift = re.compile(r"(<<|>>)\s*(np\.uint32\()?16\b|left_shift\(")
    # kernels.py: the compiled BF16 matvec decodes the bits inside its numba loop, where the numpy bf16
    # module cannot be called; its result is checked against bf16.py's in tests/model/test_kernels.py
    offenders = [f"{py.relative_to(ROOT)}:{i}" for py in (ROOT / "sim_backend").rglob("*.py")
                 if py.name not in ("bf16.py", "kernels.py")
                 for i, line in enumerate(py.read_text(encoding="utf-8").splitlines(), 1) if shift.search(line)]
    assert offenders == []


def test_import_contracts_hold():
    """The layer and door contracts in pyproject.toml ([tool.importlinter]) hold for the tree."""
    import shutil

    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    p = subprocess.run([exe, str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert "0 broken" in p.stdout


def test_no_serving_module_far_over_400_lines():
    """The serving layer stays in parts a reader can hold (the engine is the thread and the lock; admission,
    scheduler, steps, tokens, ledger, intake, gate and slot actions are modules of their own): no module
    over ~400 lines, with a margin of 50 so a small feature does not have to split a module first."""
    long = {str(py.relative_to(ROOT)): n for py in (ROOT / "sim_backend" / "serving").rglob("*.py")
            if (n := len(py.read_text(encoding="utf-8").splitlines())) > 450}
    assert long == {}


def test_no_module_over_800_lines():
    """Every module of the console and the simulator stays in parts a reader can hold: none over 800 lines
    (a module that grows past it is split by responsibility, not by count)."""
    long = {str(py.relative_to(ROOT)): n for pkg in ("calconsole", "sim_backend") for py in (ROOT / pkg).rglob("*.py")
            if (n := len(py.read_text(encoding="utf-8").splitlines())) > 800}
    assert long == {}
