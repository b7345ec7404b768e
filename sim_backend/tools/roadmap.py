"""The roadmap, priced: each stage over the report's concurrency matrix (``calconsole bench roadmap``).

Stages (status codes, facts.md "What-if is labelled"):

=================  ======  ==========================================================
``today``          C0      production calbin, serial infer() + Wait() (facts.md F1)
``overlap``        C1      ping/pong async overlap (EnableParallelMode, facts.md F5)
``batch4/8/16``    C3      batch-N decode variant calbin + continuous batching + overlap
``best+s8``        C3      the best batch stage + S8 V-cache (KV tokens x 4/3)
``best+topk``      C3      the best batch stage + on-device top-k (k = 40)
=================  ======  ==========================================================

Concurrency matrix (facts.md F8): clients 1, 2, 4, 8, 16 x mixes ``short`` (all short),
``long`` (all long), ``mixed`` (10% long + 90% short: request i of the run is long when
``i % 10 == 9``). The report names the mixes but not the lengths; ours: short = 128-token
prompt, long = 4096-token prompt (the ~4K band of facts.md F7), 64 output tokens each by default
(F8 lists 32 / 128; 64 keeps the default run near 2-3 minutes; ``--max-tokens 128`` for the F8 figure).
Closed loop: each client sends its next request when the previous ends,
``requests_per_client`` times; one slot per client; the KV pool is the calbin's 40960 tokens
(one shared store, facts.md F6), so 16 long clients meet KV pressure, as they would on the device.

Runs are timing-only (no numerics: tokens from the seeded generator) with fast pacing.
Every latency and rate is SIMULATED device time (device steps priced at full size, plus
measured host work booked on that clock).

Metric definitions (facts.md F7): TTFT = request in -> first visible token; TPOT = mean gap after
the first; ITL = the per-token gaps (pooled over requests); goodput = completed tokens/s of
requests meeting every SLO (default TTFT <= 10 s, TPOT <= 100 ms, simulated).

Ranges (``*_range`` = [low, high]): each record's representative decode step (its mean batch
occupancy at the mix's mean context) is priced by a set of cost models and the throughputs scale
by nominal/that step time (TPOT and ITL by its inverse); low/high are the extremes over the set:
``weight_stream_eff`` refitted so the short-context decode spans the F7 band 58-64 tok/s, and the
kept draws of the JOINT sample of assumed parameters and hardware peaks
(:func:`sim_backend.tools.sweep.joint_models`, ``range_samples`` draws, each refitted to the
fitted F7 cases), each with the batched flash decoding run sequence by sequence (pessimistic) or
sharing the cores (optimistic). TTFT has no range (F7 has a single prefill point, no band).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sim_backend.bundle.manifest import DEFAULT_BUNDLE_DIR
from sim_backend.bundle.shapes import ModelShape
from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.model.batching import BatchedCostModel, Variant
from sim_backend.model.costmodel import CostModel
from sim_backend.planes.metrics import percentiles
from sim_backend.planes.types import SLO, ChatRequest, SamplingParams

__all__ = ["SLO", "run_roadmap", "answers", "RangeModel", "Stage"]  # SLO re-exported for the CLI (layer rule)

CLIENTS = (1, 2, 4, 8, 16)
#: joint draws (sweep.joint_models) behind the records' ranges by default: ~2 s of refit each
RANGE_SAMPLES = 8
MIXES = ("short", "long", "mixed")
SHORT_PROMPT, LONG_PROMPT, OUTPUT_TOKENS = 128, 4096, 64
DEFAULT_SLO = SLO(ttft_ms=10_000.0, tpot_ms=100.0)
BUNDLES = DEFAULT_BUNDLE_DIR.parent
CLOCK_NOTE = ("all rates and latencies are SIMULATED device time (cost model at full Qwen3-30B-A3B size, host work "
              "booked on the simulated clock); timing-only runs, fast pacing")


@dataclass(frozen=True)
class Stage:
    """One roadmap stage: bundle (decode batch), engine overlap and cost-model switches."""

    name: str
    decode_batch: int = 1
    overlap: bool = False
    variant: Variant = field(default_factory=Variant)

    @property
    def status(self) -> str:
        return Variant(self.variant.s8_v_cache, self.variant.on_device_topk, self.variant.topk_k,
                       self.overlap).status(self.decode_batch)

    @property
    def bundle_dir(self) -> Any:
        return None if self.decode_batch == 1 else BUNDLES / f"qwen3-30b-a3b-b{self.decode_batch}"


BASE_STAGES = (Stage("today"), Stage("overlap", overlap=True), Stage("batch4", 4, True), Stage("batch8", 8, True),
               Stage("batch16", 16, True))
STAGE_NAMES = tuple(s.name for s in BASE_STAGES) + ("best+s8", "best+topk")


def _prompt_tokens(i: int, n: int) -> tuple[int, ...]:
    # distinct ids per request (no prefix reuse across requests); plain BPE ids, no specials
    base = 1000 + (i * 7919) % 100_000
    return tuple(base + (j % 997) for j in range(n))


def run_cell(stage: Stage, mix: str, clients: int, *, requests_per_client: int = 2, max_tokens: int = OUTPUT_TOKENS,
             short_prompt: int = SHORT_PROMPT, long_prompt: int = LONG_PROMPT, slo: SLO = DEFAULT_SLO,
             timeout_s: float = 600.0) -> dict[str, Any]:
    """One (stage, mix, clients) run on a fresh timing-only system; returns its raw figures.

    Returns ``{"results": [RequestResult...], "span_ms", "batch_occupancy"}`` (simulated ms).
    Raises ValueError for an unknown mix.
    """
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {', '.join(MIXES)}, got {mix!r}")
    results: list[Any] = []
    lock = threading.Lock()
    with build_system(stage.bundle_dir, pacing=Pacing(PacingMode.FAST), numerics=False, n_slots=clients,
                      queue_limit=clients, max_inflight=2 if stage.overlap else 1, maintenance=False,
                      variant=None if stage.variant.is_default else stage.variant, slo=slo) as s:
        def request(i: int) -> ChatRequest:
            long_ = mix == "long" or (mix == "mixed" and i % 10 == 9)
            return ChatRequest(messages=(), prompt_tokens=_prompt_tokens(i, long_prompt if long_ else short_prompt),
                               max_tokens=max_tokens, cache_prompt=False,
                               sampling=SamplingParams(temperature=0.0, seed=i))

        counter = iter(range(clients, clients * requests_per_client))

        def client(first: Any) -> None:
            try:
                r = first.result(timeout_s)
            except BaseException:
                first.cancel("roadmap client interrupted")
                raise
            with lock:
                results.append(r)
            for _ in range(requests_per_client - 1):
                with lock:
                    i = next(counter)
                r = s.inference.generate(request(i), timeout_s)
                with lock:
                    results.append(r)

        # every client's first request submitted here, back to back, before any client waits: the clients start
        # together on the simulated clock whatever the host's thread scheduling (threads started one by one
        # sometimes found the first 4-token reply already done, and a batch stage measured occupancy 1)
        firsts = [s.inference.submit(request(c)) for c in range(clients)]
        threads = [threading.Thread(target=client, args=(h,), name=f"roadmap-client-{c}", daemon=True)
                   for c, h in enumerate(firsts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        occ = [b["occupancy"] for b in s.engine.batch_log]
        batch_steps = len(occ)
    arr = [r.timings.arrival_ms for r in results if r.timings.arrival_ms is not None]
    done = [r.timings.done_ms for r in results if r.timings.done_ms is not None]
    span = (max(done) - min(arr)) if arr and done else 0.0
    return {"results": results, "span_ms": span,
            "batch_occupancy": (sum(occ) / len(occ)) if occ else 1.0, "batch_steps": batch_steps}


def _pct(xs: Sequence[float]) -> dict[str, Any]:
    p = percentiles(xs)
    return {"p50": p.get("p50"), "p95": p.get("p95"), "p99": p.get("p99")}


def summarise(stage: Stage, mix: str, clients: int, raw: dict[str, Any], slo: SLO,
              factors: tuple[float, float]) -> dict[str, Any]:
    """The JSON record of one cell (simulated ms / per simulated second)."""
    res = raw["results"]
    ok = [r for r in res if r.status == "finished"]
    span_s = raw["span_ms"] / 1e3
    tokens = sum(r.timings.predicted_n for r in ok)

    def good(r: Any) -> bool:
        t = r.timings
        return ((slo.ttft_ms is None or (t.ttft_ms is not None and t.ttft_ms <= slo.ttft_ms))
                and (slo.tpot_ms is None or t.tpot_ms is None or t.tpot_ms <= slo.tpot_ms)
                and (slo.e2el_ms is None or (t.e2e_ms is not None and t.e2e_ms <= slo.e2el_ms)))

    good_tokens = sum(r.timings.predicted_n for r in ok if good(r))
    rps = len(ok) / span_s if span_s > 0 else None
    tps = tokens / span_s if span_s > 0 else None
    gp = good_tokens / span_s if span_s > 0 else None
    tpot = _pct([r.timings.tpot_ms for r in ok if r.timings.tpot_ms is not None])
    itl = _pct([g for r in ok for g in (r.timings.itl_ms or ())])
    lo, hi = factors  # throughput multipliers at the pessimistic / optimistic end

    def rng(v: float | None, inverse: bool = False) -> list[float | None]:
        if v is None:
            return [None, None]
        return [v / lo, v / hi] if inverse else [v * lo, v * hi]

    return {
        "stage": stage.name, "status": stage.status, "mix": mix, "clients": clients,
        "requests": len(res), "finished": len(ok), "failed": len(res) - len(ok),
        "requests_per_s": rps, "tokens_per_s": tps,
        "ttft_ms": _pct([r.timings.ttft_ms for r in ok if r.timings.ttft_ms is not None]),
        "tpot_ms": tpot, "itl_ms": itl,
        "goodput": gp,
        "queue_ms": _pct([r.timings.queue_ms for r in res if r.timings.queue_ms is not None]),
        "batch_occupancy": raw["batch_occupancy"],
        "ranges": {"requests_per_s": rng(rps), "tokens_per_s": rng(tps), "goodput": rng(gp),
                   "tpot_ms_p95": rng(tpot["p95"], inverse=True), "itl_ms_p95": rng(itl["p95"], inverse=True),
                   "ttft_ms": None},
    }


# --- ranges -------------------------------------------------------------------------------


def _fit_weight_eff(cm: CostModel, shape: ModelShape, target_tok_s: float) -> float:
    """weight_stream_eff at which a short-context decode (context 27..272, as the F7 fit) gives ``target_tok_s``."""
    lo, hi = 0.05, 1.0

    def rate(eff: float) -> float:
        m = cm.with_fitted(weight_stream_eff=eff)
        return 1e6 / m.price_step(shape, "decode", 1, 150).total_us

    for _ in range(40):
        mid = (lo + hi) / 2
        if rate(mid) < target_tok_s:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class RangeModel:
    """Pessimistic / optimistic cost models for the ranges (module docstring, "Ranges").

    ``joint``: further cost models (the kept draws of ``sweep.joint_models``) whose steps widen the
    range; None or empty = the first-order range alone.
    """

    def __init__(self, base: CostModel | None = None, shape: ModelShape | None = None,
                 joint: Sequence[CostModel] | None = None) -> None:
        self.base = base or CostModel.load()
        self.shape = shape or ModelShape()
        self.eff_lo = _fit_weight_eff(self.base, self.shape, 58.0)   # F7 short band 58-64 tok/s
        self.eff_hi = _fit_weight_eff(self.base, self.shape, 64.0)
        self.joint = list(joint or ())
        self._cache: dict[tuple[str, int, int], tuple[float, float]] = {}

    def factors(self, stage: Stage, occupancy: float, context: int) -> tuple[float, float]:
        """(pessimistic, optimistic) throughput multipliers of the representative decode step."""
        n = max(1, min(stage.decode_batch, int(round(occupancy))))
        ctx = max(0, min(self.shape.n_ctx - 1, int(context)))
        key = (stage.name, n, ctx // 64)
        if key in self._cache:
            return self._cache[key]
        pasts = [ctx] * n

        def step(base: CostModel, ramp: str) -> float:
            return BatchedCostModel(base, stage.variant, ramp=ramp).price_decode_batch(self.shape, pasts).total_us

        nominal = step(self.base, "sum")
        opt_ramp = "max" if n > 1 else "sum"
        slow = [step(self.base.with_fitted(weight_stream_eff=self.eff_lo), "sum")]
        fast = [step(self.base.with_fitted(weight_stream_eff=self.eff_hi), opt_ramp)]
        for m in self.joint:
            slow.append(step(m, "sum"))
            fast.append(step(m, opt_ramp))
        out = (min(1.0, nominal / max(slow)), max(1.0, nominal / min(fast)))
        self._cache[key] = out
        return out


# --- the whole matrix ------------------------------------------------------------------------


def _mean_context(mix: str, short_prompt: int, long_prompt: int, max_tokens: int) -> int:
    p = {"short": short_prompt, "long": long_prompt, "mixed": 0.9 * short_prompt + 0.1 * long_prompt}[mix]
    return int(p + max_tokens / 2)


def run_roadmap(*, stages: Sequence[str] = STAGE_NAMES, mixes: Sequence[str] = MIXES,
                clients: Sequence[int] = CLIENTS, requests_per_client: int = 2, max_tokens: int = OUTPUT_TOKENS,
                short_prompt: int = SHORT_PROMPT, long_prompt: int = LONG_PROMPT, slo: SLO = DEFAULT_SLO,
                progress: Callable[[str], None] | None = None, range_samples: int = RANGE_SAMPLES) -> dict[str, Any]:
    """Run the matrix; returns ``{"records": [...], "answers": {...}, "slo": ..., "clock": ...}``.

    ``best+s8`` / ``best+topk`` use the batch stage with the highest tokens/s at the largest
    client count run (they need at least one batch stage in ``stages``; else they are skipped).
    Raises ValueError for unknown stage or mix names.
    """
    bad = [s for s in stages if s not in STAGE_NAMES]
    if bad:
        raise ValueError(f"unknown stage(s) {bad}; known: {', '.join(STAGE_NAMES)}")
    badm = [m for m in mixes if m not in MIXES]
    if badm:
        raise ValueError(f"unknown mix(es) {badm}; known: {', '.join(MIXES)}")
    if not 0 <= range_samples <= 512:
        raise ValueError(f"range_samples must be in 0..512, got {range_samples}")
    joint: list[CostModel] = []
    if range_samples:
        from sim_backend.tools.sweep import joint_models

        def note(d: str) -> None:
            if progress:
                progress(f"range {d}")

        joint = [m for name, m in joint_models(CostModel.load(), range_samples, progress=note)["models"]
                 if name != "shipped"]
    ranges = RangeModel(joint=joint)
    records: list[dict[str, Any]] = []
    kw: dict[str, Any] = dict(requests_per_client=requests_per_client, max_tokens=max_tokens,
                              short_prompt=short_prompt, long_prompt=long_prompt, slo=slo)

    def run_stage(st: Stage) -> None:
        for mix in mixes:
            for c in clients:
                if progress:
                    progress(f"{st.name} {mix} x{c}")
                raw = run_cell(st, mix, c, **kw)
                f = ranges.factors(st, raw["batch_occupancy"], _mean_context(mix, short_prompt, long_prompt,
                                                                             max_tokens))
                records.append(summarise(st, mix, c, raw, slo, f))

    for st in BASE_STAGES:
        if st.name in stages:
            run_stage(st)
    batch_names = [s.name for s in BASE_STAGES if s.decode_batch > 1 and s.name in stages]
    best = None
    if batch_names:
        top = max(clients)
        best = max(batch_names, key=lambda n: sum(r["tokens_per_s"] or 0.0 for r in records
                                                  if r["stage"] == n and r["clients"] == top))
        b = next(s for s in BASE_STAGES if s.name == best)
        if "best+s8" in stages:
            run_stage(Stage("best+s8", b.decode_batch, True, Variant(s8_v_cache=True)))
        if "best+topk" in stages:
            run_stage(Stage("best+topk", b.decode_batch, True, Variant(on_device_topk=True)))
    return {"records": records, "answers": answers(records, slo), "best_batch_stage": best,
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "e2el_ms": slo.e2el_ms},
            "workload": {"short_prompt": short_prompt, "long_prompt": long_prompt, "max_tokens": max_tokens,
                         "requests_per_client": requests_per_client, "mixed": "10% long + 90% short"},
            "ranges_from": {"first_order": "weight_stream_eff refitted to the F7 short band 58-64 tok/s",
                            "joint_drawn": range_samples, "joint_kept": len(joint)},
            "clock": CLOCK_NOTE}


def answers(records: Sequence[dict[str, Any]], slo: SLO) -> dict[str, Any]:
    """Per stage: tokens/s at the most clients run (all mixes), and the TPOT-SLO knee per mix:
    the lowest client count whose P95 TPOT exceeds the SLO (None = met at every count run)."""
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(r["stage"] for r in records):
        rs = [r for r in records if r["stage"] == name]
        top = max(r["clients"] for r in rs)
        knee: dict[str, int | None] = {}
        for mix in dict.fromkeys(r["mix"] for r in rs):
            over = sorted(r["clients"] for r in rs if r["mix"] == mix and slo.tpot_ms is not None
                          and (r["tpot_ms"]["p95"] or 0.0) > slo.tpot_ms)
            knee[mix] = over[0] if over else None
        out[name] = {"status": rs[0]["status"], "clients": top,
                     "tokens_per_s": {r["mix"]: r["tokens_per_s"] for r in rs if r["clients"] == top},
                     "tokens_per_s_range": {r["mix"]: r["ranges"]["tokens_per_s"] for r in rs if r["clients"] == top},
                     "tpot_slo_knee_clients": knee}
    base = out.get("today")
    if base:
        for v in out.values():
            v["gain_over_today"] = {m: (t / base["tokens_per_s"][m]) if t and base["tokens_per_s"].get(m) else None
                                    for m, t in v["tokens_per_s"].items()}
    return out


def fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{nd}f}"
