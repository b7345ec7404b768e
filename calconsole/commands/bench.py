"""``calconsole bench ...``: the verb that dispatches into :mod:`calconsole.bench` (one module per bench,
each with its measuring code and its ``register``; never run as timed unit tests)."""

from __future__ import annotations

import argparse
import importlib
import shutil
import textwrap
from typing import Any

# ``calconsole bench --help`` lists the benches in these groups, in this order (argparse has no groups of
# sub-commands: the listing is the parser's epilog). Each name is a module of calconsole.bench.
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("capacity and performance of the device",
     ("matrix", "serve", "replay", "sweep", "roadmap", "calibrate", "realtime")),
    ("diagnostics of this program",
     ("step", "overlap", "poll", "host", "keys", "grammar", "slowloris", "conncap", "http", "fleet")),
)
BENCH_MODULES = tuple(name for _, names in GROUPS for name in names)


class _Benches:
    """The bench subparsers as a bench's ``register`` sees them: ``add_parser`` is argparse's, but each
    bench's one-line ``help`` is kept for the grouped epilog instead of argparse's flat list."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub
        self.helps: dict[str, str] = {}

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        self.helps[name] = kwargs.pop("help", "") or ""
        parser: argparse.ArgumentParser = self._sub.add_parser(name, **kwargs)
        return parser


def grouped_listing(helps: dict[str, str], width: int | None = None) -> str:
    """The benches under their group headings, each ``  NAME  help`` wrapped to ``width`` columns
    (default: the terminal's, as argparse's own help)."""
    width = width or max(60, shutil.get_terminal_size().columns - 2)
    grouped = [(title, [n for n in names if n in helps]) for title, names in GROUPS]
    pad = max((len(n) for n in helps), default=0) + 4
    out = []
    for title, names in grouped:
        if not names:
            continue
        out.append(f"{title}:")
        for n in names:
            out.append(textwrap.fill(helps[n], width, initial_indent=f"  {n:<{pad - 2}}",
                                     subsequent_indent=" " * pad))
        out.append("")
    return "\n".join(out).rstrip("\n")


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add ``bench`` and, under it, every bench module's parser (``calconsole.bench.<name>.register``)."""
    p = sub.add_parser("bench", help="benchmarks: the device's capacity and performance (matrix, serve, replay, "
                                     "...) and diagnostics of this program (step, poll, keys, ...)",
                       description="Benchmarks that print figures. Simulated device time and host wall "
                                   "time are labelled separately.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    bsub = p.add_subparsers(title="benchmarks", dest="bench", metavar="BENCH", required=True,
                            help="one of the benches below; 'calconsole bench BENCH --help' for its options")
    benches = _Benches(bsub)
    for name in BENCH_MODULES:
        try:
            mod = importlib.import_module(f"calconsole.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"calconsole.bench.{name}":
                raise
            continue
        mod.register(benches)
    p.epilog = grouped_listing(benches.helps)
