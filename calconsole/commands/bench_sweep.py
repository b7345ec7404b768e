"""``calconsole bench sweep``: TTFT, prefill and decode rates over the report's prompt lengths and
contexts, each with a low/high sensitivity range (:mod:`sim_backend.tools.sweep`).

Simulated device time of the cost model only (no host work).  Exit code 0, or 2 on a bad
hardware YAML (one line).
"""

from __future__ import annotations

import argparse
import sys

from .common import fail, print_json


def register(bsub) -> None:
    p = bsub.add_parser(
        "sweep", help="TTFT / prefill / decode rates over prompt lengths 1..40900 and contexts, with ranges",
        description="Price the report's prompt lengths (1, 16, 128, 512, 2048, 4096, 8192, 16384, 32768, 40900; "
                    "prefill chunks of 2048 tokens as the engine cuts them) and decode contexts 27..40900 with the "
                    "cost model (simulated device time, no host work). Each figure has a low/high range: every "
                    "assumed parameter, one at a time, at each end of its physical range (the hardware YAML's "
                    "ranges), the fitted parameters refitted to the measured F7 points; variants the F7 points "
                    "rule out are listed and left out. Takes about half a minute (one refit per variant).")
    p.add_argument("--json", action="store_true",
                   help="print JSON: prompts[{prompt_tokens, ttft_ms, prefill_tok_s}], contexts[{context, "
                        "decode_tok_s}], each figure {value, low, high, low_by, high_by}")
    p.add_argument("--plot", action="store_true", help="also draw terminal plots (plotext) of TTFT and decode rate")
    p.add_argument("--hardware", metavar="YAML", default=None,
                   help="hardware/cost-model YAML (default: the shipped calculet_npu.yaml)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError
    from sim_backend.tools.calibration import CostModel
    from sim_backend.tools.sweep import plot, sweep

    try:
        cm = CostModel.load(args.hardware)
    except (CalError, ValueError) as e:
        return fail(str(e))
    res = sweep(cm)
    if args.json:
        print_json(res)
        return 0

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    def r(fig: dict, fmt: str, scale: float = 1.0) -> str:
        return escape(f"{fig['value'] * scale:{fmt}}  [{fig['low'] * scale:{fmt}} .. {fig['high'] * scale:{fmt}}]")

    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 130))
    t = Table(title=escape("Prompt-length sweep (simulated device time; value [low .. high])"))
    t.add_column("prompt tokens", justify="right")
    t.add_column("TTFT s", justify="right")
    t.add_column("prefill tok/s", justify="right")
    t.add_column("TTFT low / high set by", no_wrap=True)
    for row in res["prompts"]:
        tt = row["ttft_ms"]
        t.add_row(str(row["prompt_tokens"]), r(tt, ".2f", 1e-3), r(row["prefill_tok_s"], ".0f"),
                  f"{tt['low_by']} / {tt['high_by']}")
    con.print(t)
    t = Table(title=escape("Decode rate by context (simulated device time; value [low .. high])"))
    t.add_column("context", justify="right")
    t.add_column("decode tok/s", justify="right")
    t.add_column("low / high set by", no_wrap=True)
    for row in res["contexts"]:
        d = row["decode_tok_s"]
        t.add_row(str(row["context"]), r(d, ".1f"), f"{d['low_by']} / {d['high_by']}")
    con.print(t)
    con.print(f"variants: {', '.join(res['variants'])}")
    for name, why in res["rejected_variants"].items():
        con.print(f"left out (the F7 points rule it out): {name}: {why}")
    con.print("ranges are one assumed parameter at a time, refitted; they are not bounds and leave out the "
              "fitted parameters' own uncertainty (see `calconsole bench calibrate`, held-out errors)")
    if args.plot:
        import plotext as plt

        text = plot(res, width=min(con.width, 110))
        sys.stdout.write((text if sys.stdout.isatty() else plt.uncolorize(text)) + "\n")
    return 0
