"""What constrained decoding costs per token (``calconsole bench grammar``): host wall ms, measured.

Two measurements, each with and without a grammar:

- ``pipeline``: one request's token pipeline (``serving.tokens.TokenPipeline``: grammar mask, sampler,
  stop rules, detokeniser) over the model's full vocabulary (151,936 BF16 logits for Qwen3, facts.md F1),
  fed random logits (numerics path, llama.cpp's default sampling chain) or none (the timing-only
  stand-in). Each figure is the wall time of ``sample`` + ``push`` for one token; a request that ends is
  restarted (a fresh grammar matcher, as the engine compiles one per request).
- ``serve``: timing-only requests through a fast-paced simulator (the engine, its step loop, the
  simulated device), wall ms per generated token between streamed events.

The grammars: a tool-call-like JSON schema (bounded strings, an enum, an integer range, an array) and a
small GBNF. Host figures depend on the machine and its load; a benchmark, not a test.
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

import numpy as np

from sim_backend.bundle.manifest import load_bundle
from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.errors import CalError
from sim_backend.model.bf16 import f32_to_bf16
from sim_backend.model.families import tokenizer_for
from sim_backend.planes.types import ChatRequest, DoneEvent, Grammar, SamplingParams, TokenEvent
from sim_backend.serving import grammar as G
from sim_backend.serving.tokens import TokenPipeline

#: the JSON schema measured: what a tool-using client sends (its language is finite)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 150},
                   "role": {"enum": ["admin", "user", "guest"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                   "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "active"], "additionalProperties": False}
GBNF = 'root ::= ("yes" | "no") ", " [0-9] [0-9]? [0-9]? "."'
GRAMMARS = {"none": None, "json_schema": Grammar("json_schema", json.dumps(SCHEMA)), "gbnf": Grammar("gbnf", GBNF)}


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median_ms": statistics.median(s), "p95_ms": s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))],
            "mean_ms": statistics.fmean(s)}


def measure_pipeline(tokens: int = 400, bundle: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Wall ms per token of ``TokenPipeline.sample`` + ``push`` for each grammar (``GRAMMARS``), numerics
    (random BF16 logits) and timing-only (no logits). Returns ``{"<grammar> numerics": {median_ms, p95_ms,
    mean_ms, tokens}, "<grammar> timing-only": {...}, "mask_median_ms": {<grammar>: ms}, "vocab": int,
    "tokenizer_build_s": s}``; ``*_ms`` host wall ms. ``bundle``: a bundle directory (default the built-in
    one). Raises CalError if a pipeline fails to sample."""
    b = load_bundle(bundle) if bundle is not None else load_bundle()
    tok = tokenizer_for(b)
    vocab = int(b.shape.vocab)
    eos = frozenset(tok.eos_ids)
    t0 = time.perf_counter()
    G.lltokenizer(tok, vocab, eos)
    build_s = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    # a few fixed logits vectors (BF16 bits), cycled: numerics-like spread over the whole vocabulary
    logits = [f32_to_bf16(np.asarray(rng.standard_normal(vocab) * 2.0, dtype=np.float32)) for _ in range(8)]
    prompt = tok.encode("Describe a user as JSON.")
    out: dict[str, Any] = {"vocab": vocab, "tokenizer_build_s": build_s, "mask_median_ms": {}}
    sp = SamplingParams(seed=seed)  # llama.cpp's default chain (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05)
    for name, g in GRAMMARS.items():
        masks: list[float] = []
        for mode in ("numerics", "timing-only"):
            times: list[float] = []
            req = ChatRequest.from_prompt("x", max_tokens=256, sampling=sp, grammar=g)
            p = None
            i = 0
            while len(times) < tokens:
                if p is None:
                    m = G.compile_grammar(g, tok, vocab, eos) if g is not None else None
                    p = TokenPipeline(req, prompt, n_ctx=40960, max_tokens=256, tokenizer=tok, vocab=vocab,
                                      eos_ids=eos, grammar=m)
                    if m is not None and mode == "numerics":
                        a0 = time.perf_counter()
                        m.allowed()
                        masks.append((time.perf_counter() - a0) * 1e3)
                s0 = time.perf_counter()
                try:
                    t = p.sample(logits[i % len(logits)] if mode == "numerics" else None, mode == "numerics")
                except ValueError as e:
                    raise CalError(f"sampling failed under grammar {name!r}: {e}") from None
                _, stop = p.push(t)
                times.append((time.perf_counter() - s0) * 1e3)
                i += 1
                if stop is not None:
                    p = None
            out[f"{name} {mode}"] = {**_stats(times), "tokens": len(times)}
        if masks:
            out["mask_median_ms"][name] = statistics.median(masks)
    return out


def measure_serve(requests: int = 12, bundle: str | None = None) -> dict[str, Any]:
    """Per generated token of timing-only requests (fast pacing, one slot), for each grammar: the wall gaps
    between a request's streamed events divided by the tokens each carried (``median_ms`` / ``p95_ms`` /
    ``mean_ms``, host wall ms; the first event, after the prefill, is not counted), the engine's measured
    host sampling work (``sampling_cpu_ms``: this thread's CPU ms, mask and stand-in included, which the
    engine books on the simulated clock) and the simulated TPOT (``sim_tpot_ms``, mean over requests).
    Returns ``{<grammar>: {..., "tokens", "requests"}}``. Raises CalError if a request does not finish."""
    out: dict[str, Any] = {}
    with build_system(bundle, pacing=Pacing(PacingMode.FAST), numerics=False, n_slots=1, maintenance=False) as s:
        s.inference.generate(ChatRequest.from_prompt("warm up", max_tokens=4), 60)
        for name, g in GRAMMARS.items():
            if g is not None:  # the one-off tokenizer build and a first compile are not a request's cost
                s.inference.generate(ChatRequest.from_prompt("warm up", max_tokens=4, grammar=g), 60)
            gaps: list[float] = []
            n = 0
            sampling_ms = 0.0
            tpot: list[float] = []
            for i in range(requests):
                h = s.inference.submit(ChatRequest.from_prompt("Describe a user as JSON.", max_tokens=64,
                                                               sampling=SamplingParams(seed=i), grammar=g))
                last: tuple[float, int] | None = None
                for ev in h.stream(timeout=60):
                    now = time.perf_counter()
                    if isinstance(ev, TokenEvent):
                        if last is not None and ev.n_tokens > last[1]:
                            per = (now - last[0]) * 1e3 / (ev.n_tokens - last[1])
                            gaps.extend([per] * (ev.n_tokens - last[1]))
                        last = (now, ev.n_tokens)
                    elif isinstance(ev, DoneEvent):
                        if ev.result.status != "finished":
                            raise CalError(f"request {ev.result.request_id} ended {ev.result.status}: "
                                           f"{ev.result.error}")
                        n += len(ev.result.tokens)
                        sampling_ms += ev.result.timings.host_ms.get("sampling", 0.0)
                        if ev.result.timings.tpot_ms is not None:
                            tpot.append(ev.result.timings.tpot_ms)
            if not gaps:
                raise CalError(f"no decode gaps measured for grammar {name!r}")
            out[name] = {**_stats(gaps), "sampling_cpu_ms": sampling_ms / max(1, n),
                         "sim_tpot_ms": statistics.fmean(tpot) if tpot else None, "tokens": n, "requests": requests}
    return out
