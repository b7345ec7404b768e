"""``calconsole bench ...``: benchmarks that print figures (never run as timed unit tests)."""

from __future__ import annotations

import importlib

# one module per benchmark: each defines register(bench_subparsers)
BENCH_MODULES = ("bench_calibrate", "bench_sweep", "bench_host", "bench_overlap", "bench_step", "bench_keys",
                 "bench_realtime", "bench_serve", "bench_roadmap", "bench_matrix", "bench_slowloris", "bench_poll",
                 "bench_fleet", "bench_grammar", "bench_replay")


def register(sub, common) -> None:
    p = sub.add_parser("bench", help="benchmarks: calibrate, sweep, host, overlap, step, keys, realtime, serve, poll, "
                                     "grammar, slowloris, fleet, roadmap, matrix, replay",
                       description="Benchmarks that print figures. Simulated device time and host wall "
                                   "time are labelled separately.")
    bsub = p.add_subparsers(title="benchmarks", dest="bench", metavar="BENCH", required=True)
    for name in BENCH_MODULES:
        try:
            mod = importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__package__}.{name}":
                raise
            continue
        mod.register(bsub)
