"""The serving side of a request: ``RequestHandle`` (what ``Engine.submit`` returns, a
``RequestStream`` of the planes' contract), its ``RequestState``, the observation view of a slot
(``SlotInfo``) and the ``error`` dict of a failed result.

The value types a client builds and receives (``ChatRequest``, ``SamplingParams``, ``TokenEvent``,
``DoneEvent``, ``RequestResult``, ``Timings``, ``StageTimes``) live at the seam,
``sim_backend.planes.types``; this layer builds them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from sim_backend.errors import CalError
from sim_backend.planes.eventstream import EventStream
from sim_backend.planes.types import DoneEvent, ProgressEvent, RequestResult, TokenEvent

T = TypeVar("T")


class RequestState(str, Enum):
    """Where a request is: queued, prefilling, decoding, or ended (finished | failed | cancelled)."""

    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


class RequestHandle(EventStream):
    """Client side of a request: stream events, cancel, wait for the result. Thread-safe."""

    def __init__(self, req_id: int, prompt_n: int) -> None:
        super().__init__()
        self.id = req_id
        self.prompt_n = prompt_n
        self._cancel = threading.Event()
        self.cancel_reason = ""
        self._engine_wake: Callable[[], None] = lambda: None
        self._limit_now: Callable[[], None] = lambda: None  # the engine's: its pipeline's limit_now
        self.stop_reason = ""
        self.state = RequestState.QUEUED

    def cancel(self, reason: str = "cancelled by client") -> None:
        """Cancel in any state (queued, prefilling, decoding); idempotent, returns at once.

        The engine ends the request within one device step and frees its KV.
        A request that already ended is not changed.
        """
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()
            self._engine_wake()

    def stop_generation(self, reason: str) -> None:
        """End the request at its next sampled token with ``stop_type`` limit, as its max_tokens would:
        finished, its text and KV kept (the serving face's deadline for a request without a limit of its
        own, llama-server's -1). Returns at once; a request still queued or prefilling ends after its
        first token. Idempotent; a request that already ended is not changed."""
        if not self.stop_reason:
            self.stop_reason = reason
            self._limit_now()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def cancel_event(self) -> threading.Event:
        """Set when the request is cancelled (a KV wait watches it)."""
        return self._cancel

    def emit(self, event: TokenEvent | ProgressEvent) -> None:
        """Stream one visible piece, or the prompt's progress, to the client (engine thread)."""
        self._put(event)

    def _finish(self, result: RequestResult) -> None:
        self._result = result
        self._put(DoneEvent(self.id, result))
        self._done.set()


@dataclass(frozen=True)
class SlotInfo:
    """Observation view of one slot: its request's counts, or, idle, those of the last request it served (as
    llama-server's ``/slots`` keeps the last task of an idle slot); a slot that never served one has 0 / {}.

    ``request_id``: the request in it (None when idle); ``last_request_id``: the request it serves or last
    served (None if none yet). ``cached_tokens``: the tokens its KV holds now (the prompt prefilled so far and
    the generated tokens fed back); ``reused_tokens``: the request's prompt tokens reused from the slot's cached
    prefix (llama-server's ``n_prompt_tokens_cache``), of which ``n_prefilled`` counts the reused ones too.
    ``n_shifts`` / ``n_discarded`` / ``truncated``: the request's context shifts, the tokens they discarded, and
    whether its context filled (``context_shift``).
    """

    index: int
    state: str  # idle | prefilling | decoding
    request_id: int | None
    prompt_n: int
    n_prefilled: int
    predicted_n: int
    cached_tokens: int
    numeric: bool | None = None  # the request's tokens come from the model (False: timing-only); None if none yet
    max_tokens: int = 0  # the request's n_predict (0 if none yet)
    params: dict[str, Any] = field(default_factory=dict)  # sampling parameters, llama.cpp names ({} if none yet)
    last_request_id: int | None = None
    reused_tokens: int = 0
    n_shifts: int = 0  # context shifts of the request (``context_shift``)
    n_discarded: int = 0  # tokens those shifts discarded
    truncated: bool = False  # its context filled: shifted, or stopped at the context end (llama-server's)
    n_keep: int = 0  # the request's n_keep (-1 = the whole prompt)


@dataclass(frozen=True)
class EngineView(Generic[T]):
    """``Engine.observe``'s one-instant read. ``kv``: what the caller's KV read returned; ``slots``: one
    ``SlotInfo`` per slot; ``requests``: ``MetricsRegistry.summary()``; ``tokens_generated``: ended requests'
    predicted tokens plus those in the slots now; ``kv_stats``: a copy of the KV-pressure counters
    (``parked_requests``, ``timeouts``, ``wait_wall_ms`` in host wall ms)."""

    kv: T
    slots: list[SlotInfo]
    requests: dict[str, Any]
    tokens_generated: int
    kv_stats: dict[str, float]


def error_dict(e: CalError) -> dict[str, Any]:
    """The ``error`` of a failed RequestResult: the error's own dict (llama.cpp ``code`` / ``message`` /
    ``type``, plus its numbers for KVExhausted) and ``type_name``, the Python class name."""
    d: dict[str, Any] = e.to_dict() if hasattr(e, "to_dict") else {"message": str(e)}
    d.setdefault("type", type(e).__name__)
    d["type_name"] = type(e).__name__
    return d
