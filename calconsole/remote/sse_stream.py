"""The part every streamed request over HTTP shares, whichever server it talks to.

``SseRequestStream`` is a ``RequestStream`` (``EventStream``) whose events a reader thread takes from
an SSE response (``httpx_sse``): the queue and flags, ``cancel()`` (the socket shut down, so the
reader blocked in ``recv()`` wakes and the server sees the client gone), the one-time hand-out of
the result, and how a read that ends abnormally ends the request (``cancelled`` with the caller's
reason, or ``failed`` with "connection ... lost" and the connection marked down). What a chunk means
is the subclass's (``_consume``), and so is how a client-side result is built (``_end_client``).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
from httpx_sse import EventSource

from sim_backend.planes import DoneEvent, EventStream, RequestResult

from .connection import Connection, describe


class SseRequestStream(EventStream):
    """Base of a streamed request over HTTP. Thread-safe.

    Subclasses set their own fields, then call :meth:`_start` (the reader thread runs :meth:`_consume`,
    which returns normally once the stream's final chunk was handled, else raises), and implement
    :meth:`_end_client` (a result built here: ``cancelled`` or ``failed``, with the error given).
    """

    def __init__(self, conn: Connection, resp: httpx.Response, request_id: int, prompt_n: int) -> None:
        super().__init__()
        self._conn = conn
        self._resp = resp
        self.id = request_id
        self._prompt_n = prompt_n
        self._cancel = threading.Event()
        self._cancel_reason = ""
        self._pieces: list[str] = []
        self._thread: threading.Thread | None = None

    def _start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    @property
    def prompt_n(self) -> int:
        """Prompt tokens (with the chat template applied) as the server counts them."""
        return self._prompt_n

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self, reason: str = "cancelled by client") -> None:
        """Close the stream (the server cancels the request and frees its slot); idempotent, returns at once."""
        if self._done.is_set() or self._cancel.is_set():
            return
        self._cancel_reason = reason
        self._cancel.set()
        # shutdown, not close: it wakes the reader blocked in recv() and sends the FIN the server sees
        stream = self._resp.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if isinstance(sock, socket.socket):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed: the reader has ended or is ending

    def _finish(self, res: RequestResult) -> None:
        """Hand out the result once (later calls are ignored)."""
        if self._done.is_set():
            return
        self._result = res
        self._put(DoneEvent(res.request_id, res))
        self._done.set()

    def _chunks(self) -> Iterator[Any]:
        """The stream's JSON chunks, up to ``[DONE]`` or the end of the response."""
        for sse in EventSource(self._resp).iter_sse():
            if sse.data == "[DONE]":
                return
            yield json.loads(sse.data)

    # --- subclass hooks ----------------------------------------------------------------------

    def _consume(self) -> None:  # pragma: no cover - overridden
        """Read :meth:`_chunks` to the end and :meth:`_finish` the request; raise if it ended early."""
        raise NotImplementedError

    def _end_client(self, status: str, error: dict[str, Any]) -> None:  # pragma: no cover - overridden
        """Finish with a result built on the client (``status`` "cancelled" or "failed", ``error``)."""
        raise NotImplementedError

    # --- the reader thread -------------------------------------------------------------------

    def _end_cancelled(self) -> None:
        self._end_client("cancelled", {"type": "cancelled", "message": self._cancel_reason})

    def _read(self) -> None:
        try:
            self._consume()
        except Exception as e:  # noqa: BLE001 - whatever ended the read, the request gets a result
            if self._cancel.is_set():
                self._end_cancelled()
            elif not self._done.is_set():
                reason = describe(e)
                if isinstance(e, httpx.TransportError):
                    self._conn.mark_down(reason)
                self._end_client("failed", {
                    "type": "connection_lost",
                    "message": f"connection to {self._conn.url} lost mid-stream after {len(self._pieces)} "
                               f"pieces: {reason}"})
        finally:
            if self._cancel.is_set() and not self._done.is_set():
                self._end_cancelled()
            self._resp.close()
