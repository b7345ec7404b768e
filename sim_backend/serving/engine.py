"""Serving engine: the llama.cpp-server layer over the simulated device (facts.md F1).

Slots over the device, a bounded admission queue, chunked prefill and decode scheduled in rounds,
CPU sampling, stop rules, streaming with UTF-8-safe detokenisation and stop-string holdback,
per-request metrics. The engine is the thread and the lock; its parts are modules of their own:

- ``intake``: validation, the tokenised prompt, the grammar, the request's token pipeline;
- ``admission``: the queue and the slot choice (longest cached prefix, then LRU);
- ``scheduler``: the round rule, pure (slot states in, the next step out);
- ``steps``: the step runner (KV cells, one job, each rider's part; batch 1 is the N = 1 case);
- ``tokens``: each request's token pipeline (sampler, stop rules, visible text);
- ``ledger``: each request's end (timings, result, metrics);
- ``kv_pressure``: the KV parking and request-ending policy;
- ``slot_actions``: llama-server's slot save / restore / erase;
- ``gate``: the maintenance plane's pause, drain and resume of admission;
- ``requests``: the request and slot records.

Context boundary, as llama.cpp counts it: a prompt of ``n_ctx`` = 40960 tokens or more (chat
template included) is refused with ``ExceedContextSizeError``; a prompt that fits is accepted
whatever ``max_tokens`` is and stops with ``limit`` when prompt + generated reach ``n_ctx``
(40959 prompt tokens -> 1 token; 40958 -> 2), so ``usage.total_tokens`` never exceeds ``n_ctx``.

Clocks: request timestamps are SIMULATED device ms on the board's clock; host work is measured
(``HostTimer``) and booked on that clock (``HostBooking``); ``Timings.host_ms`` holds the measured
host parts and ``Timings.device_ms`` the simulated device parts (h2d, infer, d2h).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

from sim_backend.errors import ExceedContextSizeError, InvalidRequestError, UnavailableError
from sim_backend.planes.metrics import MetricsRegistry
from sim_backend.planes.types import SLO, ChatRequest, RequestResult, StageTimes
from sim_backend.runtime import RuntimeSession
from sim_backend.serving.admission import Admission, foreseen_logits_refusal, logits_refusal, needs_logits, numerics_now
from sim_backend.serving.api import EngineView, RequestHandle, SlotInfo
from sim_backend.serving.gate import AdmissionGate
from sim_backend.serving.hosttime import HostBooking, HostTimer
from sim_backend.serving.intake import RequestIntake
from sim_backend.serving.kv_pressure import KVPressure
from sim_backend.serving.ledger import RequestLedger
from sim_backend.serving.requests import RequestRecord, Slot, slot_info, slot_states
from sim_backend.serving.scheduler import RoundScheduler, Work
from sim_backend.serving.slot_actions import SlotActionRunner
from sim_backend.serving.steps import InFlight, StepRunner, progress_event
from sim_backend.serving.streaming import Tokenizer

T = TypeVar("T")
log = logging.getLogger(__name__)


class Engine:
    """Slots + admission + scheduler thread over a ``RuntimeSession`` (its only door to the device).

    Args:
        rt: the runtime session (submission path, KV view, simulated clock); its parallel mode
            must match ``max_inflight`` (2 needs ping/pong).
        n_slots: concurrent sequences (default 4); each slot is a KV sequence id, at most the
            runtime's ``serving_sequences``.
        queue_limit: requests allowed to wait beyond the free slots; one more ->
            UnavailableError at once.
        prefill_chunk: max tokens per prefill job (CSR cur_seq_len), for fairness.
        max_inflight: 1 = serial infer()+Wait(); 2 = ping/pong overlap of host and device work.
        kv_timeout_s: bound on waiting for KV cells (host wall s), then KVExhausted.
        step_timeout_s: bound on Wait() for one device job (host wall s).
        numerics_max_prompt: a request that must prefill more prompt tokens than this (beyond a
            prefix reused from a numeric request's KV) runs timing-only:
            its tokens are drawn from the seeded generator, and the reply says so
            (exact numerics at long context are O(n^2) in Python; see README).
        host_timer: measures host work; ScriptedHostTimer makes timings deterministic.
        host_time: what host work goes on the simulated clock: ``"modeled"`` (default; the
            facts.md F7 allowance per sampled token, ``host_token_us``) or ``"measured"`` (this
            machine's measured work). See :class:`~sim_backend.serving.hosttime.HostBooking`.
        host_token_us: the modeled allowance, µs per sampled token; None takes the shipped cost
            model's ``host_overhead_ms_per_token``.
        metrics: the registry to record into (default a new one).
        slo: service-level objectives for goodput (``SLO(ttft_ms, tpot_ms, e2el_ms)``,
            simulated ms); default none (every finished request is good).
        n_ctx: context in tokens per sequence, at most the calbin's (default: the calbin's).
        chat_template: a ``model.chat_template.JinjaChatTemplate`` that replaces the bundle's chat template
            (``serve --chat-template-file``); None keeps the bundle's.
        context_shift: llama-server's ``--context-shift`` (default off, as there): ``serving.context_shift``.
    Raises ValueError for a bad size or a parallel mode that does not match ``max_inflight``.
    """

    def __init__(self, rt: RuntimeSession, *, n_slots: int = 4, queue_limit: int = 16, prefill_chunk: int = 2048,
                 max_inflight: int = 1, kv_timeout_s: float = 2.0, step_timeout_s: float = 120.0,
                 numerics_max_prompt: int = 1024, host_timer: HostTimer | None = None,
                 host_time: str = "modeled", host_token_us: float | None = None,
                 metrics: MetricsRegistry | None = None, slo: SLO | None = None, n_ctx: int | None = None,
                 chat_template: Any = None, context_shift: bool = False) -> None:
        if not 1 <= n_slots <= rt.serving_sequences:
            raise ValueError(f"n_slots must be in 1..{rt.serving_sequences} (the runtime's serving sequences)")
        if max_inflight not in (1, 2):
            raise ValueError("max_inflight must be 1 (serial) or 2 (ping/pong)")
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if rt.parallel != (max_inflight > 1):
            raise ValueError("max_inflight 2 needs a runtime session in parallel mode, 1 a serial one")
        if queue_limit < 0:
            raise ValueError("queue_limit must be >= 0")
        self.rt = rt
        #: context in tokens per sequence: the calbin's (facts.md F2) or a shorter one given (llama-server -c)
        self.n_ctx = rt.context if n_ctx is None else int(n_ctx)
        if not 1 <= self.n_ctx <= rt.context:
            raise ValueError(f"n_ctx must be in 1..{rt.context} (the calbin's context)")
        self.n_slots = n_slots
        self.max_inflight = max_inflight
        self.step_timeout_s = step_timeout_s
        self.numerics_max_prompt = numerics_max_prompt
        self.host_timer = host_timer or HostTimer()
        self.intake = RequestIntake(rt, n_ctx=self.n_ctx, n_slots=n_slots, host_timer=self.host_timer,
                                    chat_template=chat_template, context_shift=context_shift)
        #: the bundle's tokenizer (Qwen3's BPE, a GGUF's own for the dense pilot), with ``chat_template`` if given
        self.tokenizer: Tokenizer = self.intake.tokenizer
        if host_token_us is None:
            from sim_backend.model.costmodel import default_cost_model
            host_token_us = default_cost_model().host_overhead_ms_per_token * 1e3
        self.host_booking = HostBooking(host_time, host_token_us)
        self.metrics = metrics or MetricsRegistry(slo=slo or SLO())
        if slo is not None:
            self.metrics.slo = slo
        self.metrics.clock = f"simulated device ms + {self.host_booking.describe()}"
        self.slots = [Slot(i) for i in range(n_slots)]
        #: sequences one decode step may carry (the decode sub-model's batch: 1 today, N in a C3 variant)
        self.decode_batch = int(getattr(rt, "decode_batch", 1))
        self._admission = Admission(queue_limit)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._stop = False
        self._scheduler = RoundScheduler(n_slots, prefill_chunk, self.decode_batch)
        self.kv = KVPressure(rt.kv, rt.clock, self.host_timer, n_ctx=self.n_ctx, timeout_s=kv_timeout_s,
                             end_failed=lambda r, err: self._end_locked(r, "failed", "none", err))
        self._ledger = RequestLedger(self.metrics, self.host_booking.mode)
        self._steps = StepRunner(rt, self.kv, self.slots, lock=self._lock, wake=self._wake, end=self._end_locked,
                                 metrics=self.metrics, host_timer=self.host_timer, host_booking=self.host_booking,
                                 decode_batch=self.decode_batch, step_timeout_s=step_timeout_s)
        #: {"parked_requests", "timeouts", "wait_wall_ms"}: requests parked on KV, ended for KV, wall ms waited
        self.kv_stats = self.kv.stats
        #: recent requests ended for KV pressure, with the numbers of each decision (``KVPressure.log``)
        self.kv_pressure_log = self.kv.log
        #: the last step of each kind ("prefill", "decode", maintenance steps included); recent served steps;
        #: recent batched decode steps (empty with a batch-1 calbin): see ``StepRunner``
        self.last_stage = self._steps.last_stage
        self.stage_history = self._steps.stage_history
        self.batch_log = self._steps.batch_log
        #: the maintenance plane's pause / drain / resume of admission (``AdmissionGate``)
        self.gate = AdmissionGate(self._admission, self._running_locked, lock=self._lock, wake=self._wake,
                                  clock=rt.clock, step_timeout_s=step_timeout_s)
        #: llama-server's slot save / restore / erase on idle slots (``SlotActionRunner``)
        self.slot_actions = SlotActionRunner(rt, self.slots, self._admission, lock=self._lock, wake=self._wake,
                                             stopped=lambda: self._stop, kv_timeout_s=kv_timeout_s)
        #: an arrival feed (the trace replay's reference run; None when serving): called by the scheduler
        #: thread at every step boundary, without the lock, with ``idle`` = no step in flight
        self._feed: Callable[[bool], None] | None = None
        self._thread = threading.Thread(target=self._loop, name="calconsole-engine", daemon=True)
        self._thread.start()

    # --- what the planes and tests read ------------------------------------------------

    @property
    def slo(self) -> SLO:
        """Goodput SLOs (simulated ms)."""
        return self.metrics.slo

    @property
    def prefill_chunk(self) -> int:
        """Most prompt tokens one prefill step carries (CSR cur_seq_len)."""
        return self._scheduler.prefill_chunk

    @property
    def queue_limit(self) -> int:
        return self._admission.queue_limit

    @property
    def kv_timeout_s(self) -> float:
        """Bound on a request's wait for KV cells (host wall s)."""
        return self.kv.timeout_s

    # --- client API --------------------------------------------------------------------

    def tokenize_prompt(self, req: ChatRequest) -> list[int]:
        """Prompt token ids with the chat template applied (what counts against the context);
        a raw ``prompt_tokens`` request's own ids (``RequestIntake.tokenize_prompt``)."""
        return self.intake.tokenize_prompt(req)

    def _running_locked(self) -> list[RequestRecord]:
        return [s.req for s in self.slots if s.req is not None]

    def _live_locked(self) -> tuple[int, int, float]:
        occ = self.rt.kv.occupancy()
        return len(self._admission.queue), len(self._running_locked()), occ.used_cells / max(1, occ.capacity_cells)

    def _refuse(self, e: Exception) -> NoReturn:
        self.metrics.on_rejected()
        raise e

    def attach_feed(self, feed: Callable[[bool], None]) -> None:
        """Let ``feed(idle)`` submit requests at step boundaries (``submit(req, arrival_us=...)``): the trace
        replay's token-by-token reference (``sim_backend.tools.replay_engine``), where arrivals come on the
        simulated clock, not the host's. ``idle``: no device step is in flight; the feed may then move the
        clock to its next arrival. Called from the scheduler thread; it must not block."""
        self._feed = feed
        self.wake()

    def submit(self, req: ChatRequest, *, arrival_us: float | None = None) -> RequestHandle:
        """Validate, tokenise and enqueue. Returns a handle at once.

        ``arrival_us``: when the request arrived on the simulated clock (an arrival feed's, at most now);
        None = now.

        Raises (nothing allocated, no counter but ``rejected`` moves):
        InvalidRequestError (also a grammar that does not compile, and ``n_probs`` or ``logit_bias`` for a request
        that would run timing-only: no logits to give or bias; ``admission.logits_refusal``), ExceedContextSizeError
        (prompt >= n_ctx = 40960 tokens), UnavailableError (queue full, or device in maintenance).

        A request's grammar is compiled in its tokenising host span (``RequestIntake.prepare``).
        """
        with self._lock:
            why = self._admission.refusal(self._stop)
        if why is not None:
            self._refuse(UnavailableError(why))
        try:
            self.intake.validate(req)
        except InvalidRequestError as e:
            self._refuse(e)
        arrival = self.rt.clock.now_us if arrival_us is None else min(float(arrival_us), self.rt.clock.now_us)
        try:
            prompt, matcher, tok_us = self.intake.prepare(req)
        except (ExceedContextSizeError, InvalidRequestError) as e:
            self._refuse(e)
        with self._lock:
            why = self._admission.refusal(self._stop)
            try:
                if why is not None:
                    raise UnavailableError(why)
                self._admission.check_room(sum(1 for s in self.slots if s.req is None))
            except UnavailableError as e:
                self._refuse(e)
            refusal = foreseen_logits_refusal(self.rt, self.slots, prompt, req,
                                              numerics_max_prompt=self.numerics_max_prompt)
            if refusal is not None:
                self._refuse(refusal)
            rid = next(self._ids)
            handle = RequestHandle(rid, len(prompt))
            tokens = self.intake.pipeline(req, prompt, matcher)
            r = RequestRecord(rid, req, prompt, handle, arrival / 1e3, tok_us / 1e3, tokens)
            handle._engine_wake = functools.partial(self._on_cancel, rid)
            handle._limit_now = tokens.limit_now
            booked_us = self.host_booking.before(tok_us)
            self.rt.clock.host_span(arrival, booked_us)  # tokenising is host work on the request's clock
            r.host_booked_ms += booked_us / 1e3
            r.tokenized_ms = (arrival + booked_us) / 1e3
            self._admission.queue.append(r)
            self.metrics.on_submitted(live=self._live_locked())
            # a free slot takes the request now, not when the scheduler finishes its current step:
            # queue time then measures waiting for a slot, nothing else
            self._admit_locked()
            self._wake.notify_all()
        return handle

    def generate(self, req: ChatRequest, timeout: float = 600.0) -> RequestResult:
        """Submit and wait for the final result (headless convenience); a wait that ends abnormally (timeout,
        Ctrl-C) cancels the request."""
        h = self.submit(req)
        try:
            return h.result(timeout)
        except BaseException:
            h.cancel("caller interrupted")  # a vanished client counts as a cancel
            raise

    # --- what the maintenance plane reads (its hold on admission is ``gate``) ---------------

    def active_count(self) -> int:
        with self._lock:
            return len(self._admission.queue) + len(self._running_locked())

    def queued_count(self) -> int:
        """Requests waiting for a slot."""
        with self._lock:
            return len(self._admission.queue)

    def slot_info(self) -> list[SlotInfo]:
        """One ``SlotInfo`` per slot (its request's counts and sampling parameters; idle slots their cache)."""
        with self._lock:
            Admission.drop_stale_caches(self.slots, self.rt.kv.epoch)
            return [slot_info(s) for s in self.slots]

    def _tokens_generated_locked(self) -> int:
        # ended requests' (the metrics' predicted) plus those in the slots now, under the engine lock: a request
        # ending meanwhile is counted exactly once (read apart, a sample's rate once rose by its tokens)
        return self.metrics.predicted_tokens + sum(len(s.req.generated) for s in self.slots if s.req is not None)

    def observe(self, read_kv: Callable[[], T]) -> EngineView[T]:
        """The engine's observable state at one instant: ``read_kv()`` (the caller's KV occupancy read), the
        slots, the request metrics' summary and the tokens generated so far, all under one hold of the
        engine lock. The engine frees a cancelled request's KV and counts it under that lock, so no view
        shows a request counted as ended with its KV still held (read apart, CI saw one). Costs the caller's
        read plus ~0.1 ms (the summary's percentiles are cached per new sample, ~1 ms when one arrived)."""
        with self._lock:
            Admission.drop_stale_caches(self.slots, self.rt.kv.epoch)
            return EngineView(kv=read_kv(), slots=[slot_info(s) for s in self.slots],
                              requests=self.metrics.summary(), tokens_generated=self._tokens_generated_locked(),
                              kv_stats=dict(self.kv_stats))

    def buffer_pool_state(self, timeout: float = 0.0) -> tuple[int, int]:
        """(free, size) of the device buffer pairs, after waiting up to ``timeout`` host s for all to be free: the
        maintenance health check's (after a reset every job has ended, so a pair not back is one whose job hung)."""
        return self.rt.pool.wait_all_free(timeout), self.rt.pool.size

    def record_stages(self, res: Any, *, source: str, framework_ms: float = 0.0,
                      sampling_ms: float = 0.0) -> StageTimes:
        """Show a step the engine did not schedule (a maintenance probe, self-test or health check) as the last step
        of its kind in ``last_stage``. ``res``: the device's StepResult (device stages from its cost, simulated ms);
        ``framework_ms`` / ``sampling_ms``: measured host ms of the caller. Not added to ``stage_history``: the stage
        percentiles stay those of served requests."""
        return self._steps.record_external(res, source=source, framework_ms=framework_ms, sampling_ms=sampling_ms)

    def stage_summary(self) -> dict[str, Any]:
        """P50/P95/P99/mean of each stage (facts.md F8) over the recent steps, per kind (``StepRunner``)."""
        return self._steps.stage_summary()

    def close(self, join_timeout_s: float | None = None) -> bool:
        """Stop the scheduler; every unfinished request is cancelled ("engine shutting down") and gets its result.
        Waits for the scheduler thread ``join_timeout_s`` host s (default: a step's bound when requests were
        running, else 5 s); True when it ended (False: a step still in flight, e.g. on a hung device)."""
        with self._lock:
            pending = list(self._admission.queue) + self._running_locked()
        for r in pending:
            r.handle.cancel("engine shutting down")
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        default = max(5.0, self.step_timeout_s if pending else 5.0)
        self._thread.join(timeout=default if join_timeout_s is None else join_timeout_s)
        return not self._thread.is_alive()

    def wake(self) -> None:
        """Let the scheduler look at its state now (an observer read: cancels and KV retries are seen at once)."""
        with self._lock:
            self._wake.notify_all()

    def _on_cancel(self, rid: int) -> None:
        """A handle was cancelled: a queued request ends at once (it holds nothing);
        a running one is ended by the scheduler within one device step."""
        with self._lock:
            for r in self._admission.queue:
                if r.id == rid:
                    self._end_locked(r, "cancelled", "none", None)
                    break
            self._wake.notify_all()

    # --- scheduler thread --------------------------------------------------------------

    def _admit_locked(self) -> None:
        Admission.drop_stale_caches(self.slots, self.rt.kv.epoch)

        def assigned(s: Slot) -> None:
            self._scheduler.slot_changed(s.idx)
            self.metrics.set_live(*self._live_locked())
            r = s.req
            if r is not None and needs_logits(r.req) and not r.numeric:
                # foreseen numeric at submit, timing-only now (the cache it counted on was replaced): no logits
                self._end_locked(r, "failed", "none", logits_refusal(r.req, r.timing_only_reason).to_dict())
                return
            if r is not None and r.req.return_progress:  # llama-server's 0 % event: the request has started
                r.handle.emit(progress_event(r, 0.0))

        numerics, why_not = numerics_now(self.rt)  # a worker still starting or down: admitted timing-only
        self._admission.assign(self.slots, self.rt.kv, lambda: self.rt.clock.now_us / 1e3,
                               numerics=numerics, numerics_off_why=why_not,
                               numerics_max_prompt=self.numerics_max_prompt,
                               on_assigned=assigned)

    def _reap_cancelled_locked(self, busy: set[int]) -> None:
        for r in [q for q in self._admission.queue if q.handle.cancelled]:
            self._end_locked(r, "cancelled", "none", None)
        for r in self._running_locked():
            if r.handle.cancelled and id(r) not in busy:
                self._end_locked(r, "cancelled", "none", None)

    def _loop(self) -> None:
        inflight: deque[InFlight] = deque()
        while True:
            if self._feed is not None and not self._stop:
                try:
                    self._feed(not inflight)
                except Exception:  # noqa: BLE001 - a feed's bug must not stop the scheduler
                    log.exception("arrival feed failed; detached")
                    self._feed = None
            with self._lock:
                busy = {id(r) for step in inflight for r in step.riders}
                self._reap_cancelled_locked(busy)
                if self._stop and not inflight:
                    # close(): end whatever is left (queued requests never started)
                    for r in list(self._admission.queue) + self._running_locked():
                        self._end_locked(r, "cancelled", "none", None)
                    return
                self._admit_locked()
                self.kv.check_deadlines(self._running_locked(), busy)
                work: Work | None = None
                if len(inflight) < self.max_inflight and not self._stop:
                    work = self._scheduler.next(slot_states(self.slots, busy, time.monotonic()))
                if work is None and not inflight:
                    if self.kv.break_deadlock(self._running_locked(), self.slots):
                        continue
                    self._wake.wait(self.kv.idle_wait_s(self._running_locked()))
                    continue
                riders = [] if work is None else [r for r in (self.slots[i].req for i in work.slots) if r is not None]
            started = None if work is None else self._steps.launch(work.kind, riders, work.n_tokens)
            if started is not None:
                inflight.append(started)
                if len(inflight) < self.max_inflight:
                    continue  # ping/pong: submit a second job before waiting the first
            if inflight:
                self._steps.complete(inflight.popleft())

    def _end_locked(self, r: RequestRecord, status: str, stop_type: str, error: dict[str, Any] | None,
                    stopping_word: str = "", done_ms: float | None = None) -> None:
        """Finish a request: free its slot (and its KV on cancel/failure), record metrics, deliver the result."""
        if r.ended:
            return
        self.kv.settle(r)  # ended while parked on KV (cancel, drain, deadlock): book the wait
        now_ms = self.rt.clock.now_us / 1e3 if done_ms is None else done_ms
        self._admission.forget(r)
        s = r.slot
        if s is not None:
            s.last = slot_info(s)  # an idle slot shows its last request (llama-server's /slots)
            s.req = None
            s.last_used = now_ms
            self._scheduler.slot_changed(s.idx)
            if status != "finished":
                # cancelled/failed: free this sequence's KV now (the in-flight step, if any, has ended)
                self.rt.kv.free(s.seq_id)
                s.cache_tokens = []
        self._ledger.close(r, status, stop_type, error, stopping_word=stopping_word, now_ms=now_ms,
                           live=self._live_locked())
        self._wake.notify_all()
