"""Engine thread -> event loop: request events pushed into an anyio memory stream, no polling, no thread.

Each request's stream is ``subscribe``d: the engine thread hands every event to a callback that only
schedules it on the event loop (``loop.call_soon_threadsafe``); on the loop it is formatted (``fmt``) and
put into a memory object stream the response awaits. Nothing polls and no thread waits per request. A
request's events are at most its tokens, its prompt progress (when asked for) and its end, so the buffer
is bounded by the context (``buffer``) and a push never blocks the engine side.

A streamed HTTP token crosses 5 hand-offs: engine thread -> ``call_soon_threadsafe`` onto the loop (formatted
there) into the memory stream -> sse-starlette's send loop -> uvicorn's ASGI send -> the transport's
buffer -> the socket. (Before: the request's event queue and a pump thread per request between the engine
and the loop: 7; earlier, a worker thread from anyio's pool per event polling every 0.25 s: 9.)
A stream that cannot be subscribed (no ``subscribe``) gets the pump thread of old.

Order: events reach the loop in the order the engine made them (one producer thread; ``call_soon_threadsafe``
callbacks run first in, first out), so what ``fmt`` decides from all requests' progress (the n choices'
one [DONE], after the last request's end) is delivered in that order.

Cancellation: ``cancel(reason)`` cancels every request (idempotent); the engine then ends each
within one device step and its DoneEvent flows as usual. A request that gives no event for
``silent_s`` host seconds (the engine's step timeout plus a margin) is cancelled and ends
with ``on_silent``'s items.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from sim_backend.planes import DoneEvent, RequestStream, StreamEvent

Formatter = Callable[[int, StreamEvent], list[Any]]


class EventBridge:
    """Subscriptions to ``streams`` (module docstring); ``receive`` yields ``fmt(index, event)``'s items in
    arrival order and ends once every request's DoneEvent (or silence) has been handed over.

    Args:
        streams: submitted requests (their index in this list is passed to ``fmt``).
        fmt: ``(index, event) -> items`` run on the event loop (pure formatting; an exception becomes
            ``on_error(index, exc)``'s items and ends that request).
        silent_s: host seconds without an event after which a request is cancelled as stuck.
        on_silent / on_error: items to hand over in those cases.
        buffer: memory-stream capacity (items); at least every item the requests can produce.
        first: items ``receive`` yields before any event (a stream's role chunk).
    """

    def __init__(self, streams: Sequence[RequestStream], fmt: Formatter, *, silent_s: float,
                 on_silent: Callable[[int], list[Any]], on_error: Callable[[int, BaseException], list[Any]],
                 buffer: int, first: Sequence[Any] = ()) -> None:
        self.streams = list(streams)
        self._fmt = fmt
        self._silent_s = silent_s
        self._on_silent = on_silent
        self._on_error = on_error
        send, self.receive = anyio.create_memory_object_stream[Any](max_buffer_size=buffer + len(first))
        for it in first:
            send.send_nowait(it)
        self._sends: list[MemoryObjectSendStream[Any]] = [send.clone() for _ in self.streams]
        send.close()
        self._loop = asyncio.get_running_loop()
        self._ended = [False] * len(self.streams)
        self._last = [0.0] * len(self.streams)  # loop time of each request's last event
        self._timers: list[asyncio.TimerHandle | None] = [None] * len(self.streams)
        # a pump thread only for a stream that cannot push (none of this project's own)
        self._order = threading.Lock()
        self._threads = [threading.Thread(target=self._pump, args=(i,), name=f"calconsole-pump-req{h.id}",
                                          daemon=True) for i, h in enumerate(self.streams)
                         if not callable(getattr(h, "subscribe", None))]

    def start(self) -> EventBridge:
        """Subscribe to every request (or start its pump thread). Call on the event loop, once."""
        now = self._loop.time()
        for i, h in enumerate(self.streams):
            sub = getattr(h, "subscribe", None)
            if callable(sub):
                self._last[i] = now
                self._timers[i] = self._loop.call_later(self._silent_s, self._check_silent, i)
                sub(self._from_engine(i))
        for t in self._threads:
            t.start()
        return self

    @property
    def done(self) -> bool:
        return all(h.done for h in self.streams)

    def cancel(self, reason: str) -> None:
        """Cancel every request not yet ended (returns at once; their ends still flow through ``receive``)."""
        for h in self.streams:
            if not h.done:
                h.cancel(reason)

    def stop_generation(self, reason: str) -> None:
        """End every request not yet ended at its next token as its limit would (``stop_generation``)."""
        for h in self.streams:
            if not h.done:
                h.stop_generation(reason)

    # --- push: the engine thread schedules, the loop formats and hands over ------------------------------

    def _from_engine(self, i: int) -> Callable[[StreamEvent], None]:
        loop, h = self._loop, self.streams[i]

        def on_event(ev: StreamEvent) -> None:  # the engine's thread: schedule only, never raise
            try:
                loop.call_soon_threadsafe(self._deliver, i, ev)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                h.cancel("server stopped")

        return on_event

    def _deliver(self, i: int, ev: StreamEvent) -> None:
        """On the loop: format request ``i``'s event and put its items into the memory stream."""
        if self._ended[i]:
            return
        self._last[i] = self._loop.time()
        h = self.streams[i]
        try:
            items = self._fmt(i, ev)
        except Exception as e:  # noqa: BLE001 - a formatting bug ends this request, not the server
            h.cancel("internal error formatting the response")
            self._end(i, self._on_error(i, e))
            return
        if isinstance(ev, DoneEvent):
            self._end(i, items)
        elif not self._put_all(i, items):
            h.cancel("client stopped reading the stream")
            self._end(i, [])

    def _put_all(self, i: int, items: list[Any]) -> bool:
        send = self._sends[i]
        try:
            for it in items:
                send.send_nowait(it)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False  # over its bound (cannot happen within ``buffer``) or the response is gone
        return True

    def _end(self, i: int, items: list[Any]) -> None:
        self._put_all(i, items)
        self._ended[i] = True
        t = self._timers[i]
        if t is not None:
            t.cancel()
            self._timers[i] = None
        self._sends[i].close()

    def _check_silent(self, i: int) -> None:
        """On the loop, ``silent_s`` after the last event seen then: cancel a request still silent."""
        self._timers[i] = None
        if self._ended[i]:
            return
        quiet = self._loop.time() - self._last[i]
        if quiet < self._silent_s:  # an event came meanwhile: look again when this one's silence would be due
            self._timers[i] = self._loop.call_later(self._silent_s - quiet, self._check_silent, i)
            return
        self.streams[i].cancel("no event from the engine within its step timeout")
        self._end(i, self._on_silent(i))

    # --- pull: a pump thread per request, for a stream without ``subscribe`` --------------------------

    def _hand(self, send: MemoryObjectSendStream[Any], items: list[Any]) -> bool:
        try:
            for it in items:
                self._loop.call_soon_threadsafe(send.send_nowait, it)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel("server stopped")
            return False
        return True

    def _pump(self, i: int) -> None:
        h, send = self.streams[i], self._sends[i]
        try:
            while True:
                ev = h.next_event(self._silent_s)
                if ev is None:
                    h.cancel("no event from the engine within its step timeout")
                    self._hand(send, self._on_silent(i))
                    return
                with self._order:
                    try:
                        items = self._fmt(i, ev)
                    except Exception as e:  # noqa: BLE001 - a formatting bug ends this request, not the server
                        h.cancel("internal error formatting the response")
                        self._hand(send, self._on_error(i, e))
                        return
                    handed = self._hand(send, items)
                if not handed or isinstance(ev, DoneEvent):
                    return
        finally:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(send.close)


async def receive_all(receive: MemoryObjectReceiveStream[Any]) -> list[Any]:
    """Every item until the stream ends."""
    return [it async for it in receive]


__all__ = ["EventBridge", "Formatter", "receive_all"]
