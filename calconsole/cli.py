"""Command line: ``calconsole`` opens the console; sub-commands run headless."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .commands import load_commands
from .commands.common import add_common_options, add_connect_options, check_common, fail, finalize
from .layout import MAX_REFRESH_HZ, MIN_REFRESH_HZ


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
                   help=f"observation refresh rate, {MIN_REFRESH_HZ:g} to {MAX_REFRESH_HZ:g} Hz "
                        f"(default: the layout's, 2 Hz)")
    add_common_options(p, default_pacing="realtime", top_level=True)
    add_connect_options(p, top_level=True)
    p.add_argument("--listen", metavar="HOST:PORT", default=None,
                   help="also serve this in-process device over HTTP (as calconsole serve does) so clients and "
                        "other consoles (--connect) reach the device you watch; any host but loopback needs "
                        "--api-key-file; --admin-key-file enables /maintenance")
    sub = p.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for mod in load_commands():
        mod.register(sub, p)
    return p


def _raise_broken_pipe(self) -> None:
    # rich turns a closed stdout into SystemExit(1); let main() treat it like any broken pipe
    raise BrokenPipeError


def main(argv: list[str] | None = None) -> int:
    import rich.console

    # rich's default quits the process on a closed pipe; raise instead so main() exits 0 cleanly
    rich.console.Console.on_broken_pipe = _raise_broken_pipe  # type: ignore[method-assign]
    parser = build_parser()
    args = finalize(parser.parse_args(argv))
    err = _start_up_error(args)
    if err:
        return fail(err)
    try:
        if getattr(args, "func", None) is not None:
            return args.func(args)
        return run_console(args)
    except BrokenPipeError:
        # output piped into e.g. `head` that closed early: not an error of ours
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _start_up_error(args: argparse.Namespace) -> str | None:
    """The one-line reason a shared option is unusable (checked before any command runs), or None."""
    from sim_backend.planes import CalError

    if args.refresh is not None and not MIN_REFRESH_HZ <= args.refresh <= MAX_REFRESH_HZ:  # also refuses nan
        return f"--refresh must be between {MIN_REFRESH_HZ:g} and {MAX_REFRESH_HZ:g} Hz, got {args.refresh:g}"
    try:
        # an explicit --audit-log is checked here for every command; the default path only where a
        # maintenance plane is built (build_from_args), so nothing is created for a refused console
        check_common(args, maintenance=False, audit_log=args.command != "audit")
    except (CalError, ValueError) as e:
        return str(e)
    return None


def run_console(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError

    from .layout import LayoutError, load_layout

    try:
        layout = load_layout(args.layout)
    except LayoutError as e:
        return fail(str(e))
    if args.connect and args.listen:
        return fail("--connect attaches to a served device; --listen serves this console's own: give one")
    if not sys.stdout.isatty() or not sys.stdin.isatty():
        return fail("the console needs a terminal; for scripts use 'calconsole snapshot --json' "
                    "or 'calconsole chat PROMPT --json'")
    from .app import CalConsoleApp

    # The UI, engine and device threads hand the GIL to each other several times per token;
    # the default 5 ms switch interval adds up to a visible lag behind real-time pacing.
    sys.setswitchinterval(0.001)
    from .commands.common import build_from_args, connect_from_args

    server = None
    try:
        if args.connect:
            # without an admin key (or with --observe-only) there is no maintenance plane, so no pane
            admin = not args.observe_only and bool(args.admin_key_file or os.environ.get("CALCONSOLE_ADMIN_KEY"))
            system = connect_from_args(args, admin=admin)
        else:
            # numerics in a worker process: the UI and the simulation would otherwise share one GIL
            system = build_from_args(args, maintenance=not args.observe_only, numerics_process=True)
    except (CalError, ValueError) as e:
        return fail(str(e))
    try:
        where = None
        if args.listen:
            try:
                server = listen(args, system)
            except (CalError, ValueError, OSError) as e:
                return fail(str(e))
            where = f"listening on {server.url}"
        app = CalConsoleApp(system, layout, refresh_hz=args.refresh, where=where)
        app.run()
    finally:
        if server is not None:
            server.stop()
        system.close()
    return 0


def listen(args: argparse.Namespace, system):
    """Serve ``system`` on ``--listen HOST:PORT`` from a thread (``calconsole serve``'s face and rules).

    Raises ValueError (one line) for a bad address, a refused key source or a non-loopback host
    without an API key; OSError if the address cannot be bound.
    """
    from .server.face import ServeConfig, ServingFace
    from .server.keys import KeySourceError, load_keys
    from .server.run import ServerThread, is_loopback

    host, sep, port_s = args.listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or not 0 <= int(port_s) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT (e.g. 127.0.0.1:8080), got {args.listen!r}")
    try:
        api = load_keys("api", key_file=args.api_key_file)
        admin = load_keys("admin", key_file=args.admin_key_file) if system.maintenance is not None else None
    except KeySourceError as e:
        raise ValueError(str(e)) from None
    if not is_loopback(host) and api is None:
        raise ValueError(f"refusing to listen on {host} without an API key: give --api-key-file "
                         "(or $CALCONSOLE_API_KEY), or listen on 127.0.0.1")
    cfg = ServeConfig(host=host, port=int(port_s), api_keys=api, admin_keys=admin)
    audit = system.maintenance.audit if system.maintenance is not None else None
    face = ServingFace(system.inference, system.observation, system.maintenance, cfg, audit=audit)
    try:
        thread = ServerThread(face, host, int(port_s))
    except OSError as e:
        raise OSError(f"cannot listen on {args.listen}: {e.strerror or e}") from None
    return thread.start()


if __name__ == "__main__":
    raise SystemExit(main())
