"""Token probabilities as llama-server reports them (``n_probs``): from one step's raw logits. The
post-sampling ones (after the whole chain) are :meth:`~sim_backend.serving.sampling.Sampler.post_sampling_probs`.
A timing-only step has no logits and so no probabilities (the engine refuses such a request: ``admission.NO_LOGITS``).
"""

from __future__ import annotations

import math

import numpy as np

from sim_backend.planes.types import TokenLogprob, TokenProbs
from sim_backend.serving.sampling_reference import default_n_valid, sanitize, top_ids

__all__ = ["logit_probs"]


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
    nv = default_n_valid(logits.shape[0]) if n_valid is None else int(n_valid)
    x = np.array(logits[:nv], dtype=np.float32)
    m = float(x.max())
    if not math.isfinite(m):  # NaN or +inf somewhere (rare): the sampler's convention
        sanitize(x)
        m = float(x.max())
        if m == -math.inf:
            raise ValueError("no finite logits to take probabilities of")
    lse = m + math.log(float(np.sum(np.exp(x - np.float32(m)), dtype=np.float64)))
    ids = top_ids(x, n)
    top = tuple(TokenLogprob(int(i), float(x[i]) - lse) for i in ids)
    mine = float(x[tok]) - lse if 0 <= tok < nv else -math.inf
    return TokenProbs(int(tok), mine, top, post_sampling=False)
