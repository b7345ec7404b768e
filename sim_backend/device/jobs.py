"""Device jobs: one prefill or decode step of one sequence (batch 1, facts.md F1), its states, its
result (simulated µs) and the board's job counters."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from sim_backend.errors import DeviceError, WaitTimeout


class JobState(str, Enum):
    """OutputBuf states of CalRT (facts.md F5 C1) plus FAILED for other device errors."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    CCU_EXCEPTION = "ccu_exception"
    FAILED = "failed"


@dataclass(frozen=True)
class StepResult:
    """One finished step.

    logits: the last token's (vocab,) logits as the device returns them (D2H): uint16 BF16 bit
    patterns (the production calbin's 303,872 B of facts.md F1) or float32 (a C3 calbin that
    declares F32 logits, ``ModelShape.logits_dtype``), or None in timing-only mode.
    experts_touched: distinct experts per layer (numeric mode) or None.
    cost: the cost model's ``StepCost`` (simulated µs, per layer/chip/category).
    sim_us: simulated device time of the step (µs), = cost.total_us (h2d + infer + d2h; a slow
        chip is priced per chip by the cost model, see ``CostModel.price_step(chip_scale=...)``).
    sim_start_us / sim_end_us: on the simulated clock.
    compute_wall_ms: host wall milliseconds the simulator spent computing the step.
    """

    job_id: int
    kind: str
    seq_id: int
    n_tokens: int
    past_len: int
    logits: np.ndarray | None
    experts_touched: tuple[int, ...] | None
    cost: Any
    sim_us: float
    sim_start_us: float
    sim_end_us: float
    compute_wall_ms: float
    #: a batched decode step (C3 variant calbin): one row per sequence that rode in it, in
    #: submission order; () for every batch-1 step. The top-level fields are row 0's.
    batch: tuple[BatchRow, ...] = ()


@dataclass(frozen=True)
class BatchRow:
    """One sequence of a batched decode step: its ``seq_id``, context before the step
    (``past_len``, tokens), its own (vocab,) D2H logits (uint16 BF16 bits or float32, as
    ``StepResult.logits``; None timing-only) and the
    distinct experts its token touched per layer (numeric rows only)."""

    seq_id: int
    past_len: int
    logits: np.ndarray | None
    experts_touched: tuple[int, ...] | None


@dataclass(frozen=True)
class BatchJobRow:
    """Input of one sequence in a batched decode job: 1 token, its position and new cell,
    the sequence's context cells/positions (including the new one), and whether its numerics run."""

    seq_id: int
    tokens: np.ndarray
    positions: np.ndarray
    new_cells: np.ndarray
    ctx_cells: np.ndarray
    ctx_positions: np.ndarray
    past_len: int
    numeric: bool


class Job:
    """Handle of a submitted job (CalRT OutputBuf-like). Thread-safe."""

    def __init__(self, job_id: int, kind: str, seq_id: int, tokens: np.ndarray, positions: np.ndarray,
                 new_cells: np.ndarray, ctx_cells: np.ndarray, ctx_positions: np.ndarray, past_len: int,
                 submit_sim_us: float, task_type: str, *, numeric: bool = True) -> None:
        self.id = job_id
        self.kind = kind
        self.seq_id = seq_id
        self.tokens = tokens
        self.positions = positions
        self.new_cells = new_cells
        self.ctx_cells = ctx_cells
        self.ctx_positions = ctx_positions
        self.past_len = past_len
        self.submit_sim_us = submit_sim_us
        self.task_type = task_type
        self.numeric = numeric  # compute logits; False: timing only
        #: rows of a batched decode job (``BatchJobRow``), () for a batch-1 job
        self.batch: tuple[BatchJobRow, ...] = ()
        self.state = JobState.PENDING
        self.result: StepResult | None = None
        self.error: DeviceError | None = None
        self.generation = 0  # the board's reset generation it was submitted in (set by submit)
        self._counted = "pending"  # which board counter holds it: "pending" | "running" | "" (ended)
        self._done = threading.Event()
        self._lock = threading.Lock()

    def _finish(self, state: JobState, result: StepResult | None = None, error: DeviceError | None = None) -> bool:
        # only SimulatedBoard._end_job_locked calls this (under the board lock), so the counters move with it
        with self._lock:
            if self._done.is_set():
                return False  # already ended (e.g. failed by a reset); later outcomes are dropped
            self.state, self.result, self.error = state, result, error
            self._done.set()
            return True

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> StepResult:
        """Block up to ``timeout`` host seconds.

        Returns the StepResult, or raises WaitTimeout (the job keeps running),
        CCUException, DeviceReset, LinkError or another DeviceError.
        """
        if not self._done.wait(timeout):
            raise WaitTimeout(f"job {self.id} ({self.kind}) not done after {timeout:.3f} s (state {self.state.value})")
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result



@dataclass(frozen=True)
class JobCounters:
    """Device job counters (facts.md F5 C1: pending / finished / left, plus running / failed)."""

    submitted: int
    pending: int
    running: int
    finished: int
    failed: int
    ccu_exceptions: int
    resets: int

    @property
    def left(self) -> int:
        return self.pending + self.running
