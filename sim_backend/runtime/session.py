"""The inference door of the runtime: the engine's only way to the device.

``RuntimeSession`` binds device + configured calbin + sub-models + buffer pool once, and hands
out the inference-plane subset of the KV manager (``KVView``, no whole-cache clear) and a
read-and-book view of the simulated clock (``ClockView``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from sim_backend.bundle.manifest import Bundle
from sim_backend.device.board import BatchJobRow, JobCounters, SimulatedBoard
from sim_backend.errors import SubmitError
from sim_backend.runtime.buffers import BufferPool
from sim_backend.runtime.calbin import Calbin, OutputBuf
from sim_backend.runtime.calrt import VirtualDevice
from sim_backend.runtime.views import ClockView

# --- the whole submission path, as the engine would use it -----------------------------


def scratch_sequence(n_seq_max: int) -> int:
    """The KV sequence the maintenance runtime keeps for its own jobs (probe, self-test, health check):
    the last of ``n_seq_max``; sequences below it serve requests (``RuntimeSession.serving_sequences``)."""
    return n_seq_max - 1


class RuntimeSession:
    """The facts.md F1 submission path, bound once: device + configured calbin + sub-models + pool.

    ``step()`` does, per job: take a pooled buffer pair, write input, set the
    CSR, submit with a fixed task type, and returns the OutputBuf; the pair
    goes back to the pool when its ``wait()`` ends (result or error).

    Args:
        board: the simulated board.
        parallel: enable parallel mode (ping/pong); pool size 2, else 1.
    """

    def __init__(self, board: SimulatedBoard, *, parallel: bool = False, bundle: Bundle | None = None) -> None:
        self.device = VirtualDevice(board, "PCIE")
        self.device.enable_parallel_mode(parallel)
        self.calbin = Calbin.create(self.device, bundle)
        self.calbin.configure()
        self.submodels = {"prefill": self.calbin.get_submodel("prefill", "llm_prefill"),
                          "decode": self.calbin.get_submodel("decode", "llm_decode")}
        self.pool = BufferPool(self.calbin, 2 if parallel else 1)
        self.kv = self.calbin.kv
        self.clock = ClockView(board.clock)
        self._board = board
        b = bundle or board.bundle
        #: context per sequence in tokens (the calbin's, facts.md F2) and the logits' vocabulary size
        self.context: int = b.context
        self.vocab: int = board.shape.vocab
        #: the bundle the device runs (its model family and tokenizer source)
        self.bundle: Bundle = b
        self.parallel = parallel
        self._rr = 0

    @property
    def serving_sequences(self) -> int:
        """KV sequences the serving engine may use as slots (ids 0..n-1): all but the maintenance scratch one."""
        return scratch_sequence(self._board.kv.n_seq_max)

    @property
    def numerics(self) -> bool:
        """True when the device computes logits (False: timing-only, no logits come back)."""
        return bool(self._board.numerics)

    @property
    def numerics_ready(self) -> bool:
        """True when a numeric step would run now (False while a background start compiles the kernels:
        requests admitted meanwhile run timing-only)."""
        return bool(getattr(self._board, "numerics_ready", self._board.numerics))

    @property
    def numerics_broken(self) -> bool:
        """True after the numerics worker failed to start, died or hung (a reset or reload restarts it)."""
        return bool(getattr(self._board, "numerics_broken", False))

    def kv_values(self) -> Any:
        """The device's K/V values by cell for a sequence-state file (``KVView.save_seq_state`` /
        ``load_seq_state`` ``values=``), or None when the device holds none (timing-only, memory cleared)."""
        return self._board.kv_values()

    def step(self, kind: str, seq_id: int, tokens: Any, positions: Any, cells: Any, *,
             task_type: str = "auto", acquire_timeout: float = 0.0, numeric: bool = True) -> OutputBuf:
        """Submit one prefill/decode step of ``seq_id`` whose new ``cells`` were applied in the KV.

        One token always runs the ``decode`` sub-model, whatever ``kind`` says (facts.md F1: the
        sub-model is chosen by ``n_tokens > 1``); ``kind`` is the caller's stage for its own
        accounting.

        past_kv_cur_seq_len is the sequence's other cells. Raises SubmitError,
        DeviceNotReady, or the errors of ``Calbin.submit_job``; on error the
        buffer pair is back in the pool.
        """
        if kind not in self.submodels:
            raise SubmitError(f"unknown step kind {kind!r} (prefill or decode)")
        pair = self.pool.acquire(acquire_timeout)
        try:
            pair.inp.write(seq_id, tokens, positions, cells)
            n = pair.inp.n_tokens
            ctx = self.kv.seq_cells(seq_id)  # read once: the CSR here, the attention context in the submit
            pair.inp.set_csr(past_kv_cur_seq_len=ctx[0].shape[0] - n, cur_seq_len=n)
            # facts.md F1: the real path picks prefill only if the sequence has n_tokens > 1, else decode,
            # so a leftover 1-token prefill chunk (a 2049-token prompt) runs the decode sub-model
            sub = self.submodels["decode" if n == 1 else kind]
            out = self.calbin._submit(sub, pair.inp, pair.out, task_type=task_type, numeric=numeric, ctx=ctx)
        except BaseException:
            self.pool.release(pair)
            raise
        out._on_end = lambda: self.pool.release(pair)
        return out

    @property
    def decode_batch(self) -> int:
        """Sequences one decode submission may carry: 1 today (facts.md F1), N for a C3 variant calbin."""
        return self.submodels["decode"].batch

    def step_batch(self, rows: Any, *, task_type: str = "auto", acquire_timeout: float = 0.0) -> OutputBuf:
        """Submit one batched decode step: ``rows`` is a list of ``(seq_id, token, position, cell, numeric)``,
        each sequence's new cell already applied in the KV.

        The per-row CSR is the sequence's own: ``past_kv_cur_seq_len[i]`` = its other cells,
        ``cur_seq_len[i] = 1``. The device runs each numeric row's numerics as a batch-1 forward
        and prices the step once as a batch. The result's ``batch`` holds one row per sequence,
        in order. Raises SubmitError (batch-1 calbin, too many rows), DeviceNotReady, or the
        errors of the board's submit; on error the buffer pair is back in the pool.
        """
        pair = self.pool.acquire(acquire_timeout)
        try:
            jrows = []
            for seq_id, token, position, cell, numeric in rows:
                ctx_cells, ctx_pos = self.kv.seq_cells(seq_id)
                jrows.append(BatchJobRow(int(seq_id), np.asarray([token], dtype=np.int64),
                                         np.asarray([position], dtype=np.int64), np.asarray([cell], dtype=np.int64),
                                         ctx_cells, ctx_pos, int(ctx_cells.shape[0]) - 1, bool(numeric)))
            out = self.calbin._submit_batch(self.submodels["decode"], jrows, pair.out, task_type=task_type)
        except BaseException:
            self.pool.release(pair)
            raise
        out._on_end = lambda: self.pool.release(pair)
        return out

    def do_shift(self) -> tuple[int, float, float]:
        """CalRT ``DoShift`` (facts.md F5 C1): take the cells whose positions ``seq_add`` / ``seq_div`` moved
        (``KVCacheManager.take_shift``) and run the device's K re-rotation over them (``board.run_kv_shift``,
        priced by ``costmodel.kv_shift_us``). Returns ``(n_cells, device_us, end_us)``: cells re-rotated, simulated
        µs the device spent, and when it ended on the simulated clock. No moved cell: ``(0, 0.0, now)``."""
        cells, _ = self._board.kv.take_shift()
        if cells.size == 0:
            return 0, 0.0, self.clock.now_us
        _, end, us = self._board.run_kv_shift(int(cells.size))
        return int(cells.size), us, end

    def job_counters(self) -> JobCounters:
        return self.device.job_counters()
