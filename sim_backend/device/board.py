"""The simulated board: two chiplets served by one device thread.

Jobs (one prefill or decode step of one sequence, batch 1, facts.md F1) are
queued with ``submit`` and return a ``Job`` handle at once; the device
thread runs the numerics (all 48 layers, ``numerics.ShardedModel``), prices
the step with the cost model at full Qwen3-30B-A3B size, advances the
simulated clock and, when pacing is real time, sleeps so that simulated
device time is also wall time. ``Job.wait(timeout)`` never blocks longer
than its timeout and ends in a result or a typed error.

Simulated time is in microseconds of the modelled NPU; host wall time is
measured separately and labelled as such.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
from threadpoolctl import threadpool_limits

from sim_backend.bundle.manifest import Bundle
from sim_backend.device.clock import Pacing, PacingMode, SimClock
from sim_backend.device.faults import FIRED_NAMES as FIRED_NAMES  # re-exported, as the job types below
from sim_backend.device.faults import FaultInjectingKV, Faults
from sim_backend.device.jobs import BatchJobRow as BatchJobRow
from sim_backend.device.jobs import BatchRow as BatchRow
from sim_backend.device.jobs import Job as Job
from sim_backend.device.jobs import JobCounters as JobCounters
from sim_backend.device.jobs import JobState as JobState
from sim_backend.device.jobs import StepResult as StepResult
from sim_backend.device.numerics_worker import NumericsProcess, price_numeric_step
from sim_backend.device.registers import RegisterFile
from sim_backend.errors import CCUException, DeviceError, DeviceNotReady, DeviceReset, LinkError, SubmitError
from sim_backend.model.batching import expected_union_touched, price_decode_batch
from sim_backend.model.costmodel import CostModel
from sim_backend.model.families import build_numerics, weights_stage
from sim_backend.model.numerics import ShardedModel

_DEFAULT_PACING = Pacing()  # frozen: one shared default is safe


class ResetReport(TypedDict):
    """What ``SimulatedBoard.reset`` did."""

    failed_jobs: int  #: jobs that ended with DeviceReset
    calbin: str  #: "reconfigured", or why not (device memory cleared)
    resets: int  #: resets since the board was made, this one included
    wall_ms: float  #: host wall ms the reset took (no simulated device time passes)


@dataclass(frozen=True)
class ChipletStatus:
    """Status of one chiplet: state "ready" | "fault" | "cleared" | "resetting", plus busy flag and slow factor."""

    index: int
    state: str
    busy: bool
    slow_factor: float
    jobs_done: int
    busy_us: float = 0.0  # simulated µs this chip spent executing ops since power-on (chip_busy_us)


def chip_busy_us(cost: Any) -> list[float]:
    """Simulated µs each chip executes its own ops in a priced step (a chip waiting at a sync is not busy).

    ``cost``: a ``StepCost``: its ``chip_busy_us`` (every op the chip runs: its layers and the ops
    outside them, so chip0's embedding counts on chip0 only; a slow chip's ops at its own speed).
    A cost without it (a test's stand-in) gives the sum of its ``layer_chip_us`` per chip, plus
    its ``outside_chip_us`` if it has them. Returns one float per chip.
    """
    busy = getattr(cost, "chip_busy_us", None)
    if busy is not None and np.asarray(busy).size:
        return [float(x) for x in np.asarray(busy)]
    per_chip = np.asarray(cost.layer_chip_us).sum(axis=0)
    outside = getattr(cost, "outside_chip_us", None)
    if outside is not None and np.asarray(outside).shape[1:] == per_chip.shape:
        per_chip = per_chip + np.asarray(outside).sum(axis=0)
    return [float(x) for x in per_chip]


class SimulatedBoard:
    """Two chiplets + device thread + KV cells + registers.

    Args:
        bundle: the loaded calbin bundle (model shape, numerics widths).
        cost_model: a ``costmodel.CostModel`` used to price every step.
        numerics: run the model numerically (True) or timing-only (False:
            no logits; experts priced by expectation, for long sweeps).
        pacing: real time or fast.
        kv_cells: KV capacity in tokens (default the calbin context, 40960, facts.md F4).
        numerics_process: run the numerics in a spawned worker process
            (``numerics_worker.NumericsProcess``; identical results) instead of in this one.
            With a ``CostModel``, the worker also prices numeric steps (the same StepCost);
            timing-only steps are priced here.
    """

    def __init__(self, bundle: Bundle, cost_model: Any, *, numerics: bool = True,
                 pacing: Pacing = _DEFAULT_PACING, kv_cells: int | None = None, numerics_process: bool = False,
                 numerics_progress: Callable[[str], None] | None = None,
                 numerics_background_start: bool = False) -> None:
        # single-threaded BLAS: small ops, 2 cores shared with host threads (see sim_backend/__init__)
        threadpool_limits(limits=1, user_api="blas")
        self.bundle = bundle
        self.shape = bundle.shape
        self.cost_model = cost_model
        self.numerics = numerics
        # run the numerics in a worker process (the console: keeps the GIL free for the UI)
        self.numerics_process = numerics_process
        # told (one line each) while the numerics kernels compile on a first start; None: silent
        self._numerics_progress = numerics_progress
        # with the worker: do not wait for its start (weights, kernels compiling on a first start); until it
        # answers ``numerics_ready`` is False and the engine runs new requests timing-only
        self.numerics_background_start = numerics_background_start
        self.pacing = pacing
        self.clock = SimClock()
        self.registers = RegisterFile()
        self.faults = Faults()
        n_cells = kv_cells or bundle.context
        self.kv = FaultInjectingKV(n_cells=n_cells, n_chips=self.shape.n_chips,
                                   bytes_per_token_per_chip=self.shape.kv_bytes_per_token_per_chip,
                                   faults=lambda: self.faults)
        self.model: ShardedModel | NumericsProcess | Any | None = None  # Any: another family's sharded model
        self._memory_cleared = False
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._queue: queue.Queue[tuple[int, Job] | None] = queue.Queue()
        self._generation = 0
        self._stop = threading.Event()
        self._resetting = False  # between a reset's start and its end submits are refused
        self._reset_lock = threading.Lock()  # one reset at a time
        self._running_job: Job | None = None  # the job the device thread is executing (even if already ended)
        # every job submitted and not yet ended (id -> Job). A reset ends all of them under the lock,
        # so no interleaving of submit / device thread / reset can leave a job that nobody will end.
        self._live: dict[int, Job] = {}
        self._submitted = self._pending = self._running = self._finished = self._failed = 0
        self._ccu = self._resets = 0
        self._chip_jobs = [0] * self.shape.n_chips
        # simulated µs executing since power-on: per chip (its own ops) and the board (whole steps)
        self._chip_busy_us = [0.0] * self.shape.n_chips
        self._board_busy_us = 0.0
        self.last_steps: dict[str, StepResult] = {}
        self._pace_log: deque[tuple[float, float, int]] = deque(maxlen=256)  # (wall s, sim end µs, epoch)
        self._listeners: list[Any] = []
        if isinstance(cost_model, CostModel):
            for kind in ("prefill", "decode"):  # built now, with the other start-up objects (a console freezes them)
                cost_model.graph(self.shape, kind)
        self.load_model()
        self._thread = threading.Thread(target=self._loop, name="calculet-device", daemon=True)
        self._thread.start()

    # --- model memory ---------------------------------------------------------

    def load_model(self) -> float:
        """(Re)load weights onto the chiplets and configure the calbin. Returns host wall seconds taken."""
        t0 = time.perf_counter()
        if self.numerics:
            n_cells = self.kv.occupancy().capacity_cells
            old, self.model = self.model, None
            if old is not None and hasattr(old, "close"):
                old.close()
            if self.numerics_process:
                # a real cost model goes with it, so the worker prices each step where it computes it
                cm = self.cost_model if isinstance(self.cost_model, CostModel) else None
                self.model = NumericsProcess(self.shape, self.bundle.numeric, n_cells, cost_model=cm,
                                             progress=self._numerics_progress,
                                             wait=not self.numerics_background_start)
            else:
                say = self._numerics_progress
                note = weights_stage(self.shape, self.bundle.numeric)
                if say is not None and note is not None:
                    say(note)
                model = build_numerics(self.shape, self.bundle.numeric, n_cells)
                if hasattr(model, "warm_up"):
                    model.warm_up(None if say is None else
                                  lambda i, n, stage: say(f"compiling numerics kernels, {i}/{n}: {stage}"))
                self.model = model
        self._memory_cleared = False
        self.registers.set_bits("BOARD_STATUS", 0x2, True)
        for c in range(self.shape.n_chips):
            self.registers.set_bits(f"CHIP{c}_STATUS", 0x4, False)
        return time.perf_counter() - t0

    def clear_memory(self) -> None:
        """ClearAllDevMem: zero DRAM/SRAM (weights and KV). Inference refuses until ``load_model``.

        Every array a chip holds is replaced by a zeroed one (``np.zeros`` is
        lazy, so this takes milliseconds, not the ~0.7 s of writing 1 GB of
        zeros). Replacing rather than writing in place also matters for
        correctness: some per-chip weight arrays are views of the shared,
        cached synthetic weights (e.g. ``wo`` row slices), and zeroing those
        in place corrupted the model that ``load_model`` rebuilds.
        """
        with self._lock:
            self._memory_cleared = True
            model = self.model
            self.model = None
        if model is not None:
            if hasattr(model, "close"):
                model.close()  # numerics process: its memory (weights, KV) goes with it; in-process: its chip thread
            if not isinstance(model, NumericsProcess):
                for chip in model.chips:
                    _zero_chip(chip, weights=True)
        self.kv.clear()
        self.registers.set_bits("BOARD_STATUS", 0x2, False)
        for c in range(self.shape.n_chips):
            self.registers.set_bits(f"CHIP{c}_STATUS", 0x4, True)

    @property
    def memory_cleared(self) -> bool:
        return self._memory_cleared

    def kv_values(self) -> Any:
        """The model's KV cache by cell (``kv_state.KVValueStore``: in this process or the numerics
        worker), or None when no values exist (timing-only board, memory cleared, model not loaded)."""
        model = self.model
        if not self.numerics or self._memory_cleared or model is None or not hasattr(model, "kv_take"):
            return None
        return model

    def run_kv_shift(self, n_cells: int) -> tuple[float, float, float]:
        """Run one KV shift (CalRT ``DoShift``, facts.md F5 C1) over ``n_cells`` moved cells: the device is serial,
        so it starts when the device is free (after a step in flight) and holds it for the cost model's
        ``kv_shift_us``. Returns ``(start_us, end_us, device_us)`` on the simulated clock, which it advances to
        the end. Timing only: the numerics do not re-rotate K (the engine stops a shifted request's numerics).
        Not paced in real time (a shift is ~0.3-1 ms simulated)."""
        from sim_backend.model.costmodel import CostModel, kv_shift_us
        cm = self.cost_model
        us = kv_shift_us(cm.hw, self.shape, int(n_cells)) if isinstance(cm, CostModel) else 0.0
        with self._lock:
            start = max(self.clock.now_us, self._device_free_us)
            end = start + us
            self._device_free_us = end
            self.clock.advance_to(end)
            self._board_busy_us += us
        return start, end, us

    # --- jobs -------------------------------------------------------------------

    def submit(self, kind: str, seq_id: int, tokens: np.ndarray, positions: np.ndarray, new_cells: np.ndarray,
               ctx_cells: np.ndarray, ctx_positions: np.ndarray, *, task_type: str = "auto",
               numeric: bool = True) -> Job:
        """Queue one step; returns its Job at once (non-blocking ``infer()``).

        tokens/positions/new_cells: (n,) int arrays; ctx_cells/ctx_positions:
        (T,) the sequence's cells sorted by position, including the new ones.
        numeric=False runs this job timing-only even on a numeric board (the
        engine does so for prompts too long for exact numerics in Python).
        Raises DeviceNotReady if memory was cleared or a reset is under way,
        SubmitError on bad input or after ``close``.
        """
        if kind not in ("prefill", "decode"):
            raise SubmitError(f"unknown sub-model {kind!r}")
        n = int(tokens.shape[0])
        if n < 1 or positions.shape != tokens.shape or new_cells.shape != tokens.shape:
            raise SubmitError(f"bad input buffers: tokens {tokens.shape}, positions {positions.shape}, "
                              f"cells {new_cells.shape}")
        if kind == "decode" and n != 1:
            raise SubmitError(f"decode takes exactly 1 token (cur_seq_len), got {n}")
        if ctx_cells.shape != ctx_positions.shape or ctx_cells.shape[0] < n:
            raise SubmitError(f"context cells {ctx_cells.shape} / positions {ctx_positions.shape} must hold the "
                              f"{n} new token(s) (KV cleared since apply?)")
        if n > self.bundle.context or ctx_cells.shape[0] > self.bundle.context:
            raise SubmitError(f"cur_seq_len {n} / context {ctx_cells.shape[0]} "
                              f"exceed calbin context {self.bundle.context}")
        if self._memory_cleared:
            raise DeviceNotReady("device memory cleared: reload the model before inference")
        past_len = int(ctx_cells.shape[0]) - n
        job = Job(next(self._ids), kind, seq_id, tokens, positions, new_cells, ctx_cells, ctx_positions,
                  past_len, self.clock.now_us, task_type, numeric=bool(numeric) and self.numerics)
        return self._enqueue(job)

    def _enqueue(self, job: Job) -> Job:
        """Count, register and queue ``job`` in one step under the lock: a reset sees it either not at
        all (then it ran before the reset) or as live (then the reset ends it). SubmitError once closed,
        DeviceNotReady while resetting."""
        with self._lock:
            if self._stop.is_set():
                raise SubmitError("device closed: no job can be submitted")
            if self._resetting:
                raise DeviceNotReady("device is resetting: submit again when the reset has finished")
            job.generation = self._generation
            self._submitted += 1
            self._pending += 1
            self._live[job.id] = job
            self._queue.put((job.generation, job))  # unbounded queue: never blocks under the lock
        return job

    def submit_batch(self, rows: list[BatchJobRow], *, task_type: str = "auto") -> Job:
        """Queue one batched decode step (a C3 variant bundle's batch-N decode sub-model); returns its Job.

        ``rows``: 1..``bundle.decode_batch`` sequences, one token each, distinct ``seq_id`` s.
        The device runs each numeric row's per-sequence numerics (the same ``forward`` as a
        batch-1 step, so logits equal batch-1 logits) and prices the step ONCE as a batch
        (:func:`sim_backend.model.batching.price_decode_batch`). Raises SubmitError (bad
        rows, a batch-1 bundle, too many rows), DeviceNotReady (memory cleared, resetting).
        """
        cap = self.bundle.decode_batch
        if cap < 2:
            raise SubmitError("this calbin's decode sub-model is batch 1: submit one sequence per job")
        if not 1 <= len(rows) <= cap:
            raise SubmitError(f"a batched decode job carries 1..{cap} sequences, got {len(rows)}")
        if len({r.seq_id for r in rows}) != len(rows):
            raise SubmitError("a sequence may ride only once in a batched decode job")
        for r in rows:
            if r.tokens.shape != (1,) or r.positions.shape != (1,) or r.new_cells.shape != (1,):
                raise SubmitError(f"sequence {r.seq_id}: decode takes exactly 1 token per row")
            if r.ctx_cells.shape != r.ctx_positions.shape or r.ctx_cells.shape[0] != r.past_len + 1:
                raise SubmitError(f"sequence {r.seq_id}: context cells {r.ctx_cells.shape} must be past_len + 1")
            if r.ctx_cells.shape[0] > self.bundle.context:
                raise SubmitError(f"sequence {r.seq_id}: context {r.ctx_cells.shape[0]} exceeds "
                                  f"calbin context {self.bundle.context}")
        if self._memory_cleared:
            raise DeviceNotReady("device memory cleared: reload the model before inference")
        r0 = rows[0]
        job = Job(next(self._ids), "decode", r0.seq_id, r0.tokens, r0.positions, r0.new_cells, r0.ctx_cells,
                  r0.ctx_positions, r0.past_len, self.clock.now_us, task_type,
                  numeric=any(r.numeric for r in rows) and self.numerics)
        job.batch = tuple(rows)
        return self._enqueue(job)

    def counters(self) -> JobCounters:
        """One consistent read: ``submitted == finished + failed + pending + running`` always holds."""
        with self._lock:
            return JobCounters(self._submitted, self._pending, self._running, self._finished, self._failed,
                               self._ccu, self._resets)

    def accounting_problems(self) -> list[str]:
        """Check the job bookkeeping; returns what is wrong (empty list: consistent).

        Checked in one read under the board lock: the counters balance
        (``submitted == finished + failed + pending + running``); pending +
        running equals the jobs not yet ended; every such job is really not
        ended and belongs to the current reset generation (a job from before
        the last reset that has not ended would never end).
        """
        with self._lock:
            c = (self._submitted, self._finished, self._failed, self._pending, self._running)
            live = list(self._live.values())
            gen = self._generation
        sub, fin, fail, pend, run = c
        out = []
        if sub != fin + fail + pend + run:
            out.append(f"job counters do not balance: submitted {sub} != finished {fin} + failed {fail} + "
                       f"pending {pend} + running {run}")
        if min(pend, run) < 0:
            out.append(f"negative job counter: pending {pend}, running {run}")
        if len(live) != pend + run:
            out.append(f"{len(live)} jobs not ended but pending + running = {pend + run}")
        stale = [j.id for j in live if j.generation != gen]
        if stale:
            out.append(f"{len(stale)} job(s) from before the last reset never ended (ids {stale[:5]})")
        ended = [j.id for j in live if j.done]
        if ended:
            out.append(f"{len(ended)} ended job(s) still counted as in flight (ids {ended[:5]})")
        return out

    def chiplets(self) -> list[ChipletStatus]:
        with self._lock:
            busy = self._running > 0
            out = []
            for c in range(self.shape.n_chips):
                st = self.registers.read(f"CHIP{c}_STATUS")
                state = "cleared" if st & 0x4 else ("fault" if st & 0x2 or self.numerics_broken else "ready")
                out.append(ChipletStatus(c, state, busy, self.faults.slow_chip.get(c, 1.0), self._chip_jobs[c],
                                         self._chip_busy_us[c]))
            return out

    @property
    def busy_us(self) -> float:
        """Simulated µs the board spent executing steps (h2d + infer + d2h) since power-on."""
        with self._lock:
            return self._board_busy_us

    @property
    def numerics_ready(self) -> bool:
        """True when a numeric job would run now: numerics on, the model loaded and (a worker started in the
        background) its start finished. False while the kernels compile on a first start (a worker that died
        later stays ready: its jobs fail, typed, and the device shows the fault)."""
        model = self.model
        return bool(self.numerics and model is not None and not self._memory_cleared and getattr(model, "ready", True))

    @property
    def numerics_starting(self) -> bool:
        """True while a numerics worker started in the background is not ready yet (spawning, loading its
        kernels from the disk cache, or compiling them on a first start): requests admitted now run
        timing-only. False once it is ready, when it failed to start (``numerics_broken``), and when no
        model is loaded or the memory was cleared (the status says so)."""
        model = self.model
        return bool(self.numerics and model is not None and not self._memory_cleared
                    and not getattr(model, "ready", True) and not self.numerics_broken)

    @property
    def numerics_broken(self) -> bool:
        """The numerics worker process died or hung (reset or reload the model to recover)."""
        return bool(getattr(self.model, "broken", False))

    def add_listener(self, fn: Any) -> None:
        """fn(StepResult) called on the device thread after each finished step (keep it cheap)."""
        self._listeners.append(fn)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is None:
                break
            gen, job = item
            with self._lock:
                if job.done:
                    continue  # ended by a reset while queued (and counted then)
                if gen != self._generation:  # cannot happen (a reset ends every live job); never lose it
                    self._end_job_locked(job, JobState.FAILED,
                                         error=DeviceReset(f"job {job.id} dropped by device reset"))
                    continue
                self._pending -= 1
                self._running += 1
                job._counted = "running"
                self._running_job = job
                job.state = JobState.RUNNING
            try:
                self._execute(job, gen)
            except Exception as e:  # noqa: BLE001 - a simulator bug must fail the job, not kill the device thread
                self._fail(job, JobState.FAILED, DeviceError(f"job {job.id} failed in the simulator: {e!r}"))
            finally:
                with self._lock:
                    self._running_job = None
                # _execute always ends the job; if it did not (a bug), end it here rather than lose it
                self._fail(job, JobState.FAILED, DeviceError(f"job {job.id} left unfinished by the device"))

    def _end_job_locked(self, job: Job, state: JobState, result: StepResult | None = None,
                        error: DeviceError | None = None) -> bool:
        """End ``job`` once (caller holds ``self._lock``): its outcome and the counters move together.

        Returns False if it had already ended (e.g. failed by a reset): later outcomes are dropped.
        """
        if not job._finish(state, result=result, error=error):
            return False
        if job._counted == "running":
            self._running -= 1
        elif job._counted == "pending":
            self._pending -= 1
        job._counted = ""
        self._live.pop(job.id, None)
        if state is JobState.DONE:
            self._finished += 1
        else:
            self._failed += 1
        return True

    def _fail(self, job: Job, state: JobState, err: DeviceError) -> bool:
        with self._lock:
            return self._end_job_locked(job, state, error=err)

    def _execute(self, job: Job, gen: int) -> None:
        wall0 = time.perf_counter()
        faults = self.faults
        if faults.take("ccu_next", f"chip0, job {job.id} ({job.kind})"):
            with self._lock:
                self._ccu += 1
            self.registers.bump("CHIP0_CCU_EXC")  # the chip the exception is on, not every chip
            self._fail(job, JobState.CCU_EXCEPTION,
                       CCUException(f"CCU exception on chip0 while running job {job.id} ({job.kind}), injected fault"))
            return
        if faults.take("link_error_next", f"chip0->chip1 embedding broadcast, job {job.id} ({job.kind})"):
            self.registers.bump("D2D_LINK_ERR")
            spent = self._book_link_error(job)
            err = LinkError(
                f"D2D link error between chip0 and chip1 in job {job.id}: the embedding broadcast failed"
                + (f" after {sum(spent.values()) * 1e3:.1f} µs simulated" if spent else "") + ", injected fault")
            err.device_ms = spent
            self._fail(job, JobState.FAILED, err)
            return
        model = self.model
        if self._memory_cleared or (job.numeric and model is None):
            self._fail(job, JobState.FAILED, DeviceNotReady("device memory cleared while job was queued"))
            return
        logits = None
        touched = None
        batch_rows: tuple[BatchRow, ...] = ()
        cost = None
        try:
            if job.batch:
                batch_rows, cost = self._run_batch(job, model)
                logits, touched = batch_rows[0].logits, batch_rows[0].experts_touched
            else:
                slow = dict(self.faults.slow_chip)
                scale = [slow.get(c, 1.0) for c in range(self.shape.n_chips)] if slow else None
                if job.numeric:
                    assert model is not None  # refused above
                    step = (job.tokens, job.positions, job.new_cells, job.ctx_cells, job.ctx_positions)
                    if isinstance(model, NumericsProcess) and model.prices_steps:
                        # the worker prices the step too: this process (the console's) does no numeric work
                        out, cost = model.forward_priced(*step, kind=job.kind, past_len=job.past_len,
                                                         chip_scale=scale)
                    else:
                        out = model.forward(*step)
                    # the D2H dtype (BF16 bits, or float32 for an F32 C3 calbin), made once where the logits were made
                    logits = out.device_logits(self.shape.logits_dtype)
                    touched = tuple(int(v) for v in out.experts_touched)
                if cost is None:
                    cost = price_numeric_step(self.cost_model, self.shape, job.kind, int(job.tokens.shape[0]),
                                              job.past_len, touched, scale)
        except Exception as e:  # a numerics bug must fail this job, not kill the device thread
            self._fail(job, JobState.FAILED, DeviceError(f"job {job.id} failed in the simulator: {e!r}"))
            return
        sim_us = float(cost.total_us)  # a slow chip is priced on its own timeline; barriers let it gate the step
        compute_ms = (time.perf_counter() - wall0) * 1e3
        # the device is serial: a step starts when submitted or when the previous one ended
        start = max(job.submit_sim_us, self._device_free_us)
        end = start + sim_us
        self._device_free_us = end
        if self.pacing.mode is PacingMode.REALTIME:
            remaining = self._pacing_deadline(wall0, start, end) - time.perf_counter()
            # sleep on the job's own end: a reset (or close) that ends it wakes us; nothing else can
            if remaining > 0 and job._done.wait(remaining):
                return  # ended by a reset during the pacing sleep (and counted then)
        if job.done:
            return  # ended by a reset while computing
        res = StepResult(job.id, job.kind, job.seq_id, int(job.tokens.shape[0]), job.past_len, logits,
                         touched, cost, sim_us, start, end, compute_ms, batch_rows)
        chip_busy = chip_busy_us(cost)
        with self._lock:
            if job.done:
                return  # a reset ended it just now
            self.clock.advance_to(end)  # before the waiter wakes, as it reads the clock
            self._pace_log.append((time.perf_counter(), end, self._pace_epoch))
            self._end_job_locked(job, JobState.DONE, result=res)
            self._board_busy_us += sim_us
            for c in range(self.shape.n_chips):
                self._chip_jobs[c] += 1
                self._chip_busy_us[c] += chip_busy[c]
            self.last_steps[job.kind] = res
        for c in range(self.shape.n_chips):
            self.registers.bump(f"CHIP{c}_JOBS_DONE")
        for fn in list(self._listeners):
            try:
                fn(res)
            except Exception:  # noqa: BLE001 - a listener must never break the device
                pass

    #: the op an injected link error hits: the step's first chiplet-to-chiplet transfer
    LINK_ERROR_OP = "embed_sync"

    def _book_link_error(self, job: Job) -> dict[str, float] | None:
        """Book the simulated time a job failed by a D2D link error occupied; returns its parts,
        ``{"h2d": ms, "infer": ms, "d2h": 0.0}`` (simulated ms, as ``Timings.device_ms``), or None.

        A link error is detected on a transfer, so the step runs up to that transfer and stops there:
        the injected one hits the step's first chiplet exchange, the embedding broadcast
        (``embed_sync``, chip0 -> chip1).  The job costs the H2D of its inputs, the submit overhead,
        chip0's embedding and the failed transfer (on both chips' timelines, chip1 waiting for
        chip0's embedding first), about 0.3 ms; no layer runs, there is no D2H.  The device is busy
        that long (the next step starts after it; each chip's busy time gets the ops it ran), and it
        is never the whole step's price.  Priced with the expectation of experts (the ops before the
        first layer do not depend on them), a slow chip at its own speed.  A cost model without per-op
        timelines (a test's stand-in) books nothing.
        """
        slow = dict(self.faults.slow_chip)
        scale = [slow.get(c, 1.0) for c in range(self.shape.n_chips)] if slow else None
        try:
            if job.batch:
                cost = price_decode_batch(self.cost_model, self.shape, [r.past_len for r in job.batch], None, scale)
            else:
                cost = self.cost_model.price_step(self.shape, job.kind, int(job.tokens.shape[0]), job.past_len,
                                                  None, scale)
            graph = getattr(cost, "graph", None)
            if graph is None or not hasattr(cost, "until_op"):
                return None
            idx = next(op.index for op in graph.ops if op.role == self.LINK_ERROR_OP)
            infer_us, busy = cost.until_op(idx)
        except (ValueError, StopIteration):
            return None
        sim_us = float(cost.h2d_us) + infer_us
        with self._lock:
            if job.done:
                return None  # ended by a reset meanwhile: nothing ran
            start = max(job.submit_sim_us, self._device_free_us)
            self._device_free_us = start + sim_us
            self.clock.advance_to(start + sim_us)
            self._board_busy_us += sim_us
            for c in range(self.shape.n_chips):
                self._chip_busy_us[c] += float(busy[c])
        return {"h2d": float(cost.h2d_us) / 1e3, "infer": infer_us / 1e3, "d2h": 0.0}

    def _run_batch(self, job: Job, model: Any) -> tuple[tuple[BatchRow, ...], Any]:
        """Numerics of every numeric row, one after another (each its own batch-1 forward), and
        ONE batched price. The union of experts per layer is estimated from the rows' distinct
        counts (``expected_union_touched``: the numerics report counts, not expert ids)."""
        rows: list[BatchRow] = []
        for r in job.batch:
            lg = t = None
            if r.numeric and self.numerics:
                assert model is not None  # refused in _execute
                out = model.forward(r.tokens, r.positions, r.new_cells, r.ctx_cells, r.ctx_positions)
                lg, t = out.device_logits(self.shape.logits_dtype), tuple(out.experts_touched)
            rows.append(BatchRow(r.seq_id, r.past_len, lg, t))
        counts = [r.experts_touched for r in rows]
        union = None  # a model that reports no counts (()): the expectation
        if all(counts):
            union = expected_union_touched(len(rows), self.shape, [c for c in counts if c]).tolist()
        slow = dict(self.faults.slow_chip)
        scale = [slow.get(c, 1.0) for c in range(self.shape.n_chips)] if slow else None
        cost = price_decode_batch(self.cost_model, self.shape, [r.past_len for r in rows], union, scale)
        return tuple(rows), cost

    _device_free_us = 0.0
    _pace_anchor: tuple[float, float] | None = None  # (wall s, sim µs) pacing is measured from
    _pace_prev: tuple[float, float] | None = None  # (deadline wall s, end sim µs) of the previous step
    _pace_epoch = 0  # bumped when a run starts after an idle gap; achieved_speed only looks at the current run
    IDLE_GAP_S = 0.05  # a wall gap this much longer than the booked host work means the device idled

    def _pacing_deadline(self, wall0: float, start_us: float, end_us: float) -> float:
        """Wall time (perf_counter s) at which a step ending at simulated ``end_us`` may complete.

        Paced against the simulated clock since an anchor, not step by step:
        host turnaround between steps is booked on the simulated clock, so the
        deadline of a step follows the previous one by exactly the simulated
        time in between, and thread wake-up latency is absorbed instead of
        accumulating. The device re-anchors when it was idle (the wall gap
        exceeds the booked host work by IDLE_GAP_S) or is more than 1 s behind.
        """
        speed = self.pacing.speed
        a, prev = self._pace_anchor, self._pace_prev
        idle = prev is None or wall0 > prev[0] + (start_us - prev[1]) / 1e6 / speed + self.IDLE_GAP_S
        if a is None or idle:
            a = (wall0, start_us)
            self._pace_epoch += 1
        deadline = a[0] + (end_us - a[1]) / 1e6 / speed
        if deadline < time.perf_counter() - 1.0:
            # more than 1 s behind: no catching up later, so the anchor moves, but the run goes on (same
            # epoch): achieved_speed keeps measuring it, and the console keeps saying the host is behind
            a = (wall0, start_us)
            deadline = a[0] + (end_us - a[1]) / 1e6 / speed
        self._pace_anchor = a
        self._pace_prev = (max(deadline, time.perf_counter()), end_us)
        return deadline

    def achieved_speed(self, window_s: float = 3.0) -> float | None:
        """Simulated seconds per wall second over recent back-to-back steps: those of the last ``window_s``
        wall seconds, or the last 5 when the host is slower than that (None with fewer than 3 steps since
        the pacing anchor, or when no step came for 3 typical step gaps and at least 1 s: idle).

        With real-time pacing this should be ~``pacing.speed``; lower means the
        host cannot compute the simulation as fast as the device would run
        (the console then streams slower than the simulated figures say).
        """
        now = time.perf_counter()
        epoch = self._pace_epoch  # only steps paced from the current anchor (no idle gap inside)
        run = [p for p in list(self._pace_log) if p[2] == epoch]
        pts = [p for p in run if now - p[0] <= window_s]
        if len(pts) < 5:
            # a host far slower than the device (the dense pilot: ~0.1-0.5 s of wall per 2.7 ms sim step)
            # has fewer than 5 steps in the window; its last 5 steps still measure it, and hiding the
            # figure would hide exactly the case it exists for
            pts = run[-5:]
        if len(pts) < 3:
            return None
        gaps = sorted(b[0] - a[0] for a, b in zip(pts, pts[1:], strict=False))
        if now - pts[-1][0] > max(1.0, 3.0 * gaps[len(gaps) // 2]):
            return None  # no step for a while: idle, not behind
        dw = pts[-1][0] - pts[0][0]
        return (pts[-1][1] - pts[0][1]) / 1e6 / dw if dw > 0 else None

    # --- reset ------------------------------------------------------------------

    def reset(self, timeout: float = 5.0) -> ResetReport:
        """Reset the board: fail every pending/running job with DeviceReset at once,
        return chiplets to power-on state, clear KV, count the reset, reconfigure.

        Returns {"failed_jobs", "calbin", "resets", "wall_ms"} (``wall_ms`` host
        wall time; a reset takes no simulated device time); raises DeviceError if
        the device thread does not leave the aborted job within ``timeout`` host
        seconds (or another reset holds the board that long). Armed faults are
        disarmed (power-on state).

        Race-free with ``submit``: every job submitted before the reset took
        the board lock ends with DeviceReset (queued, just taken by the device
        thread, running or in its pacing sleep); a submit while the reset is
        under way raises DeviceNotReady; jobs after it run normally. So
        ``submitted == finished + failed + pending + running`` holds at every
        moment (``accounting_problems`` checks it).
        """
        t0 = time.perf_counter()
        if not self._reset_lock.acquire(timeout=max(0.0, timeout)):
            raise DeviceError(f"another reset still under way after {timeout:.1f} s")
        try:
            return self._reset(t0, timeout)
        finally:
            self._reset_lock.release()

    def _reset(self, t0: float, timeout: float) -> ResetReport:
        with self._lock:
            # one step under the lock: every job submitted so far (queued, taken off the queue but not
            # yet started, running, or being paced) ends with DeviceReset; later submits are new work
            self._generation += 1
            self._resetting = True
            running = self._running_job
            failed = 0
            for job in sorted(self._live.values(), key=lambda j: j.id):
                verb = "aborted" if job._counted == "running" else "dropped"
                reset_err = DeviceReset(f"job {job.id} {verb} by device reset")
                if self._end_job_locked(job, JobState.FAILED, error=reset_err):
                    failed += 1
            while True:  # what is queued now has ended: drop it (the device thread would skip it)
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        try:
            # wait (bounded) for the device thread to leave the aborted job (it may be computing it)
            deadline = t0 + timeout
            while True:
                with self._lock:
                    idle = running is None or self._running_job is not running
                if idle or time.perf_counter() > deadline:
                    break
                time.sleep(0.002)
            if not idle:
                raise DeviceError(f"device thread still busy {timeout:.1f} s after reset")
            with self._lock:
                self._resets += 1
                self.faults = Faults()
                self.last_steps = {}
                # pacing re-anchors at the next step: an aborted step booked its whole price on the clock,
                # and the next one must not wait for the wall to catch up with time that never ran
                self._pace_anchor = self._pace_prev = None
            self.registers.power_on()
            self.kv.clear()
            if self.model is not None:
                if getattr(self.model, "broken", False):
                    self.load_model()  # the numerics worker died or hung: a reset starts a fresh one
                else:
                    self.model.clear_kv()  # KV back to power-on zeros (fresh lazy pages); weights stay
            if self._memory_cleared:
                # a reset does not bring weights back: the chips stay "memory cleared" until load_model
                for c in range(self.shape.n_chips):
                    self.registers.set_bits(f"CHIP{c}_STATUS", 0x4, True)
                calbin = "not configured (device memory cleared: reload the model)"
            else:
                self.registers.set_bits("BOARD_STATUS", 0x2, True)  # calbin reconfigured
                calbin = "reconfigured"
        finally:
            with self._lock:
                self._resetting = False
        return {"failed_jobs": failed, "calbin": calbin, "resets": self._resets,
                "wall_ms": (time.perf_counter() - t0) * 1e3}

    def close(self) -> None:
        """Stop the device thread (pending and running jobs fail with DeviceReset "device closed")."""
        self._stop.set()
        with self._lock:
            self._generation += 1
            for job in sorted(self._live.values(), key=lambda j: j.id):
                self._end_job_locked(job, JobState.FAILED, error=DeviceReset("device closed"))
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        model, self.model = self.model, None
        if model is not None and hasattr(model, "close"):
            model.close()


def _zero_chip(chip: Any, *, weights: bool) -> None:
    """Return one ``numerics.ChipShard`` 's memory to zeros by swapping in fresh zero arrays.

    ``weights=False`` zeroes only the KV arrays (reset); ``True`` also the
    weights (ClearAllDevMem). Never writes into the old arrays, which may be
    shared with the cached synthetic weights.
    """
    chip.k_cache = _zeros(chip.k_cache)
    chip.v_cache = _zeros(chip.v_cache)
    if not weights:
        return
    for lw in chip.layers:
        for k in list(lw):
            lw[k] = _zeros(lw[k])
    chip.lm_head = _zeros(chip.lm_head)
    chip.lm_bias = _zeros(chip.lm_bias)
    if getattr(chip, "embed", None) is not None:
        chip.embed = _zeros(chip.embed)


def _zeros(a: np.ndarray) -> np.ndarray:
    """Fresh zeros like ``a``; ``np.zeros`` maps zero pages lazily (``np.zeros_like`` writes them)."""
    return np.zeros(a.shape, dtype=a.dtype)
