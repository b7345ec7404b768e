"""Command line: ``calconsole`` opens the console; sub-commands run headless."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .commands import load_commands
from .commands.common import add_common_options, fail, finalize


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="calconsole",
        description="Operations console for the Calculet dual-chiplet NPU serving Qwen3-30B-A3B "
                    "(built-in simulator). With no sub-command, opens the console. Device timings are "
                    "simulated device time; host figures are measured wall time.")
    p.add_argument("--version", action="version", version=f"calconsole {__version__}")
    p.add_argument("--layout", default="operator", metavar="NAME|PATH",
                   help="layout: a name from layouts/ (operator, chat) or a YAML file (default: operator)")
    p.add_argument("--observe-only", action="store_true",
                   help="no maintenance pane; the maintenance plane is never constructed")
    p.add_argument("--refresh", type=float, default=None, metavar="HZ",
                   help="observation refresh rate (default: the layout's, 2 Hz); at most 10 Hz")
    add_common_options(p, default_pacing="realtime", top_level=True)
    sub = p.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for mod in load_commands():
        mod.register(sub, p)
    return p


def _raise_broken_pipe(self) -> None:
    # rich turns a closed stdout into SystemExit(1); let main() treat it like any broken pipe
    raise BrokenPipeError


def main(argv: list[str] | None = None) -> int:
    import rich.console

    rich.console.Console.on_broken_pipe = _raise_broken_pipe
    parser = build_parser()
    args = finalize(parser.parse_args(argv))
    try:
        if getattr(args, "func", None) is not None:
            return args.func(args)
        return run_console(args)
    except BrokenPipeError:
        # output piped into e.g. `head` that closed early: not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def run_console(args: argparse.Namespace) -> int:
    from sim_backend.errors import CalError

    from .layout import LayoutError, load_layout

    try:
        layout = load_layout(args.layout)
    except LayoutError as e:
        return fail(str(e))
    if args.refresh is not None and not 0.1 <= args.refresh <= 10:
        return fail(f"--refresh must be between 0.1 and 10 Hz, got {args.refresh}")
    if not sys.stdout.isatty() or not sys.stdin.isatty():
        return fail("the console needs a terminal; for scripts use 'calconsole snapshot --json' "
                    "or 'calconsole chat PROMPT --json'")
    from .app import CalConsoleApp

    # The UI, engine and device threads hand the GIL to each other several times per token;
    # the default 5 ms switch interval adds up to a visible lag behind real-time pacing.
    sys.setswitchinterval(0.001)
    from .commands.common import build_from_args

    try:
        # numerics in a worker process: the UI and the simulation would otherwise share one GIL
        system = build_from_args(args, maintenance=not args.observe_only, numerics_process=True)
    except (CalError, ValueError) as e:
        return fail(str(e))
    try:
        app = CalConsoleApp(system, layout, refresh_hz=args.refresh)
        app.run()
    finally:
        system.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
