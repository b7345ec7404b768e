"""The numerics in a separate process, so they do not compete with the UI for the GIL.

The 48-layer numerics are thousands of small numpy calls per token that
hold the GIL; in the console they share one interpreter with Textual's
rendering and the engine, and real-time pacing fell behind (about 0.75x
on 2 cores). Here the ``ShardedModel`` (weights and per-chip KV cache)
lives in a spawned worker process; the device thread sends it one step at
a time over a pipe and gets the last token's logits back, as BF16 bits.

Same code, same weights, single-threaded BLAS: results are identical to
the in-process model. Every call is bounded by a timeout and ends in a
typed ``DeviceError`` if the worker dies or hangs.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import numpy as np

from sim_backend.bundle.shapes import ModelShape, NumericShape
from sim_backend.errors import DeviceError
from sim_backend.model.numerics import StepNumerics

START_TIMEOUT_S = 120.0  # building the synthetic weights takes ~1.5 s; generous for loaded machines
CONTROL_TIMEOUT_S = 30.0


def _serve(conn: Any, shape: ModelShape, num: NumericShape, n_cells: int) -> None:
    """Worker main loop: build the model, then answer (op, args) requests until "close"."""
    # sim_backend/__init__ pins BLAS to one thread before numpy loads
    from sim_backend.model.numerics import ShardedModel

    model = ShardedModel(shape, num, n_cells=n_cells)
    conn.send((True, "ready"))
    while True:
        try:
            op, args = conn.recv()
        except EOFError:
            return  # parent went away
        try:
            if op == "forward":
                out = model.forward(*args)
                # BF16 where the logits are made: the device only returns BF16, and it is half the pipe bytes
                conn.send((True, (out.bf16(), out.experts_touched)))
            elif op == "clear_kv":
                model.clear_kv()
                conn.send((True, None))
            elif op == "close":
                conn.send((True, None))
                return
            else:
                conn.send((False, f"unknown op {op!r}"))
        except Exception as e:  # noqa: BLE001 - report to the caller as a typed device error
            conn.send((False, f"{type(e).__name__}: {e}"))


class NumericsProcess:
    """``ShardedModel``-compatible front (``forward``, ``clear_kv``, ``close``) for a worker process.

    Args:
        shape, num: model shapes (as for ShardedModel).
        n_cells: KV cells per chip.
        step_timeout_s: bound on one ``forward`` (host wall seconds).
    Raises:
        DeviceError: the worker failed to start, died, or did not answer in time.
    """

    def __init__(self, shape: ModelShape, num: NumericShape, n_cells: int, *, step_timeout_s: float = 300.0) -> None:
        self.step_timeout_s = step_timeout_s
        ctx = mp.get_context("spawn")  # never fork a process that runs threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, shape, num, n_cells), name="calconsole-numerics",
                                 daemon=True)
        self._proc.start()
        child.close()
        self._lock = threading.Lock()
        self._broken: str | None = None
        with self._lock:
            self._recv("start", START_TIMEOUT_S)

    @property
    def broken(self) -> bool:
        """True once a call timed out or the worker died: its pipe may hold a late answer, so it is
        never used again (the device reports a fault; reset or reload starts a new worker)."""
        return self._broken is not None or not self._proc.is_alive()

    def _recv(self, op: str, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            alive = self._proc.is_alive()
            self._broken = f"{'did not answer' if alive else 'died'} during {op}"
            if alive:
                self._proc.terminate()  # a late reply must never be read as the answer to a later call
            raise DeviceError(f"numerics process {self._broken} (waited {timeout:.0f} s)")
        try:
            ok, payload = self._conn.recv()
        except (EOFError, OSError) as e:
            self._broken = f"connection lost during {op}"
            raise DeviceError(f"numerics process connection lost during {op}: {e}") from None
        if not ok:
            raise DeviceError(f"numerics process failed in {op}: {payload}")
        return payload

    def _call(self, op: str, args: tuple, timeout: float) -> Any:
        with self._lock:
            if self.broken:
                raise DeviceError(f"numerics process unusable ({self._broken or 'died'}): reset or reload the model")
            try:
                self._conn.send((op, args))
            except (BrokenPipeError, OSError) as e:
                self._broken = f"gone ({op})"
                raise DeviceError(f"numerics process is gone ({op}): {e}") from None
            return self._recv(op, timeout)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, new_cells: np.ndarray, ctx_cells: np.ndarray,
                ctx_positions: np.ndarray) -> StepNumerics:
        """One step in the worker; as ``ShardedModel.forward``, but only the BF16 logits come back.

        Returns StepNumerics with ``logits`` None and ``logits_bf16`` uint16 (vocab,) set
        (the bits ``ShardedModel.forward(...).bf16()`` gives). Raises DeviceError.
        """
        bits, touched = self._call("forward", (tokens, positions, new_cells, ctx_cells, ctx_positions),
                                   self.step_timeout_s)
        return StepNumerics(logits=None, experts_touched=list(touched), logits_bf16=bits)

    def clear_kv(self) -> None:
        self._call("clear_kv", (), CONTROL_TIMEOUT_S)

    def close(self) -> None:
        """Stop the worker (bounded): ask, then terminate."""
        if not self.broken:
            try:
                self._call("close", (), 2.0)
            except DeviceError:
                pass
        self._proc.join(timeout=2.0)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout=2.0)
        self._conn.close()
