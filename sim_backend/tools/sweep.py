"""Prompt-length / context sweep with JOINT ranges (``calconsole bench sweep``).

Every figure here is SIMULATED device time of the cost model at full Qwen3-30B-A3B size
(no host work): TTFT of a prompt (its prefill chunks, ``prefill_chunk`` tokens each as
the engine cuts them, a leftover 1-token chunk priced as a decode step, facts.md F1), the
prefill rate ``n / TTFT`` and the decode rate at a context.

Outside the measured F7 points these figures are extrapolations that rest on ASSUMED
parameters.  Each figure therefore carries a range from a JOINT sample (:func:`joint_models`):
every assumed parameter of the hardware YAML's ``fitted`` section that the fit does not move
(its ``ranges``) and every hardware peak with a ``hardware_ranges`` entry (DRAM, SRAM, link,
PCIe bandwidth, INT8/FP16 peaks) are drawn together from a scrambled Sobol sequence (fixed
seed; log-uniform where a range spans a factor of 8 or more, integers rounded, KV blocks a
power of two); for each draw the fitted parameters are refitted on the FITTED cases only
(:func:`~sim_backend.tools.calibration_fit.fit_parameters`), and the draw is kept when its refit
reproduces the three F7 points within the tolerance (±3 %) and places every fitted band at
least as well as the shipped fit does (inside it, or no further outside than the shipped
model plus the tolerance: the shipped mechanisms cannot place ~2K and ~40K both inside).
``low`` / ``high`` are the extremes over the kept draws and the shipped model; a decode figure
at a context the report gives a band for also carries that band.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.costmodel import CostModel

#: facts.md F8 (report §12.1): prompt lengths of the experiment matrix
SWEEP_PROMPTS: tuple[int, ...] = (1, 16, 128, 512, 2048, 4096, 8192, 16384, 32768, 40900)
#: decode contexts: the F7 band contexts and the ones between them
SWEEP_CONTEXTS: tuple[int, ...] = (27, 128, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 33000,
                                   40900)
#: facts.md F7 decode rows by context (tok/s): the band a decode figure is shown beside
REPORT_BANDS: dict[int, tuple[float, float, str]] = {
    128: (58.0, 64.0, "short"), 2048: (38.0, 46.0, "~2K"), 4096: (28.0, 40.0, "~4K"),
    8192: (20.0, 30.0, "~8K-16K"), 12288: (20.0, 30.0, "~8K-16K"), 16384: (20.0, 30.0, "~8K-16K"),
    33000: (10.5, 13.5, "~33K: 'about 12'"), 40900: (10.0, 16.0, "~40K")}
PREFILL_CHUNK = 2048   # the engine's default prefill_chunk (serving/engine.py)
#: draws of the joint sample by default (each costs one refit, ~1-2 s of host time)
DEFAULT_SAMPLES = 32
_LOG_RATIO = 8.0


def ttft_us(cm: CostModel, n_prompt: int, chunk: int = PREFILL_CHUNK, shape: ModelShape | None = None) -> float:
    """Simulated µs from the first prefill chunk's submit to the first token's logits.

    The prompt is cut into ``chunk``-token prefill steps; a 1-token step runs the decode
    sub-model (facts.md F1).  Raises ValueError for ``n_prompt < 1`` or beyond the context.
    """
    shape = shape or ModelShape()
    if n_prompt < 1 or chunk < 1:
        raise ValueError("n_prompt and chunk must be >= 1")
    total, done = 0.0, 0
    while done < n_prompt:
        n = min(chunk, n_prompt - done)
        total += cm.price_step(shape, "decode" if n == 1 else "prefill", n, done).total_us
        done += n
    return total


def figures(cm: CostModel, prompts: Sequence[int] = SWEEP_PROMPTS, contexts: Sequence[int] = SWEEP_CONTEXTS,
            chunk: int = PREFILL_CHUNK) -> dict[str, dict[int, float]]:
    """``{"ttft_ms": {n: ms}, "prefill_tok_s": {n: tok/s}, "decode_tok_s": {ctx: tok/s}}`` (simulated)."""
    shape = ModelShape()
    t = {n: ttft_us(cm, n, chunk, shape) for n in prompts}
    return {"ttft_ms": {n: v / 1e3 for n, v in t.items()},
            "prefill_tok_s": {n: n * 1e6 / v for n, v in t.items()},
            "decode_tok_s": {c: 1e6 / cm.price_step(shape, "decode", 1, c).total_us for c in contexts}}


def sampled_parameters(cm: CostModel) -> list[tuple[str, str, float, float]]:
    """What the joint sample moves: ``(section, key, lo, hi)`` for every assumed ``fitted``-section
    parameter (not refitted) and every hardware peak with a range."""
    from sim_backend.tools.calibration_fit import FIT_FREE

    out = [("fitted", k, float(lo), float(hi)) for k, (lo, hi) in cm.hw.ranges.items()
           if k not in FIT_FREE and k != "host_overhead_ms_per_token" and lo < hi]
    out += [("hardware", k, float(lo), float(hi)) for k, (lo, hi) in cm.hw.hardware_ranges.items() if lo < hi]
    return out


def _draw(u: float, key: str, lo: float, hi: float) -> float:
    if key == "kv_block_kib":       # a DMA block is a power of two
        e_lo, e_hi = math.log2(lo), math.log2(hi)
        return float(2 ** round(e_lo + u * (e_hi - e_lo)))
    v = lo * (hi / lo) ** u if lo > 0 and hi / lo >= _LOG_RATIO else lo + u * (hi - lo)
    from sim_backend.model.hwspec import _INTEGER_FITTED

    return float(round(v)) if key in _INTEGER_FITTED else float(v)


def joint_models(cm: CostModel, samples: int = DEFAULT_SAMPLES, *, seed: int = 0,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The joint sample (module docstring): ``{"models": [(name, CostModel)], "kept", "drawn",
    "rejected": {name: reason}, "draws": [{"name", "values", "fit", "kept", "why"}], "parameters"}``.

    ``models`` starts with ``("shipped", cm)``.  Raises ValueError for ``samples < 1``.
    """
    from scipy.stats import qmc

    from sim_backend.tools.calibration_cases import (
        FIT_CASES,
        POINT_CASES,
        TOLERANCE_PCT,
        band_miss_pct,
        case_error_pct,
        evaluate_cases,
    )
    from sim_backend.tools.calibration_fit import fit_parameters

    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    params = sampled_parameters(cm)
    shipped_fit = {k: float(cm.hw.fitted[k]) for k in cm.hw.fitted}
    base_sims = evaluate_cases(cm, names=FIT_CASES)
    base_miss = {c: abs(band_miss_pct(c, base_sims[c])) for c in FIT_CASES if c not in POINT_CASES}
    # a prefix of the next power-of-two Sobol set (its balance properties need 2^m points)
    pts = qmc.Sobol(d=len(params), scramble=True, seed=seed).random_base2(m=max(0, math.ceil(math.log2(samples))))
    pts = pts[:samples]
    models: list[tuple[str, CostModel]] = [("shipped", cm)]
    draws, rejected = [], {}
    for i, u in enumerate(pts):
        name = f"draw{i}"
        if progress is not None:
            progress(name)
        vals = {(sec, k): _draw(float(x), k, lo, hi) for (sec, k, lo, hi), x in zip(params, u, strict=True)}
        m0 = cm.with_hardware(**{k: v for (sec, k), v in vals.items() if sec == "hardware"}).with_fitted(
            **{k: (int(v) if isinstance(cm.hw.fitted[k], int) else v) for (sec, k), v in vals.items()
               if sec == "fitted"})
        fit = fit_parameters(m0, start=shipped_fit, globalise=False)
        m = m0.with_fitted(**fit)
        sims = evaluate_cases(m, names=FIT_CASES)
        why = case = None
        for c in FIT_CASES:
            if c in POINT_CASES:
                e = case_error_pct(c, sims[c])
                if abs(e) > TOLERANCE_PCT:
                    why, case = f"refit misses {c} by {e:+.1f}%", f"{c} beyond ±{TOLERANCE_PCT:g}%"
                    break
            elif abs(band_miss_pct(c, sims[c])) > base_miss[c] + TOLERANCE_PCT:
                why = f"refit puts {c} {band_miss_pct(c, sims[c]):+.1f}% outside its band"
                case = f"{c} further outside its band than the shipped fit + {TOLERANCE_PCT:g}%"
                break
        draws.append({"name": name, "values": {f"{sec}.{k}": v for (sec, k), v in vals.items()}, "fit": fit,
                      "kept": why is None, "why": why, "rule": case})
        if why is None:
            models.append((name, m))
        else:
            rejected[name] = why
    return {"models": models, "kept": len(models) - 1, "drawn": samples, "rejected": rejected, "draws": draws,
            "parameters": [f"{sec}.{k} [{lo:g}, {hi:g}]" for sec, k, lo, hi in params]}


def sweep(cm: CostModel | None = None, *, prompts: Sequence[int] = SWEEP_PROMPTS,
          contexts: Sequence[int] = SWEEP_CONTEXTS,
          chunk: int = PREFILL_CHUNK, samples: int = DEFAULT_SAMPLES, seed: int = 0,
          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the sweep; JSON-friendly dict.

    ``prompts``: list of ``{"prompt_tokens", "ttft_ms": R, "prefill_tok_s": R}`` and
    ``contexts``: list of ``{"context", "decode_tok_s": R, "band": [lo, hi, label] or None}``,
    where each R is ``{"value", "low", "high", "low_by", "high_by"}`` (shipped value, extremes
    over the kept draws and the shipped model, the names of the draws that give them).
    ``joint``: ``{"drawn", "kept", "parameters", "rejected", "draws"}`` (:func:`joint_models`).
    All figures simulated device time.
    """
    cm = cm or CostModel.load()
    joint = joint_models(cm, samples, seed=seed, progress=progress)
    figs = [(name, figures(m, prompts, contexts, chunk)) for name, m in joint["models"]]

    def rng(key: str, x: int) -> dict[str, Any]:
        vals = [(f[key][x], name) for name, f in figs]
        lo, hi = min(vals), max(vals)
        return {"value": figs[0][1][key][x], "low": lo[0], "high": hi[0], "low_by": lo[1], "high_by": hi[1]}

    return {
        "time_unit": "simulated device time (cost model, no host work)",
        "prefill_chunk": chunk,
        "method": "joint sample of the assumed parameters and hardware peaks (Sobol, seed "
                  f"{seed}), fitted parameters refitted on the fitted F7 cases; kept when the F7 points stay within "
                  "3 % and the fitted bands no worse than the shipped fit + 3 %; low/high = extremes over the kept "
                  "draws and the shipped model",
        "joint": {k: joint[k] for k in ("drawn", "kept", "parameters", "rejected", "draws")},
        "prompts": [{"prompt_tokens": n, "ttft_ms": rng("ttft_ms", n), "prefill_tok_s": rng("prefill_tok_s", n)}
                    for n in prompts],
        "contexts": [{"context": c, "decode_tok_s": rng("decode_tok_s", c),
                      "band": list(REPORT_BANDS[c]) if c in REPORT_BANDS else None} for c in contexts],
    }


def plot(result: dict[str, Any], width: int = 100, height: int = 22) -> str:
    """Two terminal plots (plotext): TTFT vs prompt length and decode tok/s vs context, with ranges."""
    import plotext as plt

    out = []
    for key, rows, xkey, title, ylabel in (
            ("ttft_ms", result["prompts"], "prompt_tokens", "TTFT vs prompt length (simulated)", "TTFT s"),
            ("decode_tok_s", result["contexts"], "context", "decode rate vs context (simulated)", "tok/s")):
        scale = 1e-3 if key == "ttft_ms" else 1.0
        xs = [r[xkey] for r in rows]
        plt.clf()
        plt.plotsize(width, height)
        plt.theme("clear")
        for part, marker in (("high", "dot"), ("value", "hd"), ("low", "dot")):
            plt.plot(xs, [r[key][part] * scale for r in rows], label=part, marker=marker)
        plt.xscale("log")
        plt.title(title)
        plt.xlabel(xkey.replace("_", " "))
        plt.ylabel(ylabel)
        out.append(plt.build())
    return "\n".join(out)
