"""CPU token sampling over the full logits vector.

facts.md F1: every decode step returns 151936 BF16 logits (303,872 B D2H) that
the host converts to FP32 and samples on the CPU; F6 lists the production
integration's "full FP32 temp copy of the logits" as a latency defect. This
module is that host path, made fast: BF16 -> FP32 by a bit shift into a
preallocated buffer, and a sampler that never sorts the whole vocabulary.

Sampler chain (llama.cpp order): penalties -> top-k -> top-p -> min-p ->
temperature -> draw. Top-p and min-p see temperature-1 probabilities, as in
llama.cpp, because temperature is applied last.

Exact draw convention (shared by :class:`Sampler` and :func:`naive_sample`, so
the two pick identical tokens):

* ``x``: FP32 logits after penalties; ids ``>= n_valid`` (tokenizer padding),
  ids a grammar does not allow (``allowed`` False: constrained decoding) and
  NaN are ``-inf``; if any ``+inf`` exists, those ids get 0 and all others
  ``-inf``. ``m = max(x)``. Candidate order: descending logit, ties by lower id.
* Greedy (``temperature == 0`` or ``top_p < 1e-6``): ``argmax(x)`` (lowest id
  on ties), no random draw.
* Otherwise one ``u = rng.random()`` (float64 in [0, 1)) is drawn first.
* top-k (``0 < top_k < n_valid``): keep the first ``top_k`` candidates.
* top-p (``top_p < 1``): ``e = exp(float64(x) - m)``; ``Z = np.sum(e)`` over the
  full vector in id order if nothing was cut yet, else over the kept
  candidates in candidate order; keep up to and including the first index
  where ``cumsum(e / Z) >= top_p``.
* min-p (``min_p > 0``): keep candidates with ``float64(x) >= m + log(min_p)``.
* temperature: ``q = exp((float64(x) - m) / T)``; ``total = np.sum(q)`` with the
  same id-order/candidate-order rule; pick the first candidate whose
  ``cumsum(q) > u * total`` (clipped to the last candidate).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from sim_backend.model import bf16 as _bf16
from sim_backend.model.vocab import N_TOKENS, VOCAB_SIZE
from sim_backend.planes.types import SamplingParams, TokenLogprob, TokenProbs

__all__ = [
    "VOCAB_SIZE",
    "N_VALID",
    "Sampler",
    "naive_sample",
    "bf16_to_f32",
    "f32_to_bf16",
    "distribution_probs",
    "logit_probs",
    "uniform_probs",
]

#: Real tokenizer ids (151643 BPE + 26 specials); 151669..151935 are padding rows (model.vocab).
N_VALID = N_TOKENS

# Logits are grouped as a (64, n/64) matrix; the k-th largest of the column
# maxima is a lower bound that at least k logits reach (one per column).
_GROUP_ROWS = 64
# Candidate sets larger than this are shrunk by bisection before sorting.
_BISECT_ABOVE = 2048


# --- BF16 <-> FP32 ----------------------------------------------------------------
# One home: sim_backend.model.bf16. Re-exported here, where the host path has always imported them from.

bf16_to_f32 = _bf16.bf16_to_f32
f32_to_bf16 = _bf16.f32_to_bf16


# --- shared steps (identical arithmetic in Sampler and naive_sample) ---------------


def _default_n_valid(vocab: int) -> int:
    return N_VALID if vocab == VOCAB_SIZE else vocab


def _apply_penalties(x: np.ndarray, recent: Sequence[int], p: SamplingParams) -> None:
    """In place on FP32 ``x``: llama.cpp repeat penalty then OpenAI presence/frequency,
    over the last ``repeat_last_n`` ids of ``recent``; touches only those ids."""
    if not p.has_penalties or len(recent) == 0:
        return
    if not isinstance(recent, (list, tuple, np.ndarray)):
        recent = list(recent)  # e.g. a deque: no slicing
    window = recent if p.repeat_last_n == -1 else recent[-p.repeat_last_n :]
    ids = np.asarray(window, dtype=np.int64)
    if ids.size == 0:
        return
    if ids.min() < 0 or ids.max() >= x.shape[0]:
        raise ValueError(f"recent token ids must be in [0, {x.shape[0]})")
    uniq, counts = np.unique(ids, return_counts=True)
    v = x[uniq].astype(np.float64)
    rp = float(p.repeat_penalty)
    if rp != 1.0:
        # llama.cpp: shrink positive logits, push negative ones further down.
        v = np.where(v <= 0, v * rp, v / rp)
    v -= counts * float(p.frequency_penalty) + float(p.presence_penalty)
    x[uniq] = v.astype(np.float32)


def _apply_mask(x: np.ndarray, allowed: np.ndarray) -> None:
    """In place: ``x[~allowed] = -inf`` (``allowed``: bool, x's shape). Few allowed (a grammar's usual
    mask): the allowed values are put back over an all ``-inf`` fill; most allowed (inside a string):
    the few banned ids are set. Either is ~2x cheaper than a masked store over the whole vector."""
    n_allowed = int(np.count_nonzero(allowed))
    if n_allowed <= x.shape[0] // 2:
        ids = np.flatnonzero(allowed)
        keep = x[ids]
        x.fill(np.float32(-np.inf))
        x[ids] = keep
    else:
        x[np.flatnonzero(~allowed)] = np.float32(-np.inf)


def _sanitize(x: np.ndarray) -> None:
    """In place: NaN -> -inf; if any +inf, those -> 0 and everything else -> -inf."""
    np.nan_to_num(x, copy=False, nan=-np.inf, posinf=np.inf, neginf=-np.inf)
    pos = np.isposinf(x)
    if pos.any():
        x[...] = np.where(pos, np.float32(0), np.float32(-np.inf))


def _pick(q: np.ndarray, total: float, u: float) -> int:
    """Index of the first ``cumsum(q) > u * total`` (clipped)."""
    cs = np.cumsum(q)
    i = int(np.searchsorted(cs, u * total, side="right"))
    # u * total can round up to total: clip to the last candidate with q > 0
    # (q is non-increasing, so those form a prefix) so a zero-probability id
    # (padding, -inf) is never returned.
    return min(i, int(np.count_nonzero(q)) - 1)


def _top_p_cut(cs: np.ndarray, top_p: float) -> int:
    """Number kept: up to and including the first index with cumsum >= top_p."""
    return min(int(np.searchsorted(cs, top_p, side="left")) + 1, int(cs.shape[0]))


# --- reference implementation -------------------------------------------------------


def naive_sample(
    logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    recent: Sequence[int] = (),
    *,
    n_valid: int | None = None,
    allowed: np.ndarray | None = None,
) -> int:
    """Straightforward reference sampler: full FP32 copy, full softmax, full
    ``argsort`` of the vocabulary and ``cumsum`` (the production shape, F6).

    Args:
        logits: ``float32`` (vocab,) — not modified.
        params: validated :class:`SamplingParams` (``seed`` is ignored; ``rng`` is used).
        rng: generator; one ``rng.random()`` per non-greedy call.
        recent: previously generated/prompt ids for the penalties.
        n_valid: ids ``>= n_valid`` are never chosen (default 151669 for a
            151936 vocabulary, i.e. tokenizer padding).
        allowed: ``bool`` (vocab,) or None: ids where it is False are never chosen (a grammar's mask).

    Returns:
        The chosen token id (int). Same convention as :class:`Sampler`
        (module docstring), so the two agree token for token.
    """
    x = np.array(logits, dtype=np.float32)  # the "full FP32 temp copy"
    n = x.shape[0]
    nv = _default_n_valid(n) if n_valid is None else n_valid
    _apply_penalties(x, recent, params)
    x[nv:] = -np.inf
    if allowed is not None:
        x[~allowed] = -np.inf
    m = float(x.max())
    if not math.isfinite(m):
        _sanitize(x)
        m = float(x.max())
        if m == -math.inf:
            raise ValueError("no finite logits to sample from")
    if params.is_greedy:
        return int(np.argmax(x))
    u = rng.random()
    x64 = x.astype(np.float64)
    order = np.argsort(-x, kind="stable")  # descending, ties by lower id
    cut = False
    if 0 < params.top_k < nv:
        order = order[: params.top_k]
        cut = True
    if params.top_p < 1.0:
        if cut:
            e = np.exp(x64[order] - m)
            p = e / np.sum(e)
        else:
            e = np.exp(x64 - m)
            p = e[order] / np.sum(e)
        order = order[: _top_p_cut(np.cumsum(p), params.top_p)]
        cut = True
    if params.min_p > 0.0:
        keep = x64[order] >= m + math.log(params.min_p)
        order = order[: int(np.count_nonzero(keep))]
        cut = True
    T = float(params.temperature)
    if cut:
        q = np.exp((x64[order] - m) / T)
        total = np.sum(q)
    else:
        qf = np.exp((x64 - m) / T)
        total = np.sum(qf)
        q = qf[order]
    return int(order[_pick(q, total, u)])


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

    def __init__(self, params: SamplingParams, vocab_size: int = VOCAB_SIZE, *, n_valid: int | None = None) -> None:
        params.validate(vocab_size)
        self.params = params
        self.vocab_size = vocab_size
        self.n_valid = _default_n_valid(vocab_size) if n_valid is None else int(n_valid)
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

    def _sample_scratch(self, recent: Sequence[int], allowed: np.ndarray | None = None) -> int:
        """The sampler chain over the logits already in ``self._x[:vocab_size]`` (modified in place)."""
        p = self.params
        n, nv = self.vocab_size, self.n_valid
        x = self._x[:n]
        _apply_penalties(x, recent, p)
        x[nv:] = -np.inf
        if allowed is not None:
            if allowed.shape != (n,) or allowed.dtype != np.bool_:
                raise ValueError(f"allowed must be a bool array of shape ({n},)")
            _apply_mask(x, allowed)
        np.max(self._grid, axis=0, out=self._colmax)
        m = float(self._colmax.max())
        if not math.isfinite(m):
            _sanitize(x)
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
                cand = cand[: _top_p_cut(np.cumsum(e / np.sum(e)), p.top_p)]
            else:
                e_full = self._exp_full(m, 1.0)
                z = np.sum(e_full)
                cand = self._grow(e_full, p.top_p * z, lambda c: np.cumsum(e_full[c] / z)[-1] >= p.top_p)
                cand = cand[: _top_p_cut(np.cumsum(e_full[cand] / z), p.top_p)]
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
            return int(cand[_pick(q, total, u)])
        # Pure temperature sampling over the whole vocabulary.
        q_full = self._exp_full(m, T)
        total = float(np.sum(q_full))
        target = u * total
        cand = self._grow(q_full, target, lambda c: np.cumsum(q_full[c])[-1] > target)
        self._last = ("full", q_full, total)
        return int(cand[_pick(q_full[cand], total, u)])

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
        ids = [i for i in _top_ids(self._x[: self.vocab_size], n) if q_full[i] > 0]
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


# --- token probabilities ---------------------------------------------------------------


def _top_ids(x: np.ndarray, n: int) -> np.ndarray:
    """The ``n`` ids of largest ``x`` above ``-inf``, descending, ties by lower id (fewer if fewer are finite).

    Never sorts the whole vector: a partition finds the n-th value, everything reaching it (ties
    included) is sorted, the first ``n`` are kept."""
    k = min(max(n, 0), x.shape[0])
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    thr = np.partition(x, x.shape[0] - k)[x.shape[0] - k]
    sel = np.flatnonzero(x >= thr) if thr > -np.inf else np.flatnonzero(x > -np.inf)
    sel = sel[np.lexsort((sel, -x[sel]))]  # descending value, then ascending id
    return sel[:k]


def logit_probs(logits: np.ndarray, tok: int, n: int, *, n_valid: int | None = None) -> TokenProbs:
    """Probabilities from one step's raw logits, as llama-server gives them by default: the softmax of
    the logits (no penalty, no temperature, no top-k/top-p/min-p), ``tok``'s natural-log probability and
    the ``n`` most probable ids (descending, ties by lower id).

    Args:
        logits: ``float32`` (vocab,), the step's logits (not modified).
        tok: the token sampled at this step.
        n: how many top ids to list (``n_probs``).
        n_valid: ids ``>= n_valid`` (tokenizer padding, never sampled) are left out of the softmax
            (default as :class:`Sampler`). NaN counts as ``-inf``; if any logit is ``+inf``, those share
            the probability equally (the sampler's convention).

    The log-sum-exp sums FP32 ``exp`` terms in float64 (FP32 ``exp`` is vectorised; float64's ran ~15x
    slower here), so a logprob is good to ~1e-6. Returns a ``TokenProbs`` (``post_sampling`` False);
    ``tok``'s logprob is ``-inf`` if it has no probability. ValueError if no logit is finite.
    """
    nv = _default_n_valid(logits.shape[0]) if n_valid is None else int(n_valid)
    x = np.array(logits[:nv], dtype=np.float32)
    m = float(x.max())
    if not math.isfinite(m):  # NaN or +inf somewhere (rare): the sampler's convention
        _sanitize(x)
        m = float(x.max())
        if m == -math.inf:
            raise ValueError("no finite logits to take probabilities of")
    lse = m + math.log(float(np.sum(np.exp(x - np.float32(m)), dtype=np.float64)))
    ids = _top_ids(x, n)
    top = tuple(TokenLogprob(int(i), float(x[i]) - lse) for i in ids)
    mine = float(x[tok]) - lse if 0 <= tok < nv else -math.inf
    return TokenProbs(int(tok), mine, top, post_sampling=False)


def distribution_probs(tok: int, n: int, ids: np.ndarray, p: np.ndarray, *, post_sampling: bool = False) -> TokenProbs:
    """Probabilities of a timing-only step drawn from a known distribution (``ids`` with probabilities
    ``p``: a grammar's stand-in, ``GrammarMatcher.stand_in_distribution``): ``tok``'s and the ``n`` most
    probable ids (descending, ties by lower id); ``from_logits`` False."""
    order = np.lexsort((ids, -p))[: max(n, 0)]
    hit = np.flatnonzero(ids == tok)
    mine = math.log(float(p[hit[0]])) if hit.size and p[hit[0]] > 0 else -math.inf
    top = tuple(TokenLogprob(int(ids[i]), math.log(float(p[i]))) for i in order if p[i] > 0)
    return TokenProbs(int(tok), mine, top, post_sampling=post_sampling, from_logits=False)


def uniform_probs(tok: int, n: int, lo: int, hi: int, *, post_sampling: bool = False) -> TokenProbs:
    """Probabilities of a timing-only step (no logits): the seeded generator draws uniformly from the
    ids ``[lo, hi)``, so each has probability ``1 / (hi - lo)``. All tie: ``top`` lists ``tok`` first, then
    the lowest other ids, ``n`` in all (at most ``hi - lo``). ValueError for an empty range."""
    if hi <= lo:
        raise ValueError(f"empty id range [{lo}, {hi})")
    lp = -math.log(hi - lo)
    k = min(max(n, 0), hi - lo)
    ids = [tok] if k and lo <= tok < hi else []
    i = lo
    while len(ids) < k:
        if i != tok:
            ids.append(i)
        i += 1
    return TokenProbs(int(tok), lp if lo <= tok < hi else -math.inf, tuple(TokenLogprob(j, lp) for j in ids),
                      post_sampling=post_sampling, from_logits=False)


# --- benchmark -----------------------------------------------------------------------
