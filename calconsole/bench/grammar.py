"""``calconsole bench grammar``: what constrained decoding costs per token, with and without a grammar.

Host wall ms per token of one request's token pipeline (the grammar's mask from llguidance, the
sampler over the full vocabulary, stop rules, detokeniser), fed random BF16 logits (numerics path)
or none (the timing-only stand-in), for no grammar, a tool-call-like JSON schema and a small GBNF;
then timing-only requests through a fast-paced simulator: wall ms per token between streamed events,
the engine's host sampling CPU ms per token (booked on the simulated clock) and the simulated TPOT.
Also: the mask alone and the one-off tokenizer build llama.cpp does at model load. A benchmark,
not a test: host figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
from typing import Any

from sim_backend.planes import CalError
from sim_backend.tools.grammar_bench import GRAMMARS, measure_pipeline, measure_serve

from ..commands.common import fail, print_json
from . import BenchParsers


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("grammar", help="host ms per token with and without a grammar (constrained decoding)",
                        description=__doc__.replace("``", "").split("\n\n")[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=400, help="tokens measured per grammar and path (default 400)")
    p.add_argument("--requests", type=int, default=12,
                   help="timing-only requests per grammar through the simulator (default 12; 0 skips)")
    p.add_argument("--bundle", metavar="NAME|DIR", default=None,
                   help="calbin bundle: an installed bundle's name or a directory (default: built-in)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 10 <= args.tokens <= 100_000:
        return fail(f"--tokens must be in 10..100000, got {args.tokens}")
    if not 0 <= args.requests <= 1000:
        return fail(f"--requests must be in 0..1000, got {args.requests}")
    try:
        rep: dict[str, Any] = {"pipeline": measure_pipeline(args.tokens, args.bundle)}
        if args.requests:
            rep["serve"] = measure_serve(args.requests, args.bundle)
    except (CalError, ValueError, OSError) as e:
        return fail(str(e))
    rep["unit"] = "host wall ms per token"
    if args.json:
        print_json(rep)
        return 0
    pl = rep["pipeline"]
    print(f"constrained decoding, host wall ms per token (vocabulary {pl['vocab']}; "
          f"tokenizer build once per process {pl['tokenizer_build_s']:.2f} s)")
    for path in ("numerics", "timing-only"):
        base = pl[f"none {path}"]["median_ms"]
        for g in GRAMMARS:
            r = pl[f"{g} {path}"]
            extra = "" if g == "none" else f"   ({r['median_ms'] - base:+.3f} ms)"
            print(f"  {path:11} {g:11}: median {r['median_ms']:.3f} ms   p95 {r['p95_ms']:.3f} ms{extra}")
    for g, ms in pl["mask_median_ms"].items():
        print(f"  mask alone  {g:11}: median {ms:.3f} ms")
    serve = rep.get("serve", {})
    for g, r in serve.items():
        extra = "" if g == "none" else f"   ({r['median_ms'] - serve['none']['median_ms']:+.3f} ms)"
        tpot = "n/a" if r["sim_tpot_ms"] is None else f"{r['sim_tpot_ms']:.3f} ms"
        print(f"  serve (timing-only, fast pacing) {g:11}: wall median {r['median_ms']:.3f} ms{extra}   "
              f"host sampling {r['sampling_cpu_ms']:.3f} ms CPU   | sim TPOT {tpot}   "
              f"({r['tokens']} tokens, {r['requests']} requests)")
    return 0
