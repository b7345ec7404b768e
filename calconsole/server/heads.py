"""Response heads as llama-server writes them, sent in one write with the start of their body.

``OneWrite`` is the transport a request's cycle (uvicorn's ``RequestResponseCycle``, h11 or httptools) writes
through; ``GuardedConn``'s subclasses in ``run`` put it in place when a request head arrives. It

- spells every header name as llama-server (cpp-httplib) does (``Content-Type``, ``Process-Start-Time-Unix``;
  ``header_case``) and adds ``Date`` (RFC 9110 §6.6.1: an origin server with a clock sends it; uvicorn's own
  is off). Starlette lower-cases every name and uvicorn's httptools protocol lower-cases them again on the
  wire, so the casing is done here, on the bytes, for both. HTTP says case does not matter, but clients that
  keep headers in a plain dict (llama.cpp's test harness) look them up by llama-server's spelling;
- holds the head until the body's first write and writes both at once: a kept-alive ``GET /health`` was two
  TCP sends (two syscalls, two loopback deliveries), now one. A head whose body does not come in the same
  turn of the event loop (a stream waiting for its first event, a HEAD request) is written at the end of it.

Heads are rewritten through a small cache (the same head within one second of ``Date`` is the same bytes).
"""

from __future__ import annotations

import asyncio
import functools
import time
from email.utils import formatdate
from typing import Any

#: names whose usual spelling is not plain Title-Case (RFC 9110's own spellings)
_SPELLED = {b"www-authenticate": b"WWW-Authenticate", b"etag": b"ETag", b"te": b"TE"}
#: bodies up to this many bytes are joined to their head (a copy); longer ones follow it in a write of their own
JOIN_BYTES = 64 * 1024
#: heads kept rewritten, and the longest kept (bytes): the server writes a few kinds of head
_CACHE_HEADS = 64
_CACHE_HEAD_BYTES = 2048


@functools.lru_cache(maxsize=512)
def header_case(name: bytes) -> bytes:
    """``b"process-start-time-unix"`` -> ``b"Process-Start-Time-Unix"``: each dash-separated word capitalised,
    as llama-server (cpp-httplib) writes its names; a few names keep their RFC spelling (``WWW-Authenticate``).
    Cached: the server writes a small, fixed set of names."""
    low = name.lower()
    return _SPELLED.get(low) or b"-".join(w[:1].upper() + w[1:] for w in low.split(b"-"))


class _Heads:
    """Rewritten heads of the current second (``Date`` changes with it)."""

    def __init__(self) -> None:
        self.second = -1
        self.date = b""
        self.cache: dict[bytes, bytes] = {}

    def rewrite(self, head: bytes) -> bytes:
        """``head`` (a whole response head, ending in an empty line) with its names cased and ``Date`` added;
        anything else unchanged."""
        now = int(time.time())
        if now != self.second:
            self.second, self.cache = now, {}
            self.date = b"Date: " + formatdate(now, usegmt=True).encode("ascii")
        out = self.cache.get(head)
        if out is not None:
            return out
        if not head.endswith(b"\r\n\r\n"):
            return head
        lines = head[:-4].split(b"\r\n")
        cased = [lines[0]]
        for line in lines[1:]:
            name, sep, rest = line.partition(b":")
            if name.lower() != b"date":
                cased.append(header_case(name) + sep + rest)
        cased.append(self.date)
        out = b"\r\n".join(cased) + b"\r\n\r\n"
        if len(head) <= _CACHE_HEAD_BYTES:
            if len(self.cache) >= _CACHE_HEADS:
                self.cache.clear()
            self.cache[head] = out
        return out


_HEADS = _Heads()


def rewrite_head(head: bytes) -> bytes:
    """A response head as llama-server spells it, with ``Date`` (see the module docstring)."""
    return _HEADS.rewrite(head)


class OneWrite:
    """The transport one request's cycle writes to (see the module docstring); every other attribute is the
    connection's transport's. Event loop thread only."""

    __slots__ = ("_held", "_loop", "_state", "_transport")

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held = b""
        self._state = 0  # 0: no head yet; 1: the head held; 2: the head written

    def write(self, data: bytes) -> None:
        state = self._state
        if state == 2:
            self._transport.write(data)
        elif state == 1:
            self._state = 2
            held, self._held = self._held, b""
            if len(data) <= JOIN_BYTES:
                self._transport.write(held + data)
            else:
                self._transport.write(held)
                self._transport.write(data)
        elif data.startswith(b"HTTP/1.1 1"):  # 100 Continue: not the response's head, written as it is
            self._transport.write(data)
        else:
            self._held = rewrite_head(data)
            self._state = 1
            self._loop.call_soon(self.flush)

    def flush(self) -> None:
        """Write the held head now (its body did not come in the turn it was written in)."""
        if self._state == 1:
            self._state = 2
            held, self._held = self._held, b""
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
