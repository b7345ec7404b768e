"""sim_backend never imports Textual: statically (no import statement) and at run time; BF16 has one home; no
import circles among the modules of calconsole and sim_backend; the mypy configuration is strict on the whole tree."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

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


# --- import circles -------------------------------------------------------------------------------------

def _import_graph(*packages: str) -> tuple[dict[str, set[str]], Any]:
    """module -> the modules of ``packages`` it imports, from grimp (import-linter's graph), and the grimp graph.

    grimp counts every import statement: at module level, inside functions and under ``TYPE_CHECKING``
    (``exclude_type_checking_imports`` is left False). A package's ``__init__`` importing its own submodules
    is how it exports them, not a circle: those edges are left out."""
    import grimp

    g = grimp.build_graph(*packages, include_external_packages=False, cache_dir=None)
    edges = {m: {t for t in g.find_modules_directly_imported_by(m) if not t.startswith(m + ".")} for m in g.modules}
    return edges, g


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def _one_cycle(edges: dict[str, set[str]], comp: list[str], g: Any) -> str:
    """A shortest cycle through the component's first module, each import with its line: 'a:12 -> b:3 -> a'."""
    members, start = set(comp), comp[0]
    prev: dict[str, str] = {}
    queue, seen, end = [start], {start}, None
    while queue and end is None:
        v = queue.pop(0)
        for w in sorted(edges[v] & members):
            if w == start:
                end = v
                break
            if w not in seen:
                seen.add(w)
                prev[w] = v
                queue.append(w)
    path = [start]
    v = end
    while v is not None and v != start:
        path.insert(1, v)
        v = prev.get(v)
    path.append(start)
    hops = []
    for a, b in zip(path[:-1], path[1:], strict=True):
        details = g.get_import_details(importer=a, imported=b)
        hops.append(f"{a}:{details[0]['line_number']}" if details else a)
    return " -> ".join(hops + [start])


def test_no_import_circles():
    """No import circles among calconsole's and sim_backend's modules (every import counted: module level, in
    functions, under TYPE_CHECKING); the message names each circle and one cycle of it with the importing
    lines."""
    edges, g = _import_graph("calconsole", "sim_backend")
    circles = _circles(edges)
    message = "\n".join(f"circle of {len(c)}: {', '.join(c)}\n    e.g. {_one_cycle(edges, c, g)}" for c in circles)
    assert circles == [], ("import circles (a module that needs one of them can be moved below both, or the shape "
                       "it needs named by a Protocol):\n" + message)


def test_circle_check_counts_imports_in_functions_and_under_type_checking(tmp_path, monkeypatch):
    """The check above sees a circle made by an import inside a function and one made by an import under
    TYPE_CHECKING, and none in a package whose __init__ imports its own submodules."""
    pkg = tmp_path / "circlepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a, c\n", encoding="utf-8")
    (pkg / "a.py").write_text("from . import b\n", encoding="utf-8")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n", encoding="utf-8")
    (pkg / "c.py").write_text("from . import d\n", encoding="utf-8")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import X\n",
                              encoding="utf-8")
    (pkg / "e.py").write_text("from circlepkg import a\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    edges, g = _import_graph("circlepkg")
    assert _circles(edges) == [["circlepkg.a", "circlepkg.b"], ["circlepkg.c", "circlepkg.d"]]
    assert _one_cycle(edges, ["circlepkg.a", "circlepkg.b"], g) == "circlepkg.a:1 -> circlepkg.b:2 -> circlepkg.a"


def test_no_module_over_800_lines():
    """Every module of the console and the simulator stays in parts a reader can hold: none over 800 lines
    (a module that grows past it is split by responsibility, not by count)."""
    long = {str(py.relative_to(ROOT)): n for pkg in ("calconsole", "sim_backend") for py in (ROOT / pkg).rglob("*.py")
            if (n := len(py.read_text(encoding="utf-8").splitlines())) > 800}
    assert long == {}


#: The per-module flags `mypy --strict` turns on: an override setting any of them to false relaxes strictness.
_STRICT_FLAGS = ("warn_unused_configs", "disallow_any_generics", "disallow_subclassing_any", "disallow_untyped_calls",
                 "disallow_untyped_defs", "disallow_incomplete_defs", "check_untyped_defs",
                 "disallow_untyped_decorators", "warn_redundant_casts", "warn_unused_ignores", "warn_return_any",
                 "no_implicit_reexport", "strict_equality", "extra_checks")
#: Packages without type information whose imports mypy may take as Any (pyproject says why).
_UNTYPED_PACKAGES = {"aiofiles", "aiofiles.*", "llvmlite", "llvmlite.*", "plotext", "plotext.*", "scipy", "scipy.*",
                     "threadpoolctl", "xllamacpp", "xllamacpp.*"}
#: numba's unannotated code-generation helpers that the kernels' intrinsics may call.
_UNTYPED_CALLS_ALLOWED = ["numba.core.cgutils", "numba.core.base"]


def _mypy_config() -> dict[str, Any]:
    import tomllib

    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mypy"])


def test_mypy_config_is_strict_on_the_whole_tree():
    """What CI's ``mypy`` checks is ``mypy --strict`` on both packages, no module excepted: ``strict = true``,
    no strict flag turned off, nothing excluded or silenced; the overrides only let the imports of the named
    untyped packages be Any, and untyped calls are allowed only into numba's code-generation helpers. So a
    relaxed module or package cannot be added without this test failing."""
    cfg = _mypy_config()
    assert cfg["strict"] is True
    assert sorted(cfg["files"]) == ["calconsole", "sim_backend"]
    for key in ("exclude", "ignore_errors", "disable_error_code", "follow_imports", "ignore_missing_imports",
                "allow_untyped_globals", "allow_redefinition", "implicit_reexport", "always_true"):
        assert key not in cfg, key
    assert [f for f in _STRICT_FLAGS if cfg.get(f, True) is not True] == []
    assert cfg.get("untyped_calls_exclude", []) == _UNTYPED_CALLS_ALLOWED
    overrides = cfg.get("overrides", [])
    for o in overrides:
        modules = {o["module"]} if isinstance(o["module"], str) else set(o["module"])
        assert set(o) == {"module", "ignore_missing_imports"} and o["ignore_missing_imports"] is True, o
        assert modules <= _UNTYPED_PACKAGES, modules - _UNTYPED_PACKAGES
    assert not any(m.split(".")[0] in ("calconsole", "sim_backend") for m in _UNTYPED_PACKAGES)


def test_every_type_ignore_names_its_error_code():
    """No blanket ``# type: ignore`` in the packages: each names the one error it accepts (and
    ``warn_unused_ignores`` fails the check when that error is gone)."""
    bare = re.compile(r"#\s*type:\s*ignore(?!\[)")
    found = [f"{py.relative_to(ROOT)}:{i}" for pkg in ("calconsole", "sim_backend") for py in (ROOT / pkg).rglob("*.py")
             for i, line in enumerate(py.read_text(encoding="utf-8").splitlines(), 1) if bare.search(line)]
    assert found == []
