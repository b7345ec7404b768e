"""Calibration of the simulated cost model against facts.md F7 (report §10), with an honest hold-out.

Every case has a ROLE:

* ``fitted``: used by :func:`fit_parameters` (and only these): the three F7 points
  (``prefill_27_tok_s`` 184.27 tok/s, ``decode_246_tok_s`` 58.25 tok/s over 246 steps at
  contexts 27..272, ``e2e_27_prompt_246_decode`` 4.41 s = prefill(27) + 245 decode steps +
  the fitted host allowance x 246 tokens; each within ±3 %) and three decode bands
  (~2K 38–46, ~4K 28–40, ~40K 10–16 tok/s, one decode step at contexts 2048, 4096, 40900).
* ``held-out``: never seen by the fit, predicted once: the one ~8K–16K band (20–30 tok/s,
  "mostly", mixed software versions; checked at BOTH ends, 8192 and 16384, its error is that of
  the geometric-middle context 11585 against the band's centre), ~33K "about 12" (error against
  12; ``ok`` inside 10.5–13.5, a band of our choice), the short-context row 58–64 (one step at
  context 128; it is the F7 decode point's neighbour, so only weakly independent of it), the
  two trends, and the data-moving table of the 40,960-token prefill (facts.md F3,
  :func:`data_moving_case`).
* ``consistency``: the engine rows (:func:`run_engine_cases`): the FITTED F7 points run through
  the serving engine; they check the engine prices as the cost model does, they predict nothing.

The fit (:func:`fit_parameters`) is bounded least squares (scipy) of :data:`FIT_FREE`, each
inside its physical range (the YAML's ``ranges``).  Residuals are log errors: a point case in
units of 1 % (one measurement), a band case in units of half its log width around its
geometric centre (``|r| <= 1`` is inside the band); a weak prior (1 % of a point's weight)
towards the middle of each range keeps the problem regular.  :func:`convergence` runs it from
:data:`CONVERGENCE_STARTS` spread starts and reports whether every start reaches the same
parameters within ±5 %.  Rounded results are written by hand into the YAML.

What the report's bands can support (:func:`linear_bound`, data only): no decode step time linear in
the context through the F7 decode run meets the fitted ~2K, ~4K and ~40K bands together; the best line
(2.10 µs per context token) misses ~2K by +2.75 % and ~40K by -2.75 % and predicts 19.50 tok/s at 16K.
Meeting them needs the step to grow by 0.75 ms more between the F7 run and ~2K than a line allows (a
concave knee) -- or the long-context rows to be that much slower than the F7 version (the report: mixed
versions).  Every term of the stated mechanisms is a max or a sum of terms non-decreasing and linear in
the context (the tree merge's at most ceil(log2 partitions) levels is the only concave part, and it is
mostly on already over the F7 run), so those misses are their documented limit
(:data:`DOCUMENTED_BAND_MISSES`): a band miss within it and at the edge the best line leans to is
``explained`` (:func:`explain_band_miss`), anything else fails (:func:`protocol_checks`).

KV parameters are physical (``attention_cost.flash_decode``): per 64..16 KiB block max(DMA, vector
work), DMA latency unless double-buffered, partitions merged in a tree.  Two of them are fitted
(``attn_vector_tflops``: the slope of decode time in the context; ``attn_merge_level_us``: the
step that split-KV adds once a head has more than one block), on ~2K, ~4K and ~40K only.

Where the parts live: the cases, their predictions and errors and the bands' bound in
:mod:`sim_backend.tools.calibration_cases`, the fit and its convergence in
:mod:`sim_backend.tools.calibration_fit`; this module runs the engine cases, checks the protocol and
prints the report (``python -m sim_backend.tools.calibration``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.costmodel import CostModel as CostModel  # re-exported: the console's benches load it here
from sim_backend.tools.calibration_cases import (
    DECODE_246_TOK_S,
    DECODE_TOKENS,
    E2E_S,
    PREFILL_27_TOK_S,
    PROMPT_TOKENS,
    TOLERANCE_PCT,
    case_passes,
    linear_bound,
    point_case,
    run_calibration,
    summarise,
)
from sim_backend.tools.calibration_fit import (
    CONVERGENCE_PCT,
    CONVERGENCE_STARTS,
    convergence,
    fit_parameters,
    mechanism_reach,
)

if TYPE_CHECKING:
    from sim_backend.compose import System


def router_touched_27(bundle: object = None) -> list[float]:
    """Experts per layer the numeric device PRICES the F7 27-token prefill with (numeric mode).

    Runs the engine's calibration prompt through the numerics (one token) and returns the
    prefill step's router counts brought to a trained router's mean
    (:func:`~sim_backend.model.families.moe_cost.priced_experts_touched`): float64 list of n_layers.
    A couple of seconds of host time (the synthetic weights are drawn once).
    """
    from sim_backend.compose import build_system
    from sim_backend.model.families.moe_cost import priced_experts_touched
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


def run_engine_cases(system: System | None = None, *, prompt: str = ENGINE_PROMPT, max_tokens: int = DECODE_TOKENS,
                     expect_prompt_tokens: int = PROMPT_TOKENS) -> list[dict[str, Any]]:
    """F7 request through the real serving engine; three point cases (role ``consistency``: the
    FITTED F7 points through the engine, so they check that the engine prices as the cost model
    does, and predict nothing).

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
    if system is None:
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
             "engine": True, "mode": "numeric" if t.numerics else "timing-only", "role": "consistency",
             "host_time": t.host_time, "host_booked_ms": t.host_booked_ms,
             "explained": None,
             # measured host work per generated token on THIS machine (the real device's host
             # work is inside F7; the cost-model E2E case uses the fitted allowance instead)
             "host_ms_per_token": sum(t.host_ms.values()) / max(1, t.predicted_n),
             "fitted_host_ms_per_token": system.board.cost_model.host_overhead_ms_per_token}
    cases = [
        {**point_case("engine_e2e_27_prompt_246_decode", E2E_S, t.e2e_ms / 1e3, "s"), **extra},
        {**point_case("engine_prefill_27_tok_s", PREFILL_27_TOK_S, t.prompt_per_second or 0.0, "tok/s"), **extra},
        {**point_case("engine_decode_246_tok_s", DECODE_246_TOK_S, t.predicted_per_second or 0.0, "tok/s"), **extra},
    ]
    if t.host_time == "measured":
        explain_measured_host_misses(cases, t.host_booked_ms - extra["fitted_host_ms_per_token"] * t.predicted_n,
                                     t.e2e_ms)
    return cases


def explain_measured_host_misses(cases: list[dict[str, Any]], extra_host_ms: float, e2e_ms: float) -> None:
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


#: the protocol's acceptance criteria: held-out decode RMS (%), starts for a convergence check to count
HELD_OUT_RMS_MAX_PCT = 8.0
CONVERGENCE_MIN_STARTS = 5


def protocol_checks(cases: list[dict[str, Any]], conv: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The checks that must hold for the calibration to pass (exit code 0): ``[{"what", "ok", "detail"}]``.

    * every case ok, or its miss explained (:func:`case_passes`: a band at the mechanisms' documented
      limit, :func:`explain_band_miss`; an engine row this host's measured work accounts for);
    * per mode, the held-out decode RMS <= :data:`HELD_OUT_RMS_MAX_PCT`;
    * per mode whose convergence ran (``conv``: :func:`convergence` by mode): every start within
      :data:`CONVERGENCE_PCT` of the median and no fitted parameter at a range end in any start (the
      detail says whether it ran from the :data:`CONVERGENCE_MIN_STARTS` starts the criterion asks for).
    """
    out = []
    bad = [f"{c['name']} ({c.get('mode')})" for c in cases if not case_passes(c)]
    out.append({"what": "every case ok or an explained miss", "ok": not bad,
                "detail": "failing: " + ", ".join(bad) if bad else f"{len(cases)} cases"})
    for mode, sm in summarise(cases).items():
        v = sm["held_out_decode_rms_pct"]
        out.append({"what": f"{mode}: held-out decode RMS <= {HELD_OUT_RMS_MAX_PCT:g}%",
                    "ok": v <= HELD_OUT_RMS_MAX_PCT, "detail": f"{v:.2f}%"})
    for mode, cv in (conv or {}).items():
        n = len(cv["starts"])
        edge = f", at an edge: {', '.join(cv['at_edge'])}" if cv["at_edge"] else ""
        spread = max(cv["spread_pct"].values(), default=0.0)
        out.append({"what": f"{mode}: fit converges within {CONVERGENCE_PCT:g}%, no parameter at a range edge",
                    "ok": bool(cv["converged"]) and not cv["at_edge"],
                    "detail": f"{n} starts (the criterion asks >= {CONVERGENCE_MIN_STARTS}"
                              f"{'' if n >= CONVERGENCE_MIN_STARTS else ': too few to count'}), widest spread "
                              f"{spread:.2g}%{edge}"})
    return out


def format_table(cases: list[dict[str, Any]]) -> str:
    """Plain-text table of :func:`run_calibration` results (role, simulated, reference, error)."""
    lines = []
    for c in cases:
        sim = c["simulated"]
        head = f"{c['name']:<34} {c['role']:<11}"
        if c["name"] == "prefill_40960_data_moving":
            sims = ", ".join(f"chip{i} {d['entries']:,} entries {d['gib']:.3f} GiB" for i, d in enumerate(sim))
            meas = ", ".join(f"{d['entries']:,} / {d['gib']:.3f}" for d in c["measured"])
            lines.append(f"{head} {sims}  (F3: {meas})  err {c['error_pct']:+.2f}%  ok={c['ok']}")
        elif isinstance(sim, list):
            s = ", ".join(f"{a}:{b:.1f}" for a, b in sim)
            lines.append(f"{head} {s} {c['unit']}  ok={c['ok']}")
        elif "band" in c:
            ends = " / ".join(f"{v:.2f}" for v in c["simulated_ends"])
            lines.append(f"{head} sim {sim:8.2f} {c['unit']:<5} band {c['band']} at {c['contexts']}: {ends}"
                         f"  err {c['error_pct']:+.2f}%  ok={c['ok']}"
                         + (f" (miss {c['band_miss_pct']:+.1f}%: explained, the mechanisms' documented limit)"
                            if c.get("explained") else ""))
        else:
            lines.append(f"{head} sim {sim:8.3f} {c['unit']:<5} meas {c['measured']:8.3f}"
                         f"  err {c['error_pct']:+.2f}%  ok={c['ok']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m sim_backend.tools.calibration [--fit] [--convergence] [--reach] [--json]``: the calibration table.

    Returns the exit code: 0 when every :func:`protocol_checks` check holds (every case ok or an
    explained miss, held-out RMS, convergence when asked), 1 when one does not; argparse exits with 2
    (one usage line) on an unknown option, 0 on ``--help``.
    """
    import argparse
    import json

    ap = argparse.ArgumentParser(
        prog="python -m sim_backend.tools.calibration",
        description="Compare the simulated cost model (the shipped hardware YAML, full Qwen3-30B-A3B size) with "
                    f"the measured figures: {PROMPT_TOKENS}-token prefill {PREFILL_27_TOK_S:g} tok/s, "
                    f"{DECODE_TOKENS}-token decode {DECODE_246_TOK_S:g} tok/s, end to end {E2E_S:g} s (each "
                    f"within {TOLERANCE_PCT:g} %), decode rate bands by context (fitted: ~2K, ~4K, ~40K; "
                    "held out: short, ~8K-16K, ~33K), the trends and the 40,960-token prefill's data-moving "
                    "table. Cost model only, no engine: `calconsole bench calibrate` also runs the "
                    "engine consistency rows. Exit code 0 when every case is ok or its miss is the mechanisms' "
                    "documented limit (explained), the held-out RMS is within 8 %% and (--convergence) the fit "
                    "converges; 1 when a check fails.")
    ap.add_argument("--fit", action="store_true",
                    help="first re-fit the YAML's fitted parameters on the fitted cases (seconds) and print "
                         "them; the table still uses the shipped values")
    ap.add_argument("--convergence", action="store_true",
                    help=f"also fit from {CONVERGENCE_STARTS} spread starts and print whether they agree "
                         f"within {CONVERGENCE_PCT:g} %% (about a minute)")
    ap.add_argument("--reach", action="store_true",
                    help="also refit at several assumed attn_cores (split-KV partitions) and print how close each "
                         "gets to the bands (about 10 s)")
    ap.add_argument("--json", action="store_true", help="print the cases (and the fit) as JSON instead")
    args = ap.parse_args(argv)
    fit = fit_parameters(full=True) if args.fit else None
    conv = convergence() if args.convergence else None
    reach = mechanism_reach() if args.reach else None
    cases = run_calibration()
    checks = protocol_checks(cases, {"timing-only": conv} if conv is not None else None)
    bound = linear_bound()
    if args.json:
        doc: dict[str, Any] = {"cases": cases, "summary": summarise(cases), "linear_bound": bound, "checks": checks}
        if fit is not None:
            doc["fit"] = fit
        if conv is not None:
            doc["convergence"] = conv
        if reach is not None:
            doc["reach"] = reach
        print(json.dumps(doc, indent=2))
    else:
        if fit is not None:
            print(fit)
        if conv is not None:
            print({k: conv[k] for k in ("median", "spread_pct", "converged", "at_edge")})
        print(format_table(cases))
        print(format_bound(bound))
        for row in reach or ():
            misses = ", ".join(f"{k.removeprefix('decode_ctx_')} {v:+.2f}%" for k, v in row["band_miss_pct"].items())
            print(f"attn_cores {row['attn_cores']:>2} ({row['partitions']:>2} partitions per head): fit cost "
                  f"{row['cost']:.3f}, F7 worst {row['f7_worst_pct']:.2f}%, band misses {misses}; 16K "
                  f"{row['tok_s_16k']:.2f} tok/s; held-out RMS {row['held_out_rms_pct']:.2f}%"
                  + (f"; at an edge: {', '.join(row['at_edge'])}" if row["at_edge"] else ""))
        for chk in checks:
            print(f"{'ok  ' if chk['ok'] else 'FAIL'} {chk['what']}: {chk['detail']}")
    return 0 if all(chk["ok"] for chk in checks) else 1


def format_bound(bound: dict[str, Any]) -> str:
    """One paragraph on :func:`linear_bound` (what the report's bands need)."""
    pred = ", ".join(f"{n} {v:+.2f}%" for n, v in bound["miss_pct"].items() if v)
    return (f"data-only bound (facts.md F7, no cost model): the best decode step time linear in the context through "
            f"the F7 run ({bound['t0_ms']:.2f} ms at context {bound['c0']:g}; {bound['slope_us_per_token']:.3f} us "
            f"per context token, chosen on the {'/'.join(bound['bands'])} bands) misses {pred or 'no band'}; "
            + ("a line meets every fitted band" if bound["reachable"] else
               f"meeting every fitted band needs {bound['knee_ms']:.2f} ms more per step from ~2K on than over the "
               f"F7 run (a concave knee, or long-context rows that much slower: mixed versions)"))


if __name__ == "__main__":  # offline: python -m sim_backend.tools.calibration [--fit] [--json]
    raise SystemExit(main())
