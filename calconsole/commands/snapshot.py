"""``calconsole snapshot``: print one observation snapshot and exit 0 (``--watch``: one JSON line per sample).

Without ``--connect`` the snapshot is of a fresh in-process simulator (idle: it says so); with
``--connect URL`` it is of the live device a server runs. ``--watch [--interval S] [--count N]``
prints one compact JSON object per line, flushed after each sample (nvitop ``--once`` /
nvtop ``-s`` / tt-smi ``-s`` conventions), for either kind of device; samples are taken on a
fixed schedule of ``S`` host seconds (at least 0.25 s, nvitop's floor). A sample the server
cannot give is a line ``{"taken_unix_s", "error": {"type", "message"}, "disconnected_since"}``
and the watch goes on (the planes reconnect with back-off). Ctrl-C ends a watch with exit code 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from sim_backend.planes import CalError

from .common import (
    AnySystem,
    Subparsers,
    add_common_options,
    add_connect_options,
    build_or_connect,
    device_origin,
    fail,
    print_json,
)

MIN_INTERVAL_S = 0.25


def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("snapshot", help="print one observation snapshot (read-only) and exit; --watch to stream",
                       description="Print one read-only observation snapshot, of a fresh in-process simulator or "
                                   "(--connect URL) of a running server's live device. Times under last_step are "
                                   "simulated device microseconds; host figures are measured wall time. --watch "
                                   "prints one JSON object per line, flushed each sample.")
    add_common_options(p, default_pacing="fast")
    add_connect_options(p, admin=False)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--watch", action="store_true",
                   help="print a snapshot every --interval seconds as one JSON line, until Ctrl-C or --count")
    p.add_argument("--interval", type=float, default=1.0, metavar="S",
                   help=f"seconds between --watch samples, host wall time (default 1, at least {MIN_INTERVAL_S:g})")
    p.add_argument("--count", type=int, default=None, metavar="N", help="with --watch: stop after N samples")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.watch:
        if not (math.isfinite(args.interval) and MIN_INTERVAL_S <= args.interval <= 3600):
            return fail(f"--interval must be between {MIN_INTERVAL_S:g} and 3600 s, got {args.interval:g}")
        if args.count is not None and args.count < 1:
            return fail(f"--count must be >= 1, got {args.count}")
    elif args.count is not None:
        return fail("--count needs --watch")
    try:
        system = build_or_connect(args, maintenance=False)
    except (CalError, ValueError) as e:
        return fail(str(e))
    with system:
        if args.watch:
            return watch(system, args.interval, args.count)
        try:
            snap = system.observation.snapshot()
        except CalError as e:
            return fail(str(e))
    if args.json:
        print_json(snap.to_dict())
    else:
        from rich.console import Console
        from rich.text import Text

        from ..widgets import render

        c = Console()
        c.print(Text(f"{device_origin(system)}; --json for scripts", style="grey62"))
        if snap.server is not None:  # a llama-server: its own figures; the device sections are not reported
            from ..widgets import server as server_render

            c.print(server_render.server_table(snap))
            c.print(server_render.server_header(snap))
            c.print(render.slots_panel(snap))
            for name in ("jobs", "kv", "memory", "host", "findings"):
                c.print(server_render.absent(name, snap.server.kind))
            return 0
        for panel in (render.device_panel, render.jobs_panel, render.kv_panel, render.memory_panel,
                      render.host_panel, render.findings_panel):
            c.print(panel(snap))
    return 0


def watch(system: AnySystem, interval_s: float, count: int | None) -> int:
    """One JSON line per sample on a fixed schedule (no drift); bounded sleeps; Ctrl-C ends it (0)."""
    out = sys.stdout
    start = time.monotonic()
    n = 0
    try:
        while count is None or n < count:
            try:
                line = json.dumps(system.observation.snapshot().to_dict(), separators=(",", ":"), default=str)
            except CalError as e:
                conn = getattr(system, "connection", None)
                line = json.dumps({"taken_unix_s": time.time(),
                                   "error": {"type": type(e).__name__, "message": str(e)},
                                   "disconnected_since": getattr(conn, "disconnected_since", None)})
            out.write(line + "\n")
            out.flush()
            n += 1
            if count is not None and n >= count:
                break
            # the next slot of the schedule; samples that overran skip to the following one
            now = time.monotonic()
            k = math.floor((now - start) / interval_s) + 1
            time.sleep(max(0.0, start + k * interval_s - now))
    except KeyboardInterrupt:
        pass
    return 0
