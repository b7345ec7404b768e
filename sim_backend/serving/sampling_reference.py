"""The sampler chain's exact arithmetic, shared by :class:`~sim_backend.serving.sampling.Sampler` and
the reference :func:`naive_sample` (so the two pick identical tokens), and the reference itself.

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
from collections.abc import Sequence

import numpy as np

from sim_backend.model.vocab import N_TOKENS, VOCAB_SIZE
from sim_backend.planes.types import SamplingParams

__all__ = ["N_VALID", "apply_mask", "apply_penalties", "default_n_valid", "naive_sample", "pick", "sanitize",
           "top_ids", "top_p_cut"]

#: Real tokenizer ids (151643 BPE + 26 specials); 151669..151935 are padding rows (model.vocab).
N_VALID = N_TOKENS


# --- shared steps (identical arithmetic in Sampler and naive_sample) ---------------


def default_n_valid(vocab: int) -> int:
    """Ids a sampler may choose for a ``vocab``-wide logits vector: 151669 for Qwen3's 151936 (the
    padding rows never), every id of any other vocabulary."""
    return N_VALID if vocab == VOCAB_SIZE else vocab


def apply_penalties(x: np.ndarray, recent: Sequence[int], p: SamplingParams) -> None:
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


def apply_mask(x: np.ndarray, allowed: np.ndarray) -> None:
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


def sanitize(x: np.ndarray) -> None:
    """In place: NaN -> -inf; if any +inf, those -> 0 and everything else -> -inf."""
    np.nan_to_num(x, copy=False, nan=-np.inf, posinf=np.inf, neginf=-np.inf)
    pos = np.isposinf(x)
    if pos.any():
        x[...] = np.where(pos, np.float32(0), np.float32(-np.inf))


def pick(q: np.ndarray, total: float, u: float) -> int:
    """Index of the first ``cumsum(q) > u * total`` (clipped)."""
    cs = np.cumsum(q)
    i = int(np.searchsorted(cs, u * total, side="right"))
    # u * total can round up to total: clip to the last candidate with q > 0
    # (q is non-increasing, so those form a prefix) so a zero-probability id
    # (padding, -inf) is never returned.
    return min(i, int(np.count_nonzero(q)) - 1)


def top_p_cut(cs: np.ndarray, top_p: float) -> int:
    """Number kept: up to and including the first index with cumsum >= top_p."""
    return min(int(np.searchsorted(cs, top_p, side="left")) + 1, int(cs.shape[0]))


def top_ids(x: np.ndarray, n: int) -> np.ndarray:
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
    nv = default_n_valid(n) if n_valid is None else n_valid
    apply_penalties(x, recent, params)
    x[nv:] = -np.inf
    if allowed is not None:
        x[~allowed] = -np.inf
    m = float(x.max())
    if not math.isfinite(m):
        sanitize(x)
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
        order = order[: top_p_cut(np.cumsum(p), params.top_p)]
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
    return int(order[pick(q, total, u)])
