"""``calconsole snapshot``: print one observation snapshot and exit 0."""

from __future__ import annotations

import argparse

from sim_backend.planes import CalError

from .common import add_common_options, build_from_args, fail, print_json


def register(sub, common) -> None:
    p = sub.add_parser("snapshot", help="print one observation snapshot (read-only) and exit",
                       description="Print one read-only observation snapshot. Times under last_step are "
                                   "simulated device microseconds; host figures are measured wall time.")
    add_common_options(p, default_pacing="fast")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        system = build_from_args(args, maintenance=False)
    except (CalError, ValueError) as e:
        return fail(str(e))
    with system:
        snap = system.observation.snapshot().to_dict()
    if args.json:
        print_json(snap)
    else:
        from rich.console import Console

        from ..widgets import render

        c = Console()
        c.print("[grey62]a fresh in-process simulator (not a running console); --json for scripts[/grey62]")
        for panel in (render.device_panel, render.jobs_panel, render.kv_panel, render.memory_panel,
                      render.host_panel, render.findings_panel):
            c.print(panel(snap))
    return 0
