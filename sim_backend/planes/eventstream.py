"""The consuming side every request stream shares (the in-process handle, the HTTP client stream):
``next_event`` / ``stream`` / ``result`` over a queue of ``StreamEvent`` (token, progress, done), or,
once a consumer ``subscribe``s, each event handed to it on the producing thread (no queue, no thread
of the consumer's blocked on it: what the HTTP face's event bridge uses).

At the seam with the value types: it imports nothing of serving, runtime, device or model.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

from sim_backend.planes.types import DoneEvent, RequestResult, StreamEvent


class EventStream:
    """Base of a ``RequestStream`` implementation: ``next_event`` / ``stream`` / ``result`` over
    ``_events`` (a queue of StreamEvent) and ``_done`` (set with ``_result``).
    Subclasses call ``super().__init__()``, set ``id``, produce events with ``_put`` and provide ``cancel``."""

    id: int

    def __init__(self) -> None:
        self._events: queue.Queue[StreamEvent] = queue.Queue()
        self._done = threading.Event()
        self._result: RequestResult | None = None
        self._listener: Callable[[StreamEvent], None] | None = None
        self._sub_lock = threading.Lock()

    def _put(self, event: StreamEvent) -> None:
        """Producer side: hand ``event`` to the subscriber (on this thread) or queue it for ``next_event``."""
        fn = self._listener
        if fn is None:
            with self._sub_lock:  # against a subscribe draining the queue right now
                fn = self._listener
                if fn is None:
                    self._events.put(event)
                    return
        fn(event)

    def subscribe(self, fn: Callable[[StreamEvent], None]) -> None:
        """Hand every event to ``fn`` from now on, first those already queued (in order), then each as the
        producer makes it, on the producer's thread (the engine's): ``fn`` must be quick and must not raise
        (it typically schedules the event on an event loop). ``next_event`` sees nothing afterwards.

        Raises RuntimeError on a second subscription (one consumer per stream)."""
        with self._sub_lock:
            if self._listener is not None:
                raise RuntimeError(f"request {self.id}: the stream already has a subscriber")
            while True:
                try:
                    fn(self._events.get_nowait())
                except queue.Empty:
                    break
            self._listener = fn

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self, reason: str = "cancelled by client") -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def stop_generation(self, reason: str) -> None:
        """End the request as its token limit would (finished, ``stop_type`` limit) at its next token.
        A stream that cannot do that (an HTTP client's) cancels it with ``reason``; the in-process
        handle overrides this."""
        self.cancel(reason)

    def next_event(self, timeout: float) -> StreamEvent | None:
        """Next event within ``timeout`` host seconds, or None."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def stream(self, timeout: float = 60.0) -> Iterator[StreamEvent]:
        """Yield events until the DoneEvent. Raises TimeoutError if nothing arrives for ``timeout`` host s
        (the request keeps running; the caller decides whether to cancel).

        A consumer that stops iterating early (the generator is closed or collected) or is
        interrupted (Ctrl-C) cancels the request: a vanished client counts as a cancel.
        """
        try:
            while True:
                ev = self.next_event(timeout)
                if ev is None:
                    raise TimeoutError(f"request {self.id}: no event for {timeout:.0f} s")
                yield ev
                if isinstance(ev, DoneEvent):
                    return
        except GeneratorExit:
            if not self.done:
                self.cancel("client stopped reading the stream")
            raise
        except KeyboardInterrupt:
            if not self.done:
                self.cancel("interrupted by user (Ctrl-C)")
            raise

    def result(self, timeout: float) -> RequestResult:
        """Block up to ``timeout`` host seconds for the final result (TimeoutError otherwise)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not done after {timeout:.1f} s")
        assert self._result is not None
        return self._result
