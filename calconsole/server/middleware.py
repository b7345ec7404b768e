"""``Front``, the face's request path below the conns module's bounds, as one ASGI app: the access log, CORS
(Starlette's, for requests that carry ``Origin``), the body limit and the key check, then the route. Routes
see only requests that passed; every refusal is llama-server's error body. Header names are spelled as
llama-server's, and ``Date`` added, on the wire (``heads``).

In the order a request meets it:

- the access log: one line per request when it ends (remote, method, path, status, wall ms, key label;
  never a key; control characters in a path escaped so a log line cannot be forged), and the face's counts;
- CORS: Starlette's ``CORSMiddleware`` for a request with ``Origin``; without one, its ``Vary: Origin``;
- the body limit: a ``Content-Length`` over ``max_bytes`` (or not a number) is 400 before the route runs;
  a chunked body is counted as it is received and ``BodyTooLarge`` raised past the limit (``read_json``
  turns it into the same 400);
- the key check: the API or admin key a route's family asks for (``auth_of(path)``: "none", "api",
  "admin", or None for a path no route has: left to the router's 404); 401 otherwise, and a wrong
  admin key is audited (off the event loop, summarised per peer: ``ServingFace.audit_refusal``);
- the route: one without path parameters straight from a dict by its path; the rest through Starlette's
  router. One ASGI layer instead of four Starlette middlewares and the router's scan: a ``GET /health``
  cost ~120 µs of the event loop's CPU in them (``calconsole bench http``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp as StarletteApp
from starlette.types import Send

from .context import BodyTooLarge
from .wire import HTTPError, bad_request

if TYPE_CHECKING:
    from .context import ServingFace

log = logging.getLogger("calconsole.serve")
Scope = dict[str, Any]
ASGIApp = Callable[..., Any]


async def _refuse(send: Any, err: HTTPError) -> None:
    await JSONResponse(err.body(), status_code=err.status)({"type": "http"}, _no_receive, send)


async def _no_receive() -> dict[str, Any]:
    return {"type": "http.disconnect"}


#: a response start's headers with CORS's ``Vary: Origin`` (what Starlette's ``CORSMiddleware`` writes on a
#: response to a request without ``Origin``: any ``Vary`` of the route's is kept in front of it)
def _with_vary(headers: Any) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in headers if k.lower() != b"vary"]
    vary = [v for k, v in headers if k.lower() == b"vary"]
    out.append((b"vary", b", ".join([*vary, b"Origin"])))
    return out


class Front:
    """The face's request path below the conns module's bounds, as one ASGI app (see the module docstring):
    access log and counts, CORS, body limit, key check, then the route.

    ``fast``: path -> (methods, endpoint) of the routes without path parameters; a request for one of them
    with one of its methods is handed to its endpoint directly. Everything else (routes with parameters,
    HEAD, another method, an unknown path: llama-server's 404, and the lifespan) goes to ``app``, the
    Starlette app that holds every route. Requests that carry ``Origin`` (browsers) go through Starlette's
    ``CORSMiddleware`` (``cors``, built from ``cors_kw``); the others get its ``Vary: Origin`` here.
    """

    def __init__(self, app: ASGIApp, face: ServingFace, *, auth_of: Callable[[str], str | None],
                 fast: dict[str, tuple[frozenset[str], Callable[[Request], Any]]], cors_kw: dict[str, Any]) -> None:
        from starlette.middleware.cors import CORSMiddleware

        self.app = app
        self.face = face
        self.auth_of = auth_of
        self.fast = fast
        self.max_bytes = face.config.max_body_bytes
        self.cors = CORSMiddleware(cast(StarletteApp, self._checked), **cors_kw)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0
        origin = False
        for k, _ in scope["headers"]:
            if k == b"origin":
                origin = True
                break

        async def logged(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                if not origin:
                    message = {**message, "headers": _with_vary(message.get("headers", ()))}
            await send(message)

        try:
            if origin:
                await self.cors(scope, receive, cast(Send, logged))
            else:
                await self._checked(scope, receive, logged)
        except Exception:
            if status == 0:  # a bug of ours before any answer: llama-server's 500 body, then uvicorn's report
                err = HTTPError(500, "server_error", "internal error")
                await _refuse(logged, err)
            raise
        finally:
            self._log(scope, status, t0)

    def _log(self, scope: Scope, code: int, t0: float) -> None:
        stats = self.face.stats
        stats.requests += 1
        stats.by_status[code] = stats.by_status.get(code, 0) + 1
        if not log.isEnabledFor(logging.INFO):
            return
        client = scope.get("client")
        label = scope.get("state", {}).get("key_label", "-")
        path = scope["path"]
        if not path.isprintable():  # %0A, ESC... in a path must not forge or split a log line
            path = path.encode("unicode_escape").decode("ascii")
        where = f"{client[0]}:{client[1]}" if client else "?"
        msg = f'{where} "{scope["method"]} {path}" {code} {(time.perf_counter() - t0) * 1e3:.1f}ms key={label}'
        # the record made here, not by log.info: that one looks up its caller's frame for every line
        log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, msg, (), None))

    async def _checked(self, scope: Scope, receive: Any, send: Any) -> None:
        limit, chunked = self.max_bytes, False
        for k, v in scope["headers"]:
            if k == b"content-length":
                if not v.isdigit() or int(v) > limit:
                    cl = v.decode("latin-1")
                    await _refuse(send, bad_request(f"request body is {cl} bytes; the limit is {limit} bytes"))
                    return
            elif k == b"transfer-encoding":
                chunked = True
        if chunked:  # counted as it comes; a Content-Length is held to by the HTTP parser itself
            receive = _counted(receive, limit)
        method = scope["method"]
        kind = self.auth_of(scope["path"]) if method != "OPTIONS" else None
        if kind == "api" or kind == "admin":
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
        route = self.fast.get(scope["path"])
        if route is not None and method in route[0]:
            response = await route[1](Request(scope, receive))
            await response(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def _counted(receive: Any, limit: int) -> Any:
    """``receive`` that raises ``BodyTooLarge`` once more than ``limit`` body bytes came (``read_json``
    answers it with the body limit's 400)."""
    seen = 0

    async def counted() -> dict[str, Any]:
        nonlocal seen
        msg: dict[str, Any] = await receive()
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
        return msg

    return counted

__all__ = ["BodyTooLarge", "Front"]
