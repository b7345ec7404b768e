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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from calconsole.bench.serve_load import Record, stream_completion

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


@dataclass(frozen=True)
class Row:
    """One request to send: ``arrival_s`` (trace seconds from the first), ``prompt`` token ids, ``n_predict``;
    ``board`` the index of the URL it goes to (None: its position in the rows, round-robin)."""

    arrival_s: float
    prompt: tuple[int, ...]
    n_predict: int
    board: int | None = None


async def _send_all(rows: Sequence[Row], urls: list[str], speed: float, timeout_s: float) -> list[Record]:
    limits = httpx.Limits(max_connections=len(rows) + 4, max_keepalive_connections=len(rows) + 4)
    clients = [httpx.AsyncClient(base_url=u, timeout=httpx.Timeout(timeout_s), limits=limits) for u in urls]
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2

        async def one(i: int, row: Row) -> Record:
            await asyncio.sleep(max(0.0, t0 + row.arrival_s / speed - loop.time()))
            body = {"prompt": list(row.prompt), "n_predict": row.n_predict, "ignore_eos": True, "stream": True,
                    "cache_prompt": False, "seed": i}
            board = i if row.board is None else row.board
            return await stream_completion(clients[board % len(urls)], body, f"row{i}", timeout_s=timeout_s)

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(rows))))
    finally:
        for c in clients:
            await c.aclose()


def replay_over_http(rows: Sequence[Row], urls: list[str], *, speed: float = 1.0,
                     timeout_s: float = 600.0) -> list[Record]:
    """Send ``rows`` to the boards at ``urls`` (row i to ``urls[row.board % n]``, or ``urls[i % n]`` without a board:
    round-robin) at their arrival times divided by ``speed`` (host monotonic clock); returns one
    :class:`~calconsole.bench.serve_load.Record` per row, in order (client TTFT / E2E in host wall ms; ``server``
    the board's ``calconsole.timings`` in simulated ms; ``ok`` False with the reason for a failed one, never
    raised). ``timeout_s``: host s per request. Raises ValueError for no URL or a speed outside 0.1..10."""
    if not urls:
        raise ValueError("no board URL to send to")
    if not 0.1 <= speed <= 10:
        raise ValueError(f"speed must be in 0.1..10, got {speed}")
    return asyncio.run(_send_all(rows, urls, speed, timeout_s))
