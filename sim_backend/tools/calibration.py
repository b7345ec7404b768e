"""Calibration of the simulated cost model against FACTS F7 (report §10).

Cases (all simulated with :class:`~sim_backend.model.costmodel.CostModel` at full
Qwen3-30B-A3B size, expected experts touched):

* ``prefill_27_tok_s``: 27 tokens / one prefill step -> 184.27 tok/s (±3 %).
* ``decode_246_tok_s``: 246 decode steps, context growing 27..272,
  246 / sum(step time) -> 58.25 tok/s (±3 %).
* ``e2e_27_prompt_246_decode``: prefill(27) + 245 decode steps (contexts
  27..271: a request that generates 246 tokens samples the first from the
  prefill's logits and never feeds the 246th back) + the host allowance
  ``host_overhead_ms_per_token`` x 246 generated tokens -> 4.41 s (±3 %).
  The allowance is a FITTED stand-in for host work (HTTP, tokenizer, CPU
  sampling, detokenisation) and is used ONLY by this cost-model-only case.

Engine-level cases (:func:`run_engine_cases`, ``calconsole bench calibrate``):
the real serving engine, timing-only (``build_system(numerics=False)``), runs
a 27-token prompt (chat template included) with ``max_tokens=246`` and its
own ``timings`` are compared with F7: ``engine_e2e_27_prompt_246_decode``
(``e2e_ms``, 4.41 s), ``engine_prefill_27_tok_s`` (``prompt_per_second``,
184.27) and ``engine_decode_246_tok_s`` (``predicted_per_second``, 58.25;
llama.cpp's definition: 246 tokens over the 245 gaps).  The engine MEASURES
its host work and puts it on the simulated clock, and neither the device
nor the engine adds ``host_overhead_ms_per_token``, so host time is counted
once in each path (tests/test_calibration.py checks both).
* ``decode_ctx_*``: one decode step at a context inside the historical
  bands (F7 CSV, mixed versions): ~2K 38–46, ~4K 28–40, ~8K 20–30,
  ~16K 20–30, ~33K "about 12" -> we use the band 10.5–13.5 (our choice),
  ~40K 10–16.  Contexts used: 2048, 4096, 8192, 16384, 33000, 40900.
* ``prefill_rises_with_prompt_length`` (16..2048 tokens: weights amortised
  over more tokens; beyond a few thousand tokens quadratic attention and
  activation traffic flatten it, as on real hardware) and
  ``decode_falls_with_context`` (27..40900).

How the YAML's fitted values were obtained: :func:`fit_parameters` (run
offline, never at import) bisects, in turn, ``weight_stream_eff`` on the
246-token decode rate, ``fp16_compute_eff`` on the 27-token prefill rate,
``kv_read_eff`` so the ~16K and ~33K cases have equal log-margins to their
binding band edges (20 tok/s and 13.5 tok/s), and ``attn_kv_ramp_us`` so
the ~2K case sits at the centre of its band (42 tok/s); repeated until
stable, then ``host_overhead_ms_per_token`` closes the cost-model E2E case
exactly.
Rounded results are written by hand into ``hardware/calculet_npu.yaml``.

Why the saturating KV ramp exists: with a purely linear KV cost the ~2K band
needs >= 2.98 µs of decode time per context token while the ~16K band allows
<= 2.1 µs; the bands (mixed software versions) cannot all hold on one line.
The ramp ``attn_kv_ramp_us · (1 - exp(-ctx / attn_kv_ramp_tokens))`` per
layer per chip is a fitted stand-in (e.g. flash-attention KV streaming
start-up), not a mechanism the report describes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from itertools import pairwise

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.costmodel import CostModel

TOLERANCE_PCT = 3.0

#: FACTS F7 point measurements.
PREFILL_27_TOK_S = 184.27
DECODE_246_TOK_S = 58.25
E2E_S = 4.41
PROMPT_TOKENS = 27
DECODE_TOKENS = 246

#: (name, context tokens, [lo, hi] tok/s) — FACTS F7 decode-by-context bands.
DECODE_BANDS: tuple[tuple[str, int, tuple[float, float]], ...] = (
    ("decode_ctx_2k", 2048, (38.0, 46.0)),
    ("decode_ctx_4k", 4096, (28.0, 40.0)),
    ("decode_ctx_8k", 8192, (20.0, 30.0)),
    ("decode_ctx_16k", 16384, (20.0, 30.0)),
    ("decode_ctx_33k", 33000, (10.5, 13.5)),   # "about 12": band chosen by us
    ("decode_ctx_40k", 40900, (10.0, 16.0)),
)
PREFILL_TREND_LENGTHS = (16, 27, 64, 128, 256, 512, 1024, 2048)
DECODE_TREND_CONTEXTS = (27, 512, 2048, 4096, 8192, 16384, 33000, 40900)


def prefill_tok_s(cm: CostModel, n_tokens: int, shape: ModelShape | None = None) -> float:
    """Simulated prefill rate: n_tokens / (H2D + infer + D2H) of one prefill step, tok/s."""
    shape = shape or ModelShape()
    return n_tokens * 1e6 / cm.price_step(shape, "prefill", n_tokens, 0).total_us


def decode_step_tok_s(cm: CostModel, context: int, shape: ModelShape | None = None) -> float:
    """Simulated decode rate of one step at ``context`` tokens already in KV, tok/s."""
    shape = shape or ModelShape()
    return 1e6 / cm.price_step(shape, "decode", 1, context).total_us


def decode_run_us(cm: CostModel, start_ctx: int, n_steps: int, shape: ModelShape | None = None) -> float:
    """Sum of simulated µs of ``n_steps`` decode steps, context growing from ``start_ctx``."""
    shape = shape or ModelShape()
    return sum(cm.price_step(shape, "decode", 1, start_ctx + i).total_us for i in range(n_steps))


def e2e_cost_model_us(cm: CostModel, shape: ModelShape | None = None) -> float:
    """Cost-model-only E2E of the F7 request, simulated µs.

    prefill(27) + 245 decode steps (the request's steps: 246 tokens, the
    first from the prefill) + ``host_overhead_ms_per_token`` x 246 tokens.
    """
    shape = shape or ModelShape()
    prefill_us = cm.price_step(shape, "prefill", PROMPT_TOKENS, 0).total_us
    decode_us = decode_run_us(cm, PROMPT_TOKENS, DECODE_TOKENS - 1, shape)
    return prefill_us + decode_us + cm.host_overhead_ms_per_token * 1e3 * DECODE_TOKENS


def _point(name: str, measured: float, simulated: float, unit: str) -> dict:
    err = (simulated - measured) / measured * 100.0
    return {"name": name, "measured": measured, "simulated": simulated, "unit": unit,
            "error_pct": err, "ok": abs(err) <= TOLERANCE_PCT}


def run_calibration(cost_model: CostModel | None = None) -> list[dict]:
    """Run every calibration case; one dict per case.

    Keys: ``name``, ``measured`` (FACTS F7 value, or None for band/trend cases),
    ``simulated``, ``unit`` ("tok/s" or "s"), ``error_pct`` (point cases) or
    ``band`` ([lo, hi]), ``ok``.  Trend cases carry ``simulated`` as a list of
    ``[length, tok/s]`` pairs.  All times are simulated.
    """
    cm = cost_model or CostModel.load()
    shape = ModelShape()
    out: list[dict] = []
    prefill_us = cm.price_step(shape, "prefill", PROMPT_TOKENS, 0).total_us
    out.append(_point("prefill_27_tok_s", PREFILL_27_TOK_S, PROMPT_TOKENS * 1e6 / prefill_us, "tok/s"))
    decode_us = decode_run_us(cm, PROMPT_TOKENS, DECODE_TOKENS, shape)
    out.append(_point("decode_246_tok_s", DECODE_246_TOK_S, DECODE_TOKENS * 1e6 / decode_us, "tok/s"))
    out.append(_point("e2e_27_prompt_246_decode", E2E_S, e2e_cost_model_us(cm, shape) / 1e6, "s"))
    for name, ctx, (lo, hi) in DECODE_BANDS:
        sim = decode_step_tok_s(cm, ctx, shape)
        out.append({"name": name, "measured": None, "simulated": sim, "unit": "tok/s",
                    "band": [lo, hi], "context": ctx, "ok": lo <= sim <= hi})
    pf = [[n, prefill_tok_s(cm, n, shape)] for n in PREFILL_TREND_LENGTHS]
    out.append({"name": "prefill_rises_with_prompt_length", "measured": None, "simulated": pf,
                "unit": "tok/s", "ok": all(b[1] > a[1] for a, b in pairwise(pf))})
    dc = [[c, decode_step_tok_s(cm, c, shape)] for c in DECODE_TREND_CONTEXTS]
    out.append({"name": "decode_falls_with_context", "measured": None, "simulated": dc,
                "unit": "tok/s", "ok": all(b[1] < a[1] for a, b in pairwise(dc))})
    return out


# ------------------------------------------------------------- engine level
#: 27 prompt tokens with the Qwen3 chat template (12 template tokens incl. the
#: empty <think></think> block + 15 content tokens); checked at run time.
ENGINE_PROMPT = "Explain in two sentences how an NPU serves a large language model."


def run_engine_cases(system=None, *, prompt: str = ENGINE_PROMPT, max_tokens: int = DECODE_TOKENS,
                     expect_prompt_tokens: int = PROMPT_TOKENS) -> list[dict]:
    """F7 request through the real serving engine, timing-only; three point cases.

    Builds ``build_system(numerics=False)`` (fast pacing, 1 slot) unless
    ``system`` is given, runs one request of ``expect_prompt_tokens`` prompt
    tokens (chat template included; ``ValueError`` if ``prompt`` tokenises to
    another length) and ``max_tokens`` tokens (timing-only never samples EOS),
    and compares its engine ``timings`` with F7:

    * ``engine_e2e_27_prompt_246_decode``: ``e2e_ms`` / 1e3 vs 4.41 s;
    * ``engine_prefill_27_tok_s``: ``prompt_per_second`` vs 184.27 tok/s;
    * ``engine_decode_246_tok_s``: ``predicted_per_second`` vs 58.25 tok/s.

    Times are SIMULATED device time plus the engine's MEASURED host work
    (no ``host_overhead_ms_per_token`` in this path).  Each case also carries
    ``prompt_n``, ``predicted_n``, ``host_ms`` (measured host total, ms),
    ``device_ms`` (simulated device total, ms), ``numerics`` (False) and
    ``wall_s`` (host seconds the run took).
    """
    import time

    from sim_backend.planes.system import build_system
    from sim_backend.serving.engine import ChatRequest

    own = system is None
    if own:
        system = build_system(numerics=False, maintenance=False, n_slots=1)
    try:
        req = ChatRequest.from_prompt(prompt, max_tokens=max_tokens)
        n_prompt = len(system.engine.tokenize_prompt(req))
        if n_prompt != expect_prompt_tokens:
            raise ValueError(f"calibration prompt is {n_prompt} tokens with the chat template, "
                             f"expected {expect_prompt_tokens}")
        t0 = time.perf_counter()
        res = system.engine.generate(req)
        wall_s = time.perf_counter() - t0
    finally:
        if own:
            system.close()
    if res.status != "finished":
        raise RuntimeError(f"engine calibration request ended {res.status}: {res.error}")
    t = res.timings
    extra = {"prompt_n": t.prompt_n, "predicted_n": t.predicted_n, "host_ms": sum(t.host_ms.values()),
             "device_ms": sum(t.device_ms.values()), "numerics": t.numerics, "wall_s": wall_s,
             "engine": True}
    return [
        {**_point("engine_e2e_27_prompt_246_decode", E2E_S, t.e2e_ms / 1e3, "s"), **extra},
        {**_point("engine_prefill_27_tok_s", PREFILL_27_TOK_S, t.prompt_per_second or 0.0, "tok/s"), **extra},
        {**_point("engine_decode_246_tok_s", DECODE_246_TOK_S, t.predicted_per_second or 0.0, "tok/s"), **extra},
    ]


def price_step_cost_us(cm: CostModel | None = None, n_calls: int = 200) -> dict[str, float]:
    """HOST wall µs per :meth:`CostModel.price_step` call (decode at growing context, 27-token
    prefill), graphs already built.  A benchmark figure, printed, never asserted."""
    import time

    cm = cm or CostModel.load()
    shape = ModelShape()
    out = {}
    for kind, n in (("decode", 1), ("prefill", PROMPT_TOKENS)):
        cm.price_step(shape, kind, n, 0)
        t0 = time.perf_counter()
        for i in range(n_calls):
            cm.price_step(shape, kind, n, i)
        out[kind] = (time.perf_counter() - t0) / n_calls * 1e6
    return out


# ----------------------------------------------------------------- offline fit
def _bisect(f: Callable[[float], float], lo: float, hi: float, iters: int = 40) -> float:
    """Root of an increasing ``f`` on [lo, hi] (clamped to the ends)."""
    flo, fhi = f(lo), f(hi)
    if flo >= 0:
        return lo
    if fhi <= 0:
        return hi
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if f(mid) < 0:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def fit_parameters(cost_model: CostModel | None = None, rounds: int = 4) -> dict[str, float]:
    """Offline fit of the YAML's ``fitted`` values (see module docstring). Takes seconds.

    Never called at import or by :func:`run_calibration`; run it by hand and
    copy the (rounded) values into ``hardware/calculet_npu.yaml``.
    """
    cm = cost_model or CostModel.load()
    shape = ModelShape()
    p = {k: float(cm.hw.fitted[k]) for k in
         ("weight_stream_eff", "fp16_compute_eff", "kv_read_eff", "attn_kv_ramp_us")}

    def model(**kw: float) -> CostModel:
        return cm.with_fitted(**{**p, **kw})

    for _ in range(rounds):
        p["weight_stream_eff"] = _bisect(
            lambda x: DECODE_TOKENS * 1e6 / decode_run_us(model(weight_stream_eff=x), PROMPT_TOKENS,
                                                          DECODE_TOKENS, shape) - DECODE_246_TOK_S,
            0.05, 1.0)
        p["fp16_compute_eff"] = _bisect(
            lambda x: prefill_tok_s(model(fp16_compute_eff=x), PROMPT_TOKENS, shape) - PREFILL_27_TOK_S,
            0.02, 1.0)
        p["kv_read_eff"] = _bisect(
            lambda x: math.log(decode_step_tok_s(model(kv_read_eff=x), 16384, shape) / 20.0)
            - math.log(13.5 / decode_step_tok_s(model(kv_read_eff=x), 33000, shape)),
            0.02, 1.0)
        p["attn_kv_ramp_us"] = _bisect(
            lambda x: 42.0 - decode_step_tok_s(model(attn_kv_ramp_us=x), 2048, shape), 0.0, 500.0)
    fitted = model(host_overhead_ms_per_token=0.0)
    device_us = e2e_cost_model_us(fitted, shape)
    p["host_overhead_ms_per_token"] = (E2E_S * 1e6 - device_us) / 1e3 / DECODE_TOKENS
    return p


def format_table(cases: list[dict]) -> str:
    """Plain-text table of :func:`run_calibration` results."""
    lines = []
    for c in cases:
        sim = c["simulated"]
        if isinstance(sim, list):
            s = ", ".join(f"{a}:{b:.1f}" for a, b in sim)
            lines.append(f"{c['name']:<34} {s} {c['unit']}  ok={c['ok']}")
        elif "band" in c:
            lines.append(f"{c['name']:<34} sim {sim:8.2f} {c['unit']:<5} band {c['band']}  ok={c['ok']}")
        else:
            lines.append(f"{c['name']:<34} sim {sim:8.3f} {c['unit']:<5} meas {c['measured']:8.3f}"
                         f"  err {c['error_pct']:+.2f}%  ok={c['ok']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m sim_backend.tools.calibration [--fit] [--json]``: print the calibration table.

    Returns the exit code: 0 when every case is within its tolerance or band, 1 when one
    is not; argparse exits with 2 (one usage line) on an unknown option, 0 on ``--help``.
    """
    import argparse
    import json

    ap = argparse.ArgumentParser(
        prog="python -m sim_backend.tools.calibration",
        description="Compare the simulated cost model (the shipped hardware YAML, full Qwen3-30B-A3B size) with "
                    f"the measured figures: {PROMPT_TOKENS}-token prefill {PREFILL_27_TOK_S:g} tok/s, "
                    f"{DECODE_TOKENS}-token decode {DECODE_246_TOK_S:g} tok/s, end to end {E2E_S:g} s (each "
                    f"within {TOLERANCE_PCT:g} %), decode rate bands by context, and "
                    "the trends. Cost model only, no engine: `calconsole bench calibrate` also runs the "
                    "engine cases. Exit code 0 when every case is ok, 1 when one is not.")
    ap.add_argument("--fit", action="store_true",
                    help="first re-fit the YAML's fitted parameters by bisection (takes seconds) and print "
                         "them; the table still uses the shipped values")
    ap.add_argument("--json", action="store_true", help="print the cases (and the fit) as JSON instead")
    args = ap.parse_args(argv)
    fit = fit_parameters() if args.fit else None
    cases = run_calibration()
    if args.json:
        print(json.dumps({"fit": fit, "cases": cases} if fit is not None else {"cases": cases}, indent=2))
    else:
        if fit is not None:
            print(fit)
        print(format_table(cases))
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":  # offline: python -m sim_backend.tools.calibration [--fit] [--json]
    raise SystemExit(main())
