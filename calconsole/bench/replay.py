"""``calconsole bench replay [TRACE]``: a production trace replayed on simulated boards (capacity planning).

Each trace row is one request with exactly its prompt and output tokens (EOS ignored, timing-only) on one
of ``--boards`` boards, each what one ``calconsole serve`` runs (slots, queue limit, round scheduler, KV
pool, calibrated cost model, modeled host work). Every latency is SIMULATED ms; ``wall_seconds`` is this
machine's time. ``--find-boards`` searches the fewest boards meeting ``--slo`` at ``--attainment`` for the
production bundle and its batch variants, probes in parallel on every core (or a dask cluster).
Default trace: Azure's LLM inference trace 2023, conversation service (CC-BY 4.0, shipped).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from sim_backend.planes import CalError
from sim_backend.tools.replay import replay
from sim_backend.tools.replay_board import ROUTES, ReplayConfig
from sim_backend.tools.replay_prices import VARIANTS, prices_for_trace, variant_bundle_dir
from sim_backend.tools.replay_trace import Trace, TraceError, load_trace

from ..commands.common import fail, print_json
from ..commands.metrics import parse_slo
from . import BenchParsers
from .serve_load import Record, stream_completion

#: the shipped trace (calconsole/bench/data/azure-llm-2023, its README and LICENSE beside it)
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
DEFAULT_SLO = "ttft:2000,tpot:100"
#: the engine check steps every token: past this many requests it is refused (minutes of wall time)
ENGINE_CHECK_MAX = 400
#: the HTTP check runs one serve process per board on this machine, in real time
HTTP_CHECK_MAX_BOARDS = 8
#: the engine check runs one engine (a scheduler thread) per board: past this many boards it is refused
ENGINE_CHECK_MAX_BOARDS = 16


def register(bsub: BenchParsers) -> None:
    """Add ``replay`` to the ``bench`` subparsers."""
    p = bsub.add_parser("replay", help="replay a production trace on N simulated boards; --find-boards: how many",
                        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE), metavar="TRACE",
                   help="CSV of TIMESTAMP,ContextTokens,GeneratedTokens (default: the shipped Azure 2023 "
                        "conversation trace, 19,366 requests over one hour)")
    p.add_argument("--boards", type=int, default=24, help="simulated boards (default 24)")
    p.add_argument("--bundle", default=VARIANTS[0],
                   help=f"bundle name or directory (default {VARIANTS[0]}; variants {', '.join(VARIANTS[1:])})")
    p.add_argument("--route", default="round-robin", choices=ROUTES,
                   help="router: round-robin, least-outstanding (queued + running), least-kv (KV demand)")
    p.add_argument("--slots", dest="board_slots", type=int, default=None,
                   help="slots per board (serve's --slots; default 4, or the calbin's decode batch when larger)")
    p.add_argument("--queue-limit", type=int, default=16, help="queue per board beyond the free slots (default 16)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="first N requests of the cut")
    p.add_argument("--start", type=float, default=0.0, metavar="T", help="skip the first T trace seconds")
    p.add_argument("--span", type=float, default=None, metavar="S", help="keep S trace seconds from --start")
    p.add_argument("--speedup", type=float, default=1.0, metavar="X", help="arrivals X times as fast (default 1)")
    p.add_argument("--slo", default=DEFAULT_SLO, metavar="SPEC",
                   help=f"ttft:MS,tpot:MS,e2el:MS, simulated ms (default {DEFAULT_SLO})")
    p.add_argument("--attainment", type=float, default=0.9, metavar="F",
                   help="share of all requests that must meet every SLO (default 0.9, as in DistServe)")
    p.add_argument("--find-boards", nargs="?", const=",".join(VARIANTS), default=None, metavar="VARIANTS",
                   help=f"search the fewest boards meeting the SLO for each bundle (default all: {','.join(VARIANTS)})")
    p.add_argument("--workers", type=int, default=None,
                   help="local processes for --find-boards (default: every core)")
    p.add_argument("--scheduler", default=None, metavar="ADDRESS",
                   help="run --find-boards' probes on a dask.distributed cluster (tcp://host:8786; "
                        "pip install 'calconsole[cluster]')")
    p.add_argument("--check-engine", action="store_true",
                   help=f"also run the cut token by token through real engines and compare (<= {ENGINE_CHECK_MAX} "
                        "requests, round-robin)")
    p.add_argument("--check-http", action="store_true",
                   help=f"also send the cut to --boards real `calconsole serve` boards (<= {HTTP_CHECK_MAX_BOARDS}, "
                        "real-time pacing at --http-speed) over HTTP at its arrival times, and compare")
    p.add_argument("--http-speed", type=float, default=1.0, metavar="X",
                   help="with --check-http: the boards' simulated seconds per wall second (default 1)")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    p.add_argument("--plot", action="store_true", help="P95 latency and queue over trace time (terminal plot)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The bench's entry: 0 on success, 2 with one line for bad input (a malformed trace names its row and
    field)."""
    try:
        slo = parse_slo(args.slo)
        if not 0 < args.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
        if not 1 <= args.boards <= 1024:
            raise ValueError(f"--boards must be in 1..1024, got {args.boards}")
        cfg = ReplayConfig(n_slots=args.board_slots, queue_limit=args.queue_limit, route=args.route)
        trace = load_trace(args.trace).cut(start_s=args.start, span_s=args.span, limit=args.limit,
                                           speedup=args.speedup)
        variants = _variants(args.find_boards) if args.find_boards is not None else []
        if args.check_engine and len(trace) > ENGINE_CHECK_MAX:
            raise ValueError(f"--check-engine steps every token: cut the trace to <= {ENGINE_CHECK_MAX} requests "
                             f"(--limit), got {len(trace)}")
        # round-robin over more boards than requests leaves the rest idle: the engines needed are the rows
        if args.check_engine and min(args.boards, len(trace)) > ENGINE_CHECK_MAX_BOARDS:
            raise ValueError(f"--check-engine runs one engine per board: at most {ENGINE_CHECK_MAX_BOARDS} "
                             f"boards, got {args.boards}")
        if args.plot and (args.json or variants):
            print("calconsole: --plot ignored (it draws a single replay's report, not "
                  f"{'JSON' if args.json else '--find-boards'})", file=sys.stderr)
        if (args.check_engine or args.check_http) and args.route != "round-robin":
            raise ValueError("--check-engine and --check-http compare round-robin routing only")
        if args.check_http:
            if len(trace) > ENGINE_CHECK_MAX or args.boards > HTTP_CHECK_MAX_BOARDS:
                raise ValueError(f"--check-http runs in real time: at most {ENGINE_CHECK_MAX} requests (--limit) "
                                 f"on at most {HTTP_CHECK_MAX_BOARDS} boards")
            if not 0.1 <= args.http_speed <= 10:
                raise ValueError(f"--http-speed must be in 0.1..10, got {args.http_speed}")
    except (TraceError, ValueError, OSError, CalError) as e:
        return fail(str(e))
    try:
        if variants:
            return _find(args, trace, variants, cfg, slo)
        return _single(args, trace, cfg, slo)
    except (CalError, ValueError) as e:
        return fail(str(e))
    except BrokenProcessPool as e:
        return fail(f"a search worker process died ({e or 'killed'}); nothing was reported")


def _variants(text: str) -> list[str]:
    """The bundles named in ``--find-boards``, each checked here (a bad manifest or a dense bundle is one line
    now, not a worker's error later); a name and a path to the same bundle count once."""
    # through the tools, not the bundle package: the console's commands reach the simulator only so
    from sim_backend.tools.replay_prices import check_replayable_dir

    out: list[str] = []
    seen: set[Path] = set()
    for v in (v.strip() for v in text.split(",")):
        if not v:
            continue
        d = variant_bundle_dir(v).resolve()  # ValueError naming the choices
        if d in seen:
            continue
        check_replayable_dir(d)  # ManifestError, ValueError
        seen.add(d)
        out.append(v)
    if not out:
        raise ValueError(f"--find-boards: name bundles from {', '.join(VARIANTS)} (or leave the list out)")
    return out


def _progress(quiet: bool, total: int, what: str) -> Any:
    """A rich progress bar on stderr (a no-op object when quiet)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.description}"), console=Console(stderr=True), disable=quiet,
                    transient=True)


def _single(args: argparse.Namespace, trace: Trace, cfg: ReplayConfig, slo: Any) -> int:
    w0 = time.perf_counter()
    bundle = variant_bundle_dir(args.bundle)
    refused: set[int] = set()
    with _progress(args.json, len(trace), "replay") as bar:
        task = bar.add_task("pricing steps", total=len(trace))
        prices = prices_for_trace(trace, bundle, prefill_chunk=cfg.prefill_chunk)
        bar.update(task, description="")
        rep = replay(trace, prices, boards=args.boards, cfg=cfg, slo=slo, attainment=args.attainment,
                     progress=lambda done, total: bar.update(task, completed=done),
                     timeline_points=48 if args.plot else 0, refused_out=refused)
    rep["wall_seconds"] = time.perf_counter() - w0
    rep["trace_file"] = str(args.trace)
    if args.check_engine:
        rep["engine_check"] = _engine_check(trace, bundle, args, cfg, slo, rep)
    if args.check_http:
        rep["http_check"] = _http_check(trace, bundle, args, cfg, slo, rep, refused)
    if args.json:
        print_json(rep)
    else:
        _report(rep)
    if args.plot and not args.json:
        _plot(rep)
    return 0


def _engine_check(trace: Trace, bundle: Path, args: argparse.Namespace, cfg: ReplayConfig, slo: Any,
                  rep: dict[str, Any]) -> dict[str, Any]:
    """The same cut token by token through real engines; relative P50/P95 differences per metric."""
    from sim_backend.tools.replay_engine import replay_on_engine

    w0 = time.perf_counter()
    eng = replay_on_engine(trace, bundle, boards=min(args.boards, len(trace)), cfg=cfg, slo=slo,
                           attainment=args.attainment)
    diffs: dict[str, dict[str, float | None]] = {}
    for m in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "itl_ms"):
        diffs[m] = {}
        for q in ("p50", "p95"):
            a, b = rep["metrics"][m][q], eng["metrics"][m][q]
            diffs[m][q] = None if a is None or b is None else (abs(a - b) / b if b else float(a != b))
    worst = max((v for d in diffs.values() for v in d.values() if v is not None), default=None)
    core_d = [v for m in ("ttft_ms", "tpot_ms", "e2e_ms") for v in diffs[m].values() if v is not None]
    core = max(core_d, default=None)
    # nothing compared (every request refused on one side) is no agreement: within_1pct None, not True
    return {"engine_metrics": eng["metrics"], "engine_rejected": eng["rejected"], "relative_diff": diffs,
            "compared": len(core_d), "worst_ttft_tpot_e2e": core, "worst_any": worst,
            "within_1pct": None if core is None else core <= 0.01,
            "rejected_agree": eng["rejected"] == rep["rejected"],
            "engine_wall_seconds": time.perf_counter() - w0,
            "note": "itl differs slightly by definition: the engine's gaps are between streamed pieces "
                    "(a token that completes no character streams with the next), the fast path's per token"}


def http_replay(trace: Trace, urls: list[str], *, speed: float = 1.0, slo: Any = None, attainment: float = 0.9,
                timeout_s: float = 600.0, skip: set[int] | frozenset[int] = frozenset()) -> dict[str, Any]:
    """``trace`` sent over HTTP to served boards (:func:`replay_over_http`, row i
    with :func:`replay_engine.prompt_ids` to ``urls[i % n]``); returns ``{"client": summary, "server":
    summary, "failed": {row: error}, "skipped", "requests", "boards", "speed"}``, each summary
    :func:`replay.summarize`'s dict in simulated ms (the client's wall ms times ``speed``; the boards' own
    ``calconsole.timings``). ``skip``: 0-based rows not sent (those the in-process replay refused at
    arrival: sent, a board that has room would serve what the replay counts as refused)."""
    from sim_backend.planes.types import SLO
    from sim_backend.tools.replay import summarize
    from sim_backend.tools.replay_board import Ledger
    from sim_backend.tools.replay_engine import prompt_ids

    sent = [i for i in range(len(trace)) if i not in skip]
    rows = [Row(float(trace.arrival_s[i]), prompt_ids(i, int(trace.prompt[i])), int(trace.output[i]), board=i)
            for i in sent]
    recs = replay_over_http(rows, urls, speed=speed, timeout_s=timeout_s) if rows else []
    arr = trace.arrival_s * 1e6
    views = {"client": Ledger(len(trace)), "server": Ledger(len(trace))}
    for i in skip:
        for led in views.values():
            led.reason[i] = "refused"
    failed: dict[int, str] = {}
    for i, r in zip(sent, recs, strict=True):
        if not r.ok or r.ttft_ms is None or r.e2e_ms is None:
            failed[i] = r.error or "failed"
            for led in views.values():
                led.reason[i] = "failed"
            continue
        c = views["client"]
        c.first[i], c.last[i] = arr[i] + r.ttft_ms * speed * 1e3, arr[i] + r.e2e_ms * speed * 1e3
        c.board[i] = i % len(urls)
        srv = r.server or {}
        if srv.get("ttft_ms") is not None and srv.get("e2e_ms") is not None:
            s = views["server"]
            s.first[i], s.last[i], s.board[i] = (arr[i] + float(srv["ttft_ms"]) * 1e3,
                                                 arr[i] + float(srv["e2e_ms"]) * 1e3, i % len(urls))
            if srv.get("queue_ms") is not None:
                s.assigned[i] = arr[i] + float(srv["queue_ms"]) * 1e3
    out: dict[str, Any] = {"requests": len(trace), "boards": len(urls), "speed": speed, "failed": failed,
                           "client_clock": "host wall ms x speed (to compare with simulated ms)",
                           "server_clock": "each board's simulated ms from when it took the request"}
    for name, led in views.items():
        out[name] = summarize(trace, led, slo=slo or SLO(), attainment=attainment)
    return out


def _rel(a: dict[str, Any], b: dict[str, Any], metrics: tuple[str, ...]) -> dict[str, dict[str, float | None]]:
    """(b - a) / a per metric and quantile (P50, P95); None where either is missing."""
    out: dict[str, dict[str, float | None]] = {}
    for m in metrics:
        out[m] = {}
        for q in ("p50", "p95"):
            x, y = a[m][q], b[m][q]
            out[m][q] = None if x is None or y is None or x == 0 else (y - x) / x
    return out


def _http_check(trace: Trace, bundle: Path, args: argparse.Namespace, cfg: ReplayConfig, slo: Any,
                rep: dict[str, Any], refused: set[int]) -> dict[str, Any]:
    """The same cut over HTTP to served boards (:func:`served_boards`), less the rows the replay refused
    at arrival (``refused``, 0-based); signed relative differences."""

    w0 = time.perf_counter()
    slots = rep["board_config"]["slots"]
    with served_boards(args.boards, speed=args.http_speed, bundle=str(bundle), slots=slots,
                       queue_limit=cfg.queue_limit) as urls:
        h = http_replay(trace, urls, speed=args.http_speed, slo=slo, attainment=args.attainment, skip=refused)
    ms = ("ttft_ms", "tpot_ms", "e2e_ms")
    return {"client_metrics": h["client"]["metrics"], "server_metrics": h["server"]["metrics"],
            "failed": h["failed"], "skipped": len(refused),
            "client_vs_replay": _rel(rep["metrics"], h["client"]["metrics"], ms),
            "server_vs_replay": _rel(rep["metrics"], h["server"]["metrics"], ms + ("queue_ms",)),
            "speed": args.http_speed, "wall_seconds": time.perf_counter() - w0,
            "clock": h["client_clock"] + "; server: " + h["server_clock"]}


def _fmt(v: float | None, nd: int = 0) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.{nd}f}"


def _report(rep: dict[str, Any]) -> None:
    out = sys.stdout
    tr = rep["trace"]
    out.write(f"trace: {tr['count']:,} requests over {tr['span_s']:,.0f} s "
              f"({_fmt(tr['rate_per_s'], 2)} req/s); prompt p50/p90/p99 {tr['prompt']['p50']:.0f}/"
              f"{tr['prompt']['p90']:.0f}/{tr['prompt']['p99']:.0f}, output {tr['output']['p50']:.0f}/"
              f"{tr['output']['p90']:.0f}/{tr['output']['p99']:.0f} tokens\n")
    out.write(f"{rep['boards']} boards of {rep['bundle']}, route {rep['route']}, "
              f"{rep['board_config']['slots']} slots, queue {rep['board_config']['queue_limit']}\n\n")
    out.write(f"{'simulated ms':14}{'p50':>12}{'p95':>12}{'p99':>12}\n")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"),
                      ("queue_ms", "queue")):
        m = rep["metrics"][key]
        out.write(f"{name:14}{_fmt(m['p50'], 1):>12}{_fmt(m['p95'], 1):>12}{_fmt(m['p99'], 1):>12}\n")
    slo = ", ".join(f"{k[:-3]} <= {v:g}" for k, v in rep["slo"].items() if v is not None) or "none"
    g = rep["goodput"]
    out.write(f"\nSLO ({slo} ms): attainment {rep['attainment']:.3f} (target {rep['attainment_target']:g}) -> "
              f"{'MET' if rep['meets_slo'] else 'NOT met'}; goodput {_fmt(g['requests_per_s'], 2)} req/s, "
              f"{_fmt(g['tokens_per_s'], 0)} tok/s\n")
    fin = rep["finished"]
    rej = ", ".join(f"{k} {v} (rows {', '.join(map(str, rep['rejected_rows'][k][:5]))}"
                    f"{', ...' if v > 5 else ''})" for k, v in rep["rejected"].items()) or "none"
    out.write(f"finished {fin:,} of {rep['requests']:,}; not served: {rej}\n")
    busy = [b["busy_pct"] for b in rep["per_board"]]
    kv = [b["kv_peak_pct"] for b in rep["per_board"]]
    out.write(f"boards busy {min(busy):.0f}-{max(busy):.0f} % (mean {sum(busy) / len(busy):.0f}), "
              f"KV peak {min(kv):.0f}-{max(kv):.0f} %\n")
    out.write(f"{rep['steps']:,} device steps ({rep['rounds_skipped']:,} rounds in closed form); "
              f"wall {rep['wall_seconds']:.1f} s ({rep['trace_seconds'] / max(rep['wall_seconds'], 1e-9):,.0f}x "
              f"trace time)\n({rep['clock']})\n")
    ec = rep.get("engine_check")
    if ec:
        d = ec["relative_diff"]
        out.write("\nengine check (token by token, same cut): relative difference\n")
        out.write(f"  {'':10}{'P50':>11}{'P95':>11}\n")
        for m in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms", "itl_ms"):
            out.write(f"  {m:10}{_pct(d[m]['p50']):>11}{_pct(d[m]['p95']):>11}\n")
        verdict = {None: "nothing to compare", True: "yes", False: "NO"}[ec["within_1pct"]]
        out.write(f"  TTFT/TPOT/E2E within 1 %: {verdict} (worst {_pct(ec['worst_ttft_tpot_e2e'])}); refusals "
                  f"{'agree' if ec['rejected_agree'] else 'differ: ' + str(ec['engine_rejected'])}; "
                  f"engine wall {ec['engine_wall_seconds']:.1f} s\n")
    hc = rep.get("http_check")
    if hc:
        out.write(f"\nHTTP check ({rep['boards']} served boards at speed {hc['speed']:g}, {len(hc['failed'])} "
                  f"failed, {hc['skipped']} refused by the replay not sent): client (wall x speed) vs replay\n")
        out.write(f"  {'':10}{'P50':>11}{'P95':>11}\n")
        for m, d in hc["client_vs_replay"].items():
            out.write(f"  {m:10}{_pct(d['p50']):>11}{_pct(d['p95']):>11}\n")
        out.write(f"  wall {hc['wall_seconds']:.1f} s\n")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.3f} %"


def _plot(rep: dict[str, Any]) -> None:
    import plotext as plt

    tl = rep.get("timeline") or {}
    if not tl.get("t_s"):
        return
    t = [x / 60 for x in tl["t_s"]]
    plt.clear_figure()
    plt.subplots(1, 2)
    plt.subplot(1, 1)
    plt.title("P95 latency of arrivals, simulated s")
    plt.plot(t, [0.0 if v is None else v / 1e3 for v in tl["ttft_p95_ms"]], label="TTFT")
    plt.plot(t, [0.0 if v is None else v / 1e3 for v in tl["e2e_p95_ms"]], label="E2E")
    plt.xlabel("trace minutes")
    plt.subplot(1, 2)
    plt.title("longest queue met by an arrival (requests)")
    plt.plot(t, tl["queue_max"])
    plt.xlabel("trace minutes")
    plt.plotsize(120, 22)
    plt.show()


def _executor(args: argparse.Namespace) -> tuple[Executor, Any]:
    """(executor, closer): a dask cluster's executor with --scheduler, else local processes."""
    if args.scheduler:
        try:
            from distributed import Client
        except ImportError as e:
            raise ValueError("--scheduler needs dask.distributed: pip install 'calconsole[cluster]'") from e
        try:
            client = Client(args.scheduler, timeout=30)  # type: ignore[no-untyped-call]
        except (OSError, TimeoutError) as e:
            raise ValueError(f"--scheduler {args.scheduler}: cannot reach the dask scheduler ({e})") from e
        return client.get_executor(), client  # type: ignore[no-untyped-call]
    n = (os.cpu_count() or 1) if args.workers is None else args.workers
    if not 1 <= n <= 256:
        raise ValueError(f"--workers must be in 1..256, got {n}")
    ex = ProcessPoolExecutor(max_workers=n)
    return ex, None


def _find(args: argparse.Namespace, trace: Trace, variants: list[str], cfg: ReplayConfig, slo: Any) -> int:
    from sim_backend.tools.replay_search import find_boards

    ex, client = _executor(args)
    try:
        with _progress(args.json, 0, "search") as bar:
            task = bar.add_task("pricing the variants", total=None)

            def progress(done: int, msg: str) -> None:
                bar.update(task, completed=done, description=msg)

            res = find_boards(trace, variants, ex, slo=slo, attainment=args.attainment, cfg=cfg, progress=progress)
    finally:
        if isinstance(ex, ProcessPoolExecutor):
            ex.shutdown(wait=True, cancel_futures=True)
        else:  # dask's ClientExecutor takes no cancel_futures
            ex.shutdown(wait=True)
        if client is not None:
            client.close()
    res["trace"] = trace.stats()
    res["trace_file"] = str(args.trace)
    local = f"{os.cpu_count() if args.workers is None else args.workers} local processes"
    res["executor"] = f"dask {args.scheduler}" if args.scheduler else local
    if args.json:
        print_json(res)
        return 0
    out = sys.stdout
    slo_s = ", ".join(f"{k[:-3]} <= {v:g}" for k, v in res["slo"].items() if v is not None)
    out.write(f"fewest boards meeting {slo_s} ms (simulated) for {res['attainment_target']:g} of "
              f"{res['trace']['count']:,} requests, route {res['route']}:\n\n")
    out.write(f"{'variant':20}{'boards':>7}{'meets':>7}{'attain':>8}{'TTFT p95':>11}{'TPOT p95':>10}"
              f"{'E2E p95':>11}{'refused':>8}{'busy %':>8}\n")
    for r in res["search"]:
        mark = " <" if res["answers"].get(r["variant"]) == r["boards"] else ""
        out.write(f"{r['variant']:20}{r['boards']:>7}{'yes' if r['meets_slo'] else 'no':>7}{r['attainment']:>8.3f}"
                  f"{_fmt(r['ttft_p95_ms']):>11}{_fmt(r['tpot_p95_ms'], 1):>10}{_fmt(r['e2e_p95_ms']):>11}"
                  f"{r['rejected']:>8}{r['busy_pct']:>8.0f}{mark}\n")
    out.write("\n")
    top = res["max_boards"]
    for v, n in res["answers"].items():
        out.write(f"{v}: {n} boards\n" if n is not None else f"{v}: not met up to {top} boards\n")
    out.write(f"({res['probes']} replays on {res['executor']}, wall {res['wall_seconds']:.1f} s; latencies are "
              "simulated ms)\n")
    return 0


# --- the replay over HTTP: served boards ------------------------------------------------------
#
# The trace replay over HTTP: a slice sent to real ``calconsole serve`` boards at its arrival times.
#
# The in-process replay (:mod:`sim_backend.tools.replay`) says what N boards would do with a trace; this
# sends the same rows to N served boards (``calconsole serve --boards N``, the fleet launcher: one process
# per board, real-time pacing at ``speed`` simulated seconds per wall second), round-robin, each row a
# streamed ``/completion`` of its exact prompt token ids with ``n_predict`` = its output and ``ignore_eos``.
# Arrivals are scheduled on the host's monotonic clock at ``arrival_s / speed``.
#
# Two views of each request come back: the client's (host wall ms, times ``speed`` to compare with
# simulated ms) and the board's own (``calconsole.timings``: TTFT, E2E and queue in simulated ms from when
# the board took the request). They differ from the in-process replay by where an arrival lands against
# the boards' step boundaries (a step is ~18 simulated ms at batch 1) and the host's scheduling jitter,
# amplified by ``speed``: that is the "host-time noise" the comparison allows.

#: host seconds for the launcher to report every board listening (N imports share the cores)
START_TIMEOUT_S = 240.0


@contextlib.contextmanager
def served_boards(n: int, *, speed: float = 1.0, bundle: str | None = None, slots: int = 4,
                  queue_limit: int = 16) -> Iterator[list[str]]:
    """``calconsole serve --boards n`` (timing-only, real-time pacing at ``speed``, loopback, ephemeral
    ports) for the ``with`` body; yields the boards' URLs and stops them all after (SIGINT, then kill).
    Raises RuntimeError with the launcher's last lines if the boards do not listen within
    :data:`START_TIMEOUT_S` host s."""
    with tempfile.TemporaryDirectory(prefix="calconsole-replay-") as d:
        cmd = [sys.executable, "-m", "calconsole", "serve", "--boards", str(n), "--host", "127.0.0.1", "--port", "0",
               "--timing-only", "--pacing", "realtime", "--speed", repr(float(speed)), "--slots", str(slots),
               "--queue-limit", str(queue_limit), "--boards-dir", d]
        if bundle:
            cmd += ["--bundle", bundle]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                            os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=env)
        try:
            assert proc.stderr is not None
            lines: list[str] = []
            deadline = time.monotonic() + START_TIMEOUT_S
            for line in proc.stderr:  # the launcher itself gives up after its start timeout
                lines.append(line)
                if "boards listening" in line or time.monotonic() > deadline:
                    break
            fleet = Path(d) / "fleet.yaml"
            if not fleet.is_file():
                raise RuntimeError("the boards did not start: " + "".join(lines[-10:]).strip())
            urls = [b["url"] for b in yaml.safe_load(fleet.read_text(encoding="utf-8"))["boards"]]
            # keep draining stderr so a chatty board never blocks on a full pipe
            threading.Thread(target=proc.stderr.read, daemon=True, name="replay-boards-stderr").start()
            yield urls
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@dataclass(frozen=True)
class Row:
    """One request to send: ``arrival_s`` (trace seconds from the first), ``prompt`` token ids, ``n_predict``;
    ``board`` the index of the URL it goes to (None: its position in the rows, round-robin)."""

    arrival_s: float
    prompt: tuple[int, ...]
    n_predict: int
    board: int | None = None


async def _send_all(rows: Sequence[Row], urls: list[str], speed: float, timeout_s: float) -> list[Record]:
    limits = httpx.Limits(max_connections=len(rows) + 4, max_keepalive_connections=len(rows) + 4)
    clients = [httpx.AsyncClient(base_url=u, timeout=httpx.Timeout(timeout_s), limits=limits) for u in urls]
    try:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2

        async def one(i: int, row: Row) -> Record:
            await asyncio.sleep(max(0.0, t0 + row.arrival_s / speed - loop.time()))
            body = {"prompt": list(row.prompt), "n_predict": row.n_predict, "ignore_eos": True, "stream": True,
                    "cache_prompt": False, "seed": i}
            board = i if row.board is None else row.board
            return await stream_completion(clients[board % len(urls)], body, f"row{i}", timeout_s=timeout_s)

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(rows))))
    finally:
        for c in clients:
            await c.aclose()


def replay_over_http(rows: Sequence[Row], urls: list[str], *, speed: float = 1.0,
                     timeout_s: float = 600.0) -> list[Record]:
    """Send ``rows`` to the boards at ``urls`` (row i to ``urls[row.board % n]``, or ``urls[i % n]`` without a board:
    round-robin) at their arrival times divided by ``speed`` (host monotonic clock); returns one
    :class:`~calconsole.bench.serve_load.Record` per row, in order (client TTFT / E2E in host wall ms; ``server``
    the board's ``calconsole.timings`` in simulated ms; ``ok`` False with the reason for a failed one, never
    raised). ``timeout_s``: host s per request. Raises ValueError for no URL or a speed outside 0.1..10."""
    if not urls:
        raise ValueError("no board URL to send to")
    if not 0.1 <= speed <= 10:
        raise ValueError(f"speed must be in 0.1..10, got {speed}")
    return asyncio.run(_send_all(rows, urls, speed, timeout_s))
