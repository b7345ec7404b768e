"""Serving engine: the llama.cpp-server layer over the simulated device (facts.md F1).

Slots over a batch-1 device, a bounded admission queue, chunked prefill and
decode scheduled from separate queues, CPU sampling, stop rules, streaming
with UTF-8-safe detokenisation and stop-string holdback, per-request metrics.

Admission: a request is validated and tokenised in ``submit`` (typed errors,
nothing allocated on error); it waits in a FIFO queue of at most
``queue_limit`` requests beyond the free slots (more -> ``UnavailableError``
at once) and takes the first free slot (the one sharing the longest cached
prefix with its prompt, then least recently used).

Scheduling rule (stated, tested): work goes in ROUNDS. A round runs ONE
decode step for each decoding slot (round-robin over slots), then ONE
prefill chunk (<= ``prefill_chunk`` tokens) for the next prefilling slot in
round-robin order; then the next round starts. Consequences: a decode never
waits behind more than one prefill chunk plus the other slots' decode steps;
a long prompt is cut into chunks, and prompts admitted after it get their
chunks between its chunks, so short prompts reach their first token while a
long one is still prefilling; a prefilling slot gets a chunk at least once
every ``n_slots`` rounds, so no request starves.

Continuous batching (a C3 variant calbin whose decode sub-model carries N > 1 sequences):
the same rounds, but the decoding slots of a round go in batched decode steps of up to N
(filled in round-robin order from the decoding slots that are ready), so each decode step
carries every ready decoding sequence up to N; sequences join when their prefill ends and leave
when they stop, between steps. Prefill chunks stay their own batch-1 submissions (facts.md F1:
prefill and decode never share one), one per round as above. A rider parked on KV, cancelled or
failed drops out of that step alone. With N = 1 (today's calbin) nothing of this path runs.

Stop rules (llama.cpp ``stop_type``): ``eos`` (an EOS id was sampled; it
counts in ``predicted_n`` but prints nothing), ``limit`` (``max_tokens``
reached, or the context end: prompt + generated tokens reached ``n_ctx``),
``word`` (a stop string appeared; it and everything after it
are dropped), ``none`` (cancelled or failed). Context boundary, as llama.cpp
counts it: a prompt of ``n_ctx`` = 40960 tokens or more (chat template
included) is refused with ``ExceedContextSizeError``; a prompt that fits is
accepted whatever ``max_tokens`` is and stops with ``limit`` when prompt +
generated reach ``n_ctx`` (40959 prompt tokens -> 1 token; 40958 -> 2), so
``usage.total_tokens`` never exceeds ``n_ctx``.

Clocks: request timestamps are SIMULATED device milliseconds on the board's
clock (``SimClock``). Host work (tokenising, KV apply, buffer set-up,
sampling, detokenising) is measured with ``host_timer`` (this thread's CPU
time, so waiting for the GIL behind the console's UI is not counted; scripted
in tests) and added to that clock (``SimClock.host_span``) before the device
step it precedes or after the step it follows, so TTFT is honest. Time a
request spends parked waiting for KV cells is wall time and is booked too.
``Timings.host_ms`` holds the measured host parts and ``Timings.device_ms``
the simulated device parts (h2d, infer, d2h).

KV pressure: a step that finds too few free cells (a prefill chunk asks for
up to ``prefill_chunk`` cells, a decode for 1) does not block the scheduler;
its request is parked and retried with back-off, and at once when cells come
back. Rule for ending requests (``_break_kv_deadlock_locked``,
``_kv_deadlines_locked``): end the fewest requests needed so the rest can make
progress, newest first; a request whose step fits the free cells is never
ended; a request that could finish with the pool to itself ("fits alone":
``min(prompt + max_tokens - 1, n_ctx) <= capacity``) is never ended while one
that cannot fit alone still holds cells (those go first, whatever their age).
- Every running request parked and none of their steps fits: idle prefix
  caches are evicted; then holders are ended one at a time (cannot-fit-alone
  first, then the newest) until some survivor's step fits.
- A request parked for its own deadline (``kv_timeout_s``) while others hold
  the cells: cannot-fit-alone holders are ended for it if that frees enough,
  or else one newer parked holder whose cells suffice; otherwise it fails.
Each ended request gets ``KVExhausted`` with its true numbers (the cells it
asked for, the cells free at that moment, the pool size, the time it waited)
and the reason; ``Engine.kv_pressure_log`` records each decision.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, TypeGuard

import msgspec
import numpy as np

from sim_backend.errors import (
    DeviceError,
    DeviceReset,
    ExceedContextSizeError,
    InvalidRequestError,
    KVExhausted,
    RequestCancelled,
    UnavailableError,
)
from sim_backend.model.families import tokenizer_for
from sim_backend.planes.metrics import MetricsRegistry, percentiles, request_latencies
from sim_backend.planes.types import (
    SLO,
    STAGES,
    ChatRequest,
    RequestResult,
    StageTimes,
    Timings,
    TokenEvent,
    validate_request,
)
from sim_backend.runtime import OutputBuf, RuntimeSession
from sim_backend.serving.api import RequestHandle, RequestState, SlotInfo
from sim_backend.serving.api import error_dict as _err
from sim_backend.serving.hosttime import HostBooking, HostTimer, ScriptedHostTimer  # noqa: F401
from sim_backend.serving.kv_pressure import KVPressure, _Request, _Slot

log = logging.getLogger(__name__)


def _add_device_ms(r: _Request, e: DeviceError) -> None:
    """Add the simulated device time a failed job occupied (``DeviceError.device_ms``) to the request's parts."""
    for k, v in (e.device_ms or {}).items():
        if k in r.device:
            r.device[k] += float(v)


class Engine(KVPressure):
    """Slots + admission + scheduler thread over a ``RuntimeSession`` (its only door to the device).

    Args:
        rt: the runtime session (submission path, KV view, simulated clock); its parallel mode
            must match ``max_inflight`` (2 needs ping/pong).
        n_slots: concurrent sequences (default 4); each slot is a KV sequence id.
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
    """

    def __init__(self, rt: RuntimeSession, *, n_slots: int = 4, queue_limit: int = 16, prefill_chunk: int = 2048,
                 max_inflight: int = 1, kv_timeout_s: float = 2.0, step_timeout_s: float = 120.0,
                 numerics_max_prompt: int = 1024, host_timer: HostTimer | None = None,
                 host_time: str = "modeled", host_token_us: float | None = None,
                 metrics: MetricsRegistry | None = None, slo: SLO | None = None) -> None:
        if n_slots < 1 or n_slots > 63:  # sequence 63 is the maintenance plane's scratch sequence
            raise ValueError("n_slots must be in 1..63")
        if max_inflight not in (1, 2):
            raise ValueError("max_inflight must be 1 (serial) or 2 (ping/pong)")
        if queue_limit < 0:
            raise ValueError("queue_limit must be >= 0")
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        if rt.parallel != (max_inflight > 1):
            raise ValueError("max_inflight 2 needs a runtime session in parallel mode, 1 a serial one")
        self.rt = rt
        # requests that found the KV full and were parked; those that hit their deadline; host wall ms waited
        self.kv_stats = {"parked_requests": 0, "timeouts": 0, "wait_wall_ms": 0.0}
        #: recent requests ended for KV pressure: dicts with request_id, cause (deadline | deadlock | for_other),
        #: requested / free / capacity / held cells, fits_alone, and "others" (what each other running request
        #: held then). Read by tests and diagnostics; bounded.
        self.kv_pressure_log: deque[dict] = deque(maxlen=512)
        # the bundle's tokenizer (Qwen3's BPE, or a GGUF's own for the dense pilot); a stand-in runtime
        # without a bundle gets Qwen3's
        self.tokenizer = tokenizer_for(getattr(rt, "bundle", None))
        self._eos_ids = frozenset(self.tokenizer.eos_ids)
        #: token ids the timing-only stand-in draws from: the tokenizer's ordinary text tokens
        self._text_ids = tuple(getattr(self.tokenizer, "text_id_range", (0, 151643)))
        self.n_ctx = rt.context
        self.n_slots = n_slots
        self.queue_limit = queue_limit
        self.prefill_chunk = prefill_chunk
        self.max_inflight = max_inflight
        self.kv_timeout_s = kv_timeout_s
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
        self.slots = [_Slot(i) for i in range(n_slots)]
        self._queue: deque[_Request] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._admitting = True
        self._refuse_reason = ""
        self._rr_decode = 0
        self._rr_prefill = 0
        self._round_served: set[int] = set()  # slots whose decode ran in the current round
        self._stop = False
        self.last_stage: dict[str, StageTimes] = {}
        self.stage_history: deque[StageTimes] = deque(maxlen=2000)
        #: sequences one decode step may carry (the decode sub-model's batch: 1 today, N in a C3 variant)
        self.decode_batch = int(getattr(rt, "decode_batch", 1))
        #: recent batched decode steps: {"job_id", "occupancy", "capacity", "slots", "request_ids",
        #: "sim_end_ms"} (simulated ms); empty with a batch-1 calbin
        self.batch_log: deque[dict] = deque(maxlen=64)
        self._thread = threading.Thread(target=self._loop, name="calconsole-engine", daemon=True)
        self._thread.start()

    # --- client API ------------------------------------------------------------------

    @property
    def slo(self) -> SLO:
        """Goodput SLOs (simulated ms)."""
        return self.metrics.slo

    def validate(self, req: ChatRequest) -> None:
        """Raise InvalidRequestError for bad parameters (nothing is allocated)."""
        validate_request(req, self.rt.vocab)

    def tokenize_prompt(self, req: ChatRequest) -> list[int]:
        """Prompt token ids with the chat template applied (what counts against the context);
        a raw ``prompt_tokens`` request's own ids."""
        if req.prompt_tokens is not None:
            return [int(t) for t in req.prompt_tokens]
        return self.tokenizer.encode_chat(list(req.messages), add_generation_prompt=True,
                                          enable_thinking=req.enable_thinking)

    def _live_locked(self) -> tuple[int, int, float]:
        running = sum(1 for s in self.slots if s.req is not None)
        occ = self.rt.kv.occupancy()
        return len(self._queue), running, occ.used_cells / max(1, occ.capacity_cells)

    def submit(self, req: ChatRequest) -> RequestHandle:
        """Validate, tokenise and enqueue. Returns a handle at once.

        Raises (nothing allocated, no counter but ``rejected`` moves):
        InvalidRequestError, ExceedContextSizeError (prompt >= n_ctx = 40960
        tokens), UnavailableError (queue full, or device in maintenance).
        """
        with self._lock:
            if self._stop:
                self.metrics.on_rejected()
                raise UnavailableError("engine is shut down")
            if not self._admitting:
                self.metrics.on_rejected()
                raise UnavailableError(self._refuse_reason or "not admitting requests")
        try:
            self.validate(req)
        except InvalidRequestError:
            self.metrics.on_rejected()
            raise
        arrival = self.rt.clock.now_us
        t0 = self.host_timer.now()
        prompt = self.tokenize_prompt(req)
        tok_us = self.host_timer.now() - t0
        if len(prompt) >= self.n_ctx:  # llama.cpp: n_prompt >= n_ctx leaves no room for one token
            self.metrics.on_rejected()
            raise ExceedContextSizeError(len(prompt), self.n_ctx)
        if req.id_slot >= self.n_slots:
            self.metrics.on_rejected()
            raise InvalidRequestError(f"id_slot {req.id_slot} does not exist (slots 0..{self.n_slots - 1})",
                                      param="id_slot")
        kv_cap = self.rt.kv.occupancy().capacity_cells
        if len(prompt) > kv_cap:  # a board built with a KV pool smaller than the context
            self.metrics.on_rejected()
            raise ExceedContextSizeError(len(prompt), kv_cap, f"the prompt has {len(prompt)} tokens but the KV "
                                         f"cache holds {kv_cap} tokens in all (context {self.n_ctx})")
        with self._lock:
            if self._stop or not self._admitting:
                self.metrics.on_rejected()
                raise UnavailableError("engine is shut down" if self._stop
                                       else self._refuse_reason or "not admitting requests")
            free = sum(1 for s in self.slots if s.req is None)
            if len(self._queue) >= self.queue_limit + free:
                self.metrics.on_rejected()
                raise UnavailableError(f"server busy: {len(self._queue)} requests queued (limit {self.queue_limit})")
            rid = next(self._ids)
            handle = RequestHandle(rid, len(prompt))
            handle._engine_wake = functools.partial(self._on_cancel, rid)
            booked_us = self.host_booking.before(tok_us)
            self.rt.clock.host_span(arrival, booked_us)  # tokenising is host work on the request's clock
            r = _Request(rid, req, prompt, handle, arrival / 1e3, tok_us / 1e3, tokenizer=self.tokenizer,
                         vocab=int(self.rt.vocab))
            r.host_booked_ms += booked_us / 1e3
            r.tokenized_ms = (arrival + booked_us) / 1e3
            self._queue.append(r)
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
            self._admitting = False
            self._refuse_reason = reason

    def resume_admission(self) -> None:
        with self._lock:
            self._admitting = True
            self._refuse_reason = ""

    @property
    def admitting(self) -> bool:
        with self._lock:
            return self._admitting

    def active_count(self) -> int:
        with self._lock:
            return len(self._queue) + sum(1 for s in self.slots if s.req is not None)

    def drain(self, timeout_s: float, reason: str) -> dict:
        """Wait up to ``timeout_s`` host seconds for in-flight requests to end, then cancel the rest with ``reason``.

        Returns {"drained": n ended on their own, "cancelled": n cancelled, "wall_ms", "sim_ms"}.
        Admission should be paused first. Bounded: never waits past timeout + one device step.
        """
        t0 = time.perf_counter()
        sim0 = self.rt.clock.now_us
        with self._lock:
            initial = {r.id: r for r in self._queue} | {s.req.id: s.req for s in self.slots if s.req is not None}
            deadline = t0 + timeout_s
            while self._active_locked() and time.perf_counter() < deadline:
                self._wake.wait(min(0.05, max(0.0, deadline - time.perf_counter())))
            remaining = [r for r in initial.values() if r.handle._result is None]
        for r in remaining:
            r.handle.cancel(reason)
        # cancels take effect within one device step; wait for them (bounded)
        end = time.perf_counter() + self.step_timeout_s
        for r in remaining:
            r.handle._done.wait(max(0.0, end - time.perf_counter()))
        return {"drained": len(initial) - len(remaining), "cancelled": len(remaining),
                "wall_ms": (time.perf_counter() - t0) * 1e3, "sim_ms": (self.rt.clock.now_us - sim0) / 1e3}

    def _active_locked(self) -> bool:
        return bool(self._queue) or any(s.req is not None for s in self.slots)

    def slot_info(self) -> list[SlotInfo]:
        with self._lock:
            self._drop_stale_caches_locked()
            out = []
            for s in self.slots:
                r = s.req
                out.append(SlotInfo(s.idx, "idle" if r is None else r.state.value, r.id if r else None,
                                    len(r.prompt) if r else 0, r.n_prefilled if r else 0,
                                    len(r.generated) if r else 0, len(s.cache_tokens), r.numeric if r else None,
                                    r.max_tokens if r else 0,
                                    msgspec.structs.asdict(r.req.sampling) if r else {}))
            return out

    def queued_count(self) -> int:
        with self._lock:
            return len(self._queue)

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
        cost = res.cost
        st = StageTimes(res.kind, cost.h2d_us / 1e3, cost.infer_us / 1e3, cost.d2h_us / 1e3, 0.0, sampling_ms, 0.0,
                        framework_ms, 0.0, res.n_tokens, 0, source)
        self.last_stage[res.kind] = st
        return st

    def stage_summary(self) -> dict:
        """P50/P95/P99/mean of each stage (facts.md F8) over the recent steps, per kind.

        {"prefill": {"h2d": {"p50": ..}, ...}, "decode": {...}, "units": ...}. Device
        stages are simulated ms, host stages measured host ms.
        """
        hist = list(self.stage_history)
        out: dict = {"units": "h2d/infer/d2h simulated device ms; other stages measured host ms"}
        for kind in ("prefill", "decode"):
            steps = [s for s in hist if s.kind == kind]
            out[kind] = {name: percentiles(getattr(s, f"{name}_ms") for s in steps) for name in STAGES}
        return out

    def close(self) -> None:
        """Stop the scheduler; every unfinished request is cancelled ("engine shutting down") and gets its result."""
        with self._lock:
            pending = list(self._queue) + [s.req for s in self.slots if s.req is not None]
        for r in pending:
            r.handle.cancel("engine shutting down")
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=max(5.0, self.step_timeout_s if pending else 5.0))

    def _notify(self) -> None:
        with self._lock:
            self._wake.notify_all()

    def _on_cancel(self, rid: int) -> None:
        """A handle was cancelled: a queued request ends at once (it holds nothing);
        a running one is ended by the scheduler within one device step."""
        with self._lock:
            for r in self._queue:
                if r.id == rid:
                    self._end_locked(r, "cancelled", "none", None)
                    break
            self._wake.notify_all()

    def _update_live_locked(self) -> None:
        self.metrics.set_live(*self._live_locked())

    # --- scheduler -------------------------------------------------------------------

    def _loop(self) -> None:
        inflight: deque[tuple[Any, OutputBuf, dict]] = deque()  # (a _Request or a _Batch, job, info)
        while True:
            with self._lock:
                self._reap_cancelled_locked(inflight)
                if self._stop and not inflight:
                    # close(): end whatever is left (queued requests never started)
                    for r in list(self._queue) + [s.req for s in self.slots if s.req is not None]:
                        self._end_locked(r, "cancelled", "none", None)
                    return
                self._admit_locked()
                busy = _busy_ids(inflight)
                self._kv_deadlines_locked(busy)
                work = None
                if len(inflight) < self.max_inflight and not self._stop:
                    work = self._next_work_locked(busy)
                if work is None and not inflight:
                    if self._break_kv_deadlock_locked():
                        continue
                    self._wake.wait(self._idle_wait_s())
                    continue
            if work is not None:
                r, kind, n = work
                started: tuple[Any, OutputBuf, dict] | None
                try:
                    if isinstance(r, _Batch):
                        started = self._start_batch(r)
                    else:
                        started = self._start_step(r, kind, n)
                except Exception as e:  # noqa: BLE001 - a bug must fail one request, never the scheduler
                    self._fail_internal(r, e)
                    started = None
                if started is not None:
                    inflight.append(started)
                    if len(inflight) < self.max_inflight:
                        continue  # ping/pong: submit a second job before waiting the first
            if inflight:
                item = inflight.popleft()
                try:
                    if isinstance(item[0], _Batch):
                        self._finish_batch(item[0], item[1], item[2])
                    else:
                        self._finish_step(item[0], item[1], item[2])
                except Exception as e:  # noqa: BLE001 - see above
                    self._fail_internal(item[0], e)

    def _fail_internal(self, r: Any, e: Exception) -> None:
        """End ``r`` (a request, or every rider of a batch) with a typed internal error (the scheduler runs on)."""
        if isinstance(r, _Batch):
            for m in r.members:
                self._fail_internal(m, e)
            return
        log.exception("request %s failed inside the engine", r.id)
        with self._lock:
            if r.slot is not None:
                self.rt.kv.free(r.slot.seq_id)
                r.slot.cache_tokens = []
            self._end_locked(r, "failed", "none", {"code": 500, "type": "server_error", "type_name": type(e).__name__,
                                                   "message": f"internal error in the engine: {type(e).__name__}: {e}"})

    # --- KV pressure (module docstring, "KV pressure") ----------------------------------

    def _idle_wait_s(self) -> float:
        """How long the idle scheduler sleeps: until the earliest KV retry, at most 0.25 s."""
        retry = [min(s.req.kv_retry_at, s.req.kv_deadline) for s in self.slots
                 if s.req is not None and s.req.kv_deadline is not None]
        if not retry:
            return 0.25
        return min(0.25, max(0.001, min(retry) - time.monotonic()))

    def _reap_cancelled_locked(self, inflight: deque) -> None:
        busy = _busy_ids(inflight)
        for r in [q for q in self._queue if q.handle.cancelled]:
            self._queue.remove(r)
            self._end_locked(r, "cancelled", "none", None)
        for s in self.slots:
            q = s.req
            if q is not None and q.handle.cancelled and id(q) not in busy:
                self._end_locked(q, "cancelled", "none", None)

    def _drop_stale_caches_locked(self) -> None:
        """Forget prefix caches whose cells a KV clear (reset, ClearAllDevMem, Clear KV) removed."""
        epoch = self.rt.kv.epoch
        for s in self.slots:
            if s.cache_epoch != epoch:
                if s.req is None:
                    s.cache_tokens = []
                s.cache_epoch = epoch

    def _admit_locked(self) -> None:
        self._drop_stale_caches_locked()
        waiting: deque[_Request] = deque()  # asked for a busy slot (id_slot): keep their place in the queue
        while self._queue:
            free = [s for s in self.slots if s.req is None]
            if not free:
                break
            r = self._queue.popleft()
            if r.req.id_slot >= 0:
                free = [s for s in free if s.idx == r.req.id_slot]
                if not free:
                    waiting.append(r)
                    continue
            # llama.cpp: prefer the idle slot sharing the longest prefix with the prompt, then LRU
            best = max(free, key=lambda s: (_common_prefix(s.cache_tokens, r.prompt), -s.last_used))
            # keep at least one prompt token to prefill: its logits give the first token
            n_common = min(_common_prefix(best.cache_tokens, r.prompt), len(r.prompt) - 1)
            if not r.req.cache_prompt:
                n_common = 0
            kv = self.rt.kv
            if n_common <= 0:
                kv.free(best.seq_id)
                n_common = 0
            else:
                kv.seq_rm(best.seq_id, n_common, -1)
            best.cache_tokens = r.prompt[:n_common]
            best.req = r
            r.slot = best
            r.cache_n = r.n_prefilled = n_common
            r.assigned_ms = self.rt.clock.now_us / 1e3
            r.kv_epoch = kv.epoch
            r.handle.state = RequestState.PREFILLING
            # the limit bounds the tokens this request prefills; a reused prefix counts only if its KV
            # was computed by the numerics (a timing-only request's cells hold no values)
            reuse_ok = n_common == 0 or best.cache_numeric
            r.numeric = (self.rt.numerics and reuse_ok
                         and len(r.prompt) - n_common <= self.numerics_max_prompt)
            best.cache_numeric = r.numeric
            self._round_served.discard(best.idx)
            self._update_live_locked()
        self._queue.extendleft(reversed(waiting))

    def _next_work_locked(self, busy: set) -> tuple[Any, str, int] | None:
        """The round rule (module docstring): each decoding slot once, then one prefill chunk."""
        n = self.n_slots

        now = time.monotonic()

        def ready(r: _Request | None, state: RequestState) -> TypeGuard[_Request]:
            return (r is not None and r.state is state and id(r) not in busy and not r.handle.cancelled
                    and not r.kv_hold and r.kv_retry_at <= now)  # parked on KV: not before its retry time

        def next_decode() -> tuple[Any, str, int] | None:
            if self.decode_batch > 1:  # continuous batching: up to N ready decoders in one step
                picked = [s for s in (self.slots[(self._rr_decode + k) % n] for k in range(n))
                          if s.idx not in self._round_served and ready(s.req, RequestState.DECODING)]
                picked = picked[:self.decode_batch]
                if not picked:
                    return None
                self._round_served.update(s.idx for s in picked)
                self._rr_decode = (picked[-1].idx + 1) % n
                return _Batch([s.req for s in picked if s.req is not None]), "decode", len(picked)
            for k in range(n):
                s = self.slots[(self._rr_decode + k) % n]
                if s.idx not in self._round_served and ready(s.req, RequestState.DECODING):
                    self._round_served.add(s.idx)
                    self._rr_decode = (s.idx + 1) % n
                    return s.req, "decode", 1
            return None

        work = next_decode()
        if work is not None:
            return work
        for k in range(n):
            s = self.slots[(self._rr_prefill + k) % n]
            r = s.req
            if ready(r, RequestState.PREFILLING):
                self._rr_prefill = (s.idx + 1) % n
                self._round_served.clear()  # the chunk closes the round
                return r, "prefill", min(self.prefill_chunk, len(r.prompt) - r.n_prefilled)
        if self._round_served:
            self._round_served.clear()  # no prefill waiting: next round of decodes
            return next_decode()
        return None

    def _start_step(self, r: _Request, kind: str, n: int) -> tuple[_Request, OutputBuf, dict] | None:
        """Apply KV cells and submit one job. On failure the request ends with a typed error.

        The host work before the submit (KV apply, buffer set-up) is put on the
        simulated clock first, so the device step starts after it.
        """
        if r.kv_epoch != self.rt.kv.epoch:
            # the KV was cleared under this request (reset / ClearAllDevMem / Clear KV): its context is gone
            with self._lock:
                self._end_locked(r, "failed", "none", _err(DeviceReset(
                    "KV cache cleared (device reset or memory clear) while the request was running")))
            return None
        ht = self.host_timer
        t0 = ht.now()
        start_sim = self.rt.clock.now_us
        assert r.slot is not None  # set at admission, never cleared; only admitted requests get steps
        seq = r.slot.seq_id
        if kind == "prefill":
            toks = r.prompt[r.n_prefilled:r.n_prefilled + n]
            p0 = r.n_prefilled
        else:
            assert r.pending_token is not None  # a decoding request has its sampled token to feed
            toks = [r.pending_token]
            p0 = len(r.prompt) + len(r.generated) - 1
        positions = np.arange(p0, p0 + len(toks), dtype=np.int64)
        kv = self.rt.kv
        kv_wait_us = 0.0
        try:
            if not kv.can_allocate(len(toks)):
                self._evict_idle(len(toks))
            cells = self._apply_kv(r, seq, positions)
            if cells is None:
                return None  # parked: KV is full; retried after a back-off while others run
            kv_wait_us = r.kv_last_wait_us
            host_us = ht.now() - t0
            booked_us = self.host_booking.before(host_us)
            r.host_booked_ms += booked_us / 1e3
            self.rt.clock.host_span(start_sim, booked_us)  # the job is submitted after this host work
            if kind == "prefill" and r.prefill_start_ms is None:
                r.prefill_start_ms = start_sim / 1e3
            # CalRT path (facts.md F1): pooled buffers, CSR set and checked, ping/pong task type
            job = self.rt.step(kind, seq, np.asarray(toks, dtype=np.int64), positions, np.asarray(cells),
                               numeric=r.numeric)
        except RequestCancelled:
            with self._lock:
                self._end_locked(r, "cancelled", "none", None)
            return None
        except (KVExhausted, DeviceError) as e:
            with self._lock:
                self._end_locked(r, "failed", "none", _err(e))
            return None
        r.host["kv_wait"] += kv_wait_us / 1e3
        # host work of the submit itself: CPU time minus the apply call (parked wall time is not in host_us)
        return r, job, {"kind": kind, "n": len(toks), "kv_wait_us": kv_wait_us,
                        "submit_host_us": max(0.0, host_us - r.kv_last_attempt_us)}

    def _finish_step(self, r: _Request, job: OutputBuf, info: dict) -> None:
        """Wait for the job, sample, apply stop rules, stream the visible piece, account host work."""
        try:
            res = job.wait(self.step_timeout_s)
        except DeviceError as e:
            job.discard()  # a timed-out job returns its buffers to the pool when it ends
            with self._lock:
                _add_device_ms(r, e)
                self._end_locked(r, "failed", "none", _err(e))
            return
        with self._lock:
            busy = sum(1 for s in self.slots if s.req is not None)
        self.metrics.on_decode(busy)
        self._after_step(r, res, info)

    def _after_step(self, r: _Request, res: Any, info: dict) -> float:
        """Sample, apply stop rules, stream and account one request's part of a finished step.

        ``res``: the StepResult (for a batched step, this rider's view of it: its logits,
        ``sim_end_us`` = when its host work may start). Returns the simulated µs its host work ended.
        """
        ht = self.host_timer
        t0 = ht.now()
        cost = res.cost
        # the parts add up to the step's sim time (a slow chip is already in the per-chip pricing)
        dev = {"h2d": cost.h2d_us / 1e3, "infer": cost.infer_us / 1e3, "d2h": cost.d2h_us / 1e3}
        for k in dev:
            r.device[k] += dev[k]
        kind = info["kind"]
        sampling_us = detok_us = 0.0
        assert r.slot is not None  # set at admission, never cleared
        if kind == "prefill":
            r.n_prefilled += info["n"]
            r.slot.cache_tokens = r.prompt[: r.n_prefilled]
        else:
            assert r.pending_token is not None  # the decode step just fed it
            r.slot.cache_tokens.append(r.pending_token)
        visible = ""
        stop: tuple[str, str] | None = None
        need_token = (kind == "decode" or r.n_prefilled >= len(r.prompt)) and not r.handle.cancelled
        if need_token:
            s0 = ht.now()
            tok = self._sample(r, res)
            sampling_us = ht.now() - s0
            d0 = ht.now()
            visible, stop = self._consume_token(r, tok)
            if stop is not None:
                visible, stop = self._final_flush(r, visible, stop)
            detok_us = ht.now() - d0
            r.host["sampling"] += sampling_us / 1e3
            r.host["detokenize"] += detok_us / 1e3
        host_us = ht.now() - t0
        framework_us = max(0.0, host_us - sampling_us - detok_us) + info["submit_host_us"]
        r.host["framework"] += framework_us / 1e3
        booked_us = self.host_booking.after(host_us, 1 if need_token else 0)
        r.host_booked_ms += booked_us / 1e3
        t_end = self.rt.clock.host_span(res.sim_end_us, booked_us)
        tok_ms = 0.0
        if kind == "prefill" and not r.tokenize_reported:
            r.tokenize_reported = True
            tok_ms = r.tokenize_ms
        st = StageTimes(kind, dev["h2d"], dev["infer"], dev["d2h"], info["kv_wait_us"] / 1e3, sampling_us / 1e3,
                        detok_us / 1e3, framework_us / 1e3, tok_ms, info["n"], r.id)
        self.last_stage[kind] = st
        self.stage_history.append(st)
        if need_token:
            if r.first_token_ms is None:
                r.first_token_ms = t_end / 1e3
                r.handle.state = RequestState.DECODING
            r.last_token_ms = t_end / 1e3
        if visible:
            # TTFT / ITL are recorded as the pieces stream, so a reply stopped later still counts
            if not r.pieces_ms:
                if not r.ttft_recorded:
                    r.ttft_recorded = True
                    self.metrics.on_first_token(t_end / 1e3 - r.arrival_ms)
            else:
                self.metrics.on_token_gap(t_end / 1e3 - r.pieces_ms[-1])
            r.pieces_ms.append(t_end / 1e3)
            r.text_parts.append(visible)
            r.handle._events.put(TokenEvent(r.id, visible, len(r.generated), t_end / 1e3,
                                            tuple(r.generated[r.n_streamed:])))
            r.n_streamed = len(r.generated)
        with self._lock:
            if stop is not None:
                self._end_locked(r, "finished", stop[0], None, stopping_word=stop[1], done_ms=t_end / 1e3)
            else:
                self._wake.notify_all()
        return t_end

    # --- continuous batching (C3 variant calbin, decode batch N > 1) ----------------------

    def _start_batch(self, b: _Batch) -> tuple[_Batch, OutputBuf, dict] | None:
        """Apply one KV cell per rider and submit ONE batched decode job for those that got one.

        A rider whose KV was cleared fails, one parked on KV is left out of this step (retried
        later, as at batch 1), a cancelled one ends. Host work (KV applies, staging) goes on the
        simulated clock before the job, as in ``_start_step``.
        """
        ht = self.host_timer
        t0 = ht.now()
        start_sim = self.rt.clock.now_us
        kv = self.rt.kv
        rows, riders, waits = [], [], []
        attempt_us = 0.0
        for r in b.members:
            if r.kv_epoch != kv.epoch:
                with self._lock:
                    self._end_locked(r, "failed", "none", _err(DeviceReset(
                        "KV cache cleared (device reset or memory clear) while the request was running")))
                continue
            assert r.slot is not None and r.pending_token is not None  # a decoding request
            p0 = len(r.prompt) + len(r.generated) - 1
            positions = np.arange(p0, p0 + 1, dtype=np.int64)
            try:
                if not kv.can_allocate(1):
                    self._evict_idle(1)
                cells = self._apply_kv(r, r.slot.seq_id, positions)
            except RequestCancelled:
                with self._lock:
                    self._end_locked(r, "cancelled", "none", None)
                continue
            except (KVExhausted, DeviceError) as e:
                with self._lock:
                    self._end_locked(r, "failed", "none", _err(e))
                continue
            if cells is None:
                continue  # parked: rides a later step
            r.host["kv_wait"] += r.kv_last_wait_us / 1e3
            attempt_us += r.kv_last_attempt_us
            rows.append((r.slot.seq_id, r.pending_token, p0, int(np.asarray(cells).reshape(-1)[0]), r.numeric))
            riders.append(r)
            waits.append(r.kv_last_wait_us)
        if not riders:
            return None
        host_us = ht.now() - t0
        booked_us = self.host_booking.before(host_us)
        for r in riders:
            r.host_booked_ms += booked_us / 1e3 / len(riders)
        self.rt.clock.host_span(start_sim, booked_us)
        try:
            job = self.rt.step_batch(rows)
        except (KVExhausted, DeviceError) as e:
            with self._lock:
                for r in riders:
                    self._end_locked(r, "failed", "none", _err(e))
            return None
        b.members = riders
        each = max(0.0, host_us - attempt_us) / len(riders)
        return b, job, {"kind": "decode", "n": len(riders), "kv_wait_us": waits, "submit_host_us": each}

    def _finish_batch(self, b: _Batch, job: OutputBuf, info: dict) -> None:
        """Wait for the batched job once, then sample/stream each rider in turn (its host work after the previous)."""
        try:
            res = job.wait(self.step_timeout_s)
        except DeviceError as e:
            job.discard()
            with self._lock:
                for r in b.members:
                    _add_device_ms(r, e)  # each rider's timings carry the batched step, as when it succeeds
                    self._end_locked(r, "failed", "none", _err(e))
            return
        self.batch_log.append({"job_id": res.job_id, "occupancy": len(res.batch), "capacity": self.decode_batch,
                               "slots": [r.slot.idx for r in b.members if r.slot is not None],
                               "request_ids": [r.id for r in b.members], "sim_end_ms": res.sim_end_us / 1e3})
        with self._lock:
            busy = sum(1 for s in self.slots if s.req is not None)
        self.metrics.on_decode(busy)
        t = res.sim_end_us
        for r, row, wait_us in zip(b.members, res.batch, info["kv_wait_us"], strict=True):
            mine = dataclasses.replace(res, seq_id=row.seq_id, past_len=row.past_len, logits_bf16=row.logits_bf16,
                                       experts_touched=row.experts_touched, sim_end_us=t)
            try:
                t = self._after_step(r, mine, {"kind": "decode", "n": 1, "kv_wait_us": wait_us,
                                               "submit_host_us": info["submit_host_us"]})
            except Exception as e:  # noqa: BLE001 - one rider's bug must not take the others down
                self._fail_internal(r, e)

    def _sample(self, r: _Request, res) -> int:
        if res.logits_bf16 is None or not r.numeric:
            # timing-only: no logits exist; a seeded generator stands in (labelled in Timings.numerics)
            return int(r.fallback_rng.integers(*self._text_ids))
        # BF16 bits widen straight into the sampler's scratch buffer: no FP32 copy per step
        return r.sampler.sample_bf16(res.logits_bf16, r.prompt + r.generated if r.req.sampling.has_penalties else ())

    def _consume_token(self, r: _Request, tok: int) -> tuple[str, tuple[str, str] | None]:
        """Apply stop rules to a sampled token; returns (visible text, (stop_type, word) or None).

        Order: EOS, then stop strings (on the text made visible by this token),
        then ``max_tokens``, then the context end. Held text (a pending stop-string
        prefix, an incomplete UTF-8 sequence) is NOT flushed here; see ``_final_flush``.
        """
        r.generated.append(tok)
        if tok in self._eos_ids:
            return "", ("eos", "")
        r.pending_token = tok
        piece = r.decoder.push(tok)
        visible, word = r.matcher.push(piece) if piece else ("", None)
        if word is not None:
            return visible, ("word", word)
        if len(r.generated) >= r.max_tokens:
            return visible, ("limit", "")
        # context end (llama.cpp): prompt + generated never exceeds n_ctx, so usage.total_tokens <= n_ctx
        if len(r.prompt) + len(r.generated) >= self.n_ctx:
            return visible, ("limit", "")
        return visible, None

    @staticmethod
    def _final_flush(r: _Request, visible: str, stop: tuple[str, str]) -> tuple[str, tuple[str, str]]:
        """Generation ended for ``stop``: release held text unless a stop word matched.

        An incomplete UTF-8 tail becomes U+FFFD (a whole character). If the
        released text completes a stop string, the stop becomes ``word``.
        """
        if stop[0] == "word":
            return visible, stop
        tail = r.decoder.flush()
        if tail:
            more, word = r.matcher.push(tail)
            visible += more
            if word is not None:
                return visible, ("word", word)
        return visible + r.matcher.flush(), stop

    def _end_locked(self, r: _Request, status: str, stop_type: str, error: dict | None, stopping_word: str = "",
                    done_ms: float | None = None) -> None:
        """Finish a request: free its slot (and its KV on cancel/failure), record metrics, deliver the result."""
        if r.handle._result is not None:
            return
        if r.kv_deadline is not None:  # ended while parked on KV (cancel, drain, deadlock): book the wait
            waited = time.monotonic() - r.kv_wait_start
            r.host["kv_wait"] += waited * 1e3
            self.kv_stats["wait_wall_ms"] += waited * 1e3
            self.rt.clock.host_span(r.kv_wait_start_sim, waited * 1e6)
            r.kv_deadline = None
        now_ms = self.rt.clock.now_us / 1e3 if done_ms is None else done_ms
        if r in self._queue:
            self._queue.remove(r)
        s = r.slot
        if s is not None:
            s.req = None
            s.last_used = now_ms
            self._round_served.discard(s.idx)
            if status != "finished":
                # cancelled/failed: free this sequence's KV now (the in-flight step, if any, has ended)
                self.rt.kv.free(s.seq_id)
                s.cache_tokens = []
        n = len(r.generated)
        ttft, tpot, itl, e2e = request_latencies(r.arrival_ms, r.pieces_ms, now_ms, n)
        if ttft is None and r.first_token_ms is not None:
            # nothing visible (e.g. EOS first, only special tokens, or text held back when the
            # request was stopped): the response started when its first token was sampled
            ttft, tpot, itl, e2e = request_latencies(r.arrival_ms, [r.first_token_ms], now_ms, n)
            itl = ()
        if ttft is not None and not r.ttft_recorded:
            r.ttft_recorded = True
            self.metrics.on_first_token(ttft)
        pn = r.n_prefilled - r.cache_n
        if r.first_token_ms is not None and r.prefill_start_ms is not None:
            prompt_ms = r.first_token_ms - r.prefill_start_ms
        elif r.prefill_start_ms is not None:
            prompt_ms = now_ms - r.prefill_start_ms  # ended during prefill
        else:
            prompt_ms = 0.0
        predicted_ms = (r.last_token_ms - r.first_token_ms) if (
            r.first_token_ms is not None and r.last_token_ms is not None) else 0.0  # set together
        done_prefill = r.first_token_ms is not None
        timings = Timings(
            prompt_n=pn, prompt_ms=prompt_ms,
            prompt_per_token_ms=prompt_ms / pn if pn and done_prefill else None,
            prompt_per_second=1e3 * pn / prompt_ms if pn and prompt_ms > 0 and done_prefill else None,
            predicted_n=n, predicted_ms=predicted_ms,
            # llama.cpp: the first token costs no decode step, so n - 1 steps over predicted_ms; 0.0 for one token
            predicted_per_token_ms=predicted_ms / (n - 1) if n > 1 else 0.0,
            predicted_per_second=1e3 * (n - 1) / predicted_ms if n > 1 and predicted_ms > 0 else 0.0,
            cache_n=r.cache_n, ttft_ms=ttft, tpot_ms=tpot, itl_ms=itl, e2e_ms=e2e,
            # waiting for a slot, nothing else: from the tokenised prompt (its host work is booked before)
            queue_ms=max(0.0, r.assigned_ms - r.tokenized_ms) if r.assigned_ms is not None else None,
            host_ms=dict(r.host), device_ms=dict(r.device), numerics=r.numeric,
            arrival_ms=r.arrival_ms, done_ms=now_ms,
            host_booked_ms=r.host_booked_ms, host_time=self.host_booking.mode,
        )
        if status == "cancelled" and error is None:
            error = {"type": "cancelled", "message": r.handle.cancel_reason or "cancelled"}
        text = "".join(r.text_parts)
        result = RequestResult(r.id, status, text, tuple(r.generated), stop_type, stopping_word, error, timings,
                               r.sampler.seed)
        r.handle.state = {"finished": RequestState.FINISHED,
                          "failed": RequestState.FAILED}.get(status, RequestState.CANCELLED)
        self.metrics.on_done(status, prompt_n=r.n_prefilled, cache_n=r.cache_n, predicted_n=n, prompt_ms=prompt_ms,
                             predicted_ms=predicted_ms, ttft=ttft, tpot=tpot, itl=itl, e2e=e2e,
                             queue_ms=timings.queue_ms, done_ms=now_ms, arrival_ms=r.arrival_ms,
                             live=self._live_locked())
        r.handle._finish(result)
        self._wake.notify_all()


class _Batch:
    """The riders of one batched decode step (continuous batching), in slot round-robin order."""

    def __init__(self, members: list[_Request]) -> None:
        self.members = members


def _busy_ids(inflight: deque) -> set[int]:
    """ids of the requests whose step is in flight (every rider of a batched step)."""
    out: set[int] = set()
    for r, _, _ in inflight:
        if isinstance(r, _Batch):
            out.update(id(m) for m in r.members)
        else:
            out.add(id(r))
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    idx = np.flatnonzero(x)
    return int(idx[0]) if idx.size else n
