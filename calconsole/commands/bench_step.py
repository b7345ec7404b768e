"""``calconsole bench step``: host wall time per decode step, in-process numerics vs the console's worker.

Serves greedy requests on a fresh numeric system with fast pacing (no
real-time sleeps) and records the wall clock at the end of every device
step. A decode step's wall time is the gap between two consecutive decode
steps of one request: sampling, detokenising, KV bookkeeping, submit, the
numerics (in this process, or in the spawned worker the console uses,
``numerics_process=True``) and every copy in between. Requests are short
(``--tokens-per-request``) so the context stays near ``--context`` tokens.
Also reported: this process's CPU milliseconds per decode step (all its
threads; with the worker, the numerics' CPU is the worker's and not
counted), which a loaded machine disturbs less than wall time.
Host wall / CPU milliseconds, never simulated time; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
from typing import Any

from sim_backend.planes import CalError
from sim_backend.tools.step_bench import MODES, measure_step  # noqa: F401 (re-exported for tests)

from .common import fail, print_json


def register(bsub) -> None:
    p = bsub.add_parser("step", help="host wall ms per decode step: in-process numerics vs the console's worker",
                        description=__doc__.replace("``", "").split("\n\n")[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="decode steps measured per mode (default 200)")
    p.add_argument("--context", type=int, default=100, help="approximate context tokens per step (default 100)")
    p.add_argument("--tokens-per-request", type=int, default=50,
                   help="tokens per request; keeps the context near --context (default 50)")
    p.add_argument("--mode", choices=("both", *MODES), default="both", help="which numerics placement (default both)")
    p.add_argument("--bundle", metavar="DIR", default=None, help="calbin bundle directory (default: built-in)")
    p.add_argument("--json", action="store_true", help='print {"in-process": {...}, "worker": {...}, "unit": ...}')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.steps <= 100_000:
        return fail(f"--steps must be in 1..100000, got {args.steps}")
    if not 1 <= args.context <= 4000:
        return fail(f"--context must be in 1..4000, got {args.context}")
    if not 2 <= args.tokens_per_request <= 4096:
        return fail(f"--tokens-per-request must be in 2..4096, got {args.tokens_per_request}")
    modes = list(MODES) if args.mode == "both" else [args.mode]
    rep: dict[str, Any] = {}
    try:
        for m in modes:
            r = measure_step(MODES[m], steps=args.steps, context=args.context,
                             tokens_per_request=args.tokens_per_request, bundle=args.bundle)
            r.pop("token_ids")
            rep[m] = r
    except (CalError, ValueError) as e:
        return fail(str(e))
    rep["unit"] = "host wall ms per decode step (fast pacing)"
    if args.json:
        print_json(rep)
        return 0
    print(f"wall time per decode step (host wall ms, fast pacing, {args.steps} steps per mode)")
    for m in modes:
        r = rep[m]
        print(f"  {m:11}: median {r['median_ms']:.3f} ms   p95 {r['p95_ms']:.3f} ms   "
              f"(device thread numerics median {r['device_compute_median_ms']:.3f} ms; "
              f"this process's CPU median {r['process_cpu_median_ms']:.3f} ms; "
              f"context {r['context_min']}..{r['context_max']})")
    return 0
