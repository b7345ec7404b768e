"""Command line: ``calconsole`` opens the console; sub-commands run headless."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from typing import TYPE_CHECKING

from . import __version__
from .commands import load_commands
from .commands.common import add_common_options, check_common, fail, finalize
from .layout import MAX_REFRESH_HZ, MIN_REFRESH_HZ

if TYPE_CHECKING:
    import rich.console

    from .commands.common import AnySystem, LocalSystem
    from .layout import Layout
    from .server.run import ServerThread
    from .settings import Settings

SETTINGS_HELP = """settings: {path} (YAML; optional). Keys: layout, refresh_hz, history_window_s (60|300|900),
theme, compact (auto|on|off), panes (auto|single|columns: one pane at a time below the layout's
single_pane_below size, always, or never), audit_log, slo {{ttft_ms, tpot_ms}}, thresholds {{NAME: {{warn, crit}}}}
with NAME one of {names}, sections {{order: [...], folded: [...], focus: NAME|null}} (the observation pane's
arrangement, written at each change). Environment overrides: CALCONSOLE_CONFIG (the file),
CALCONSOLE_LAYOUT, CALCONSOLE_REFRESH, CALCONSOLE_HISTORY_WINDOW, CALCONSOLE_THEME, CALCONSOLE_COMPACT,
CALCONSOLE_PANES, CALCONSOLE_AUDIT_LOG, CALCONSOLE_SLO_TTFT_MS, CALCONSOLE_SLO_TPOT_MS,
CALCONSOLE_THRESHOLD_<NAME>=WARN,CRIT.
Options given here override both; the console saves its settings from the palette (Ctrl+P). Every command
reads the file: a bad one stops each with the same error (exit 2)."""


def build_parser() -> argparse.ArgumentParser:
    from .settings import DEFAULT_THRESHOLDS, settings_path

    p = argparse.ArgumentParser(
        prog="calconsole", formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SETTINGS_HELP.format(path=settings_path(), names=", ".join(DEFAULT_THRESHOLDS)),
        description="Operations console for the Calculet dual-chiplet NPU serving Qwen3-30B-A3B "
                    "(built-in simulator). With no sub-command, opens the console. Device timings are "
                    "simulated device time; host figures are measured wall time.")
    p.add_argument("--version", action="version", version=f"calconsole {__version__}")
    p.add_argument("--layout", default=None, metavar="NAME|PATH",
                   help="layout: a name from layouts/ (operator, chat) or a YAML file (default: the settings', "
                        "operator)")
    p.add_argument("--observe-only", action="store_true",
                   help="no maintenance pane; the maintenance plane is never constructed")
    p.add_argument("--refresh", type=float, default=None, metavar="HZ",
                   help=f"observation refresh rate, {MIN_REFRESH_HZ:g} to {MAX_REFRESH_HZ:g} Hz "
                        f"(default: the layout's, 2 Hz)")
    p.add_argument("--listen", default=None, metavar="HOST:PORT", type=_listen_spec,
                   help="also serve this device's HTTP API (as 'calconsole serve') from the console process, so "
                        "real clients drive the device you watch (keys: --api-key-file, --admin-key-file; "
                        "any host but loopback needs an API key)")
    g = p.add_argument_group("keys for --listen, or to present with --connect (prefer files or the environment: "
                             "a flag is visible in ps)")
    g.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="API keys, one per line ('KEY' or 'LABEL KEY'; mode 600); also $CALCONSOLE_API_KEY")
    g.add_argument("--admin-key-file", default=None, metavar="FILE",
                   help="admin keys for /maintenance/... (without one no maintenance route exists)")
    add_common_options(p, default_pacing="realtime", top_level=True)
    from .commands.fleet import ConnectAction, add_fleet_source

    p.add_argument("--connect", metavar="URL", default=None, action=ConnectAction,
                   help="open the console on the live device a running 'calconsole serve' (or a console with "
                        "--listen) serves at URL; --api-key-file / --admin-key-file then hold the keys to present "
                        "(no admin key: no maintenance pane). Given twice or more: the fleet view over those "
                        "boards (the same key files for each; a fleet file names one per board)")
    add_fleet_source(p, top_level=True)
    sub = p.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    for mod in load_commands():
        mod.register(sub, p)
    return p


def _raise_broken_pipe(self: rich.console.Console) -> None:
    # rich turns a closed stdout into SystemExit(1); let main() treat it like any broken pipe
    raise BrokenPipeError


def main(argv: list[str] | None = None) -> int:
    import rich.console

    # rich's default quits the process on a closed pipe; raise instead so main() exits 0 cleanly
    rich.console.Console.on_broken_pipe = _raise_broken_pipe  # type: ignore[method-assign]
    parser = build_parser()
    args = finalize(parser.parse_args(argv))
    from .settings import SettingsError, load_settings

    # every command reads the settings file: a bad one stops the console and a headless command alike, with
    # the same SettingsError (exit 2); headless commands ignored it (and its audit_log) while the console refused
    try:
        settings = load_settings()
    except SettingsError as e:
        return fail(str(e))
    if args.audit_log is None and settings.audit_log is not None:
        # the settings' log (its key or $CALCONSOLE_AUDIT_LOG) is a default, not an option given: it is checked
        # only where a maintenance plane writes it (check_common), so `chat` is not refused over it
        args.audit_log = settings.audit_log
        args.audit_log_from_settings = True
    if args.layout is None:
        args.layout = settings.layout
    err = _start_up_error(args)
    if err:
        return fail(err)
    try:
        if getattr(args, "func", None) is not None:
            rc: int = args.func(args)  # a command's run(args): its exit code
            return rc
        return run_console(args, settings)
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


def run_console(args: argparse.Namespace, settings: Settings | None = None) -> int:
    from .layout import LayoutError, load_layout

    try:
        layout = load_layout(args.layout)
    except LayoutError as e:
        return fail(str(e))
    if args.connect and args.listen:
        return fail("--connect attaches to a served device; --listen serves this console's own: give one")
    if args.fleet or len(getattr(args, "connect_urls", None) or ()) > 1:
        return run_fleet(args, settings, layout)
    err = _console_args_error(args)
    if err:  # a bad bundle, key file or address is named before the terminal check and any heavy start
        return fail(err)
    sock = None
    if args.listen is not None:
        # bound now, before the terminal check and the simulator (a first start compiles the kernels for
        # minutes): a busy port was found only once the device had been built
        from .server.run import bind_socket

        try:
            sock = bind_socket(*parse_listen(args.listen))
        except OSError as e:
            return fail(f"--listen {args.listen}: cannot listen: {e.strerror or e}")
    try:
        return _run_console(args, settings, layout, sock)
    finally:
        if sock is not None:
            sock.close()  # the server's own socket: closing it again after the server stopped is harmless


def _run_console(args: argparse.Namespace, settings: Settings | None, layout: Layout,
                 sock: socket.socket | None) -> int:
    """The console once its options are checked (``sock``: the ``--listen`` socket, bound already)."""
    from sim_backend.planes import CalError

    if not sys.stdout.isatty() or not sys.stdin.isatty():
        return fail("the console needs a terminal; for scripts use 'calconsole snapshot --json' "
                    "or 'calconsole chat PROMPT --json'")
    from .app import CalConsoleApp, StartProgress

    # The UI, engine and device threads hand the GIL to each other several times per token;
    # the default 5 ms switch interval adds up to a visible lag behind real-time pacing.
    sys.setswitchinterval(0.001)
    from .commands.common import build_from_args, connect_from_args

    server = None
    progress = StartProgress()
    system: AnySystem
    local: LocalSystem | None = None  # the in-process device, the one --listen serves (never with --connect)
    try:
        if args.connect:
            # without an admin key (or with --observe-only) there is no maintenance plane, so no pane
            admin = not args.observe_only and bool(args.admin_key_file or os.environ.get("CALCONSOLE_ADMIN_KEY"))
            system = connect_from_args(args, admin=admin)
            if getattr(system, "kind", None) == "llama-server" and args.observe_only:
                system.maintenance = None  # its slot actions need no admin key: --observe-only drops them
        else:
            from sim_backend.planes import SLO

            # the engine's goodput checks the console's SLO (settings slo), the one the header colours
            # by: one SLO in every panel. Attached (--connect), the server's own SLO is shown as such.
            slo = None if settings is None else SLO(ttft_ms=settings.slo_ttft_ms, tpot_ms=settings.slo_tpot_ms)
            # numerics in a worker process: the UI and the simulation would otherwise share one GIL. The console
            # does not wait for the worker's start (a first start compiles its kernels: ~30 s of CPU, minutes of
            # wall on a busy host): it serves at once, timing-only until the numerics are ready, and says so
            system = local = build_from_args(args, maintenance=not args.observe_only, numerics_process=True, slo=slo,
                                             numerics_progress=progress, numerics_background_start=True)
    except (CalError, ValueError) as e:
        return fail(str(e))
    try:
        if args.listen is not None and local is not None:
            try:
                server = start_listening(args, local, sock)
            except (CalError, ValueError, OSError) as e:
                return fail(f"--listen {args.listen}: {e}")
        notes: tuple[str, ...] = ()
        if args.connect:
            from .commands.common import ignored_simulator_options

            ignored = ignored_simulator_options(args, kind=getattr(system, "kind", "calconsole"))
            if ignored:
                notes = (f"{', '.join(ignored)}: with --connect the simulator options are the server's, "
                         "not applied here",)
        app = CalConsoleApp(system, layout, refresh_hz=args.refresh, listen_url=server.url if server else None,
                            settings=settings, start_notes=notes, start_progress=progress)
        app.run()
    finally:
        if server is not None:
            server.stop()
        system.close()
    return 0


def run_fleet(args: argparse.Namespace, settings: Settings | None, layout: Layout) -> int:
    """The fleet view (``--fleet FILE`` or ``--connect URL`` twice or more): one row per board, worst first."""
    from .commands.fleet import fleet_config
    from .fleet.config import FleetConfigError
    from .server.keys import KeySourceError

    if args.listen:
        return fail("--fleet watches served boards; --listen serves this console's own device: give one")
    try:
        config = fleet_config(args)
        from .fleet.view import FleetApp

        app = FleetApp(config, settings=settings, layout=layout)
    except (FleetConfigError, KeySourceError, ValueError) as e:
        return fail(str(e))
    if not sys.stdout.isatty() or not sys.stdin.isatty():
        return fail("the fleet view needs a terminal; for scripts use 'calconsole fleet --json [--watch]'")
    app.run()
    return 0


def _console_args_error(args: argparse.Namespace) -> str | None:
    """The one-line reason the console's own options cannot work, or None; cheap (no device is built).

    Checked before the terminal check, so a script sees what is wrong with its options rather than
    "needs a terminal", and before the simulator is built (compiling the kernels on a first start):
    the bundle's manifest, the key files, the ``--connect`` URL's scheme, and ``--listen``'s keys
    (a non-loopback bind needs an API key)."""
    from sim_backend.planes import CalError

    from .server.keys import KeySourceError, load_keys, parse_key_file

    try:
        if args.connect:
            if not args.connect.startswith(("http://", "https://")):
                return f"--connect must be an http:// or https:// URL, got {args.connect!r}"
            for kind, path in (("api", args.api_key_file), ("admin", args.admin_key_file)):
                if path is not None:
                    parse_key_file(path, kind)
            return None
        from .commands.common import check_bundle_option

        check_bundle_option(args)  # the manifest alone, strict: 0.1 s (no weights, no device)
        if not args.observe_only:  # the log the maintenance pane will write (the settings' or the default)
            from sim_backend.planes import AuditLog

            AuditLog(getattr(args, "audit_log", None)).check_writable()
        if args.listen is not None:
            from .commands.serve import load_serving_keys

            host, _ = parse_listen(args.listen)
            load_serving_keys(argparse.Namespace(host=host, api_key=None, api_key_file=args.api_key_file,
                                                 admin_key_file=args.admin_key_file))
        else:
            for kind, path in (("api", args.api_key_file), ("admin", args.admin_key_file)):
                if path is not None:
                    load_keys(kind, key_file=path)
    except (CalError, KeySourceError, ValueError) as e:
        return f"--listen {args.listen}: {e}" if args.listen is not None and not args.connect else str(e)
    return None


def _listen_spec(spec: str) -> str:
    """argparse type of ``--listen``: the spec unchanged once ``parse_listen`` takes it."""
    try:
        parse_listen(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def parse_listen(spec: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6, ``:PORT`` for 127.0.0.1) -> (host, port); ValueError otherwise."""
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0..65535, got {spec!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def start_listening(args: argparse.Namespace, system: LocalSystem, sock: socket.socket | None = None) -> ServerThread:
    """Serve ``system``'s planes over HTTP from a thread of this process (``--listen``); ``sock``: the
    listening socket bound before the device was built (None: bind ``--listen``'s address now)."""
    from .commands.serve import build_face
    from .server.run import ServerThread

    host, port = parse_listen(args.listen)
    args.host, args.port = host, port
    _, face = build_face(args, system)
    return ServerThread(face, host, port, sock=sock).start()


if __name__ == "__main__":
    raise SystemExit(main())
