"""``calconsole bench conncap``: the connection guard of ``calconsole serve`` past its connection cap and beside
a reconnecting neighbour.

``--mode cap`` (default): ``--addresses`` loopback source addresses (127.0.0.2, 127.0.0.3, ...) each keep
``--per-address`` connections open that send the start of a request head and never finish it; each one the
server closes is opened again at once. Together they are more than the server's connection cap (``--cap``;
4,096 by default, set through the child's file limit) and its reserve. While that runs the admin asks
``GET /maintenance/status`` (``Authorization: Bearer``, a new connection from 127.0.0.1 each time)
``--probes`` times: the figures are how many were answered 200 within 1 s, their P50/P95 latency (host wall
ms, connect to the end of the answer), the time the server's access log gave each inside its handler (the
rest is the wait before the request reached the app: accept queue, event loop), and the tracebacks in the
server's log.

``--mode pooled``: ``--clients`` keep-alive clients from one address (127.0.0.2) each ask ``GET /health`` every
``--poll`` s on the connection they keep, beside one client of the same address that opens a connection every
``--reconnect`` s and sends nothing on it. The figure is how many of the pooled clients' requests were
answered by an eviction (a 503 read as the reply) out of all they sent, over ``--duration`` s.

The server is a ``calconsole serve --timing-only`` child on 127.0.0.1 with an ephemeral port (its stderr in a
file: ``bench.child``), stopped at the end; the attacker of ``cap`` runs in a process of its own, so the
probes do not wait behind its event loop. A benchmark that prints figures (``--json``: one object), not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import time
from typing import Any

from ..commands.common import fail, print_json
from . import BenchParsers
from .argcheck import out_of_bounds
from .child import ServeChild, serve_child

HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
#: ``conns.ConnLimits.effective_max_conns``: the cap is the file limit less 64 descriptors and the reserve's 32
_FILES_BESIDE_CAP = 64 + 32
_IP_BIND_ADDRESS_NO_PORT = 24  # Linux: the port is picked at connect (4-tuple unique), not at bind


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("conncap", help="admin latency past the connection cap; pooled clients beside a reconnecting "
                                        "neighbour", description=(__doc__ or "").split("\n\n", 1)[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("cap", "pooled"), default="cap", help="what to measure (default cap)")
    p.add_argument("--addresses", type=int, default=220, help="cap: source addresses, 1..250 (default 220)")
    p.add_argument("--per-address", type=int, default=20, help="cap: connections per address, 1..500 (default 20)")
    p.add_argument("--cap", type=int, default=4096, help="cap: the server's connection cap, 16..4096 (default 4096)")
    p.add_argument("--files", type=int, default=None, metavar="N",
                   help="cap: the server's file limit, 112..1048576 (default: --cap + 96, the least that gives that "
                        "cap; a larger one leaves room for its closing connections, and the cap is the smaller of "
                        "4096 and N - 96)")
    p.add_argument("--probes", type=int, default=15, help="cap: admin probes, 1..1000 (default 15)")
    p.add_argument("--interval", type=float, default=0.3, metavar="S",
                   help="cap: host s between probes, 0..10 (default 0.3)")
    p.add_argument("--settle", type=float, default=5.0, metavar="S",
                   help="cap: host s the attack runs before the first probe, 0..600 (default 5)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="cap: per-probe timeout, host s, 0.5..120 (default 10)")
    p.add_argument("--clients", type=int, default=64, help="pooled: keep-alive clients, 1..500 (default 64)")
    p.add_argument("--poll", type=float, default=1.2, metavar="S",
                   help="pooled: host s between a client's requests, 0.05..60 (default 1.2)")
    p.add_argument("--reconnect", type=float, default=0.1, metavar="S",
                   help="pooled: host s between the neighbour's connections, 0.01..10 (default 0.1)")
    p.add_argument("--duration", type=float, default=30.0, metavar="S",
                   help="pooled: host s the clients poll, 1..3600 (default 30)")
    p.add_argument("--server-log", default=None, metavar="FILE", help="copy the server's stderr to FILE at the end")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


BOUNDS: dict[str, tuple[float, float]] = {
    "addresses": (1, 250), "per_address": (1, 500), "cap": (16, 4096), "probes": (1, 1000), "interval": (0, 10),
    "settle": (0, 600), "timeout": (0.5, 120), "clients": (1, 500), "poll": (0.05, 60), "reconnect": (0.01, 10),
    "duration": (1, 3600), "files": (112, 1 << 20)}
_INTS = ("addresses", "per_address", "cap", "probes", "clients", "files")


def check_args(args: argparse.Namespace) -> str | None:
    """The first argument out of its bounds (``BOUNDS``), said as an error message; None when all are in."""
    return out_of_bounds(args, BOUNDS, ints=_INTS, optional=("files",))


def _connect_from(src: str) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.setsockopt(socket.SOL_IP, _IP_BIND_ADDRESS_NO_PORT, 1)
    except OSError:
        pass  # not Linux: bind picks the port
    s.bind((src, 0))
    return s


def _raise_file_limit(need: int) -> None:
    """This process's soft file limit to at least ``need`` (up to the hard limit); OSError if it cannot be."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            raise OSError(f"the bench needs {need} open files; the hard limit is {hard} (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


# --- cap: the attacker (a process of its own) -----------------------------------------------------------


async def _attack(port: int, addresses: int, per: int, open_now: Any, stop: Any) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    counts = {"opened": 0, "closed_by_server": 0, "connect_failed": 0}
    answers: dict[str, int] = {}

    async def one(src: str) -> None:
        while True:
            s = _connect_from(src)
            try:
                await loop.sock_connect(s, ("127.0.0.1", port))
            except OSError:
                s.close()
                counts["connect_failed"] += 1
                await asyncio.sleep(0.05)  # the listen queue is full or the address is busy: do not spin
                continue
            counts["opened"] += 1
            open_now.value += 1
            try:
                await loop.sock_sendall(s, HALF_HEAD)
                first = b""
                while data := await loop.sock_recv(s, 4096):
                    first = first or data
                line = first.split(b"\r\n", 1)[0].decode("latin-1") or "(closed, no answer)"
                answers[line] = answers.get(line, 0) + 1
            except OSError:
                answers["(reset)"] = answers.get("(reset)", 0) + 1
            finally:
                s.close()
                open_now.value -= 1
            counts["closed_by_server"] += 1

    tasks = [asyncio.ensure_future(one(f"127.0.0.{2 + a}")) for a in range(addresses) for _ in range(per)]
    while not stop.is_set():
        await asyncio.sleep(0.1)  # polls the cross-process stop flag; the connections run meanwhile
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {**counts, "server_answers": answers}


def _attack_process(port: int, addresses: int, per: int, open_now: Any, stop: Any, out: Any) -> None:
    """The attacker's own process (multiprocessing target): its report to ``out`` once ``stop`` is set."""
    try:
        _raise_file_limit(addresses * per + 64)
        out.put(asyncio.run(_attack(port, addresses, per, open_now, stop)))
    except OSError as e:
        out.put({"error": f"{type(e).__name__}: {e}"})


# --- cap: the admin's probes --------------------------------------------------------------------------


def admin_probe(port: int, key: str, timeout_s: float) -> dict[str, Any]:
    """One ``GET /maintenance/status`` on a new connection: host wall ms (connect to the end of the answer), the
    status (an int, or the error's name), the local port (to find its access-log line) and a non-200's text."""
    req = (f"GET /maintenance/status HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
           f"Connection: close\r\n\r\n").encode()
    t0 = time.perf_counter()
    local = 0
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            local = s.getsockname()[1]
            s.sendall(req)
            chunks = []
            while data := s.recv(65536):
                chunks.append(data)
    except OSError as e:
        return {"ms": (time.perf_counter() - t0) * 1e3, "status": type(e).__name__, "port": local, "why": str(e)}
    ms = (time.perf_counter() - t0) * 1e3
    raw = b"".join(chunks)
    m = re.match(rb"HTTP/1\.[01] (\d{3})", raw)
    status: int | str = int(m.group(1)) if m else "no answer"
    why = None if status == 200 else raw.split(b"\r\n\r\n", 1)[-1][:200].decode("latin-1")
    return {"ms": ms, "status": status, "port": local, "why": why}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))], 1)


def handler_ms(log: str, ports: list[int]) -> list[float]:
    """The access log's wall ms of the admin's requests (matched by the probes' local ports)."""
    want = set(ports)
    out = []
    for m in re.finditer(r'127\.0\.0\.1:(\d+) "GET /maintenance/status" \d+ ([\d.]+)ms', log):
        if int(m.group(1)) in want:
            out.append(float(m.group(2)))
    return out


def measure_cap(child: ServeChild, args: argparse.Namespace) -> dict[str, Any]:
    """The ``cap`` figures (module docstring) against ``child``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    open_now, stop, results = ctx.Value("i", 0, lock=False), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_attack_process, name="conncap-attacker", daemon=True,
                       args=(child.port, args.addresses, args.per_address, open_now, stop, results))
    proc.start()
    total = args.addresses * args.per_address
    probes: list[dict[str, Any]] = []
    try:
        t0 = time.monotonic()
        while open_now.value < min(total, args.cap) and time.monotonic() - t0 < 120 and proc.is_alive():
            time.sleep(0.05)  # the attacker's process starting and opening its connections
        time.sleep(args.settle)  # a bench: the attack reaches its steady state before the probes
        held = open_now.value
        for i in range(args.probes):
            if i:
                time.sleep(args.interval)
            probes.append(admin_probe(child.port, child.admin_key, args.timeout))
        held_after = open_now.value
    finally:
        stop.set()
        try:
            atk = results.get(timeout=60)
        except Exception as e:  # noqa: BLE001 - queue.Empty or a dead attacker: said in the report
            atk = {"error": f"no report from the attacker process: {type(e).__name__}"}
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    ms = [p["ms"] for p in probes]
    statuses: dict[str, int] = {}
    whys: dict[str, int] = {}
    for p in probes:
        statuses[str(p["status"])] = statuses.get(str(p["status"]), 0) + 1
        if p["why"] is not None and (p["why"] in whys or len(whys) < 8):
            whys[f"{p['status']}: {p['why']}"] = whys.get(f"{p['status']}: {p['why']}", 0) + 1
    hms = handler_ms(child.log_text(), [p["port"] for p in probes if p["port"]])
    return {
        "mode": "cap", "cap": args.cap, "server_file_limit": args.files,
        "attack": {"addresses": args.addresses, "per_address": args.per_address, "connections": total,
                   "held_when_probing": held, "held_after_probing": held_after, **atk},
        "admin": {"probes": len(probes),
                  "ok_within_1s": sum(1 for p in probes if p["status"] == 200 and p["ms"] <= 1000),
                  "status": statuses, "p50_ms": _pct(ms, 50), "p95_ms": _pct(ms, 95),
                  "max_ms": round(max(ms), 1) if ms else None,
                  "handler_p50_ms": _pct(hms, 50), "handler_p95_ms": _pct(hms, 95), "not_ok": whys},
        "tracebacks": child.tracebacks()}


# --- pooled ---------------------------------------------------------------------------------------------


async def _read_reply(loop: asyncio.AbstractEventLoop, s: socket.socket, buf: bytearray) -> tuple[int, bool]:
    """(status, the server closes after it) of one whole response read from ``s``; EOFError if none came."""
    while b"\r\n\r\n" not in buf:
        data = await loop.sock_recv(s, 65536)
        if not data:
            raise EOFError
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    m = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    n = int(m.group(1)) if m else 0
    while len(rest) < n:
        data = await loop.sock_recv(s, 65536)
        if not data:
            raise EOFError
        rest += data
    buf[:] = rest[n:]
    closes = re.search(rb"(?im)^connection:\s*close", head) is not None
    return int(head[9:12]), closes


async def _pooled(port: int, args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    src = "127.0.0.2"
    req = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    st: dict[str, int] = {}
    counts = {"requests": 0, "evicted": 0, "retried": 0, "new_connections": 0}
    nb = {"opened": 0, "closed_by_server": 0, "connect_failed": 0}
    end = time.monotonic() + args.duration

    async def client(i: int) -> None:
        await asyncio.sleep(args.poll * i / args.clients)  # spread over one poll interval
        s: socket.socket | None = None
        buf = bytearray()
        while time.monotonic() < end:
            fresh = s is None
            if s is None:
                s = _connect_from(src)
                await loop.sock_connect(s, ("127.0.0.1", port))
                counts["new_connections"] += 1
                buf.clear()
            try:
                await loop.sock_sendall(s, req)
                status, closes = await _read_reply(loop, s, buf)
            except (EOFError, OSError):
                s.close()
                s = None
                if not fresh:  # a kept connection closed before it answered: sent again, as a pool does
                    counts["retried"] += 1
                    continue
                raise
            counts["requests"] += 1
            st[str(status)] = st.get(str(status), 0) + 1
            if status == 503:
                counts["evicted"] += 1
            if closes:
                s.close()
                s = None
            await asyncio.sleep(args.poll)
        if s is not None:
            s.close()

    async def held(s: socket.socket) -> None:
        try:
            while await loop.sock_recv(s, 4096):
                pass
            nb["closed_by_server"] += 1
        except OSError:
            nb["closed_by_server"] += 1
        finally:
            s.close()

    async def neighbour() -> None:
        tasks = []
        while time.monotonic() < end:
            s = _connect_from(src)
            try:
                await loop.sock_connect(s, ("127.0.0.1", port))
                nb["opened"] += 1
                tasks.append(asyncio.ensure_future(held(s)))
            except OSError:
                s.close()
                nb["connect_failed"] += 1
            await asyncio.sleep(args.reconnect)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    results = await asyncio.gather(neighbour(), *(client(i) for i in range(args.clients)), return_exceptions=True)
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    return {"pooled": {"clients": args.clients, "poll_s": args.poll, **counts, "status": st,
                       "failed_clients": len(errors), "errors": errors[:4]},
            "neighbour": {"every_s": args.reconnect, **nb}}


def measure_pooled(child: ServeChild, args: argparse.Namespace) -> dict[str, Any]:
    """The ``pooled`` figures (module docstring) against ``child``."""
    _raise_file_limit(args.clients + int(args.duration / args.reconnect) + 64)
    rep = asyncio.run(_pooled(child.port, args))
    return {"mode": "pooled", "duration_s": args.duration, **rep, "tracebacks": child.tracebacks()}


def _keep_log(child: ServeChild, path: str | None) -> None:
    if path is not None:
        import shutil

        shutil.copyfile(child.log_path, path)


def run(args: argparse.Namespace) -> int:
    why = check_args(args)
    if why is not None:
        return fail(why)
    load0 = os.getloadavg()[0]
    try:
        if args.mode == "cap":
            _raise_file_limit(args.addresses * args.per_address + 64)
            if args.files is None:
                args.files = args.cap + _FILES_BESIDE_CAP
            args.cap = min(args.cap, args.files - _FILES_BESIDE_CAP)  # the server's own rule
            with serve_child(nofile=args.files) as child:
                rep = measure_cap(child, args)
                _keep_log(child, args.server_log)
        else:
            with serve_child() as child:
                rep = measure_pooled(child, args)
                _keep_log(child, args.server_log)
    except (OSError, RuntimeError, ValueError) as e:
        return fail(f"{type(e).__name__}: {e}")
    rep["load_average"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    rep["clock"] = "host wall ms"
    if args.json:
        print_json(rep)
        return 0
    if rep["mode"] == "cap":
        a, r = rep["attack"], rep["admin"]
        print(f"calconsole bench conncap: {a['addresses']} addresses x {a['per_address']} reconnecting = "
              f"{a['connections']} connections, cap {rep['cap']}; {a['held_when_probing']} open when probing; "
              f"server closed {a.get('closed_by_server', '?')} of {a.get('opened', '?')} opened; load average "
              f"{rep['load_average'][0]:.2f} / {rep['load_average'][1]:.2f}")
        if "error" in a:
            print(f"  attacker: {a['error']}")
        print(f"  admin GET /maintenance/status: {r['ok_within_1s']}/{r['probes']} answered 200 within 1 s; "
              f"P50 {r['p50_ms']} ms, P95 {r['p95_ms']} ms, max {r['max_ms']} ms (host wall); in the handler P50 "
              f"{r['handler_p50_ms']} ms, P95 {r['handler_p95_ms']} ms; status {r['status']}")
        for w, n in r["not_ok"].items():
            print(f"    {n} x {w}")
    else:
        p, nb = rep["pooled"], rep["neighbour"]
        print(f"calconsole bench conncap --mode pooled: {p['clients']} keep-alive clients every {p['poll_s']:g} s "
              f"beside one opening a connection every {nb['every_s']:g} s, {rep['duration_s']:g} s; load average "
              f"{rep['load_average'][0]:.2f} / {rep['load_average'][1]:.2f}")
        print(f"  pooled requests evicted (503 as their reply): {p['evicted']}/{p['requests']}; status {p['status']}; "
              f"{p['retried']} resent after a kept connection closed; {p['new_connections']} connections")
        print(f"  neighbour: {nb['opened']} opened, {nb['closed_by_server']} closed by the server")
        for failure in p["errors"]:
            print(f"  client failed: {failure}")
    print(f"  tracebacks in the server's log: {rep['tracebacks']}")
    return 0
