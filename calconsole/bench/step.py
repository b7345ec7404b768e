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
Beside every wall figure: the simulated device time of the same step (cost model), so a host
slower than the simulated device is visible (real-time pacing then falls behind by the ratio).
``--context 128,1024`` measures several contexts; ``--prefill 128,512`` also times one prefill
of exactly that many prompt tokens. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
from typing import Any

from sim_backend.planes import CalError
from sim_backend.tools.step_bench import MODES, measure_prefill, measure_step  # noqa: F401 (re-exported for tests)

from ..commands.common import fail, print_json
from . import BenchParsers


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("step", help="host wall ms per decode step: in-process numerics vs the console's worker",
                        description=__doc__.replace("``", "").split("\n\n")[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="decode steps measured per mode (default 200)")
    p.add_argument("--context", default="100",
                   help="approximate context tokens per step, or a comma list (e.g. 128,1024; default 100)")
    p.add_argument("--prefill", default="", metavar="N[,N]",
                   help="also time one prefill of exactly N prompt tokens (e.g. 128,512)")
    p.add_argument("--tokens-per-request", type=int, default=50,
                   help="tokens per request; keeps the context near --context (default 50)")
    p.add_argument("--mode", choices=("both", *MODES), default="both", help="which numerics placement (default both)")
    p.add_argument("--bundle", metavar="NAME|DIR", default=None,
                   help="calbin bundle: an installed bundle's name or a directory (default: built-in)")
    p.add_argument("--json", action="store_true", help='print {"in-process": {...}, "worker": {...}, "unit": ...}')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.steps <= 100_000:
        return fail(f"--steps must be in 1..100000, got {args.steps}")
    try:
        contexts = [int(x) for x in str(args.context).split(",") if x.strip()]
        prefills = [int(x) for x in str(args.prefill).split(",") if x.strip()]
    except ValueError:
        return fail(f"--context / --prefill take integers separated by commas, got {args.context!r} / {args.prefill!r}")
    if not contexts or not all(1 <= c <= 4000 for c in contexts) or len(contexts) > 8:
        return fail(f"--context must be 1..8 values in 1..4000, got {args.context}")
    if not all(1 <= n <= 8192 for n in prefills) or len(prefills) > 8:
        return fail(f"--prefill must be at most 8 values in 1..8192, got {args.prefill}")
    if not 2 <= args.tokens_per_request <= 4096:
        return fail(f"--tokens-per-request must be in 2..4096, got {args.tokens_per_request}")
    modes = list(MODES) if args.mode == "both" else [args.mode]
    rep: dict[str, Any] = {}
    try:
        for m in modes:
            per_ctx = []
            for c in contexts:
                r = measure_step(MODES[m], steps=args.steps, context=c,
                                 tokens_per_request=args.tokens_per_request, bundle=args.bundle)
                r.pop("token_ids")
                r["context"] = c
                per_ctx.append(r)
            rep[m] = per_ctx[0] if len(contexts) == 1 else {"contexts": per_ctx}
            if prefills:
                rep[m + " prefill"] = measure_prefill(MODES[m], prefills, bundle=args.bundle)
    except (CalError, ValueError) as e:
        return fail(str(e))
    rep["unit"] = "host wall ms per decode step (fast pacing); sim_* simulated device ms"
    if args.json:
        print_json(rep)
        return 0
    print(f"wall time per decode step (host wall ms, fast pacing, {args.steps} steps per mode and context), "
          "beside the simulated device time of the same step")
    for m in modes:
        rows = rep[m]["contexts"] if "contexts" in rep[m] else [rep[m]]
        for r in rows:
            w, sm = r["median_ms"], r["sim_median_ms"]
            lag = f"; host {w / sm:.1f}x slower than the device: real-time pacing falls behind" if w > sm else ""
            print(f"  {m:11} context {r['context_min']}..{r['context_max']}: wall median {w:.3f} ms "
                  f"({1e3 / w:.1f} tok/s)   p95 {r['p95_ms']:.3f} ms   | sim {sm:.3f} ms ({1e3 / sm:.1f} tok/s){lag}"
                  f"   (numerics {r['device_compute_median_ms']:.3f} ms wall; "
                  f"this process's CPU {r['process_cpu_median_ms']:.3f} ms)")
        for r in rep.get(m + " prefill", []):
            print(f"  {m:11} prefill {r['tokens']} tokens: wall {r['wall_median_ms']:.1f} ms "
                  f"({r['wall_tok_s']:.0f} tok/s)   | sim {r['sim_ms']:.2f} ms ({r['sim_tok_s']:.0f} tok/s)")
    return 0
