"""The fit of the cost model's free parameters to the fitted calibration cases: bounded least squares
(scipy) of :data:`FIT_FREE` inside their physical ranges (:func:`fit_parameters`), its convergence
from spread starts (:func:`convergence`) and the reach of the KV mechanism over core counts
(:func:`mechanism_reach`).

Residuals and roles: :mod:`sim_backend.tools.calibration`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sim_backend.model.costmodel import CostModel
from sim_backend.tools.calibration_cases import (
    BAND_RANGES,
    FIT_CASES,
    POINT_CASES,
    band_centre,
    evaluate_cases,
    run_calibration,
    summarise,
)

if TYPE_CHECKING:
    import numpy as np

# ----------------------------------------------------------------- fit and convergence
#: continuous parameters the fit moves (each within its YAML range)
FIT_FREE: tuple[str, ...] = ("weight_stream_eff", "fp16_compute_eff", "host_overhead_ms_per_token",
                             "attn_vector_tflops")


_POINT_SIGMA = 0.01        # a point case's residual unit: 1 % (log)


_PRIOR_WEIGHT = 0.01       # prior towards the range middle, in point-residual units per full range


#: starts of the convergence check (spread over the ranges: a Halton sequence, fixed seed)
CONVERGENCE_STARTS = 6


CONVERGENCE_PCT = 5.0


#: a fitted parameter whose range's hi / lo is at least this is searched on a log scale
LOG_SCALE_RATIO = 8.0


#: points of the coarse scan each log-scaled parameter gets before the least-squares refinement
GRID_POINTS = 7


def _residual(name: str, sim: float) -> float:
    if name in POINT_CASES:
        return math.log(sim / POINT_CASES[name]) / _POINT_SIGMA
    lo, hi = BAND_RANGES[name]
    return math.log(sim / band_centre((lo, hi))) / (0.5 * math.log(hi / lo))


def fit_parameters(cost_model: CostModel | None = None, *, free: tuple[str, ...] = FIT_FREE,
                   fixed: dict[str, float] | None = None, ranges: dict[str, Any] | None = None,
                   touched_27: list[float] | None = None, start: dict[str, float] | None = None,
                   cases: tuple[str, ...] = FIT_CASES, full: bool = False, globalise: bool = True) -> dict[str, Any]:
    """Bounded least-squares fit of ``free`` on ``cases`` (default :data:`FIT_CASES`: the fitted
    role only; module docstring).  A second or two of host time.

    ``fixed``: fitted-section values to hold (an assumed value moved for a sensitivity run).
    ``ranges``: bounds per parameter (default: the YAML's ``ranges``).  ``start``: where to start
    (default: the middle of every range).  ``globalise``: first profile each log-scaled parameter
    over a coarse grid (robust from any start; ~10x slower; off for refits that start from a
    solution).  Returns the fitted values of ``free``; with
    ``full=True`` a dict ``{"params", "cost", "at_edge": [names within 0.5 % of a range end],
    "residuals": {case: r}}``.  Never called at import or by :func:`run_calibration`.
    """
    import numpy as np
    from scipy.optimize import least_squares

    cm = cost_model or CostModel.load()
    if fixed:
        cm = cm.with_fitted(**fixed)
    rng = dict(ranges if ranges is not None else cm.hw.ranges)
    # a parameter whose range spans a decade or more is searched on a log scale (its effect is
    # multiplicative: a throughput), the others linearly; x in [0, 1] either way
    logs = [rng[k][0] > 0 and rng[k][1] / rng[k][0] >= LOG_SCALE_RATIO for k in free]

    def value(k: str, x: float, is_log: bool) -> float:
        lo_, hi_ = rng[k]
        return float(lo_ * (hi_ / lo_) ** x) if is_log else float(lo_ + x * (hi_ - lo_))

    def unit(k: str, v: float, is_log: bool) -> float:
        lo_, hi_ = rng[k]
        u = math.log(v / lo_) / math.log(hi_ / lo_) if is_log else (v - lo_) / (hi_ - lo_)
        return min(1.0, max(0.0, u))

    def params(x: np.ndarray) -> dict[str, float]:
        return {k: value(k, float(v), g) for k, v, g in zip(free, x, logs, strict=True)}

    def res(x: np.ndarray) -> np.ndarray:
        sims = evaluate_cases(cm.with_fitted(**params(x)), touched_27, names=cases)
        r = [_residual(c, sims[c]) for c in cases]
        return np.array(r + list(_PRIOR_WEIGHT * 2.0 * (x - 0.5)))

    x0 = np.full(len(free), 0.5) if start is None else np.array(
        [unit(k, start[k], g) for k, g in zip(free, logs, strict=True)])
    # globalise the log-scaled parameters first: a throughput can start where its term is hidden
    # behind another one of a max() (flash decoding's DMA vs vector work), with zero gradient there.
    # Profile it: on a coarse grid of its values, fit the others from the start; keep the best.
    for i in (i for i, g in enumerate(logs) if g and globalise):
        others = [j for j in range(len(free)) if j != i]
        best: tuple[float, np.ndarray] | None = None
        for gx in np.linspace(0.0, 1.0, GRID_POINTS):
            def res_i(y: np.ndarray, gx: float = gx, base: np.ndarray = x0, i: int = i,
                      others: list[int] = others) -> np.ndarray:
                x = base.copy()
                x[others] = y
                x[i] = gx
                return res(x)
            sub = least_squares(res_i, x0[others], bounds=(0.0, 1.0), diff_step=1e-4, max_nfev=60)
            if best is None or sub.cost < best[0]:
                xb = x0.copy()
                xb[others] = sub.x
                xb[i] = gx
                best = (float(sub.cost), xb)
        assert best is not None
        x0 = best[1]
    sol = least_squares(res, x0, bounds=(0.0, 1.0), diff_step=1e-4, xtol=1e-10, ftol=1e-12, gtol=1e-10)
    p = params(sol.x)
    if not full:
        return p
    sims = evaluate_cases(cm.with_fitted(**p), touched_27, names=cases)
    return {"params": p, "cost": float(sol.cost),
            "at_edge": [k for k, x in zip(free, sol.x, strict=True) if x < 0.005 or x > 0.995],
            "residuals": {c: _residual(c, sims[c]) for c in cases}}


#: attn_cores values :func:`mechanism_reach` refits at by default (partitions per KV head: cores // 2)
REACH_CORES: tuple[int, ...] = (4, 6, 8, 12, 16, 24, 32)


def mechanism_reach(cost_model: CostModel | None = None, cores: tuple[int, ...] = REACH_CORES) -> list[dict[str, Any]]:
    """How close the stated mechanisms get to the bands as the ASSUMED ``attn_cores`` moves (its range).

    ``attn_cores // kv_heads_per_chip`` is the most partitions split-KV uses; a block-granular split
    ramps up to it (one block per partition, facts.md F3's 32 KiB KV blocks), so it sets how convex
    the decode time is over the first ``partitions x block`` positions.  For each value the fitted
    parameters are refitted (from the shipped ones) on the FITTED cases only.  Returns one row per
    value: ``{"attn_cores", "partitions", "cost"`` (the fit's), ``"at_edge", "params",
    "f7_worst_pct", "band_miss_pct": {band: %}, "tok_s_16k", "held_out_rms_pct"}``.  A diagnostic,
    printed by ``--reach``; about a second of host time per value.
    """
    from sim_backend.bundle.shapes import ModelShape as _Shape

    cm = cost_model or CostModel.load()
    start = {k: float(cm.hw.fitted[k]) for k in FIT_FREE}
    heads = max(1, _Shape().kv_heads_per_chip)
    out = []
    for n in cores:
        m0 = cm.with_fitted(attn_cores=int(n))
        r = fit_parameters(m0, full=True, start=start, globalise=False)
        cases = {c["name"]: c for c in run_calibration(m0.with_fitted(**r["params"]))}
        out.append({"attn_cores": int(n), "partitions": max(1, int(n) // heads), "cost": r["cost"],
                    "at_edge": r["at_edge"], "params": r["params"],
                    "f7_worst_pct": max(abs(cases[c]["error_pct"]) for c in POINT_CASES),
                    "band_miss_pct": {c: cases[c]["band_miss_pct"] for c in BAND_RANGES},
                    "tok_s_16k": cases["decode_ctx_8k_16k"]["simulated_ends"][-1],
                    "held_out_rms_pct": summarise(list(cases.values()))["timing-only"]["held_out_decode_rms_pct"]})
    return out


def convergence(cost_model: CostModel | None = None, *, starts: int = CONVERGENCE_STARTS,
                touched_27: list[float] | None = None, **fit_kw: Any) -> dict[str, Any]:
    """Run :func:`fit_parameters` from ``starts`` spread starting points (a scrambled Halton sequence
    over the ranges, seed 0) and compare the solutions.

    Returns ``{"starts": [{"start", "params", "cost", "at_edge"}], "median": {param: value},
    "spread_pct": {param: max |value - median| / median, %}, "converged": bool (every parameter of
    every start within :data:`CONVERGENCE_PCT` of the median), "at_edge": [parameters at a range end
    in any start]}``.  ``starts`` must be >= 1 (ValueError).
    """
    import numpy as np
    from scipy.stats import qmc

    if starts < 1:
        raise ValueError(f"starts must be >= 1, got {starts}")
    cm = cost_model or CostModel.load()
    free = fit_kw.get("free", FIT_FREE)
    rng = dict(fit_kw.get("ranges") or cm.hw.ranges)
    pts = qmc.Halton(d=len(free), scramble=True, seed=0).random(starts)
    runs = []
    for u in pts:
        st = {k: rng[k][0] + float(v) * (rng[k][1] - rng[k][0]) for k, v in zip(free, u, strict=True)}
        r = fit_parameters(cm, start=st, touched_27=touched_27, full=True, **fit_kw)
        runs.append({"start": st, "params": r["params"], "cost": r["cost"], "at_edge": r["at_edge"]})
    med = {k: float(np.median([r["params"][k] for r in runs])) for k in free}
    spread = {k: max(abs(r["params"][k] - med[k]) for r in runs) / abs(med[k]) * 100.0 if med[k] else 0.0
              for k in free}
    return {"starts": runs, "median": med, "spread_pct": spread,
            "converged": all(v <= CONVERGENCE_PCT for v in spread.values()),
            "at_edge": sorted({k for r in runs for k in r["at_edge"]})}
