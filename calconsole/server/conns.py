"""Connection limits of the serving face: what one peer address may hold open, and room idle connections cannot take.

uvicorn's ``limit_concurrency`` counts every open connection, also those that never finish their
request head; past it every request gets a plain-text 503, so ~90 half-open connections (slowloris)
shut everyone out, the admin included. Here connections are told apart by what they do:

- **idle**: no request in progress: the head has not arrived yet, or the connection is kept alive
  between requests. Idle connections have their own budget, per peer address
  (``max_idle_per_peer``) and in total (``max_idle``). A new connection past either budget makes
  room by closing the connection that has been idle the longest (with a 503 JSON answer), but
  only among those idle for at least ``min_idle_s``: a client that sends its head at once (all
  real ones) is never closed for being new, however fast an attacker reconnects. Nor is one whose
  peer's bytes wait unread in the kernel (``FIONREAD``): when the loop is late, a head can sit there
  past ``min_idle_s`` after the accept, and that client asked in time. Nor one kept alive after a
  response (a client's pool: it counts toward the budget, and is closed by uvicorn's keep-alive
  timeout, or at a hard bound after every never-served one). Closing for a budget is paced:
  at most ``budget_closes_per_s`` a second for one address and as many for the total (a token bucket
  each, ``budget_close_burst`` deep). Every close of a reconnecting attacker's connection costs an
  accept, a protocol and a 503 for its next one (~0.5 ms of CPU); unpaced, each admit closed every
  connection past the budget idle >= ``min_idle_s``, and on a starved loop (load ~20 on 2 cores) every
  connection was that old by the next admit: ~100 closes a second, the server's whole share of the
  CPU, and /health waited behind the reconnects (``calconsole bench slowloris``: admin P95 1-2.7 s).
  Past its budget a connection is still closed by the head deadline, and the hard bounds below are
  never paced.
- **open**: a hard bound on all connections of one peer (``max_conns_per_peer``) and in total
  (``max_conns``, below the process's file limit). A connection past it, when no idle one can make
  room, is answered 503 in llama-server's JSON shape and closed at once (its descriptor freed).
- **reserve**: past ``max_conns``, ``reserve_conns`` more connections are admitted for ``/health`` and
  ``/maintenance/*`` only (any other request on one is answered 503); when the reserve is full, a new
  connection takes the place of its connection idle the longest, except one that showed an admin key.
  Over the cap (220 addresses x 20 reconnecting past 4,096), the admin's status requests got no answer
  within 1 s without it.
- **requests in progress** (``RequestBound``, an ASGI wrapper): at most ``max_active``; one more
  is answered 503 JSON. Idle connections never count here, so they cannot take this capacity;
  ``/health`` and ``/maintenance/*`` have ``reserve`` places of their own beyond it, so the
  operator can still look and act while ordinary routes are full.

``RequestBound`` also refuses a request that carries both ``Content-Length`` and
``Transfer-Encoding`` (RFC 9112 §6.1: a server may reject it, and must not trust the length; a
proxy in front that reads the other header would see a different request: smuggling) with 400,
and closes that connection.

All of this runs on the event loop thread only (protocol callbacks): no locks.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import resource
import socket
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.h11_impl import H11Protocol

try:  # the C parser (llhttp) of uvicorn's fast path; optional: h11 serves without it
    import httptools
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    HAVE_HTTPTOOLS = True
except ImportError:  # pragma: no cover - httptools is a dependency
    HttpToolsProtocol = H11Protocol  # type: ignore[misc,assignment]
    HAVE_HTTPTOOLS = False

from .wire import HTTPError

log = logging.getLogger("calconsole.serve")

try:  # unread bytes of a socket (GuardedConn.unread_bytes); POSIX only
    import fcntl
    import termios

    _FIONREAD: int | None = termios.FIONREAD
    #: the socket's send queue (Linux SIOCOUTQ is TIOCOUTQ); GuardedConn.unsent_bytes
    _OUTQ: int | None = getattr(termios, "TIOCOUTQ", None)
except ImportError:  # pragma: no cover - not POSIX
    _FIONREAD = _OUTQ = None

if TYPE_CHECKING:  # the mixin calls the protocol's methods through super()
    _ProtocolBase = H11Protocol
else:
    _ProtocolBase = object

#: the listening socket's queue of connections not accepted yet (uvicorn's default; with 128, reconnects past
#: the connection cap filled it and an admin's SYN was dropped, retried after 1 s)
LISTEN_BACKLOG = 2048
#: connections asyncio accepts in one pass of the event loop (it takes uvicorn's backlog, 2048, for this too)
ACCEPTS_PER_PASS = 32

#: the scope entry that holds a request's connection (``GuardedConn``), for ``conn_of``
SCOPE_KEY = "calconsole.conn"


def conn_of(scope: Mapping[str, Any]) -> GuardedConn | None:
    """The guarded connection a request came on (None when served by another protocol: no deadlines then)."""
    c = scope.get(SCOPE_KEY)
    return c if isinstance(c, GuardedConn) else None


def error_bytes(status: int, type_: str, message: str, reason: str) -> bytes:
    """A whole HTTP/1.1 response with llama-server's JSON error body and ``Connection: close``."""
    body = json.dumps(HTTPError(status, type_, message).body(), separators=(",", ":")).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("ascii")
    return head + body


def _file_limit() -> int:
    try:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1024
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass
class ConnLimits:
    """The bounds (counts of TCP connections; ``min_idle_s`` host seconds). See the module docstring."""

    max_idle_per_peer: int = 32
    max_idle: int = 256
    max_conns_per_peer: int = 512
    max_conns: int = 4096
    min_idle_s: float = 1.0
    #: closes for an idle budget, per address and for the total: a rate (per host s) and a bucket depth
    budget_closes_per_s: float = 8.0
    budget_close_burst: int = 8
    #: connections beyond ``max_conns`` for ``/health`` and ``/maintenance/*`` only (the operator's share)
    reserve_conns: int = 32
    #: at the cap, newcomers admitted by closing an idle connection (per host s, and the bucket's depth); the
    #: others are refused at accept (``ListenGate``) unless their first bytes show an admin key
    cap_admits_per_s: float = 64.0
    cap_admit_burst: int = 16

    def check(self) -> None:
        """ValueError naming the bound that no server should run with."""
        for name in ("max_idle_per_peer", "max_idle", "max_conns_per_peer", "max_conns"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
                raise ValueError(f"{name} must be an integer in [1, {1 << 20}], got {v!r}")
        if self.max_idle_per_peer > self.max_conns_per_peer or self.max_idle > self.max_conns:
            raise ValueError("an idle budget must not exceed the bound on open connections it is part of")
        if not 0.0 <= self.min_idle_s <= 60.0:
            raise ValueError(f"min_idle_s must be in [0, 60], got {self.min_idle_s}")
        if not 0.0 < self.budget_closes_per_s <= 1e6:
            raise ValueError(f"budget_closes_per_s must be in (0, 1e6], got {self.budget_closes_per_s}")
        r = self.reserve_conns
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r <= 4096:
            raise ValueError(f"reserve_conns must be an integer in [0, 4096], got {r!r}")
        for bname in ("budget_close_burst", "cap_admit_burst"):
            b = getattr(self, bname)
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 1 << 20:
                raise ValueError(f"{bname} must be an integer in [1, {1 << 20}], got {b!r}")
        if not 0.0 < self.cap_admits_per_s <= 1e6:
            raise ValueError(f"cap_admits_per_s must be in (0, 1e6], got {self.cap_admits_per_s}")

    def effective_max_conns(self) -> int:
        """``max_conns``, lowered to leave 64 descriptors of the process's file limit for files and threads,
        and the reserve's."""
        return max(16, min(self.max_conns, _file_limit() - 64 - self.reserve_conns))


@dataclass
class ConnStats:
    """What the guard did (read by tests and ``/maintenance/status``)."""

    open: int = 0
    evicted_idle: int = 0
    refused: int = 0
    #: times an idle-looking connection was not closed because its peer's bytes waited unread (loop late)
    spared_unread: int = 0
    #: times a connection past an idle budget was left open because that budget's closes were used up
    paced: int = 0
    #: answer-and-close on a connection whose peer was already gone (ENOTCONN / EPIPE / reset): closed quietly
    peer_gone: int = 0
    #: connections admitted into the reserve beyond ``max_conns``, and reserve ones closed for a newer one
    reserved: int = 0
    reserve_evicted: int = 0
    #: connections cut because a piece of their reply was not taken within the send deadline (``ReplyGuard``)
    send_deadline: int = 0
    #: requests for a heavy reply answered 503: every heavy-reply place (or this address's share) was taken
    heavy_refused: int = 0
    #: connections refused at accept past the cap (``ListenGate``: no protocol made), and admitted there for
    #: an admin key in their first bytes
    refused_at_accept: int = 0
    admin_at_accept: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


_RESERVE_FULL = error_bytes(503, "unavailable_error", "connection closed: the server is at its connection cap and "
                           "its reserve is full", "Service Unavailable")


_AT_CAP = error_bytes(503, "unavailable_error", "server busy: at its connection cap", "Service Unavailable")
#: bytes of a new connection's first data looked at by ``ConnectionGuard.gate`` (an admin's head fits)
PEEK_BYTES = 4096


def admin_key_of(head: bytes) -> str | None:
    """The key a raw request head shows: its ``Authorization: Bearer`` token, else its ``X-Api-Key`` (as
    ``KeyCheck`` reads them), or None. Only the lines before the head's end (or the bytes so far) are read."""
    bearer = api_key = None
    for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            continue
        n = name.strip().lower()
        if n == b"authorization" and bearer is None:
            scheme, _, tok = value.strip().partition(b" ")
            if scheme.lower() == b"bearer":
                bearer = tok.strip().decode("latin-1")
        elif n == b"x-api-key" and api_key is None:
            api_key = value.strip().decode("latin-1")
    return bearer or api_key or None


class ConnectionGuard:
    """The registry of open connections by peer address, and the limits above. Event loop thread only.

    ``admin_match(key)``: the admin key ring's ``match`` (a label or None), for ``gate``; None: no admin keys.
    """

    def __init__(self, limits: ConnLimits | None = None,
                 admin_match: Callable[[str], str | None] | None = None) -> None:
        self.admin_match = admin_match
        #: the cap's admit bucket (``gate``): tokens and the host monotonic s of its fill
        self._cap_bucket: tuple[float, float] | None = None
        #: host monotonic s of the connections ``gate`` let through that ``admit`` has not seen yet (asyncio
        #: makes their protocol a pass or two later): they hold descriptors the registry does not count yet
        self._pending: collections.deque[float] = collections.deque()
        #: connections closing with a linger (``GuardedConn.close_with``): descriptors the registry no longer
        #: counts, held up to ``linger_s``; at most ``max_lingering`` at once, the next ones close at once
        self.lingering = 0
        self.limits = limits or ConnLimits()
        self.limits.check()
        self.max_conns = self.limits.effective_max_conns()
        self._by_peer: dict[str, dict[GuardedConn, None]] = {}
        self._total = 0
        self.stats = ConnStats()
        #: token buckets of budget closes: address (None: the total) -> (tokens, host monotonic s of the fill)
        self._buckets: dict[str | None, tuple[float, float]] = {}
        #: connections admitted past ``max_conns`` (``_into_reserve``)
        self._reserve: dict[GuardedConn, None] = {}
        #: the idle connections (not closing), in the order they became idle (oldest first), all and by
        #: address: an admit finds its candidates without looking at every connection (4,096 at the cap)
        self._idle_all: dict[GuardedConn, None] = {}
        self._idle_by_peer: dict[str, dict[GuardedConn, None]] = {}

    # --- what protocols call -----------------------------------------------------------------

    def admit(self, conn: GuardedConn) -> bool:
        """Register a new connection, making room or refusing it (then it is answered and closed: False)."""
        lim, now = self.limits, time.monotonic()
        if self._pending:
            self._pending.popleft()
        peers = self._by_peer.get(conn.peer) or {}
        if len(peers) >= lim.max_conns_per_peer and not self._evict_one(
                self._idle_by_peer.get(conn.peer, {}), now, "open connections of this address"):
            self._refuse(conn, f"too many open connections from {conn.peer} (limit {lim.max_conns_per_peer})")
            return False
        if self._total - len(self._reserve) >= self.max_conns and not self._evict_one(
                self._idle_all, now, "open connections", ordinary=True):
            if not self._into_reserve(conn):
                self._refuse(conn, f"too many open connections (limit {self.max_conns})")
                return False
        peers[conn] = None
        self._by_peer[conn.peer] = peers
        self._total += 1
        self.stats.open = self._total
        self._trim(self._idle_by_peer.get(conn.peer, {}), lim.max_idle_per_peer, now,
                   "idle connections of this address", key=conn.peer)
        if self._total > lim.max_idle:
            self._trim(self._idle_all, lim.max_idle, now, "idle connections", key=None)
        self.set_idle(conn, True)  # after the trims: a newcomer is never closed for its own admit
        return True

    def set_idle(self, conn: GuardedConn, idle: bool) -> None:
        """``conn`` became idle (at its start, after each response) or not (a head arrived, it is closing)."""
        self._idle_all.pop(conn, None)
        mine = self._idle_by_peer.get(conn.peer)
        if mine is not None:
            mine.pop(conn, None)
        if idle and not conn.closing and conn in self._by_peer.get(conn.peer, ()):
            self._idle_all[conn] = None
            self._idle_by_peer.setdefault(conn.peer, {})[conn] = None
        elif mine is not None and not mine:
            del self._idle_by_peer[conn.peer]

    def _into_reserve(self, conn: GuardedConn) -> bool:
        """Past ``max_conns``: a place in the reserve (``/health`` and ``/maintenance/*`` only, checked by
        ``RequestBound`` when the head arrives), freed if need be by closing the reserve connection idle the
        longest that showed no admin key (never one whose bytes wait unread). False: none to be had."""
        if len(self._reserve) >= self.limits.reserve_conns:
            idle = sorted((c for c in self._reserve if c.idle_since is not None and not c.closing
                           and not c.admin), key=lambda c: c.idle_since or 0.0)
            victim = next((c for c in idle if self._evictable(c)), None)
            if victim is None:
                return False
            self.stats.reserve_evicted += 1
            victim.close_with(_RESERVE_FULL, linger=False)  # _evictable: nothing unread
            self.forget(victim)
        conn.reserved = True
        self._reserve[conn] = None
        self.stats.reserved += 1
        return True

    def forget(self, conn: GuardedConn) -> None:
        self._reserve.pop(conn, None)
        self._idle_all.pop(conn, None)
        mine = self._idle_by_peer.get(conn.peer)
        if mine is not None:
            mine.pop(conn, None)
            if not mine:
                del self._idle_by_peer[conn.peer]
        peers = self._by_peer.get(conn.peer)
        if peers is not None and conn in peers:
            del peers[conn]
            self._total -= 1
            self.stats.open = self._total
            if not peers:
                del self._by_peer[conn.peer]
                self._buckets.pop(conn.peer, None)  # a full bucket is the same as none

    #: host s after which a connection ``gate`` let through is no longer counted as pending (one whose
    #: protocol was never made, its transport failing, must not lower the cap for good)
    pending_s = 1.0
    max_lingering = 32

    def at_cap(self) -> bool:
        """Whether a newcomer can be admitted only by closing a connection (or into the reserve): the registry
        and the connections accepted but not registered yet (``gate``)."""
        p, old = self._pending, time.monotonic() - self.pending_s
        while p and p[0] < old:
            p.popleft()
        return self._total - len(self._reserve) + len(p) + self.lingering >= self.max_conns

    def gate(self, sock: socket.socket) -> bool:
        """At accept, before asyncio makes a transport and a protocol for ``sock`` (``ListenGate``): True to
        serve it; False when it was refused (503 written, closed).

        Below the cap every connection is served. At it, a newcomer is served only while the cap's admit
        bucket (``cap_admits_per_s``, ``cap_admit_burst`` deep) has a token, or when the bytes it already
        sent show an admin key (peeked, not read). Every other one is refused here for a few syscalls: made
        into a protocol it cost ~0.5 ms of the loop (transport, h11 state, admit, a close for its place),
        every evicted reconnect came back at once, and the admin's connection waited 0.1-0.8 s in the
        accept queue behind them and as long again in the loop's passes.
        """
        now = time.monotonic()
        if not self.at_cap():
            self._pending.append(now)
            return True
        lim = self.limits
        tokens, at = self._cap_bucket or (float(lim.cap_admit_burst), now)
        tokens = min(float(lim.cap_admit_burst), tokens + (now - at) * lim.cap_admits_per_s)
        if tokens >= 1.0:
            self._cap_bucket = (tokens - 1.0, now)
            self._pending.append(now)
            return True
        self._cap_bucket = (tokens, now)
        try:
            first = sock.recv(PEEK_BYTES, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except OSError:
            first = b""
        if first and self.admin_match is not None:
            key = admin_key_of(first)
            if key is not None and self.admin_match(key) is not None:
                self.stats.admin_at_accept += 1
                self._pending.append(now)
                return True
        self.stats.refused_at_accept += 1
        try:  # read first: closing with unread input would reset, destroying the answer before it is read
            sock.recv(len(first), socket.MSG_DONTWAIT)
            sock.send(_AT_CAP, socket.MSG_DONTWAIT)
        except OSError:
            pass  # gone already, or its buffer full: closed all the same
        sock.close()
        return False

    def count(self, peer: str | None = None) -> int:
        """Open connections (of ``peer``, or all)."""
        return self._total if peer is None else len(self._by_peer.get(peer, ()))

    # --- internals ---------------------------------------------------------------------------

    def _all(self) -> Iterable[GuardedConn]:
        for peers in self._by_peer.values():
            yield from peers

    def _ready(self, idle: dict[GuardedConn, None], now: float, limit: int, *, kept_alive: bool = True,
               ordinary: bool = False) -> list[GuardedConn]:
        """The first ``limit`` of ``idle`` (an ordered idle registry) idle for at least ``min_idle_s``: never
        served first, then (``kept_alive``) those kept alive, oldest first in each; ``ordinary``: none of the
        reserve. Candidates (see ``_evictable``), taken in order without looking past the first too young."""
        out: list[GuardedConn] = []
        for served in ((False, True) if kept_alive else (False,)):
            for c in idle:
                if len(out) >= limit:
                    return out
                if now - (c.idle_since or now) < self.limits.min_idle_s:
                    break  # the rest became idle later still
                if bool(c.served) == served and not c.closing and not (ordinary and c.reserved):
                    out.append(c)
        return out

    def _evictable(self, c: GuardedConn) -> bool:
        """Not when bytes the peer sent wait unread in the socket: the loop is late, not the peer.

        Under load (a starved event loop, an iteration that accepts a hundred reconnects) a client's
        head can wait in the kernel for more than ``min_idle_s`` after its accept; it is not idle,
        and closing it answered a real client 503 while it had asked in time. Checked only for the
        connections about to be closed (one ioctl each), not for every idle one at every admit.
        """
        if c.unread_bytes() > 0:
            self.stats.spared_unread += 1
            return False
        return True

    def _tokens(self, key: str | None, now: float) -> float:
        """Budget closes ``key`` (an address, None: the total) may make now (its bucket, refilled to ``now``)."""
        lim = self.limits
        tokens, at = self._buckets.get(key, (float(lim.budget_close_burst), now))
        return min(float(lim.budget_close_burst), tokens + (now - at) * lim.budget_closes_per_s)

    def _trim(self, idle: dict[GuardedConn, None], budget: int, now: float, what: str,
              key: str | None) -> None:
        # a kept-alive connection is a client's pool: closing it for a budget made its next request (sent as
        # the close crossed it) read the 503 (2 of 1,301 of 64 pooled pollers beside one reconnecting). It
        # counts toward the budget but is closed only by uvicorn's keep-alive timeout or at a hard bound.
        over = len(idle) + 1 - budget  # + the newcomer (not registered as idle yet), idle until its head arrives
        if over <= 0:
            return
        tokens = self._tokens(key, now)
        # + room for ones spared (unread bytes)
        for c in self._ready(idle, now, int(min(over, tokens)) + 8, kept_alive=False):
            if over <= 0:
                break
            if tokens < 1.0:
                self.stats.paced += 1  # left open: closed later, or by its head deadline
                break
            if self._evictable(c):
                self._evict(c, what, budget)
                over -= 1
                tokens -= 1.0
        self._buckets[key] = (tokens, now)

    def _evict_one(self, idle: dict[GuardedConn, None], now: float, what: str, *,
                   ordinary: bool = False) -> bool:
        for c in self._ready(idle, now, 8, ordinary=ordinary):
            if self._evictable(c):
                self._evict(c, what, None)
                return True
        return False

    def _evict(self, c: GuardedConn, what: str, budget: int | None) -> None:
        """Close ``c`` (checked ``_evictable``: nothing unread) for ``what``; ``budget`` None: a hard bound,
        closed at once (``close_with(linger=False)``), else a paced budget close that lingers."""
        self.stats.evicted_idle += 1
        self.stats.by_reason[what] = self.stats.by_reason.get(what, 0) + 1
        lim = f" (budget {budget})" if budget is not None else ""
        c.close_with(error_bytes(503, "unavailable_error", f"connection closed: it sent no request for "
                                 f"{time.monotonic() - (c.idle_since or 0):.1f} s while {what} are over their "
                                 f"limit{lim}", "Service Unavailable"), linger=budget is not None)
        self.forget(c)

    def _refuse(self, conn: GuardedConn, message: str) -> None:
        self.stats.refused += 1
        self.stats.by_reason[message.split(" from ")[0]] = self.stats.by_reason.get(message.split(" from ")[0], 0) + 1
        # lingers only when the peer's bytes already wait: a reset would destroy the answer before it is read
        conn.close_with(error_bytes(503, "unavailable_error", message, "Service Unavailable"),
                        linger=conn.unread_bytes() > 0)


class GuardedConn(_ProtocolBase):
    """The guard's side of a uvicorn HTTP protocol (mixed in before ``H11Protocol`` or ``HttpToolsProtocol``),
    registered with a ``ConnectionGuard`` (class attribute ``guard``).

    ``idle_since`` (host monotonic s) is set while no request is in progress: from the connection's
    start and from the end of each response until the next request head arrives. Malformed heads get
    a 400 in llama-server's JSON shape instead of uvicorn's plain text.
    """

    guard: ConnectionGuard | None = None
    idle_since: float | None = None
    closing = False
    peer = "?"
    #: responses completed on this connection (> 0: kept alive by a client's pool)
    served = 0
    #: admitted into the reserve past ``max_conns``; ``admin``: one of its requests showed an admin key
    reserved = False
    admin = False

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self.idle_since = time.monotonic()
        self.peer = self.client[0] if self.client else "?"
        if self.guard is not None:
            self.guard.admit(self)  # refused: answered and closing already

    def unread_bytes(self) -> int:
        """Bytes the peer sent that wait in the kernel's receive buffer, not yet read by the loop (0 if unknown).

        ``FIONREAD`` (``SIOCINQ`` on Linux) on the connection's socket; 0 where the platform or the
        transport does not say (then the connection is judged by ``idle_since`` alone, as before).
        """
        if _FIONREAD is None:
            return 0
        t = getattr(self, "transport", None)
        sock = t.get_extra_info("socket") if t is not None else None
        if sock is None:
            return 0
        try:
            buf = fcntl.ioctl(sock.fileno(), _FIONREAD, b"\0\0\0\0")
        except (OSError, ValueError):
            return 0
        return int(struct.unpack("i", buf)[0])

    _lingers = False

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard is not None:
            if self._lingers:
                self._lingers = False
                self.guard.lingering -= 1
            self.guard.forget(self)
        super().connection_lost(exc)

    def _head_arrived(self) -> None:
        """Called by the protocol after parsing: a request head arrived when its cycle is not answered yet."""
        if self.cycle is not None and not self.cycle.response_complete:
            if self.idle_since is not None and self.guard is not None:
                self.guard.set_idle(self, False)
            self.idle_since = None  # a request head arrived: in progress until on_response_complete
            # the app's task has not run yet: it finds its connection in its scope (``conn_of``)
            self.cycle.scope[SCOPE_KEY] = self  # type: ignore[literal-required]

    def unsent_bytes(self) -> int:
        """Bytes of replies the peer has not taken yet: the transport's write buffer plus the socket's
        send queue (``SIOCOUTQ``: not yet acknowledged by the peer's kernel; 0 where the platform does not
        say). A reader that reads keeps it near 0; one that stopped reading keeps it from shrinking."""
        t = getattr(self, "transport", None)
        if t is None or t.is_closing():
            return 0
        n = int(t.get_write_buffer_size())
        sock = t.get_extra_info("socket")
        if _OUTQ is not None and sock is not None:
            try:
                n += int(struct.unpack("i", fcntl.ioctl(sock.fileno(), _OUTQ, b"\0\0\0\0"))[0])
            except (OSError, ValueError):
                pass
        return n

    def cut(self, reason: str) -> None:
        """Close at once (a reset, no answer: the peer is not reading), for ``reason``: counted in
        ``ConnStats.by_reason``."""
        self.closing = True
        if self.guard is not None:
            self.guard.stats.by_reason[reason] = self.guard.stats.by_reason.get(reason, 0) + 1
        if not self.transport.is_closing():
            self.transport.abort()

    def on_response_complete(self) -> None:
        self.idle_since = time.monotonic()
        self.served += 1
        if self.guard is not None:
            self.guard.set_idle(self, True)
        super().on_response_complete()
        self._head_arrived()  # a pipelined request may have started from the response's end

    #: after an answer-and-close, how long the peer may take to close its side (host s)
    linger_s = 2.0

    def close_with(self, data: bytes, *, linger: bool = True) -> None:
        """Answer ``data`` (a whole response) and close, whatever h11's state is (no request may have come).

        ``linger``: a lingering close: our side ends with FIN and what the peer still sends is read and
        dropped until it closes (at most ``linger_s``). Closing a socket with unread input sends a reset,
        which destroys the answer in the peer's buffer before it reads it. Without it (the guard's closes
        at a hard bound, of a socket with nothing unread) the socket is closed at once after the answer:
        its descriptor is free now, not up to ``linger_s`` later, and no timer is armed. Past the cap every
        reconnect costs such a close, and lingering ones held descriptors the cap does not count.

        A peer that is already gone (the socket reset or never connected: ``write_eof`` raises ENOTCONN,
        EPIPE or ECONNRESET, as seen over the connection cap) is not an error of the server: the transport
        is aborted and the guard counts it in ``ConnStats.peer_gone``; nothing is logged.
        """
        self.closing = True
        if self.guard is not None and self.idle_since is not None:
            self.guard.set_idle(self, False)
        t = self.transport
        if t.is_closing():
            return
        g = self.guard
        if linger and g is not None and g.lingering >= g.max_lingering:
            linger = False  # descriptors first: a burst of lingering closes ran the process out of them
        try:
            t.write(data)
            if linger and t.can_write_eof():
                t.write_eof()
                self.loop.call_later(self.linger_s, t.close)
                if g is not None:
                    g.lingering += 1
                    self._lingers = True
            else:
                t.close()
        except OSError:  # the peer left before our answer: nothing to tell it
            if self.guard is not None:
                self.guard.stats.peer_gone += 1
            t.abort()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return  # answered and closing: the rest of what the peer sends is dropped
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        self.close_with(error_bytes(400, "invalid_request_error", f"invalid HTTP request: {msg}", "Bad Request"))


class GuardedH11Protocol(GuardedConn, H11Protocol):
    """uvicorn's h11 protocol with the guard (``GuardedConn``); its head size bound is h11's own
    (``h11_max_incomplete_event_size``)."""

    def handle_events(self) -> None:
        super().handle_events()
        self._head_arrived()


class GuardedHttpToolsProtocol(GuardedConn, HttpToolsProtocol):  # type: ignore[misc]
    """uvicorn's httptools (llhttp, C) protocol with the guard (``GuardedConn``).

    llhttp puts no bound on a request head, so one is kept here as h11 keeps it: more than
    ``max_head_bytes`` received while no head is complete is answered 400 (as h11's
    ``h11_max_incomplete_event_size``) and the connection closed.
    """

    max_head_bytes = 64 * 1024
    _head_bytes = 0

    def data_received(self, data: bytes) -> None:
        # uvicorn's own, but a 400 says llhttp's reason (e.g. both Content-Length and Transfer-Encoding)
        if self.closing:
            return
        waiting = self.idle_since is not None  # no head complete yet: these bytes are (part of) one
        if waiting:
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.send_400_response(str(e) or "invalid HTTP request")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()  # type: ignore[call-arg]
            else:
                self._unsupported_upgrade_warning()
        if self.idle_since is not None and waiting and self._head_bytes > self.max_head_bytes \
                and not self.closing:
            self.send_400_response(f"request head larger than {self.max_head_bytes} bytes")

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._head_bytes = 0
        self._head_arrived()


class ListenGate(socket.socket):
    """A listening socket whose ``accept`` lets its ``guard`` (``ConnectionGuard.gate``) refuse a connection
    before asyncio makes anything of it. Pure-Python event loops only: uvloop accepts in C and never calls it.

    At most ``refusals_per_accept`` are refused in one call; then it raises ``BlockingIOError``, which ends
    the loop's accepting for this pass (the listening socket stays readable: the rest waits a pass), so a
    reconnecting crowd cannot keep the loop in ``accept``.
    """

    guard: ConnectionGuard | None = None
    refusals_per_accept = 64

    def listen(self, backlog: int = 128, /) -> None:
        """``listen``, with Linux's ``TCP_DEFER_ACCEPT`` (1 s): a connection is handed to ``accept`` once its
        first bytes came (or that long after, if none come), so the gate sees what it sent: an admin's head
        a moment behind its connect was refused as empty."""
        opt = getattr(socket, "TCP_DEFER_ACCEPT", None)
        if opt is not None:
            try:
                self.setsockopt(socket.IPPROTO_TCP, opt, 1)
            except OSError:
                pass  # not supported here: the gate sees fewer first bytes
        super().listen(backlog)

    def accept(self) -> tuple[socket.socket, Any]:
        for _ in range(self.refusals_per_accept):
            conn, addr = super().accept()
            g = self.guard
            if g is None or g.gate(conn):
                return conn, addr
        raise BlockingIOError(errno.EAGAIN, "connections refused at the cap: the rest waits a pass")
