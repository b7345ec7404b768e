"""``calconsole audit``: print the maintenance audit log (one row per action; crashed actions marked)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from .common import Subparsers, add_connect_options, connect_from_args, fail, print_json

DEFAULT_TAIL = 1000
#: the table's width limit when the output is not a terminal: wide enough that no cell is ever folded
PIPED_WIDTH = 1 << 16


def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("audit", help="print the maintenance audit log",
                       description="Print the maintenance audit log: one row per maintenance call, granted or "
                                   "refused, with OS user, arguments, result and duration (wall ms; sim ms is "
                                   "simulated device time). An action with a 'started' record and no 'finished' "
                                   "one is shown as 'did not finish' (the process crashed or was killed). "
                                   "A damaged log is still read: each unreadable line (not UTF-8, not a JSON "
                                   "audit record) is shown as 'corrupt' with its line number and counted on "
                                   "stderr; the exit code stays 0. A path that is not a regular file (a FIFO, "
                                   "a directory) is refused with exit code 2. With --connect URL (and the admin "
                                   "key) the log is the running server's, read over HTTP. Only the last "
                                   f"{DEFAULT_TAIL} entries by default, read from the end of the log without "
                                   "reading the rest (--tail N for another count, --all for every entry, the "
                                   "rotated files <log>.1, .2 ... included).")
    # SUPPRESS: do not clobber a top-level ``calconsole --audit-log X audit``
    p.add_argument("--audit-log", metavar="PATH", default=argparse.SUPPRESS,
                   help="audit log (default: $CALCONSOLE_AUDIT_LOG or the user state dir)")
    p.add_argument("--json", action="store_true", help="print JSON (a list of entries)")
    p.add_argument("--raw", action="store_true", help="the raw started/finished records, as JSON")
    p.add_argument("--tail", type=int, default=None, metavar="N",
                   help=f"only the last N entries (default {DEFAULT_TAIL}), read from the end of the log")
    p.add_argument("--all", action="store_true", help="every entry, the rotated files included (reads them all)")
    add_connect_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from sim_backend.planes import AuditLog, AuditLogError, CalError, summarize

    if args.tail is not None and args.tail < 1:
        return fail(f"--tail must be >= 1, got {args.tail}")
    if args.tail is not None and args.all:
        return fail("give --tail N or --all, not both")
    tail = None if args.all else (args.tail or DEFAULT_TAIL)
    more = False
    # --audit-log on the command line; a default from the settings or $CALCONSOLE_AUDIT_LOG is not one given
    named = getattr(args, "audit_log", None) is not None and not getattr(args, "audit_log_from_settings", False)
    if args.connect:
        if args.raw:
            return fail("--raw reads the log file itself; over HTTP (--connect) the server gives its entries")
        try:
            with connect_from_args(args, admin=True) as remote:
                assert remote.maintenance is not None
                if remote.kind == "llama-server":
                    # a llama-server keeps no audit log: its calls were audited here, with their origin
                    records = [e for e in remote.maintenance.audit.entries()
                               if (e.get("origin") or {}).get("server") == remote.url][-(tail or 10_000):]
                    where = f"{remote.maintenance.audit.path} (entries for {remote.url})"
                elif named:
                    return fail("--audit-log names a local file; with --connect the server's log is read")
                else:
                    from ..remote.maintenance import AUDIT_LIMIT

                    records = remote.maintenance.audit.entries(limit=min(tail or AUDIT_LIMIT, AUDIT_LIMIT))
                    where = f"{remote.url} · {remote.maintenance.audit.path}"
        except (CalError, ValueError) as e:
            return fail(str(e))
        entries = records
        n_corrupt = sum(1 for r in records if r.get("status") == "corrupt")
    else:
        log = AuditLog(getattr(args, "audit_log", None))
        where = str(log.path)
        # a path the user named that holds no log (a typo) is an error; the default log not yet written is not
        if named and not log.path.exists() and not log.rotated_paths():
            return fail(f"no audit log at {log.path}: --audit-log names a file that does not exist")
        try:
            if tail is None:
                records = log.read_all()
            elif args.raw:
                records, more = log.tail_records(tail)
            else:
                entries, records, more = log.tail_read(tail)
        except AuditLogError as e:
            return fail(str(e))
        except OSError as e:
            return fail(f"cannot read audit log {log.path}: {e.strerror or e}")
        n_corrupt = sum(1 for r in records if "corrupt" in r and "phase" not in r)
        if tail is None or args.raw:
            entries = records if args.raw else summarize(records)
    if n_corrupt:
        print(f"calconsole: warning: {n_corrupt} of {len(records)} lines of {where} are unreadable "
              f"(shown as corrupt); the rest was read", file=sys.stderr)
    if tail is not None:
        entries = entries[-tail:]
    if more:
        print(f"calconsole: the last {len(entries)} entries of {where}; older ones exist (--tail N, --all)",
              file=sys.stderr)
    if args.json or args.raw:  # raw records have no table form: --raw implies JSON
        print_json(entries)
        return 0
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    c = Console()
    # piped (not a terminal) and no $COLUMNS: every entry on one line at its full length, as ls -l and ps do,
    # not folded at rich's 80-column default (a pipe has no width); a terminal's width is used as it is
    full = not c.is_terminal and not os.environ.get("COLUMNS")
    if full:
        c = Console(width=PIPED_WIDTH)
    if not records:
        c.print(Text(f"no audit records in {where}"))
        return 0
    users = sorted({_who(e) for e in entries if _who(e)})
    one_user = len(users) <= 1
    # Text, not markup: the path and the user names come from outside ("[/]" in a damaged log)
    title = Text(f"maintenance audit log · {where}" + (f" · by {users[0]}" if one_user and users else ""))
    t = Table(title=title, title_justify="left", expand=not full)
    t.add_column("time", no_wrap=True)
    if not one_user:
        t.add_column("who")  # the OS user, or for a call over HTTP the admin key's label and the address
    t.add_column("action", overflow="fold", ratio=1, min_width=19)
    t.add_column("status", no_wrap=True)
    t.add_column("result", overflow="fold", ratio=2, min_width=20)
    t.add_column("wall ms", justify="right", no_wrap=True)
    t.add_column("sim ms", justify="right", no_wrap=True)
    styles = {"granted": "green", "ok": "green", "refused": "yellow", "failed": "red", "not as expected": "red",
              "did not finish": "bold red", "corrupt": "bold red", "not run": "yellow"}
    for ent in entries:
        action = Text(ent["action"], style="bold")
        if ent["args"]:
            action.append((" " if full else "\n") + _kv(ent["args"]), style="dim")
        row = [Text(ent["time"][11:19] or "?")] + ([] if one_user else [Text(_who(ent))]) + [
            action, Text(ent["status"], style=styles.get(ent["status"], "")), Text(brief(ent["result"])),
            Text("" if ent["duration_ms"] is None else f"{ent['duration_ms']:.1f}"),
            Text("" if ent["sim_ms"] is None else f"{ent['sim_ms']:.1f}")]
        t.add_row(*row)
    c.print(t)
    if n_corrupt:
        c.print(Text(f"{n_corrupt} unreadable line{'s' if n_corrupt > 1 else ''} shown as corrupt", style="bold red"))
    return 0


def _kv(d: object) -> str:
    if not isinstance(d, dict):
        return "" if d is None else str(d)
    return " ".join(f"{k}={v}" for k, v in d.items() if not isinstance(v, (dict, list)))


def brief(result: object, limit: int = 120) -> str:
    """A one-line summary of an action's result for the table (the JSON has all of it)."""
    if result is None:
        return ""
    if not isinstance(result, dict):
        text = str(result)
    else:
        parts = []
        for key in ("detail", "status", "holder", "path", "armed", "disarmed", "name", "value", "new"):
            if key in result and result[key] not in (None, "", []):
                parts.append(f"{key}={result[key]}")
        if isinstance(result.get("health"), dict):
            parts.append(f"health: {result['health'].get('detail')}")
        if isinstance(result.get("error"), dict):
            parts.append(f"{result['error'].get('type')}: {result['error'].get('message')}")
        if isinstance(result.get("drain"), dict):
            d = result["drain"]
            parts.append(f"drained {d.get('drained')} cancelled {d.get('cancelled')}")
        text = "; ".join(parts) or _kv(result)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _who(ent: dict[str, Any]) -> str:
    """Who made the call: the OS user of an in-process call; over HTTP the key's label (never the key) and the
    peer address ("ops-admin from 127.0.0.1:50412"; "no valid key from ..." for a refused authentication)."""
    origin = ent.get("origin") if isinstance(ent.get("origin"), dict) else None
    if origin is None:
        return str(ent.get("user") or "")
    key = origin.get("key")
    name = "no valid key" if key in (None, "?", "(none)") else str(key)
    remote = origin.get("remote") or origin.get("server")
    return f"{name} from {remote}" if remote else name
