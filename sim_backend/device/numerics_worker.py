"""The numerics in a separate process, so they do not compete with the UI for the GIL.

The 48-layer numerics are thousands of small numpy calls per token that
hold the GIL; in the console they share one interpreter with Textual's
rendering and the engine, and real-time pacing fell behind (about 0.75x
on 2 cores). Here the ``ShardedModel`` (weights and per-chip KV cache)
lives in a spawned worker process; the device thread sends it one step at
a time over a pipe and gets the last token's logits back, as the D2H dtype
(BF16 bits; float32 for an F32 C3 calbin), in a buffer both processes share
(one 303,872 B copy out instead of pickling them through a 64 KiB pipe:
0.35 -> 0.08 ms of this process's CPU a step).
Given the board's cost model, the worker also prices the step
(``forward_priced``) and sends the ``StepCost`` with the logits, so the
console's process does no per-step numeric work at all: its device thread
only waits on the pipe, paces and hands the result on.

Same code, same weights, single-threaded BLAS: results are identical to
the in-process model. Every call is bounded by a timeout and ends in a
typed ``DeviceError`` if the worker dies or hangs.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sim_backend.bundle.shapes import ModelShape, NumericShape
from sim_backend.errors import DeviceError
from sim_backend.model.costmodel import CostModel
from sim_backend.model.families.moe_cost import priced_experts_touched
from sim_backend.model.logits import NUMPY_DTYPES
from sim_backend.model.numerics import StepNumerics
from sim_backend.model.stepcost import StepCost

#: Bound on the worker's start (host wall s): the synthetic weights take ~1.5 s, the pilot's GGUF ~6 s of
#: CPU; a first start after install also compiles the kernels (~15 s of CPU on a quiet 2-core host, ~70 s
#: wall measured with 18 runnable jobs beside it).
START_TIMEOUT_S = 300.0
CONTROL_TIMEOUT_S = 30.0
#: How much lower than its parent the worker runs (``nice`` steps, Linux/Unix). The CPU-bound worker also
#: runs as ``SCHED_BATCH`` where the OS has it (Linux): it never preempts the UI when it wakes, while a key
#: that wakes the UI still preempts it. +5 gave the worker 1/4 of the CPU beside one busy process of the
#: same session (weights 335 vs 1024: Linux groups a session's processes, so nice counts within the
#: session) and it fell ever further behind; +2 (weight 655) keeps it at about 2/5 there, and the UI, at
#: 1.6x the worker's weight and never preempted by it, still gets the CPU first.
WORKER_NICE = 2


def lower_priority(steps: int = WORKER_NICE) -> int | None:
    """Lower this process's scheduling priority by ``steps`` nice levels (at most to 19), for every thread
    it runs now (Linux keeps nice and policy per thread: ``/proc/self/task``; threads started later
    inherit the caller's), and make it ``SCHED_BATCH`` where the OS has it (see ``WORKER_NICE``).
    Returns the new nice value, or None where the OS has no nice. Never raises: a priority it may not
    set stays as it was.
    """
    import os

    if not hasattr(os, "nice"):
        return None
    try:
        target = min(19, os.nice(0) + max(0, steps))
    except OSError:
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        try:
            if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_BATCH"):
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, target)  # PRIO_PROCESS with a thread id: that thread
        except OSError:
            pass
    return os.nice(0)


def price_numeric_step(cost_model: CostModel, shape: ModelShape, kind: str, n_tokens: int, past_len: int,
                       router_touched: Sequence[int] | None, chip_scale: list[float] | None) -> StepCost:
    """How the board prices a batch-1 step, here or in the worker (one definition for both).

    ``router_touched``: the router's distinct experts per layer (numeric step), priced at a trained
    router's mean (``priced_experts_touched``); None (timing-only): the cost model's expectation.
    ``chip_scale``: per-chip slow factors or None. Returns ``cost_model.price_step(...)``
    (simulated µs); raises its ValueError.
    """
    priced = priced_experts_touched(router_touched, n_tokens, shape.n_experts,
                                    shape.n_experts_active) if router_touched else None
    return cost_model.price_step(shape, kind, n_tokens, past_len, experts_touched=priced, chip_scale=chip_scale)


def _serve(conn: Any, shape: ModelShape, num: NumericShape, n_cells: int, cost_model: CostModel | None,
           shared_logits: Any, source: Any = None) -> None:
    """Worker main loop: build the model, then answer (op, args) requests until "close".

    A step's D2H logits go into ``shared_logits`` ((vocab,) in ``shape.logits_dtype``: uint16 BF16
    bits, or float32 for an F32 calbin; shared with the parent) and the answer carries None in their
    place; the parent reads the buffer only after the answer,
    and the worker writes it only while answering a call, so they never overlap.
    """
    # sim_backend/__init__ pins BLAS to one thread before numpy loads
    from sim_backend.model.families import build_numerics, weights_stage

    try:
        note = weights_stage(shape, num)
        if note is not None:
            conn.send((None, ("say", note)))
        model = build_numerics(shape, num, n_cells, source=source)
    except Exception as e:  # noqa: BLE001 - weights that do not load: a typed start failure
        conn.send((False, f"loading the weights failed: {type(e).__name__}: {e}"))
        return
    shared = np.frombuffer(shared_logits, dtype=NUMPY_DTYPES[shape.logits_dtype])
    # compile the kernels (or load them from the disk cache) before answering; a stage that compiles is
    # announced (from whichever thread compiles it, hence the lock) so that the parent can show it
    try:
        if hasattr(model, "warm_up"):  # a family with compiled kernels
            send_lock = threading.Lock()

            def compiling(i: int, n: int, stage: str) -> None:
                with send_lock:
                    conn.send((None, ("stage", i, n, stage)))

            model.warm_up(compiling)
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile: a typed start failure
        conn.send((False, f"compiling the numerics kernels failed: {type(e).__name__}: {e}"))
        return
    # steps run below the UI's priority; the start (weights, compiling) does not, nothing else runs yet.
    # Linux keeps nice per thread: every thread there is now is lowered, and the warm-up's chip thread is
    # stopped anyway (the next prefill starts one that inherits the lowered value)
    if hasattr(model, "close"):
        model.close()
    lower_priority()

    def logits(out: StepNumerics) -> np.ndarray | None:
        # converted where the logits are made: what the device returns (D2H, BF16 or F32 as the calbin says)
        bits = out.device_logits(shape.logits_dtype)
        if bits.shape != shared.shape:
            return bits  # never for this model (vocab logits); the pipe still carries them correctly
        shared[:] = bits
        return None

    conn.send((True, "ready"))
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return  # parent went away
        try:
            if op == "forward":
                out = model.forward(*args)
                conn.send((True, (logits(out), out.experts_touched)))
            elif op == "forward_priced":
                if cost_model is None:
                    raise ValueError("this worker was started without a cost model")
                *step, kind, past_len, chip_scale = args
                out = model.forward(*step)
                cost = price_numeric_step(cost_model, shape, kind, int(step[0].shape[0]), past_len,
                                          tuple(int(v) for v in out.experts_touched), chip_scale)
                conn.send((True, (logits(out), out.experts_touched, cost.to_wire())))
            elif op == "clear_kv":
                model.clear_kv()
                conn.send((True, None))
            elif op == "kv_layout":
                conn.send((True, model.kv_layout()))
            elif op == "kv_take":
                conn.send((True, model.kv_take(*args)))
            elif op == "kv_put":
                model.kv_put(*args)
                conn.send((True, None))
            elif op == "close":
                conn.send((True, None))
                return
            else:
                conn.send((False, f"unknown op {op!r}"))
        except Exception as e:  # noqa: BLE001 - report to the caller as a typed device error
            conn.send((False, f"{type(e).__name__}: {e}"))


_MAIN_LOCK = threading.Lock()


class _main_not_rerun:
    """While a worker is spawned: ``__main__`` without the path of the script that started this process.

    ``spawn`` re-runs the parent's main script in the child (as ``__mp_main__``) when that script was run by
    its path, as the ``calconsole`` console script is. The worker needs nothing from it (its target lives
    in this module), and a script replaced or removed since (calconsole reinstalled while ``serve`` runs)
    made every worker start fail: ``FileNotFoundError`` and a traceback on the server's stderr, then a
    reload that failed with "connection lost during start". A main module imported by name (``python -m``)
    is left as it is: the child imports it by name.
    """

    def __enter__(self) -> None:
        import sys
        import types

        _MAIN_LOCK.acquire()
        self._saved = sys.modules.get("__main__")
        if self._saved is not None and getattr(self._saved, "__spec__", None) is None \
                and getattr(self._saved, "__file__", None):
            sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__: nothing to re-run

    def __exit__(self, *exc: object) -> None:
        import sys

        try:
            if self._saved is not None:
                sys.modules["__main__"] = self._saved
        finally:
            _MAIN_LOCK.release()


class NumericsProcess:
    """``ShardedModel``-compatible front (``forward``, ``clear_kv``, ``close``) for a worker process.

    Args:
        shape, num: model shapes (as for ShardedModel).
        n_cells: KV cells per chip.
        step_timeout_s: bound on one ``forward`` (host wall seconds).
        cost_model: the board's cost model; a copy goes to the worker so that
            ``forward_priced`` prices there (None: only ``forward``; ``prices_steps`` False).
        progress: told one line per compile stage (a first start after install), and, in a background
            start that compiled, one line when the kernels are ready.
        wait: True waits here for the worker's start (weights, kernels); False returns at once and a
            thread waits for it: ``ready`` says when it answers, and every call waits for the start
            first (a console starts serving at once and runs requests timing-only meanwhile).
    Raises:
        DeviceError: the worker failed to start (``wait``; in a background start the worker is then
            ``broken`` and ``start_error`` says why), died, or did not answer in time.
    """

    def __init__(self, shape: ModelShape, num: NumericShape, n_cells: int, *, step_timeout_s: float = 300.0,
                 cost_model: CostModel | None = None, progress: Callable[[str], None] | None = None,
                 wait: bool = True) -> None:
        self.step_timeout_s = step_timeout_s
        self._cost_model = cost_model
        self._shape = shape
        ctx = mp.get_context("spawn")  # never fork a process that runs threads
        self._conn, child = ctx.Pipe()
        # the logits buffer both processes map (lock-free: the call protocol keeps them apart)
        dtype = NUMPY_DTYPES[shape.logits_dtype]
        shared = ctx.RawArray(ctypes.c_uint8, shape.logits_bytes_per_token)
        self._shared_logits = np.frombuffer(memoryview(shared).cast("B"), dtype=dtype)
        # the weights' file table from this process's parse (the pilot's GGUF): the worker maps it, no second parse
        from sim_backend.model.families import weights_source

        source = weights_source(shape, num)
        self._proc = ctx.Process(target=_serve, args=(child, shape, num, n_cells, cost_model, shared, source),
                                 name="calconsole-numerics", daemon=True)
        try:
            with _main_not_rerun():
                self._proc.start()
        except OSError as e:  # the interpreter to spawn is gone (a venv removed or rebuilt while this runs)
            child.close()
            self._conn.close()
            raise DeviceError(f"numerics worker could not be started: {type(e).__name__}: {e}") from None
        child.close()
        self._lock = threading.Lock()
        self._broken: str | None = None
        self._progress = progress
        self._compiled_stages = 0
        self._ready = threading.Event()
        self.start_error: str | None = None
        self.nice: int | None = None
        if wait:
            self._start()
        else:
            self._lock.acquire()  # held by the start thread until the worker answers: calls wait behind it
            threading.Thread(target=self._start_in_background, name="calconsole-numerics-start", daemon=True).start()

    def _start(self) -> None:
        with self._lock:
            self._recv("start", START_TIMEOUT_S)
        self.nice = self._nice_of_child()
        self._ready.set()

    def _start_in_background(self) -> None:
        import time

        t0 = time.perf_counter()
        try:
            self._recv("start", START_TIMEOUT_S)
            self.nice = self._nice_of_child()
            self._ready.set()
        except DeviceError as e:
            self.start_error = str(e)
            self._broken = self._broken or f"failed to start ({e})"
        finally:
            self._lock.release()
        if self._progress is not None and (self._compiled_stages or self.start_error):
            self._progress(f"numerics kernels ready after {time.perf_counter() - t0:.0f} s: new requests run "
                           "the numerics" if self.start_error is None else
                           f"numerics did not start: {self.start_error}; requests run timing-only")

    @property
    def ready(self) -> bool:
        """True once the worker has started (weights built, kernels compiled or loaded) and answers."""
        return self._ready.is_set()

    def _nice_of_child(self) -> int | None:
        """The worker's nice value as the OS reports it (None if unknown)."""
        try:
            import psutil

            return int(psutil.Process(self._proc.pid).nice())
        except Exception:  # noqa: BLE001 - informational only (gone, or no permission)
            return None

    def cpu_seconds(self) -> float | None:
        """CPU seconds the worker process has used so far (all its threads), or None if it cannot be read.

        On Linux from each thread's ``/proc/<pid>/task/<tid>/schedstat`` (time on a CPU, ns resolution);
        elsewhere psutil's user + system, which counts in clock ticks (10 ms): a few short steps could read 0."""
        ns = _schedstat_ns(self._proc.pid)
        if ns is not None:
            return ns / 1e9
        try:
            import psutil

            t = psutil.Process(self._proc.pid).cpu_times()
            return float(t.user + t.system)
        except Exception:  # noqa: BLE001 - a dead worker reads as unknown; its calls raise DeviceError
            return None

    @property
    def broken(self) -> bool:
        """True once a call timed out, the worker died or failed to start: its pipe may hold a late answer,
        so it is never used again (the device reports a fault; reset or reload starts a new worker)."""
        return self._broken is not None or not self._proc.is_alive()

    def _recv(self, op: str, timeout: float) -> Any:
        import time

        deadline = time.monotonic() + timeout
        while True:
            ok, payload = self._recv_one(op, max(0.0, deadline - time.monotonic()), timeout)
            if ok is not None:
                break
            if payload[0] != "say":
                self._compiled_stages += 1  # a kernel stage compiled (a background start says when it is ready)
            if self._progress is None:
                continue
            if payload[0] == "say":  # a start stage said as it is (building the weights: ``weights_stage``)
                self._progress(payload[1])
                continue
            # a start stage (i, n, name) that is compiling (the worker says so only then: ``warm_up``)
            _, i, n, stage = payload
            self._progress(f"compiling numerics kernels, {i}/{n}: {stage} (first start after install; "
                           "later starts load them from the disk cache)")
        if not ok:
            raise DeviceError(f"numerics process failed in {op}: {payload}")
        return payload

    def _recv_one(self, op: str, wait: float, timeout: float) -> tuple[bool | None, Any]:
        if not self._conn.poll(wait):
            alive = self._proc.is_alive()
            self._broken = f"{'did not answer' if alive else 'died'} during {op}"
            if alive:
                self._proc.terminate()  # a late reply must never be read as the answer to a later call
            raise DeviceError(f"numerics process {self._broken} (waited {timeout:g} s)")
        try:
            reply: tuple[bool | None, Any] = self._conn.recv()  # (ok, payload); ok None: a progress line
            return reply
        except (EOFError, OSError) as e:
            self._broken = f"connection lost during {op}"
            self._proc.join(1.0)  # the worker ended (EOF): its exit code says how
            code = self._proc.exitcode
            how = (f"the worker exited with code {code}" if code is not None and code >= 0 else
                   f"the worker was killed by signal {-code}" if code is not None else
                   f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            if op == "start":
                how += " before it had started (see its lines on stderr, if any)"
            raise DeviceError(f"numerics process connection lost during {op}: {how}") from None

    def _call(self, op: str, args: tuple[Any, ...], timeout: float, lock_wait: float = -1) -> Any:
        """Send ``op`` and wait up to ``timeout`` host s for its answer. ``lock_wait``: host s to wait for a
        call in flight to end (-1: as long as it takes, which its own timeout bounds); DeviceError past it."""
        if not self._lock.acquire(timeout=lock_wait):
            raise DeviceError(f"numerics process busy: a call was still running after {lock_wait:g} s ({op})")
        try:
            if self.broken:
                raise DeviceError(f"numerics process unusable ({self._broken or 'died'}): reset or reload the model")
            try:
                self._conn.send((op, args))
            except (BrokenPipeError, OSError) as e:
                self._broken = f"gone ({op})"
                raise DeviceError(f"numerics process is gone ({op}): {e}") from None
            return self._recv(op, timeout)
        finally:
            self._lock.release()

    def forward(self, tokens: np.ndarray, positions: np.ndarray, new_cells: np.ndarray, ctx_cells: np.ndarray,
                ctx_positions: np.ndarray) -> StepNumerics:
        """One step in the worker; as ``ShardedModel.forward``, but only the D2H logits come back.

        Returns StepNumerics with the logits in the shape's ``logits_dtype``: BF16 -> ``logits`` None and
        ``logits_bf16`` uint16 (vocab,) set (the bits ``ShardedModel.forward(...).bf16()`` gives); F32 ->
        ``logits`` float32 (vocab,). Raises DeviceError.
        """
        bits, touched = self._call("forward", (tokens, positions, new_cells, ctx_cells, ctx_positions),
                                   self.step_timeout_s)
        return self._numerics(bits, touched)

    @property
    def prices_steps(self) -> bool:
        """True when the worker has the cost model (``forward_priced`` works)."""
        return self._cost_model is not None

    def forward_priced(self, tokens: np.ndarray, positions: np.ndarray, new_cells: np.ndarray,
                       ctx_cells: np.ndarray, ctx_positions: np.ndarray, *, kind: str, past_len: int,
                       chip_scale: list[float] | None) -> tuple[StepNumerics, StepCost]:
        """``forward`` plus the worker pricing the step (``price_numeric_step`` with this step's
        router counts and the shape the worker was started with): the very StepCost the board
        would compute (same code, same float64 arithmetic), with the graph of this process's cost
        model attached.
        Raises DeviceError (a pricing ValueError included).
        """
        if self._cost_model is None:
            raise DeviceError("numerics process started without a cost model: it cannot price steps")
        bits, touched, wire = self._call(
            "forward_priced", (tokens, positions, new_cells, ctx_cells, ctx_positions, kind, past_len, chip_scale),
            self.step_timeout_s)
        cost = StepCost.from_wire(wire, self._cost_model.graph(self._shape, kind))
        return self._numerics(bits, touched), cost

    def _numerics(self, bits: np.ndarray | None, touched: Sequence[int]) -> StepNumerics:
        # the shared buffer is overwritten by the next step: the result gets its own copy
        own = self._shared_logits.copy() if bits is None else bits
        if self._shape.logits_dtype == "f32":
            return StepNumerics(logits=own, experts_touched=list(touched))
        return StepNumerics(logits=None, experts_touched=list(touched), logits_bf16=own)

    def clear_kv(self) -> None:
        self._call("clear_kv", (), CONTROL_TIMEOUT_S)

    # the KV cache by cell (``device.kv_state.KVValueStore``): a slot's saved state, through the pipe
    def kv_layout(self) -> list[tuple[tuple[int, ...], str, int]]:
        """(shape, dtype string, cell axis) of the worker model's KV arrays. DeviceError."""
        return list(self._call("kv_layout", (), CONTROL_TIMEOUT_S))

    def kv_take(self, cells: np.ndarray) -> list[np.ndarray]:
        """The worker's KV rows at ``cells`` (~24 KiB a cell for Qwen3 at the shipped width). DeviceError."""
        return list(self._call("kv_take", (np.asarray(cells, dtype=np.int64),), self.step_timeout_s))

    def kv_put(self, cells: np.ndarray, rows: Sequence[np.ndarray]) -> None:
        """Write KV rows at ``cells`` in the worker. DeviceError."""
        self._call("kv_put", (np.asarray(cells, dtype=np.int64), list(rows)), self.step_timeout_s)

    def close(self) -> None:
        """Stop the worker, bounded at ~9 s wall: ask it (0.5 s for a call in flight to end, 2 s for the
        answer, 2 s to exit), then ``_stop``. During a background start: ``_stop`` at once (the start thread
        then ends on the lost connection)."""
        if not self._ready.is_set() and self.start_error is None:
            self._broken = self._broken or "closed during its start"
            self._stop()
            return  # the start thread still polls the pipe: it is closed with this object
        if not self.broken:
            try:  # a forward in flight (or hung: SIGSTOP, a stuck host) is not waited out: ended below
                self._call("close", (), 2.0, lock_wait=0.5)
                self._proc.join(timeout=2.0)
            except DeviceError:
                pass
        self._stop()
        self._conn.close()

    def _stop(self) -> None:
        """End the worker process, bounded at ~4 s wall: SIGTERM, then SIGKILL if it is still there after 2 s
        (the worker runs niced: on a busy host its exit may not get the CPU to finish within 2 s, CI saw it
        alive after SIGTERM and a 2 s join). It may still be ending when this returns: the OS reaps it."""
        if not self._proc.is_alive():
            self._proc.join(timeout=0.1)
            return
        self._proc.terminate()
        self._proc.join(timeout=2.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=2.0)


def _schedstat_ns(pid: int | None) -> int | None:
    """Nanoseconds on a CPU of every thread of process ``pid`` so far (Linux ``schedstat``); None where there is
    no such file (another system, or the process is gone). A thread's time leaves the sum when it ends: the
    worker's threads live as long as it does."""
    if pid is None:
        return None
    total, found = 0, False
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
                found = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total if found else None
