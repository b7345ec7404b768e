"""``calconsole metrics``: Prometheus text exposition of the serving metrics (``llamacpp:`` names).

By default prints the registry of a freshly built simulator (counters at 0); with
``--connect URL`` the live device's (the server's ``/metrics``).
``--warmup N`` first runs a short scripted workload of N requests (timing-only
unless ``--numerics``) so the histograms have samples. Latencies are
SIMULATED seconds (Prometheus base unit): device time plus the host work
booked on the same clock (``--host-time``: modeled by default, or measured).
TTFT and ITL count every request that produced tokens (cancelled or failed
ones too); E2E and TPOT finished requests only.
"""

from __future__ import annotations

import argparse

import msgspec

from sim_backend.planes import SLO

from .common import (
    Subparsers,
    add_common_options,
    add_connect_options,
    build_from_args,
    connect_from_args,
    fail,
    print_json,
)

WARMUP_PROMPTS = ("Hello!", "Summarise the history of lighthouses in three sentences.",
                  "Write a haiku about chiplets.", "What is 17 times 23?")


def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "metrics", help="print Prometheus metrics (llamacpp: names); --warmup N runs N requests first",
        description="Print the serving metrics in Prometheus text exposition format, with llama.cpp's "
                    "'llamacpp:' names (prompt_tokens_total, tokens_predicted_total, requests_processing, "
                    "requests_deferred, kv_cache_usage_ratio, ...) plus histograms of TTFT, ITL, TPOT, E2E "
                    "and queue time in SIMULATED device seconds. TTFT counts every request that produced a "
                    "first token (also those cancelled or failed after it, as vLLM counts it), ITL every "
                    "streamed gap; E2E and TPOT count finished requests only. Without --warmup the registry "
                    "is fresh; with --connect URL they are the live device's (the server's /metrics).")
    add_common_options(p, default_pacing="fast")
    add_connect_options(p, admin=False)
    p.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="run N short scripted requests first (default 0: print the fresh registry)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per warm-up request (default 16)")
    p.add_argument("--numerics", action="store_true",
                   help="run the warm-up with the numerics (default: timing-only, fast)")
    p.add_argument("--slo", default=None, metavar="SPEC",
                   help="goodput SLOs, vLLM style: ttft:MS,tpot:MS,e2el:MS (simulated ms, each a positive "
                        "finite number, each key at most once; a bad field exits with code 2 naming it)")
    p.add_argument("--json", action="store_true", help="print the JSON summary (P50/P95/P99, goodput) instead")
    p.set_defaults(func=run)


def parse_slo(spec: str) -> SLO:
    """``--slo ttft:MS,tpot:MS,e2el:MS`` -> ``SLO`` (simulated ms). Raises ValueError with a
    one-line message naming the offending field (``SLO.parse`` itself reports a bad number
    with Python's float() message, which does not say which field)."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise ValueError(f"--slo names no objective (got {spec[:40]!r}); expected ttft:MS,tpot:MS,e2el:MS "
                         "or leave --slo out")
    seen: set[str] = set()
    for part in parts:
        key, _, val = part.partition(":")
        if key in seen:
            raise ValueError(f"--slo field '{key}' given twice; give each of ttft, tpot, e2el at most once")
        seen.add(key)
        if key in ("ttft", "tpot", "e2el") and val:
            try:
                ms = float(val)
            except ValueError:
                ms = float("nan")
            if not 0 < ms < float("inf"):
                raise ValueError(f"--slo field '{key}': expected a positive number of simulated ms, got {val!r}")
    return SLO.parse(spec)  # unknown keys and empty values: SLO.parse's message names the part


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError, ChatRequest, SamplingParams

    if not 0 <= args.warmup <= 10_000:
        return fail(f"--warmup must be in 0..10000, got {args.warmup}")
    if not 1 <= args.max_tokens <= 4096:
        return fail(f"--max-tokens must be in 1..4096, got {args.max_tokens}")
    try:
        slo = parse_slo(args.slo) if args.slo is not None else None
    except ValueError as e:
        return fail(str(e))
    if args.connect:
        if args.warmup or slo is not None:
            return fail("--warmup and --slo shape a fresh in-process device; with --connect the live device's "
                        "metrics are printed as they are")
        try:
            with connect_from_args(args) as remote:
                text = remote.observation.metrics_text()
                summary = msgspec.to_builtins(remote.observation.snapshot().requests) if args.json else None
        except (CalError, ValueError) as e:
            return fail(str(e))
        if args.json:
            print_json(summary)
        else:
            print(text, end="")
        return 0
    if not args.numerics:
        args.timing_only = True  # the registry does not depend on the numerics; timing-only builds faster
    try:
        system = build_from_args(args, maintenance=False, slo=slo)
    except (CalError, ValueError) as e:
        return fail(str(e))
    with system:
        device = system.observation.snapshot().device
        assert device is not None  # the in-process simulator always reports its device
        n_slots = device.n_slots
        # batches of n_slots concurrent requests: the queue limit is never hit
        for start in range(0, args.warmup, n_slots):
            batch = [system.inference.submit(ChatRequest.from_prompt(WARMUP_PROMPTS[i % len(WARMUP_PROMPTS)],
                                                           max_tokens=args.max_tokens,
                                                           sampling=SamplingParams(seed=i), client="metrics-warmup"))
                     for i in range(start, min(args.warmup, start + n_slots))]
            for h in batch:
                h.result(600.0)
        text = system.observation.metrics_text()
        summary = msgspec.to_builtins(system.observation.snapshot().requests)
    if args.json:
        print_json(summary)
    else:
        print(text, end="")
    return 0

