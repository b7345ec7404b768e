"""Running the face on uvicorn: in the foreground (``calconsole serve``) or in a thread (tests, ``--listen``).

Stopping: SIGINT/SIGTERM (foreground) or ``ServerThread.stop()`` set ``face.closing`` first, so
every open stream ends with an ``unavailable_error`` event and its request is cancelled (KV
freed) before uvicorn closes the connections; the caller then closes the system (engine and
device threads) and the audit log, whose records are already fsync'd one by one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import uvicorn

from .bounds import HEAVY_REPLY_BUDGET, ReplyGuard, RequestBound
from .conns import (
    ACCEPTS_PER_PASS,
    HAVE_HTTPTOOLS,
    LISTEN_BACKLOG,
    ConnectionGuard,
    GuardedConn,
    GuardedH11Protocol,
    GuardedHttpToolsProtocol,
    ListenGate,
)
from .face import HEAVY_BODY_BYTES, ServingFace, build_app
from .heads import OneWrite
from .replies import reply_limit

log = logging.getLogger("calconsole.serve")
#: how long in-flight responses get to finish after a stop is asked (host s); then they are cancelled
GRACEFUL_S = 5.0


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and 'localhost'."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: an ephemeral port). OSError if it cannot bind.

    Created with ``IPPROTO_TCP`` named: asyncio sets ``TCP_NODELAY`` on accepted sockets only when
    ``sock.proto`` says TCP, and with proto 0 Nagle held the body segment of every kept-alive
    response until the client's delayed ACK (~40 ms a request; 0.1 ms with it).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = ListenGate(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # the guard refuses at accept past the cap
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)  # conns.LISTEN_BACKLOG says why that deep
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def _app_with_lifespan(face: ServingFace, on_started: Callable[[], None] | None = None) -> Any:
    from .maintenance_routes import reaper

    app = build_app(face)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            if face.maintenance is not None:
                tg.start_soon(reaper, face)
            if on_started is not None:
                on_started()  # signal handlers are in place by now: a stop from here on is a clean one
            yield
            tg.cancel_scope.cancel()
        if face.audit is not None:  # the refusal windows still open: their summaries, before the log closes
            try:
                await anyio.to_thread.run_sync(lambda: face.refusals.flush(face.audit, force=True))
            except Exception as e:  # noqa: BLE001 - stopping goes on; say what was not written
                log.error("audit log: refusal summaries not written at stop: %s", e)

    app.app.router.lifespan_context = lifespan  # type: ignore[attr-defined]
    c = face.config
    # requests in progress, not connections: idle ones cannot take this capacity (conns module)
    face.request_bound = RequestBound(app, max_active=c.max_streams + c.max_snapshot_streams + 64,
                                      is_admin=lambda scope: _shows_admin_key(face, scope))
    # every reply in pieces with a send deadline; heavy replies bounded in number (conns.ReplyGuard)
    guarded = ReplyGuard(face.request_bound, face.conn_guard, send_timeout_s=c.send_timeout_s,
                         heavy_body_bytes=HEAVY_BODY_BYTES,
                         places=max(1, HEAVY_REPLY_BUDGET // reply_limit(c.max_body_bytes)))
    return guarded  # heads: names cased and Date added on the wire (heads.OneWrite), the bounds' refusals too


def _shows_admin_key(face: ServingFace, scope: dict[str, Any]) -> bool:
    """Whether a request's ``Authorization: Bearer`` (or ``X-Api-Key``) is one of the admin keys."""
    ring = face.config.admin_keys
    if ring is None:
        return False
    headers = dict(scope.get("headers", ()))
    auth = headers.get(b"authorization", b"").decode("latin-1")
    scheme, _, token = auth.partition(" ")
    key = token.strip() if auth and scheme.lower() == "bearer" else headers.get(b"x-api-key", b"").decode("latin-1")
    return bool(key) and ring.match(key) is not None


class _Server(uvicorn.Server):
    """uvicorn's server, telling the face to end its streams as soon as a stop is asked."""

    def __init__(self, config: uvicorn.Config, face: ServingFace) -> None:
        super().__init__(config)
        self.face = face

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.face.begin_shutdown()
        super().handle_exit(sig, frame)
        # a stop asked by a signal is a clean stop: do not re-raise it at exit (uvicorn would), so the
        # caller closes the simulator and returns 0
        self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        # uvicorn's backlog is asyncio's accepts per loop pass (ACCEPTS_PER_PASS), and its listen(): the queue
        # gets its own depth back
        for sk in sockets or ():
            sk.listen(LISTEN_BACKLOG)


class _HeadDeadline(GuardedConn):
    """A deadline on each request head (``head_timeout_s`` host s), mixed in before a guarded protocol.

    uvicorn times out only a keep-alive connection between requests, and any byte cancels that:
    a connection that sends nothing, or headers that never end (slowloris), kept its place under
    ``limit_concurrency`` forever, and enough of them made every client a 503.
    """

    head_timeout_s = 10.0

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        # headers and body are two writes: without NODELAY, Nagle waits for the peer's delayed ACK
        # (~40 ms) on every kept-alive response, whatever socket the server was handed
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._arm_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_head_deadline()

    def _head_arrived(self) -> None:
        super()._head_arrived()
        # the request's cycle writes its head through OneWrite: llama-server's spelling, one write with the body
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not isinstance(cycle.transport, OneWrite):
            cycle.transport = OneWrite(cycle.transport, self.loop)  # type: ignore[assignment]

    def _arm_head_deadline(self) -> None:
        self.loop.call_later(self.head_timeout_s, self._head_deadline, self.served)

    def _head_deadline(self, served: int) -> None:
        # still idle since the deadline was armed: no response ended and no new request head arrived
        if self.served == served and self.idle_since is not None and not self.transport.is_closing():
            self.transport.close()


class _H11Protocol(_HeadDeadline, GuardedH11Protocol):
    """uvicorn's h11 protocol (pure Python) with the guard and the head deadline."""


class _HttpToolsProtocol(_HeadDeadline, GuardedHttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's httptools protocol (llhttp, C) with the guard and the head deadline."""


#: ``ServeConfig.http`` -> (protocol, uvicorn's event loop): the C parser runs on uvloop (both C; with
#: asyncio's loop the h11 path stays what it was)
PROTOCOLS: dict[str, tuple[type[GuardedConn], str]] = {"h11": (_H11Protocol, "asyncio"),
                                                       "httptools": (_HttpToolsProtocol, "auto")}


def http_impl(name: str) -> str:
    """The HTTP implementation ``name`` ("auto", "h11", "httptools") stands for: "auto" is httptools when
    it is importable, else h11. ValueError for another name."""
    if name == "auto":
        return "httptools" if HAVE_HTTPTOOLS else "h11"
    if name not in PROTOCOLS:
        raise ValueError(f"--http must be auto, h11 or httptools, got {name!r}")
    if name == "httptools" and not HAVE_HTTPTOOLS:
        raise ValueError("--http httptools: the httptools package is not installed")
    return name


def _config(face: ServingFace, *, signals: bool, on_started: Callable[[], None] | None = None) -> uvicorn.Config:
    c = face.config
    # the head gets the body's time bound (ServeConfig.body_timeout_s); one guard per server (conns module)
    face.conn_guard = ConnectionGuard(c.conn_limits, admin_match=c.admin_keys.match if c.admin_keys else None)
    base, loop = PROTOCOLS[http_impl(c.http)]
    proto = type("_Guarded", (base,), {"head_timeout_s": c.body_timeout_s, "guard": face.conn_guard})
    # no limit_concurrency: uvicorn counts idle connections too and answers plain text (RequestBound instead)
    # no proxy headers: llama-server reads no X-Forwarded-For, and with them any local client named its own address
    # (the access log, the audit log, the per-address bounds of heavy replies and snapshot streams)
    return uvicorn.Config(_app_with_lifespan(face, on_started), log_config=None, access_log=False, lifespan="on",
                          http=proto, loop=loop, backlog=ACCEPTS_PER_PASS, proxy_headers=False,
                          timeout_graceful_shutdown=int(GRACEFUL_S), timeout_keep_alive=5,
                          h11_max_incomplete_event_size=64 * 1024, server_header=False,
                          date_header=False)  # heads.OneWrite writes Date (uvicorn's is lower-case)


def serve_foreground(face: ServingFace, socks: socket.socket | list[socket.socket],
                     on_started: Callable[[], None] | None = None) -> None:
    """Serve ``socks`` (one listening socket, or several: ``--host a,b``) until SIGINT/SIGTERM (uvicorn
    installs the handlers). ``on_started`` runs once the server is up and the handlers are installed
    (``calconsole serve`` prints its "listening" line then)."""
    server = _Server(_config(face, signals=True, on_started=on_started), face)
    socks = socks if isinstance(socks, list) else [socks]
    _gate(socks, face)
    server.run(sockets=socks)


def _gate(socks: list[socket.socket], face: ServingFace) -> None:
    for sk in socks:  # a socket bound elsewhere (not a ListenGate) is served ungated
        if isinstance(sk, ListenGate):
            sk.guard = face.conn_guard


class ServerThread:
    """The face served from a background thread (tests bind 127.0.0.1:0; the console's ``--listen``).

    ``start()`` returns once uvicorn listens (bounded); ``url`` is then ``http://host:port``;
    ``stop()`` ends streams with an error event and joins the thread (bounded).
    """

    def __init__(self, face: ServingFace, host: str = "127.0.0.1", port: int = 0,
                 sock: socket.socket | None = None) -> None:
        """``sock``: a listening socket bound beforehand (``bind_socket``; then ``host``/``port`` are not
        used), so a busy port is found before the device is built; None binds ``host:port`` here."""
        self.face = face
        self.sock = sock if sock is not None else bind_socket(host, port)
        h, p = self.sock.getsockname()[:2]
        self.host, self.port = h, p
        self.url = f"http://[{h}]:{p}" if ":" in h else f"http://{h}:{p}"
        self._server = _Server(_config(face, signals=False), face)
        _gate([self.sock], face)
        # uvicorn captures signals only on the main thread: a thread's server is stopped by stop()
        self._thread = threading.Thread(target=self._run, name="calconsole-serve", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self.sock])
        except BaseException as e:  # noqa: BLE001 - reported by start()/stop(), never lost
            self.error = e

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server did not start on {self.url}: {self.error!r}")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = GRACEFUL_S + 5.0) -> None:
        self.face.begin_shutdown()
        self._server.should_exit = True
        self._thread.join(timeout_s)
        with contextlib.suppress(OSError):
            self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
