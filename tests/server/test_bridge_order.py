"""The event bridge hands each request's formatted items to the loop in the order ``fmt`` saw them,
whatever the pump threads' scheduling: what fmt decides from every request's progress (the n choices'
single ``[DONE]`` after the last request's end) must arrive in that order."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from calconsole.server.bridge import EventBridge, receive_all
from sim_backend.planes.types import DoneEvent, RequestResult, Timings


class _Ended:
    """A request stream whose only event is its end (the plane's ``RequestStream`` surface the bridge uses)."""

    def __init__(self, rid: int) -> None:
        self.id, self.done = rid, False
        timings = Timings(*([0] * 16), numerics=True, arrival_ms=0.0, done_ms=0.0, host_booked_ms=0.0)
        self._ev: DoneEvent | None = DoneEvent(rid, RequestResult(rid, "finished", "", (), "limit", "", None,
                                                                  timings, 1))

    def next_event(self, timeout: float) -> Any:
        ev, self._ev = self._ev, None
        self.done = True
        return ev

    def cancel(self, reason: str) -> None:
        self.done = True


def test_a_request_descheduled_between_its_format_and_its_hand_over_is_not_overtaken() -> None:
    """Request 0 ends first (fmt: its usage chunk) and its pump stalls before handing it over; request 1
    ends next (fmt: its usage chunk and [DONE], the last request's end). [DONE] must still come last. The
    stall waits (at most 2 s) for request 1's fmt to run, which it can only do once request 0 handed over:
    before the fix it ran meanwhile and its [DONE] overtook request 0's usage chunk."""
    ended: list[int] = []
    second_formatted = threading.Event()

    def fmt(i: int, ev: Any) -> list[Any]:
        ended.append(i)
        if len(ended) == 2:
            second_formatted.set()
            return [f"usage {i}", "[DONE]"]
        return [f"usage {i}"]

    async def run() -> list[Any]:
        streams = [_Ended(1), _Ended(2)]
        bridge = EventBridge(streams, fmt, silent_s=5.0, on_silent=lambda i: [], on_error=lambda i, e: [],
                             buffer=8)
        real_hand = bridge._hand

        def hand(send: Any, items: list[Any]) -> bool:
            if items == ["usage 0"]:  # request 0's pump, descheduled right here
                second_formatted.wait(2.0)
            return real_hand(send, items)

        bridge._hand = hand  # type: ignore[method-assign]
        bridge._threads[0].start()  # request 0 ends first: wait (bounded) until its fmt ran
        for _ in range(1000):
            if ended:
                break
            await asyncio.sleep(0.01)
        assert ended == [0]
        bridge._threads[1].start()
        return await asyncio.wait_for(receive_all(bridge.receive), 10.0)

    got = asyncio.run(run())
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1, got
    assert set(got) == {"usage 0", "usage 1", "[DONE]"}, got
