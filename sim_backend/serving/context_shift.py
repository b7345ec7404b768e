"""llama-server's context shift (``--context-shift``) on the simulated device's KV.

When a generating slot's context is full (``n_past + 1 >= n_ctx``, ``n_past`` = tokens its KV holds), llama-server
keeps the first ``n_keep`` tokens (the request's ``n_keep``; -1 = the whole prompt; +1 for a BOS the model adds;
at most ``n_ctx - 4``), discards ``n_discard`` of the ``n_left = n_past - n_keep`` others (the request's
``n_discard``, 0 = half: ``n_left // 2``, clamped to ``[0, n_left - 1]``), moves the rest down
(``seq_rm(seq, n_keep, n_keep + n_discard)``; ``seq_add(seq, n_keep + n_discard, n_past, -n_discard)``), drops
the same tokens from the slot's cached tokens, marks the request ``truncated`` and goes on generating
(llama.cpp ``tools/server/server-context.cpp``, ``update_slots``). Without it, generation stops with ``limit``
at the context end and the result is ``truncated`` too (``TokenPipeline``).

The moved cells' K is re-rotated by the device (CalRT ``DoShift``, facts.md F5 C1: ``RuntimeSession.do_shift``),
priced by the cost model (``costmodel.kv_shift_us``) and booked on the simulated clock before the next step;
its µs count in the request's device ``infer`` time. The numerics do not re-rotate K, so a numeric request
runs timing-only after its first shift (``RequestRecord.numeric`` False, the reason in
``timing_only_reason``), and a request that needs the model's logits (``n_probs``, ``logit_bias``) is never
shifted: it stops at the context end as without context shift (``TokenPipeline``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sim_backend.serving.requests import RequestRecord

#: why a shifted request's tokens are no longer the model's
SHIFT_TIMING_ONLY = "context shift: the simulated numerics do not re-rotate the shifted keys"


@dataclass(frozen=True)
class ShiftPlan:
    """One context shift in tokens: ``n_keep`` kept at the start, ``n_left`` after them before the shift,
    ``n_discard`` of those dropped."""

    n_keep: int
    n_left: int
    n_discard: int


def plan_shift(n_past: int, n_prompt: int, *, n_keep: int, n_discard: int, n_ctx: int,
               add_bos: bool = False) -> ShiftPlan:
    """llama-server's shift arithmetic (module docstring) for a sequence holding ``n_past`` tokens of a request
    with ``n_prompt`` prompt tokens and parameters ``n_keep`` / ``n_discard``; ``n_ctx``: the slot's context.
    Raises ValueError for ``n_ctx < 5`` (no room to keep and shift) or ``n_past`` outside ``1..n_ctx``."""
    if n_ctx < 5:
        raise ValueError(f"context shift needs n_ctx >= 5, got {n_ctx}")
    if not 1 <= n_past <= n_ctx:
        raise ValueError(f"n_past must be in 1..{n_ctx}, got {n_past}")
    keep = n_prompt if n_keep < 0 else n_keep
    keep = min(n_ctx - 4, keep + (1 if add_bos else 0))
    left = n_past - keep
    discard = n_discard if n_discard else left // 2
    discard = min(max(discard, 0), max(0, left - 1))
    return ShiftPlan(keep, left, discard)


def n_past(r: RequestRecord) -> int:
    """Tokens ``r``'s sequence holds while it decodes: prompt and generated tokens but the pending one, less
    those context shifts discarded."""
    return len(r.prompt) + len(r.generated) - 1 - r.n_discarded


def shift_if_full(rt: Any, r: RequestRecord, n_ctx: int) -> ShiftPlan | None:
    """Shift ``r``'s context when it is full (``n_past + 1 >= n_ctx``; module docstring), before its next decode
    step feeds the pending token; None when it is not full (or nothing would be discarded). ``rt``: the runtime
    session (its ``kv`` view and ``do_shift``). Updates the request's and slot's figures: ``n_shifts``,
    ``n_discarded``, ``shift_ms`` (simulated device ms), the slot's ``cache_tokens``, ``truncated``. Raises the KV
    view's errors (``KVArgumentError``) for a sequence that cannot move."""
    assert r.slot is not None  # only a decoding request in a slot is shifted
    past = n_past(r)
    if past + 1 < n_ctx:
        return None
    plan = plan_shift(past, len(r.prompt), n_keep=r.req.n_keep, n_discard=r.req.n_discard, n_ctx=n_ctx)
    if plan.n_discard <= 0:
        return None
    seq, k, d = r.slot.seq_id, plan.n_keep, plan.n_discard
    rt.kv.seq_rm(seq, k, k + d)
    rt.kv.seq_add(seq, k + d, past, -d)
    _, dev_us, _ = rt.do_shift()
    del r.slot.cache_tokens[k:k + d]
    r.n_shifts += 1
    r.n_discarded += d
    r.shift_ms += dev_us / 1e3
    r.device["infer"] += dev_us / 1e3
    r.tokens.truncated = True
    if r.numeric:
        r.numeric = False
        r.timing_only_reason = SHIFT_TIMING_ONLY
    r.slot.cache_numeric = False  # the cells left hold K rotated for positions they no longer have
    return plan
