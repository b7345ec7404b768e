"""``calconsole bench realtime``: does the simulation keep real time, in-process and in the console's worker?

A real-time factor (RTF) is simulated device time / host wall time of the same step: >= 1 keeps
real-time pacing. Measured side by side in one run, straight on a fast-paced board: decode RTF
at several contexts, prefill RTF of one chunk at several prompt lengths (medians of --runs), the
numeric prompt limit they give (the longest measured prompt whose prefill keeps real time in the
worker), and numpy calls per decode step in this process. With --ui, also key latency in the
headless console while a long reply streams and as it ends, and the garbage-collection pauses
of the console's process meanwhile. Host wall ms vs simulated ms are labelled; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from typing import Any

from calconsole.bench.busy import MAX_BUSY_LOOPS
from sim_backend.planes import CalError
from sim_backend.tools.realtime_bench import BACKENDS, DECODE_CONTEXTS, PREFILL_LENGTHS, measure

from ..commands.common import fail, print_json
from . import BenchParsers


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("realtime", help="real-time factor of decode and prefill, in-process and in the worker",
                        description=__doc__.replace("``", "").split("\n\n")[1],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs per figure; medians are reported (default 3)")
    p.add_argument("--decode-steps", type=int, default=16, help="decode steps per run (default 16)")
    p.add_argument("--contexts", default=",".join(map(str, DECODE_CONTEXTS)),
                   help="decode contexts, comma-separated tokens (default 128,1024,2048,4096)")
    p.add_argument("--lengths", default=",".join(map(str, PREFILL_LENGTHS)),
                   help="prefill prompt lengths, comma-separated tokens (default 128,256,512,1024,2048)")
    p.add_argument("--backend", choices=("both", *BACKENDS), default="both", help="which numerics placement")
    p.add_argument("--kernels", choices=("compiled", "numpy", "both"), default="compiled",
                   help="numerics implementation: the compiled kernels (what runs), the numpy reference, or both "
                        "in one run (before/after on the same host and load; default compiled)")
    p.add_argument("--step-timeout", type=float, default=None, metavar="S",
                   help="the worker's bound on one measured step, host wall s (default 300, the console's); a "
                        "step over it (a long KV fill on a busy host) ends that backend's measurement: what was "
                        "measured before it is reported and the step is named")
    p.add_argument("--ui", action="store_true", help="also key latency and GC pauses in the headless console")
    p.add_argument("--ui-tokens", type=int, default=3000, help="reply length for --ui (default 3000 tokens)")
    p.add_argument("--ui-busy-loops", type=int, default=1,
                   help=f"CPU busy loops (child processes) beside the console during --ui only, 0..{MAX_BUSY_LOOPS} "
                        "(default 1)")
    p.add_argument("--ui-idle-s", type=float, default=5.0,
                   help="--ui: window of the console's idle CPU before the request and after the reply "
                        "(host wall s, 0..120, default 5; 0: not measured)")
    p.add_argument("--bundle", metavar="NAME|DIR", default=None,
                   help="calbin bundle: an installed bundle's name or a directory (default: built-in)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def _sizes(text: str, name: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not vals or any(not 1 <= v <= 8192 for v in vals):
        raise ValueError(f"{name} must be 1..8192 tokens each, got {text!r}")
    return sorted(set(vals))


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.runs <= 50:
        return fail(f"--runs must be in 1..50, got {args.runs}")
    if not 1 <= args.decode_steps <= 10_000:
        return fail(f"--decode-steps must be in 1..10000, got {args.decode_steps}")
    if not 1 <= args.ui_tokens <= 40_000:
        return fail(f"--ui-tokens must be in 1..40000, got {args.ui_tokens}")
    if not 0 <= args.ui_busy_loops <= MAX_BUSY_LOOPS:
        return fail(f"--ui-busy-loops must be in 0..{MAX_BUSY_LOOPS}, got {args.ui_busy_loops}")
    if not 0 <= args.ui_idle_s <= 120:
        return fail(f"--ui-idle-s must be in 0..120, got {args.ui_idle_s}")
    if args.step_timeout is not None and not 0 < args.step_timeout <= 3600:
        return fail(f"--step-timeout must be in (0, 3600] s, got {args.step_timeout}")
    try:
        contexts = _sizes(args.contexts, "--contexts")
        lengths = _sizes(args.lengths, "--lengths")
    except ValueError as e:
        return fail(str(e))
    backends = list(BACKENDS) if args.backend == "both" else [args.backend]
    kernels = ["compiled", "numpy"] if args.kernels == "both" else [args.kernels]
    try:
        rep: dict[str, Any] = measure(backends=backends, runs=args.runs, decode_steps=args.decode_steps,
                                      contexts=contexts, prompt_lengths=lengths, kernels=kernels,
                                      bundle=getattr(args, "bundle", None),
                                      step_timeout_s=getattr(args, "step_timeout", None))
    except (CalError, ValueError) as e:
        return fail(str(e))
    if args.ui:
        try:
            rep["ui"] = asyncio.run(_ui(args.ui_tokens, busy_loops=args.ui_busy_loops, idle_s=args.ui_idle_s))
        except OSError as e:
            return fail(f"could not start a busy loop: {e}")
    if args.json:
        print_json(rep)
        return 0
    print(f"real-time factor = simulated device time / host wall time; CPU RTF = simulated / CPU time of the "
          f"process running the numerics (medians of {args.runs} runs)")
    la = rep.get("load_average")
    if la:
        print(f"  host load average (1 min) at start / end: {la[0]:.2f} / {la[1]:.2f}")
    for b in (key for key in rep if isinstance(rep[key], dict) and "decode_rtf" in rep[key]):
        r = rep[b]
        nice = f", worker nice {r['worker_nice']}" if r.get("worker_nice") is not None else ""
        print(f"  {b} ({r['kernels']} kernels{nice}):")
        if r["decode_rtf"]:
            print("    decode  " + "  ".join(
                f"ctx {k}: {v:.2f} ({r['decode_wall_ms'][k]:.2f} ms wall / {r['decode_sim_ms'][k]:.2f} ms sim; "
                f"CPU RTF {r['decode_cpu_rtf'][k]:.2f})" for k, v in r["decode_rtf"].items()))
        if r["prefill_rtf"]:
            print("    prefill " + "  ".join(
                f"{k} tok: {v:.2f} ({r['prefill_wall_ms'][k]:.0f} ms wall / {r['prefill_sim_ms'][k]:.0f} ms sim; "
                f"CPU RTF {r['prefill_cpu_rtf'][k]:.2f})" for k, v in r["prefill_rtf"].items()))
        if r["numpy_calls_per_decode_step"] is not None:
            print(f"    numpy calls per decode step in this process: {r['numpy_calls_per_decode_step']}")
        if r.get("unfinished"):
            print("    " + unfinished_line(r["unfinished"]))
    print("  " + limit_line(rep, backends))
    if args.ui:
        from .keys import busy_text, idle_lines, key_lines

        u = rep["ui"]
        print(f"  console (--ui, timing-only simulator): {busy_text(u['busy_loops'])}")
        for line in key_lines(u, "keys "):
            print(f"  {line} (host wall ms, key posted -> shown)")
        for line in idle_lines(u, "console "):
            print(f"  {line}")
        g0 = u["gc_startup"]
        print(f"  GC pauses before the first key (start-up): {g0['n']} collections, max {g0['max_ms']:.1f} ms")
        g = u["gc"]
        print(f"  GC pauses from the first key on: {g['n']} collections, gen2 {g['gen2_n']}, max {g['max_ms']:.1f} ms, "
              f"over 20 ms: {g['over_20ms']}")
    return 0


async def _ui(max_tokens: int, *, busy_loops: int = 0, idle_s: float = 0.0) -> dict[str, Any]:
    """Key latency (bench keys) while a timing-only reply streams, with every GC pause of this process,
    ``busy_loops`` busy child processes beside it and the console's idle CPU over ``idle_s`` (as
    ``keys._measure``; OSError if a busy loop cannot start).

    Pauses are split by when they happened: ``gc`` counts those from the first key typed to the
    end of the measurement (what an operator could feel), ``gc_startup`` those before it (imports,
    building the app, the console's own collect-and-freeze at mount, before anyone can type).
    """
    from .keys import _measure

    pauses: list[tuple[int, float, float]] = []   # (generation, ms, perf_counter at start)
    started: dict[str, float] = {}

    def cb(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started["t"] = time.perf_counter()
        elif "t" in started:
            t = started.pop("t")
            pauses.append((int(info.get("generation", -1)), (time.perf_counter() - t) * 1e3, t))

    gc.callbacks.append(cb)
    try:
        r = await _measure(max_tokens, 1.0, (120, 36), busy_loops=busy_loops, idle_s=idle_s)
    finally:
        gc.callbacks.remove(cb)
    first_key = r.pop("window_perf_s")[0]

    def summary(ps: list[tuple[int, float, float]]) -> dict[str, Any]:
        ms = [p for _, p, _ in ps]
        return {"n": len(ms), "gen2_n": sum(1 for g, _, _ in ps if g == 2),
                "median_ms": statistics.median(ms) if ms else 0.0, "max_ms": max(ms, default=0.0),
                "over_20ms": sum(1 for p in ms if p > 20.0), "unit": "host wall ms per collection"}

    r["gc"] = summary([p for p in pauses if first_key is None or p[2] >= first_key])
    r["gc_startup"] = summary([p for p in pauses if first_key is not None and p[2] < first_key])
    return r


def unfinished_line(u: dict[str, Any]) -> str:
    """The step a backend's measurement stopped at (``measure_backend``'s ``unfinished``), as a sentence."""
    return (f"NOT MEASURED from here: {u['what']} did not finish ({u['error']}); the figures above are what "
            "was measured before it, longer lengths and contexts were not measured")


def limit_line(rep: dict[str, Any], backends: list[str]) -> str:
    """The numeric prompt limit as a sentence: the length, or that none of the measured lengths kept real
    time (not "0 tokens"), with the RTF of the first length that fell behind to 3 decimals (an RTF of
    0.998 prints as 1.00 in the table above)."""
    src = rep.get("worker") or next(v for v in rep.values() if isinstance(v, dict) and "prefill_rtf" in v)
    rtf = src["prefill_rtf"]
    limit = rep["numeric_limit_tokens"]
    miss = next((n for n in sorted(rtf, key=int) if int(n) > limit), None)
    behind = f"{miss} tokens fell behind (RTF {rtf[miss]:.3f} < 1)" if miss is not None else ""
    u = src.get("unfinished")
    if not behind and u and u["what"].startswith("prefill"):
        behind = f"{u['length']} tokens did not finish (not measured)"
    if limit == 0:
        return ("numeric prompt limit: none of the measured prompt lengths keeps real time on this host "
                f"(the shortest, {behind}); every prompt would run timing-only")
    return (f"numeric prompt limit (longest measured prompt whose prefill keeps real time): {limit} tokens"
            + (f"; {behind}" if behind else ""))
