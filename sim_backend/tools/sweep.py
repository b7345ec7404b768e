"""Prompt-length / context sweep with sensitivity ranges (``calconsole bench sweep``).

Every figure here is SIMULATED device time of the cost model at full Qwen3-30B-A3B size
(no host work): TTFT of a prompt (its prefill chunks, ``prefill_chunk`` tokens each as
the engine cuts them, a leftover 1-token chunk priced as a decode step, facts.md F1), the
prefill rate ``n / TTFT`` and the decode rate at a context.

Outside the measured F7 points these figures are extrapolations that rest on ASSUMED
parameters (the YAML's non-fitted values).  Each figure therefore carries a range: for
every assumed parameter of :data:`SENSITIVITY_PARAMS`, one at a time, the value is moved
to each end of its physical range (the YAML's ``ranges``), the fitted parameters are
refitted to the F7 cases (:func:`~sim_backend.tools.calibration.fit_parameters`), and the
figure is recomputed; ``low`` / ``high`` are the extremes over these variants and the
shipped model, ``low_by`` / ``high_by`` name the variant that gives them.  The ranges are
one-at-a-time (no joint corners), so they are not bounds, and they do not include the
fitted parameters' own uncertainty (see the held-out errors of ``bench calibrate``).
"""

from __future__ import annotations

from collections.abc import Callable

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.costmodel import CostModel

#: facts.md F8 (report §12.1): prompt lengths of the experiment matrix
SWEEP_PROMPTS: tuple[int, ...] = (1, 16, 128, 512, 2048, 4096, 8192, 16384, 32768, 40900)
#: decode contexts: the F7 band contexts and the ones between them
SWEEP_CONTEXTS: tuple[int, ...] = (27, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 33000, 40900)
#: assumed (not fitted) parameters whose ranges make the sensitivity figures
SENSITIVITY_PARAMS: tuple[str, ...] = ("attn_compute_eff", "prefill_m_tile", "activation_eff", "per_op_overhead_us",
                                       "int8_compute_eff", "d2d_eff", "step_submit_overhead_us", "attn_kv_block_rows")
PREFILL_CHUNK = 2048   # the engine's default prefill_chunk (serving/engine.py)


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


def figures(cm: CostModel, prompts=SWEEP_PROMPTS, contexts=SWEEP_CONTEXTS,
            chunk: int = PREFILL_CHUNK) -> dict[str, dict[int, float]]:
    """``{"ttft_ms": {n: ms}, "prefill_tok_s": {n: tok/s}, "decode_tok_s": {ctx: tok/s}}`` (simulated)."""
    shape = ModelShape()
    t = {n: ttft_us(cm, n, chunk, shape) for n in prompts}
    return {"ttft_ms": {n: v / 1e3 for n, v in t.items()},
            "prefill_tok_s": {n: n * 1e6 / v for n, v in t.items()},
            "decode_tok_s": {c: 1e6 / cm.price_step(shape, "decode", 1, c).total_us for c in contexts}}


def variants(cm: CostModel, params: tuple[str, ...] = SENSITIVITY_PARAMS,
             progress: Callable[[str], None] | None = None,
             rejected: dict[str, str] | None = None) -> list[tuple[str, CostModel]]:
    """The shipped model and, per assumed parameter and range end, the refitted model.

    Names: ``"shipped"``, ``"<param>=<value>"``.  One refit per variant (about a second each).
    A variant whose refit cannot reproduce the three F7 points within the tolerance is
    ruled out by the data: it is left out and, if ``rejected`` is given, recorded there
    (name -> reason).
    """
    from sim_backend.tools.calibration import POINT_CASES, TOLERANCE_PCT, case_error_pct, evaluate_cases, fit_parameters

    shipped = {k: float(v) for k, v in cm.hw.fitted.items()}
    out: list[tuple[str, CostModel]] = [("shipped", cm)]
    for p in params:
        lo, hi = cm.hw.ranges[p]
        for v in (lo, hi):
            if v == cm.hw.fitted[p]:
                continue
            name = f"{p}={v:g}"
            if progress is not None:
                progress(name)
            fit = fit_parameters(cm, fixed={p: v}, start=shipped)
            m = cm.with_fitted(**{p: v}, **fit)
            sims = evaluate_cases(m)
            errs = {c: case_error_pct(c, sims[c]) for c in POINT_CASES}
            worst = max(errs, key=lambda c: abs(errs[c]))
            if abs(errs[worst]) > TOLERANCE_PCT:
                if rejected is not None:
                    rejected[name] = f"refit misses {worst} by {errs[worst]:+.1f}%"
                continue
            out.append((name, m))
    return out


def sweep(cm: CostModel | None = None, *, prompts=SWEEP_PROMPTS, contexts=SWEEP_CONTEXTS,
          chunk: int = PREFILL_CHUNK, params: tuple[str, ...] = SENSITIVITY_PARAMS,
          progress: Callable[[str], None] | None = None) -> dict:
    """Run the sweep; JSON-friendly dict.

    ``prompts``: list of ``{"prompt_tokens", "ttft_ms": R, "prefill_tok_s": R}`` and
    ``contexts``: list of ``{"context", "decode_tok_s": R}``, where each R is
    ``{"value", "low", "high", "low_by", "high_by"}`` (shipped value, extremes over the
    variants, the variant names that give them).  ``variants``: the variant names used;
    ``rejected_variants``: those the F7 points rule out, with the reason.
    All figures simulated device time.
    """
    cm = cm or CostModel.load()
    rejected: dict[str, str] = {}
    models = variants(cm, params, progress, rejected)
    figs = [(name, figures(m, prompts, contexts, chunk)) for name, m in models]

    def rng(key: str, x: int) -> dict:
        vals = [(f[key][x], name) for name, f in figs]
        lo, hi = min(vals), max(vals)
        return {"value": figs[0][1][key][x], "low": lo[0], "high": hi[0], "low_by": lo[1], "high_by": hi[1]}

    return {
        "time_unit": "simulated device time (cost model, no host work)",
        "prefill_chunk": chunk,
        "variants": [name for name, _ in models],
        "rejected_variants": rejected,
        "method": "one assumed parameter at a time at each end of its physical range, fitted parameters refitted "
                  "to the F7 cases; low/high = extremes over those variants and the shipped model",
        "prompts": [{"prompt_tokens": n, "ttft_ms": rng("ttft_ms", n), "prefill_tok_s": rng("prefill_tok_s", n)}
                    for n in prompts],
        "contexts": [{"context": c, "decode_tok_s": rng("decode_tok_s", c)} for c in contexts],
    }


def plot(result: dict, width: int = 100, height: int = 22) -> str:
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
