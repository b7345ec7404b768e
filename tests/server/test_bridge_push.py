"""The event bridge without a thread per request: the engine thread's events are scheduled onto the loop
(``subscribe``), formatted there and handed over in the order the engine made them."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from calconsole.server.bridge import EventBridge, receive_all
from sim_backend.planes.types import DoneEvent, RequestResult, Timings, TokenEvent
from sim_backend.serving.api import RequestHandle


def _result(rid: int) -> RequestResult:
    timings = Timings(*([0] * 16), numerics=True, arrival_ms=0.0, done_ms=0.0, host_booked_ms=0.0)
    return RequestResult(rid, "finished", "", (), "limit", "", None, timings, 1)


def _tok(rid: int, text: str, n: int) -> TokenEvent:
    return TokenEvent(rid, text, n, float(n), (), (), 0)


def test_a_subscriber_gets_the_queued_events_first_then_each_on_the_producers_thread() -> None:
    h = RequestHandle(7, 3)
    h.emit(_tok(7, "a", 1))
    h.emit(_tok(7, "b", 2))
    got: list[tuple[str, str]] = []
    h.subscribe(lambda ev: got.append((getattr(ev, "text", "done"), threading.current_thread().name)))
    assert [t for t, _ in got] == ["a", "b"]
    t = threading.Thread(target=lambda: (h.emit(_tok(7, "c", 3)), h._finish(_result(7))), name="producer")
    t.start()
    t.join(10)
    assert [t for t, _ in got] == ["a", "b", "c", "done"] and got[2][1] == got[3][1] == "producer"
    assert h.next_event(0.0) is None  # nothing queued once subscribed
    with pytest.raises(RuntimeError, match="already has a subscriber"):
        h.subscribe(lambda ev: None)


def test_the_bridge_starts_no_thread_and_keeps_the_engines_order() -> None:
    def fmt(i: int, ev: Any) -> list[Any]:
        return [(i, "end")] if isinstance(ev, DoneEvent) else [(i, ev.text)]

    async def run() -> tuple[list[Any], int, int]:
        hs = [RequestHandle(1, 1), RequestHandle(2, 1)]
        before = threading.active_count()
        bridge = EventBridge(hs, fmt, silent_s=30.0, on_silent=lambda i: [], on_error=lambda i, e: [],
                             buffer=16).start()
        during = threading.active_count()

        def engine() -> None:  # one producer thread interleaving two requests, as the engine does
            for k in range(3):
                for h in hs:
                    h.emit(_tok(h.id, f"t{k}", k + 1))
            for h in hs:
                h._finish(_result(h.id))

        t = threading.Thread(target=engine)
        t.start()
        got = await asyncio.wait_for(receive_all(bridge.receive), 10.0)
        t.join(10)
        return got, before, during

    got, before, during = asyncio.run(run())
    assert during == before  # no pump thread
    assert got == [(i, f"t{k}") for k in range(3) for i in (0, 1)] + [(0, "end"), (1, "end")]


def test_a_request_silent_past_its_bound_is_cancelled_and_ends_with_the_silence_items() -> None:
    async def run() -> tuple[list[Any], RequestHandle]:
        h = RequestHandle(3, 1)
        bridge = EventBridge([h], lambda i, ev: [ev.text], silent_s=0.3,
                             on_silent=lambda i: [f"silent {i}"], on_error=lambda i, e: [], buffer=8).start()
        h.emit(_tok(3, "x", 1))  # an event moves the bound on; then nothing comes
        return await asyncio.wait_for(receive_all(bridge.receive), 20.0), h

    got, h = asyncio.run(run())
    assert got == ["x", "silent 0"] and h.cancelled
    assert "step timeout" in h.cancel_reason


def test_a_response_that_went_away_cancels_its_request_and_the_engine_side_never_raises() -> None:
    async def run() -> RequestHandle:
        h = RequestHandle(4, 1)
        bridge = EventBridge([h], lambda i, ev: ["piece"], silent_s=30.0, on_silent=lambda i: [],
                             on_error=lambda i, e: [], buffer=8).start()
        bridge.receive.close()  # the response stopped reading
        h.emit(_tok(4, "x", 1))
        for _ in range(200):  # the loop delivers it on its next turn
            if h.cancelled:
                break
            await asyncio.sleep(0.01)
        return h

    h = asyncio.run(run())
    assert h.cancelled and h.cancel_reason == "client stopped reading the stream"


def test_events_after_the_loop_closed_cancel_the_request_quietly() -> None:
    box: dict[str, Any] = {}

    async def run() -> None:
        h = RequestHandle(5, 1)
        box["h"] = h
        box["bridge"] = EventBridge([h], lambda i, ev: [], silent_s=30.0, on_silent=lambda i: [],
                                    on_error=lambda i, e: [], buffer=8).start()

    asyncio.run(run())  # the loop is closed when run returns
    h = box["h"]
    h.emit(_tok(5, "late", 1))  # the engine thread keeps producing: no exception reaches it
    assert h.cancelled and h.cancel_reason == "server stopped"
