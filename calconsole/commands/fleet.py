"""``calconsole fleet``: the boards of a fleet, headless (a table, or JSON lines for scripts), and the
Prometheus scrape configuration for them.

    calconsole fleet --fleet boards.yaml               # one table, worst first
    calconsole fleet --connect URL --connect URL --json --watch --count 10
    calconsole fleet prometheus-config --fleet boards.yaml --out prometheus.yml

The full-screen fleet view is ``calconsole --fleet FILE`` (or ``calconsole --connect URL --connect URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .common import Subparsers, fail

if TYPE_CHECKING:
    from ..fleet.config import FleetConfig
    from ..fleet.sample import BoardSample

MAX_COUNT = 1_000_000


class ConnectAction(argparse.Action):
    """``--connect URL``, repeatable: ``connect`` holds the first URL (what single-board commands read),
    ``connect_urls`` every one given (two or more open the fleet view)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        urls = list(getattr(namespace, "connect_urls", None) or [])
        urls.append(values)
        namespace.connect_urls = urls
        namespace.connect = urls[0]


def add_fleet_source(p: argparse.ArgumentParser, *, top_level: bool = False) -> None:
    """``--fleet FILE``; the sub-command also takes ``--connect URL`` (repeatable)."""
    p.add_argument("--fleet", metavar="FILE", default=None if top_level else argparse.SUPPRESS,
                   help="fleet file (YAML: refresh_hz, timeout_s, boards: [{name, url, api_key_file, "
                        "admin_key_file}]); opens the fleet view (one row per board, worst first)")


def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("fleet", help="the boards of a fleet: one row per board, worst first (headless)",
                       description="Poll every board of a fleet (one calconsole serve or llama-server per board; "
                                   "each on its own task with its own back-off) and print one row per board, "
                                   "worst first. calconsole boards report simulated device time (sim); a "
                                   "llama-server's rate is its counters over wall time (wall); n/r = not "
                                   "reported by that server.")
    p.add_argument("action", nargs="?", default="show", choices=("show", "prometheus-config"),
                   help="show (default): the boards' rows; prometheus-config: a scrape configuration with one "
                        "job per board (the API key file as bearer credentials file)")
    add_fleet_source(p)
    p.add_argument("--connect", metavar="URL", action=ConnectAction, default=argparse.SUPPRESS,
                   help="a board's URL (repeat for more boards); names are host-port")
    p.add_argument("--api-key-file", metavar="FILE", default=argparse.SUPPRESS,
                   help="with --connect: the API key file for every board (a fleet file names one per board)")
    p.add_argument("--json", action="store_true", help="one JSON object per board per sample (JSON lines)")
    p.add_argument("--watch", action="store_true", help="keep sampling (JSON lines) until Ctrl-C or --count")
    p.add_argument("--count", type=int, default=None, metavar="N",
                   help=f"with --watch: stop after N samples of every board (1..{MAX_COUNT})")
    p.add_argument("--out", metavar="FILE", default=None, help="prometheus-config: write here (default stdout)")
    p.set_defaults(func=run)


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    """The ``FleetConfig`` of ``--fleet FILE`` or of the ``--connect`` URLs; FleetConfigError otherwise."""
    from ..fleet.config import FleetConfigError, from_urls, load_fleet

    urls = getattr(args, "connect_urls", None) or ([args.connect] if getattr(args, "connect", None) else None)
    if args.fleet and urls:
        raise FleetConfigError("--fleet", "--connect", "give a fleet file or --connect URLs, not both")
    if args.fleet:
        return load_fleet(args.fleet)
    if urls:
        return from_urls(list(urls), api_key_file=getattr(args, "api_key_file", None),
                         admin_key_file=getattr(args, "admin_key_file", None))
    raise FleetConfigError("--fleet", "--fleet", "give --fleet FILE or one --connect URL per board")


def run(args: argparse.Namespace) -> int:
    from ..fleet.config import FleetConfigError
    from ..server.keys import KeySourceError

    try:
        config = fleet_config(args)
        if args.action == "prometheus-config":
            text = prometheus_config(config)
            if args.out:
                from .common import prepare_output_file

                prepare_output_file(args.out)
                with open(args.out, "w", encoding="utf-8") as fh:
                    fh.write(text)
                print(f"calconsole fleet: scrape configuration for {len(config.boards)} boards written to "
                      f"{args.out}", file=sys.stderr)
            else:
                sys.stdout.write(text)
            return 0
        if args.count is not None and not 1 <= args.count <= MAX_COUNT:
            raise ValueError(f"--count must be in 1..{MAX_COUNT}, got {args.count}")
        if args.count is not None and not args.watch:
            raise ValueError("--count needs --watch")
        return asyncio.run(_show(config, json_lines=args.json or args.watch, watch=args.watch, count=args.count))
    except (FleetConfigError, KeySourceError, ValueError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return 130


async def _show(config: FleetConfig, *, json_lines: bool, watch: bool, count: int | None) -> int:
    from ..fleet.poller import FleetMonitor
    from ..fleet.sample import rank

    monitor = FleetMonitor(config)
    try:
        if not watch:
            samples = rank(await monitor.poll_all_once())
            if json_lines:
                for s in samples:
                    print(json.dumps(s.to_json(), separators=(",", ":")), flush=True)
            else:
                _print_table(samples)
            return 0 if all(s.state == "up" for s in samples) else 1
        # --watch: every board on its own task; a line per board per sample as it arrives
        seen: dict[str, int] = {b.name: 0 for b in config.boards}
        done = asyncio.Event()

        def emit(sample: BoardSample) -> None:
            if count is not None and seen[sample.name] >= count:
                return
            seen[sample.name] += 1
            print(json.dumps(sample.to_json(), separators=(",", ":")), flush=True)
            if count is not None and all(n >= count for n in seen.values()):
                done.set()

        monitor.on_change = emit
        monitor.start()
        await done.wait()
        return 0
    finally:
        await monitor.stop()


def _print_table(samples: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..fleet.view import cells, columns_for
    from ..settings import Settings

    settings, now = Settings(), time.time()
    console = Console()
    table = Table(title="calconsole fleet: worst first (sim = simulated device time, wall = server wall time, "
                        "n/r = not reported)", title_justify="left", box=None, pad_edge=False)
    keys = [c for c in columns_for(console.width) if c[0] != "history"]
    for _, header, _, _ in keys:
        table.add_column(header)
    for s in samples:
        row = cells(s, [], settings, now)
        table.add_row(*(row[k] for k, _, _, _ in keys))
    console.print(table)
    for s in samples:
        if s.state != "up":
            print(f"{s.name}: {s.state}: {s.error}", file=sys.stderr)


def prometheus_config(config: FleetConfig) -> str:
    """A Prometheus ``scrape_configs`` document: one job per board, ``/metrics`` at the board's URL, its API
    key file as the bearer ``credentials_file``. Raises ValueError for a key file Prometheus cannot use
    as it is (Prometheus sends the whole file, trimmed, as the token: labels, comments or several keys
    would be sent as part of it)."""
    from urllib.parse import urlsplit

    import yaml

    from ..server.keys import parse_key_file

    jobs = []
    for b in config.boards:
        parts = urlsplit(b.url)
        job: dict[str, Any] = {
            "job_name": f"calconsole-{b.name}",
            "scheme": parts.scheme,
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [parts.netloc], "labels": {"board": b.name}}],
        }
        if b.api_key_file:
            keys = parse_key_file(b.api_key_file, "api")
            with open(b.api_key_file, encoding="utf-8") as fh:
                raw = fh.read().strip()
            if len(keys) != 1 or raw != keys[0][1]:
                raise ValueError(f"board {b.name}: API key file {b.api_key_file} holds a label, a comment or "
                                 "several keys; Prometheus sends the whole file as the token: give it a file "
                                 "with the key alone")
            job["authorization"] = {"type": "Bearer", "credentials_file": b.api_key_file}
        jobs.append(job)
    head = ("# Prometheus scrape configuration for a calconsole fleet (calconsole fleet prometheus-config):\n"
            "# one job per board; calconsole serve and llama-server both expose llamacpp: families at /metrics.\n")
    return head + yaml.safe_dump({"scrape_configs": jobs}, sort_keys=False)
