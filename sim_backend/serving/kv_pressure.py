"""KV pressure in the serving engine: parking a step that finds the cache full, and the rule for
ending requests when the pool cannot hold them all (see the engine's module docstring, "KV pressure").

``KVPressure`` is the part of ``Engine`` that decides: park with back-off, retry at once when cells
come back, evict idle prefix caches first, then end the fewest requests needed so the rest make
progress (cannot-fit-alone first, then newest), each with ``KVExhausted`` carrying its true numbers.
``_Request`` / ``_Slot`` are the engine's internal request and slot records.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from sim_backend.errors import KVExhausted
from sim_backend.planes.types import ChatRequest
from sim_backend.runtime import KV_BACKOFF_MAX_S, KV_BACKOFF_START_S
from sim_backend.serving.api import RequestHandle, RequestState
from sim_backend.serving.api import error_dict as _err
from sim_backend.serving.sampling import Sampler
from sim_backend.serving.streaming import StopStringMatcher, StreamDecoder

if TYPE_CHECKING:
    from sim_backend.runtime import RuntimeSession
    from sim_backend.serving.hosttime import HostTimer


class _Request:
    """Engine-side state of one request. Times in simulated ms unless named host."""

    def __init__(self, rid: int, req: ChatRequest, prompt: list[int], handle: RequestHandle, arrival_ms: float,
                 tokenize_ms: float, *, tokenizer: Any = None, vocab: int | None = None) -> None:
        self.id = rid
        self.req = req
        if req.max_tokens is None:  # validate_request refuses this before a _Request is made
            raise ValueError("max_tokens is required")
        self.max_tokens = int(req.max_tokens)
        self.prompt = prompt
        self.handle = handle
        self.arrival_ms = arrival_ms
        self.tokenize_ms = tokenize_ms  # host ms
        self.slot: _Slot | None = None
        self.assigned_ms: float | None = None
        self.n_prefilled = 0  # prompt tokens whose KV is written (including cache_n)
        self.cache_n = 0
        self.generated: list[int] = []
        self.n_streamed = 0  # generated tokens already carried by a TokenEvent
        self.pending_token: int | None = None  # sampled, not yet fed to the model
        self.pieces_ms: list[float] = []
        self.ttft_recorded = False  # its TTFT sample went into the metrics (once per request)
        self.text_parts: list[str] = []
        self.prefill_start_ms: float | None = None
        self.first_token_ms: float | None = None  # first token sampled (llama.cpp t_start_generation)
        self.last_token_ms: float | None = None
        self.host = {"tokenize": tokenize_ms, "sampling": 0.0, "detokenize": 0.0, "kv_wait": 0.0, "framework": 0.0}
        self.host_booked_ms = 0.0  # host work put on the simulated clock (HostBooking), ms
        self.tokenized_ms = arrival_ms  # simulated ms the prompt was tokenised (queue time starts here)
        self.device = {"h2d": 0.0, "infer": 0.0, "d2h": 0.0}
        self.tokenize_reported = False
        # the model's vocabulary and tokenizer (defaults: Qwen3's)
        self.sampler = Sampler(req.sampling) if vocab is None else Sampler(req.sampling, vocab)
        self.decoder = StreamDecoder(tokenizer, skip_special=True)
        self.matcher = StopStringMatcher(req.stop)
        self.numeric = True
        self.kv_epoch = -1  # KVCacheManager.epoch at admission
        # KV parking (see Engine._apply_kv): deadline/retry in time.monotonic() seconds
        self.kv_deadline: float | None = None
        self.kv_retry_at = 0.0
        self.kv_backoff_s = KV_BACKOFF_START_S
        self.kv_wait_start = 0.0
        self.kv_wait_start_sim = 0.0
        self.kv_last_wait_us = 0.0
        self.kv_last_attempt_us = 0.0
        self.kv_parked_once = False
        self.kv_need = 0  # cells the parked step asks for: its prefill chunk (<= prefill_chunk) or 1 (decode)
        self.kv_hold = False  # to be ended for KV once its step in flight is done: start no new step
        self.fallback_rng = np.random.default_rng(self.sampler.seed)

    @property
    def state(self) -> RequestState:
        return self.handle.state

    def total_cells(self, n_ctx: int) -> int:
        """KV cells this request holds when it ends at ``max_tokens`` or the context end (the last token is not fed)."""
        return min(len(self.prompt) + self.max_tokens - 1, n_ctx)


class _Slot:
    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.seq_id = idx
        self.req: _Request | None = None
        self.cache_tokens: list[int] = []  # tokens whose KV this slot's sequence holds (prefix reuse)
        self.cache_epoch = 0  # KVCacheManager.epoch the cache was built in
        self.cache_numeric = False  # the cached KV was computed by the numerics (a numeric request's)
        self.last_used = 0.0


class KVPressure:
    """Mixin of ``Engine``: the KV parking and request-ending policy. Uses the engine's ``rt`` (KV
    view), ``slots``, ``_lock``, ``kv_timeout_s``, ``kv_stats``, ``kv_pressure_log`` and ``_end_locked``."""

    # set by Engine.__init__
    rt: RuntimeSession
    slots: list[_Slot]
    _lock: threading.Lock
    n_ctx: int
    kv_timeout_s: float
    kv_stats: dict[str, float]
    kv_pressure_log: deque[dict[str, Any]]
    host_timer: HostTimer

    if TYPE_CHECKING:  # defined by Engine
        def _end_locked(self, r: _Request, status: str, stop_type: str, error: dict[str, Any] | None,
                        stopping_word: str = "", done_ms: float | None = None) -> None: ...

    def _kv_free(self) -> int:
        """Free cells now (cheaper than ``occupancy()``, which counts every sequence)."""
        return self.rt.kv.n_cells - self.rt.kv.used_cells

    def _kv_held(self, r: _Request) -> int:
        """Cells ``r``'s sequence holds now."""
        return 0 if r.slot is None else int(self.rt.kv.seq_cells(r.slot.seq_id)[0].size)

    def _kv_fits_alone(self, r: _Request, capacity: int) -> bool:
        """True if ``r`` could run to its end (max_tokens or context end) with the whole pool to itself."""
        return r.total_cells(self.n_ctx) <= capacity

    def _kv_running_locked(self) -> list[_Request]:
        return [s.req for s in self.slots if s.req is not None and s.req.handle._result is None]

    def _kv_end_locked(self, r: _Request, cause: str, err: KVExhausted, held: int) -> None:
        """End ``r`` (not in flight) for KV pressure with ``err``, which carries its true numbers.

        Records the decision in ``kv_pressure_log`` with what every other running request held at that
        moment, so the rule can be checked from outside.
        """
        cap = err.capacity
        self.kv_stats["timeouts"] += 1
        self.kv_pressure_log.append({
            "request_id": r.id, "cause": cause, "requested": err.requested, "free": err.free, "capacity": cap,
            "held": held, "fits_alone": self._kv_fits_alone(r, cap),
            "others": tuple({"request_id": q.id, "held": self._kv_held(q), "fits_alone": self._kv_fits_alone(q, cap),
                             "parked": q.kv_deadline is not None, "kv_need": q.kv_need}
                            for q in self._kv_running_locked() if q is not r)})
        self._end_locked(r, "failed", "none", _err(err))

    def _kv_deadlines_locked(self, busy: set) -> None:
        """Parked requests: retry at once when cells came back; at a request's own deadline, decide who ends.

        At the deadline of parked request ``r`` (it waited ``kv_timeout_s`` while others held the cells),
        if ``r`` fits alone:
        1. requests that cannot finish in the pool even alone and hold cells are ended, newest first,
           until ``r``'s step fits;
        2. if that is not enough, one newer parked request whose cells are enough is ended (one ended
           either way, and the newer one has waited less);
        3. else ``r`` ends with KVExhausted (its step's cells, the free cells, the pool size).
        A request chosen while its step is in flight gets no new step, and the next pass (within a step)
        decides again.
        """
        running = self._kv_running_locked()
        for q in running:
            q.kv_hold = False
        parked = [r for r in running if r.kv_deadline is not None]
        if not parked:
            return
        cap, free = self.rt.kv.n_cells, self._kv_free()
        for r in parked:
            if r.kv_need <= free:
                r.kv_retry_at = 0.0  # cells came back: retry now rather than after the back-off
        now = time.monotonic()
        for r in sorted(parked, key=lambda q: (q.arrival_ms, q.id)):
            if r.handle._result is not None or r.kv_deadline is None or now < r.kv_deadline or r.kv_need <= free:
                continue
            short = r.kv_need - free
            others = [q for q in self._kv_running_locked() if q is not r]
            held = {q.id: self._kv_held(q) for q in others}
            newest_first = sorted(others, key=lambda q: (q.arrival_ms, q.id), reverse=True)
            victims: list[_Request] = []
            if self._kv_fits_alone(r, cap):
                got = 0
                for q in newest_first:  # rule 1
                    if got < short and held[q.id] > 0 and not self._kv_fits_alone(q, cap):
                        victims.append(q)
                        got += held[q.id]
                if got < short:  # rule 2
                    one = next((q for q in newest_first if q not in victims and q.kv_deadline is not None
                                and q.kv_need > free and (q.arrival_ms, q.id) > (r.arrival_ms, r.id)
                                and got + held[q.id] >= short), None)
                    if one is not None:
                        victims.append(one)
                if any(id(q) in busy for q in victims):
                    for q in victims:
                        q.kv_hold = True  # its step in flight uses its cells: end it when that is done
                    continue
            for q in victims:
                if not self._kv_fits_alone(q, cap):
                    total = q.total_cells(self.n_ctx)
                    why = (f"it needs up to {total} cells to finish (prompt {len(q.prompt)} + max_tokens "
                           f"{q.max_tokens}, context {self.n_ctx}), more than the {cap}-cell pool, so it "
                           f"was ended to give its cells to request {r.id}, which fits")
                    req = total - held[q.id]
                else:
                    why = (f"request {r.id} had waited {self.kv_timeout_s:g} s for KV cells; this newer waiting "
                           f"request was ended so it could continue")
                    req = q.kv_need
                waited = now - q.kv_wait_start if q.kv_deadline is not None else 0.0
                self._kv_end_locked(q, "for_other", KVExhausted(req, free, cap, waited, why), held[q.id])
                free = self._kv_free()
            if r.kv_need <= free:
                r.kv_retry_at = 0.0
                continue
            self._kv_end_locked(r, "deadline", KVExhausted(
                r.kv_need, free, cap, now - r.kv_wait_start,
                f"waited out its {self.kv_timeout_s:g} s KV deadline while other requests held the cells"),
                self._kv_held(r))
            free = self._kv_free()

    def _break_kv_deadlock_locked(self) -> bool:
        """Nothing in flight and every running request parked: end the fewest so the rest can continue.

        A parked request whose step now fits is not stuck: it retries at once. If all are stuck, idle
        prefix caches are evicted first; then, one at a time until some survivor's step fits, requests
        holding cells are ended: those that cannot finish in the pool even alone first, then the newest.
        Each gets KVExhausted with its own step's cells, the cells free at that moment and the pool size.
        True if something changed (the scheduler looks for work again at once).
        """
        running = self._kv_running_locked()
        if not running or any(r.kv_deadline is None for r in running):
            return False
        cap, free = self.rt.kv.n_cells, self._kv_free()
        if any(r.kv_need <= free for r in running):
            changed = False
            for r in running:
                if r.kv_need <= free and r.kv_retry_at > 0.0:
                    r.kv_retry_at = 0.0
                    changed = True
            return changed
        idle = [s for s in self.slots if s.req is None and s.cache_tokens]
        if idle:  # cached prefixes of finished requests go first; then retry at once
            for s in idle:
                self.rt.kv.free(s.seq_id)
                s.cache_tokens = []
            for r in running:
                r.kv_retry_at = 0.0
            return True
        held = {r.id: self._kv_held(r) for r in running}
        order = sorted(running, key=lambda r: (self._kv_fits_alone(r, cap), -r.arrival_ms, -r.id))
        survivors = list(running)
        now = time.monotonic()
        for v in order:
            if any(q.kv_need <= free for q in survivors):
                break
            if held[v.id] == 0:
                continue  # ending it would free nothing
            if self._kv_fits_alone(v, cap):
                why = ("every running request was waiting for KV cells and none could continue; it was the "
                       "newest holding cells, so it was ended to let the others continue")
            else:
                why = (f"every running request was waiting for KV cells; it needs up to "
                       f"{v.total_cells(self.n_ctx)} cells to finish, more than the {cap}-cell pool, so it was "
                       f"ended first to let the others continue")
            survivors.remove(v)
            self._kv_end_locked(v, "deadlock", KVExhausted(v.kv_need, free, cap, now - v.kv_wait_start, why),
                                held[v.id])
            free = self._kv_free()
        for q in survivors:
            if q.kv_need <= free:
                q.kv_retry_at = 0.0
        return True

    def _apply_kv(self, r: _Request, seq: int, positions: np.ndarray) -> np.ndarray | None:
        """Take KV cells without blocking the scheduler.

        One non-blocking ``apply`` per attempt; if too few cells are free the
        request is parked (``kv_need`` = the cells this step asks for) with
        exponential back-off (1 ms doubling to 50 ms) while other requests
        keep running (they are what frees cells). Its deadline ``kv_timeout_s``
        (host wall s) and deadlocks are decided under the engine lock by
        ``_kv_deadlines_locked`` / ``_break_kv_deadlock_locked``, which know
        every request. The wait is put on the simulated clock, so the
        request's E2E includes it.
        Raises KVExhausted (injected fault, or more cells than the pool has), RequestCancelled.
        """
        kv = self.rt.kv
        n = int(positions.shape[0])
        now = time.monotonic()
        k0 = self.host_timer.now()
        try:
            cells = kv.apply(seq, n, timeout=0.0, cancel=r.handle._cancel, positions=positions)
        except KVExhausted as e:
            occ = kv.occupancy()
            if e.injected or n > occ.capacity_cells:
                raise  # retrying cannot help
            if r.kv_deadline is None:
                if not r.kv_parked_once:  # count requests that waited, not parkings
                    r.kv_parked_once = True
                    self.kv_stats["parked_requests"] += 1
                r.kv_deadline = now + self.kv_timeout_s
                r.kv_wait_start = now
                r.kv_wait_start_sim = self.rt.clock.now_us
                r.kv_backoff_s = KV_BACKOFF_START_S
            r.kv_need = n  # the deadline and the deadlock breaker decide under the lock (_kv_deadlines_locked)
            r.kv_retry_at = now + r.kv_backoff_s
            r.kv_backoff_s = min(KV_BACKOFF_MAX_S, r.kv_backoff_s * 2)
            return None
        r.kv_need = 0
        r.kv_last_attempt_us = self.host_timer.now() - k0  # the apply itself (CPU)
        r.kv_last_wait_us = r.kv_last_attempt_us
        if r.kv_deadline is not None:
            waited = now - r.kv_wait_start
            r.kv_last_wait_us += waited * 1e6
            self.kv_stats["wait_wall_ms"] += waited * 1e3
            self.rt.clock.host_span(r.kv_wait_start_sim, waited * 1e6)
            r.kv_deadline = None
            r.kv_retry_at = 0.0
        return cells

    def _evict_idle(self, need: int) -> None:
        """Free KV of idle slots' cached prefixes, least recently used first, until ``need`` cells fit."""
        kv = self.rt.kv
        with self._lock:
            idle = sorted((s for s in self.slots if s.req is None and s.cache_tokens), key=lambda s: s.last_used)
            for s in idle:
                if kv.can_allocate(need):
                    return
                kv.free(s.seq_id)
                s.cache_tokens = []
