"""``calconsole bench poll --connect URL``: what observing a server costs this console (host wall and CPU).

Two figures, for either kind of server (calconsole or a stock llama-server):

- per snapshot: ``--count N`` snapshots taken back to back through the observation plane; wall ms
  per snapshot (P50 / P95 / max, ``time.perf_counter``) and this process's CPU ms per snapshot
  (``time.process_time``: every thread of this process, so run the server in another process);
- an idle attached console (``--console S``, default 20 s, 0 skips it): the full Textual console run
  headless (``App.run_test``) at its layout's refresh rate for S wall seconds with nobody typing;
  CPU % of one core over that time (process CPU s / wall s x 100).

All figures are measured host wall / CPU time on this machine (nothing simulated); a loaded machine
reads higher. Exit 2 for a bad option or a server that cannot be attached.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from ..commands.common import add_connect_options, connect_from_args, fail, print_json
from . import BenchParsers


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("poll", help="cost of observing a server: wall and CPU ms per snapshot, CPU of an idle "
                                     "attached console",
                        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connect_options(p, admin=False, top_level=True)
    p.add_argument("--count", type=int, default=50, metavar="N", help="snapshots to time (default 50, 1..10000)")
    p.add_argument("--console", type=float, default=20.0, metavar="S",
                   help="wall seconds to run an idle attached console for its CPU %% (default 20; 0 skips)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not args.connect:
        return fail("bench poll measures an attached console: give --connect URL")
    if not 1 <= args.count <= 10_000:
        return fail(f"--count must be in 1..10000, got {args.count}")
    if not 0 <= args.console <= 3600:
        return fail(f"--console must be between 0 and 3600 wall s, got {args.console:g}")
    from sim_backend.planes import CalError

    try:
        system = connect_from_args(args)
    except (CalError, ValueError) as e:
        return fail(str(e))
    with system:
        try:
            system.observation.snapshot()  # warm: the connection pool, the first load sample
            walls: list[float] = []
            cpu0 = time.process_time()
            for _ in range(args.count):
                t0 = time.perf_counter()
                system.observation.snapshot()
                walls.append((time.perf_counter() - t0) * 1e3)
            cpu_ms = (time.process_time() - cpu0) * 1e3 / args.count
        except CalError as e:
            return fail(str(e))
        out = {"server": getattr(system, "kind", "calconsole"), "url": system.url, "snapshots": args.count,
               "wall_ms_p50": statistics.median(walls), "wall_ms_p95": _p95(walls), "wall_ms_max": max(walls),
               "cpu_ms_per_snapshot": cpu_ms, "clock": "host wall / process CPU, measured"}
        if args.console > 0:
            out.update(idle_console(system, args.console))
    if args.json:
        print_json(out)
        return 0
    print(f"{out['server']} at {out['url']}: {args.count} snapshots, wall ms per snapshot P50 "
          f"{out['wall_ms_p50']:.2f} / P95 {out['wall_ms_p95']:.2f} / max {out['wall_ms_max']:.2f}; "
          f"this process's CPU {out['cpu_ms_per_snapshot']:.2f} ms per snapshot (host, measured)")
    if "console_cpu_percent" in out:
        print(f"idle attached console at {out['console_refresh_hz']:g} Hz for {out['console_wall_s']:.1f} s wall: "
              f"{out['console_cpu_percent']:.2f} % of one core ({out['console_snapshots']} snapshots drawn)")
    return 0


def _p95(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))]


def idle_console(system: Any, seconds: float) -> dict[str, Any]:
    """Run the console headless on ``system`` for ``seconds`` wall s untouched; its process CPU %."""
    from ..app import CalConsoleApp
    from ..layout import load_layout
    from ..messages import SnapshotReady

    app = CalConsoleApp(system, load_layout("operator"))
    counting = False
    drawn = 0

    def hook(message: object) -> None:
        nonlocal drawn
        if counting and isinstance(message, SnapshotReady):
            drawn += 1

    async def main() -> tuple[float, float]:
        nonlocal counting
        async with app.run_test(size=(160, 48), message_hook=hook) as pilot:
            deadline = time.monotonic() + 30.0
            while app.last_snapshot is None and time.monotonic() < deadline:
                await pilot.pause(0.05)
            await pilot.pause(2.0)  # past the first draws of every section and graph
            counting = True
            w0, c0 = time.perf_counter(), time.process_time()
            await asyncio.sleep(seconds)  # nobody types: the console runs on its own timers
            return time.perf_counter() - w0, time.process_time() - c0

    wall, cpu = asyncio.run(main())
    return {"console_wall_s": wall, "console_cpu_percent": 100.0 * cpu / wall if wall > 0 else None,
            "console_refresh_hz": app.refresh_hz, "console_snapshots": drawn}
