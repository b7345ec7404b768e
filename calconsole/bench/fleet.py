"""``calconsole bench fleet``: what watching N boards costs, and whether every board is polled on time.

Starts ``calconsole serve --boards N`` (N timing-only simulator processes, fast pacing, idle) in a
subprocess, then for ``--seconds`` host seconds runs the fleet view headless (Textual ``run_test``) over
them, or with ``--headless`` only the pollers (what ``calconsole fleet --watch`` does). Prints this
process's CPU (user + system time over wall time, %), the inter-sample interval of every board (host wall
s: mean, p95, max; the poll loop stays inside its interval when each board's interval is about 1/hz), how
many samples were pushed on a board's ``/snapshot/stream`` (no request) or polled (with the polls' round
trip, host wall ms), the redraws of the table, and how long one board entering exclusive mode takes to
reach its sample and its row. The boards' own CPU is not counted (separate processes). A benchmark
figure, never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..commands.common import fail, print_json
from . import BenchParsers

if TYPE_CHECKING:
    from ..fleet.config import BoardSpec
    from ..fleet.poller import FleetMonitor
    from ..fleet.sample import BoardSample


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("fleet", help="fleet view CPU and poll intervals over N served boards (host wall time)",
                        description="Start N idle timing-only boards (calconsole serve --boards N), watch them "
                                    "with the fleet view (headless) for a while and print the view's CPU and "
                                    "every board's poll interval (host wall s).")
    p.add_argument("--boards", type=int, default=16, help="boards to start, 1..64 (default 16)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long to watch, host s (default 30)")
    p.add_argument("--hz", type=float, default=1.0, help="polls per board per second (default 1)")
    p.add_argument("--headless", action="store_true", help="pollers only, no Textual view")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.boards <= 64:
        return fail(f"--boards must be in 1..64, got {args.boards}")
    if not 5 <= args.seconds <= 3600:
        return fail(f"--seconds must be in 5..3600, got {args.seconds:g}")
    if not 0.1 <= args.hz <= 10:
        return fail(f"--hz must be in 0.1..10, got {args.hz:g}")
    with tempfile.TemporaryDirectory(prefix="calconsole-bench-fleet-") as tmp:
        fleet_file = Path(tmp) / "fleet.yaml"
        admin_key = Path(tmp) / "admin.key"  # one board enters exclusive mode for the state-change figure
        admin_key.write_text(secrets.token_urlsafe(24) + "\n", encoding="utf-8")
        admin_key.chmod(0o600)
        cmd = [sys.executable, "-m", "calconsole", "serve", "--boards", str(args.boards), "--port", "0",
               "--timing-only", "--pacing", "fast", "--boards-dir", tmp, "--admin-key-file", str(admin_key)]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                if "boards listening" in line or "stopping all" in line:
                    break
            if not fleet_file.is_file():
                return fail(f"the {args.boards} boards did not start (see calconsole serve --boards)")
            start_s = time.monotonic() - t0
            # keep the boards' stderr drained (their request logs) so they never block on a full pipe
            import threading

            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()  # type: ignore[union-attr]
            r = asyncio.run(_watch(fleet_file, args.hz, args.seconds, args.headless))
            r["boards_start_s"] = round(start_s, 1)
        finally:
            proc.send_signal(2)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
    r.update(boards=args.boards, hz=args.hz, seconds=args.seconds, view="pollers only" if args.headless else
             "fleet view (Textual, headless)")
    if args.json:
        print_json(r)
        return 0
    print(f"fleet of {args.boards} idle timing-only boards, {args.hz:g} Hz each, {args.seconds:g} s "
          f"({r['view']}); boards started in {r['boards_start_s']} s")
    print(f"  this process CPU: {r['cpu_percent']:.1f} % of one core (user+sys over wall, host)")
    print(f"  sample interval per board, host wall s: mean {r['interval_mean_s']:.3f}, p95 {r['interval_p95_s']:.3f}, "
          f"max {r['interval_max_s']:.3f} (target {1 / args.hz:.3f}); samples {r['samples']}, "
          f"failed polls {r['failed']}")
    print(f"  this process's event loop woke a 50 ms sleep late by p95 {r['loop_lag_ms_p95']:.1f} ms, max "
          f"{r['loop_lag_ms_max']:.1f} ms (host wall; small: a late sample was late at its board)")
    rtt = (f", round trip host wall ms p50 {r['poll_ms_p50']:.1f}, p95 {r['poll_ms_p95']:.1f}" if r["polled"]
           else "")
    print(f"  samples pushed on /snapshot/stream: {r['streamed']} (no request, no round trip); polled: "
          f"{r['polled']}{rtt}")
    if not args.headless:
        print(f"  table redraws in the {args.seconds:g} s: {r['redraws']}")
    for key, what in (("change_sample_s", "its sample"), ("change_shown_s", "the view's row")):
        if key in r and (key == "change_sample_s" or not args.headless):
            v = r[key]
            print(f"  a board entering exclusive mode reached {what} after "
                  f"{'(not within the wait)' if v is None else f'{v:.3f} s'} host wall "
                  f"(refresh interval {1 / args.hz:.3f} s; from just before the enter request)")
    return 0


async def _watch(fleet_file: Path, hz: float, seconds: float, headless: bool) -> dict[str, Any]:
    from ..fleet.config import load_fleet
    from ..fleet.poller import FleetMonitor

    cfg = load_fleet(fleet_file)
    cfg = type(cfg)(cfg.boards, refresh_hz=hz, timeout_s=cfg.timeout_s, source=cfg.source)
    stamps: dict[str, list[float]] = {b.name: [] for b in cfg.boards}
    polls: list[float] = []  # round trips of polled samples (a streamed sample has none)
    failed = streamed = 0

    def note(s: BoardSample) -> None:
        nonlocal failed, streamed
        stamps[s.name].append(time.monotonic())
        if s.poll_ms is not None:
            polls.append(s.poll_ms)
        streamed += s.via == "stream"
        failed += s.state != "up"

    redraws = 0
    lag = LoopLag()
    if headless:
        mon = FleetMonitor(cfg, on_change=note)
        mon.start()
        deadline = time.monotonic() + 60.0  # every board's first poll and stream start are not counted
        while time.monotonic() < deadline and any(len(v) < 2 for v in stamps.values()):
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)
        for v in stamps.values():
            v.clear()
        polls.clear()
        streamed = failed = 0
        lag.start()
        c0, w0 = os.times(), time.monotonic()
        await asyncio.sleep(seconds)
        c1, w1 = os.times(), time.monotonic()
        await lag.stop()
        change = await state_change(mon, cfg.boards[0], 10.0 / hz)
        await mon.stop()
    else:
        from ..fleet.view import FleetApp

        app = FleetApp(cfg)
        inner = app.monitor._record

        def record(s: BoardSample) -> None:
            inner(s)
            note(s)

        for p in app.monitor.pollers:
            p.on_sample = record
        async with app.run_test(size=(160, 48)):
            # mount, every board's first poll (kind detection) and its stream's start are not counted: wait
            # until every board has sent a streamed or second sample (bounded), then 2 s more
            deadline = time.monotonic() + 60.0
            while time.monotonic() < deadline and any(len(v) < 2 for v in stamps.values()):
                await asyncio.sleep(0.1)
            await asyncio.sleep(2.0)
            for v in stamps.values():
                v.clear()
            polls.clear()
            streamed = failed = 0
            redraws0 = app.redraws
            lag.start()
            c0, w0 = os.times(), time.monotonic()
            await asyncio.sleep(seconds)
            c1, w1 = os.times(), time.monotonic()
            await lag.stop()
            redraws = app.redraws - redraws0  # in the measured window only
            name = cfg.boards[0].name
            change = await state_change(app.monitor, cfg.boards[0], 10.0 / hz,
                                        shown=lambda: "exclusive" in app.row_text(name))
    intervals = [b - a for v in stamps.values() for a, b in zip(v, v[1:], strict=False)]
    intervals.sort()
    polls.sort()

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    cpu = (c1.user - c0.user + c1.system - c0.system) / (w1 - w0) * 100
    return {"cpu_percent": cpu, "interval_mean_s": statistics.fmean(intervals) if intervals else float("nan"),
            "interval_p95_s": pct(intervals, 0.95), "interval_max_s": intervals[-1] if intervals else float("nan"),
            "samples": sum(len(v) for v in stamps.values()), "failed": failed,
            "streamed": streamed, "polled": len(polls), "loop_lag_ms_p95": pct(sorted(lag.lags_ms), 0.95),
            "loop_lag_ms_max": max(lag.lags_ms, default=float("nan")),
            "poll_ms_p50": pct(polls, 0.5), "poll_ms_p95": pct(polls, 0.95), "redraws": redraws, **change}


class LoopLag:
    """How late this process's event loop wakes a task that sleeps ``tick_s`` (host wall ms over the sleep):
    a loop that keeps up wakes it within a few ms; a late sample with a small lag was late at its board."""

    def __init__(self, tick_s: float = 0.05) -> None:
        self.tick_s = tick_s
        self.lags_ms: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(self.tick_s)
            self.lags_ms.append(max(0.0, (time.monotonic() - t - self.tick_s) * 1e3))

    def start(self) -> None:
        self.lags_ms.clear()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def state_change(monitor: FleetMonitor, spec: BoardSpec, timeout_s: float,
                       shown: Callable[[], bool] | None = None) -> dict[str, Any]:
    """Put board ``spec`` in exclusive mode (its admin key) and time, in host wall s from just before the
    request, until its sample says so (``change_sample_s``) and, with ``shown()``, until the view's row shows
    it (``change_shown_s``); then leave exclusive mode. None for a figure not reached within ``timeout_s``.
    The times include the enter request's own round trip (an upper bound on the view's delay)."""
    from ..fleet.poller import read_key
    from ..remote import connect

    system = await asyncio.to_thread(connect, spec.url, admin_key=read_key(spec.admin_key_file, "admin"))
    sample_s = shown_s = None
    try:
        t0 = time.monotonic()
        lease = await asyncio.to_thread(system.maintenance.enter_exclusive, "bench-fleet")
        deadline = t0 + timeout_s
        while time.monotonic() < deadline and (sample_s is None or (shown is not None and shown_s is None)):
            now = time.monotonic()
            if sample_s is None and monitor.samples[spec.name].mode == "exclusive":
                sample_s = now - t0
            if shown is not None and shown_s is None and shown():
                shown_s = now - t0
            await asyncio.sleep(0.005)
        await asyncio.to_thread(system.maintenance.leave_exclusive, lease)
    finally:
        await asyncio.to_thread(system.close)
    return {"change_sample_s": sample_s, "change_shown_s": shown_s}
