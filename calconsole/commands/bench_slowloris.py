"""``calconsole bench slowloris``: /health latency while many half-open connections are held or reconnected.

An attacker opens ``--connections`` TCP connections to the server, sends the start of a request head
(``GET /health HTTP/1.1`` and one header line without its end) and never finishes it. In
``--mode reconnect`` (default) every connection the server closes is opened again at once; in
``hold`` it is not. While that runs, a normal client (a new connection per probe, no key) and the
admin (``Authorization: Bearer <admin key>``) each ask ``GET /health`` ``--probes`` times; the
figure is their latency (host wall ms, connect to the end of the answer) and the status they got.

Without ``--url`` the server is ``calconsole serve --timing-only`` in a child process on
127.0.0.1 (an admin key in a temporary 0600 file), so the attacker and the clients here do not
share the server's interpreter; it is stopped at the end. A benchmark that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from .common import fail, print_json

HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def register(bsub) -> None:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def child_server() -> Iterator[tuple[str, str]]:
    """(url, admin key) of a ``calconsole serve --timing-only`` child on 127.0.0.1, stopped on exit."""
    import secrets

    import httpx

    key = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory() as d:
        kf = os.path.join(d, "admin.keys")
        fd = os.open(kf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"bench {key}\n")
        port = _free_port()
        env = {**os.environ, "CALCONSOLE_AUDIT_LOG": os.path.join(d, "audit.jsonl")}
        proc = subprocess.Popen([sys.executable, "-m", "calconsole", "serve", "--port", str(port), "--timing-only",
                                 "--pacing", "fast", "--admin-key-file", kf],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                if proc.poll() is not None:
                    err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace")[-400:]
                    raise RuntimeError(f"the server exited with {proc.returncode}: {err}")
                try:
                    if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not answer /health within 120 s")
                time.sleep(0.2)
            yield url, key
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


class Attack:
    """``n`` half-open connections to ``host:port``; counts opens and closes by the server."""

    def __init__(self, host: str, port: int, n: int, reconnect: bool) -> None:
        self.host, self.port, self.n, self.reconnect = host, port, n, reconnect
        self.opened = self.closed_by_server = self.refused = 0
        self.open_now = 0
        self.answers: dict[str, int] = {}
        self.stop = asyncio.Event()

    async def _one(self) -> None:
        while not self.stop.is_set():
            try:
                r, w = await asyncio.open_connection(self.host, self.port)
            except OSError:
                self.refused += 1
                await asyncio.sleep(0.01)  # the listen queue is full: do not spin
                continue
            self.opened += 1
            self.open_now += 1
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
                self.open_now -= 1
                w.close()
            if not self.reconnect:
                await self.stop.wait()

    async def run(self) -> None:
        await asyncio.gather(*(self._one() for _ in range(self.n)))


async def _probe(url: str, headers: dict[str, str], timeout_s: float) -> tuple[float, int | str]:
    import httpx

    t0 = time.perf_counter()
    try:  # a new client per probe: a new connection, as a client arriving during the attack
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=timeout_s) as c:
            r = await c.get("/health", headers=headers)
            status: int | str = r.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return (time.perf_counter() - t0) * 1e3, status


async def measure(url: str, admin_key: str | None, args: argparse.Namespace) -> dict[str, Any]:
    from urllib.parse import urlsplit

    import numpy as np

    u = urlsplit(url)
    atk = Attack(u.hostname or "127.0.0.1", u.port or 80, args.connections, args.mode == "reconnect")
    task = asyncio.ensure_future(atk.run())
    await asyncio.sleep(args.settle)  # a bench: let the attack reach its steady state before probing
    held_at_start = atk.open_now
    out: dict[str, Any] = {}
    who = {"client": {}, "admin": {"Authorization": f"Bearer {admin_key}"} if admin_key else None}
    for name, headers in who.items():
        if headers is None:
            out[name] = {"skipped": "no admin key (give --admin-key-file with --url)"}
            continue
        lat: list[float] = []
        sts: list[int | str] = []
        statuses: dict[str, int] = {}
        for _ in range(args.probes):
            ms, st = await _probe(url, headers, args.timeout)
            lat.append(ms)
            sts.append(st)
            statuses[str(st)] = statuses.get(str(st), 0) + 1
        a = np.array(lat)
        out[name] = {"probes": len(lat), "status": statuses, "p50_ms": float(np.median(a)),
                     "p95_ms": float(np.percentile(a, 95)), "max_ms": float(a.max()),
                     "ok_within_1s": sum(1 for ms, st in zip(lat, sts, strict=True) if st == 200 and ms <= 1000)}
    atk.stop.set()
    await task
    out["attack"] = {"connections": args.connections, "mode": args.mode, "held_when_probing": held_at_start,
                     "opened": atk.opened, "closed_by_server": atk.closed_by_server, "connect_failed": atk.refused,
                     "server_answers": atk.answers}
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
          f"{a['held_when_probing']} open when probing; server closed {a['closed_by_server']} of {a['opened']} "
          f"opened; load average {load0:.2f} / {rep['load_average'][1]:.2f}")
    for name in ("client", "admin"):
        r = rep[name]
        if "skipped" in r:
            print(f"  {name:>6}: skipped ({r['skipped']})")
            continue
        print(f"  {name:>6} GET /health: P50 {r['p50_ms']:.1f} ms, P95 {r['p95_ms']:.1f} ms, max {r['max_ms']:.1f} ms "
              f"(host wall); {r['ok_within_1s']}/{r['probes']} answered 200 within 1 s; status {r['status']}")
    if a["server_answers"]:
        print(f"  what the server told the attacker: {a['server_answers']}")
    return 0
