"""Options shared by the console and headless commands, and building the system from them."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from sim_backend.compose import NUMERIC_PROMPT_LIMIT, Pacing, PacingMode

if TYPE_CHECKING:
    from sim_backend.compose import System

    from ..remote import RemoteSystem
    from ..remote.llamacpp import LlamaServerSystem

#: what ``ArgumentParser.add_subparsers`` returns; each command's ``register(sub, common)`` adds its parser to it
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
#: what ``build_or_connect`` gives: a fresh in-process System, or the planes of a calconsole server or a llama-server
AnySystem: TypeAlias = "System | RemoteSystem | LlamaServerSystem"
#: the in-process System, named here for the console (which imports no part of the simulator itself)
LocalSystem: TypeAlias = "System"

# Defaults of the shared options. Sub-command parsers register the options with
# SUPPRESS so a value given before the sub-command (``calconsole --bundle D
# snapshot``) is not overwritten by the sub-parser's default; ``finalize``
# fills in whatever is still missing.
COMMON_DEFAULTS = {"bundle": None, "speed": 1.0, "timing_only": False, "slots": 4, "audit_log": None,
                   "connect": None, "api_key_file": None, "admin_key_file": None, "numeric_limit": None,
                   "host_time": "modeled"}

# --speed: at 0.1 the longest step without a fault (a 2048-token prefill chunk at full
# context, ~3.7 s simulated) takes ~37 s of wall time, well inside the engine's 120 s step
# timeout; above 1000 the host cannot compute steps that fast anyway (use --pacing fast).
# The pacing API below accepts a wider range (Pacing.MIN_SPEED .. MAX_SPEED).
CLI_SPEED_RANGE = (0.1, 1000.0)
SLOTS_RANGE = (1, 32)
# --numeric-limit: 1 token up to the calbin context (40960, facts.md F4); longer prompts cannot exist
NUMERIC_LIMIT_RANGE = (1, 40960)


def add_common_options(p: argparse.ArgumentParser, *, default_pacing: str, top_level: bool = False) -> None:
    def d(name: str) -> str:
        # SUPPRESS at the top level too: finalize fills the defaults and so knows what was given
        # (with --connect a given simulator option is named as not applied)
        return argparse.SUPPRESS

    g = p.add_argument_group("simulator")
    g.add_argument("--bundle", metavar="NAME|DIR", default=d("bundle"),
                   help="calbin bundle: an installed bundle's name (qwen3-30b-a3b, its -b4/-b8/-b16 variants, "
                        "smollm2-135m-pilot) or a directory (default: the built-in Qwen3-30B-A3B simulator bundle)")
    g.add_argument("--pacing", choices=[m.value for m in PacingMode], default=None if top_level else argparse.SUPPRESS,
                   help=f"map simulated device time to wall time: realtime or fast (default: {default_pacing})")
    g.add_argument("--speed", type=float, default=d("speed"),
                   help=f"with --pacing realtime: simulated seconds per wall second, {CLI_SPEED_RANGE[0]:g} to "
                        f"{CLI_SPEED_RANGE[1]:g} (default 1.0)")
    g.add_argument("--timing-only", action="store_true", default=d("timing_only"),
                   help="skip the numerics (no logits; tokens from a seeded generator). Steps are priced the same way, "
                        "but prefill uses the expected number of experts touched instead of the router's choices")
    g.add_argument("--numeric-limit", type=int, metavar="N", default=d("numeric_limit"),
                   help="a request that must prefill more than N new prompt tokens (a cached prefix not "
                        "counted) runs timing-only (its tokens from the seeded generator; the reply says so). "
                        f"Default {NUMERIC_PROMPT_LIMIT}: the longest prompt whose numeric prefill kept real time "
                        "on the reference host (calconsole bench realtime measures this one)")
    g.add_argument("--host-time", choices=("modeled", "measured"), default=d("host_time"),
                   help="host work put on the simulated clock: 'modeled' books the real serving host's "
                        "fitted allowance per token (0.204 ms, fitted to the report's end-to-end figure; "
                        "timings then do not depend on this machine), 'measured' books this machine's own "
                        "host work (default: modeled)")
    g.add_argument("--slots", type=int, default=d("slots"),
                   help=f"concurrent request slots, {SLOTS_RANGE[0]} to {SLOTS_RANGE[1]} (default 4)")
    g.add_argument("--audit-log", metavar="PATH", default=d("audit_log"),
                   help="maintenance audit log (default: $CALCONSOLE_AUDIT_LOG or the user state dir); "
                        "checked writable at start-up; 'serve' creates the file (and missing directories) once its "
                        "start-up checks pass, other commands with their first record, so a refused command leaves "
                        "nothing on disk")
    p.set_defaults(preferred_pacing=default_pacing)


def add_connect_options(p: argparse.ArgumentParser, *, admin: bool = True, top_level: bool = False) -> None:
    """``--connect URL [--api-key-file F] [--admin-key-file F]``: act on a running server's device."""
    d = None if top_level else argparse.SUPPRESS
    g = p.add_argument_group("attach to a running device (calconsole serve, or a console started with --listen)")
    g.add_argument("--connect", metavar="URL", default=d,
                   help="act on the live device served at URL (http://host:port) instead of a fresh in-process "
                        "simulator; the simulator options are then the server's")
    g.add_argument("--api-key-file", metavar="FILE", default=d,
                   help="file holding the server's API key (mode 600; or $CALCONSOLE_API_KEY)")
    if admin:
        g.add_argument("--admin-key-file", metavar="FILE", default=d,
                       help="file holding the server's admin key, for maintenance over HTTP (mode 600; or "
                            "$CALCONSOLE_ADMIN_KEY)")


def ignored_simulator_options(args: argparse.Namespace, kind: str = "calconsole") -> list[str]:
    """The simulator options given on the command line (``--host-time modeled`` ...), as typed
    (``finalize`` records which); with ``--connect`` they cannot apply: the server built its device.
    ``--audit-log`` does apply to a llama-server (``kind``): its maintenance calls are audited locally."""
    given: frozenset[str] = getattr(args, "given_options", frozenset())
    out = []
    for opt, key in (("--bundle", "bundle"), ("--pacing", "pacing"), ("--speed", "speed"),
                     ("--timing-only", "timing_only"), ("--numeric-limit", "numeric_limit"),
                     ("--host-time", "host_time"), ("--slots", "slots"), ("--audit-log", "audit_log")):
        if key in given and not (key == "audit_log" and kind == "llama-server"):
            v = getattr(args, key)
            out.append(opt if v is True else f"{opt} {v:g}" if isinstance(v, float) else f"{opt} {v}")
    return out


def connect_from_args(args: argparse.Namespace, *, admin: bool = False) -> RemoteSystem | LlamaServerSystem:
    """The attached system of ``--connect`` (keys from the files or the environment): a ``RemoteSystem``
    (calconsole serve) or a ``LlamaServerSystem`` (a stock llama-server; ``system.kind`` says which).

    ``admin``: the command needs the maintenance plane (a calconsole server then requires the admin key;
    a llama-server has no admin routes: its maintenance plane is its own slot actions, audited in the
    LOCAL log ``--audit-log``, which is checked for writability). Raises ValueError with a one-line
    message for an unusable key file, an unreachable server, a refused key or a URL that is neither kind.
    """
    from sim_backend.planes import CalError, MaintenanceRefused

    from ..remote import RemoteAuthError, ServerUnreachable, connect
    from ..server.keys import ENV_ADMIN_KEY, ENV_API_KEY, KeySourceError, parse_key_file

    def key(kind: str, path: str | None, var: str) -> str | None:
        if path is not None:
            try:
                return parse_key_file(path, kind)[0][1]
            except KeySourceError as e:
                raise ValueError(str(e)) from None
        return os.environ.get(var) or None

    api = key("api", getattr(args, "api_key_file", None), ENV_API_KEY)
    adm = key("admin", getattr(args, "admin_key_file", None), ENV_ADMIN_KEY) if admin else None
    url = args.connect
    try:
        # connect's own return is untyped (it imports the llama-server planes lazily): its two kinds
        system: RemoteSystem | LlamaServerSystem = connect(url, api_key=api, admin_key=adm,
                                                           audit_path=getattr(args, "audit_log", None))
        if system.kind == "llama-server":
            if admin or getattr(args, "audit_log", None) is not None:
                from sim_backend.planes import AuditLog

                AuditLog(getattr(args, "audit_log", None)).check_writable()  # the local log its actions go to
        elif admin and adm is None:
            system.close()
            raise ValueError("maintenance over HTTP needs the server's admin key: give --admin-key-file "
                             "(or $CALCONSOLE_ADMIN_KEY)")
        ignored = ignored_simulator_options(args, kind=system.kind)
        if ignored:  # the server's device answers as the server was started: say so, do not look obeyed
            print(f"note: {', '.join(ignored)}: with --connect the simulator options are the server's, "
                  "not applied here", file=sys.stderr)
        return system
    except ServerUnreachable as e:
        raise ValueError(f"cannot attach: {e}") from None
    except RemoteAuthError:
        what = "refused the API key" if api else "needs an API key (none was given)"
        raise ValueError(f"{url} {what}: give the server's key with --api-key-file "
                         "(or $CALCONSOLE_API_KEY)") from None
    except MaintenanceRefused as e:
        raise ValueError(f"{url}: {e.reason}") from None
    except CalError as e:
        raise ValueError(f"cannot attach to {url}: {e}") from None


def build_or_connect(args: argparse.Namespace, *, maintenance: bool = False,
                     **kw: Any) -> AnySystem:
    """``connect_from_args`` with ``--connect``, else ``build_from_args`` (a fresh in-process device)."""
    if getattr(args, "connect", None):
        return connect_from_args(args, admin=maintenance)
    return build_from_args(args, maintenance=maintenance, **kw)


def device_origin(system: Any) -> str:
    """What the output describes: the live device at a URL, or a fresh in-process simulator."""
    url = getattr(system, "url", None)
    if getattr(system, "kind", None) == "llama-server":
        return f"the {system.describe()}"
    return f"the live device at {url}" if url else "a fresh in-process simulated device (--connect URL attaches " \
                                                   "to a running one)"


def finalize(args: argparse.Namespace) -> argparse.Namespace:
    """Fill shared options not given anywhere; pacing defaults per command (console: realtime, headless: fast)."""
    given = {k for k in COMMON_DEFAULTS if hasattr(args, k)}
    if getattr(args, "pacing", None) is not None:
        given.add("pacing")
    args.given_options = frozenset(given)
    for k, v in COMMON_DEFAULTS.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    if getattr(args, "pacing", None) is None:
        args.pacing = getattr(args, "preferred_pacing", "realtime")
    return args


def check_common(args: argparse.Namespace, *, maintenance: bool, audit_log: bool = True) -> None:
    """Check the shared options before anything is built; raises ValueError or AuditLogError
    (a CalError) with a one-line message naming the option.

    The audit log is checked for writability (``AuditLog.check_writable``, which creates
    nothing: the first record creates the log and its directories) when it was given explicitly
    or when ``maintenance`` (a maintenance plane will write to it), so an unusable path is
    refused at start-up, not at the first action, and a refused or failed command leaves nothing;
    ``audit_log=False`` skips that (``calconsole audit`` only reads the log).
    """
    from sim_backend.planes import AuditLog

    lo, hi = CLI_SPEED_RANGE
    if not lo <= args.speed <= hi:  # also refuses nan
        raise ValueError(f"--speed must be between {lo:g} and {hi:g} simulated s per wall s, got {args.speed:g}")
    if not SLOTS_RANGE[0] <= args.slots <= SLOTS_RANGE[1]:
        raise ValueError(f"--slots must be in {SLOTS_RANGE[0]}..{SLOTS_RANGE[1]}, got {args.slots}")
    lim = getattr(args, "numeric_limit", None)
    if lim is not None and not NUMERIC_LIMIT_RANGE[0] <= lim <= NUMERIC_LIMIT_RANGE[1]:
        raise ValueError(f"--numeric-limit must be in {NUMERIC_LIMIT_RANGE[0]}..{NUMERIC_LIMIT_RANGE[1]} "
                         f"prompt tokens, got {lim}")
    # with --connect the server keeps the audit log: a local path is named as not applied, not created;
    # the settings' audit_log (cli.main) is a default, checked where maintenance runs like the built-in one
    given = args.audit_log is not None and not getattr(args, "audit_log_from_settings", False)
    if audit_log and not getattr(args, "connect", None) and (maintenance or given):
        AuditLog(args.audit_log).check_writable()


def check_bundle_option(args: argparse.Namespace) -> None:
    """Load ``--bundle``'s manifest (strict, ~0.1 s, nothing built); raises ManifestError (a CalError)."""
    from sim_backend.compose import check_bundle

    check_bundle(getattr(args, "bundle", None))


def build_from_args(args: argparse.Namespace, *, maintenance: bool = True, **kw: Any) -> System:
    """Build the System from common options (after ``check_common``).
    Raises ManifestError / ValueError / AuditLogError on bad input."""
    from sim_backend.compose import build_system

    check_common(args, maintenance=maintenance)
    lim = getattr(args, "numeric_limit", None)
    if lim is not None:
        kw.setdefault("numerics_max_prompt", lim)
        kw.setdefault("numerics_limit_reason", "--numeric-limit")
    return build_system(args.bundle, pacing=Pacing(PacingMode(args.pacing), args.speed),
                        numerics=not args.timing_only, n_slots=args.slots, maintenance=maintenance,
                        audit_path=args.audit_log, host_time=getattr(args, "host_time", "modeled"), **kw)


MAX_PROMPT_BYTES = 8 << 20  # far more than the 40,960-token context holds; bounds what is read


def read_prompt(arg: str) -> str:
    """The prompt argument, or stdin when it is ``-``, as text.

    Both are taken as UTF-8 (stdin whatever the locale; a leading BOM is dropped) and
    decoded strictly: input that is not UTF-8 text is refused rather than silently
    changed. stdin is read up to MAX_PROMPT_BYTES. Raises ValueError with a one-line
    message (offset and byte of the first invalid sequence).
    """
    if arg == "-":
        data = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
        if len(data) > MAX_PROMPT_BYTES:
            raise ValueError(f"stdin is longer than {MAX_PROMPT_BYTES >> 20} MiB; "
                             f"the context holds 40960 tokens (far less text)")
        where = "stdin"
    else:
        # undecodable bytes of argv arrive as lone surrogates (PEP 383): get the bytes back
        where = "the prompt argument"
        try:
            data = arg.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError as e:
            raise ValueError(f"{where} is not valid text: lone surrogate at offset {e.start}") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{where} is not UTF-8 text: byte 0x{data[e.start]:02x} at offset {e.start} "
                         f"({e.reason}); convert it first, e.g. with iconv") from None


def prepare_output_file(path: str | Path, option: str = "--out") -> bool:
    """Check before any work that ``path`` can be written; returns True if this call created it
    (so a caller whose run fails can remove the empty file again).

    Refuses, with ValueError and a one-line message naming ``option``: a missing directory,
    a directory, an existing non-regular file (a device or FIFO: writing a trace to
    /dev/sda would be a disaster, to a FIFO would block), a path on a kernel
    pseudo-filesystem (/proc, /sys, /dev), and a file that opens but refuses a
    zero-length probe write. An existing regular file is opened without truncation, so
    it is unchanged until the caller writes it.
    """
    from sim_backend.planes import pseudo_filesystem

    out = Path(path)
    if not str(path):
        raise ValueError(f"{option} is empty")
    try:
        if not out.parent.exists():
            raise ValueError(f"directory of {option} does not exist: {out.parent}")
        if out.is_dir():
            raise ValueError(f"{option} is a directory, not a file: {out}")
        existed = out.exists() or out.is_symlink()
        if existed:
            mode = os.stat(out).st_mode
            if not stat.S_ISREG(mode):
                raise ValueError(f"{option} is not a regular file (a device, FIFO or socket): {out}")
    except OSError as e:  # a symlink loop, a name too long
        raise ValueError(f"{option} cannot be used: {e.strerror or e}: {out}") from None
    pseudo = pseudo_filesystem(out)
    if pseudo is not None:
        raise ValueError(f"{option} is on the {pseudo[0]} pseudo-filesystem ({pseudo[1]}), which holds kernel "
                         f"interfaces, not files: {out}")
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except OSError as e:
        raise ValueError(f"{option} is not writable: {e.strerror or e}: {out}") from None
    try:
        os.write(fd, b"")  # zero bytes: changes nothing, fails where a real write would
    except OSError as e:
        raise ValueError(f"{option} is not writable (a probe write failed: {e.strerror or e}): {out}") from None
    finally:
        os.close(fd)
    return not existed


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str, ensure_ascii=False)
    sys.stdout.write("\n")


def fail(msg: str, code: int = 2) -> int:
    print(f"calconsole: error: {msg}", file=sys.stderr)
    return code
