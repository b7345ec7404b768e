"""The trace replay over HTTP: a slice sent to real ``calconsole serve`` boards at its arrival times.

The in-process replay (:mod:`sim_backend.tools.replay`) says what N boards would do with a trace; this
sends the same rows to N served boards (``calconsole serve --boards N``, the fleet launcher: one process
per board, real-time pacing at ``speed`` simulated seconds per wall second), round-robin, each row a
streamed ``/completion`` of its exact prompt token ids with ``n_predict`` = its output and ``ignore_eos``.
Arrivals are scheduled on the host's monotonic clock at ``arrival_s / speed``.

Two views of each request come back: the client's (host wall ms, times ``speed`` to compare with
simulated ms) and the board's own (``calconsole.timings``: TTFT, E2E and queue in simulated ms from when
the board took the request). They differ from the in-process replay by where an arrival lands against
the boards' step boundaries (a step is ~18 simulated ms at batch 1) and the host's scheduling jitter,
amplified by ``speed``: that is the "host-time noise" the comparison allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml

from calconsole.bench.serve_load import Record, stream_completion
from sim_backend.planes.types import SLO
from sim_backend.tools.replay import Ledger, Trace, summarize
from sim_backend.tools.replay_engine import prompt_ids

__all__ = ["replay_over_http", "served_boards"]

#: host seconds for the launcher to report every board listening (N imports share the cores)
START_TIMEOUT_S = 240.0


@contextlib.contextmanager
def served_boards(n: int, *, speed: float = 1.0, bundle: str | None = None, slots: int = 4,
                  queue_limit: int = 16) -> Iterator[list[str]]:
    """``calconsole serve --boards n`` (timing-only, real-time pacing at ``speed``, loopback, ephemeral
    ports) for the ``with`` body; yields the boards' URLs and stops them all after (SIGINT, then kill).
    Raises RuntimeError with the launcher's last lines if the boards do not listen within
    :data:`START_TIMEOUT_S` host s."""
    with tempfile.TemporaryDirectory(prefix="calconsole-replay-") as d:
        cmd = [sys.executable, "-m", "calconsole", "serve", "--boards", str(n), "--host", "127.0.0.1", "--port", "0",
               "--timing-only", "--pacing", "realtime", "--speed", repr(float(speed)), "--slots", str(slots),
               "--queue-limit", str(queue_limit), "--boards-dir", d]
        if bundle:
            cmd += ["--bundle", bundle]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                            os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=env)
        try:
            assert proc.stderr is not None
            lines: list[str] = []
            deadline = time.monotonic() + START_TIMEOUT_S
            for line in proc.stderr:  # the launcher itself gives up after its start timeout
                lines.append(line)
                if "boards listening" in line or time.monotonic() > deadline:
                    break
            fleet = Path(d) / "fleet.yaml"
            if not fleet.is_file():
                raise RuntimeError("the boards did not start: " + "".join(lines[-10:]).strip())
            urls = [b["url"] for b in yaml.safe_load(fleet.read_text(encoding="utf-8"))["boards"]]
            # keep draining stderr so a chatty board never blocks on a full pipe
            threading.Thread(target=proc.stderr.read, daemon=True, name="replay-boards-stderr").start()
            yield urls
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


async def _send_all(trace: Trace, urls: list[str], speed: float, timeout_s: float) -> list[Record]:
    limits = httpx.Limits(max_connections=len(trace) + 4, max_keepalive_connections=len(trace) + 4)
    clients = [httpx.AsyncClient(base_url=u, timeout=httpx.Timeout(timeout_s), limits=limits) for u in urls]
    try:
        loop_t0 = asyncio.get_running_loop().time() + 0.2

        async def one(i: int) -> Record:
            await asyncio.sleep(max(0.0, loop_t0 + float(trace.arrival_s[i]) / speed
                                    - asyncio.get_running_loop().time()))
            body = {"prompt": list(prompt_ids(i, int(trace.prompt[i]))), "n_predict": int(trace.output[i]),
                    "ignore_eos": True, "stream": True, "cache_prompt": False, "seed": i}
            return await stream_completion(clients[i % len(urls)], body, f"row{i}", timeout_s=timeout_s)

        return list(await asyncio.gather(*(one(i) for i in range(len(trace)))))
    finally:
        for c in clients:
            await c.aclose()


def replay_over_http(trace: Trace, urls: list[str], *, speed: float = 1.0, slo: SLO | None = None,
                     attainment: float = 0.9, timeout_s: float = 600.0) -> dict[str, Any]:
    """Send ``trace`` to the boards at ``urls`` (round-robin, row i to ``urls[i % n]``) at its arrival
    times divided by ``speed``; returns ``{"client": summary, "server": summary, "failed": {row: error},
    "requests", "boards", "speed"}``, each summary :func:`replay.summarize`'s dict in simulated ms (client
    wall ms times ``speed``; the server's ``calconsole.timings``). ``timeout_s``: host s per request."""
    recs = asyncio.run(_send_all(trace, urls, speed, timeout_s))
    arr = trace.arrival_s * 1e6
    views: dict[str, Ledger] = {"client": Ledger(len(trace)), "server": Ledger(len(trace))}
    failed: dict[int, str] = {}
    for i, r in enumerate(recs):
        if not r.ok or r.ttft_ms is None or r.e2e_ms is None:
            failed[i] = r.error or "failed"
            for led in views.values():
                led.reason[i] = "failed"
            continue
        c = views["client"]
        c.first[i] = arr[i] + r.ttft_ms * speed * 1e3
        c.last[i] = arr[i] + r.e2e_ms * speed * 1e3
        c.board[i] = i % len(urls)
        srv = r.server or {}
        s = views["server"]
        if srv.get("ttft_ms") is not None and srv.get("e2e_ms") is not None:
            s.first[i] = arr[i] + float(srv["ttft_ms"]) * 1e3
            s.last[i] = arr[i] + float(srv["e2e_ms"]) * 1e3
            if srv.get("queue_ms") is not None:
                s.assigned[i] = arr[i] + float(srv["queue_ms"]) * 1e3
            s.board[i] = i % len(urls)
    out: dict[str, Any] = {"requests": len(trace), "boards": len(urls), "speed": speed, "failed": failed}
    for name, led in views.items():
        out[name] = summarize(trace, led, slo=slo or SLO(), attainment=attainment)
    out["client_clock"] = "host wall ms x speed (to compare with simulated ms)"
    out["server_clock"] = "each board's simulated ms from when it took the request"
    return out

