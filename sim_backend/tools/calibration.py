"""Calibration of the simulated cost model against facts.md F7 (report §10).

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
llama.cpp's definition: 246 tokens over the 245 gaps).  Host time on the
simulated clock is the engine's ``HostBooking``: ``modeled`` (default) books
``host_overhead_ms_per_token`` per sampled token, so F7's host work is
counted once, as in the cost-model case, and the result does not depend on
this machine; ``measured`` books this machine's host work instead (in numeric
mode, Python sampling of 151,936 logits at 0.7-1 ms a token puts decode ~4 %
under F7 on a 2-core host). tests/tools/test_calibration.py checks both.
* ``decode_ctx_*``: one decode step at a context inside the historical
  bands (F7 CSV, mixed versions): ~2K 38–46, ~4K 28–40, ~8K 20–30,
  ~16K 20–30, ~33K "about 12" -> we use the band 10.5–13.5 (our choice),
  ~40K 10–16.  Contexts used: 2048, 4096, 8192, 16384, 33000, 40900.
* ``prefill_rises_with_prompt_length`` (16..2048 tokens: weights amortised
  over more tokens; beyond a few thousand tokens quadratic attention and
  activation traffic flatten it, as on real hardware) and
  ``decode_falls_with_context`` (27..40900).

How the YAML's fitted values were obtained: :func:`fit_parameters` (run
offline, never at import) is a bounded least-squares fit (scipy) of the free
parameters :data:`FIT_FREE` (continuous) and :data:`FIT_INTEGER` (searched over
integers) on the nine F7 cases :data:`FIT_CASES`, every parameter bounded by
its physical range in the YAML's ``ranges`` section.  Residuals are log errors:
a point case in units of 1 % (a single measurement), a band case in units of
half its log width around the band's geometric centre (``|r| <= 1`` is inside
the band); a weak prior (1 % of a point's weight) pulls each parameter towards
the middle of its range, so a parameter no remaining case informs stays there
instead of drifting.  Rounded results are written by hand into the YAML.

Validation (:func:`leave_one_out`): each of the nine cases is left out in turn,
the free parameters are refitted on the other eight, and the left-out case is
predicted: ``loo_simulated`` / ``loo_error_pct`` per case, and their RMS.  This
is the only out-of-sample test the report's data allows; the in-sample error of
a case with its own knob says nothing about predictive power.  Known limits,
printed with the results: the 27-token prefill is the only prefill point, so
held out it is predicted from the range middle of ``fp16_compute_eff`` (an
honest, large error); the E2E case likewise for the host allowance.

Decode bands and the mechanism that meets them: with a purely linear KV cost
the ~2K band needs >= 2.4 µs of decode time per context token and the ~16K band
allows <= 2.0 µs.  The cost model's split-KV flash decoding meets both: the
context is cut into blocks of ``attn_kv_block_rows`` (64 KiB of rows, the
report's data-moving block) spread over at most ``attn_max_splits``
partitions, each ending in a merge (``attn_split_merge_us``), so the merge cost
grows with the context up to ``attn_kv_block_rows * attn_max_splits`` tokens and
then stays flat; past that knee only the KV rows' bytes grow (at the weights'
DRAM efficiency times ``256 / (256 + kv_row_overhead_bytes)``).  The report
itself says the ~8K-16K rows mix software versions (§10), so a miss there is
expected, not bent away.  The fit puts ``attn_split_merge_us`` at the top of its
range (the bands want more concavity than the mechanism physically gives) and the
~16K case 0.5 % below its band (explained, :data:`EXPLAINED_BANDS`).

Held-out (leave-one-out) RMS, same procedure, both on this tree: the
previous model (KV ramp, ``kv_read_eff``) 17.1 % over the nine cases, 16.1 % over
the bands (4/6 held-out bands inside); this model 18.2 % / 15.7 % (4/6).  The
bands' own half-widths have an RMS of 18.0 %: neither model predicts a held-out
band better than "somewhere inside it"; the mechanism's gain is that every
parameter is physical and bounded, not a better fit.
"""

from __future__ import annotations

import math
from itertools import pairwise

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.costmodel import CostModel

TOLERANCE_PCT = 3.0

#: facts.md F7 point measurements.
PREFILL_27_TOK_S = 184.27
DECODE_246_TOK_S = 58.25
E2E_S = 4.41
PROMPT_TOKENS = 27
DECODE_TOKENS = 246

#: (name, context tokens, [lo, hi] tok/s) — facts.md F7 decode-by-context bands.
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
    """Sum of simulated µs of ``n_steps`` decode steps, context growing from ``start_ctx``.

    Exact and fast: within a run of contexts with the same split-KV partition count a
    decode step's time is linear in the context, so each run is priced at its ends
    (checked at its middle; a run that is not linear is summed step by step).
    """
    shape = shape or ModelShape()
    block = int(cm.hw.fitted["attn_kv_block_rows"])

    def us(past: int) -> float:
        return cm.price_step(shape, "decode", 1, past).total_us

    total, past, end = 0.0, start_ctx, start_ctx + n_steps
    while past < end:
        seg_end = min(end, (past // block + 1) * block)  # ctx = past + 1: same ceil(ctx / block) inside
        m = seg_end - past
        a = us(past)
        if m == 1:
            total += a
        else:
            b = us(seg_end - 1)
            mid = past + (m - 1) // 2
            lin = a + (b - a) * (mid - past) / (m - 1)
            if m > 2 and not math.isclose(us(mid), lin, rel_tol=1e-9):
                total += a + b + sum(us(c) for c in range(past + 1, seg_end - 1))
            else:
                total += m * (a + b) / 2.0
        past = seg_end
    return total


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


#: band cases a miss of which the report explains (§10: "~8K-16K mostly 20-30, mixed
#: versions, cannot be compared directly"), up to :data:`EXPLAINED_MISS_PCT` beyond the edge
EXPLAINED_BANDS: dict[str, str] = {
    name: "report §10: the ~8K-16K rows of the CSV mix software versions and cannot be compared directly"
    for name in ("decode_ctx_8k", "decode_ctx_16k")}
EXPLAINED_MISS_PCT = 5.0
#: why a band held out (leave-one-out) can land outside it; reported with the miss, never used to pass
LOO_EXPLAINED: dict[str, str] = {
    **{name: "report §10: the ~8K-16K rows of the CSV mix software versions; held out, this band is "
             "predicted from bands that may come from another version"
       for name in ("decode_ctx_8k", "decode_ctx_16k")},
    "decode_ctx_33k": "held out, predicted from ~16K and ~40K alone: the report gives 'about 12' with no "
                      "range (the band 10.5-13.5 is our choice), and it is the only point between ~16K and ~40K "
                      "that shapes the split-KV knee (attn_kv_block_rows x attn_max_splits)",
}
MODES = ("timing-only", "numeric")


def run_calibration(cost_model: CostModel | None = None, *, mode: str = "timing-only",
                    touched_27: list[float] | None = None, loo: dict | None = None) -> list[dict]:
    """Run every calibration case; one dict per case.

    Keys: ``name``, ``mode`` (``timing-only``: experts priced by the expectation;
    ``numeric``: the 27-token prefill priced with ``touched_27``, the router's per-layer
    experts as the device prices them), ``role`` (``fitted``: a case of
    :data:`FIT_CASES`; ``held-out``: never used by the fit), ``measured`` (facts.md F7
    value, or None for band/trend cases), ``simulated``, ``unit`` ("tok/s" or "s"),
    ``error_pct`` (vs the measurement, or vs a band's geometric centre), ``band``
    ([lo, hi]) and ``band_miss_pct`` for bands, ``ok``, and ``explained`` (why a band
    miss is expected, or None).  With ``loo`` (from :func:`leave_one_out`) each fitted
    case also has ``loo_simulated``, ``loo_error_pct`` (and ``loo_band_miss_pct``,
    ``loo_in_band``, and ``loo_explained``: why a held-out band miss is expected, or None).
    Trend cases carry ``simulated`` as ``[length, tok/s]`` pairs.
    All times are simulated.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if (mode == "numeric") != (touched_27 is not None):
        raise ValueError("numeric mode needs touched_27 (the router's experts per layer); timing-only takes none")
    cm = cost_model or CostModel.load()
    shape = ModelShape()
    sims = evaluate_cases(cm, touched_27, shape)
    out: list[dict] = []
    for name in FIT_CASES:
        sim = sims[name]
        err = case_error_pct(name, sim)
        c: dict = {"name": name, "mode": mode, "role": "fitted", "simulated": sim, "error_pct": err,
                   "explained": None}
        if name in POINT_CASES:
            c.update(measured=POINT_CASES[name], unit="s" if name.startswith("e2e") else "tok/s",
                     ok=abs(err) <= TOLERANCE_PCT)
        else:
            lo, hi = _BANDS[name]
            miss = band_miss_pct(name, sim)
            c.update(measured=None, unit="tok/s", band=[lo, hi], band_miss_pct=miss,
                     context=next(ctx for n, ctx, _ in DECODE_BANDS if n == name), ok=miss == 0.0)
            if miss != 0.0 and name in EXPLAINED_BANDS and abs(miss) <= EXPLAINED_MISS_PCT:
                c["explained"] = EXPLAINED_BANDS[name]
        if loo is not None and name in loo:
            r = loo[name]
            c.update(loo_simulated=r["loo_simulated"], loo_error_pct=r["loo_error_pct"])
            if "in_band" in r:
                c.update(loo_in_band=r["in_band"], loo_band_miss_pct=r["loo_band_miss_pct"],
                         loo_explained=None if r["in_band"] else LOO_EXPLAINED.get(name))
        out.append(c)
    touched_pf = None if touched_27 is None else touched_27  # only the 27-token point has the router's pattern
    pf = [[n, (n * 1e6 / cm.price_step(shape, "prefill", n, 0, experts_touched=touched_pf).total_us
               if n == PROMPT_TOKENS and touched_pf is not None else prefill_tok_s(cm, n, shape))]
          for n in PREFILL_TREND_LENGTHS]
    out.append({"name": "prefill_rises_with_prompt_length", "mode": mode, "role": "held-out", "measured": None,
                "simulated": pf, "unit": "tok/s", "ok": all(b[1] > a[1] for a, b in pairwise(pf)),
                "explained": None})
    dc = [[c, decode_step_tok_s(cm, c, shape)] for c in DECODE_TREND_CONTEXTS]
    out.append({"name": "decode_falls_with_context", "mode": mode, "role": "held-out", "measured": None,
                "simulated": dc, "unit": "tok/s", "ok": all(b[1] < a[1] for a, b in pairwise(dc)),
                "explained": None})
    return out


def case_passes(c: dict) -> bool:
    """A case is fine when it is ok, or when its miss is one the report explains."""
    return bool(c["ok"] or c.get("explained"))


def summarise(cases: list[dict]) -> dict[str, dict]:
    """Per mode: in-sample and held-out (leave-one-out) RMS error, % (see :func:`leave_one_out`).

    ``loo_rms_pct`` over all nine fitted cases, ``loo_rms_bands_pct`` / ``loo_rms_points_pct``
    over the decode bands / the three points (errors vs the band's geometric centre),
    ``loo_rms_band_miss_pct`` (distance outside the band, 0 inside), ``loo_bands_in_band``
    ("k/6"), ``in_sample_rms_pct``; the RMS keys are None when no leave-one-out was run.
    """
    out: dict[str, dict] = {}
    for mode in MODES:
        fitted = [c for c in cases if c.get("mode") == mode and c.get("role") == "fitted" and not c.get("engine")]
        if not fitted:
            continue
        has_loo = all("loo_error_pct" in c for c in fitted)
        bands = [c for c in fitted if "band" in c]
        pts = [c for c in fitted if "band" not in c]
        out[mode] = {
            "in_sample_rms_pct": rms([c["error_pct"] for c in fitted]),
            "loo_rms_pct": rms([c["loo_error_pct"] for c in fitted]) if has_loo else None,
            "loo_rms_bands_pct": rms([c["loo_error_pct"] for c in bands]) if has_loo else None,
            "loo_rms_points_pct": rms([c["loo_error_pct"] for c in pts]) if has_loo else None,
            "loo_rms_band_miss_pct": rms([c["loo_band_miss_pct"] for c in bands]) if has_loo else None,
            "loo_bands_in_band": f"{sum(bool(c['loo_in_band']) for c in bands)}/{len(bands)}" if has_loo else None,
        }
    return out


def router_touched_27(bundle=None) -> list[float]:
    """Experts per layer the numeric device PRICES the F7 27-token prefill with (numeric mode).

    Runs the engine's calibration prompt through the numerics (one token) and returns the
    prefill step's router counts brought to a trained router's mean
    (:func:`~sim_backend.model.costmodel.priced_experts_touched`): float64 list of n_layers.
    A couple of seconds of host time (the synthetic weights are drawn once).
    """
    from sim_backend.compose import build_system
    from sim_backend.model.costmodel import priced_experts_touched
    from sim_backend.model.trace import StepRecorder
    from sim_backend.planes.types import ChatRequest

    with build_system(numerics=True, maintenance=False, n_slots=1) as system:
        rec = StepRecorder()
        system.board.add_listener(rec)
        system.engine.generate(ChatRequest.from_prompt(ENGINE_PROMPT, max_tokens=1), timeout=120)
        (step,) = rec.wait_for(1)
    if step.kind != "prefill" or step.n_tokens != PROMPT_TOKENS or not step.experts_touched:
        raise RuntimeError(f"numeric calibration prefill was {step.kind} of {step.n_tokens} tokens")
    return [float(v) for v in priced_experts_touched(step.experts_touched, step.n_tokens)]


# ------------------------------------------------------------- engine level
#: 27 prompt tokens with the Qwen3 chat template (12 template tokens incl. the
#: empty <think></think> block + 15 content tokens); checked at run time.
ENGINE_PROMPT = "Explain in two sentences how an NPU serves a large language model."


def run_engine_cases(system=None, *, prompt: str = ENGINE_PROMPT, max_tokens: int = DECODE_TOKENS,
                     expect_prompt_tokens: int = PROMPT_TOKENS) -> list[dict]:
    """F7 request through the real serving engine; three point cases (role ``held-out``).

    The mode (``numeric`` / ``timing-only``) is the system's; builds
    ``build_system(numerics=False)`` (fast pacing, 1 slot) unless
    ``system`` is given, runs one request of ``expect_prompt_tokens`` prompt
    tokens (chat template included; ``ValueError`` if ``prompt`` tokenises to
    another length) and ``max_tokens`` tokens (timing-only never samples EOS),
    and compares its engine ``timings`` with F7:

    * ``engine_e2e_27_prompt_246_decode``: ``e2e_ms`` / 1e3 vs 4.41 s;
    * ``engine_prefill_27_tok_s``: ``prompt_per_second`` vs 184.27 tok/s;
    * ``engine_decode_246_tok_s``: ``predicted_per_second`` vs 58.25 tok/s.

    Times are SIMULATED: device time plus the host work the engine booked
    (``host_time``: ``modeled`` = the fitted allowance per token, ``measured`` =
    this machine's work; ``host_booked_ms``).  Each case also carries
    ``prompt_n``, ``predicted_n``, ``host_ms`` (measured host total, ms, booked or not),
    ``device_ms`` (simulated device total, ms), ``numerics``, ``mode``, ``role``,
    ``host_ms_per_token`` (measured here) beside ``fitted_host_ms_per_token`` (the YAML's
    allowance), and ``wall_s`` (host seconds the run took).  The engine cases depend on
    this machine's host speed: numeric mode samples 151,936 real logits per token.
    """
    import time

    from sim_backend.compose import build_system
    from sim_backend.planes.types import ChatRequest

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
             "engine": True, "mode": "numeric" if t.numerics else "timing-only", "role": "held-out",
             "host_time": t.host_time, "host_booked_ms": t.host_booked_ms,
             "explained": None,
             # measured host work per generated token on THIS machine (the real device's host
             # work is inside F7; the cost-model E2E case uses the fitted allowance instead)
             "host_ms_per_token": sum(t.host_ms.values()) / max(1, t.predicted_n),
             "fitted_host_ms_per_token": system.board.cost_model.host_overhead_ms_per_token}
    cases = [
        {**_point("engine_e2e_27_prompt_246_decode", E2E_S, t.e2e_ms / 1e3, "s"), **extra},
        {**_point("engine_prefill_27_tok_s", PREFILL_27_TOK_S, t.prompt_per_second or 0.0, "tok/s"), **extra},
        {**_point("engine_decode_246_tok_s", DECODE_246_TOK_S, t.predicted_per_second or 0.0, "tok/s"), **extra},
    ]
    if t.host_time == "measured":
        explain_measured_host_misses(cases, t.host_booked_ms - extra["fitted_host_ms_per_token"] * t.predicted_n,
                                     t.e2e_ms)
    return cases


def explain_measured_host_misses(cases: list[dict], extra_host_ms: float, e2e_ms: float) -> None:
    """With ``--host-time measured``: explain an engine case's miss that this machine's host work accounts for.

    ``extra_host_ms`` is the host work booked beyond the real host's fitted allowance (measured booked
    minus allowance x tokens, simulated ms), ``e2e_ms`` the request's end-to-end time.  A case that reads
    SLOWER than the measurement by at most ``TOLERANCE_PCT`` plus that extra's share of the request is
    explained (the miss is this host's speed, not the model: the modeled default is the calibration);
    a faster reading, or a miss larger than the extra work, stays a failure.  Sets ``explained`` in place.
    """
    share_pct = 100.0 * extra_host_ms / e2e_ms if e2e_ms > 0 else 0.0
    if share_pct <= 0:
        return
    for c in cases:
        err = c["error_pct"]
        # a rate (tok/s) reads slower as a lower value, a time (s) as a higher one
        slower = err > 0 if c["unit"] == "s" else err < 0
        if not c["ok"] and slower and abs(err) - TOLERANCE_PCT <= share_pct:
            c["explained"] = (f"--host-time measured: this machine booked {extra_host_ms:.1f} ms of host work "
                              f"beyond the real host's fitted allowance ({share_pct:.1f}% of the request), which "
                              "accounts for the miss; the modeled default is the calibration")


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


# ----------------------------------------------------------------- fit and validation
#: continuous parameters the fit moves (each within its YAML range)
FIT_FREE: tuple[str, ...] = ("weight_stream_eff", "fp16_compute_eff", "kv_row_overhead_bytes",
                             "attn_split_merge_us", "host_overhead_ms_per_token")
#: integer parameters the fit searches
FIT_INTEGER: tuple[str, ...] = ("attn_max_splits",)
#: the F7 cases the fit uses (role "fitted"); every other case is held out
FIT_CASES: tuple[str, ...] = ("prefill_27_tok_s", "decode_246_tok_s", "e2e_27_prompt_246_decode") + tuple(
    b[0] for b in DECODE_BANDS)
#: the three F7 point measurements by case name
POINT_CASES = {"prefill_27_tok_s": PREFILL_27_TOK_S, "decode_246_tok_s": DECODE_246_TOK_S,
           "e2e_27_prompt_246_decode": E2E_S}
_BANDS = {name: band for name, _, band in DECODE_BANDS}
_POINT_SIGMA = 0.01        # a point case's residual unit: 1 % (log)
_PRIOR_WEIGHT = 0.01       # prior towards the range middle, in point-residual units per full range


def band_centre(band: tuple[float, float] | list[float]) -> float:
    """Geometric centre of a band [lo, hi] (tok/s): what a band case's error is measured against."""
    return math.sqrt(band[0] * band[1])


def evaluate_cases(cm: CostModel, touched_27: list[float] | None = None,
                   shape: ModelShape | None = None) -> dict[str, float]:
    """Simulated value of every case in :data:`FIT_CASES` (tok/s, or s for the E2E case).

    ``touched_27``: per-layer experts to price the 27-token prefill with (numeric mode);
    None prices the expectation (timing-only mode).
    """
    shape = shape or ModelShape()
    pre = cm.price_step(shape, "prefill", PROMPT_TOKENS, 0, experts_touched=touched_27).total_us
    run = decode_run_us(cm, PROMPT_TOKENS, DECODE_TOKENS, shape)
    last = cm.price_step(shape, "decode", 1, PROMPT_TOKENS + DECODE_TOKENS - 1).total_us
    out = {"prefill_27_tok_s": PROMPT_TOKENS * 1e6 / pre,
           "decode_246_tok_s": DECODE_TOKENS * 1e6 / run,
           "e2e_27_prompt_246_decode": (pre + run - last + cm.host_overhead_ms_per_token * 1e3 * DECODE_TOKENS) / 1e6}
    for name, ctx, _ in DECODE_BANDS:
        out[name] = decode_step_tok_s(cm, ctx, shape)
    return out


def _residual(name: str, sim: float) -> float:
    if name in POINT_CASES:
        return math.log(sim / POINT_CASES[name]) / _POINT_SIGMA
    lo, hi = _BANDS[name]
    return math.log(sim / band_centre((lo, hi))) / (0.5 * math.log(hi / lo))


def band_miss_pct(name: str, sim: float) -> float:
    """How far a band case lies outside its band, % of the nearest edge (0.0 inside)."""
    lo, hi = _BANDS[name]
    return (sim - hi) / hi * 100.0 if sim > hi else (sim - lo) / lo * 100.0 if sim < lo else 0.0


def case_error_pct(name: str, sim: float) -> float:
    """Error of a fit case in %: vs the measurement (points) or the band's geometric centre (bands)."""
    ref = POINT_CASES[name] if name in POINT_CASES else band_centre(_BANDS[name])
    return (sim - ref) / ref * 100.0


def fit_parameters(cost_model: CostModel | None = None, *, exclude: tuple[str, ...] = (),
                   free: tuple[str, ...] = FIT_FREE, integer: tuple[str, ...] = FIT_INTEGER,
                   fixed: dict[str, float] | None = None, ranges: dict | None = None,
                   touched_27: list[float] | None = None, start: dict[str, float] | None = None) -> dict[str, float]:
    """Bounded least-squares fit of ``free`` (and integer search of ``integer``) on
    :data:`FIT_CASES` minus ``exclude`` (see module docstring).  Takes about a second.

    ``fixed``: other fitted-section values to hold (e.g. an assumed value moved to
    the end of its range for a sensitivity figure).  ``ranges``: bounds per parameter
    (default: the YAML's ``ranges``).  ``start``: a previous solution to start from (the
    integer is then searched by walking from its value instead of over a coarse grid
    first; :func:`leave_one_out` starts each refit from the full fit).  Returns the fitted
    values of ``free`` and ``integer``.  Never called at import or by :func:`run_calibration`.
    """
    import numpy as np
    from scipy.optimize import least_squares

    cm = cost_model or CostModel.load()
    if fixed:
        cm = cm.with_fitted(**fixed)
    rng = dict(ranges if ranges is not None else cm.hw.ranges)
    use = [c for c in FIT_CASES if c not in exclude]
    lo = np.array([rng[k][0] for k in free], dtype=float)
    span = np.array([rng[k][1] - rng[k][0] for k in free], dtype=float)

    def params(x, ints: dict[str, float]) -> dict[str, float]:
        return {**{k: float(v) for k, v in zip(free, lo + x * span, strict=True)}, **ints}

    def fit_cont(ints: dict[str, float]) -> tuple[float, dict[str, float]]:
        def res(x):
            sims = evaluate_cases(cm.with_fitted(**params(x, ints)), touched_27)
            r = [_residual(c, sims[c]) for c in use]
            return np.array(r + list(_PRIOR_WEIGHT * 2.0 * (x - 0.5)))
        x0 = np.full(len(free), 0.5) if start is None else np.clip(
            (np.array([start[k] for k in free]) - lo) / span, 0.0, 1.0)
        sol = least_squares(res, x0, bounds=(0.0, 1.0), diff_step=1e-4, xtol=1e-8, ftol=1e-10)
        return float(sol.cost), params(sol.x, ints)

    if not integer:
        return fit_cont({})[1]
    (key,) = integer  # one integer parameter: coarse grid, then walk to the best neighbour
    ilo, ihi = int(rng[key][0]), int(rng[key][1])
    seen: dict[int, tuple[float, dict[str, float]]] = {}

    def at(v: int) -> float:
        if v not in seen:
            seen[v] = fit_cont({key: float(v)})
        return seen[v][0]

    if start is not None and key in start:
        best = int(start[key])
    else:
        grid = sorted({ilo, ihi, *[v for v in (1, 2, 4, 8, 16, 32, 64, 128) if ilo <= v <= ihi]})
        best = min(grid, key=at)
    while True:
        nb = [v for v in (best - 1, best + 1) if ilo <= v <= ihi]
        cand = min(nb, key=at) if nb else best
        if at(cand) < at(best):
            best = cand
        else:
            break
    return {**seen[best][1], key: float(best)}


def leave_one_out(cost_model: CostModel | None = None, *, touched_27: list[float] | None = None,
                  **fit_kw) -> dict[str, dict[str, float]]:
    """For each case of :data:`FIT_CASES`: refit without it, predict it.

    Returns ``{case: {"loo_simulated", "loo_error_pct", "in_band" (bands only)}, ...}``
    and, under ``"_params"``, the refitted values per left-out case.  Prices the
    27-token prefill with ``touched_27`` when given (numeric mode), in the fits too.
    Each refit starts from the fit on all nine cases, for speed; the residuals exclude the
    left-out case, so where the bounded, prior-regularised problem has one optimum the start
    does not matter (refits from the range middle gave the same held-out errors within
    0.2 %).  The integer is walked from the full fit's value.  ~7 s of CPU.
    """
    cm = cost_model or CostModel.load()
    out: dict[str, dict] = {"_params": {}}
    full = fit_parameters(cm, touched_27=touched_27, **fit_kw)
    for case in FIT_CASES:
        p = fit_parameters(cm, exclude=(case,), touched_27=touched_27, start=full, **fit_kw)
        sim = evaluate_cases(cm.with_fitted(**p, **(fit_kw.get("fixed") or {})), touched_27)[case]
        row: dict = {"loo_simulated": sim, "loo_error_pct": case_error_pct(case, sim)}
        if case in _BANDS:
            lo, hi = _BANDS[case]
            row["in_band"] = lo <= sim <= hi
            row["loo_band_miss_pct"] = band_miss_pct(case, sim)
        out[case] = row
        out["_params"][case] = p
    return out


def rms(values: list[float]) -> float:
    """Root mean square (0.0 for an empty list)."""
    return math.sqrt(sum(v * v for v in values) / len(values)) if values else 0.0


def format_table(cases: list[dict]) -> str:
    """Plain-text table of :func:`run_calibration` results."""
    lines = []
    for c in cases:
        sim = c["simulated"]
        if isinstance(sim, list):
            s = ", ".join(f"{a}:{b:.1f}" for a, b in sim)
            lines.append(f"{c['name']:<34} {s} {c['unit']}  ok={c['ok']}")
        elif "band" in c:
            loo = f"  held-out {c['loo_simulated']:.2f}" if "loo_simulated" in c else ""
            why = f"  explained: {c['explained']}" if c.get("explained") else ""
            lines.append(f"{c['name']:<34} sim {sim:8.2f} {c['unit']:<5} band {c['band']}{loo}  ok={c['ok']}{why}")
        else:
            loo = f"  held-out err {c['loo_error_pct']:+.2f}%" if "loo_error_pct" in c else ""
            lines.append(f"{c['name']:<34} sim {sim:8.3f} {c['unit']:<5} meas {c['measured']:8.3f}"
                         f"  err {c['error_pct']:+.2f}%{loo}  ok={c['ok']}")
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
    ap.add_argument("--loo", action="store_true",
                    help="also run the leave-one-out validation (refits 9 times, ~15 s) and print its RMS")
    args = ap.parse_args(argv)
    fit = fit_parameters() if args.fit else None
    loo = leave_one_out() if args.loo else None
    cases = run_calibration(loo=loo) if loo is not None else run_calibration()
    if args.json:
        doc: dict = {"cases": cases, "summary": summarise(cases)}
        if fit is not None:
            doc["fit"] = fit
        print(json.dumps(doc, indent=2))
    else:
        if fit is not None:
            print(fit)
        print(format_table(cases))
    return 0 if all(case_passes(c) for c in cases) else 1


if __name__ == "__main__":  # offline: python -m sim_backend.tools.calibration [--fit] [--json]
    raise SystemExit(main())
