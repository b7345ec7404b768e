"""Request-level bounds of the serving face, below the connection guard (``conns``): requests in progress
(``RequestBound``, a reserve for /health and /maintenance/*), snapshot-stream places per address
(``PeerPlaces``) and their progress deadline (``Progress``), and how many heavy replies are produced or
sent at once (``ReplyGuard``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import anyio

from .conns import SCOPE_KEY, ConnectionGuard, GuardedConn, conn_of, error_bytes  # noqa: F401
from .replies import PIECE_BYTES
from .wire import HTTPError

#: paths that keep ``reserve`` places beyond ``max_active``: the operator can look and act when traffic is full
RESERVED_PREFIXES = ("/health", "/maintenance/")


class RequestBound:
    """ASGI wrapper: at most ``max_active`` requests in progress (503 JSON beyond), ``reserve`` more for
    ``/health`` and ``/maintenance/*``; a request with both Content-Length and Transfer-Encoding is a 400.

    ``active`` counts requests from their head to the end of their response (streams included).
    """

    def __init__(self, app: Any, max_active: int, reserve: int = 8,
                 is_admin: Callable[[dict[str, Any]], bool] | None = None) -> None:
        """``is_admin(scope)``: whether a request shows an admin key (a connection of the reserve that does
        is never closed to make room there)."""
        self.app = app
        self.max_active = max_active
        self.reserve = reserve
        self.is_admin = is_admin
        self.active = 0
        self.refused = 0

    async def _answer(self, send: Any, status: int, type_: str, message: str) -> None:
        await _answer(send, status, type_, message)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        names = {k for k, _ in scope.get("headers", ())}
        if b"content-length" in names and b"transfer-encoding" in names:
            await self._answer(send, 400, "invalid_request_error",
                               "request has both Content-Length and Transfer-Encoding; send one of them")
            return
        reserved_path = scope["path"].startswith(RESERVED_PREFIXES)
        conn = conn_of(scope)
        if conn is not None and conn.reserved:
            if not reserved_path:
                await self._answer(send, 503, "unavailable_error",
                                   "server busy: at its connection cap; past it only /health and /maintenance/* "
                                   "are served")
                return
            if self.is_admin is not None and self.is_admin(scope):
                conn.admin = True
        limit = self.max_active + (self.reserve if reserved_path else 0)
        if self.active >= limit:
            self.refused += 1
            await self._answer(send, 503, "unavailable_error",
                               f"server busy: {self.active} requests in progress (limit {self.max_active})")
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1



class PeerPlaces:
    """Places of one kind held by peer address, at most ``per_peer`` for one address (event loop thread only)."""

    def __init__(self, per_peer: int) -> None:
        self.per_peer = max(1, per_peer)
        self.held: dict[str, int] = {}

    def take(self, peer: str) -> bool:
        """Take one for ``peer``; False when it holds ``per_peer`` already."""
        n = self.held.get(peer, 0)
        if n >= self.per_peer:
            return False
        self.held[peer] = n + 1
        return True

    def give(self, peer: str) -> None:
        n = self.held.get(peer, 0) - 1
        if n > 0:
            self.held[peer] = n
        else:
            self.held.pop(peer, None)


class Progress:
    """Whether a connection's reader takes what it is sent: ``stalled()`` is True once its unsent bytes
    (``GuardedConn.unsent_bytes``) have not shrunk for ``stall_s`` host s while some are waiting.

    A reader that reads keeps them near 0 or shrinking; one that stopped keeps them growing once the
    kernel buffers between (its receive window, our send queue) are full. A send timeout alone never
    fires while the kernel still takes bytes: 8 snapshot streams that never read held every place for
    over 50 s (measured on this release)."""

    def __init__(self, conn: GuardedConn | None, stall_s: float) -> None:
        self.conn = conn
        self.stall_s = stall_s
        self._last = 0
        self._since: float | None = None

    def stalled(self) -> bool:
        if self.conn is None:
            return False
        n, now = self.conn.unsent_bytes(), time.monotonic()
        if n == 0 or n < self._last:
            self._since = None
        elif self._since is None:
            self._since = now
        self._last = n
        return self._since is not None and now - self._since >= self.stall_s

#: routes whose reply grows with the request body (a token's piece per id): heavy when the body is large
HEAVY_REPLY_PATHS = ("/tokenize", "/detokenize")
#: reply bytes the heavy replies being produced or sent may hold at once; with ``reply_limit`` (16 x the body
#: limit: 16 MiB at the default 1 MiB) it gives the places (4 by default). A reply's own objects (the parsed
#: ids, its text) hold about as much again: measured, 20 non-reading clients of 12 MB replies from 20 addresses
#: grew the server's RSS by 88 MB with 4 places, 1,431 MB without them (``python -m calconsole.bench.slow_readers``)
HEAVY_REPLY_BUDGET = 64 << 20


class ReplyGuard:
    """ASGI wrapper bounding what a slow reader can hold, for every reply:

    - a reply body is handed to the connection in pieces of at most ``replies.PIECE_BYTES``; uvicorn
      writes a piece only once the transport's buffer is below its low-water mark, so a connection
      never holds more than ~2 pieces in user space (its output cap), whatever the reply's size;
    - each piece must be taken within ``send_timeout_s`` (host s), else the connection is cut (a reset;
      ``ConnStats.send_deadline``) and the rest of the reply dropped: a client that stops reading frees
      its reply within that deadline. Streams also have sse-starlette's own send timeout;
    - a request on ``HEAVY_REPLY_PATHS`` whose body is over ``heavy_body_bytes`` (or of unknown size:
      chunked) takes one of ``places`` heavy-reply places from its start to its last piece sent, at most
      ``per_peer`` of them for one address; beyond, it is answered 503 ``unavailable_error`` at once,
      before its body is read (``ConnStats.heavy_refused``).
    """

    def __init__(self, app: Any, guard: ConnectionGuard | None, *, send_timeout_s: float, heavy_body_bytes: int,
                 places: int, per_peer: int | None = None) -> None:
        self.app = app
        self.guard = guard
        self.send_timeout_s = send_timeout_s
        self.heavy_body_bytes = heavy_body_bytes
        self.places = max(1, places)
        #: one address never holds every place while there are two or more
        self.per_peer = per_peer if per_peer is not None else max(1, self.places // 2)
        self.active = 0
        self._by_peer: dict[str, int] = {}

    def _heavy(self, scope: dict[str, Any]) -> bool:
        if scope.get("method") != "POST" or scope.get("path") not in HEAVY_REPLY_PATHS:
            return False
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                return not v.isdigit() or int(v) > self.heavy_body_bytes
        return True  # chunked: its size is not known before it is read

    def _count(self, attr: str) -> None:
        if self.guard is not None:
            setattr(self.guard.stats, attr, getattr(self.guard.stats, attr) + 1)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        conn = conn_of(scope)
        peer = str((scope.get("client") or ("?",))[0])
        heavy = self._heavy(scope)
        if heavy:
            mine = self._by_peer.get(peer, 0)
            if self.active >= self.places or mine >= self.per_peer:
                self._count("heavy_refused")
                which = (f"{self.active} large /tokenize or /detokenize replies in progress (limit {self.places})"
                         if self.active >= self.places else
                         f"{mine} large /tokenize or /detokenize replies in progress for {peer} "
                         f"(limit {self.per_peer} an address)")
                await _answer(send, 503, "unavailable_error", f"server busy: {which}")
                return
            self.active += 1
            self._by_peer[peer] = mine + 1
        cut = False

        async def one(message: dict[str, Any]) -> None:
            nonlocal cut
            if cut:
                return  # the connection is gone: the rest of the reply is dropped
            if conn is not None and not conn.flow.write_paused:
                await send(message)  # uvicorn's send waits only while writing is paused: no deadline to keep
                return
            with anyio.move_on_after(self.send_timeout_s) as deadline:
                await send(message)
            if deadline.cancelled_caught:
                cut = True
                self._count("send_deadline")
                if conn is not None:
                    conn.cut(f"reply not taken within {self.send_timeout_s:g} s")

        async def pieces(message: dict[str, Any]) -> None:
            body = message.get("body", b"")
            if message["type"] != "http.response.body" or len(body) <= PIECE_BYTES:
                await one(message)
                return
            more = message.get("more_body", False)
            for i in range(0, len(body), PIECE_BYTES):
                last = i + PIECE_BYTES >= len(body)
                await one({"type": "http.response.body", "body": body[i:i + PIECE_BYTES],
                           "more_body": more if last else True})

        try:
            await self.app(scope, receive, pieces)
        finally:
            if heavy:
                self.active -= 1
                left = self._by_peer.get(peer, 1) - 1
                if left > 0:
                    self._by_peer[peer] = left
                else:
                    self._by_peer.pop(peer, None)


async def _answer(send: Any, status: int, type_: str, message: str) -> None:
    """A whole JSON error reply (llama-server's body) with ``Connection: close``, through ASGI ``send``."""
    body = json.dumps(HTTPError(status, type_, message).body(), separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json; charset=utf-8"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
