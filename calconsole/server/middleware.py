"""ASGI middleware of the face, outermost first: the header casing (around everything, the request bound of
the conns module included), the access log, CORS (Starlette's), the body limit and the key check. Routes see
only requests that passed; every refusal is llama-server's error body.

- ``HeaderCase``: response header names as llama-server writes them (``Content-Type``,
  ``Access-Control-Allow-Origin``, ``Process-Start-Time-Unix``) and the ``Date`` header (uvicorn's own is
  off: it writes ``date``). Starlette lower-cases every name; HTTP says case does not matter, but clients
  that keep headers in a plain dict (llama.cpp's test harness) look them up by llama-server's spelling. h11
  writes the names it is given as given and title-cases the ones it adds (``Connection``,
  ``Transfer-Encoding``).

- ``AccessLog``: one line per request when it ends (remote, method, path, status, wall ms, key label;
  never a key; control characters in a path escaped so a log line cannot be forged).
- ``BodyLimit``: a ``Content-Length`` over ``max_bytes`` (or not a number) is 400 before the app runs; a
  chunked body is counted as it is received and ``BodyTooLarge`` raised past the limit (``read_json``
  turns it into the same 400).
- ``KeyCheck``: the API or admin key a route's family asks for (``auth_of(path)``: "none", "api",
  "admin", or None for a path no route has: left to the router's 404); 401 otherwise, and a wrong
  admin key is audited (off the event loop, summarised per peer: ``ServingFace.audit_refusal``).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from .context import BodyTooLarge
from .wire import HTTPError, bad_request

if TYPE_CHECKING:
    from .context import ServingFace

log = logging.getLogger("calconsole.serve")
Scope = dict[str, Any]
ASGIApp = Callable[..., Any]


class AccessLog:
    """One log line per request, when it ends."""

    def __init__(self, app: ASGIApp, face: ServingFace) -> None:
        self.app = app
        self.face = face

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = {"code": 0}

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            code = status["code"]
            self.face.stats.requests += 1
            self.face.stats.by_status[code] = self.face.stats.by_status.get(code, 0) + 1
            client = scope.get("client")
            label = scope.get("state", {}).get("key_label", "-")
            path = scope["path"]
            if not path.isprintable():  # %0A, ESC... in a path must not forge or split a log line
                path = path.encode("unicode_escape").decode("ascii")
            log.info('%s "%s %s" %d %.1fms key=%s', f"{client[0]}:{client[1]}" if client else "?",
                     scope["method"], path, code, (time.perf_counter() - t0) * 1e3, label)


#: names whose usual spelling is not plain Title-Case (RFC 9110's own spellings)
_SPELLED = {b"www-authenticate": b"WWW-Authenticate", b"etag": b"ETag", b"te": b"TE"}


@functools.lru_cache(maxsize=512)
def header_case(name: bytes) -> bytes:
    """``b"process-start-time-unix"`` -> ``b"Process-Start-Time-Unix"``: each dash-separated word capitalised,
    as llama-server (cpp-httplib) writes its names; a few names keep their RFC spelling (``WWW-Authenticate``).
    Cached: the server writes a small, fixed set of names."""
    low = name.lower()
    return _SPELLED.get(low) or b"-".join(w[:1].upper() + w[1:] for w in low.split(b"-"))


class HeaderCase:
    """Response header names in llama-server's casing, and ``Date`` (RFC 9110 §6.6.1: an origin server with a
    clock sends it), formatted once per second."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._date_s = -1
        self._date = b""

    def _date_now(self) -> bytes:
        now = int(time.time())
        if now != self._date_s:
            self._date_s, self._date = now, formatdate(now, usegmt=True).encode("ascii")
        return self._date

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def cased(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [(header_case(k), v) for k, v in message.get("headers", ())]
                headers.append((b"Date", self._date_now()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, cased)


async def _refuse(send: Any, err: HTTPError) -> None:
    await JSONResponse(err.body(), status_code=err.status)({"type": "http"}, _no_receive, send)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


class BodyLimit:
    """Request bodies of at most ``max_bytes`` bytes."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                cl = v.decode("latin-1")
                if not cl.isdigit() or int(cl) > limit:
                    await _refuse(send, bad_request(f"request body is {cl} bytes; the limit is {limit} bytes"))
                    return
        seen = 0

        async def counted() -> dict[str, Any]:
            nonlocal seen
            msg: dict[str, Any] = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
            return msg

        await self.app(scope, counted, send)


class KeyCheck:
    """The key each route family asks for, checked before the route runs."""

    def __init__(self, app: ASGIApp, face: ServingFace, auth_of: Callable[[str], str | None]) -> None:
        self.app = app
        self.face = face
        self.auth_of = auth_of

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        kind = self.auth_of(scope["path"]) if scope["type"] == "http" and scope["method"] != "OPTIONS" else None
        if kind in ("api", "admin"):
            request = Request(scope, receive)
            try:
                label = self.face.authorize(request, kind)
            except HTTPError as e:
                if e.audit_action is not None:
                    await self.face.audit_refusal(request, e.audit_action,
                                                  "authentication failed: missing or wrong admin key",
                                                  unauthenticated=True, key_label="(none)")
                await _refuse(send, e)
                return
            scope.setdefault("state", {})["key_label"] = label
        await self.app(scope, receive, send)


__all__ = ["AccessLog", "BodyLimit", "BodyTooLarge", "HeaderCase", "KeyCheck", "header_case"]
