"""Engine thread -> event loop: request events pushed into an anyio memory stream, no polling.

The plane's ``RequestStream`` is pull-only (``next_event(timeout)``), so each request gets one pump
thread that blocks on it and hands every event, already formatted (``fmt``), to the event loop
with ``loop.call_soon_threadsafe`` into a memory object stream. The loop side awaits that stream;
nothing polls. A request's events are at most its tokens, its prompt progress (when asked for) and its end,
so the buffer is bounded by the context (``buffer``) and a push never blocks the engine side.

A streamed HTTP token crosses 7 hand-offs: engine thread -> the request's event queue -> its pump
thread -> ``call_soon_threadsafe`` into the memory stream -> sse-starlette's send loop -> uvicorn's
ASGI send -> the transport's buffer -> the socket. (Before: a worker thread from anyio's pool per
event, polling every 0.25 s, and an async-generator layer between them: 9.)

Cancellation: ``cancel(reason)`` cancels every request (idempotent); the engine then ends each
within one device step and its DoneEvent flows as usual. A pump that hears nothing for
``silent_s`` host seconds (the engine's step timeout plus a margin) cancels its request and ends
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
    """Pump threads for ``streams``; ``receive`` yields ``fmt(index, event)``'s items in arrival order and
    ends once every request's DoneEvent (or silence) has been handed over.

    Args:
        streams: submitted requests (their index in this list is passed to ``fmt``).
        fmt: ``(index, event) -> items`` run on the pump thread (pure formatting; an exception becomes
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
        # one request's formatting and hand-over at a time: the order items reach the loop is then the order
        # ``fmt`` saw the events in, so what fmt decides from all requests' progress (the n choices' one
        # [DONE], after the last request's end) is delivered in that order (a pump descheduled between its
        # fmt and its hand-over let another request's [DONE] overtake its usage chunk, under load)
        self._order = threading.Lock()
        self._threads = [threading.Thread(target=self._pump, args=(i,), name=f"calconsole-pump-req{h.id}",
                                          daemon=True) for i, h in enumerate(self.streams)]

    def start(self) -> EventBridge:
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
