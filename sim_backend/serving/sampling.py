"""CPU token sampling over the full logits vector.

facts.md F1: every decode step returns 151936 BF16 logits (303,872 B D2H) that
the host converts to FP32 and samples on the CPU; F6 lists the production
integration's "full FP32 temp copy of the logits" as a latency defect. This
module is that host path, made fast: BF16 -> FP32 by a bit shift into a
preallocated buffer, and a sampler that never sorts the whole vocabulary.

Sampler chain (llama.cpp order): logit bias -> penalties -> top-k -> top-p -> min-p ->
temperature -> draw. Top-p and min-p see temperature-1 probabilities, as in
llama.cpp, because temperature is applied last.

The exact draw convention (the chain's arithmetic, which :class:`Sampler` and the reference
:func:`~sim_backend.serving.sampling_reference.naive_sample` share) is in
:mod:`sim_backend.serving.sampling_reference`; token probabilities in :mod:`sim_backend.serving.token_probs`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from sim_backend.model import bf16 as _bf16
from sim_backend.model import logits as _logits
from sim_backend.model.vocab import VOCAB_SIZE
from sim_backend.planes.types import SamplingParams, TokenLogprob, TokenProbs
from sim_backend.serving.sampling_reference import (
    N_VALID,
    apply_mask,
    apply_penalties,
    default_n_valid,
    pick,
    sanitize,
    top_ids,
    top_p_cut,
)

__all__ = [
    "VOCAB_SIZE",
    "N_VALID",
    "Sampler",
    "bf16_to_f32",
    "f32_to_bf16",
]

# Logits are grouped as a (64, n/64) matrix; the k-th largest of the column
# maxima is a lower bound that at least k logits reach (one per column).
_GROUP_ROWS = 64
# Candidate sets larger than this are shrunk by bisection before sorting.
_BISECT_ABOVE = 2048


# --- BF16 <-> FP32 ----------------------------------------------------------------
# One home: sim_backend.model.bf16. Re-exported here, where the host path has always imported them from.

bf16_to_f32 = _bf16.bf16_to_f32
f32_to_bf16 = _bf16.f32_to_bf16


# --- fast sampler --------------------------------------------------------------------


class Sampler:
    """Fast CPU sampler for one request (facts.md F1: 151936 FP32 logits per token).

    Owns ``np.random.Generator(PCG64(seed))``; with ``params.seed is None`` a
    seed is drawn once and exposed as :attr:`seed`, so any run can be replayed
    with ``SamplingParams(seed=sampler.seed)``. Not thread-safe (one per slot).

    Never sorts the vocabulary: a column-max bound over a (64, vocab/64) view
    gives a threshold that at least k logits reach, so top-k is a compare +
    a sort of ~k values; top-p without top-k grows such a candidate prefix
    until its mass covers top_p. Results equal :func:`naive_sample` exactly.
    """

    def __init__(self, params: SamplingParams, vocab_size: int = VOCAB_SIZE, *, n_valid: int | None = None,
                 logit_bias: Sequence[tuple[int, float]] = ()) -> None:
        """``logit_bias``: (token id in [0, vocab_size), bias) pairs added to the logits first in the chain
        (llama.cpp's logit-bias sampler; ``-inf`` bans the id; a repeated id adds up). ValueError for an id out
        of range."""
        params.validate(vocab_size)
        self.params = params
        self._bias_ids = np.fromiter((int(t) for t, _ in logit_bias), dtype=np.intp, count=len(logit_bias))
        self._bias = np.fromiter((float(b) for _, b in logit_bias), dtype=np.float32, count=len(logit_bias))
        if self._bias_ids.size and not (0 <= int(self._bias_ids.min()) and int(self._bias_ids.max()) < vocab_size):
            raise ValueError(f"logit_bias ids must be in [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.n_valid = default_n_valid(vocab_size) if n_valid is None else int(n_valid)
        if not 0 < self.n_valid <= vocab_size:
            raise ValueError(f"n_valid must be in (0, {vocab_size}]")
        if params.seed is None:
            self.seed = int(np.random.SeedSequence().generate_state(1, np.uint64)[0])
        else:
            self.seed = int(params.seed)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        # Scratch: logits padded with -inf to a multiple of _GROUP_ROWS.
        self._cols = -(-vocab_size // _GROUP_ROWS)
        self._x = np.full(self._cols * _GROUP_ROWS, -np.inf, dtype=np.float32)
        self._grid = self._x.reshape(_GROUP_ROWS, self._cols)
        self._colmax = np.empty(self._cols, dtype=np.float32)
        self._f64 = np.empty(vocab_size, dtype=np.float64)
        #: what the last sample drew from (for post_sampling_probs): ("greedy", id) | ("cand", ids, q, total)
        #: | ("full", q over the vocabulary, total)
        self._last: tuple[Any, ...] | None = None

    def sample(self, logits: np.ndarray, recent: Sequence[int] = (), allowed: np.ndarray | None = None) -> int:
        """Choose the next token id.

        Args:
            logits: ``float32`` shape (vocab_size,) — FP32 logits of one step
                (not modified; copied into an internal scratch buffer).
            recent: previous token ids (prompt + generated), newest last, for
                the repeat/presence/frequency penalties.
            allowed: ``bool`` shape (vocab_size,) or None: the ids a grammar allows (constrained
                decoding); the others get ``-inf`` after the penalties. At least one valid id must be allowed.

        Returns:
            Token id in ``[0, n_valid)`` (int), one ``allowed`` permits.
        """
        n = self.vocab_size
        if logits.shape != (n,):
            raise ValueError(f"logits must have shape ({n},), got {logits.shape}")
        np.copyto(self._x[:n], logits)
        return self._sample_scratch(recent, allowed)

    def sample_bf16(self, logits_bf16: np.ndarray, recent: Sequence[int] = (),
                    allowed: np.ndarray | None = None) -> int:
        """:meth:`sample` from BF16 bits, widened straight into the scratch buffer (no FP32 temp copy).

        Args:
            logits_bf16: ``uint16`` shape (vocab_size,), the BF16 bits of one step's logits (the D2H).
            recent, allowed: as for :meth:`sample`.

        Returns the same token :meth:`sample` returns for ``bf16_to_f32(logits_bf16)``.
        Raises ValueError (wrong shape; no finite logit left), TypeError (not uint16).
        """
        n = self.vocab_size
        if logits_bf16.shape != (n,):
            raise ValueError(f"logits must have shape ({n},), got {logits_bf16.shape}")
        _bf16.bf16_to_f32(logits_bf16, out=self._x[:n])
        return self._sample_scratch(recent, allowed)

    def sample_d2h(self, logits: np.ndarray, recent: Sequence[int] = (),
                   allowed: np.ndarray | None = None) -> int:
        """:meth:`sample` from a step's D2H logits in either dtype the device returns: ``uint16`` BF16 bits
        (:meth:`sample_bf16`) or ``float32`` (an F32 C3 calbin; :meth:`sample`). ``recent``, ``allowed``
        as for :meth:`sample`. Raises ValueError (wrong shape; no finite logit left), TypeError (another dtype).
        """
        if _logits.dtype_of(logits) == "bf16":
            return self.sample_bf16(logits, recent, allowed)
        return self.sample(logits, recent, allowed)

    def _sample_scratch(self, recent: Sequence[int], allowed: np.ndarray | None = None) -> int:
        """The sampler chain over the logits already in ``self._x[:vocab_size]`` (modified in place)."""
        p = self.params
        n, nv = self.vocab_size, self.n_valid
        x = self._x[:n]
        if self._bias_ids.size:
            np.add.at(x, self._bias_ids, self._bias)  # first in llama.cpp's chain, before the penalties
        apply_penalties(x, recent, p)
        x[nv:] = -np.inf
        if allowed is not None:
            if allowed.shape != (n,) or allowed.dtype != np.bool_:
                raise ValueError(f"allowed must be a bool array of shape ({n},)")
            apply_mask(x, allowed)
        np.max(self._grid, axis=0, out=self._colmax)
        m = float(self._colmax.max())
        if not math.isfinite(m):
            sanitize(x)
            np.max(self._grid, axis=0, out=self._colmax)
            m = float(self._colmax.max())
            if m == -math.inf:
                raise ValueError("no finite logits to sample from")
        if p.is_greedy:
            tok = int(np.argmax(x))
            self._last = ("greedy", tok)
            return tok
        u = self.rng.random()
        cand: np.ndarray | None = None  # sorted candidate ids; None = whole vocab, uncut
        if 0 < p.top_k < nv:
            cand = self._top(p.top_k)[: p.top_k]
        if p.top_p < 1.0:
            if cand is not None:
                e = np.exp(x[cand].astype(np.float64) - m)
                cand = cand[: top_p_cut(np.cumsum(e / np.sum(e)), p.top_p)]
            else:
                e_full = self._exp_full(m, 1.0)
                z = np.sum(e_full)
                cand = self._grow(e_full, p.top_p * z, lambda c: np.cumsum(e_full[c] / z)[-1] >= p.top_p)
                cand = cand[: top_p_cut(np.cumsum(e_full[cand] / z), p.top_p)]
        if p.min_p > 0.0:
            thr = m + math.log(p.min_p)
            if cand is not None:
                keep = x[cand].astype(np.float64) >= thr
                cand = cand[: int(np.count_nonzero(keep))]
            else:
                # float64 scalar: the comparison runs in float64, as in naive_sample.
                cand = self._sorted(np.flatnonzero(x >= np.float64(thr)))
        T = float(p.temperature)
        if cand is not None:
            q = np.exp((x[cand].astype(np.float64) - m) / T)
            total = float(np.sum(q))
            self._last = ("cand", cand, q, total)
            return int(cand[pick(q, total, u)])
        # Pure temperature sampling over the whole vocabulary.
        q_full = self._exp_full(m, T)
        total = float(np.sum(q_full))
        target = u * total
        cand = self._grow(q_full, target, lambda c: np.cumsum(q_full[c])[-1] > target)
        self._last = ("full", q_full, total)
        return int(cand[pick(q_full[cand], total, u)])

    def post_sampling_probs(self, tok: int, n: int) -> TokenProbs:
        """The distribution the last :meth:`sample` / :meth:`sample_bf16` drew ``tok`` from, after the
        whole chain (llama.cpp ``post_sampling_probs``): the candidates penalties, top-k, top-p and min-p
        kept, ``exp((x - m) / T)`` renormalised over them; greedy: the arg-max alone, probability 1.

        Call it right after that sample (it reads the sampler's scratch). Returns ``tok``'s natural-log
        probability and the ``n`` most probable candidates (ties: lower id), zero probabilities left out
        (as llama-server filters them). RuntimeError if nothing was sampled yet.
        """
        last = self._last
        if last is None:
            raise RuntimeError("post_sampling_probs needs a sample first")
        if last[0] == "greedy":
            top = (TokenLogprob(last[1], 0.0),)[: max(n, 0)]
            return TokenProbs(int(tok), 0.0 if tok == last[1] else -math.inf, top, post_sampling=True)
        if last[0] == "cand":
            _, cand, q, total = last
            keep = int(np.count_nonzero(q))  # q is non-increasing: the non-zero ones are a prefix
            lp = np.log(q[: min(n, keep)]) - math.log(total)
            top = tuple(TokenLogprob(int(i), float(v)) for i, v in zip(cand[: min(n, keep)], lp, strict=True))
            hit = np.flatnonzero(cand == tok)
            mine = float(math.log(q[hit[0]]) - math.log(total)) if hit.size and q[hit[0]] > 0 else -math.inf
            return TokenProbs(int(tok), mine, top, post_sampling=True)
        _, q_full, total = last
        ids = [i for i in top_ids(self._x[: self.vocab_size], n) if q_full[i] > 0]
        top = tuple(TokenLogprob(int(i), float(math.log(q_full[i]) - math.log(total))) for i in ids)
        mine = float(math.log(q_full[tok]) - math.log(total)) if q_full[tok] > 0 else -math.inf
        return TokenProbs(int(tok), mine, top, post_sampling=True)

    # -- candidate helpers (operate on self._x after penalties/masking) --

    def _exp_full(self, m: float, T: float) -> np.ndarray:
        """``exp((float64(x) - m) / T)`` over the whole vocabulary into a reused
        float64 buffer (a fresh 1.2 MB array per token costs ~1 ms of page faults)."""
        buf = self._f64
        np.subtract(self._x[: self.vocab_size], m, out=buf, dtype=np.float64)
        if T != 1.0:
            np.divide(buf, T, out=buf)
        return np.exp(buf, out=buf)

    def _sorted(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` (ascending) ordered by descending logit, ties by lower id (``-inf`` ones last, by id).

        The ``-inf`` ids (a grammar's mask leaves most of the vocabulary there) are not sorted: in
        ascending id order after the finite ones they are where a stable sort of all puts them."""
        v = self._x[ids]
        fin = np.isfinite(v)
        if fin.all():
            return ids[np.argsort(-v, kind="stable")]
        f = ids[fin]
        return np.concatenate((f[np.argsort(-self._x[f], kind="stable")], ids[~fin]))

    def _threshold(self, k: int) -> float:
        """A value that at least ``k`` logits reach (the k-th largest column max)."""
        cm = self._colmax
        if k > cm.shape[0]:
            x = self._x[: self.vocab_size]
            return float(np.partition(x, x.shape[0] - k)[x.shape[0] - k])
        return float(np.partition(cm, cm.shape[0] - k)[cm.shape[0] - k])

    def _top(self, k: int) -> np.ndarray:
        """Sorted candidate prefix containing at least the top ``k`` ids (all of them ``-inf`` but fewer
        than ``k`` finite: a grammar's mask; then the finite ones and the first ``-inf`` ids to ``k``)."""
        x = self._x[: self.vocab_size]
        t = self._threshold(k)
        if t == -math.inf:  # fewer than k columns hold a finite logit: no need to touch the -inf ones
            fin = np.isfinite(x)
            f = np.flatnonzero(fin)
            if f.size >= k:
                return self._sorted(f)
            return np.concatenate((self._sorted(f), np.flatnonzero(~fin)[: k - f.size]))
        return self._sorted(np.flatnonzero(x >= t))

    def _grow(self, w: np.ndarray, need: float, enough: Callable[[np.ndarray], bool]) -> np.ndarray:
        """A sorted candidate prefix whose exact mass satisfies ``enough``.

        Candidates are ``{x >= t}`` (any such set is a prefix of the full
        sorted order). ``t`` falls through the k-th column max for k = 64, 256,
        1024, then ``m - d`` with ``d`` doubling. A set whose unsorted mass
        ``sum(w[x >= t])`` is below ``need`` (margin far above float64
        rounding) is skipped unsorted; a large set that has enough is first
        shrunk by bisecting ``t`` upward. The chosen set is sorted once and
        checked exactly (``enough``: the same sequential cumsum as
        :func:`naive_sample`). Falls back to the whole vocabulary.
        """
        x = self._x[: self.vocab_size]
        floor = need * (1.0 - 1e-9)
        m = float(self._colmax.max())

        def schedule() -> Iterator[float]:
            last = m
            for k in (64, 256, 1024):
                if k <= self._colmax.shape[0]:
                    last = self._threshold(k)
                    yield last
            d = max(m - last, 1.0)
            while m - d > -3.0e38:
                d *= 2.0
                yield m - d

        hi = math.inf  # a threshold known to hold too little mass
        min_finite: float | None = None
        for t in schedule():
            if t == -math.inf:  # (a grammar's mask) the same candidates by mass: the finite ones
                if min_finite is None:
                    min_finite = float(np.min(x, where=np.isfinite(x), initial=math.inf))
                t = min_finite
            if t >= hi:
                continue
            mask = x >= t
            if np.sum(w, where=mask) < floor:
                hi = t
                continue
            lo = t
            if math.isfinite(hi) and np.count_nonzero(mask) > _BISECT_ABOVE:
                for _ in range(20):
                    mid = 0.5 * (lo + hi)
                    if not lo < mid < hi:
                        break
                    mask_mid = x >= mid
                    if np.sum(w, where=mask_mid) >= floor:
                        lo, mask = mid, mask_mid
                        if np.count_nonzero(mask) <= _BISECT_ABOVE:
                            break
                    else:
                        hi = mid
            c = self._sorted(np.flatnonzero(mask))
            if enough(c):
                return c
            hi = lo
        return self._sorted(np.arange(self.vocab_size))
