"""``calconsole bench fleet``: what watching N boards costs, and whether every board is polled on time.

Starts ``calconsole serve --boards N`` (N timing-only simulator processes, fast pacing, idle) in a
subprocess, then for ``--seconds`` host seconds runs the fleet view headless (Textual ``run_test``) over
them, or with ``--headless`` only the pollers (what ``calconsole fleet --watch`` does). Prints this
process's CPU (user + system time over wall time, %), the inter-sample interval of every board (host wall
s: mean, p95, max; the poll loop stays inside its interval when each board's interval is about 1/hz) and
the redraws of the table. The boards' own CPU is not counted (separate processes). A benchmark figure,
never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import fail, print_json


def register(bsub) -> None:
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
        cmd = [sys.executable, "-m", "calconsole", "serve", "--boards", str(args.boards), "--port", "0",
               "--timing-only", "--pacing", "fast", "--boards-dir", tmp]
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
    print(f"  poll interval per board, host wall s: mean {r['interval_mean_s']:.3f}, p95 {r['interval_p95_s']:.3f}, "
          f"max {r['interval_max_s']:.3f} (target {1 / args.hz:.3f}); samples {r['samples']}, "
          f"failed polls {r['failed']}")
    print(f"  poll round trip, host wall ms: p50 {r['poll_ms_p50']:.1f}, p95 {r['poll_ms_p95']:.1f}")
    if not args.headless:
        print(f"  table redraws: {r['redraws']}")
    return 0


async def _watch(fleet_file: Path, hz: float, seconds: float, headless: bool) -> dict:
    from ..fleet.config import load_fleet
    from ..fleet.poller import FleetMonitor

    cfg = load_fleet(fleet_file)
    cfg = type(cfg)(cfg.boards, refresh_hz=hz, timeout_s=cfg.timeout_s, source=cfg.source)
    stamps: dict[str, list[float]] = {b.name: [] for b in cfg.boards}
    polls: list[float] = []
    failed = 0

    def note(s) -> None:
        nonlocal failed
        stamps[s.name].append(time.monotonic())
        if s.poll_ms is not None:
            polls.append(s.poll_ms)
        failed += s.state != "up"

    redraws = 0
    if headless:
        mon = FleetMonitor(cfg, on_change=note)
        mon.start()
        c0, w0 = os.times(), time.monotonic()
        await asyncio.sleep(seconds)
        c1, w1 = os.times(), time.monotonic()
        await mon.stop()
    else:
        from ..fleet.view import FleetApp

        app = FleetApp(cfg)
        inner = app.monitor._record

        def record(s) -> None:
            inner(s)
            note(s)

        for p in app.monitor.pollers:
            p.on_sample = record
        async with app.run_test(size=(160, 48)):
            await asyncio.sleep(min(3.0, seconds / 4))  # mount and the first polls: not counted
            for v in stamps.values():
                v.clear()
            polls.clear()
            c0, w0 = os.times(), time.monotonic()
            await asyncio.sleep(seconds)
            c1, w1 = os.times(), time.monotonic()
            redraws = app.redraws
    intervals = [b - a for v in stamps.values() for a, b in zip(v, v[1:], strict=False)]
    intervals.sort()
    polls.sort()

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    cpu = (c1.user - c0.user + c1.system - c0.system) / (w1 - w0) * 100
    return {"cpu_percent": cpu, "interval_mean_s": statistics.fmean(intervals) if intervals else float("nan"),
            "interval_p95_s": pct(intervals, 0.95), "interval_max_s": intervals[-1] if intervals else float("nan"),
            "samples": sum(len(v) for v in stamps.values()), "failed": failed,
            "poll_ms_p50": pct(polls, 0.5), "poll_ms_p95": pct(polls, 0.95), "redraws": redraws}
