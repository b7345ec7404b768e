"""``calconsole bench slowloris``: /health latency while many half-open connections are held or reconnected.

An attacker opens ``--connections`` TCP connections to the server, sends the start of a request head
(``GET /health HTTP/1.1`` and one header line without its end) and never finishes it. In
``--mode reconnect`` (default) every connection the server closes is opened again at once; in
``hold`` it is not. While that runs, a normal client (a new connection per probe, no key) and the
admin (``Authorization: Bearer <admin key>``) each ask ``GET /health`` ``--probes`` times, taking
turns; the figure is their latency (host wall ms, connect to the end of the answer) and the status they got.

Without ``--url`` the server is ``calconsole serve --timing-only`` in a child process on
127.0.0.1 (an admin key in a temporary 0600 file), so the attacker and the clients here do not
share the server's interpreter; it is stopped at the end. The attacker runs in a process of its
own too: on one event loop with the probes, a loaded host let a probe's head leave more than a
second after its connect (the loop busy reconnecting), and the server rightly closed it as idle.
Each non-200 answer's message is kept (the first few of each). A benchmark that prints figures,
not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

from ..commands.common import fail, print_json
from . import BenchParsers
from .child import serve_child

HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("slowloris", help="/health latency while half-open connections are held or reconnected",
                        description=(__doc__ or "").split("\n\n", 1)[1])
    p.add_argument("--url", default=None, help="a running server (default: a child calconsole serve)")
    p.add_argument("--admin-key-file", default=None, metavar="FILE", help="admin key of --url (first key)")
    p.add_argument("--connections", type=int, default=200, help="half-open connections (default 200)")
    p.add_argument("--mode", choices=("reconnect", "hold"), default="reconnect",
                   help="reopen every connection the server closes (default) or not")
    p.add_argument("--probes", type=int, default=20, help="/health probes per client (default 20)")
    p.add_argument("--settle", type=float, default=3.0, metavar="S",
                   help="host seconds the attack runs before the first probe (default 3)")
    p.add_argument("--timeout", type=float, default=15.0, metavar="S", help="per-probe timeout, host s (15)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


@contextlib.contextmanager
def child_server() -> Iterator[tuple[str, str]]:
    """(url, admin key) of a ``calconsole serve --timing-only`` child on 127.0.0.1, stopped on exit (its stderr
    drained into a file: ``child.serve_child``)."""
    with serve_child() as c:
        yield c.url, c.admin_key


class Attack:
    """``n`` half-open connections to ``host:port``; counts opens and closes by the server."""

    def __init__(self, host: str, port: int, n: int, reconnect: bool, open_now: Any = None) -> None:
        self.host, self.port, self.n, self.reconnect = host, port, n, reconnect
        self.opened = self.closed_by_server = self.refused = 0
        self.open_now = 0
        #: a multiprocessing.Value the prober reads (connections open now), or None
        self.shared_open = open_now
        self.answers: dict[str, int] = {}
        self.stop = asyncio.Event()

    def _count(self, d: int) -> None:
        self.open_now += d
        if self.shared_open is not None:
            self.shared_open.value = self.open_now

    async def _one(self) -> None:
        while not self.stop.is_set():
            try:
                r, w = await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.refused += 1
                await asyncio.sleep(0.01)  # the listen queue is full: do not spin
                continue
            self.opened += 1
            self._count(1)
            try:
                w.write(HALF_HEAD)
                stop = asyncio.ensure_future(self.stop.wait())
                read = asyncio.ensure_future(r.read(4096))
                await asyncio.wait({stop, read}, return_when=asyncio.FIRST_COMPLETED)
                if read.done() and not read.cancelled() and read.exception() is None:
                    first = read.result().split(b"\r\n", 1)[0].decode("latin-1")
                    self.answers[first or "(closed, no answer)"] = self.answers.get(first or "(closed, no answer)",
                                                                                     0) + 1
                    self.closed_by_server += 1
                for t in (stop, read):
                    t.cancel()
            except OSError:
                self.closed_by_server += 1
            finally:
                self._count(-1)
                w.close()
            if not self.reconnect:
                await self.stop.wait()

    async def run(self) -> None:
        await asyncio.gather(*(self._one() for _ in range(self.n)))

    def report(self) -> dict[str, Any]:
        return {"opened": self.opened, "closed_by_server": self.closed_by_server, "connect_failed": self.refused,
                "server_answers": self.answers}


def _attack_process(host: str, port: int, n: int, reconnect: bool, open_now: Any, stop: Any, out: Any) -> None:
    """The attacker's own process (multiprocessing target): ``Attack`` until ``stop`` is set, its report to ``out``."""

    async def main() -> dict[str, Any]:
        atk = Attack(host, port, n, reconnect, open_now)
        task = asyncio.ensure_future(atk.run())
        while not stop.is_set():
            await asyncio.sleep(0.1)  # polls the cross-process stop flag; the attack runs meanwhile
        atk.stop.set()
        await task
        return atk.report()

    out.put(asyncio.run(main()))


async def _probe(c: Any, headers: dict[str, str]) -> tuple[float, int | str, str | None]:
    """(host wall ms, status or error name, the error message of a non-200 answer) of one GET /health.

    ``c`` keeps no connection alive: each probe connects anew, as a client arriving during the attack.
    """
    import httpx

    t0 = time.perf_counter()
    why: str | None = None
    try:
        r = await c.get("/health", headers=headers)
        status: int | str = r.status_code
        if r.status_code != 200:
            try:
                err = r.json().get("error")
                why = str(err.get("message")) if isinstance(err, dict) else r.text[:200]
            except ValueError:
                why = r.text[:200]
    except httpx.HTTPError as e:
        status, why = type(e).__name__, str(e)[:200]
    return (time.perf_counter() - t0) * 1e3, status, why


async def measure(url: str, admin_key: str | None, args: argparse.Namespace) -> dict[str, Any]:
    import multiprocessing as mp
    from urllib.parse import urlsplit

    u = urlsplit(url)
    ctx = mp.get_context("spawn")
    open_now, stop, results = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_attack_process, name="slowloris-attacker", daemon=True,
                       args=(u.hostname or "127.0.0.1", u.port or 80, args.connections, args.mode == "reconnect",
                             open_now, stop, results))
    proc.start()
    try:
        return await _measure(url, admin_key, args, proc, open_now, stop, results)
    finally:
        stop.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


async def _measure(url: str, admin_key: str | None, args: argparse.Namespace, proc: Any, open_now: Any, stop: Any,
                   results: Any) -> dict[str, Any]:
    import httpx
    import numpy as np

    t_start = time.monotonic()
    while open_now.value < args.connections and time.monotonic() - t_start < 60 and proc.is_alive():
        await asyncio.sleep(0.05)  # the attacker's process starting and opening its connections
    await asyncio.sleep(args.settle)  # a bench: let the attack reach its steady state before probing
    held_at_start = open_now.value
    out: dict[str, Any] = {}
    who = {"client": {}, "admin": {"Authorization": f"Bearer {admin_key}"} if admin_key else None}
    roles = [name for name, headers in who.items() if headers is not None]
    for name, headers in who.items():
        if headers is None:
            out[name] = {"skipped": "no admin key (give --admin-key-file with --url)"}
    lat: dict[str, list[float]] = {name: [] for name in roles}
    sts: dict[str, list[int | str]] = {name: [] for name in roles}
    whys: dict[str, dict[str, int]] = {name: {} for name in roles}
    # built once (an httpx client's set-up costs ~10 ms of CPU: not the server's latency); no keep-alive
    clients = {name: httpx.AsyncClient(base_url=url, trust_env=False, timeout=args.timeout,
                                       limits=httpx.Limits(max_keepalive_connections=0)) for name in roles}
    try:
        # the roles take turns, probe after probe: both see the same attack and the same host load (one
        # role's 100 probes after the other's ran while the load average rose, and read as the admin's tail)
        for _ in range(args.probes):
            for name in roles:
                ms, st, why = await _probe(clients[name], who[name] or {})
                lat[name].append(ms)
                sts[name].append(st)
                if why is not None:
                    key = f"{st}: {why}"
                    if key in whys[name] or len(whys[name]) < 8:
                        whys[name][key] = whys[name].get(key, 0) + 1
    finally:
        for c in clients.values():
            await c.aclose()
    for name in roles:
        a = np.array(lat[name])
        statuses: dict[str, int] = {}
        for st in sts[name]:
            statuses[str(st)] = statuses.get(str(st), 0) + 1
        out[name] = {"probes": len(a), "status": statuses, "p50_ms": float(np.median(a)),
                     "p95_ms": float(np.percentile(a, 95)), "max_ms": float(a.max()),
                     "ok_within_1s": sum(1 for ms, st in zip(lat[name], sts[name], strict=True)
                                         if st == 200 and ms <= 1000),
                     "not_ok": whys[name]}
    stop.set()
    try:
        atk = await asyncio.get_running_loop().run_in_executor(None, lambda: results.get(timeout=60))
    except Exception as e:  # noqa: BLE001 - queue.Empty or a dead attacker: said in the report, figures kept
        atk = {"error": f"no report from the attacker process: {type(e).__name__}"}
    out["attack"] = {"connections": args.connections, "mode": args.mode, "held_when_probing": held_at_start, **atk}
    return out


def _key_of(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        line = next((ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")), "")
    if not line:
        raise ValueError(f"--admin-key-file holds no key: {path}")
    return line.split()[-1]


def run(args: argparse.Namespace) -> int:
    for name, v, lo, hi in (("connections", args.connections, 1, 5000), ("probes", args.probes, 1, 10_000)):
        if not lo <= v <= hi:
            return fail(f"--{name} must be in {lo}..{hi}, got {v}")
    for fname, fv, flo, fhi in (("settle", args.settle, 0.0, 600.0), ("timeout", args.timeout, 0.5, 600.0)):
        if not flo <= fv <= fhi:
            return fail(f"--{fname} must be in {flo:g}..{fhi:g}, got {fv:g}")
    load0 = os.getloadavg()[0]
    try:
        if args.url is not None:
            key = _key_of(args.admin_key_file) if args.admin_key_file else None
            rep = asyncio.run(measure(args.url, key, args))
        else:
            with child_server() as (url, key):
                rep = asyncio.run(measure(url, key, args))
    except (OSError, RuntimeError, ValueError) as e:
        return fail(f"{type(e).__name__}: {e}")
    rep["load_average"] = [load0, os.getloadavg()[0]]
    rep["clock"] = "host wall ms, from connect to the end of the answer"
    if args.json:
        print_json(rep)
        return 0
    a = rep["attack"]
    print(f"calconsole bench slowloris: {a['connections']} half-open connections ({a['mode']}), "
          f"{a['held_when_probing']} open when probing; server closed {a.get('closed_by_server', '?')} of "
          f"{a.get('opened', '?')} opened; load average {load0:.2f} / {rep['load_average'][1]:.2f}")
    if "error" in a:
        print(f"  attacker: {a['error']}")
    for name in ("client", "admin"):
        r = rep[name]
        if "skipped" in r:
            print(f"  {name:>6}: skipped ({r['skipped']})")
            continue
        print(f"  {name:>6} GET /health: P50 {r['p50_ms']:.1f} ms, P95 {r['p95_ms']:.1f} ms, max {r['max_ms']:.1f} ms "
              f"(host wall); {r['ok_within_1s']}/{r['probes']} answered 200 within 1 s; status {r['status']}")
        for why, n in r["not_ok"].items():
            print(f"          {n} x {why}")
    if a.get("server_answers"):
        print(f"  what the server told the attacker: {a['server_answers']}")
    return 0
