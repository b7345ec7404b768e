"""The trace replay's reference: the same requests through real engines, token by token.

One :class:`~sim_backend.compose.System` per board (timing-only, fast pacing, what ``calconsole serve``
builds: slots, queue limit, prefill chunk, KV pool, cost model, modeled host work); rows go to boards
round-robin (the router that needs no view of a board). Each engine gets an arrival feed
(``Engine.attach_feed``): at every step boundary it submits the rows that have arrived by then on the
simulated clock, with their own arrival time, and moves an idle board's clock to its next arrival. That
is the event rule of :mod:`sim_backend.tools.replay`, so the fast path must agree with this to float
rounding; the bench and the tests compare their P50 / P95.

Slow by design (every token is a device step with its threads and pricing): for slices, not the hour.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from sim_backend.bundle.manifest import load_bundle
from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.errors import CalError, UnavailableError
from sim_backend.planes.types import SLO, ChatRequest, SamplingParams
from sim_backend.tools.replay import summarize
from sim_backend.tools.replay_board import Ledger, ReplayConfig
from sim_backend.tools.replay_trace import Trace

__all__ = ["prompt_ids", "replay_on_engine"]

#: first token of row i's prompt: distinct per row (< 140,000 rows), so no slot's cached prefix is reused
FIRST_ID, SPAN_IDS = 1000, 140_000


def prompt_ids(row: int, n: int) -> tuple[int, ...]:
    """``n`` plain BPE ids (no special token: Qwen3's start at 151,643) for trace row ``row``; the first id
    is distinct per row, so requests share no prefix (the trace says nothing of reuse)."""
    head = FIRST_ID + row % SPAN_IDS
    return (head,) + tuple(2000 + (row * 31 + j) % 90_000 for j in range(1, n))


class _Feed:
    """Arrivals of one board: (row, arrival µs) in time order, submitted at step boundaries."""

    def __init__(self, system: Any, rows: list[tuple[int, float]], trace: Trace, led: Ledger) -> None:
        self.sys = system
        self.rows = deque(rows)
        self.trace = trace
        self.led = led
        self.handles: list[tuple[int, Any]] = []
        self.done = threading.Event()
        self.error: BaseException | None = None
        if not rows:
            self.done.set()

    def __call__(self, idle: bool) -> None:
        try:
            self._feed(idle)
        except BaseException as e:  # the waiter must hear of it, not time out
            self.error = e
            self.done.set()
            raise

    def _feed(self, idle: bool) -> None:
        eng = self.sys.engine
        clock = self.sys.board.clock  # the board's own clock (the runtime's view is read-only)
        if not self.rows:
            return
        if idle and eng.active_count() == 0:
            clock.advance_to(self.rows[0][1])  # nothing to run until the next arrival
        now = clock.now_us
        while self.rows and self.rows[0][1] <= now:
            row, a = self.rows.popleft()
            p, out = int(self.trace.prompt[row]), int(self.trace.output[row])
            if p + out > eng.n_ctx:
                self.led.reason[row] = "context"
                continue
            req = ChatRequest(messages=(), prompt_tokens=prompt_ids(row, p), max_tokens=out, ignore_eos=True,
                              sampling=SamplingParams(seed=row))
            try:
                self.handles.append((row, eng.submit(req, arrival_us=a)))
            except UnavailableError:
                self.led.reason[row] = "queue_full"
            except CalError as e:
                self.led.reason[row] = type(e).__name__
        if not self.rows:
            self.done.set()


def replay_on_engine(trace: Trace, bundle_dir: str | Path | None = None, *, boards: int,
                     cfg: ReplayConfig | None = None, slo: SLO | None = None, attainment: float = 0.9,
                     timeout_s: float = 1800.0) -> dict[str, Any]:
    """Replay ``trace`` through ``boards`` real engines (round-robin); returns :func:`replay.summarize`'s dict
    plus ``requests``, ``boards``, ``bundle``, ``rejected``, ``statuses``. Raises ValueError for a router
    other than round-robin, TimeoutError when a request does not end within ``timeout_s`` host seconds."""
    cfg = cfg or ReplayConfig()
    if cfg.route != "round-robin":
        raise ValueError("the engine reference routes round-robin only (the fast path's other routers read "
                         "every board at each arrival)")
    n = len(trace)
    led = Ledger(n)
    arr = trace.arrival_s * 1e6
    n_slots = cfg.slots_for(load_bundle(bundle_dir).decode_batch)
    systems = [build_system(bundle_dir, pacing=Pacing(PacingMode.FAST), numerics=False, n_slots=n_slots,
                            queue_limit=cfg.queue_limit, prefill_chunk=cfg.prefill_chunk, maintenance=False)
               for _ in range(boards)]
    feeds: list[_Feed] = []
    statuses: dict[str, int] = {}
    try:
        for k, s in enumerate(systems):
            f = _Feed(s, [(i, float(arr[i])) for i in range(k, n, boards)], trace, led)
            feeds.append(f)
            s.engine.attach_feed(f)
        for f in feeds:
            if not f.done.wait(timeout_s):
                raise TimeoutError(f"board fed for {timeout_s:.0f} s without taking every arrival")
            if f.error is not None:
                raise RuntimeError(f"the arrival feed failed: {f.error!r}") from f.error
        for k, f in enumerate(feeds):
            for row, h in f.handles:
                res = h.result(timeout_s)
                statuses[res.status] = statuses.get(res.status, 0) + 1
                t = res.timings
                led.board[row] = k
                a_ms = t.arrival_ms
                if t.queue_ms is not None:
                    led.assigned[row] = (a_ms + t.queue_ms) * 1e3
                if res.status != "finished":
                    led.reason[row] = res.status
                    continue
                led.first[row] = (a_ms + (t.ttft_ms or 0.0)) * 1e3
                led.last[row] = (a_ms + t.e2e_ms) * 1e3
                if t.itl_ms:
                    led.itl.append(np.asarray(t.itl_ms) * 1e3)
                # the reference stamps arrivals as given; re-base on the trace's own times
                led.first[row] += arr[row] - a_ms * 1e3
                led.last[row] += arr[row] - a_ms * 1e3
                if t.queue_ms is not None:
                    led.assigned[row] += arr[row] - a_ms * 1e3
    finally:
        for s in systems:
            s.close()
    out: dict[str, Any] = {"requests": n, "boards": boards, "bundle": systems[0].bundle.name, "route": cfg.route}
    out.update(summarize(trace, led, slo=slo or SLO(), attainment=attainment))
    rejected: dict[str, int] = {}
    for why in led.reason:
        if why:
            rejected[why] = rejected.get(why, 0) + 1
    out["rejected"] = rejected
    out["statuses"] = statuses
    return out
