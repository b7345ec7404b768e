"""The replay's price tables: what a board's steps cost, from the bundle's calibrated cost model, as
tables (:class:`StepPrices`: decode = a per-step part by batch size + a per-sequence part by context,
prefix-summed over context; prefill chunks memoised), and the shipped bundles a replay can run
(:data:`VARIANTS`, :func:`check_replayable`).  Prices are SIMULATED µs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sim_backend.bundle.manifest import DEFAULT_BUNDLE_DIR, Bundle, load_bundle
from sim_backend.model.batching import price_decode_batch
from sim_backend.model.costmodel import CostModel
from sim_backend.tools.replay_trace import Trace

#: the bundles a search compares: production (batch-1 decode) and the roadmap's batch variants (C3 what-ifs)
VARIANTS = ("qwen3-30b-a3b", "qwen3-30b-a3b-b4", "qwen3-30b-a3b-b8", "qwen3-30b-a3b-b16")


def variant_bundle_dir(name: str) -> Path:
    """The shipped bundle directory named ``name`` (one of :data:`VARIANTS`, or any bundle beside them).
    Raises ValueError naming the choices for an unknown name."""
    d = DEFAULT_BUNDLE_DIR.parent / name
    if not (d / "manifest.yaml").is_file() and not d.is_dir():
        raise ValueError(f"no shipped bundle {name!r}; choose one of {', '.join(VARIANTS)}")
    return d


def check_replayable(b: Bundle) -> None:
    """Raise ValueError unless bundle ``b`` is of the MoE family the replay prices (the cost model's decode
    batches and expert tables are Qwen3-30B-A3B's, facts.md F2); a dense pilot bundle is named as such."""
    if not b.shape.is_moe:
        raise ValueError(f"bundle {b.name!r} is of the {b.family} family: the replay prices the MoE model's "
                         f"boards only (choose one of {', '.join(VARIANTS)})")


def check_replayable_dir(bundle_dir: str | Path) -> None:
    """Load the bundle at ``bundle_dir`` and check it as :func:`check_replayable` does, for callers that may
    not import the bundle package themselves (the console's commands reach the simulator through its tools).
    Raises ManifestError for a bad manifest, ValueError for a bundle the replay does not price."""
    check_replayable(load_bundle(Path(bundle_dir)))


@dataclass
class StepPrices:
    """Step prices of one bundle in simulated µs, as the board's cost model gives them.

    ``decode_fixed_us[n]`` (n = 1..decode_batch; [0] unused): the part of a decode step of ``n`` sequences
    that does not depend on their contexts; ``decode_seq_us[p]``: the part one sequence with ``p`` tokens of
    past adds (batched decode prices each sequence's flash attention on its own context and sums them,
    ``batching.BatchedCostModel``); ``decode_seq_cum`` its prefix sum (``cum[p]`` = sum below p).
    A decode step of pasts ``ps`` costs ``decode_fixed_us[len(ps)] + sum(decode_seq_us[p] for p in ps)``
    (tests check this against the cost model). ``prefill_us[(n, past)]``: one prefill chunk.
    ``host_token_us``: modeled host work per sampled token (facts.md F7 fit, the hardware YAML's
    ``host_overhead_ms_per_token``). ``kv_cells``: the bundle's KV pool in tokens (facts.md F6);
    ``n_ctx``: a slot's context (the calbin's, facts.md F2).
    """

    bundle: str
    decode_batch: int
    decode_fixed_us: np.ndarray
    decode_seq_us: np.ndarray
    decode_seq_cum: np.ndarray
    prefill_us: dict[tuple[int, int], float]
    host_token_us: float
    kv_cells: int
    n_ctx: int
    cost: CostModel | None = field(default=None, repr=False)
    shape: Any = field(default=None, repr=False)

    @classmethod
    def build(cls, bundle_dir: str | Path | None = None, *, max_context: int | None = None,
              prefill_chunks: Iterable[tuple[int, int]] = (), cost: CostModel | None = None) -> StepPrices:
        """Price the tables for ``bundle_dir`` (default the production bundle) up to ``max_context`` tokens
        of past (default the calbin's context), and the given prefill chunks ``(n_tokens, past)``.

        Raises ManifestError for a bad bundle, ValueError for a bundle not of the MoE family or a context
        beyond the calbin's.
        """
        b: Bundle = load_bundle(bundle_dir)
        check_replayable(b)
        cm = cost if cost is not None else CostModel.load()
        shape = b.shape
        top = b.context if max_context is None else int(max_context)
        if not 1 <= top <= b.context:
            raise ValueError(f"max_context must be in 1..{b.context}, got {top}")
        nb = int(b.decode_batch)
        zero = float(price_decode_batch(cm, shape, [0]).total_us)
        seq = np.empty(top, dtype=np.float64)
        for p in range(top):
            seq[p] = float(cm.price_step(shape, "decode", 1, p).total_us) - zero
        seq[0] = 0.0
        fixed = np.zeros(nb + 1, dtype=np.float64)
        for n in range(1, nb + 1):
            fixed[n] = float(price_decode_batch(cm, shape, [0] * n).total_us) if n > 1 else zero
        cum = np.concatenate([[0.0], np.cumsum(seq)])
        out = cls(b.name, nb, fixed, seq, cum, {}, float(cm.host_overhead_ms_per_token) * 1e3,
                  int(b.context), int(b.context), cm, shape)
        for n, past in prefill_chunks:
            out.prefill(n, past)
        return out

    def prefill(self, n: int, past: int) -> float:
        """One prefill chunk of ``n`` tokens after ``past`` (simulated µs); priced once, then memoised.
        Raises RuntimeError for an unpriced chunk once the cost model was dropped (``detached``)."""
        key = (int(n), int(past))
        v = self.prefill_us.get(key)
        if v is None:
            if self.cost is None:
                raise RuntimeError(f"prefill chunk {key} was not priced before the prices were detached")
            v = self.prefill_us[key] = float(self.cost.price_step(self.shape, "prefill", key[0], key[1]).total_us)
        return v

    def decode(self, pasts: Sequence[int]) -> float:
        """One decode step of ``len(pasts)`` sequences with those pasts (simulated µs)."""
        return float(self.decode_fixed_us[len(pasts)] + sum(self.decode_seq_us[p] for p in pasts))

    def detached(self) -> StepPrices:
        """A copy without the cost model (small to ship to another process; every needed chunk priced)."""
        return StepPrices(self.bundle, self.decode_batch, self.decode_fixed_us, self.decode_seq_us,
                          self.decode_seq_cum, dict(self.prefill_us), self.host_token_us, self.kv_cells,
                          self.n_ctx)


def prefill_chunks(prompts: Iterable[int], chunk: int) -> set[tuple[int, int]]:
    """The ``(n_tokens, past)`` prefill chunks the round rule cuts ``prompts`` into (``chunk`` at most)."""
    out: set[tuple[int, int]] = set()
    for p in prompts:
        done = 0
        while done < p:
            n = min(chunk, p - done)
            out.add((n, done))
            done += n
    return out


def prices_for_trace(trace: Trace, bundle_dir: str | Path | None = None, *, prefill_chunk: int = 2048,
                     cost: CostModel | None = None) -> StepPrices:
    """:meth:`StepPrices.build` with the contexts and chunks ``trace`` needs (requests over the calbin's
    context are not priced: the replay refuses them)."""
    b = load_bundle(bundle_dir)
    total = trace.prompt + trace.output
    ok = total <= b.context  # the rest is refused before a step, so never priced
    need = int(total[ok].max()) if ok.any() else 1
    return StepPrices.build(bundle_dir, max_context=need, prefill_chunks=prefill_chunks(
        (int(p) for p in trace.prompt[ok]), prefill_chunk), cost=cost)
