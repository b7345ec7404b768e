"""The engine's records: one ``RequestRecord`` per admitted request, one ``Slot`` per KV sequence.

Plain mutable state, owned by the engine and changed under its lock; the parts of the engine
(admission, scheduler input, step runner, KV pressure policy, ledger) read and write them.
Times are simulated ms unless named host or wall.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import msgspec

from sim_backend.planes.types import ChatRequest
from sim_backend.runtime import KV_BACKOFF_START_S
from sim_backend.serving.api import RequestHandle, RequestState, SlotInfo
from sim_backend.serving.scheduler import SlotState
from sim_backend.serving.tokens import TokenPipeline


class RequestRecord:
    """Engine-side state of one request.

    ``prompt``: token ids (chat template applied); ``tokens``: its token pipeline (sampler, stop
    rules, streaming text; built by the engine for the model's tokenizer); ``n_prefilled``: prompt
    tokens whose KV is written (``cache_n`` of them reused from the slot's prefix); ``kv_*``: the KV
    pressure policy's parking state (``time.monotonic()`` seconds). Raises ValueError without
    ``max_tokens`` (``validate_request`` refuses that first).
    """

    def __init__(self, rid: int, req: ChatRequest, prompt: list[int], handle: RequestHandle, arrival_ms: float,
                 tokenize_ms: float, tokens: TokenPipeline) -> None:
        self.id = rid
        self.req = req
        if req.max_tokens is None:
            raise ValueError("max_tokens is required")
        self.max_tokens = int(req.max_tokens)
        self.prompt = prompt
        self.handle = handle
        self.arrival_ms = arrival_ms
        self.tokenize_ms = tokenize_ms  # host ms
        self.slot: Slot | None = None
        self.assigned_ms: float | None = None
        self.n_prefilled = 0
        self.cache_n = 0
        self.tokens = tokens
        self.n_streamed = 0  # generated tokens already carried by a TokenEvent
        self.pieces_ms: list[float] = []  # when each visible piece streamed
        self.ttft_recorded = False  # its TTFT sample went into the metrics (once per request)
        self.text_parts: list[str] = []
        self.prefill_start_ms: float | None = None
        self.first_token_ms: float | None = None  # first token sampled (llama.cpp t_start_generation)
        self.last_token_ms: float | None = None
        self.host = {"tokenize": tokenize_ms, "sampling": 0.0, "detokenize": 0.0, "kv_wait": 0.0, "framework": 0.0}
        self.host_booked_ms = 0.0  # host work put on the simulated clock (HostBooking), ms
        self.tokenized_ms = arrival_ms  # simulated ms the prompt was tokenised (queue time starts here)
        self.device = {"h2d": 0.0, "infer": 0.0, "d2h": 0.0}
        self.tokenize_reported = False
        self.numeric = True
        self.timing_only_reason = ""  # why not, when ``numeric`` is False (``admission.timing_only_why``)
        self.kv_epoch = -1  # KV epoch at admission (a clear since then took its cells)
        self.kv_deadline: float | None = None
        self.kv_retry_at = 0.0
        self.kv_backoff_s = KV_BACKOFF_START_S
        self.kv_wait_start = 0.0
        self.kv_wait_start_sim = 0.0
        self.kv_last_wait_us = 0.0
        self.kv_last_attempt_us = 0.0
        self.kv_parked_once = False
        self.kv_need = 0  # cells the parked step asks for: its prefill chunk (<= prefill_chunk) or 1 (decode)
        self.kv_hold = False  # to be ended for KV once its step in flight is done: start no new step
        # context shifts (``context_shift``): how many, tokens they discarded, simulated device ms they took
        self.n_shifts = 0
        self.n_discarded = 0
        self.shift_ms = 0.0

    @property
    def state(self) -> RequestState:
        return self.handle.state

    @property
    def generated(self) -> list[int]:
        """Token ids sampled so far (EOS included)."""
        return self.tokens.generated

    @property
    def pending_token(self) -> int | None:
        """The last sampled token, not yet fed to the model (None before the first)."""
        return self.tokens.pending_token

    @property
    def ended(self) -> bool:
        """The request has its result (finished, failed or cancelled)."""
        return self.handle.done

    def total_cells(self, n_ctx: int) -> int:
        """KV cells this request holds when it ends at ``max_tokens`` or the context end (the last token is not fed)."""
        return min(len(self.prompt) + self.max_tokens - 1, n_ctx)


class Slot:
    """One serving slot: KV sequence ``seq_id``, the request in it, and the prefix its cells hold.

    ``cache_tokens``: tokens whose KV the sequence holds (prefix reuse); ``cache_numeric``: those
    cells were computed by the numerics (a timing-only request's cells hold no values);
    ``cache_epoch``: the KV epoch they were written in; ``last_used``: simulated ms; ``action``: a
    slot action in progress (save / restore / erase, ``SlotActionRunner``): while set, nothing
    assigns the slot or evicts its cells.
    """

    def __init__(self, idx: int, seq_id: int | None = None) -> None:
        self.idx = idx
        self.seq_id = idx if seq_id is None else seq_id
        self.req: RequestRecord | None = None
        self.cache_tokens: list[int] = []
        self.cache_epoch = 0
        self.cache_numeric = False
        self.last_used = 0.0
        self.action: str | None = None
        #: the view of the last request it served, as it ended (llama-server keeps an idle slot's last task)
        self.last: SlotInfo | None = None

    @property
    def free(self) -> bool:
        """No request in it and no slot action on it: a request may take it, its cached cells may be evicted."""
        return self.req is None and self.action is None


def slot_info(s: Slot) -> SlotInfo:
    """The observation view of slot ``s``: its request's counts and sampling parameters (llama.cpp
    names); idle, the last request's (``Slot.last``; none yet: zeros) with the size of its cached prefix now."""
    r = s.req
    if r is None:
        last = s.last
        if last is None:
            return SlotInfo(s.idx, "idle", None, 0, 0, 0, len(s.cache_tokens), None, 0, {})
        return dataclasses.replace(last, state="idle", request_id=None, cached_tokens=len(s.cache_tokens))
    return SlotInfo(s.idx, r.state.value, r.id, len(r.prompt), r.n_prefilled, len(r.generated), len(s.cache_tokens),
                    r.numeric, r.max_tokens, msgspec.structs.asdict(r.req.sampling), r.id, r.cache_n,
                    r.n_shifts, r.n_discarded, r.tokens.truncated, r.req.n_keep)


def slot_states(slots: Sequence[Slot], busy: set[int], now: float) -> list[SlotState]:
    """The scheduler's view of ``slots``: a slot is ready if its request is not in flight (``id()`` in
    ``busy``), not cancelled, not held for ending and not parked on KV before its retry time
    (``now``: ``time.monotonic()``)."""
    out = []
    for s in slots:
        r = s.req
        if r is None:
            out.append(SlotState(s.idx, "idle", False))
            continue
        ready = id(r) not in busy and not r.handle.cancelled and not r.kv_hold and r.kv_retry_at <= now
        out.append(SlotState(s.idx, r.state.value, ready, len(r.prompt) - r.n_prefilled))
    return out
