"""``calconsole bench host``: the per-token host path (D2H landing -> BF16 -> FP32 -> sample).

Prints the median (and P95) host wall milliseconds per token of the fast
path (preallocated buffers, no full-vocabulary sort) and of a naive
full-sort sampler with a fresh FP32 copy (the production shape, facts.md F6),
measured in the same run. A benchmark figure, never a test assertion.
"""

from __future__ import annotations

import argparse

from ..commands.common import fail, print_json
from . import BenchParsers


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser(
        "host", help="host path per token: fast sampler vs naive full-sort sampler (host wall ms)",
        description="Time the per-token host path over the 151936 BF16 logits of one step (303,872 B D2H "
                    "per token): copy into a landing buffer, BF16 -> FP32, sample (default parameters: "
                    "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, with penalties over 64 recent ids). "
                    "The same run times a naive sampler (fresh FP32 copy, full softmax, full argsort). "
                    "Figures are measured HOST WALL milliseconds per token, not simulated time.")
    p.add_argument("--json", action="store_true",
                   help='print {"median_ms", "naive_median_ms", "p95_ms", "naive_p95_ms", "speedup", ...}')
    p.add_argument("--iterations", type=int, default=200, help="measured tokens per path (default 200)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic logits, an integer in [0, 2**64) (default 0)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sim_backend.tools.bench_host import bench_host

    if not 1 <= args.iterations <= 100_000:
        return fail(f"--iterations must be in 1..100000, got {args.iterations}")
    if not 0 <= args.seed < 2**64:  # the sampler's seed range; numpy refuses negatives with a traceback
        shown = str(args.seed) if abs(args.seed) < 10**30 else f"a {len(str(abs(args.seed)))}-digit number"
        return fail(f"--seed must be an integer in [0, 2**64), got {shown}")
    r = bench_host(iterations=args.iterations, seed=args.seed)
    r["speedup"] = r["naive_median_ms"] / r["median_ms"] if r["median_ms"] > 0 else None
    r["unit"] = "host wall ms per token"
    if args.json:
        print_json(r)
    else:
        print(f"host path per token ({r['iterations']} tokens, vocab {r['vocab']}; host wall time)")
        print(f"  fast : median {r['median_ms']:.3f} ms   p95 {r['p95_ms']:.3f} ms")
        print(f"  naive: median {r['naive_median_ms']:.3f} ms   p95 {r['naive_p95_ms']:.3f} ms")
        if r["speedup"] is not None:
            print(f"  fast is {r['speedup']:.1f}x the naive sampler")
    return 0
