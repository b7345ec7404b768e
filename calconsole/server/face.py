"""The serving face: llama-server's and OpenAI's HTTP routes over the three planes.

Starlette (routing, requests, responses) + sse-starlette (Server-Sent Events with send timeouts,
client-disconnect detection and shutdown hooks) on uvicorn: the smallest well-kept ASGI stack
that does SSE properly; FastAPI would add pydantic models we do not need (the shapes are
llama-server's, checked in ``wire``), aiohttp has no SSE of its own.

The face is a client of the plane contracts only (``sim_backend.planes``): it cannot tell an
in-process device from any other implementation. Plane calls block, so each runs in a worker
thread (``anyio.to_thread``), bounded by a capacity limiter.

Routes (llama-server / OpenAI shapes; see ``wire``):
    GET  /health /props /slots /metrics /v1/models /snapshot /snapshot/stream
    POST /tokenize /detokenize /apply-template /completion(s) /v1/completions /v1/chat/completions
    /maintenance/... only when an admin key is configured (``maintenance_routes``).

Bounds (``ServeConfig``): body bytes and read time, concurrent generation requests (503 beyond;
the engine's own queue limit also answers 503), per-request deadline, per-send timeout for
slow readers, snapshot-stream rate and count. Every route but /health needs the API key when
one is configured; keys are compared in constant time and never logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import msgspec
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from sim_backend.planes import (
    CalError,
    ChatRequest,
    DoneEvent,
    InferencePlane,
    MaintenancePlane,
    ObservationPlane,
    RequestResult,
    RequestStream,
    SamplingParams,
    TokenEvent,
)
from sim_backend.planes.snapshot import DeviceInfo, Snapshot

from .. import __version__
from ..codec import result_extension
from . import wire
from .bridge import EventBridge, Formatter
from .keys import KeyRing
from .wire import HTTPError

if TYPE_CHECKING:
    from .leases import LeaseTable

log = logging.getLogger("calconsole.serve")
T = TypeVar("T")

Handler = Callable[[Request], Awaitable[Response]]
def _dumps(obj: Any) -> str:
    """Compact JSON, as llama-server writes it (``data: {...}`` lines byte for byte)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


#: after a stop is asked, how long a stream has to end with its error event before it is cut (host s);
#: below uvicorn's graceful-shutdown timeout (run.GRACEFUL_S)
SHUTDOWN_GRACE_S = 3.0
#: how often a snapshot stream looks at shutdown while it sleeps between snapshots (host s)
POLL_S = 0.25


class _SSE(EventSourceResponse):
    """sse-starlette's response with an ``on_end`` hook run once it is over (finished, cut or cancelled)."""

    def __init__(self, *args: Any, on_end: Callable[[], None] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self._on_end is not None:
                self._on_end()


@dataclass
class ServeConfig:
    """What the face listens on and the bounds it enforces. Times are host wall seconds.

    ``n_predict``: default generation limit when a body gives none (-1: until the context is
    full, llama-server's default). ``max_streams``: generation requests in flight at once
    (streaming or not); one more is refused with 503. ``send_timeout_s``: a stream whose reader
    does not take a chunk within this time is closed and its request cancelled.
    """

    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: KeyRing | None = None
    admin_keys: KeyRing | None = None
    slots_endpoint: bool = True
    metrics_endpoint: bool = True
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0
    max_streams: int = 16
    request_timeout_s: float = 600.0
    send_timeout_s: float = 30.0
    lease_ttl_s: float = 30.0
    n_predict: int = -1
    model_alias: str = "qwen3-30b-a3b"
    snapshot_max_hz: float = 10.0
    max_snapshot_streams: int = 8
    ping_s: float = 15.0
    #: what one peer address and all peers may hold open (``conns.ConnLimits``); None: its defaults
    conn_limits: Any = None
    #: browser origins allowed to call the server (CORS); None: localhost and 127.0.0.1 / [::1] on any
    #: port; ("*",): any origin (llama-server's ``--cors-origins``)
    cors_origins: tuple[str, ...] | None = None

    def check(self) -> None:
        """ValueError (one line, naming the setting) for a value no server should run with."""
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        for name, lo, hi in (("max_body_bytes", 1024, 64 << 20), ("max_streams", 1, 1024),
                             ("max_snapshot_streams", 1, 256)):
            v = getattr(self, name)
            if not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
        for fname, flo, fhi in (("request_timeout_s", 1.0, 86400.0), ("send_timeout_s", 0.5, 3600.0),
                                ("body_timeout_s", 0.5, 600.0), ("snapshot_max_hz", 0.1, 50.0)):
            fv = getattr(self, fname)
            if not (isinstance(fv, (int, float)) and math.isfinite(fv) and flo <= fv <= fhi):
                raise ValueError(f"{fname} must be in [{flo:g}, {fhi:g}], got {fv}")
        if self.conn_limits is not None:
            self.conn_limits.check()
        if self.n_predict == 0 or self.n_predict < -1:
            raise ValueError(f"n_predict must be -1 (until the context is full) or positive, got {self.n_predict}")
        if self.api_keys is not None and self.admin_keys is not None and self.api_keys.shares_a_key_with(
                self.admin_keys):
            raise ValueError("the admin key must differ from every API key")


@dataclass
class FaceStats:
    """Counters of the face itself (host side), read by tests and the log."""

    requests: int = 0
    refused_auth: int = 0
    refused_busy: int = 0
    streams_open: int = 0
    disconnects: int = 0
    by_status: dict[int, int] = field(default_factory=dict)


def device_of(snap: Snapshot) -> DeviceInfo:
    """The snapshot's device; 503 if the plane reports none (a backend still starting)."""
    if snap.device is None:
        raise HTTPError(503, "unavailable_error", "Loading model: the device is not reporting yet")
    return snap.device


def remote_of(request: Request) -> str:
    c = request.client
    return f"{c.host}:{c.port}" if c else "?"


def _presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization")
    if auth:
        scheme, _, token = auth.partition(" ")
        return token.strip() if scheme.lower() == "bearer" else None
    return request.headers.get("x-api-key")


class ServingFace:
    """The HTTP face of one device: plane clients, bounds, the lease table and the route table.

    Args:
        inference / observation: the planes requests and reads go to.
        maintenance: the maintenance plane, or None (no maintenance routes whatever the keys).
        audit: the audit log (``sim_backend.planes.AuditLog``) for refusals decided here (wrong
            admin key, no or expired lease, wrong confirmation); the plane audits its own calls.
        config: ``ServeConfig``.
    """

    def __init__(self, inference: InferencePlane, observation: ObservationPlane,
                 maintenance: MaintenancePlane | None, config: ServeConfig, audit: Any = None) -> None:
        config.check()
        self.inference = inference
        self.observation = observation
        self.maintenance = maintenance if config.admin_keys is not None else None
        self.audit = audit
        self.config = config
        self.stats = FaceStats()
        self.closing = threading.Event()  # set on SIGINT/SIGTERM: streams end with an error event
        self._active = 0
        self._snap_streams = 0
        self._count_lock = threading.Lock()
        self._bridges: set[EventBridge] = set()  # requests in flight (begin_shutdown cancels them)
        # plane calls run in threads: one per in-flight generation + a few for reads and maintenance
        self.limiter = anyio.CapacityLimiter(config.max_streams + config.max_snapshot_streams + 8)
        self.created = int(time.time())
        self.fingerprint = wire.BUILD_INFO  # llama-server's b<build>-<commit> form
        self.leases: LeaseTable | None = None
        # set by run._config when served: the connection guard and the bound on requests in progress (conns)
        self.conn_guard: Any = None
        self.request_bound: Any = None
        from .refusals import RefusalSummary

        self.refusals = RefusalSummary()
        if self.maintenance is not None:
            from .leases import LeaseTable

            self.leases = LeaseTable(config.lease_ttl_s)

    # --- plumbing ----------------------------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        """Run a blocking plane call in a worker thread; its result."""
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kw), limiter=self.limiter)

    async def read_json(self, request: Request) -> dict[str, Any]:
        """The body as a JSON object; 400 for a missing, oversized, slow, malformed or non-object body."""
        limit = self.config.max_body_bytes
        cl = request.headers.get("content-length")
        if cl is not None and (not cl.isdigit() or int(cl) > limit):
            raise wire.bad_request(f"request body is {cl} bytes; the limit is {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        try:
            with anyio.fail_after(self.config.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise wire.bad_request(f"request body is over the limit of {limit} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise wire.bad_request(f"request body not received within {self.config.body_timeout_s:g} s") from None
        except ClientDisconnect:  # nobody reads the answer; a refusal, not an internal error
            raise wire.bad_request("client disconnected before sending the whole body") from None
        data = b"".join(chunks)
        if not data.strip():
            raise wire.bad_request("request body is empty; expected a JSON object")
        try:
            obj = json.loads(data)
            # a lone \uD800-\uDFFF escape parses to a str that cannot be encoded back (responses, logs):
            # refuse it as llama-server's parser does. Only escapes make one (raw bytes are strict UTF-8).
            if b"\\u" in data:
                json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise wire.bad_request("request body is not valid JSON: a string holds a lone UTF-16 surrogate "
                                   "(\\ud800-\\udfff escape without its pair)") from None
        except (ValueError, RecursionError) as e:
            raise wire.bad_request(f"request body is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise wire.bad_request(f"request body must be a JSON object, got {type(obj).__name__}")
        return obj

    def authorize(self, request: Request, kind: str) -> str:
        """The key label for ``kind`` ("api" or "admin"), "open" if no key is configured; 401 otherwise."""
        ring = self.config.api_keys if kind == "api" else self.config.admin_keys
        if ring is None:
            return "open"
        label = ring.match(_presented_key(request))
        if label is None:
            self.stats.refused_auth += 1
            what = "API Key" if kind == "api" else "admin key"  # llama-server's words: "Invalid API Key"
            err = HTTPError(401, "authentication_error", f"Invalid {what}")
            if kind == "admin":  # audited by the route wrapper, off the event loop, summarised per peer
                err.audit_action, err.unauthenticated = request.url.path, True
            raise err
        return label

    async def audit_refusal(self, request: Request, action: str, reason: str, *, key_label: str,
                            unauthenticated: bool = False, args: dict[str, Any] | None = None) -> None:
        """A refusal decided by the face (not the plane) as one audit record with the remote address,
        written in a worker thread (its fsync never stalls the event loop). ``unauthenticated``: the
        caller had no valid admin key: the first refusal of a window per peer address is written, the
        rest are counted into a summary record (``refusals``)."""
        if self.audit is None:
            return
        from sim_backend.planes import audit_origin

        remote = remote_of(request)
        if unauthenticated and not self.refusals.note_unauthenticated(remote.rsplit(":", 1)[0], action):
            return
        origin = {"remote": remote, "key": key_label, "via": "http"}

        def write() -> None:
            with audit_origin(origin):
                self.audit.event(action, dict(args or {}), granted=False, ok=False, result=reason, duration_ms=0.0)
            if self.refusals.pending():
                self.refusals.flush(self.audit)

        try:
            await self.call(write)
        except Exception as e:  # noqa: BLE001 - the refusal still stands; say the audit failed
            log.error("audit log write failed for a refused %s: %s", action, e)

    def _enter_generation(self, n: int = 1) -> None:
        """Take ``n`` generation places (one per request; a prompt list takes one each); 503 beyond the limit."""
        with self._count_lock:
            if self.closing.is_set():
                raise HTTPError(503, "unavailable_error", "server is shutting down")
            if self._active + n > self.config.max_streams:
                self.stats.refused_busy += 1
                raise HTTPError(503, "unavailable_error",
                                f"server busy: {self._active} requests in flight (limit {self.config.max_streams})")
            self._active += n

    def _leave_generation(self, n: int = 1) -> None:
        with self._count_lock:
            self._active -= n

    @property
    def in_flight(self) -> int:
        return self._active

    def begin_shutdown(self) -> None:
        """Stop admitting and cancel every request in flight: each stream ends with its error event at once."""
        self.closing.set()
        with self._count_lock:
            bridges = list(self._bridges)
        for b in bridges:
            b.cancel("server shutting down")

    async def submit(self, req: ChatRequest) -> RequestStream:
        """Submit (the caller has entered a generation slot); typed refusals become HTTP errors."""
        try:
            return await self.call(self.inference.submit, req)
        except CalError as e:
            raise wire.from_cal_error(e) from None

    async def _open(self, reqs: list[ChatRequest], fmt: Formatter, *, on_silent: Callable[[int], list[Any]],
                    on_error: Callable[[int, BaseException], list[Any]], first: list[Any] | None = None
                    ) -> tuple[EventBridge, Callable[[], None]]:
        """Take generation places, submit ``reqs`` and start their bridge; returns it and its ``close``
        (cancels what has not ended, gives the places back; call exactly once). Errors before the
        bridge exists (busy, refused) give the places back and cancel what was submitted."""
        self._enter_generation(len(reqs))
        handles: list[RequestStream] = []
        try:
            for r in reqs:
                handles.append(await self.submit(r))
            if self.closing.is_set():
                raise HTTPError(503, "unavailable_error", "server is shutting down")
            # every item a request can give: a piece per token, its end (final + usage + [DONE]), margin
            buffer = sum(3 * ((r.max_tokens or self.inference.n_ctx) + 2) for r in reqs)
            bridge = EventBridge(handles, fmt, silent_s=self.inference.step_timeout_s + 30, on_silent=on_silent,
                                 on_error=on_error, buffer=buffer, first=first or ())
        except BaseException:
            for h in handles:
                h.cancel("request refused")
            self._leave_generation(len(reqs))
            raise
        with self._count_lock:
            self._bridges.add(bridge)
        timer = asyncio.get_running_loop().call_later(
            self.config.request_timeout_s, bridge.cancel,
            f"request exceeded the server's deadline of {self.config.request_timeout_s:g} s")
        closed = False

        def close() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            timer.cancel()
            with self._count_lock:
                self._bridges.discard(bridge)
            if not bridge.done:
                self.stats.disconnects += 1
                bridge.cancel("client disconnected")
            self._leave_generation(len(reqs))

        bridge.start()
        return bridge, close

    async def generate(self, req: ChatRequest, request: Request) -> RequestResult:
        """Submit and wait for the result (non-streaming), cancelling if the client disconnects."""
        return (await self.generate_all([req], request))[0]

    async def generate_all(self, reqs: list[ChatRequest], request: Request) -> list[RequestResult]:
        """Several requests at once (a prompt list), each in its own generation place; their results in
        order. The first that did not finish is the error; a client that goes away cancels them all."""

        def fmt(i: int, ev: TokenEvent | DoneEvent) -> list[Any]:
            return [(i, ev.result)] if isinstance(ev, DoneEvent) else []

        def silent(i: int) -> list[Any]:
            return [(i, HTTPError(500, "server_error", "engine did not answer within its step timeout"))]

        def failed(i: int, e: BaseException) -> list[Any]:
            return [(i, HTTPError(500, "server_error", f"internal error: {type(e).__name__}"))]

        bridge, close = await self._open(reqs, fmt, on_silent=silent, on_error=failed)
        results: dict[int, Any] = {}
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch_disconnect, request, bridge)
                async for i, r in bridge.receive:
                    results[i] = r
                tg.cancel_scope.cancel()
        finally:
            close()
        out: list[RequestResult] = []
        for i in range(len(reqs)):
            r = results.get(i)
            if isinstance(r, HTTPError):
                raise r
            if r is None:
                raise HTTPError(500, "server_error", "request ended without a result")
            if r.status != "finished":
                raise wire.result_error(r)
            out.append(r)
        return out

    async def _watch_disconnect(self, request: Request, bridge: EventBridge) -> None:
        """Wait (without polling) for the client to go away; then cancel the bridge's requests."""
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                if not bridge.done:
                    bridge.cancel("client disconnected")
                return

    async def _stream(self, reqs: list[ChatRequest], first: list[dict[str, Any]],
                      piece: Callable[[int, TokenEvent], list[dict[str, Any]]],
                      last: Callable[[int, RequestResult], list[dict[str, Any]]], send_done: bool) -> Response:
        """Submit, then stream ``data:`` events: ``first``, ``piece(i, ev)`` per visible piece, ``last(i,
        result)`` per request, then ``[DONE]`` if ``send_done`` (OpenAI routes: one request).

        Errors before the first byte are ordinary HTTP errors; after it, one ``data: {"error": ...}``
        event (llama-server's streaming error) ends that request's part of the stream.
        """

        def data(chunks: list[dict[str, Any]]) -> list[dict[str, str]]:
            return [{"data": _dumps(c)} for c in chunks]

        def fmt(i: int, ev: TokenEvent | DoneEvent) -> list[Any]:
            if isinstance(ev, TokenEvent):
                return data(piece(i, ev))
            res = ev.result
            if res.status != "finished":
                return data([{**wire.result_error(res).body(), "timings": wire.timings(res),
                              "calconsole": result_extension(res)}])
            return data(last(i, res)) + ([{"data": "[DONE]"}] if send_done else [])

        def silent(i: int) -> list[Any]:
            return data([HTTPError(500, "server_error", "engine did not answer within its step timeout").body()])

        def failed(i: int, e: BaseException) -> list[Any]:
            log.error("formatting a stream chunk failed: %r", e)
            return data([HTTPError(500, "server_error", f"internal error: {type(e).__name__}").body()])

        bridge, close = await self._open(reqs, fmt, on_silent=silent, on_error=failed, first=data(first))
        face = self
        face.stats.streams_open += 1

        async def on_client_close(_message: Any) -> None:
            if not bridge.done:
                bridge.cancel("client disconnected")

        def closed() -> None:
            face.stats.streams_open -= 1
            close()

        h = bridge.streams[0]
        headers = {"X-Request-Id": str(h.id), "X-Prompt-Tokens": str(h.prompt_n)}
        return self.sse(bridge.receive, headers=headers, on_client_close=on_client_close, on_end=closed)

    def sse(self, items: AsyncIterable[dict[str, Any]], headers: dict[str, str] | None = None,
            on_client_close: Callable[[Any], Awaitable[None]] | None = None,
            on_end: Callable[[], None] | None = None) -> EventSourceResponse:
        """An SSE response of ``data: <json>`` events (llama-server framing: ``\\n`` line ends); ``on_end``
        runs once the response is over, however it ended."""
        # the grace period lets a stop (begin_shutdown cancels every request) send each stream's error event
        return _SSE(items, sep="\n", send_timeout=self.config.send_timeout_s, ping=self.config.ping_s,
                    headers={"Cache-Control": "no-cache", **(headers or {})},
                    client_close_handler_callable=on_client_close, shutdown_event=anyio.Event(),
                    shutdown_grace_period=SHUTDOWN_GRACE_S, on_end=on_end)

    # --- request-level routes -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        snap = await self.call(self.observation.snapshot)
        dev = device_of(snap)
        if dev.status == "memory cleared":
            raise HTTPError(503, "unavailable_error", "Loading model: device memory is cleared")
        if dev.mode != "serving":
            raise HTTPError(503, "unavailable_error", f"device in maintenance ({dev.mode}, lease: {dev.lease_holder})")
        return JSONResponse({"status": "ok"})

    def _default_params(self) -> dict[str, Any]:
        n = self.config.n_predict
        return wire.sampling_settings(SamplingParams(), n_predict=n)

    async def props(self, request: Request) -> Response:
        snap = await self.call(self.observation.snapshot)
        dev = device_of(snap)
        n_ctx = self.inference.n_ctx
        return JSONResponse({
            "default_generation_settings": {"params": self._default_params(), "n_ctx": n_ctx},
            "total_slots": dev.n_slots,
            "model_alias": self.config.model_alias,
            "model_ftype": "BF16",  # the calbin's weights and KV are BF16 (facts.md F1)
            "model_path": f"{dev.bundle} (simulated calbin bundle)",
            "modalities": {"vision": False, "video": False, "audio": False},
            "media_marker": "<__media__>",
            "endpoint_slots": self.config.slots_endpoint, "endpoint_props": False,
            "endpoint_metrics": self.config.metrics_endpoint,
            "ui": False, "ui_settings": {},
            "chat_template": self.inference.chat_template,
            "chat_template_caps": {"supports_object_arguments": False, "supports_parallel_tool_calls": False,
                                   "supports_preserve_reasoning": False, "supports_reasoning_effort": False,
                                   "supports_string_content": True, "supports_system_role": True,
                                   "supports_tool_calls": False, "supports_tools": False,
                                   "supports_typed_content": False},
            "bos_token": "", "eos_token": "<|im_end|>",
            "build_info": wire.BUILD_INFO,
            "is_sleeping": False, "cors_proxy_enabled": False,
            "device": {"name": dev.name, "status": dev.status, "mode": dev.mode, "calrt_version": dev.calrt_version,
                       "firmware_commit": dev.firmware_commit, "chiplets": msgspec.to_builtins(dev.chiplets),
                       "context_tokens": dev.context_tokens, "numerics": dev.numerics, "pacing": dev.pacing,
                       "pacing_speed": dev.pacing_speed, "step_timeout_s": self.inference.step_timeout_s,
                       "maintenance_routes": self.maintenance is not None,
                       "findings": msgspec.to_builtins(snap.findings),
                       # which host work the timings book (--host-time): a client comparing runs
                       # (bench matrix records this key) cannot tell modeled from measured otherwise
                       "clock": "timings are "
                                + (snap.requests.get("clock") or "simulated device ms + booked host work"),
                       "calconsole_version": __version__},
        })

    async def slots(self, request: Request) -> Response:
        """llama-server's ``/slots``: an idle slot is its id, n_ctx, speculative and is_processing; a busy one
        adds the task, prompt counts, its sampling params and ``next_token`` (an array of one object)."""
        if not self.config.slots_endpoint:
            raise HTTPError(501, "not_supported_error", "This server does not support slots endpoint.")
        snap = await self.call(self.observation.snapshot)
        n_ctx = self.inference.n_ctx
        out: list[dict[str, Any]] = []
        for s in snap.slots:
            busy = s.state != "idle"
            slot: dict[str, Any] = {"id": s.index, "n_ctx": n_ctx, "speculative": False, "is_processing": busy}
            if busy:
                known = {k: v for k, v in s.params.items() if k in wire.SAMPLING_FIELDS}
                n_predict = -1 if s.max_tokens == n_ctx else s.max_tokens
                slot.update({
                    "id_task": s.request_id if s.request_id is not None else -1,
                    "n_prompt_tokens": s.prompt_n, "n_prompt_tokens_processed": s.n_prefilled,
                    "n_prompt_tokens_cache": s.cached_tokens,
                    "params": wire.sampling_settings(SamplingParams(**known), n_predict=n_predict),
                    "next_token": [{"has_next_token": True, "has_new_line": False,
                                    "n_remain": max(0, s.max_tokens - (s.predicted_n or 0)),
                                    "n_decoded": s.predicted_n or 0}]})
            out.append(slot)
        if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(o["is_processing"] for o in out):
            raise HTTPError(503, "unavailable_error", "no slot available")
        return JSONResponse(out)

    async def metrics(self, request: Request) -> Response:
        if not self.config.metrics_endpoint:
            raise HTTPError(501, "not_supported_error", "This server does not support metrics endpoint.")
        text = await self.call(self.observation.metrics_text)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8",
                                 headers={"Process-Start-Time-Unix": str(self.created)})

    async def models(self, request: Request) -> Response:
        n_ctx = self.inference.n_ctx
        alias = self.config.model_alias
        return JSONResponse({
            # the Ollama-style list llama-server also sends
            "models": [{"name": alias, "model": alias, "modified_at": "", "size": "", "digest": "", "type": "model",
                        "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                        "details": {"parent_model": "", "format": "calbin", "family": "", "families": [""],
                                    "parameter_size": "", "quantization_level": ""}}],
            "object": "list",
            "data": [{"id": alias, "aliases": [alias], "tags": [], "object": "model",
                      "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                      "created": self.created, "owned_by": "calconsole",
                      "meta": {"n_vocab": 151936, "n_ctx": n_ctx, "n_ctx_train": n_ctx}}]})

    async def tokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise wire.bad_request("'content' must be a string")
        parse_special = wire.flag(body, "parse_special", True)
        wire.flag(body, "add_special", False)  # Qwen3 adds no BOS: accepted, nothing to add
        with_pieces = wire.flag(body, "with_pieces", False)
        ids = await self.call(self.inference.tokenize, content, parse_special=parse_special)
        if not with_pieces:
            return JSONResponse({"tokens": ids})
        pieces = []
        for t in ids:
            b = self.inference.token_bytes(t)
            try:
                piece: Any = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)  # llama-server: a piece that is not valid UTF-8 is given as its bytes
            pieces.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": pieces})

    async def detokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        tokens = body.get("tokens", [])
        if not isinstance(tokens, list):
            raise wire.bad_request("'tokens' must be a list of token ids")
        try:
            text = await self.call(self.inference.detokenize, tokens)
        except CalError as e:
            raise wire.bad_request(str(e)) from None
        if not wire.flag(body, "with_pieces", False):
            return JSONResponse({"content": text})
        # our addition: each token's raw piece (str, or its bytes when not valid UTF-8, as /tokenize gives them)
        pieces = []
        for t in tokens:
            b = self.inference.token_bytes(t)
            try:
                piece: Any = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)
            pieces.append({"id": t, "piece": piece})
        return JSONResponse({"content": text, "pieces": pieces})

    async def apply_template(self, request: Request) -> Response:
        body = await self.read_json(request)
        msgs = wire.messages_from(body)
        try:
            think = wire.thinking(body)
            prompt = await self.call(self.inference.apply_template, msgs, enable_thinking=think)
        except CalError as e:
            raise wire.bad_request(str(e)) from None
        return JSONResponse({"prompt": prompt})

    async def input_tokens(self, request: Request) -> Response:
        """``/chat/completions/input_tokens``: the templated prompt's tokens, as the context limit counts them."""
        body = await self.read_json(request)
        msgs = wire.messages_from(body)
        try:
            n = await self.call(self.inference.count_prompt_tokens,
                                ChatRequest(messages=msgs, max_tokens=1, enable_thinking=wire.thinking(body)))
        except CalError as e:
            raise wire.bad_request(str(e)) from None
        return JSONResponse({"input_tokens": n, "object": "response.input_tokens"})

    @staticmethod
    def not_offered(message: str) -> Handler:
        """A route llama-server has that needs a model the calbin is not (embeddings, reranking, infill):
        its 501 ``not_supported_error`` with its words."""
        async def handler(request: Request) -> Response:
            raise HTTPError(501, "not_supported_error", message)
        return handler

    def _model(self, body: dict[str, Any]) -> str:
        """The model name a response reports: the request's (OpenAI echoes it), else the alias."""
        m = body.get("model")
        return m if isinstance(m, str) and m else self.config.model_alias

    def _client(self, request: Request) -> str:
        return f"http {remote_of(request)}"

    async def chat_completions(self, request: Request) -> Response:
        body = await self.read_json(request)
        req = wire.chat_request(body, n_ctx=self.inference.n_ctx, n_predict=self.config.n_predict,
                                client=self._client(request))
        stream = wire.flag(body, "stream", False)
        include_usage = wire.stream_options(body)
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        model = self._model(body)
        if not stream:
            res = await self.generate(req, request)
            if res.status != "finished":
                raise wire.result_error(res)
            return JSONResponse(wire.chat_completion(res, cid, int(time.time()), model, self.fingerprint,
                                                     wire.prefill_of(req)))
        created = int(time.time())
        fp = self.fingerprint

        first = [wire.chat_chunk(cid, created, model, fp, {"role": "assistant", "content": None})]

        def piece(_i: int, ev: TokenEvent) -> list[dict[str, Any]]:
            return [wire.chat_chunk(cid, created, model, fp, {"content": ev.text})]

        def last(_i: int, res: RequestResult) -> list[dict[str, Any]]:
            out = [wire.chat_chunk(cid, created, model, fp, {}, wire.finish_reason(res))]
            if include_usage:
                out.append({"choices": [], "created": created, "id": cid, "model": model, "system_fingerprint": fp,
                            "object": "chat.completion.chunk", "usage": wire.usage(res)})
            out[-1]["timings"] = wire.timings(res)
            out[-1]["calconsole"] = result_extension(res)
            return out

        return await self._stream([req], first, piece, last, True)

    async def completions_oai(self, request: Request) -> Response:
        body = await self.read_json(request)
        prompts = wire.prompts_from(body)
        reqs = [await self._completion_req({**body, "prompt": p}, request, openai=True) for p in prompts]
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        model = self._model(body)
        created = int(time.time())
        fp = self.fingerprint
        if not wire.flag(body, "stream", False):
            results = await self.generate_all(reqs, request)
            return JSONResponse(wire.text_completion(results, cid, created, model, fp))
        if len(reqs) > 1:
            raise wire.bad_request("'prompt': several prompts stream on /completion only; ask /v1/completions "
                                   "without 'stream' for several")
        wire.stream_options(body)  # checked; llama-server sends usage in the final chunk whatever it says

        def last(_i: int, res: RequestResult) -> list[dict[str, Any]]:
            c = wire.text_chunk(cid, created, model, fp, "", wire.finish_reason(res))
            c["usage"] = wire.usage(res)
            c["timings"] = wire.timings(res)
            c["calconsole"] = result_extension(res)
            return [c]

        return await self._stream(reqs, [], lambda _i, ev: [wire.text_chunk(cid, created, model, fp, ev.text)],
                                  last, True)

    async def _completion_req(self, body: dict[str, Any], request: Request, *, openai: bool) -> ChatRequest:
        return await self.call(lambda: wire.completion_request(
            body, lambda text: self.inference.tokenize(text, parse_special=True), n_ctx=self.inference.n_ctx,
            n_predict=self.config.n_predict, client=self._client(request), openai=openai))

    async def completion(self, request: Request) -> Response:
        """llama.cpp native ``/completion``: no chat template; ``data:`` chunks without ``[DONE]``; a list of
        prompts gives a JSON array of results (streamed: chunks of all, each with its ``index``)."""
        body = await self.read_json(request)
        prompts = wire.prompts_from(body)
        reqs = [await self._completion_req({**body, "prompt": p}, request, openai=False) for p in prompts]
        return_tokens = wire.flag(body, "return_tokens", False)
        per_token = wire.flag(body, "timings_per_token", False)
        stream = wire.flag(body, "stream", False)
        n_ctx = self.inference.n_ctx
        model = self.config.model_alias
        # echoed in the final result: the prompt as the model saw it (its ids detokenized)
        texts = [await self.call(self.inference.detokenize, list(r.prompt_tokens or ())) for r in reqs]

        def final(res: RequestResult, i: int) -> dict[str, Any]:
            return wire.native_completion(res, reqs[i], n_ctx, model, id_slot=reqs[i].id_slot,
                                          return_tokens=return_tokens, stream=stream, prompt=texts[i], index=i,
                                          per_token=per_token)

        if not stream:
            results = await self.generate_all(reqs, request)
            out = [final(r, i) for i, r in enumerate(results)]
            return JSONResponse(out if len(prompts) > 1 else out[0])

        n_prompt = [len(r.prompt_tokens or ()) for r in reqs]

        def piece(i: int, ev: TokenEvent) -> list[dict[str, Any]]:
            c = wire.native_chunk(ev.text, list(ev.tokens), id_slot=reqs[i].id_slot, n_predicted=ev.n_tokens,
                                  n_evaluated=n_prompt[i])
            c["index"] = i
            if per_token:  # llama-server's per-chunk timings need counts the face does not see: ours instead
                c["calconsole"] = {"sim_ms": ev.sim_ms, "clock": "simulated ms: device time + booked host work"}
            return [c]

        return await self._stream(reqs, [], piece, lambda i, res: [final(res, i)], False)

    # --- observation ------------------------------------------------------------------------

    async def snapshot(self, request: Request) -> Response:
        snap = await self.call(self.observation.snapshot)
        # msgspec writes the typed snapshot directly (NaN as null, as to_dict does): ~40x faster than json.dumps
        return Response(msgspec.json.encode(snap), media_type="application/json")

    async def snapshot_stream(self, request: Request) -> Response:
        raw = request.query_params.get("hz", "2")
        try:
            hz = float(raw)
        except ValueError:
            raise wire.bad_request(f"'hz' must be a number, got {raw!r}") from None
        top = self.config.snapshot_max_hz
        if not (math.isfinite(hz) and 0.1 <= hz <= top):
            raise wire.bad_request(f"'hz' must be in [0.1, {top:g}], got {raw}")
        with self._count_lock:
            if self._snap_streams >= self.config.max_snapshot_streams:
                raise HTTPError(503, "unavailable_error",
                                f"too many snapshot streams (limit {self.config.max_snapshot_streams})")
            self._snap_streams += 1
        face = self

        async def gen() -> AsyncIterator[dict[str, Any]]:
            try:
                while not face.closing.is_set():
                    t0 = time.monotonic()
                    snap = await face.call(face.observation.snapshot)
                    yield {"data": msgspec.json.encode(snap).decode()}
                    # slept in POLL_S slices: a stop is seen at once, also at hz=0.1
                    while not face.closing.is_set() and (left := 1.0 / hz - (time.monotonic() - t0)) > 0:
                        await anyio.sleep(min(left, POLL_S))
                yield {"data": _dumps(HTTPError(503, "unavailable_error", "server shutting down").body())}
            finally:
                with face._count_lock:
                    face._snap_streams -= 1

        return self.sse(gen())


def _wrap(face: ServingFace, handler: Handler, auth: str) -> Handler:
    async def endpoint(request: Request) -> Response:
        try:
            if auth != "none":
                request.state.key_label = face.authorize(request, auth)
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


def build_app(face: ServingFace) -> Starlette:
    """The Starlette app: routes above, llama-server error bodies for 404/405, one log line per request."""
    routes: list[tuple[str, Handler, list[str], str]] = [
        ("/health", face.health, ["GET"], "none"),
        ("/props", face.props, ["GET"], "api"),
        ("/slots", face.slots, ["GET"], "api"),
        ("/metrics", face.metrics, ["GET"], "api"),
        ("/v1/models", face.models, ["GET"], "api"),
        ("/models", face.models, ["GET"], "api"),
        ("/tokenize", face.tokenize, ["POST"], "api"),
        ("/detokenize", face.detokenize, ["POST"], "api"),
        ("/apply-template", face.apply_template, ["POST"], "api"),
        ("/chat/completions/input_tokens", face.input_tokens, ["POST"], "api"),
        ("/v1/chat/completions/input_tokens", face.input_tokens, ["POST"], "api"),
        ("/completion", face.completion, ["POST"], "api"),
        ("/completions", face.completion, ["POST"], "api"),
        ("/v1/completions", face.completions_oai, ["POST"], "api"),
        ("/v1/chat/completions", face.chat_completions, ["POST"], "api"),
        ("/chat/completions", face.chat_completions, ["POST"], "api"),
        ("/snapshot", face.snapshot, ["GET"], "api"),
        ("/snapshot/stream", face.snapshot_stream, ["GET"], "api"),
    ]
    # llama-server's answers for a model without embeddings / reranking / fill-in-the-middle tokens
    embeddings = face.not_offered("This server does not support embeddings. Start it with `--embeddings`")
    rerank = face.not_offered("This server does not support reranking. Start it with `--reranking`")
    infill = face.not_offered("Infill is not supported by this model: prefix token is missing. "
                              "suffix token is missing. middle token is missing. ")
    routes += [(p, embeddings, ["POST"], "api") for p in ("/embedding", "/embeddings", "/v1/embeddings")]
    routes += [(p, rerank, ["POST"], "api") for p in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")]
    routes += [("/infill", infill, ["POST"], "api")]
    table = [Route(p, _wrap(face, h, auth), methods=m) for p, h, m, auth in routes]
    if face.maintenance is not None:
        from .maintenance_routes import maintenance_routes

        table += [Route(p, _wrap(face, h, "admin"), methods=m) for p, h, m in maintenance_routes(face)]

    async def not_found(request: Request, exc: Exception) -> Response:
        # llama-server routes by method and path together: a known path with another method is a 404 too
        return JSONResponse(HTTPError(404, "not_found_error", "File Not Found").body(), status_code=404)

    app = Starlette(routes=table, exception_handlers={StarletteHTTPException: not_found})
    # Starlette answers '/props/' with a redirect to an absolute URL built from the Host header, before any
    # key check (an open redirect); llama-server has no such routes: a trailing slash is a 404 here
    app.router.redirect_slashes = False
    origins = face.config.cors_origins
    # llama-server's CORS: the origin echoed, credentials allowed, its four methods, any header
    app.add_middleware(CORSMiddleware, allow_origins=list(origins or ()),
                       allow_origin_regex=None if origins else LOCAL_ORIGINS, allow_credentials=True,
                       allow_methods=["GET", "POST", "DELETE", "OPTIONS"], allow_headers=["*"])
    app.add_middleware(_AccessLog, face=face)
    return app


#: the browser origins allowed without ``--cors-origins``: pages served from this machine
LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?"


class _AccessLog:
    """One log line per request, when it ends: remote, method, path, status, wall ms, key label (never a key)."""

    def __init__(self, app: Any, face: ServingFace) -> None:
        self.app = app
        self.face = face

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
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
