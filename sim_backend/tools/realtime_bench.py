"""Real-time factor of the numerics, in-process and in the console's worker (``calconsole bench realtime``).

A real-time factor (RTF) is simulated device time / measured host wall time for the same step:
>= 1 means the host computes the step at least as fast as the modelled NPU runs it, so real-time
pacing holds. Steps go straight to a fast-paced ``SimulatedBoard`` (no engine, no sampling): the
wall time is ``submit`` -> result, i.e. the device thread's numerics (in this process, or the
spawned worker plus the pipe), the cost model's pricing and the thread hand-offs.

Simulated times are the cost model's (calibrated to facts.md F7); wall and CPU times are measured here.
"""

from __future__ import annotations

import dis
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sim_backend.bundle.manifest import Bundle, load_bundle
from sim_backend.device.board import SimulatedBoard
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.device.numerics_worker import NumericsProcess
from sim_backend.errors import CalError
from sim_backend.model.costmodel import default_cost_model
from sim_backend.model.numerics import KERNELS_ENV, kernels_choice

BACKENDS = {"in_process": False, "worker": True}
DECODE_CONTEXTS = (128, 1024, 2048, 4096)
PREFILL_LENGTHS = (128, 256, 512, 1024, 2048)
#: KV fill chunk (tokens) used to build a decode context; the engine's default prefill chunk.
FILL_CHUNK = 2048
STEP_TIMEOUT_S = 600.0
#: The worker's bound on one step (host wall s) unless the bench is given another: the console's own
#: (``NumericsProcess``'s default step timeout).
WORKER_STEP_TIMEOUT_S = 300.0
#: A prefill run longer than this (host wall ms) is not repeated (its length reports 1 run).
LONG_RUN_MS = 4000.0


def _tokens(n: int, offset: int = 0, vocab: int = 151_936) -> np.ndarray:
    """Deterministic prompt ids (ordinary text tokens: below Qwen3's special ids, above the pilot's 0..16)."""
    hi = min(150_000, vocab) - 17
    return ((np.arange(offset, offset + n, dtype=np.int64) * 7919 + 101) % hi + 17).astype(np.int64)


def _cpu_s(board: SimulatedBoard) -> float:
    """CPU seconds so far of whichever process runs the numerics: the worker's (all its threads), or this
    process's (the device thread and the prefill's chip thread; the waiting bench thread uses none)."""
    model = board.model
    if isinstance(model, NumericsProcess):
        t = model.cpu_seconds()
        if t is not None:
            return t
    return time.process_time()


class Unfinished(CalError):
    """A measured step that did not finish (the worker's step timeout, or a device error): ``what`` names
    it (e.g. ``"fill KV 2048..4096 (for decode at ctx 4096)"``), ``length`` its token count or context."""

    def __init__(self, what: str, length: int, cause: Exception) -> None:
        super().__init__(f"{what}: {cause}")
        self.what, self.length, self.cause = what, length, cause


def _run(board: SimulatedBoard, kind: str, tokens: np.ndarray, p0: int) -> tuple[float, float, float]:
    """One step on the board at positions/cells [p0, p0+n), context [0, p0+n).
    Returns (host wall ms, simulated ms, CPU ms of the process that ran the numerics).
    Raises CalError (DeviceError: the worker's step timeout; WaitTimeout after ``STEP_TIMEOUT_S``)."""
    n = tokens.shape[0]
    pos = np.arange(p0, p0 + n, dtype=np.int64)
    ctx = np.arange(0, p0 + n, dtype=np.int64)
    c0 = _cpu_s(board)
    t0 = time.perf_counter()
    res = board.submit(kind, 0, tokens, pos, pos.copy(), ctx, ctx.copy()).wait(STEP_TIMEOUT_S)
    wall = (time.perf_counter() - t0) * 1e3
    return wall, res.sim_us / 1e3, (_cpu_s(board) - c0) * 1e3


def count_numpy_calls(fn: Callable[[], Any]) -> int:
    """numpy operations started from Python while ``fn()`` runs in this thread.

    Counts ``sys.setprofile`` ``c_call`` events whose callee belongs to numpy (functions, ufuncs,
    array methods), plus the binary-operator and subscript opcodes executed in the model's and the
    device's own frames (``a * b``, ``a[i] = b``: on arrays each is a numpy call that makes no call
    event; the few on Python ints there are counted too, so this slightly over-counts).
    """
    n = 0

    def prof(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event != "c_call":
            return
        if isinstance(arg, np.ufunc):
            n += 1
            return
        mod = getattr(arg, "__module__", None) or ""
        owner = getattr(arg, "__self__", None)
        if mod.startswith("numpy") or isinstance(owner, (np.ndarray, np.generic)) or (
                isinstance(owner, type(np)) and owner.__name__.startswith("numpy")):
            n += 1

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal n
        if event == "call":
            if not any(d in frame.f_code.co_filename for d in _OWN_DIRS):
                return None
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return trace
        if event == "opcode" and frame.f_code.co_code[frame.f_lasti] in _ARRAY_OPS:
            n += 1
        return trace

    sys.setprofile(prof)
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return n


_OWN_DIRS = ("sim_backend/model/", "sim_backend/device/")
_ARRAY_OPS = frozenset(dis.opmap[o] for o in ("BINARY_OP", "BINARY_SUBSCR", "STORE_SUBSCR", "UNARY_NEGATIVE")
                       if o in dis.opmap)


def _decode_work_calls(board: SimulatedBoard, context: int) -> int:
    """numpy calls this process makes for one decode step's device work, run on this thread the way
    the device thread runs it: numerics + BF16 + pricing in-process; with the worker (which computes
    and prices the step) only the pipe round trip and unpacking the StepCost."""
    model = board.model
    assert model is not None
    tok = _tokens(1, context, board.shape.vocab)
    pos = np.array([context], dtype=np.int64)
    ctx = np.arange(context + 1, dtype=np.int64)

    def work() -> None:
        if isinstance(model, NumericsProcess) and model.prices_steps:  # the worker computes and prices
            out, _ = model.forward_priced(tok, pos, pos.copy(), ctx, ctx.copy(), kind="decode", past_len=context,
                                          chip_scale=None)
            out.bf16()
            return
        out = model.forward(tok, pos, pos.copy(), ctx, ctx.copy())
        out.bf16()
        board.cost_model.price_step(board.shape, "decode", 1, context,
                                    experts_touched=list(out.experts_touched), chip_scale=None)

    work()  # warm (caches, first-call imports)
    return count_numpy_calls(work)


def measure_backend(worker: bool, *, runs: int = 3, decode_steps: int = 16,
                    contexts: Sequence[int] = DECODE_CONTEXTS, prompt_lengths: Sequence[int] = PREFILL_LENGTHS,
                    bundle: Bundle | str | None = None, progress: Callable[[str], None] | None = None,
                    kernels: str = "compiled", step_timeout_s: float | None = None) -> dict[str, Any]:
    """Measure one backend on a fresh board.

    Prefill: each length in ``prompt_lengths`` as one chunk from position 0, ``runs`` times
    (once if a run takes over ``LONG_RUN_MS``; ``prefill_runs`` says how many).
    Decode: at each context in ``contexts`` (KV filled by real prefill chunks first),
    ``runs`` x ``decode_steps`` steps. ``kernels``: ``compiled`` or ``numpy`` (the reference), as
    ``numerics.kernels_choice``. Returns ``{"decode_rtf": {ctx: median RTF}, "decode_wall_ms",
    "decode_sim_ms", "decode_cpu_ms", "decode_cpu_rtf", "prefill_rtf": {n: median RTF}, "prefill_wall_ms",
    "prefill_sim_ms", "prefill_cpu_ms", "prefill_cpu_rtf", "numpy_calls_per_decode_step", "kernels",
    "worker_nice"}`` (keys of the by-size dicts are str for JSON; ``*_wall_ms`` host wall ms medians,
    ``*_cpu_ms`` CPU ms of the process running the numerics, medians (decode: of each run's mean
    per step); ``*_sim_ms`` simulated device ms;
    a CPU RTF is simulated / CPU time: what the step costs the host whatever else runs beside it).
    ``step_timeout_s``: the worker's bound on one measured step (host wall s; None: the console's,
    ``WORKER_STEP_TIMEOUT_S``; the warm-up step keeps the default); unused in-process.
    A measured step that fails (a long KV fill or prefill over the worker's step timeout on a busy host:
    the worker is then stopped) ends the measurement of this backend: what was measured before it is
    returned, with ``"unfinished": {"what", "length", "error"}`` naming the step (None when all finished);
    ``numpy_calls_per_decode_step`` is then None. Raises CalError if the board or the warm-up step fails,
    ValueError for unknown kernels or a step timeout <= 0.
    """
    if step_timeout_s is not None and not step_timeout_s > 0:
        raise ValueError(f"step timeout must be > 0 s, got {step_timeout_s}")
    say = progress or (lambda _m: None)
    b = bundle if isinstance(bundle, Bundle) else load_bundle(bundle)
    top = max([*contexts, *prompt_lengths]) + 1
    if top > b.context:
        raise CalError(f"largest context {top} exceeds the calbin context {b.context}")
    kernels = kernels_choice(kernels)
    saved = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = kernels  # the board's model (in this process or the spawned worker) reads it
    try:
        board = SimulatedBoard(b, default_cost_model(), numerics=True, pacing=Pacing(PacingMode.FAST),
                               kv_cells=max(top, 8), numerics_process=worker)
    finally:
        if saved is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = saved
    pre_wall: dict[str, float] = {}
    pre_sim: dict[str, float] = {}
    pre_cpu: dict[str, float] = {}
    pre_runs: dict[str, int] = {}
    dec_wall: dict[str, float] = {}
    dec_sim: dict[str, float] = {}
    dec_cpu: dict[str, float] = {}
    unfinished: dict[str, Any] | None = None
    calls: int | None = None
    try:
        _run(board, "prefill", _tokens(8, 0, b.shape.vocab), 0)  # warm up
        nice = getattr(board.model, "nice", None)
        if isinstance(board.model, NumericsProcess):
            board.model.step_timeout_s = WORKER_STEP_TIMEOUT_S if step_timeout_s is None else step_timeout_s
        try:
            _measure_steps(board, b.shape.vocab, runs, decode_steps, contexts, prompt_lengths, say,
                           pre_wall, pre_sim, pre_cpu, pre_runs, dec_wall, dec_sim, dec_cpu)
            calls = _decode_work_calls(board, min(contexts) if contexts else 128)
        except Unfinished as e:
            unfinished = {"what": e.what, "length": e.length, "error": str(e.cause)}
            say(f"{e.what} did not finish: {e.cause}")
    finally:
        board.close()

    def rtf(sim: dict[str, float], host: dict[str, float]) -> dict[str, float]:
        return {k: sim[k] / host[k] if host[k] > 0 else math.inf for k in host}

    return {"decode_rtf": rtf(dec_sim, dec_wall), "decode_wall_ms": dec_wall, "decode_sim_ms": dec_sim,
            "decode_cpu_ms": dec_cpu, "decode_cpu_rtf": rtf(dec_sim, dec_cpu),
            "prefill_rtf": rtf(pre_sim, pre_wall), "prefill_wall_ms": pre_wall, "prefill_sim_ms": pre_sim,
            "prefill_cpu_ms": pre_cpu, "prefill_cpu_rtf": rtf(pre_sim, pre_cpu), "prefill_runs": pre_runs,
            "numpy_calls_per_decode_step": calls, "kernels": kernels, "worker_nice": nice,
            "unfinished": unfinished}


def _measure_steps(board: SimulatedBoard, vocab: int, runs: int, decode_steps: int, contexts: Sequence[int],
                   prompt_lengths: Sequence[int], say: Callable[[str], None], pre_wall: dict[str, float],
                   pre_sim: dict[str, float], pre_cpu: dict[str, float], pre_runs: dict[str, int],
                   dec_wall: dict[str, float], dec_sim: dict[str, float], dec_cpu: dict[str, float]) -> None:
    """The measured steps of :func:`measure_backend`, filling the dicts as each length or context completes
    (a length is recorded only once all its runs finished). Raises Unfinished for the first step that fails."""

    def step(what: str, length: int, kind: str, tokens: np.ndarray, p0: int) -> tuple[float, float, float]:
        try:
            return _run(board, kind, tokens, p0)
        except CalError as e:
            raise Unfinished(what, length, e) from None

    for n in sorted(prompt_lengths):
        say(f"prefill {n}")
        walls, cpus = [], []
        for _ in range(runs):
            w, s, c = step(f"prefill {n} tokens", n, "prefill", _tokens(n, 0, vocab), 0)
            walls.append(w)
            cpus.append(c)
            if w > LONG_RUN_MS:  # one long run says enough; keeps the default sweep within minutes
                break
        pre_wall[str(n)], pre_sim[str(n)] = statistics.median(walls), s
        pre_cpu[str(n)] = statistics.median(cpus)
        pre_runs[str(n)] = len(walls)
    filled = max(prompt_lengths, default=0)  # the prefills wrote real K/V into cells [0, longest)
    for c in sorted(contexts):
        while filled < c:  # real K/V in every context cell (zero pages would read unrealistically fast)
            m = min(FILL_CHUNK, c - filled)
            say(f"fill KV {filled}..{filled + m}")
            step(f"fill KV {filled}..{filled + m} (for decode at ctx {c})", c, "prefill",
                 _tokens(m, filled, vocab), filled)
            filled += m
        say(f"decode at {c}")
        meds, cmeds = [], []
        for _ in range(runs):
            walls = []
            c0 = _cpu_s(board)
            for _ in range(decode_steps):
                # overwrites cell c: same context every step
                w, s, _cpu = step(f"decode at ctx {c}", c, "decode", _tokens(1, c, vocab), c)
                walls.append(w)
            meds.append(statistics.median(walls))
            # CPU per step over the whole run: the worker's CPU time is read in clock ticks (10 ms
            # on Linux), so one step's own difference reads 0, 10 or 20 ms
            cmeds.append((_cpu_s(board) - c0) * 1e3 / decode_steps)
        dec_wall[str(c)], dec_sim[str(c)] = statistics.median(meds), s
        dec_cpu[str(c)] = statistics.median(cmeds)


def numeric_limit(prefill_rtf: dict[str, float]) -> int:
    """Longest measured prompt length whose prefill keeps real time (RTF >= 1) and every shorter one
    does too; 0 if even the shortest falls behind. Never extrapolated past the longest length measured."""
    limit = 0
    for n in sorted(prefill_rtf, key=int):
        r = prefill_rtf[n]
        if not (math.isfinite(r) and r >= 1.0):
            break
        limit = int(n)
    return limit


def measure(*, backends: Sequence[str] = tuple(BACKENDS), runs: int = 3, decode_steps: int = 16,
            contexts: Sequence[int] = DECODE_CONTEXTS, prompt_lengths: Sequence[int] = PREFILL_LENGTHS,
            bundle: Bundle | str | None = None, progress: Callable[[str], None] | None = None,
            kernels: Sequence[str] = ("compiled",), step_timeout_s: float | None = None) -> dict[str, Any]:
    """Both backends side by side in one run, plus the numeric prefill limit they give.

    ``kernels``: which implementations to measure, each under every backend: ``compiled`` (what runs)
    under the backend's own name, ``numpy`` (the reference, the former implementation) as
    ``<backend>:numpy``, so one run gives the before/after figures on the same host and load.
    ``numeric_limit_tokens`` comes from the worker backend with the compiled kernels (what the
    console runs) when measured, else from the first measured. Returns ``{"in_process": {...},
    "worker": {...}, "numeric_limit_tokens", "runs", "decode_steps", "load_average", "units"}``.
    ``step_timeout_s``: the worker's bound on one step (``measure_backend``). A backend whose measurement
    stopped at a step that did not finish keeps what it measured, with its ``unfinished`` step named;
    raises CalError (naming each unfinished step) only if no backend measured anything.
    """
    out: dict[str, Any] = {}

    def tagged(name: str) -> Callable[[str], None] | None:
        if progress is None:
            return None
        report = progress
        return lambda m: report(f"{name}: {m}")

    load0 = os.getloadavg() if hasattr(os, "getloadavg") else None
    for k in kernels:
        kernels_choice(k)
    for name in backends:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r} (one of {', '.join(BACKENDS)})")
    for k in kernels:
        for name in backends:
            key = name if k == "compiled" else f"{name}:{k}"
            out[key] = measure_backend(BACKENDS[name], runs=runs, decode_steps=decode_steps, contexts=contexts,
                                       prompt_lengths=prompt_lengths, bundle=bundle, progress=tagged(key),
                                       kernels=k, step_timeout_s=step_timeout_s)
    measured = [key for key in out if isinstance(out[key], dict)]
    if not any(out[key]["prefill_rtf"] or out[key]["decode_rtf"] for key in measured):
        raise CalError("nothing was measured: " + "; ".join(
            f"{key}: {out[key]['unfinished']['what']} did not finish ({out[key]['unfinished']['error']})"
            for key in measured if out[key]["unfinished"]))
    src = out.get("worker") or out[measured[0]]
    out["numeric_limit_tokens"] = numeric_limit(src["prefill_rtf"])
    out["runs"], out["decode_steps"] = runs, decode_steps
    load1 = os.getloadavg() if hasattr(os, "getloadavg") else None
    # other work on the host slows wall time (and, less, CPU time): the 1-minute load average at start and end
    out["load_average"] = [round(load0[0], 2), round(load1[0], 2)] if load0 and load1 else None
    out["units"] = {"rtf": "simulated device time / host wall time (>= 1 keeps real time)",
                    "cpu_rtf": "simulated device time / CPU time of the process running the numerics",
                    "wall_ms": "host wall ms, median", "sim_ms": "simulated device ms (cost model)",
                    "cpu_ms": "CPU ms of the process running the numerics (all its threads), median",
                    "numpy_calls": "numpy calls in this process per decode step (operators not counted)"}
    return out
