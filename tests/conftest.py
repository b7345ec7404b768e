"""Shared fixtures: the simulator bundle and a factory for whole systems.

``make_system(**kw)`` is ``build_system(**kw)`` with FAST pacing and an audit log under the
test's temporary directory unless ``kw`` says otherwise; every system it built is closed at
teardown. ``make_module_system`` is the same for module-scoped fixtures (one directory per
module). The first system of a scope logs to ``<dir>/audit.jsonl``, later ones to
``audit-2.jsonl``, ``audit-3.jsonl``... so two systems never share a log.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sim_backend.bundle.manifest import Bundle, load_bundle
from sim_backend.compose import System, build_system
from sim_backend.device.clock import Pacing, PacingMode


class SystemFactory:
    """Builds systems for one fixture scope and closes them all at its end."""

    def __init__(self, audit_dir: Path) -> None:
        self.audit_dir = audit_dir
        self.systems: list[System] = []

    def __call__(self, **kw: Any) -> System:
        kw.setdefault("pacing", Pacing(PacingMode.FAST))
        if "audit_path" not in kw:
            n = len(self.systems) + 1
            kw["audit_path"] = self.audit_dir / ("audit.jsonl" if n == 1 else f"audit-{n}.jsonl")
        system = build_system(**kw)
        self.systems.append(system)
        return system

    def close_all(self) -> None:
        while self.systems:
            self.systems.pop().close()


_SAVED_CA_ENV: dict[str, str | None] = {}


def pytest_configure(config: pytest.Config) -> None:
    """No CA bundle for the tests' HTTP clients: every test talks plain http to 127.0.0.1 only.

    Each ``httpx.Client`` (so each ``httpx.get`` / ``httpx.post``, each OpenAI SDK client, each attached
    console's connection) builds an SSL context, and with ``SSL_CERT_FILE`` (or certifi's bundle) that
    parses ~150 CA certificates: 62-68 ms CPU a client on the 2-core test host, ~1 ms with an empty
    ``SSL_CERT_DIR`` (httpx reads it when ``trust_env`` is on, its default). The tests create thousands.
    Set for this process and the CLI subprocesses it starts; restored at the end of the run.
    """
    import os
    import tempfile

    empty = tempfile.mkdtemp(prefix="calconsole-tests-no-ca-")
    for var, value in (("SSL_CERT_FILE", None), ("SSL_CERT_DIR", empty)):
        _SAVED_CA_ENV[var] = os.environ.get(var)
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    _start_kernel_warmer(config)
    _wait_for_warm_kernels()


_WARM_ENV = "CALCONSOLE_TESTS_WARM_LOCKS"


def _start_kernel_warmer(config: pytest.Config) -> None:
    """In the pytest-xdist controller: compile the numerics kernels once, in ``tests/warm_kernels.py``.

    Started before the workers (they are spawned after ``pytest_configure``), it runs beside their start-up
    and first files. It holds one exclusive ``flock`` per kernel family (the MoE model's, the dense pilot's)
    until that family is in numba's cache; the workers learn the lock files from ``CALCONSOLE_TESTS_WARM_LOCKS``
    (the environment they inherit). Nothing without workers (``-n 0``, a single file) or in a worker.
    """
    import fcntl
    import os
    import subprocess
    import sys
    import tempfile

    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        return
    locks = tempfile.mkdtemp(prefix="calconsole-tests-warm-")
    fds = []
    for name in ("moe.lock", "dense.lock"):
        fd = os.open(os.path.join(locks, name), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fds.append(fd)
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    try:
        _WARMER.append(subprocess.Popen([sys.executable, "-m", "tests.warm_kernels", *map(str, fds)], cwd=root,
                                        env=env, pass_fds=fds, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        os.environ[_WARM_ENV] = locks
    finally:
        for fd in fds:
            os.close(fd)  # the warmer's copies hold the locks now (or nobody's, if it did not start)


_WARMER: list[Any] = []


def _wait_for_warm_kernels() -> None:
    """In a worker: the first numba compilation of a kernel waits for the warmer's lock of its family.

    ``Dispatcher._compile_for_args`` is where numba goes for a call with no compiled version in this process
    (it then loads the disk cache or compiles). Waiting there (a shared ``flock``: returns when the warmer has
    closed its exclusive one, at once if it already has) makes the first call of each kernel find what the
    warmer wrote instead of compiling it beside it. One wait per family; a process without the variable
    (no warmer) is left as it is.
    """
    import fcntl
    import os

    locks = os.environ.get(_WARM_ENV)
    if not locks or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from numba.core import dispatcher

    original = dispatcher.Dispatcher._compile_for_args
    waited: set[str] = set()

    def family(d: Any) -> str:
        mod = getattr(getattr(d, "py_func", None), "__module__", "") or ""
        return "dense" if mod.startswith("sim_backend.model.families") else "moe"

    def compile_for_args(self: Any, *args: Any, **kws: Any) -> Any:
        fam = family(self)
        if fam not in waited:
            waited.add(fam)
            try:
                fd = os.open(os.path.join(locks, f"{fam}.lock"), os.O_RDONLY)
            except OSError:
                pass
            else:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH)  # blocks while the warmer compiles this family
                finally:
                    os.close(fd)
        return original(self, *args, **kws)

    dispatcher.Dispatcher._compile_for_args = compile_for_args  # type: ignore[method-assign]


def pytest_unconfigure(config: pytest.Config) -> None:
    import os
    import shutil

    empty = os.environ.get("SSL_CERT_DIR")
    for var, value in _SAVED_CA_ENV.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value
    if empty and os.path.basename(empty).startswith("calconsole-tests-no-ca-"):
        shutil.rmtree(empty, ignore_errors=True)
    locks = None if os.environ.get("PYTEST_XDIST_WORKER") else os.environ.pop(_WARM_ENV, None)
    while _WARMER:
        proc = _WARMER.pop()
        if proc.poll() is None:
            proc.kill()  # a run that ended before the warm-up did (e.g. -x, a collection error)
        proc.wait()
    if locks and os.path.basename(locks).startswith("calconsole-tests-warm-"):
        shutil.rmtree(locks, ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _user_files_in_tmp_for_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Module- and session-scoped fixtures are built before any function-scoped one runs: they too get a
    settings file and a default audit log of their own (a pilot fixture without ``audit_path`` wrote its
    maintenance actions into the operator's real audit log)."""
    base = tmp_path_factory.mktemp("user-files")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CALCONSOLE_CONFIG", str(base / "config.yaml"))
        mp.setenv("CALCONSOLE_AUDIT_LOG", str(base / "audit.jsonl"))
        yield


@pytest.fixture(autouse=True)
def _settings_file_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """The console's settings file and default audit log: never the user's own (CALCONSOLE_CONFIG,
    CALCONSOLE_AUDIT_LOG), and no other CALCONSOLE_* from outside."""
    import os

    for var in [v for v in os.environ if v.startswith("CALCONSOLE_")]:
        monkeypatch.delenv(var)
    d = tmp_path_factory.mktemp("cfg")
    monkeypatch.setenv("CALCONSOLE_CONFIG", str(d / "config.yaml"))
    monkeypatch.setenv("CALCONSOLE_AUDIT_LOG", str(d / "audit.jsonl"))


@pytest.fixture(autouse=True)
def _textual_widget_caches_freed() -> Iterator[None]:
    """After each test, drop what Textual's ``StylesCache.get_inner_outer`` cache keeps of the test's widgets.

    It is an ``lru_cache(1024)`` on a method, so its keys hold the last 1024 ``StylesCache`` objects, one per
    widget, with every rendered line each one caches: ~15-25k objects per console test stay alive after the
    app is gone, ~330k after 30 console tests in one worker (~100k with this), and every full collection of
    the rest of that worker's tests (the console's own ``gc.collect()`` at mount among them) walks them.
    The cache only maps two colours to two styles; clearing it changes no picture.
    """
    yield
    import sys

    styles_cache = sys.modules.get("textual._styles_cache")
    if styles_cache is not None:
        styles_cache.StylesCache.get_inner_outer.cache_clear()


@pytest.fixture
def make_system(tmp_path: Path) -> Iterator[SystemFactory]:
    factory = SystemFactory(tmp_path)
    yield factory
    factory.close_all()


@pytest.fixture(scope="module")
def make_module_system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SystemFactory]:
    factory = SystemFactory(tmp_path_factory.mktemp("audit"))
    yield factory
    factory.close_all()


@pytest.fixture(scope="session")
def bundle() -> Bundle:
    """The shipped simulator bundle (frozen dataclass, safe to share across the session)."""
    return load_bundle()


@pytest.fixture(scope="session")
def llama_server() -> Iterator[Any]:
    """A real llama-server (xllamacpp, SmolLM2-135M Q4_1) on 127.0.0.1, 2 slots, one CPU thread, for the session.

    See ``tests/real/llama_server.py``. Stopped at the end of the session (of the xdist worker).
    """
    from tests.real.llama_server import start_llama_server

    server = start_llama_server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def llama_server_slot_save(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The same real llama-server started with a slot save path (``--slot-save-path``), so its slot
    actions (erase, save, restore) are offered; for the session (of the xdist worker)."""
    from tests.real.llama_server import start_llama_server

    slots_dir = str(tmp_path_factory.mktemp("llama-slots"))
    server = start_llama_server(configure=lambda p: setattr(p, "slot_save_path", slots_dir))
    try:
        yield server
    finally:
        server.stop()
