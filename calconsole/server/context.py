"""The serving face's context: the state every route shares, below the routes, the middleware and the app.

As llama.cpp's server splits ``server-context`` (the server's state, slots, task queue) from ``server-http``
(the HTTP layer and the routes over it): ``ServingFace`` holds the planes, the bounds, the lease table,
generation places, the push bridge (``bridge``) from the engine's threads to the event loop and the SSE
responses; ``ServeConfig`` the bounds; ``device_of`` / ``remote_of`` and the ``RouteSpec`` / ``Handler``
shapes are the helpers the route modules share. This module imports no route, no middleware and not the app
assembly (``face``): they import it.

Starlette (routing, requests, responses) + sse-starlette (Server-Sent Events with send timeouts,
client-disconnect detection and shutdown hooks) on uvicorn: the smallest well-kept ASGI stack
that does SSE properly; FastAPI would add pydantic models we do not need (the shapes are
llama-server's, checked in ``wire``), aiohttp has no SSE of its own.

The face is a client of the plane contracts only (``sim_backend.planes``): it cannot tell an
in-process device from any other implementation. Plane calls block, so each runs in a worker
thread (``anyio.to_thread``), bounded by a capacity limiter.

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
import os
import threading
import time
from collections.abc import AsyncIterable, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import msgspec
from sse_starlette.sse import EventSourceResponse
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from sim_backend.planes import (
    CalError,
    ChatRequest,
    DoneEvent,
    InferencePlane,
    MaintenancePlane,
    ObservationPlane,
    ProgressEvent,
    RequestResult,
    RequestStream,
    StreamEvent,
    TokenEvent,
)
from sim_backend.planes.snapshot import DeviceInfo, Snapshot

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
#: one route: (path, handler, methods, key it needs: "none" | "api" | "admin"); each routes_* module lists its own
RouteSpec = tuple[str, Handler, list[str], str]
_dumps = wire.dumps


class BodyTooLarge(Exception):
    """A request body grew past the limit while it was being received (raised by ``middleware.BodyLimit``,
    turned into a 400 by ``ServingFace.read_json``)."""


#: a request body over this many bytes is parsed in a worker thread, and /tokenize and /detokenize of one
#: take a place in the generation bound (``ServingFace.heavy``)
HEAVY_BODY_BYTES = 64 * 1024
#: after a stop is asked, how long a stream has to end with its error event before it is cut (host s);
#: below uvicorn's graceful-shutdown timeout (run.GRACEFUL_S)
SHUTDOWN_GRACE_S = 3.0


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


#: host s a request without a limit of its own (-1) gets past the deadline to end at its next token (a decode
#: step is ~17 ms sim at 58 tok/s, facts.md F7), before it is cancelled as any other; chosen, not measured:
#: room for a slow host and for a request still prefilling a long prompt
UNBOUNDED_GRACE_S = 10.0


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
    #: the model's names (llama-server's --alias, comma list): the first is reported, all are aliases
    model_alias: str = "qwen3-30b-a3b"
    #: tags /v1/models lists (llama-server's --tags)
    model_tags: tuple[str, ...] = ()
    #: the slot context the face enforces, tokens (llama-server's --ctx-size; None: the calbin's 40960)
    n_ctx: int | None = None
    #: the seed of a request that gives none (llama-server's --seed; None: a fresh random one each)
    seed: int | None = None
    snapshot_max_hz: float = 10.0
    max_snapshot_streams: int = 8
    ping_s: float = 15.0
    #: what one peer address and all peers may hold open (``conns.ConnLimits``); None: its defaults
    conn_limits: Any = None
    #: browser origins allowed to call the server (CORS); None: localhost and 127.0.0.1 / [::1] on any
    #: port; ("*",): any origin (llama-server's ``--cors-origins``)
    cors_origins: tuple[str, ...] | None = None
    #: directory of slot state files (llama-server's ``--slot-save-path``): POST /slots/{id}?action=save|
    #: restore|erase exist only with it (501 otherwise, as llama-server); created (mode 700) if missing
    slot_save_path: str | None = None
    #: chat template variables every request gets, under its own ``chat_template_kwargs`` (llama-server's
    #: ``--chat-template-kwargs``; ``enable_thinking`` there sets the server's default thinking mode)
    chat_template_kwargs: dict[str, Any] | None = None
    #: llama-server's ``-b/--batch-size`` (logical batch, tokens; its default 2048): here it only sizes
    #: ``/infill``'s prefix and suffix cuts, as there (the simulator batches by its own plan)
    n_batch: int = 2048
    #: llama-server's ``--spm-infill``: ``/infill`` puts the suffix before the prefix (suffix-prefix-middle)
    spm_infill: bool = False
    #: the HTTP/1.1 implementation (``--http``): "httptools" (llhttp, C, on uvloop), "h11" (pure Python, on
    #: asyncio's loop) or "auto" (httptools when installed); the guards are the same on both (server/run.py).
    #: h11 stays the default: under uvloop one guard test (a head unread by a late loop is spared) fails
    http: str = "h11"

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
        from .leases import MAX_TTL_S, MIN_TTL_S

        if not (isinstance(self.lease_ttl_s, (int, float)) and MIN_TTL_S <= self.lease_ttl_s <= MAX_TTL_S):
            raise ValueError(f"--lease-ttl must be in [{MIN_TTL_S:g}, {MAX_TTL_S:g}] s, got {self.lease_ttl_s}")
        if self.n_ctx is not None and not 1 <= self.n_ctx <= 40960:
            raise ValueError(f"--ctx-size must be in 1..40960 (the calbin's context, facts.md F2), got {self.n_ctx}")
        if self.seed is not None and not 0 <= self.seed <= 0xFFFFFFFF:
            raise ValueError(f"--seed must be in 0..4294967295, got {self.seed}")
        if not [a for a in self.model_alias.split(",") if a.strip()]:
            raise ValueError("--alias must name the model")
        if not 1 <= self.n_batch <= 1 << 20:
            raise ValueError(f"--batch-size must be in 1..{1 << 20}, got {self.n_batch}")
        if self.n_predict == 0 or self.n_predict < -1:
            raise ValueError(f"n_predict must be -1 (until the context is full) or positive, got {self.n_predict}")
        if self.http not in ("auto", "h11", "httptools"):
            raise ValueError(f"--http must be auto, h11 or httptools, got {self.http!r}")
        if self.slot_save_path is not None and (not self.slot_save_path or (
                os.path.lexists(self.slot_save_path) and not os.path.isdir(self.slot_save_path))):
            raise ValueError(f"--slot-save-path must be a directory, got {self.slot_save_path!r}")
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
        #: the slot save directory, resolved once (symlinks in its own path followed here, never in a file name)
        self.slot_dir: str | None = None
        if config.slot_save_path is not None:
            os.makedirs(config.slot_save_path, mode=0o700, exist_ok=True)
            self.slot_dir = os.path.realpath(config.slot_save_path)
        self._thinking: bool | None = None  # thinking_default, once probed
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
        """The body as a JSON object; 400 for a missing, oversized (``middleware.BodyLimit``), slow,
        malformed or non-object body."""
        chunks: list[bytes] = []
        try:
            with anyio.fail_after(self.config.body_timeout_s):
                async for chunk in request.stream():
                    chunks.append(chunk)
        except BodyTooLarge as e:
            raise wire.bad_request(str(e)) from None
        except TimeoutError:
            raise wire.bad_request(f"request body not received within {self.config.body_timeout_s:g} s") from None
        except ClientDisconnect:  # nobody reads the answer; a refusal, not an internal error
            raise wire.bad_request("client disconnected before sending the whole body") from None
        data = b"".join(chunks)
        request.state.body_bytes = len(data)
        if not data.strip():
            raise wire.bad_request("request body is empty; expected a JSON object")
        if len(data) > HEAVY_BODY_BYTES:  # ~10 ms a MiB: parsed in a worker thread, not on the event loop
            obj: dict[str, Any] = await self.call(self._parse_json, data)
            return obj
        return self._parse_json(data)

    @staticmethod
    def _parse_json(data: bytes) -> dict[str, Any]:
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

    async def heavy(self, request: Request, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` in a worker thread; a request whose body is over ``HEAVY_BODY_BYTES`` also takes a
        place in the generation bound (``max_streams``, 503 beyond), as its CPU is a generation's.

        (/tokenize of 0.7 MB with pieces took 2.45 s of CPU, /detokenize of 100k ids 1.6 s: outside the
        bound and on the event loop, a few of them stalled every stream.)
        """
        if getattr(request.state, "body_bytes", 0) <= HEAVY_BODY_BYTES:
            return await self.call(fn)
        self._enter_generation()
        try:
            return await self.call(fn)
        finally:
            self._leave_generation()

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

    @property
    def n_ctx(self) -> int:
        """The slot context the face enforces (tokens): ``--ctx-size``, at most the plane's."""
        c = self.config.n_ctx
        return self.inference.n_ctx if c is None else min(c, self.inference.n_ctx)

    @property
    def n_vocab(self) -> int:
        """The model's vocabulary rows (token ids are in ``[0, n_vocab)``): the plane's, Qwen3's 151936 for a
        plane that does not say."""
        return int(getattr(self.inference, "n_vocab", 151936))

    @property
    def aliases(self) -> list[str]:
        """The model's names, the reported one first."""
        return [a.strip() for a in self.config.model_alias.split(",") if a.strip()]

    async def template_options(self, body: dict[str, Any]) -> dict[str, Any]:
        """The body's chat template fields (``wire.template_options``) with this server's defaults: its
        ``--chat-template-kwargs``, and thinking on when the model's template has a thinking mode
        (llama-server's default; Qwen3's has)."""
        return wire.template_options(body, thinking_default=await self.thinking_default(),
                                     server_kwargs=self.config.chat_template_kwargs)

    async def thinking_default(self) -> bool:
        """Whether a request that does not say gets thinking on: the template has a thinking mode when a
        one-message chat renders differently with ``enable_thinking`` true and false and one rendering has
        a ``</think>`` tag (llama-server tells it from the template's thinking tags: a template that merely
        prints the variable has none). Probed once through the plane."""
        if self._thinking is None:
            self._thinking = await self.call(self._probe_thinking)
        return self._thinking

    def _probe_thinking(self) -> bool:
        probe = [{"role": "user", "content": "test"}]
        try:
            on, off = (self.inference.apply_template(probe, enable_thinking=t) for t in (True, False))
        except CalError:  # a template that refuses the probe has no thinking mode to turn on
            return False
        return on != off and ("</think>" in on or "</think>" in off)

    def with_defaults(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` with the server's default seed when it gives none (llama-server's --seed)."""
        if self.config.seed is not None and body.get("seed") is None:
            return {**body, "seed": self.config.seed}
        return body

    async def fit_context(self, req: ChatRequest) -> ChatRequest:
        """``req`` within the slot context (``--ctx-size`` below the plane's): a prompt that fills it is
        llama-server's 400 exceed_context_size_error; the generation limit is cut to what is left."""
        if self.n_ctx >= self.inference.n_ctx:
            return req  # the plane enforces its own context
        n = len(req.prompt_tokens) if req.prompt_tokens is not None else await self.call(
            self.inference.count_prompt_tokens, req)
        if n >= self.n_ctx:
            raise HTTPError(400, "exceed_context_size_error",
                            f"request ({n} tokens) exceeds the available context size ({self.n_ctx} tokens), "
                            "try increasing it", n_prompt_tokens=n, n_ctx=self.n_ctx)
        left = self.n_ctx - n
        if req.max_tokens is None or req.max_tokens > left:
            req = msgspec.structs.replace(req, max_tokens=left)
        return req

    def enter_snapshot_stream(self) -> None:
        """Take a snapshot-stream place; 503 beyond ``max_snapshot_streams``."""
        with self._count_lock:
            if self._snap_streams >= self.config.max_snapshot_streams:
                raise HTTPError(503, "unavailable_error",
                                f"too many snapshot streams (limit {self.config.max_snapshot_streams})")
            self._snap_streams += 1

    def leave_snapshot_stream(self) -> None:
        with self._count_lock:
            self._snap_streams -= 1

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
        # no limit of its own (-1, llama-server's "until the context is full or a stop"): the deadline is
        # its limit, so it ends there with what it generated (finished, limit) instead of an error
        unbounded = all(r.max_tokens is None or r.max_tokens >= self.n_ctx for r in reqs)
        reqs = [await self.fit_context(r) for r in reqs]
        self._enter_generation(len(reqs))
        handles: list[RequestStream] = []
        try:
            for r in reqs:
                handles.append(await self.submit(r))
            if self.closing.is_set():
                raise HTTPError(503, "unavailable_error", "server is shutting down")
            # every item a request can give: a piece per token, its end (final + usage + [DONE]), margin; with
            # return_progress one more per prefill step (at most one a prompt token) and the first one
            buffer = sum(3 * ((r.max_tokens or self.n_ctx) + 2) + ((h.prompt_n + 1) if r.return_progress else 0)
                         for r, h in zip(reqs, handles, strict=True))
            bridge = EventBridge(handles, fmt, silent_s=self.inference.step_timeout_s + 30, on_silent=on_silent,
                                 on_error=on_error, buffer=buffer, first=first or ())
        except BaseException:
            for h in handles:
                h.cancel("request refused")
            self._leave_generation(len(reqs))
            raise
        with self._count_lock:
            self._bridges.add(bridge)
        loop = asyncio.get_running_loop()
        deadline_s = self.config.request_timeout_s
        why = f"request exceeded the server's deadline of {deadline_s:g} s"
        if unbounded:
            timers = [loop.call_later(deadline_s, bridge.stop_generation, f"the server's deadline of {deadline_s:g} s"),
                      loop.call_later(deadline_s + UNBOUNDED_GRACE_S, bridge.cancel, why)]
        else:
            timers = [loop.call_later(deadline_s, bridge.cancel, why)]
        closed = False

        def close() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            for timer in timers:
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

        def fmt(i: int, ev: StreamEvent) -> list[Any]:
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

    async def stream(self, reqs: list[ChatRequest], first: list[dict[str, Any]],
                      piece: Callable[[int, TokenEvent], list[dict[str, Any]]],
                      last: Callable[[int, RequestResult], list[dict[str, Any]]], send_done: bool,
                      progress: Callable[[int, ProgressEvent], list[dict[str, Any]]] | None = None) -> Response:
        """Submit, then stream ``data:`` events: ``first``, ``piece(i, ev)`` per visible piece, ``progress(i,
        ev)`` per prompt-progress event (requests with ``return_progress``), ``last(i, result)`` per request,
        then ``[DONE]`` if ``send_done`` (OpenAI routes: one request).

        Errors before the first byte are ordinary HTTP errors; after it, one ``data: {"error": ...}``
        event (llama-server's streaming error) ends that request's part of the stream.
        """

        def data(chunks: list[dict[str, Any]]) -> list[dict[str, str]]:
            return [{"data": _dumps(c)} for c in chunks]

        ended = {"n": 0, "failed": False}
        ended_lock = threading.Lock()

        def all_ended(failed: bool) -> bool:
            with ended_lock:  # the pumps run in their own threads
                ended["n"] += 1
                ended["failed"] = ended["failed"] or failed
                return ended["n"] == len(reqs) and not ended["failed"]

        def fmt(i: int, ev: StreamEvent) -> list[Any]:
            if isinstance(ev, TokenEvent):
                return data(piece(i, ev))
            if isinstance(ev, ProgressEvent):
                return data(progress(i, ev)) if progress is not None else []
            res = ev.result
            if res.status != "finished":
                all_ended(True)
                return data([{**wire.result_error(res).body(), "timings": wire.timings(res),
                              "calconsole": result_extension(res)}])
            # [DONE] once, after the last request's end (n choices stream interleaved)
            done = all_ended(False) and send_done
            return data(last(i, res)) + ([{"data": "[DONE]"}] if done else [])

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
