"""Replay a production trace on simulated boards: capacity planning (``calconsole bench replay``).

A trace is a CSV of ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure's LLM inference trace 2023, shipped
in ``calconsole/bench/data/azure-llm-2023``). Each row is one request: it arrives at its timestamp (scaled
by ``speedup``), carries a prompt of exactly ContextTokens tokens and yields exactly GeneratedTokens tokens
(EOS ignored), timing-only. A router sends it to one of ``boards`` simulated boards; one board is what one
``calconsole serve`` process runs: ``n_slots`` slots, a FIFO queue of ``queue_limit`` beyond the free slots,
the engine's round scheduler (:class:`~sim_backend.serving.scheduler.RoundScheduler`, the same object), the
bundle's KV pool and the calibrated cost model, host work modeled per sampled token (facts.md F7,
``host_overhead_ms_per_token``), one step in flight (serve's default).

The fast path (:class:`BoardSim`) does not step tokens: a batch-1 board serves one sequence per step and
the cost model prices a step from its size and context alone, so it prices steps from tables
(:class:`StepPrices`: decode = a per-step part by batch size + a per-sequence part by context, prefix-summed
over context; prefill chunks memoised) and runs whole scheduler rounds in closed form while nothing
changes (no arrival, prefill or finish), going step by step only around those events. The token-by-token
engine (:func:`replay_on_engine`) is its reference: the same slice through real ``Engine`` objects.

Clocks: every latency is SIMULATED device time (µs inside, ms out) plus the modeled host work booked on
it; ``wall_seconds`` is this machine's measured time for the replay itself.

Event rule shared by both paths: a board notices an arrival at its first step boundary at or after it
(a device step is never interrupted); the request is refused there if ``queue_limit`` requests already
wait beyond the free slots (llama-server's "server busy"), else it takes a free slot (least recently
used, as ``admission.choose_slot`` with no shared prefix) or waits in the FIFO. Routing looks at each
board at that boundary.

Where the parts live: trace loading in :mod:`sim_backend.tools.replay_trace`, the price tables and the
replayable bundles in :mod:`sim_backend.tools.replay_prices`, the board model in
:mod:`sim_backend.tools.replay_board`; this module routes a fleet of boards (:func:`replay`) and
summarises what they booked (:func:`summarize`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sim_backend.planes.types import SLO
from sim_backend.tools.replay_board import BoardSim, Ledger, ReplayConfig
from sim_backend.tools.replay_prices import StepPrices
from sim_backend.tools.replay_trace import Trace

__all__ = ["replay", "summarize"]


# --- a fleet ------------------------------------------------------------------------------------


def _route(boards: Sequence[BoardSim], i: int, how: str) -> BoardSim:
    """The board request ``i`` goes to (ties: the lowest index)."""
    if how == "round-robin":
        return boards[i % len(boards)]
    if how == "least-outstanding":
        return min(boards, key=lambda b: (b.outstanding, b.index))
    return min(boards, key=lambda b: (b.kv_demand, b.outstanding, b.index))


def _q(vals: np.ndarray) -> dict[str, float | None]:
    """{p50, p95, p99} of ``vals`` (already in ms), None when empty."""
    if vals.size == 0:
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(vals, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def summarize(trace: Trace, led: Ledger, *, slo: SLO, attainment: float) -> dict[str, Any]:
    """Metrics of a finished replay (vLLM's definitions, simulated ms): per request TTFT = arrival -> first
    token, E2E = arrival -> last, TPOT = (E2E - TTFT) / (out - 1), queue = arrival -> slot; ITL pooled gaps.
    ``attainment`` = share of ALL trace requests that finished meeting every SLO (a refused one misses);
    ``goodput`` = those requests (and their output tokens) per trace second (None over a zero span);
    ``meets_slo`` = attainment >= the target."""
    arr = trace.arrival_s * 1e6
    done = ~np.isnan(led.last)
    ttft = (led.first - arr)[done] / 1e3
    e2e = (led.last - arr)[done] / 1e3
    outs = trace.output[done]
    tpot = np.where(outs > 1, (e2e - ttft) / np.maximum(1, outs - 1), np.nan)
    queue = (led.assigned - arr)[~np.isnan(led.assigned)] / 1e3
    good = np.ones(int(done.sum()), dtype=bool)
    if slo.ttft_ms is not None:
        good &= ttft <= slo.ttft_ms
    if slo.tpot_ms is not None:
        good &= np.isnan(tpot) | (tpot <= slo.tpot_ms)
    if slo.e2el_ms is not None:
        good &= e2e <= slo.e2el_ms
    n = len(trace)
    att = float(good.sum()) / n if n else 0.0
    span = trace.span_s  # a rate over no time is no rate: None for a single instant
    return {"metrics": {"ttft_ms": _q(ttft), "tpot_ms": _q(tpot[~np.isnan(tpot)]), "itl_ms": _q(led.gaps() / 1e3),
                        "e2e_ms": _q(e2e), "queue_ms": _q(queue)},
            "finished": int(done.sum()),
            "slo": slo.to_dict(), "attainment_target": attainment, "attainment": att,
            "meets_slo": att >= attainment,
            "goodput": {"requests_per_s": float(good.sum()) / span if span > 0 else None,
                        "tokens_per_s": float(outs[good].sum()) / span if span > 0 else None}}


def replay(trace: Trace, prices: StepPrices, *, boards: int, cfg: ReplayConfig | None = None,
           slo: SLO | None = None, attainment: float = 0.9,
           progress: Callable[[int, int], None] | None = None,
           timeline_points: int = 0, refused_out: set[int] | None = None) -> dict[str, Any]:
    """Replay ``trace`` on ``boards`` boards priced by ``prices`` (the fast path); returns the report dict.
    ``refused_out``, when given, receives the 0-based indices of the requests refused at arrival (queue full,
    context).

    Keys: ``requests``, ``trace_seconds``, ``boards``, ``bundle``, ``metrics`` {ttft_ms, tpot_ms, itl_ms,
    e2e_ms, queue_ms: {p50, p95, p99}} (simulated ms), ``goodput``, ``attainment``, ``meets_slo``,
    ``rejected`` {reason: count}, ``rejected_rows`` (first 20 per reason, 1-based data rows of the trace
    file: ``Trace.file_row``),
    ``per_board`` [{requests, busy_pct, kv_peak_pct}], ``trace`` (the workload's figures), ``steps``,
    the router: ``round-robin`` (row i to board i mod N), ``least-outstanding`` (fewest queued + running),
    ``least-kv`` (least KV demand: prompt + output of its outstanding requests), ties to the lowest index;
    ``rounds_skipped`` and, with ``timeline_points`` > 0, ``timeline`` (latency and queue over trace time).
    ``progress(done, total)`` is called every 512 arrivals. Raises ValueError for boards < 1 or an
    attainment outside (0, 1].
    """
    if boards < 1:
        raise ValueError(f"boards must be >= 1, got {boards}")
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")
    cfg = cfg or ReplayConfig()
    slo = slo or SLO()
    n = len(trace)
    led = Ledger(n)
    fleet = [BoardSim(i, prices, cfg, led, trace.prompt, trace.output) for i in range(boards)]
    arr = trace.arrival_s * 1e6
    stateful = cfg.route != "round-robin"
    quiet = [0.0] * boards  # per board: no request ends before this (simulated µs)
    for i in range(n):
        a = float(arr[i])
        if stateful:
            # what the router reads changes only when a request ends: run only boards where one may have
            for k, bk in enumerate(fleet):
                if quiet[k] <= a:
                    bk.run_until(a)
                    quiet[k] = bk.quiet_until()
        b = _route(fleet, i, cfg.route)
        b.run_until(a)
        why = b.submit(i, a)
        quiet[b.index] = b.quiet_until()
        if why:
            led.reason[i] = why
            if refused_out is not None:
                refused_out.add(i)
        if progress is not None and (i % 512 == 511 or i == n - 1):
            progress(i + 1, n)
    for b in fleet:
        b.run_until(math.inf)
    out: dict[str, Any] = {"requests": n, "trace_seconds": trace.span_s, "boards": boards,
                           "bundle": prices.bundle, "route": cfg.route,
                           "board_config": {"slots": cfg.slots_for(prices.decode_batch), "queue_limit": cfg.queue_limit,
                                            "prefill_chunk": cfg.prefill_chunk, "decode_batch": prices.decode_batch,
                                            "kv_cells": prices.kv_cells, "n_ctx": prices.n_ctx,
                                            "host_token_ms": prices.host_token_us / 1e3}}
    out.update(summarize(trace, led, slo=slo, attainment=attainment))
    rejected: dict[str, int] = {}
    rows: dict[str, list[int]] = {}
    for i, why in enumerate(led.reason):
        if why:
            rejected[why] = rejected.get(why, 0) + 1
            if len(rows.setdefault(why, [])) < 20:
                rows[why].append(trace.file_row(i))
    out["rejected"] = rejected
    out["rejected_rows"] = rows
    span_us = max(max(b.t for b in fleet), float(arr[-1]), 1.0)
    out["per_board"] = [{"requests": b.served, "busy_pct": 100.0 * b.busy_us / span_us,
                         "kv_peak_pct": 100.0 * b.kv_peak / prices.kv_cells} for b in fleet]
    out["trace"] = trace.stats()
    out["steps"] = sum(b.steps for b in fleet)
    out["rounds_skipped"] = sum(b.rounds_skipped for b in fleet)
    out["clock"] = ("latencies are SIMULATED ms (cost model at full size + modeled host work per token); "
                    "wall_seconds is this machine's time for the replay")
    if timeline_points:
        out["timeline"] = _timeline(trace, led, timeline_points)
    return out


def _timeline(trace: Trace, led: Ledger, points: int) -> dict[str, list[float | None]]:
    """Per trace-time bin (``points`` bins): p95 TTFT / E2E of the requests arriving in it (simulated ms) and
    the longest fleet queue met by an arrival in it (requests arrived, not refused, not yet in a slot). A bin
    whose arrivals all went unserved has None for its latencies (JSON has no NaN)."""
    edges = np.linspace(0.0, max(trace.span_s, 1e-9), points + 1)
    which = np.clip(np.searchsorted(edges, trace.arrival_s, side="right") - 1, 0, points - 1)
    arr = trace.arrival_s * 1e6
    served = led.board >= 0
    got = np.sort(led.assigned[served & ~np.isnan(led.assigned)])
    queue_len = (np.searchsorted(np.sort(arr[served]), arr, side="right")
                 - np.searchsorted(got, arr, side="right"))
    ttft = (led.first - arr) / 1e3
    e2e = (led.last - arr) / 1e3
    t_out: list[float | None] = []
    ttft_out: list[float | None] = []
    e2e_out: list[float | None] = []
    q_out: list[float | None] = []
    for k in range(points):
        m = which == k
        if not m.any():
            continue
        t_out.append(float(edges[k]))
        tt, ee = ttft[m], e2e[m]
        ttft_out.append(float(np.nanpercentile(tt, 95)) if np.isfinite(tt).any() else None)
        e2e_out.append(float(np.nanpercentile(ee, 95)) if np.isfinite(ee).any() else None)
        q_out.append(float(queue_len[m].max()))
    return {"t_s": t_out, "ttft_p95_ms": ttft_out, "e2e_p95_ms": e2e_out, "queue_max": q_out}

