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

import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
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

from .. import __version__
from . import wire
from .keys import KeyRing
from .wire import HTTPError

log = logging.getLogger("calconsole.serve")

Handler = Callable[[Request], Awaitable[Response]]
def _dumps(obj: Any) -> str:
    """Compact JSON, as llama-server writes it (``data: {...}`` lines byte for byte)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


#: after a stop is asked, how long a stream has to end with its error event before it is cut (host s);
#: below uvicorn's graceful-shutdown timeout (run.GRACEFUL_S)
SHUTDOWN_GRACE_S = 3.0
#: how often a waiting stream looks at its client, the deadline and shutdown (host s)
POLL_S = 0.25


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
        # plane calls run in threads: one per in-flight generation + a few for reads and maintenance
        self.limiter = anyio.CapacityLimiter(config.max_streams + config.max_snapshot_streams + 8)
        self.created = int(time.time())
        self.fingerprint = f"calconsole-{__version__}-sim"
        self.leases: Any = None
        # set by run._config when served: the connection guard and the bound on requests in progress (conns)
        self.conn_guard: Any = None
        self.request_bound: Any = None
        from .refusals import RefusalSummary

        self.refusals = RefusalSummary()
        if self.maintenance is not None:
            from .leases import LeaseTable

            self.leases = LeaseTable(config.lease_ttl_s)

    # --- plumbing ----------------------------------------------------------------------------

    async def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Run a blocking plane call in a worker thread."""
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
            what = "API key" if kind == "api" else "admin key"
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

    def _enter_generation(self) -> None:
        with self._count_lock:
            if self.closing.is_set():
                raise HTTPError(503, "unavailable_error", "server is shutting down")
            if self._active >= self.config.max_streams:
                self.stats.refused_busy += 1
                raise HTTPError(503, "unavailable_error",
                                f"server busy: {self._active} requests in flight (limit {self.config.max_streams})")
            self._active += 1

    def _leave_generation(self) -> None:
        with self._count_lock:
            self._active -= 1

    @property
    def in_flight(self) -> int:
        return self._active

    async def submit(self, req: ChatRequest) -> RequestStream:
        """Submit (the caller has entered a generation slot); typed refusals become HTTP errors."""
        try:
            return await self.call(self.inference.submit, req)
        except CalError as e:
            raise wire.from_cal_error(e) from None

    async def events(self, h: RequestStream, request: Request | None = None
                     ) -> AsyncIterator[TokenEvent | DoneEvent]:
        """The request's events; cancels it on shutdown, on the deadline and when the client goes away.

        Always ends with the DoneEvent unless the consumer stops first (then ``finally`` cancels).
        """
        deadline = time.monotonic() + self.config.request_timeout_s
        next_look = time.monotonic() + POLL_S
        silent_since = time.monotonic()
        try:
            while True:
                ev = await anyio.to_thread.run_sync(h.next_event, POLL_S, limiter=self.limiter)
                now = time.monotonic()
                if ev is not None:
                    silent_since = now
                    yield ev
                    if isinstance(ev, DoneEvent):
                        return
                if now >= next_look or ev is None:
                    next_look = now + POLL_S
                    if self.closing.is_set():
                        h.cancel("server shutting down")
                    elif now >= deadline:
                        h.cancel(f"request exceeded the server's deadline of {self.config.request_timeout_s:g} s")
                    elif request is not None and await request.is_disconnected():
                        self.stats.disconnects += 1
                        h.cancel("client disconnected")
                    if ev is None and now - silent_since > self.inference.step_timeout_s + 30:
                        h.cancel("no event from the engine within its step timeout")
                        raise HTTPError(500, "server_error", f"request {h.id}: engine did not answer")
        finally:
            if not h.done:
                h.cancel("client stopped reading the stream")

    async def generate(self, req: ChatRequest, request: Request) -> RequestResult:
        """Submit and wait for the result (non-streaming), cancelling if the client disconnects."""
        self._enter_generation()
        try:
            h = await self.submit(req)
            async for ev in self.events(h, request):
                if isinstance(ev, DoneEvent):
                    return ev.result
            raise HTTPError(500, "server_error", "request ended without a result")
        finally:
            self._leave_generation()

    def sse(self, gen: AsyncIterator[dict[str, Any]], headers: dict[str, str] | None = None) -> EventSourceResponse:
        """An SSE response of ``data: <json>`` events (llama-server framing: ``\\n`` line ends)."""
        # on shutdown sse-starlette would cancel the stream at once; the grace period lets ``events``
        # (which sees ``closing`` within POLL_S) cancel the request and send its error event first
        return EventSourceResponse(gen, sep="\n", send_timeout=self.config.send_timeout_s,
                                   ping=self.config.ping_s, headers={"Cache-Control": "no-cache", **(headers or {})},
                                   shutdown_event=anyio.Event(), shutdown_grace_period=SHUTDOWN_GRACE_S)

    # --- request-level routes -----------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        snap = await self.call(self.observation.snapshot)
        dev = snap.device
        if dev.status == "memory cleared":
            raise HTTPError(503, "unavailable_error", "Loading model: device memory is cleared")
        if dev.mode != "serving":
            raise HTTPError(503, "unavailable_error", f"device in maintenance ({dev.mode}, lease: {dev.lease_holder})")
        return JSONResponse({"status": "ok"})

    def _default_params(self) -> dict[str, Any]:

        return {"n_predict": self.config.n_predict, **msgspec.structs.asdict(SamplingParams()), "stop": [],
                "n_ctx": self.inference.n_ctx, "cache_prompt": True}

    async def props(self, request: Request) -> Response:
        snap = await self.call(self.observation.snapshot)
        dev = snap.device
        n_ctx = self.inference.n_ctx
        return JSONResponse({
            "default_generation_settings": {"id": 0, "id_task": -1, "n_ctx": n_ctx, "speculative": False,
                                            "is_processing": False, "params": self._default_params()},
            "total_slots": dev.n_slots,
            "model_path": f"{dev.bundle} (simulated calbin bundle)",
            "model_alias": self.config.model_alias,
            "modalities": {"vision": False, "audio": False},
            "chat_template": self.inference.chat_template,
            "bos_token": "", "eos_token": "<|im_end|>",
            "build_info": f"calconsole {__version__} (simulated device)",
            "device": {"name": dev.name, "status": dev.status, "mode": dev.mode, "calrt_version": dev.calrt_version,
                       "firmware_commit": dev.firmware_commit, "chiplets": msgspec.to_builtins(dev.chiplets),
                       "context_tokens": dev.context_tokens, "numerics": dev.numerics, "pacing": dev.pacing,
                       "pacing_speed": dev.pacing_speed, "step_timeout_s": self.inference.step_timeout_s,
                       "maintenance_routes": self.maintenance is not None,
                       "findings": msgspec.to_builtins(snap.findings),
                       # which host work the timings book (--host-time): a client comparing runs
                       # (bench matrix records this key) cannot tell modeled from measured otherwise
                       "clock": "timings are "
                                + (snap.requests.get("clock") or "simulated device ms + booked host work")},
        })

    async def slots(self, request: Request) -> Response:
        if not self.config.slots_endpoint:
            raise HTTPError(501, "not_supported_error", "This server does not support slots endpoint.")
        snap = await self.call(self.observation.snapshot)
        n_ctx = self.inference.n_ctx
        out = []
        for s in snap.slots:
            busy = s.state != "idle"
            params = {"n_predict": (-1 if s.max_tokens == n_ctx else s.max_tokens) if busy else self.config.n_predict,
                      **(s.params if busy else self._default_params())}
            params.pop("n_ctx", None)
            out.append({"id": s.index, "id_task": s.request_id if s.request_id is not None else -1, "n_ctx": n_ctx,
                        "speculative": False, "is_processing": busy, "state": s.state, "params": params,
                        "n_prompt_tokens": s.prompt_n, "n_prompt_tokens_processed": s.n_prefilled,
                        "n_cached_tokens": s.cached_tokens,
                        "next_token": {"has_next_token": busy, "has_new_line": False,
                                       "n_remain": max(0, s.max_tokens - s.predicted_n) if busy else -1,
                                       "n_decoded": s.predicted_n, "stopping_word": ""}})
        if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(o["is_processing"] for o in out):
            raise HTTPError(503, "unavailable_error", "no slot available")
        return JSONResponse(out)

    async def metrics(self, request: Request) -> Response:
        if not self.config.metrics_endpoint:
            raise HTTPError(501, "not_supported_error", "This server does not support metrics endpoint.")
        text = await self.call(self.observation.metrics_text)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def models(self, request: Request) -> Response:
        n_ctx = self.inference.n_ctx
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_alias, "object": "model", "created": self.created, "owned_by": "calconsole",
            "meta": {"n_ctx_train": n_ctx, "n_ctx": n_ctx, "n_vocab": 151936, "simulated": True}}]})

    async def tokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise wire.bad_request("'content' must be a string")
        parse_special = wire._bool(body, "parse_special", True)
        wire._bool(body, "add_special", False)  # Qwen3 adds no BOS: accepted, nothing to add
        with_pieces = wire._bool(body, "with_pieces", False)
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
        if not wire._bool(body, "with_pieces", False):
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
            think = wire._thinking(body)
            prompt = await self.call(self.inference.apply_template, msgs, enable_thinking=think)
            n = await self.call(self.inference.count_prompt_tokens,
                                ChatRequest(messages=msgs, max_tokens=1, enable_thinking=think))
        except CalError as e:
            raise wire.bad_request(str(e)) from None
        # n_prompt_tokens: the templated prompt's tokens as the context limit counts them (our addition)
        return JSONResponse({"prompt": prompt, "n_prompt_tokens": n})

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
        stream = wire._bool(body, "stream", False)
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise wire.bad_request("'stream_options' must be an object")
        include_usage = wire._bool(opts, "include_usage", False)
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        model = self._model(body)
        if not stream:
            res = await self.generate(req, request)
            if res.status != "finished":
                raise wire.result_error(res)
            return JSONResponse(wire.chat_completion(res, cid, int(time.time()), model, self.fingerprint))
        return await self._stream(req, request, *self._chat_chunks(cid, model, include_usage))

    def _chat_chunks(self, cid: str, model: str, include_usage: bool) -> tuple[Any, Any, Any, bool]:
        created = int(time.time())
        fp = self.fingerprint

        def first() -> list[dict[str, Any]]:
            return [wire.chat_chunk(cid, created, model, fp, {"role": "assistant", "content": None})]

        def piece(ev: TokenEvent) -> list[dict[str, Any]]:
            return [wire.chat_chunk(cid, created, model, fp, {"content": ev.text})]

        def last(res: RequestResult) -> list[dict[str, Any]]:
            out = [wire.chat_chunk(cid, created, model, fp, {}, wire.finish_reason(res))]
            if include_usage:
                out.append({"choices": [], "created": created, "id": cid, "model": model, "system_fingerprint": fp,
                            "object": "chat.completion.chunk", "usage": wire.usage(res)})
            out[-1]["timings"] = wire.timings(res)
            out[-1]["calconsole"] = wire.result_extension(res)
            return out

        return first, piece, last, True

    async def completions_oai(self, request: Request) -> Response:
        body = await self.read_json(request)
        req = await self._completion_req(body, request, openai=True)
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        model = self._model(body)
        if not wire._bool(body, "stream", False):
            res = await self.generate(req, request)
            if res.status != "finished":
                raise wire.result_error(res)
            return JSONResponse(wire.text_completion(res, cid, int(time.time()), model, self.fingerprint))
        created = int(time.time())
        fp = self.fingerprint
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise wire.bad_request("'stream_options' must be an object")
        include_usage = wire._bool(opts, "include_usage", False)

        def last(res: RequestResult) -> list[dict[str, Any]]:
            c = wire.text_chunk(cid, created, model, fp, "", wire.finish_reason(res))
            if include_usage:
                c["usage"] = wire.usage(res)
            c["timings"] = wire.timings(res)
            c["calconsole"] = wire.result_extension(res)
            return [c]

        return await self._stream(req, request, lambda: [],
                                  lambda ev: [wire.text_chunk(cid, created, model, fp, ev.text)], last, True)

    async def _completion_req(self, body: dict[str, Any], request: Request, *, openai: bool) -> ChatRequest:
        return await self.call(lambda: wire.completion_request(
            body, lambda text: self.inference.tokenize(text, parse_special=True), n_ctx=self.inference.n_ctx,
            n_predict=self.config.n_predict, client=self._client(request), openai=openai))

    async def completion(self, request: Request) -> Response:
        """llama.cpp native ``/completion``: no chat template; ``data:`` chunks without ``[DONE]``."""
        body = await self.read_json(request)
        req = await self._completion_req(body, request, openai=False)
        return_tokens = wire._bool(body, "return_tokens", False)
        per_token = wire._bool(body, "timings_per_token", False)
        n_ctx = self.inference.n_ctx
        model = self.config.model_alias
        ids = list(req.prompt_tokens or ())
        prompt = await self.call(lambda: self.inference.detokenize(ids))  # echoed in the final result
        if not wire._bool(body, "stream", False):
            res = await self.generate(req, request)
            if res.status != "finished":
                raise wire.result_error(res)
            return JSONResponse(wire.native_completion(res, req, n_ctx, model, id_slot=req.id_slot,
                                                       return_tokens=return_tokens, stream=False, prompt=prompt))

        def piece(ev: TokenEvent) -> list[dict[str, Any]]:
            c: dict[str, Any] = {"index": 0, "content": ev.text, "tokens": [], "stop": False, "id_slot": req.id_slot,
                                 "tokens_predicted": ev.n_tokens, "tokens_evaluated": 0}
            if per_token:
                c["timings"] = {"predicted_n": ev.n_tokens, "sim_ms": ev.sim_ms,
                                "clock": "simulated ms: device time + booked host work"}
            return [c]

        def last(res: RequestResult) -> list[dict[str, Any]]:
            return [wire.native_completion(res, req, n_ctx, model, id_slot=req.id_slot,
                                           return_tokens=return_tokens, stream=True, prompt=prompt)]

        return await self._stream(req, request, lambda: [], piece, last, False)

    async def _stream(self, req: ChatRequest, request: Request, first: Callable[[], list[dict[str, Any]]],
                      piece: Callable[[TokenEvent], list[dict[str, Any]]],
                      last: Callable[[RequestResult], list[dict[str, Any]]], send_done: bool) -> Response:
        """Submit, then stream ``data:`` events: ``first()``, ``piece(ev)`` per visible piece, ``last(result)``,
        then ``[DONE]`` if ``send_done`` (OpenAI routes).

        Errors before the first byte are ordinary HTTP errors; after it, one ``data: {"error": ...}``
        event (llama-server's streaming error) ends the stream.
        """
        self._enter_generation()
        try:
            h = await self.submit(req)
        except BaseException:
            self._leave_generation()
            raise
        face = self

        async def gen() -> AsyncIterator[dict[str, Any]]:
            face.stats.streams_open += 1
            try:
                for c in first():
                    yield {"data": _dumps(c)}
                async for ev in face.events(h, None):
                    if isinstance(ev, TokenEvent):
                        for c in piece(ev):
                            yield {"data": _dumps(c)}
                        continue
                    res = ev.result
                    if res.status != "finished":
                        yield {"data": _dumps({**wire.result_error(res).body(), "timings": wire.timings(res),
                                               "calconsole": wire.result_extension(res)})}
                        return
                    for c in last(res):
                        yield {"data": _dumps(c)}
                    if send_done:
                        yield {"data": "[DONE]"}
                    return
            except HTTPError as e:
                yield {"data": _dumps(e.body())}
            finally:
                face.stats.streams_open -= 1
                if not h.done:
                    face.stats.disconnects += 1
                    h.cancel("client disconnected")
                face._leave_generation()

        return self.sse(gen(), headers={"X-Request-Id": str(h.id), "X-Prompt-Tokens": str(h.prompt_n)})

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
    routes = [
        ("/health", face.health, ["GET"], "none"),
        ("/props", face.props, ["GET"], "api"),
        ("/slots", face.slots, ["GET"], "api"),
        ("/metrics", face.metrics, ["GET"], "api"),
        ("/v1/models", face.models, ["GET"], "api"),
        ("/models", face.models, ["GET"], "api"),
        ("/tokenize", face.tokenize, ["POST"], "api"),
        ("/detokenize", face.detokenize, ["POST"], "api"),
        ("/apply-template", face.apply_template, ["POST"], "api"),
        ("/completion", face.completion, ["POST"], "api"),
        ("/completions", face.completion, ["POST"], "api"),
        ("/v1/completions", face.completions_oai, ["POST"], "api"),
        ("/v1/chat/completions", face.chat_completions, ["POST"], "api"),
        ("/chat/completions", face.chat_completions, ["POST"], "api"),
        ("/snapshot", face.snapshot, ["GET"], "api"),
        ("/snapshot/stream", face.snapshot_stream, ["GET"], "api"),
    ]
    table = [Route(p, _wrap(face, h, auth), methods=m) for p, h, m, auth in routes]
    if face.maintenance is not None:
        from .maintenance_routes import maintenance_routes

        table += [Route(p, _wrap(face, h, "admin"), methods=m) for p, h, m in maintenance_routes(face)]

    async def not_found(request: Request, exc: Exception) -> Response:
        code = getattr(exc, "status_code", 404)
        if code == 405:
            return JSONResponse(HTTPError(405, "invalid_request_error",
                                          f"method {request.method} not allowed on {request.url.path}").body(),
                                status_code=405)
        return JSONResponse(HTTPError(404, "not_found_error", "File Not Found").body(), status_code=404)

    app = Starlette(routes=table, exception_handlers={StarletteHTTPException: not_found})
    # Starlette answers '/props/' with a redirect to an absolute URL built from the Host header, before any
    # key check (an open redirect); llama-server has no such routes: a trailing slash is a 404 here
    app.router.redirect_slashes = False
    app.add_middleware(_AccessLog, face=face)
    return app


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
