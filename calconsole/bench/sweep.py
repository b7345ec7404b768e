"""``calconsole bench sweep``: TTFT, prefill and decode rates over the report's prompt lengths and
contexts, each with a low/high range from a JOINT sample of the assumed parameters and hardware
peaks (:mod:`sim_backend.tools.sweep`).

Simulated device time of the cost model only (no host work).  Exit code 0, or 2 on a bad
hardware YAML (one line).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..commands.common import fail, print_json
from . import BenchParsers


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser(
        "sweep", help="TTFT / prefill / decode rates over prompt lengths 1..40900 and contexts, with joint ranges",
        description="Price the report's prompt lengths (1, 16, 128, 512, 2048, 4096, 8192, 16384, 32768, 40900; "
                    "prefill chunks of 2048 tokens as the engine cuts them) and decode contexts 27..40900 with the "
                    "cost model (simulated device time, no host work). Each figure has a low/high range from a "
                    "joint sample: every assumed parameter and hardware peak (DRAM/SRAM/link/PCIe bandwidth, "
                    "INT8/FP16 peaks) drawn together over its physical range (the hardware YAML's ranges), the "
                    "fitted parameters refitted on the fitted F7 cases; a draw is kept when the F7 points stay "
                    "within 3%% and the fitted bands no worse than the shipped fit's plus 3%%. Decode figures at "
                    "a context the report gives a band for are shown beside it. One refit per draw: about "
                    "2 s each.")
    p.add_argument("--json", action="store_true",
                   help="print JSON: prompts[{prompt_tokens, ttft_ms, prefill_tok_s}], contexts[{context, "
                        "decode_tok_s, band}], each figure {value, low, high, low_by, high_by}; joint{drawn, kept, "
                        "parameters, rejected, draws}")
    p.add_argument("--samples", type=_samples, default=None, metavar="N",
                   help="draws of the joint sample (default 32; 1..512)")
    p.add_argument("--seed", type=int, default=0, help="seed of the (scrambled Sobol) joint sample (default 0)")
    p.add_argument("--plot", action="store_true", help="also draw terminal plots (plotext) of TTFT and decode rate")
    p.add_argument("--hardware", metavar="YAML", default=None,
                   help="hardware/cost-model YAML (default: the shipped calculet_npu.yaml)")
    p.set_defaults(func=run)


def _samples(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= n <= 512:
        raise argparse.ArgumentTypeError(f"must be 1..512, got {n}")
    return n


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError
    from sim_backend.tools.calibration import CostModel
    from sim_backend.tools.sweep import DEFAULT_SAMPLES, plot, sweep

    try:
        cm = CostModel.load(args.hardware)
    except (CalError, ValueError) as e:
        return fail(str(e))
    res = sweep(cm, samples=args.samples or DEFAULT_SAMPLES, seed=args.seed)
    if args.json:
        print_json(res)
        return 0

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    def r(fig: dict[str, Any], fmt: str, scale: float = 1.0) -> str:
        return escape(f"{fig['value'] * scale:{fmt}}  [{fig['low'] * scale:{fmt}} .. {fig['high'] * scale:{fmt}}]")

    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 130))
    j = res["joint"]
    t = Table(title=escape("Prompt-length sweep (simulated device time; value [low .. high] over "
                           f"{j['kept']} kept joint draws of {j['drawn']})"))
    t.add_column("prompt tokens", justify="right")
    t.add_column("TTFT s", justify="right")
    t.add_column("prefill tok/s", justify="right")
    t.add_column("TTFT low / high from", no_wrap=True)
    for row in res["prompts"]:
        tt = row["ttft_ms"]
        t.add_row(str(row["prompt_tokens"]), r(tt, ".2f", 1e-3), r(row["prefill_tok_s"], ".0f"),
                  f"{tt['low_by']} / {tt['high_by']}")
    con.print(t)
    t = Table(title=escape("Decode rate by context (simulated device time; value [low .. high]; the report's band)"))
    t.add_column("context", justify="right")
    t.add_column("decode tok/s", justify="right")
    t.add_column("report (facts.md F7)", no_wrap=True)
    t.add_column("low / high from", no_wrap=True)
    for row in res["contexts"]:
        d = row["decode_tok_s"]
        band = row["band"]
        bt = f"{band[0]:g}-{band[1]:g} ({band[2]})" if band else ""
        t.add_row(str(row["context"]), r(d, ".1f"), escape(bt), f"{d['low_by']} / {d['high_by']}")
    con.print(t)
    con.print(f"joint sample: {j['drawn']} draws, {j['kept']} kept; moved: {', '.join(j['parameters'])}")
    reasons: dict[str, int] = {}
    for d in j["draws"]:
        if not d["kept"]:
            reasons[d["rule"]] = reasons.get(d["rule"], 0) + 1
    for why, n in sorted(reasons.items()):
        con.print(f"left out: {n} draw(s): {why}")
    con.print("ranges are the extremes over the kept draws and the shipped model: a sample, not bounds; the "
              "decode ranges are narrow because the fitted KV throughput is refitted to the fitted bands in each "
              "draw (see `calconsole bench calibrate` for the held-out errors)")
    if args.plot:
        import plotext as plt

        text = plot(res, width=min(con.width, 110))
        sys.stdout.write((text if sys.stdout.isatty() else plt.uncolorize(text)) + "\n")
    return 0
