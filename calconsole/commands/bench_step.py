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
import statistics
import time
from typing import Any

from sim_backend.errors import CalError

from .common import fail, print_json

MODES = {"in-process": False, "worker": True}


def _prompt(i: int, words: int) -> str:
    base = f"Request {i}: summarise the maintenance log for chiplet {i % 2} and list the faults seen today. "
    text = base
    while len(text.split()) < words:
        text += base
    return " ".join(text.split()[:words])


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def measure_step(worker: bool, *, steps: int = 200, context: int = 100, tokens_per_request: int = 50,
                 bundle: Any = None, timeout_s: float = 600.0) -> dict:
    """Wall ms per decode step on a fresh system (``worker``: numerics in the spawned process).

    Returns ``{"mode", "steps", "median_ms", "p95_ms", "mean_ms", "device_compute_median_ms",
    "process_cpu_median_ms", "process_cpu_mean_ms", "context_min", "context_max", "requests", "token_ids"}``;
    ``*_ms`` are host wall milliseconds (``device_compute``: the device thread's numerics call, IPC
    included for the worker) except ``process_cpu_*``: this process's CPU ms per decode step.
    Raises CalError if a request does not finish or yields no decode steps.
    """
    from sim_backend.device import Pacing, PacingMode
    from sim_backend.engine import ChatRequest
    from sim_backend.sampling import SamplingParams
    from sim_backend.system import build_system

    marks: list[tuple[float, str, int, int, float, float]] = []  # (wall s, kind, seq, past_len, compute ms, cpu s)
    words = max(1, int(context * 0.6))  # ~1.6 tokens per word of this prompt with the chat template
    token_ids: list[list[int]] = []
    ctx_seen: list[int] = []
    with build_system(bundle, pacing=Pacing(PacingMode.FAST), numerics=True, n_slots=1, maintenance=False,
                      numerics_process=worker, numerics_max_prompt=4096) as s:
        s.inference.generate(ChatRequest.from_prompt("warm up", max_tokens=3,
                                                     sampling=SamplingParams(temperature=0.0)), timeout_s)
        s.board.add_listener(lambda r: marks.append((time.perf_counter(), r.kind, r.seq_id, r.past_len,
                                                     r.compute_wall_ms, time.process_time())))
        i = 0
        gaps: list[float] = []
        compute: list[float] = []
        cpu: list[float] = []
        while len(gaps) < steps:
            if i > 4 * steps:
                raise CalError("requests end too early to collect the decode steps asked for")
            marks.clear()
            res = s.inference.generate(ChatRequest.from_prompt(
                _prompt(i, words), max_tokens=tokens_per_request, sampling=SamplingParams(temperature=0.0)),
                timeout_s)
            if res.status != "finished":
                raise CalError(f"request {res.request_id} ended {res.status}: {res.error}")
            token_ids.append(list(res.tokens))
            i += 1
            for prev, cur in zip(marks, marks[1:]):
                if cur[1] == "decode" and prev[1] == "decode" and cur[2] == prev[2]:
                    gaps.append((cur[0] - prev[0]) * 1e3)
                    compute.append(cur[4])
                    cpu.append((cur[5] - prev[5]) * 1e3)
                    ctx_seen.append(cur[3] + 1)
    gaps, compute, cpu, ctx_seen = gaps[:steps], compute[:steps], cpu[:steps], ctx_seen[:steps]
    if not gaps:
        raise CalError("no decode steps were measured")
    return {"mode": "worker" if worker else "in-process", "steps": len(gaps),
            "median_ms": statistics.median(gaps), "p95_ms": _pct(gaps, 0.95), "mean_ms": statistics.fmean(gaps),
            "device_compute_median_ms": statistics.median(compute),
            "process_cpu_median_ms": statistics.median(cpu), "process_cpu_mean_ms": statistics.fmean(cpu),
            "context_min": min(ctx_seen), "context_max": max(ctx_seen), "requests": i, "token_ids": token_ids}


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
