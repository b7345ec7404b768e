"""KV pressure: parking a step that finds the cache full, and the rule for ending requests when
the pool cannot hold them all. A policy object: it is given the KV view, the clock and, on each
call, the running requests and the slots; it ends requests through the callback it was given.

A step that finds too few free cells (a prefill chunk asks for up to ``prefill_chunk`` cells, a
decode for 1) does not block the scheduler; its request is parked and retried with back-off
(1 ms doubling to 50 ms), and at once when cells come back. Rule for ending requests: end the
fewest requests needed so the rest can make progress, newest first; a request whose step fits the
free cells is never ended; a request that could finish with the pool to itself ("fits alone":
``min(prompt + max_tokens - 1, n_ctx) <= capacity``) is never ended while one that cannot fit
alone still holds cells (those go first, whatever their age).

- Every running request parked and none of their steps fits (``break_deadlock``): idle prefix
  caches are evicted; then holders are ended one at a time (cannot-fit-alone first, then the
  newest) until some survivor's step fits.
- A request parked for its own deadline (``kv_timeout_s``) while others hold the cells
  (``check_deadlines``): cannot-fit-alone holders are ended for it if that frees enough, or else
  one newer parked holder whose cells suffice; otherwise it fails.

Each ended request gets ``KVExhausted`` with its true numbers (the cells it asked for, the cells
free at that moment, the pool size, the time it waited) and the reason; ``log`` records each
decision with what every other running request held then.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sim_backend.errors import KVExhausted
from sim_backend.runtime import KV_BACKOFF_MAX_S, KV_BACKOFF_START_S, ClockView, KVView
from sim_backend.serving.api import error_dict
from sim_backend.serving.hosttime import HostTimer
from sim_backend.serving.requests import RequestRecord, Slot

#: ``end(request, error)``: end a request as failed with ``error`` (its ``error_dict``); the engine's
EndFailed = Callable[[RequestRecord, dict[str, Any]], None]


class KVPressure:
    """The KV parking and request-ending policy (module docstring).

    Args:
        kv: the runtime's KV view (cells, ``apply``, ``free``, ``seq_cells``, ``occupancy``).
        clock: the simulated clock (a parked wait is booked on it).
        host_timer: measures the host work of an ``apply`` attempt.
        n_ctx: context in tokens (for "fits alone").
        timeout_s: a parked request's deadline, host wall s.
        end_failed: ends a request as failed; called with the engine lock held.
    All methods but ``apply`` are called with the engine lock held.
    """

    def __init__(self, kv: KVView, clock: ClockView, host_timer: HostTimer, *, n_ctx: int, timeout_s: float,
                 end_failed: EndFailed) -> None:
        self._kv = kv
        self._clock = clock
        self._host_timer = host_timer
        self.n_ctx = n_ctx
        self.timeout_s = timeout_s
        self._end_failed = end_failed
        #: requests that found the KV full and were parked; those ended for KV; host wall ms waited
        self.stats: dict[str, float] = {"parked_requests": 0, "timeouts": 0, "wait_wall_ms": 0.0}
        #: recent requests ended for KV pressure: request_id, cause (deadline | deadlock | for_other),
        #: requested / free / capacity / held cells, fits_alone, and "others" (what each other running
        #: request held then). Bounded.
        self.log: deque[dict[str, Any]] = deque(maxlen=512)

    # --- state -------------------------------------------------------------------------

    def free_cells(self) -> int:
        """Free cells now (cheaper than ``occupancy()``, which counts every sequence)."""
        return int(self._kv.n_cells - self._kv.used_cells)

    def held(self, r: RequestRecord) -> int:
        """Cells ``r``'s sequence holds now."""
        return 0 if r.slot is None else int(self._kv.seq_cells(r.slot.seq_id)[0].size)

    def fits_alone(self, r: RequestRecord, capacity: int) -> bool:
        """True if ``r`` could run to its end (max_tokens or context end) with the whole pool to itself."""
        return r.total_cells(self.n_ctx) <= capacity

    def retry_at(self, running: Sequence[RequestRecord]) -> float | None:
        """The earliest ``time.monotonic()`` a parked request retries or reaches its deadline (None: none parked)."""
        times = [min(r.kv_retry_at, r.kv_deadline) for r in running if r.kv_deadline is not None]
        return min(times) if times else None

    # --- ending ------------------------------------------------------------------------

    def idle_wait_s(self, running: Sequence[RequestRecord]) -> float:
        """How long the idle scheduler sleeps (host wall s): until the earliest KV retry, at most 0.25 s."""
        retry = self.retry_at(running)
        return 0.25 if retry is None else min(0.25, max(0.001, retry - time.monotonic()))

    def _end(self, r: RequestRecord, cause: str, err: KVExhausted, held: int, running: Sequence[RequestRecord]) -> None:
        cap = err.capacity
        self.stats["timeouts"] += 1
        self.log.append({
            "request_id": r.id, "cause": cause, "requested": err.requested, "free": err.free, "capacity": cap,
            "held": held, "fits_alone": self.fits_alone(r, cap),
            "others": tuple({"request_id": q.id, "held": self.held(q), "fits_alone": self.fits_alone(q, cap),
                             "parked": q.kv_deadline is not None, "kv_need": q.kv_need}
                            for q in running if q is not r and not q.ended)})
        self._end_failed(r, error_dict(err))

    def check_deadlines(self, running: Sequence[RequestRecord], busy: set[int]) -> None:
        """Parked requests: retry at once when cells came back; at a request's own deadline, decide who ends.

        ``running``: the requests holding slots; ``busy``: ``id()`` of those whose step is in flight.
        At the deadline of parked request ``r`` (it waited ``timeout_s`` while others held the cells),
        if ``r`` fits alone:
        1. requests that cannot finish in the pool even alone and hold cells are ended, newest first,
           until ``r``'s step fits;
        2. if that is not enough, one newer parked request whose cells are enough is ended (one ended
           either way, and the newer one has waited less);
        3. else ``r`` ends with KVExhausted (its step's cells, the free cells, the pool size).
        A request chosen while its step is in flight gets no new step (``kv_hold``), and the next pass
        (within a step) decides again.
        """
        running = [q for q in running if not q.ended]
        for q in running:
            q.kv_hold = False
        parked = [r for r in running if r.kv_deadline is not None]
        if not parked:
            return
        cap, free = int(self._kv.n_cells), self.free_cells()
        for r in parked:
            if r.kv_need <= free:
                r.kv_retry_at = 0.0  # cells came back: retry now rather than after the back-off
        now = time.monotonic()
        for r in sorted(parked, key=lambda q: (q.arrival_ms, q.id)):
            if r.ended or r.kv_deadline is None or now < r.kv_deadline or r.kv_need <= free:
                continue
            short = r.kv_need - free
            others = [q for q in running if q is not r and not q.ended]
            held = {q.id: self.held(q) for q in others}
            newest_first = sorted(others, key=lambda q: (q.arrival_ms, q.id), reverse=True)
            victims: list[RequestRecord] = []
            if self.fits_alone(r, cap):
                got = 0
                for q in newest_first:  # rule 1
                    if got < short and held[q.id] > 0 and not self.fits_alone(q, cap):
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
                if not self.fits_alone(q, cap):
                    total = q.total_cells(self.n_ctx)
                    why = (f"it needs up to {total} cells to finish (prompt {len(q.prompt)} + max_tokens "
                           f"{q.max_tokens}, context {self.n_ctx}), more than the {cap}-cell pool, so it "
                           f"was ended to give its cells to request {r.id}, which fits")
                    req = total - held[q.id]
                else:
                    why = (f"request {r.id} had waited {self.timeout_s:g} s for KV cells; this newer waiting "
                           f"request was ended so it could continue")
                    req = q.kv_need
                waited = now - q.kv_wait_start if q.kv_deadline is not None else 0.0
                self._end(q, "for_other", KVExhausted(req, free, cap, waited, why), held[q.id], running)
                free = self.free_cells()
            if r.kv_need <= free:
                r.kv_retry_at = 0.0
                continue
            self._end(r, "deadline", KVExhausted(
                r.kv_need, free, cap, now - r.kv_wait_start,
                f"waited out its {self.timeout_s:g} s KV deadline while other requests held the cells"),
                self.held(r), running)
            free = self.free_cells()

    def break_deadlock(self, running: Sequence[RequestRecord], slots: Sequence[Slot]) -> bool:
        """Nothing in flight and every running request parked: end the fewest so the rest can continue.

        A parked request whose step now fits is not stuck: it retries at once. If all are stuck, idle
        prefix caches (of ``slots`` without a request) are evicted first; then, one at a time until
        some survivor's step fits, requests holding cells are ended: those that cannot finish in the
        pool even alone first, then the newest. Each gets KVExhausted with its own step's cells, the
        cells free at that moment and the pool size. True if something changed (look for work again).
        """
        running = [q for q in running if not q.ended]
        if not running or any(r.kv_deadline is None for r in running):
            return False
        cap, free = int(self._kv.n_cells), self.free_cells()
        if any(r.kv_need <= free for r in running):
            changed = False
            for r in running:
                if r.kv_need <= free and r.kv_retry_at > 0.0:
                    r.kv_retry_at = 0.0
                    changed = True
            return changed
        idle = [s for s in slots if s.free and s.cache_tokens]
        if idle:  # cached prefixes of finished requests go first; then retry at once
            for s in idle:
                self._kv.free(s.seq_id)
                s.cache_tokens = []
            for r in running:
                r.kv_retry_at = 0.0
            return True
        held = {r.id: self.held(r) for r in running}
        order = sorted(running, key=lambda r: (self.fits_alone(r, cap), -r.arrival_ms, -r.id))
        survivors = list(running)
        now = time.monotonic()
        for v in order:
            if any(q.kv_need <= free for q in survivors):
                break
            if held[v.id] == 0:
                continue  # ending it would free nothing
            if self.fits_alone(v, cap):
                why = ("every running request was waiting for KV cells and none could continue; it was the "
                       "newest holding cells, so it was ended to let the others continue")
            else:
                why = (f"every running request was waiting for KV cells; it needs up to "
                       f"{v.total_cells(self.n_ctx)} cells to finish, more than the {cap}-cell pool, so it was "
                       f"ended first to let the others continue")
            survivors.remove(v)
            self._end(v, "deadlock", KVExhausted(v.kv_need, free, cap, now - v.kv_wait_start, why), held[v.id],
                      running)
            free = self.free_cells()
        for q in survivors:
            if q.kv_need <= free:
                q.kv_retry_at = 0.0
        return True

    def settle(self, r: RequestRecord) -> None:
        """``r`` ends while parked (cancel, drain, deadlock): book its wait (host wall) on the clock and
        in ``stats``."""
        if r.kv_deadline is None:
            return
        waited = time.monotonic() - r.kv_wait_start
        r.host["kv_wait"] += waited * 1e3
        self.stats["wait_wall_ms"] += waited * 1e3
        self._clock.host_span(r.kv_wait_start_sim, waited * 1e6)
        r.kv_deadline = None

    # --- taking cells (engine thread, without the lock) ----------------------------------

    def apply(self, r: RequestRecord, seq: int, positions: np.ndarray) -> np.ndarray | None:
        """Take KV cells for ``positions`` (int64 (n,)) of sequence ``seq`` without blocking the scheduler.

        One non-blocking ``apply`` per attempt; if too few cells are free the request is parked
        (``kv_need`` = the cells this step asks for) with exponential back-off while other requests
        keep running (they are what frees cells). Its deadline and deadlocks are decided under the
        engine lock by ``check_deadlines`` / ``break_deadlock``. The wait is put on the simulated
        clock, so the request's E2E includes it. Returns the cell indices, or None when parked.
        Raises KVExhausted (injected fault, or more cells than the pool has), RequestCancelled.
        """
        kv = self._kv
        n = int(positions.shape[0])
        now = time.monotonic()
        k0 = self._host_timer.now()
        try:
            cells = kv.apply(seq, n, timeout=0.0, cancel=r.handle.cancel_event, positions=positions)
        except KVExhausted as e:
            occ = kv.occupancy()
            if e.injected or n > occ.capacity_cells:
                raise  # retrying cannot help
            if r.kv_deadline is None:
                if not r.kv_parked_once:  # count requests that waited, not parkings
                    r.kv_parked_once = True
                    self.stats["parked_requests"] += 1
                r.kv_deadline = now + self.timeout_s
                r.kv_wait_start = now
                r.kv_wait_start_sim = self._clock.now_us
                r.kv_backoff_s = KV_BACKOFF_START_S
            r.kv_need = n
            r.kv_retry_at = now + r.kv_backoff_s
            r.kv_backoff_s = min(KV_BACKOFF_MAX_S, r.kv_backoff_s * 2)
            return None
        r.kv_need = 0
        r.kv_last_attempt_us = self._host_timer.now() - k0  # the apply itself (CPU)
        r.kv_last_wait_us = r.kv_last_attempt_us
        if r.kv_deadline is not None:
            waited = now - r.kv_wait_start
            r.kv_last_wait_us += waited * 1e6
            self.stats["wait_wall_ms"] += waited * 1e3
            self._clock.host_span(r.kv_wait_start_sim, waited * 1e6)
            r.kv_deadline = None
            r.kv_retry_at = 0.0
        return np.asarray(cells)

    def evict_idle(self, slots: Sequence[Slot], need: int) -> None:
        """Free KV of idle slots' cached prefixes, least recently used first, until ``need`` cells fit.
        Called with the engine lock held."""
        idle = sorted((s for s in slots if s.free and s.cache_tokens), key=lambda s: s.last_used)
        for s in idle:
            if self._kv.can_allocate(need):
                return
            self._kv.free(s.seq_id)
            s.cache_tokens = []
