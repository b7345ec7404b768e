"""Wall time per decode step, in-process vs the console's numerics worker (``calconsole bench step``).

Host wall ms (and this process's CPU ms) per decode step; the simulated device time is not what
is measured here.
"""

from __future__ import annotations

import statistics
import time
from itertools import pairwise
from typing import Any

from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.errors import CalError
from sim_backend.planes.types import ChatRequest, SamplingParams

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
                 bundle: Any = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """Wall ms per decode step on a fresh system (``worker``: numerics in the spawned process).

    Returns ``{"mode", "steps", "median_ms", "p95_ms", "mean_ms", "device_compute_median_ms",
    "process_cpu_median_ms", "process_cpu_mean_ms", "context_min", "context_max", "requests", "token_ids"}``;
    ``*_ms`` are host wall milliseconds (``device_compute``: the device thread's numerics call, IPC
    included for the worker) except ``process_cpu_*``: this process's CPU ms per decode step, and
    ``sim_median_ms``: the simulated device time of a decode step (H2D + infer + D2H, cost model).
    Raises CalError if a request does not finish or yields no decode steps.
    """
    # (wall s, kind, seq, past_len, compute ms, cpu s, simulated device ms)
    marks: list[tuple[float, str, int, int, float, float, float]] = []
    words = max(1, int(context * 0.6))  # ~1.6 tokens per word of this prompt with the chat template
    token_ids: list[list[int]] = []
    ctx_seen: list[int] = []
    with build_system(bundle, pacing=Pacing(PacingMode.FAST), numerics=True, n_slots=1, maintenance=False,
                      numerics_process=worker, numerics_max_prompt=4096) as s:
        s.inference.generate(ChatRequest.from_prompt("warm up", max_tokens=3,
                                                     sampling=SamplingParams(temperature=0.0)), timeout_s)
        s.board.add_listener(lambda r: marks.append((time.perf_counter(), r.kind, r.seq_id, r.past_len,
                                                     r.compute_wall_ms, time.process_time(), r.sim_us / 1e3)))
        i = 0
        gaps: list[float] = []
        compute: list[float] = []
        cpu: list[float] = []
        sim: list[float] = []
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
            for prev, cur in pairwise(marks):
                if cur[1] == "decode" and prev[1] == "decode" and cur[2] == prev[2]:
                    gaps.append((cur[0] - prev[0]) * 1e3)
                    compute.append(cur[4])
                    cpu.append((cur[5] - prev[5]) * 1e3)
                    sim.append(cur[6])
                    ctx_seen.append(cur[3] + 1)
    gaps, compute, cpu, ctx_seen = gaps[:steps], compute[:steps], cpu[:steps], ctx_seen[:steps]
    if not gaps:
        raise CalError("no decode steps were measured")
    return {"mode": "worker" if worker else "in-process", "steps": len(gaps),
            "median_ms": statistics.median(gaps), "p95_ms": _pct(gaps, 0.95), "mean_ms": statistics.fmean(gaps),
            "device_compute_median_ms": statistics.median(compute),
            "process_cpu_median_ms": statistics.median(cpu), "process_cpu_mean_ms": statistics.fmean(cpu),
            "sim_median_ms": statistics.median(sim[:steps]),
            "context_min": min(ctx_seen), "context_max": max(ctx_seen), "requests": i, "token_ids": token_ids}




def measure_prefill(worker: bool, sizes: list[int], *, bundle: Any = None, repeats: int = 3,
                    timeout_s: float = 600.0) -> list[dict[str, Any]]:
    """Host wall ms of one prefill of exactly ``n`` prompt tokens (raw token ids, no cache), per ``n``.

    Returns per size ``{"tokens", "wall_median_ms", "sim_ms", "wall_tok_s", "sim_tok_s"}``: ``wall``
    is the device thread's numerics call (host wall, IPC included for the worker), ``sim`` the
    simulated device time of that prefill step (cost model). Raises CalError if a request fails.
    """
    out = []
    with build_system(bundle, pacing=Pacing(PacingMode.FAST), numerics=True, n_slots=1, maintenance=False,
                      numerics_process=worker, numerics_max_prompt=max(sizes) + 1) as s:
        seen: list[tuple[str, int, float, float]] = []
        s.board.add_listener(lambda r: seen.append((r.kind, r.n_tokens, r.compute_wall_ms, r.sim_us / 1e3)))
        lo, hi = getattr(s.engine.tokenizer, "text_id_range", (0, 151643))
        for n in sizes:
            walls, sims = [], []
            for k in range(repeats):
                ids = tuple(int(lo + (7919 * (i + 31 * k)) % (hi - lo)) for i in range(n))  # fixed, varied ids
                seen.clear()
                res = s.inference.generate(ChatRequest(messages=(), prompt_tokens=ids, max_tokens=1,
                                                       sampling=SamplingParams(temperature=0.0), cache_prompt=False),
                                           timeout_s)
                if res.status != "finished":
                    raise CalError(f"prefill of {n} tokens ended {res.status}: {res.error}")
                pf = [x for x in seen if x[0] == "prefill"]
                walls.append(sum(x[2] for x in pf))
                sims.append(sum(x[3] for x in pf))
            w, sm = statistics.median(walls), statistics.median(sims)
            out.append({"tokens": n, "wall_median_ms": w, "sim_ms": sm, "wall_tok_s": n * 1e3 / w if w else 0.0,
                        "sim_tok_s": n * 1e3 / sm if sm else 0.0})
    return out
