"""``calconsole bench http``: HTTP keep-alive throughput on ``GET /health``, llama-server beside ``calconsole serve``.

Starts a real llama-server (llama.cpp's server from the ``xllamacpp`` wheel, the SmolLM2 GGUF of the
differential tests, one CPU thread; ``calconsole.bench.llama_server`` in a process of its own) and one
``calconsole serve --timing-only`` child per ``--http`` implementation, all on 127.0.0.1 and ephemeral
ports. Then ``--clients`` raw-socket keep-alive clients (one epoll loop in this process, one request in
flight per connection: no pipelining) ask ``GET /health`` of each server in turn, for ``--seconds`` each
after ``--warmup``, ``--rounds`` times with the servers interleaved (every server is measured once per round),
so they share the machine's state.

Per server: requests a second (median and range over the rounds), keep-alive latency p50 / p99 (host wall
ms from the request's send to the end of its answer, over every round; a connection's first request is left
out: it is not a kept-alive one), the server's CPU per request (its process's user + system CPU over the
windows, host µs), non-200 answers, and reconnects: cpp-httplib closes a kept-alive connection after 100
requests (``Connection: close`` on the 100th answer), and a client then connects again and goes on; a
request the server closed on without answering is sent again and counted as ``lost``. A benchmark that
prints figures, never a test.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from ..commands.common import fail, print_json
from . import BenchParsers
from .argcheck import out_of_bounds

REQUEST = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
#: ``--http`` implementations of ``calconsole serve`` this bench knows
IMPLS = ("h11", "httptools")
LIMITS = {"clients": (1, 512), "seconds": (0.2, 120.0), "rounds": (1, 20), "warmup": (0.0, 30.0)}
#: host seconds a child server gets to answer /health (a calconsole serve imports and builds its device)
START_S = 120.0
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close", re.IGNORECASE)


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("http", help="GET /health keep-alive req/s and latency: llama-server beside calconsole "
                                     "serve on each --http implementation",
                        description=(__doc__ or "").split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=32, metavar="N", help="keep-alive connections (1..512, default 32)")
    p.add_argument("--seconds", type=float, default=3.0, metavar="S",
                   help="host seconds measured per server and round (0.2..120, default 3)")
    p.add_argument("--warmup", type=float, default=0.5, metavar="S",
                   help="host seconds of load before each window, not counted (0..30, default 0.5)")
    p.add_argument("--rounds", type=int, default=3, metavar="N",
                   help="rounds, each measuring every server once in turn (1..20, default 3)")
    p.add_argument("--http", default=",".join(IMPLS), metavar="LIST",
                   help=f"calconsole serve --http implementations, a comma list of {', '.join(IMPLS)} "
                        f"(default both; empty: none)")
    p.add_argument("--no-llama", action="store_true", help="leave out the real llama-server")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


@dataclass
class Window:
    """What one server answered in one measured window (latencies host wall seconds)."""

    seconds: float
    ok: int = 0
    other: int = 0
    reconnects: int = 0
    lost: int = 0
    latencies: list[float] = field(default_factory=list)
    cpu_s: float | None = None

    @property
    def rps(self) -> float:
        return (self.ok + self.other) / self.seconds if self.seconds > 0 else 0.0


class _Conn:
    __slots__ = ("buf", "on_conn", "sent_at", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.sent_at = 0.0
        self.on_conn = 0  # answers read on this connection


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.setblocking(False)
    return s


def drive(port: int, clients: int, seconds: float, warmup: float, pid: int | None = None) -> Window:
    """``clients`` keep-alive connections asking ``GET /health`` of 127.0.0.1:``port`` for ``warmup`` + ``seconds``
    host s; the figures of the last ``seconds`` (``pid``: the server process whose CPU is read over them).
    OSError if the server cannot be reached."""
    ep = select.epoll()
    conns: dict[int, _Conn] = {}

    def open_one() -> _Conn:
        c = _Conn(_connect(port))
        conns[c.sock.fileno()] = c
        ep.register(c.sock.fileno(), select.EPOLLIN)
        c.sent_at = time.perf_counter()
        c.sock.send(REQUEST)
        return c

    def reopen(c: _Conn) -> None:
        ep.unregister(c.sock.fileno())
        del conns[c.sock.fileno()]
        c.sock.close()
        open_one()

    win = Window(seconds)
    try:
        for _ in range(clients):
            open_one()
        t0 = time.perf_counter()
        start, end = t0 + warmup, t0 + warmup + seconds
        counting, cpu0 = False, None
        while True:
            now = time.perf_counter()
            if not counting and now >= start:
                counting, cpu0 = True, _cpu_of(pid)
                win.ok = win.other = win.reconnects = win.lost = 0
                win.latencies.clear()
            if now >= end:
                break
            for fd, _ev in ep.poll(0.2):
                c = conns[fd]
                try:
                    data = c.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:  # closed by the server with a request unanswered: sent again on a new one
                    win.lost += 1
                    win.reconnects += 1
                    reopen(c)
                    continue
                buf = c.buf + data
                while True:
                    head_end = buf.find(b"\r\n\r\n")
                    if head_end < 0:
                        break
                    m = _CONTENT_LENGTH.search(buf, 0, head_end + 2)
                    size = head_end + 4 + (int(m.group(1)) if m else 0)
                    if len(buf) < size:
                        break
                    t = time.perf_counter()
                    if buf.startswith(b"HTTP/1.1 200 "):
                        win.ok += 1
                    else:
                        win.other += 1
                    if c.on_conn:
                        win.latencies.append(t - c.sent_at)
                    c.on_conn += 1
                    close = _CLOSE.search(buf, 0, head_end + 2) is not None
                    buf = buf[size:]
                    if close:
                        win.reconnects += 1
                        reopen(c)
                        break
                    c.sent_at = t
                    c.sock.send(REQUEST)
                if fd in conns and conns[fd] is c:
                    c.buf = buf
        cpu1 = _cpu_of(pid)
        if cpu0 is not None and cpu1 is not None:
            win.cpu_s = cpu1 - cpu0
    finally:
        for c in conns.values():
            c.sock.close()
        ep.close()
    return win


def _cpu_of(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except Exception:  # noqa: BLE001 - gone, or unreadable: reported as unknown
        return None


@dataclass
class Child:
    """A server in a child process: ``name``, its port, the process, and the file its stderr goes to."""

    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: IO[bytes]

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-600:].decode(errors="replace")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(child: Child, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if child.proc.poll() is not None:
            raise RuntimeError(f"{child.name} exited with {child.proc.returncode}: {child.tail()}")
        try:
            with socket.create_connection(("127.0.0.1", child.port), timeout=2) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                s.settimeout(2)
                if s.recv(64).startswith(b"HTTP/1.1 200 "):
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{child.name} did not answer /health within {timeout_s:.0f} s: {child.tail()}")
        time.sleep(0.2)


@contextlib.contextmanager
def children(impls: list[str], llama: bool) -> Iterator[list[Child]]:
    """The servers, healthy, in the order measured (llama-server first); all stopped on exit.
    RuntimeError naming the one that did not start."""
    started: list[Child] = []
    with tempfile.TemporaryDirectory() as d:
        env = {**os.environ, "CALCONSOLE_AUDIT_LOG": os.path.join(d, "audit.jsonl")}
        try:
            specs: list[tuple[str, list[str]]] = []
            if llama:
                specs.append(("llama-server", [sys.executable, "-m", "calconsole.bench.llama_server"]))
            for impl in impls:
                specs.append((f"calconsole {impl}", [sys.executable, "-m", "calconsole", "serve", "--timing-only",
                                                     "--pacing", "fast", "--http", impl]))
            for name, cmd in specs:
                port = _free_port()
                log = open(os.path.join(d, f"{len(started)}.log"), "w+b")  # noqa: SIM115 - closed below
                proc = subprocess.Popen(cmd + ["--port", str(port)], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=log)
                started.append(Child(name, port, proc, log))
            for child in started:
                _wait_healthy(child, START_S)
            yield started
        finally:
            for child in started:
                with contextlib.suppress(OSError):
                    if child.proc.stdin is not None:
                        child.proc.stdin.close()  # llama-server's child stops at the end of its stdin
                if child.proc.poll() is None:
                    child.proc.terminate()
            for child in started:
                try:
                    child.proc.wait(15)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait(5)
                child.log.close()


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarise(name: str, windows: list[Window]) -> dict[str, Any]:
    """One server's figures over its windows (rates per host s, latencies host wall ms, CPU host µs)."""
    rates = [w.rps for w in windows]
    lat = [x for w in windows for x in w.latencies]
    answered = sum(w.ok + w.other for w in windows)
    cpus = [w.cpu_s for w in windows]
    cpu_us = (1e6 * sum(c for c in cpus if c is not None) / answered
              if answered and all(c is not None for c in cpus) else None)
    p50, p99 = _pct(lat, 0.50), _pct(lat, 0.99)
    return {"server": name, "rps_median": round(statistics.median(rates), 1),
            "rps_rounds": [round(r, 1) for r in rates],
            "p50_ms": None if p50 is None else round(p50 * 1e3, 4),
            "p99_ms": None if p99 is None else round(p99 * 1e3, 4),
            "server_cpu_us_per_request": None if cpu_us is None else round(cpu_us, 1),
            "answers": answered, "non_200": sum(w.other for w in windows),
            "reconnects": sum(w.reconnects for w in windows), "lost": sum(w.lost for w in windows)}


def _check(args: argparse.Namespace) -> str | None:
    if (msg := out_of_bounds(args, LIMITS, ints=("clients", "rounds"))) is not None:
        return msg
    impls = [x.strip() for x in args.http.split(",") if x.strip()]
    bad = [x for x in impls if x not in IMPLS]
    if bad or len(set(impls)) != len(impls):
        return f"--http must be a comma list of distinct {', '.join(IMPLS)}, got {args.http!r}"
    if not impls and args.no_llama:
        return "nothing to measure: --http is empty and --no-llama given"
    return None


def run(args: argparse.Namespace) -> int:
    if (msg := _check(args)) is not None:
        return fail(msg)
    impls = [x.strip() for x in args.http.split(",") if x.strip()]
    try:
        with children(impls, llama=not args.no_llama) as servers:
            windows: dict[str, list[Window]] = {s.name: [] for s in servers}
            for _ in range(args.rounds):
                for s in servers:
                    windows[s.name].append(drive(s.port, args.clients, args.seconds, args.warmup, s.proc.pid))
    except (OSError, RuntimeError) as e:
        return fail(f"bench http: {e}", 1)
    rows = [summarise(name, ws) for name, ws in windows.items()]
    out = {"clients": args.clients, "seconds": args.seconds, "warmup": args.warmup, "rounds": args.rounds,
           "path": "/health", "load_average": list(os.getloadavg()), "cpus": os.cpu_count(), "servers": rows,
           "units": "rps: answers per host s; p50/p99: keep-alive latency, host wall ms (send to the answer's "
                    "end, a connection's first request left out); server CPU: host µs of the server process "
                    "per answer"}
    if args.json:
        print_json(out)
        return 0
    print(f"GET /health, {args.clients} keep-alive clients, {args.rounds} x {args.seconds:g} s per server "
          f"(interleaved), load {out['load_average'][0]:.2f} on {out['cpus']} CPUs")
    head = f"{'server':<22}{'req/s':>10}{'range':>18}{'p50 ms':>9}{'p99 ms':>9}{'cpu µs/req':>12}" \
           f"{'non-200':>9}{'reconn':>8}{'lost':>6}"
    print(head)
    for r in rows:
        rng = f"{min(r['rps_rounds']):.0f}-{max(r['rps_rounds']):.0f}"
        cpu = "-" if r["server_cpu_us_per_request"] is None else f"{r['server_cpu_us_per_request']:.0f}"
        print(f"{r['server']:<22}{r['rps_median']:>10.0f}{rng:>18}{_ms(r['p50_ms']):>9}{_ms(r['p99_ms']):>9}"
              f"{cpu:>12}{r['non_200']:>9}{r['reconnects']:>8}{r['lost']:>6}")
    return 0


def _ms(v: float | None) -> str:
    """A latency cell (wall ms, 3 decimals) or "-" when none was measured."""
    return "-" if v is None else f"{v:.3f}"
