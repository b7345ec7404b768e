"""``calconsole bench roadmap``: the report's roadmap stages priced over its concurrency matrix.

Stages: today (C0), async overlap (C1), batch 4 / 8 / 16 decode variant calbins with continuous
batching (C3), and S8 V-cache / on-device top-k on the best batch stage. Clients 1, 2, 4, 8, 16
x all short / all long / 10% long + 90% short (the operators' matrix). Each cell runs on a fresh timing-only
simulator with fast pacing; every figure is SIMULATED device time. Ranges are first-order, from
the cost model's stated uncertainty (the decode band of the calibration; see README).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from sim_backend.planes import CalError
from sim_backend.tools.roadmap import (
    CLIENTS,
    DEFAULT_SLO,
    MIXES,
    OUTPUT_TOKENS,
    RANGE_SAMPLES,
    SLO,
    STAGE_NAMES,
    fmt,
    run_roadmap,
)

from ..commands.common import fail, print_json
from . import BenchParsers


def _csv(text: str, allowed: tuple[Any, ...], what: str, conv: Callable[[str], Any] = str) -> list[Any]:
    items = [conv(x.strip()) for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise ValueError(f"--{what}: {', '.join(map(str, bad)) or 'nothing given'} not in "
                         f"{', '.join(map(str, allowed))}")
    return items


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("roadmap", help="roadmap stages (today, overlap, batch 4/8/16, S8, top-k) x F8 matrix",
                        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one record per (stage, mix, clients) plus the answers")
    p.add_argument("--plot", action="store_true", help="terminal plot: tokens/s and P95 TPOT vs clients")
    p.add_argument("--stages", default=",".join(STAGE_NAMES), help=f"subset of {','.join(STAGE_NAMES)}")
    p.add_argument("--mixes", default=",".join(MIXES), help=f"subset of {','.join(MIXES)}")
    p.add_argument("--clients", default=",".join(map(str, CLIENTS)), help="subset of 1,2,4,8,16")
    p.add_argument("--requests-per-client", type=int, default=2, help="closed-loop requests per client (default 2)")
    p.add_argument("--max-tokens", type=int, default=OUTPUT_TOKENS, help=f"output tokens (default {OUTPUT_TOKENS})")
    p.add_argument("--quick", action="store_true", help="clients 1,4,16, mixes short,mixed, 1 request per client")
    p.add_argument("--range-samples", type=int, default=RANGE_SAMPLES, metavar="N",
                   help=f"joint draws of assumed parameters and hardware peaks behind each record's range "
                        f"(default {RANGE_SAMPLES}, ~2 s of refit each; 0 = the first-order range only)")
    p.add_argument("--slo", default=None, metavar="SPEC",
                   help="goodput SLOs, simulated ms (default ttft:10000,tpot:100)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        stages = _csv(args.stages, STAGE_NAMES, "stages")
        mixes = _csv(args.mixes, MIXES, "mixes")
        clients = _csv(args.clients, CLIENTS, "clients", conv=lambda x: int(x) if x.isdigit() else x)
        slo = SLO.parse(args.slo) if args.slo is not None else DEFAULT_SLO
    except ValueError as e:
        return fail(str(e))
    if not 1 <= args.requests_per_client <= 64:
        return fail(f"--requests-per-client must be in 1..64, got {args.requests_per_client}")
    if not 0 <= args.range_samples <= 512:
        return fail(f"--range-samples must be in 0..512, got {args.range_samples}")
    if not 2 <= args.max_tokens <= 4096:
        return fail(f"--max-tokens must be in 2..4096, got {args.max_tokens}")
    rpc = args.requests_per_client
    if args.quick:
        clients, mixes, rpc = [c for c in (1, 4, 16)], [m for m in ("short", "mixed")], 1
    def progress(msg: str) -> None:
        sys.stderr.write(f"\r  running {msg:<28}")
        sys.stderr.flush()

    prog = None if args.json else progress
    try:
        rep = run_roadmap(stages=stages, mixes=mixes, clients=clients, requests_per_client=rpc,
                          max_tokens=args.max_tokens, slo=slo, progress=prog, range_samples=args.range_samples)
    except (CalError, ValueError) as e:
        return fail(str(e))
    if prog:
        sys.stderr.write("\r" + " " * 40 + "\r")
    if args.json:
        print_json(rep)
    else:
        _table(rep)
    if args.plot:
        _plot(rep)
    return 0


def _table(rep: dict[str, Any]) -> None:
    out = sys.stdout
    out.write(f"{'stage':10}{'st':4}{'mix':7}{'cl':>3}{'req/s':>8}{'tok/s':>8}{'tok/s range':>15}"
              f"{'TTFT p50/p95':>16}{'TPOT p50/p95':>14}{'ITL p99':>8}{'good':>7}{'fail':>5}{'batch':>6}\n")
    for r in rep["records"]:
        lo, hi = r["ranges"]["tokens_per_s"]
        out.write(f"{r['stage']:10}{r['status']:4}{r['mix']:7}{r['clients']:>3}{fmt(r['requests_per_s'], 2):>8}"
                  f"{fmt(r['tokens_per_s']):>8}{fmt(lo) + '-' + fmt(hi):>15}"
                  f"{fmt(r['ttft_ms']['p50'], 0) + '/' + fmt(r['ttft_ms']['p95'], 0):>16}"
                  f"{fmt(r['tpot_ms']['p50'], 0) + '/' + fmt(r['tpot_ms']['p95'], 0):>14}"
                  f"{fmt(r['itl_ms']['p99'], 0):>8}{fmt(r['goodput']):>7}{r['failed']:>5}"
                  f"{fmt(r['batch_occupancy']):>6}\n")
    slo = rep["slo"]
    out.write(f"\nSLOs (simulated ms): TTFT <= {fmt(slo['ttft_ms'], 0)}, TPOT <= {fmt(slo['tpot_ms'], 0)}; "
              f"best batch stage: {rep['best_batch_stage'] or '-'}\n")
    for name, a in rep["answers"].items():
        tps = ", ".join(f"{m} {fmt(v)}" for m, v in a["tokens_per_s"].items())
        gain = ", ".join(f"{m} {fmt(v, 2)}x" for m, v in (a.get("gain_over_today") or {}).items())
        knee = ", ".join(f"{m} {'met at all' if v is None else f'fails from {v}'}"
                         for m, v in a["tpot_slo_knee_clients"].items())
        out.write(f"{name} [{a['status']}]: {a['clients']} clients -> tok/s {tps} (gain {gain}); "
                  f"TPOT SLO: {knee}\n")
    rf = rep["ranges_from"]
    out.write(f"tok/s ranges: {rf['first_order']}, and {rf['joint_kept']} kept of {rf['joint_drawn']} joint draws of "
              "the assumed parameters and hardware peaks (refitted to F7; `calconsole bench sweep`)\n")
    out.write(f"({rep['clock']}; C3 = a calbin the vendor would have to compile, not today's product)\n")


def _plot(rep: dict[str, Any]) -> None:
    import plotext as plt

    recs = rep["records"]
    mix = "short" if any(r["mix"] == "short" for r in recs) else recs[0]["mix"]
    plt.clear_figure()
    plt.subplots(1, 2)
    for i, (key, title) in enumerate((("tokens_per_s", f"output tok/s ({mix}, sim)"),
                                      ("tpot_p95", f"P95 TPOT ms ({mix}, sim)"))):
        plt.subplot(1, i + 1)
        plt.title(title)
        for name in dict.fromkeys(r["stage"] for r in recs):
            rs = sorted((r for r in recs if r["stage"] == name and r["mix"] == mix), key=lambda r: r["clients"])
            ys = [(r["tokens_per_s"] if key == "tokens_per_s" else r["tpot_ms"]["p95"]) or 0.0 for r in rs]
            plt.plot([r["clients"] for r in rs], ys, label=f"{name} {rs[0]['status']}" if rs else name)
        plt.xlabel("clients")
    plt.plotsize(120, 24)
    plt.show()
