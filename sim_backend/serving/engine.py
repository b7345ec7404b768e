"""Serving engine: the llama.cpp-server layer over the simulated device (facts.md F1).

Slots over the device, a bounded admission queue, chunked prefill and decode scheduled in rounds,
CPU sampling, stop rules, streaming with UTF-8-safe detokenisation and stop-string holdback,
per-request metrics. The engine is the thread and the lock; its parts are modules of their own:

- ``admission``: the queue and the slot choice (longest cached prefix, then LRU);
- ``scheduler``: the round rule, pure (slot states in, the next step out);
- ``steps``: the step runner (KV cells, one job, each rider's part; batch 1 is the N = 1 case);
- ``tokens``: each request's token pipeline (sampler, stop rules, visible text);
- ``ledger``: each request's end (timings, result, metrics);
- ``kv_pressure``: the KV parking and request-ending policy;
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
import os
import threading
import time
from collections import deque
from typing import Any, NoReturn

import numpy as np

from sim_backend.errors import (
    ExceedContextSizeError,
    InvalidRequestError,
    KVArgumentError,
    KVExhausted,
    KVStateFileError,
    UnavailableError,
)
from sim_backend.model.families import tokenizer_for
from sim_backend.model.vocab import N_BPE
from sim_backend.planes.metrics import MetricsRegistry
from sim_backend.planes.types import SLO, ChatRequest, RequestResult, StageTimes, validate_request
from sim_backend.runtime import RuntimeSession
from sim_backend.serving import grammar as _grammar
from sim_backend.serving.admission import Admission, check_prompt
from sim_backend.serving.api import RequestHandle, SlotInfo
from sim_backend.serving.hosttime import HostBooking, HostTimer
from sim_backend.serving.kv_pressure import KVPressure
from sim_backend.serving.ledger import RequestLedger
from sim_backend.serving.requests import RequestRecord, Slot, slot_info, slot_states
from sim_backend.serving.scheduler import RoundScheduler, Work
from sim_backend.serving.steps import InFlight, StepRunner, progress_event
from sim_backend.serving.streaming import Tokenizer
from sim_backend.serving.tokens import TokenPipeline


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
    Raises ValueError for a bad size or a parallel mode that does not match ``max_inflight``.
    """

    def __init__(self, rt: RuntimeSession, *, n_slots: int = 4, queue_limit: int = 16, prefill_chunk: int = 2048,
                 max_inflight: int = 1, kv_timeout_s: float = 2.0, step_timeout_s: float = 120.0,
                 numerics_max_prompt: int = 1024, host_timer: HostTimer | None = None,
                 host_time: str = "modeled", host_token_us: float | None = None,
                 metrics: MetricsRegistry | None = None, slo: SLO | None = None, n_ctx: int | None = None,
                 chat_template: Any = None) -> None:
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
        # the bundle's tokenizer (Qwen3's BPE, or a GGUF's own for the dense pilot); a stand-in runtime
        # without a bundle gets Qwen3's
        self.tokenizer: Tokenizer = tokenizer_for(getattr(rt, "bundle", None))
        if chat_template is not None:
            from sim_backend.model.chat_template import TemplatedTokenizer
            self.tokenizer = TemplatedTokenizer(self.tokenizer, chat_template)
        self._eos_ids = frozenset(self.tokenizer.eos_ids)
        #: token ids the timing-only stand-in draws from: the tokenizer's ordinary text tokens
        lo, hi = getattr(self.tokenizer, "text_id_range", (0, N_BPE))
        self._text_ids = (int(lo), int(hi))
        #: context in tokens per sequence: the calbin's (facts.md F2) or a shorter one given (llama-server -c)
        self.n_ctx = rt.context if n_ctx is None else int(n_ctx)
        if not 1 <= self.n_ctx <= rt.context:
            raise ValueError(f"n_ctx must be in 1..{rt.context} (the calbin's context)")
        self.n_slots = n_slots
        self.max_inflight = max_inflight
        self.step_timeout_s = step_timeout_s
        self.numerics_max_prompt = numerics_max_prompt
        self.host_timer = host_timer or HostTimer()
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
        a raw ``prompt_tokens`` request's own ids."""
        if req.prompt_tokens is not None:
            return [int(t) for t in req.prompt_tokens]
        return self.tokenizer.encode_chat(list(req.messages), add_generation_prompt=req.add_generation_prompt,
                                          enable_thinking=req.enable_thinking,
                                          continue_final_message=req.continue_final_message,
                                          template_kwargs=req.template_kwargs)

    def _running_locked(self) -> list[RequestRecord]:
        return [s.req for s in self.slots if s.req is not None]

    def _live_locked(self) -> tuple[int, int, float]:
        occ = self.rt.kv.occupancy()
        return len(self._admission.queue), len(self._running_locked()), occ.used_cells / max(1, occ.capacity_cells)

    def _refuse(self, e: Exception) -> NoReturn:
        self.metrics.on_rejected()
        raise e

    def submit(self, req: ChatRequest) -> RequestHandle:
        """Validate, tokenise and enqueue. Returns a handle at once.

        Raises (nothing allocated, no counter but ``rejected`` moves):
        InvalidRequestError (also a grammar that does not compile), ExceedContextSizeError
        (prompt >= n_ctx = 40960 tokens), UnavailableError (queue full, or device in maintenance).

        A request's grammar is compiled here, in its tokenising host span (booked as ``tokenize``);
        the process's one-off llguidance tokenizer build (``serving.grammar.lltokenizer``) is not.
        """
        with self._lock:
            why = self._admission.refusal(self._stop)
        if why is not None:
            self._refuse(UnavailableError(why))
        try:
            validate_request(req, self.rt.vocab)
        except InvalidRequestError as e:
            self._refuse(e)
        arrival = self.rt.clock.now_us
        matcher: _grammar.GrammarMatcher | None = None
        if req.grammar is not None:  # once per process: llama.cpp's model-load work, not this request's
            _grammar.lltokenizer(self.tokenizer, int(self.rt.vocab), self._eos_ids)
        try:
            t0 = self.host_timer.now()
            prompt = self.tokenize_prompt(req)
            if req.grammar is not None:
                matcher = _grammar.compile_grammar(req.grammar, self.tokenizer, int(self.rt.vocab), self._eos_ids)
            tok_us = self.host_timer.now() - t0
            check_prompt(len(prompt), req.id_slot, n_ctx=self.n_ctx, n_slots=self.n_slots,
                         kv_cells=self.rt.kv.occupancy().capacity_cells)
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
            rid = next(self._ids)
            handle = RequestHandle(rid, len(prompt))
            tokens = TokenPipeline(req, prompt, n_ctx=self.n_ctx, max_tokens=int(req.max_tokens or 0),
                                   tokenizer=self.tokenizer, vocab=int(self.rt.vocab), eos_ids=self._eos_ids,
                                   text_ids=self._text_ids, grammar=matcher)
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
        """Submit and wait for the final result (headless convenience).

        If the wait ends abnormally (timeout, Ctrl-C) the request is cancelled.
        """
        h = self.submit(req)
        try:
            return h.result(timeout)
        except BaseException:
            h.cancel("caller interrupted")  # a vanished client counts as a cancel
            raise

    # --- admission control (maintenance plane) ------------------------------------------

    def pause_admission(self, reason: str) -> None:
        """Refuse new requests with UnavailableError(reason) until ``resume_admission``."""
        with self._lock:
            self._admission.admitting = False
            self._admission.refuse_reason = reason

    def resume_admission(self) -> None:
        with self._lock:
            self._admission.admitting = True
            self._admission.refuse_reason = ""

    @property
    def admitting(self) -> bool:
        with self._lock:
            return self._admission.admitting

    def active_count(self) -> int:
        with self._lock:
            return len(self._admission.queue) + len(self._running_locked())

    def queued_count(self) -> int:
        """Requests waiting for a slot."""
        with self._lock:
            return len(self._admission.queue)

    def drain(self, timeout_s: float, reason: str) -> dict[str, float]:
        """Wait up to ``timeout_s`` host seconds for in-flight requests to end, then cancel the rest with ``reason``.

        Returns {"drained": n ended on their own, "cancelled": n cancelled, "wall_ms", "sim_ms"}.
        Admission should be paused first. Bounded: never waits past timeout + one device step.
        """
        t0 = time.perf_counter()
        sim0 = self.rt.clock.now_us
        with self._lock:
            initial = {r.id: r for r in self._admission.queue} | {r.id: r for r in self._running_locked()}
            deadline = t0 + timeout_s
            while (self._admission.queue or self._running_locked()) and time.perf_counter() < deadline:
                self._wake.wait(min(0.05, max(0.0, deadline - time.perf_counter())))
            remaining = [r for r in initial.values() if not r.ended]
        for r in remaining:
            r.handle.cancel(reason)
        # cancels take effect within one device step; wait for them (bounded)
        end = time.perf_counter() + self.step_timeout_s
        for r in remaining:
            r.handle._done.wait(max(0.0, end - time.perf_counter()))
        return {"drained": len(initial) - len(remaining), "cancelled": len(remaining),
                "wall_ms": (time.perf_counter() - t0) * 1e3, "sim_ms": (self.rt.clock.now_us - sim0) / 1e3}

    def slot_info(self) -> list[SlotInfo]:
        """One ``SlotInfo`` per slot (its request's counts and sampling parameters; idle slots their cache)."""
        with self._lock:
            Admission.drop_stale_caches(self.slots, self.rt.kv.epoch)
            return [slot_info(s) for s in self.slots]

    # --- slot actions (llama-server's POST /slots/{id}?action=save|restore|erase) ----------------

    def _take_slot(self, idx: Any, action: str) -> Slot:
        """Reserve slot ``idx`` for ``action`` (nothing assigns it or evicts its cells until ``_give_back``).
        InvalidRequestError for no such slot; UnavailableError while it serves a request or another action, or
        while admission is stopped (maintenance: a reset or KV clear must not meet a restore half way)."""
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < self.n_slots:
            raise InvalidRequestError(f"Invalid slot ID: {idx!r} (slots 0..{self.n_slots - 1})", param="id_slot")
        with self._lock:
            why = self._admission.refusal(self._stop)
            if why is not None:
                raise UnavailableError(why)
            Admission.drop_stale_caches(self.slots, self.rt.kv.epoch)
            s = self.slots[idx]
            if s.req is not None or s.action is not None:
                what = f"request {s.req.id}" if s.req is not None else f"a slot {s.action}"
                raise UnavailableError(f"slot {idx} is busy ({what}); try again once it is idle")
            s.action = action
            return s

    def _give_back(self, s: Slot) -> None:
        with self._lock:
            s.action = None
            self._wake.notify_all()  # a request waiting for this slot (id_slot) may take it now

    def save_slot(self, idx: int, path: str) -> dict[str, Any]:
        """Save idle slot ``idx``'s cached prefix to ``path`` (``KVView.save_seq_state``: its cells' positions,
        the prompt tokens they hold and whether they hold values, and the device's K/V rows when it computes
        them). Returns {"n_saved": tokens, "n_written": file bytes, "save_ms": host wall ms}.

        Raises InvalidRequestError (no such slot, the file cannot be written), UnavailableError (slot busy).
        """
        s = self._take_slot(idx, "save")
        t0 = time.perf_counter()
        try:
            tokens = list(s.cache_tokens)
            cells, pos = self.rt.kv.seq_cells(s.seq_id)
            meta = np.full((2, int(self.rt.kv.n_cells)), -1, dtype=np.int64)  # token, holds values (1/0)
            held = pos < len(tokens)
            meta[0, cells[held]] = np.asarray(tokens, dtype=np.int64)[pos[held]]
            meta[1, cells] = 1 if s.cache_numeric else 0
            try:
                n = self.rt.kv.save_seq_state(s.seq_id, path, [(meta, 1)], values=self.rt.kv_values())
            except KVStateFileError as e:
                raise InvalidRequestError(f"Unable to save slot {idx}: {e.reason}") from None
            return {"n_saved": int(n), "n_written": os.path.getsize(path),
                    "save_ms": (time.perf_counter() - t0) * 1e3}
        finally:
            self._give_back(s)

    def restore_slot(self, idx: int, path: str) -> dict[str, Any]:
        """Replace idle slot ``idx``'s KV with a state ``save_slot`` wrote (all or nothing): its cells, the
        prompt tokens they hold (the slot's cached prefix: the next request sharing it reuses them, as
        ``tokens_cached`` shows) and the K/V values. Returns {"n_restored", "n_read": file bytes,
        "restore_ms": host wall ms}.

        Raises InvalidRequestError ("Unable to restore slot": missing, damaged or foreign file, not
        enough free KV cells within the KV timeout), UnavailableError (slot busy).
        """
        s = self._take_slot(idx, "restore")
        t0 = time.perf_counter()
        try:
            meta = np.full((2, int(self.rt.kv.n_cells)), -1, dtype=np.int64)
            try:
                n = self.rt.kv.load_seq_state(s.seq_id, path, [(meta, 1)], timeout=self.kv.timeout_s,
                                              values=self.rt.kv_values())
            except (KVArgumentError, KVExhausted) as e:
                reason = getattr(e, "reason", None) or str(e)
                raise InvalidRequestError("Unable to restore slot: No available space in KV cache or invalid "
                                          f"slot save file ({reason})") from None
            cells, pos = self.rt.kv.seq_cells(s.seq_id)
            toks, flags = meta[0, cells], meta[1, cells]
            vocab = int(self.rt.vocab)
            if not (np.array_equal(pos, np.arange(n)) and bool(np.all((toks >= 0) & (toks < vocab)))):
                self.rt.kv.free(s.seq_id)
                with self._lock:
                    s.cache_tokens = []
                raise InvalidRequestError(f"Unable to restore slot: the file holds no prompt prefix (positions "
                                          f"0..n-1 with token ids below {vocab}); slot {idx} was erased")
            with self._lock:
                s.cache_tokens = [int(t) for t in toks]
                s.cache_numeric = bool(n) and bool(np.all(flags == 1)) and self.rt.kv_values() is not None
                s.cache_epoch = self.rt.kv.epoch
                s.last_used = self.rt.clock.now_us / 1e3
            return {"n_restored": int(n), "n_read": os.path.getsize(path),
                    "restore_ms": (time.perf_counter() - t0) * 1e3}
        finally:
            self._give_back(s)

    def erase_slot(self, idx: int) -> dict[str, Any]:
        """Free idle slot ``idx``'s cached cells. Returns {"n_erased": tokens it held}.
        Raises InvalidRequestError (no such slot), UnavailableError (slot busy)."""
        s = self._take_slot(idx, "erase")
        try:
            with self._lock:
                n = len(s.cache_tokens)
                self.rt.kv.free(s.seq_id)
                s.cache_tokens = []
            return {"n_erased": n}
        finally:
            self._give_back(s)

    def tokens_generated(self) -> int:
        """Tokens generated since start: ended requests' (the metrics' predicted) plus those of the requests in
        the slots now, read under the engine lock, so a request ending meanwhile is counted exactly once (read
        apart, its tokens were in neither count for one sample and the next sample's rate rose by them)."""
        with self._lock:
            return self.metrics.predicted_tokens + sum(len(s.req.generated) for s in self.slots if s.req is not None)

    def buffer_pool_state(self, timeout: float = 0.0) -> tuple[int, int]:
        """(free, size) of the device buffer pairs, after waiting up to ``timeout`` host s for all to be free.

        Used by the maintenance health check: after a reset every job has ended,
        so every pair must come back (a pair whose job never ends stays out).
        """
        return self.rt.pool.wait_all_free(timeout), self.rt.pool.size

    def record_stages(self, res: Any, *, source: str, framework_ms: float = 0.0,
                      sampling_ms: float = 0.0) -> StageTimes:
        """Show a step the engine did not schedule (a maintenance probe, self-test or health check)
        as the last step of its kind in ``last_stage``.

        ``res``: the device's StepResult (device stages from its cost, simulated ms);
        ``framework_ms`` / ``sampling_ms``: measured host ms of the caller. Not added to
        ``stage_history``: the stage percentiles stay those of served requests.
        """
        return self._steps.record_external(res, source=source, framework_ms=framework_ms, sampling_ms=sampling_ms)

    def stage_summary(self) -> dict[str, Any]:
        """P50/P95/P99/mean of each stage (facts.md F8) over the recent steps, per kind (``StepRunner``)."""
        return self._steps.stage_summary()

    def close(self) -> None:
        """Stop the scheduler; every unfinished request is cancelled ("engine shutting down") and gets its result."""
        with self._lock:
            pending = list(self._admission.queue) + self._running_locked()
        for r in pending:
            r.handle.cancel("engine shutting down")
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=max(5.0, self.step_timeout_s if pending else 5.0))

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
            if r is not None and r.req.return_progress:  # llama-server's 0 % event: the request has started
                r.handle.emit(progress_event(r, 0.0))

        self._admission.assign(self.slots, self.rt.kv, lambda: self.rt.clock.now_us / 1e3,
                               numerics=self.rt.numerics, numerics_max_prompt=self.numerics_max_prompt,
                               on_assigned=assigned)

    def _reap_cancelled_locked(self, busy: set[int]) -> None:
        for r in [q for q in self._admission.queue if q.handle.cancelled]:
            self._end_locked(r, "cancelled", "none", None)
        for r in self._running_locked():
            if r.handle.cancelled and id(r) not in busy:
                self._end_locked(r, "cancelled", "none", None)

    def _idle_wait_s(self) -> float:
        """How long the idle scheduler sleeps: until the earliest KV retry, at most 0.25 s."""
        retry = self.kv.retry_at(self._running_locked())
        return 0.25 if retry is None else min(0.25, max(0.001, retry - time.monotonic()))

    def _loop(self) -> None:
        inflight: deque[InFlight] = deque()
        while True:
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
                    self._wake.wait(self._idle_wait_s())
                    continue
                riders = [] if work is None else [r for r in (self.slots[i].req for i in work.slots) if r is not None]
            if work is not None:
                started: InFlight | None = None
                try:
                    started = self._steps.start(work.kind, riders, work.n_tokens)
                except Exception as e:  # noqa: BLE001 - a bug must fail its requests, never the scheduler
                    for r in riders:
                        self._steps.fail_internal(r, e)
                if started is not None:
                    inflight.append(started)
                    if len(inflight) < self.max_inflight:
                        continue  # ping/pong: submit a second job before waiting the first
            if inflight:
                step = inflight.popleft()
                try:
                    self._steps.finish(step, self._steps.fail_internal)
                except Exception as e:  # noqa: BLE001 - see above
                    for r in step.riders:
                        self._steps.fail_internal(r, e)

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
