"""Admission: the bounded FIFO queue in front of the slots, and the choice of a slot.

A request is validated and tokenised by the engine's ``submit`` (typed errors, nothing allocated on
error); it waits in a FIFO queue of at most ``queue_limit`` requests beyond the free slots (more ->
``UnavailableError`` at once) and takes the first free slot as llama-server chooses it: the one
sharing the longest cached prefix with its prompt, then the least recently used. A request that
names a slot (``id_slot``) waits for that slot, keeping its place in the queue.

A reused prefix counts toward the numerics limit only if its cells hold values (a timing-only
request's cells hold none), and such a prefix is not reused for a request that can run with
numerics without it; see ``choose_slot``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from sim_backend.errors import ExceedContextSizeError, InvalidRequestError, UnavailableError
from sim_backend.planes.types import (
    CONTINUES_TIMING_ONLY,
    NUMERICS_DOWN,
    NUMERICS_NOT_READY,
    NUMERICS_OFF,
    OVER_NUMERIC_LIMIT,
    ChatRequest,
)
from sim_backend.runtime import KVView, RuntimeSession
from sim_backend.serving.api import RequestState
from sim_backend.serving.requests import RequestRecord, Slot


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    idx = np.flatnonzero(x)
    return int(idx[0]) if idx.size else n


def check_prompt(prompt_n: int, id_slot: int, *, n_ctx: int, n_slots: int, kv_cells: int) -> None:
    """Refuse a tokenised prompt that cannot run: ExceedContextSizeError for ``prompt_n >= n_ctx``
    (llama.cpp: no room for one token) or more tokens than the KV pool holds; InvalidRequestError
    for an ``id_slot`` that does not exist."""
    if prompt_n >= n_ctx:
        raise ExceedContextSizeError(prompt_n, n_ctx)
    if id_slot >= n_slots:
        raise InvalidRequestError(f"id_slot {id_slot} does not exist (slots 0..{n_slots - 1})", param="id_slot")
    if prompt_n > kv_cells:  # a board built with a KV pool smaller than the context
        raise ExceedContextSizeError(prompt_n, kv_cells, f"the prompt has {prompt_n} tokens but the KV "
                                     f"cache holds {kv_cells} tokens in all (context {n_ctx})")


def numerics_now(rt: RuntimeSession) -> tuple[bool, str]:
    """(numeric steps run for requests admitted now, why not): the device runs timing-only (``NUMERICS_OFF``), or
    its numerics worker is not ready: still starting (``NUMERICS_NOT_READY``) or failed its start
    (``NUMERICS_DOWN``). A worker that died after its start stays ready: its requests fail, typed."""
    if not rt.numerics:
        return False, NUMERICS_OFF
    if getattr(rt, "numerics_ready", True):
        return True, ""
    return False, NUMERICS_DOWN if getattr(rt, "numerics_broken", False) else NUMERICS_NOT_READY


def timing_only_why(*, numerics: bool, numerics_off_why: str, new_tokens: int, prompt_n: int,
                    numerics_max_prompt: int) -> str:
    """Why ``choose_slot`` admitted a request timing-only: the device computes no numerics now
    (``numerics_off_why``: ``NUMERICS_OFF``, ``NUMERICS_NOT_READY`` or ``NUMERICS_DOWN``), more new prompt
    tokens than the numeric limit, or else a reused prefix that a timing-only turn left (it holds no values:
    ``CONTINUES_TIMING_ONLY``, which ``choose_slot`` reuses only for a prompt of ``prompt_n`` tokens over the
    limit as a whole, so sent afresh it would run timing-only too)."""
    if not numerics:
        return numerics_off_why
    if new_tokens > numerics_max_prompt:
        return OVER_NUMERIC_LIMIT.format(new_tokens=new_tokens, limit=numerics_max_prompt)
    return CONTINUES_TIMING_ONLY.format(prompt_n=prompt_n, limit=numerics_max_prompt)


def choose_slot(free: Sequence[Slot], prompt: Sequence[int], *, cache_prompt: bool, numerics: bool,
                numerics_max_prompt: int) -> tuple[Slot, int, bool]:
    """The slot a request takes among ``free`` (non-empty): (slot, prefix tokens reused, runs with numerics).

    llama.cpp: the idle slot sharing the longest prefix with the prompt, then the least recently
    used. At least one prompt token is left to prefill (its logits give the first token); with
    ``cache_prompt`` False nothing is reused. The request runs with numerics if the device computes
    them (``numerics``) and the tokens it must prefill beyond a reused prefix that holds values are at
    most ``numerics_max_prompt``. A prefix that holds no values (left by a timing-only request) is not
    reused for a request that can run with numerics without it: it would make that request timing-only
    too. Slots where the request runs with numerics are preferred.
    """
    fresh = numerics and len(prompt) <= numerics_max_prompt  # numeric with nothing reused

    def plan(s: Slot) -> tuple[bool, int, int, float]:
        raw = common_prefix(s.cache_tokens, prompt)
        usable = raw if s.cache_numeric or not fresh else 0
        n = max(0, min(usable, len(prompt) - 1)) if cache_prompt else 0
        numeric = numerics and (n == 0 or s.cache_numeric) and len(prompt) - n <= numerics_max_prompt
        return numeric, usable, n, -s.last_used

    plans = [plan(s) for s in free]
    i = max(range(len(free)), key=lambda k: (plans[k][0], plans[k][1], plans[k][3]))
    return free[i], plans[i][2], plans[i][0]


#: the refusal of a request asking for token probabilities that would run timing-only (a template: ``why``)
NO_LOGITS = ("token probabilities ('n_probs' / 'logprobs') need the model's logits, and this request would run "
             "timing-only: {why}. Its tokens would be seeded draws with no logits, so there are no probabilities "
             "to report; send it without 'n_probs' / 'logprobs', or where the numerics run")
#: the refusal of a request with a ``logit_bias`` that would run timing-only (a template: ``why``)
NO_LOGITS_BIAS = ("'logit_bias' is added to the model's logits, and this request would run timing-only: {why}. "
                  "Its tokens would be seeded draws with no logits to bias, so the bias could not be honoured; "
                  "send it without 'logit_bias', or where the numerics run")


def needs_logits(req: ChatRequest) -> bool:
    """Whether a request needs the model's logits (token probabilities, a logit bias): such a request is refused
    rather than run timing-only (``logits_refusal``)."""
    return bool(req.n_probs or req.logit_bias)


def logits_refusal(req: ChatRequest, why: str) -> InvalidRequestError:
    """The refusal of a request that needs logits and would run timing-only for reason ``why``: ``NO_LOGITS``
    for token probabilities (said first), else ``NO_LOGITS_BIAS``, naming the field."""
    if req.n_probs:
        return InvalidRequestError(NO_LOGITS.format(why=why), param="n_probs")
    return InvalidRequestError(NO_LOGITS_BIAS.format(why=why), param="logit_bias")


def timing_only_foreseen(slots: Sequence[Slot], prompt: Sequence[int], *, cache_prompt: bool, numerics: bool,
                         numerics_off_why: str, numerics_max_prompt: int) -> str:
    """Why a request of ``prompt`` would run timing-only whichever slot it takes ("" if one slot lets it run
    with numerics): ``choose_slot`` over every slot, busy ones included (their cached prefix may be free by
    the time the request is admitted). A request that can run with numerics is still admitted by
    ``choose_slot`` at its turn; ``Admission.assign`` may then find it timing-only after all (a cache it counted
    on was replaced meanwhile), and the engine ends it with ``NO_LOGITS`` then."""
    if not slots:
        return numerics_off_why
    _, n_common, numeric = choose_slot(slots, prompt, cache_prompt=cache_prompt, numerics=numerics,
                                       numerics_max_prompt=numerics_max_prompt)
    if numeric:
        return ""
    return timing_only_why(numerics=numerics, numerics_off_why=numerics_off_why, new_tokens=len(prompt) - n_common,
                           prompt_n=len(prompt), numerics_max_prompt=numerics_max_prompt)


def foreseen_logits_refusal(rt: RuntimeSession, slots: Sequence[Slot], prompt: Sequence[int], req: ChatRequest, *,
                            numerics_max_prompt: int) -> InvalidRequestError | None:
    """The refusal of a request that needs logits (``needs_logits``: ``n_probs``, ``logit_bias``) but would run
    timing-only whichever slot it takes (``timing_only_foreseen``); None when it needs none or one slot can
    give them. Read at submit, under the engine lock."""
    if not needs_logits(req):
        return None
    numerics, why_not = numerics_now(rt)
    why = timing_only_foreseen(slots, prompt, cache_prompt=req.cache_prompt, numerics=numerics,
                               numerics_off_why=why_not, numerics_max_prompt=numerics_max_prompt)
    return logits_refusal(req, why) if why else None


class Admission:
    """The queue and the slot assignment (module docstring). State only; the engine holds the lock.

    Args:
        queue_limit: requests allowed to wait beyond the free slots (>= 0).
    """

    def __init__(self, queue_limit: int) -> None:
        if queue_limit < 0:
            raise ValueError("queue_limit must be >= 0")
        self.queue_limit = queue_limit
        self.queue: deque[RequestRecord] = deque()
        self.admitting = True
        self.refuse_reason = ""

    def refusal(self, stopped: bool) -> str | None:
        """Why a request would be refused now (engine shut down, or maintenance paused admission), or None."""
        if stopped:
            return "engine is shut down"
        if not self.admitting:
            return self.refuse_reason or "not admitting requests"
        return None

    def check_room(self, free_slots: int) -> None:
        """UnavailableError if ``queue_limit`` requests already wait beyond the ``free_slots``."""
        if len(self.queue) >= self.queue_limit + free_slots:
            raise UnavailableError(f"server busy: {len(self.queue)} requests queued (limit {self.queue_limit})")

    def forget(self, r: RequestRecord) -> None:
        """``r`` ended while queued: it leaves the queue."""
        if r in self.queue:
            self.queue.remove(r)

    def assign(self, slots: Sequence[Slot], kv: KVView, now_ms: Callable[[], float], *, numerics: bool,
               numerics_max_prompt: int, on_assigned: Callable[[Slot], None],
               numerics_off_why: str = NUMERICS_OFF) -> None:
        """Give queued requests free slots, in queue order (``id_slot`` requests wait for theirs).

        The slot's sequence keeps the reused prefix (``seq_rm`` of the rest) or is freed; whether the
        request runs with numerics is ``choose_slot``'s (otherwise timing-only, and the request records why:
        ``timing_only_why``; ``numerics_off_why`` is the reason when ``numerics`` is False).
        ``now_ms``: the simulated clock (ms); ``on_assigned``: called for each slot given a request.
        """
        waiting: deque[RequestRecord] = deque()  # asked for a busy slot (id_slot): keep their place in the queue
        while self.queue:
            free = [s for s in slots if s.free]
            if not free:
                break
            r = self.queue.popleft()
            if r.req.id_slot >= 0:
                free = [s for s in free if s.idx == r.req.id_slot]
                if not free:
                    waiting.append(r)
                    continue
            best, n_common, r.numeric = choose_slot(free, r.prompt, cache_prompt=r.req.cache_prompt,
                                                    numerics=numerics, numerics_max_prompt=numerics_max_prompt)
            if n_common <= 0:
                kv.free(best.seq_id)
            else:
                kv.seq_rm(best.seq_id, n_common, -1)
            r.timing_only_reason = "" if r.numeric else timing_only_why(
                numerics=numerics, numerics_off_why=numerics_off_why, new_tokens=len(r.prompt) - n_common,
                prompt_n=len(r.prompt), numerics_max_prompt=numerics_max_prompt)
            best.cache_tokens = r.prompt[:n_common]
            best.req = r
            r.slot = best
            r.cache_n = r.n_prefilled = n_common
            r.assigned_ms = now_ms()
            r.kv_epoch = kv.epoch
            r.handle.state = RequestState.PREFILLING
            best.cache_numeric = r.numeric
            on_assigned(best)
        self.queue.extendleft(reversed(waiting))

    @staticmethod
    def drop_stale_caches(slots: Sequence[Slot], epoch: int) -> None:
        """Forget prefix caches whose cells a KV clear (reset, ClearAllDevMem, Clear KV) removed."""
        for s in slots:
            if s.cache_epoch != epoch:
                if s.req is None:
                    s.cache_tokens = []
                s.cache_epoch = epoch
