"""The serving face: llama-server's and OpenAI's HTTP routes over the three planes, assembled into one app.

The face in layers (as llama.cpp's server: http / task results that own their JSON / queue / slots; its
``server-http`` over ``server-context``):

- ``middleware``: access log, CORS, body limit, key check (``Front``, one ASGI layer), header casing;
- one routes module per family, each listing (path, handler, methods, key): ``routes_monitor``
  (/health /props /slots /metrics /v1/models), ``routes_text`` (/tokenize /detokenize /apply-template
  /chat/completions/input_tokens /infill; embeddings, rerank answered 501 as llama-server does without
  such a model), ``routes_generate`` (/completion /v1/completions /v1/chat/completions),
  ``routes_snapshot`` (/snapshot /snapshot/stream), ``maintenance_routes`` (/maintenance/..., only
  when an admin key is configured);
- ``context``: the state they share (``ServingFace``: the planes, the bounds, generation places, the push
  bridge from the engine's threads to the event loop, SSE responses; ``ServeConfig``); the routes and the
  middleware import it, never this module;
- ``wire``: request parsing and response shapes (public helpers), ``logprobs`` those of token
  probabilities, ``calconsole.codec`` the ``calconsole`` extension (and the probabilities' entries)
  both the face and the remote plane read;
- this module: the app assembly (``build_app``: the route table, llama-server's error bodies, the
  middleware stack). ``ServeConfig``, ``ServingFace`` and the context's other names are importable from
  here as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from sim_backend.planes import CalError

from . import wire
from .context import (
    HEAVY_BODY_BYTES,
    SHUTDOWN_GRACE_S,
    UNBOUNDED_GRACE_S,
    FaceStats,
    Handler,
    RouteSpec,
    ServeConfig,
    ServingFace,
    device_of,
    remote_of,
)
from .middleware import Front
from .wire import HTTPError

log = logging.getLogger("calconsole.serve")


def _wrap(face: ServingFace, handler: Handler) -> Handler:
    """The route's errors as llama-server's error bodies (typed refusals keep their status and type; a bug
    of ours is a 500 naming the exception, never a traceback page); audited refusals are written."""
    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except HTTPError as e:
            if e.audit_action is not None and not e.audited:
                reason = "authentication failed: missing or wrong admin key" if e.unauthenticated else e.message
                await face.audit_refusal(request, e.audit_action, reason, unauthenticated=e.unauthenticated,
                                         key_label="(none)" if e.unauthenticated
                                         else getattr(request.state, "key_label", "?"))
            return JSONResponse(e.body(), status_code=e.status)
        except CalError as e:
            err = wire.from_cal_error(e)
            return JSONResponse(err.body(), status_code=err.status)
        except Exception as e:  # noqa: BLE001 - a bug of ours is a 500 with a message, never a traceback page
            log.exception("internal error on %s %s", request.method, request.url.path)
            err = HTTPError(500, "server_error", f"internal error: {type(e).__name__}")
            return JSONResponse(err.body(), status_code=500)

    return endpoint


def build_app(face: ServingFace) -> Front:
    """The face as one ASGI app: ``middleware.Front`` (access log, CORS, body limit, key check; the routes
    without path parameters looked up by path) over the Starlette app (``Front.app``: every route, llama-server
    error bodies for 404, the lifespan)."""
    from . import routes_generate, routes_monitor, routes_slots, routes_snapshot, routes_text

    specs: list[RouteSpec] = []
    for family in (routes_monitor, routes_slots, routes_text, routes_generate, routes_snapshot):
        specs += family.routes(face)
    if face.maintenance is not None:
        from .maintenance_routes import maintenance_routes

        specs += [(p, h, m, "admin") for p, h, m in maintenance_routes(face)]
    endpoints = [(p, _wrap(face, h), m) for p, h, m, _ in specs]
    table = [Route(p, e, methods=m) for p, e, m in endpoints]

    async def not_found(request: Request, exc: Exception) -> Response:
        # llama-server routes by method and path together: a known path with another method is a 404 too
        return JSONResponse(HTTPError(404, "not_found_error", "File Not Found").body(), status_code=404)

    app = Starlette(routes=table, exception_handlers={StarletteHTTPException: not_found})
    # Starlette answers '/props/' with a redirect to an absolute URL built from the Host header, before any
    # key check (an open redirect); llama-server has no such routes: a trailing slash is a 404 here
    app.router.redirect_slashes = False
    origins = face.config.cors_origins
    # llama-server's CORS: the origin echoed, credentials allowed, its four methods, any header
    cors = {"allow_origins": list(origins or ()), "allow_origin_regex": None if origins else LOCAL_ORIGINS,
            "allow_credentials": True, "allow_methods": ["GET", "POST", "DELETE", "OPTIONS"],
            "allow_headers": ["*"]}
    # HEAD (Starlette adds it to GET routes) and the other methods stay with the router
    fast = {p: (frozenset(m), e) for p, e, m in endpoints if "{" not in p}
    return Front(app, face, auth_of=auth_of(specs), fast=fast, cors_kw=cors)


def auth_of(specs: list[RouteSpec]) -> Callable[[str], str | None]:
    """path -> the key its route needs ("none" | "api" | "admin"), or None for a path no route has. Routes
    with parameters (``/slots/{id_slot}``) match by their pattern: an exact-path table alone let
    ``/slots/0`` pass without any key."""
    from starlette.routing import compile_path

    exact = {p: a for p, _, _, a in specs if "{" not in p}
    patterns = [(compile_path(p)[0], a) for p, _, _, a in specs if "{" in p]

    def lookup(path: str) -> str | None:
        kind = exact.get(path)
        if kind is None:
            kind = next((a for rx, a in patterns if rx.match(path)), None)
        return kind

    return lookup


#: the browser origins allowed without ``--cors-origins``: pages served from this machine
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


__all__ = [
    "HEAVY_BODY_BYTES",
    "LOCAL_ORIGINS",
    "SHUTDOWN_GRACE_S",
    "UNBOUNDED_GRACE_S",
    "FaceStats",
    "Handler",
    "RouteSpec",
    "ServeConfig",
    "ServingFace",
    "auth_of",
    "build_app",
    "device_of",
    "remote_of",
]
