"""Slow readers of big replies: what they make a ``calconsole serve`` process hold.

``python -m calconsole.bench.slow_readers [--clients 20] [--hold 40] [--ids 500000] [--addresses 20]``
starts ``calconsole serve --timing-only`` on an ephemeral 127.0.0.1 port (``bench.child.serve_child``),
then opens ``clients`` connections from ``addresses`` loopback source addresses that each POST
``/detokenize`` with ``ids`` token ids (single digits: ~2 bytes of body an id, a 1 MB body for 500,000) and
``with_pieces`` (~24 bytes of reply an id) and never read. The server's resident set (psutil, of the server
process) is sampled every 0.5 s wall while they hang for ``hold`` s and for 5 s after they close.
Prints one JSON object: RSS before (MiB), the peak, the growth (peak - before), the RSS after the
clients closed, and what each client found in its socket when it finally read (the status line, or
nothing: cut). A benchmark, not a test: loopback, figures depend on the host.

``--streams`` measures snapshot streams instead (``streams``): 8 that never read, each from its own
address, and the wall s until a new stream gets 200.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import time
from typing import Any

import psutil

from .child import serve_child


def request_bytes(n_ids: int) -> bytes:
    body = json.dumps({"tokens": [i % 10 for i in range(n_ids)], "with_pieces": True},
                      separators=(",", ":")).encode()
    head = (f"POST /detokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    return head + body


def run(clients: int, hold_s: float, n_ids: int, addresses: int = 1) -> dict[str, Any]:
    """The measurement (module docstring); RSS in MiB, times in wall s."""
    with serve_child() as child:
        return _hang(child.port, psutil.Process(child.proc.pid), clients, hold_s, n_ids, addresses)


def _hang(port: int, proc: psutil.Process, clients: int, hold_s: float, n_ids: int,
          addresses: int) -> dict[str, Any]:
    samples: list[tuple[float, float]] = []
    t0 = time.monotonic()

    def sample() -> float:
        mb = proc.memory_info().rss / 2**20
        samples.append((round(time.monotonic() - t0, 1), round(mb, 1)))
        return mb

    time.sleep(1.0)
    before = sample()
    data = request_bytes(n_ids)
    socks = []
    for i in range(clients):
        src = ("127.0.0.1" if addresses <= 1 else f"127.0.0.{10 + i % addresses}", 0)
        s = socket.create_connection(("127.0.0.1", port), source_address=src)
        s.sendall(data)  # the body is sent whole; the reply is never read
        socks.append(s)
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        sample()
        time.sleep(0.5)
    found = []
    for s in socks:
        s.setblocking(False)
        try:
            first = s.recv(64)
            found.append(first.split(b"\r\n", 1)[0].decode("latin-1") or "closed")
        except BlockingIOError:
            found.append("nothing yet")
        except OSError as e:
            found.append(f"cut ({e.strerror})")
        with contextlib.suppress(OSError):
            s.close()
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        sample()
        time.sleep(0.5)
    peak = max(mb for _, mb in samples)
    return {"clients": clients, "ids": n_ids, "body_bytes": len(data), "hold_s": hold_s,
            "rss_before_mb": round(before, 1), "rss_peak_mb": peak, "growth_mb": round(peak - before, 1),
            "rss_after_close_mb": samples[-1][1],
            "replies": {k: found.count(k) for k in sorted(set(found))}, "samples": samples,
            "clock": "wall s host time; RSS MiB of the server process"}


def streams(non_readers: int = 8, hz: float = 2.0, wait_s: float = 60.0) -> dict[str, Any]:
    """``non_readers`` snapshot streams (each from its own address, 127.0.0.10, ...) that never read, then a
    new stream from 127.0.0.1 tried every 1 s: the wall s until it gets 200 (None: not within ``wait_s``)."""
    import httpx

    with serve_child() as child, contextlib.ExitStack() as closing:  # the sockets close before the server stops
        port = child.port
        for i in range(non_readers):
            sk = closing.enter_context(
                socket.create_connection(("127.0.0.1", port), source_address=(f"127.0.0.{10 + i}", 0)))
            sk.sendall(f"GET /snapshot/stream?hz={hz:g} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        time.sleep(1.0)
        t0 = time.monotonic()
        tries: list[tuple[float, int]] = []
        while time.monotonic() - t0 < wait_s:
            with httpx.stream("GET", f"http://127.0.0.1:{port}/snapshot/stream?hz=1", timeout=10) as r:
                tries.append((round(time.monotonic() - t0, 1), r.status_code))
            if r.status_code == 200:
                break
            time.sleep(1.0)
        ok = [t for t, st in tries if st == 200]
        return {"non_readers": non_readers, "hz": hz, "first_200_after_s": ok[0] if ok else None,
                "tries": len(tries), "refused": sum(st == 503 for _, st in tries),
                "clock": "wall s host time, from 1 s after the non-readers opened their streams"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m calconsole.bench.slow_readers", description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--hold", type=float, default=40.0, help="wall s the clients hang without reading")
    ap.add_argument("--ids", type=int, default=500_000)
    ap.add_argument("--addresses", type=int, default=20,
                    help="source addresses the clients come from (127.0.0.10, ...; 1: 127.0.0.1 only)")
    ap.add_argument("--streams", action="store_true",
                    help="measure snapshot streams instead: 8 that never read, and how long a new one waits for 200")
    a = ap.parse_args(argv)
    print(json.dumps(streams() if a.streams else run(a.clients, a.hold, a.ids, a.addresses)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
