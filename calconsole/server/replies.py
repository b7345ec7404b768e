"""Large replies produced in pieces, and the bound on their size.

A reply whose size grows with its request (``/tokenize`` and ``/detokenize`` with pieces: ~24 bytes of
JSON a token, a 1 MB body of 500,000 ids answered 12 MB) was built as one ``bytes`` from a list of one
dict per token (~200 bytes of Python objects each: ~100 MB for that body, before the 12 MB of text) and
handed to the connection whole. Here the JSON text is written straight into pieces of ``PIECE_BYTES``
(no list of dicts), the reply is at most ``reply_limit`` bytes (``REPLY_PER_BODY`` times the body
limit: 400 beyond, said before more is built), and ``PiecedResponse`` hands the pieces to the
connection one by one, dropping each once it is written.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from typing import Any

from starlette.responses import Response

from .wire import HTTPError

#: a reply body is handed to the connection in pieces of at most this many bytes (the transport's own
#: high-water mark is 64 KiB too: asyncio's default, which uvicorn keeps)
PIECE_BYTES = 64 * 1024
#: a reply may be at most this many times the request body limit (``ServeConfig.max_body_bytes``): the
#: largest one here, /detokenize with pieces, is ~12 bytes of reply per byte of body (500,000 ids, 1 MB
#: in, 12 MB out, measured on this release); 16 leaves room for pieces given as byte lists
REPLY_PER_BODY = 16
#: items dumped by one ``json.dumps`` call while a list is written (bounds the objects alive at once)
_BATCH = 2048


def reply_limit(max_body_bytes: int) -> int:
    """The most bytes one reply may have, for a body limit of ``max_body_bytes`` bytes."""
    return REPLY_PER_BODY * max_body_bytes


class ReplyTooLarge(HTTPError):
    """A reply would be over ``reply_limit`` bytes (400 ``invalid_request_error``)."""

    def __init__(self, limit: int) -> None:
        super().__init__(400, "invalid_request_error",
                         f"the reply would be over {limit} bytes ({REPLY_PER_BODY} x the request body limit); "
                         "ask for fewer tokens at once, or without pieces")


def _dumps(obj: Any) -> str:
    # as Starlette's JSONResponse renders (UTF-8, compact, no NaN)
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class _Writer:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pieces: list[bytes] = []
        self._buf: list[bytes] = []
        self._n = 0
        self.total = 0

    def write(self, text: str) -> None:
        b = text.encode("utf-8")
        self.total += len(b)
        if self.total > self.limit:
            raise ReplyTooLarge(self.limit)
        self._buf.append(b)
        self._n += len(b)
        if self._n >= PIECE_BYTES:
            self._flush()

    def _flush(self) -> None:
        data = b"".join(self._buf)
        self._buf, self._n = [], 0
        for i in range(0, len(data), PIECE_BYTES):
            self.pieces.append(data[i:i + PIECE_BYTES])

    def done(self) -> list[bytes]:
        self._flush()
        return self.pieces


def json_pieces(head: dict[str, Any], key: str | None, items: Iterable[Any], limit: int) -> list[bytes]:
    """``{**head, key: [*items]}`` as compact UTF-8 JSON in pieces of at most ``PIECE_BYTES`` bytes
    (``key`` None: ``head`` alone). ``items`` is read once, ``_BATCH`` at a time, and never held as a
    list. Raises ``ReplyTooLarge`` as soon as the text passes ``limit`` bytes, ValueError for what JSON
    cannot hold (NaN)."""
    w = _Writer(limit)
    if key is None:
        w.write(_dumps(head))
        return w.done()
    w.write(_dumps({**head, key: []})[:-2])  # '{...,"key":[' : the list is written after it
    batch: list[Any] = []
    first = True
    for item in items:
        batch.append(item)
        if len(batch) >= _BATCH:
            w.write(("" if first else ",") + _dumps(batch)[1:-1])
            batch, first = [], False
    if batch:
        w.write(("" if first else ",") + _dumps(batch)[1:-1])
    w.write("]}")
    return w.done()


class PiecedResponse(Response):
    """A reply whose body is given as pieces: ``Content-Length`` is their sum; each piece is one ASGI body
    message, dropped once the connection took it (a slow reader holds the rest, not a second copy)."""

    media_type = "application/json"

    def __init__(self, pieces: list[bytes], status_code: int = 200) -> None:
        self._pieces = deque(pieces)
        super().__init__(None, status_code=status_code,
                         headers={"content-length": str(sum(len(p) for p in pieces))})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        if not self._pieces:
            await send({"type": "http.response.body", "body": b""})
        while self._pieces:
            piece = self._pieces.popleft()
            await send({"type": "http.response.body", "body": piece, "more_body": bool(self._pieces)})
