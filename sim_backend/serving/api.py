"""The serving API's vocabulary: what clients build (ChatRequest, SamplingParams) and receive
(TokenEvent, DoneEvent, RequestResult with llama.cpp-style Timings) and the handle they hold.

Times in Timings and events are SIMULATED device ms; ``host_ms`` parts are measured host CPU ms.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from sim_backend.errors import CalError, InvalidRequestError
from sim_backend.model.vocab import VOCAB_SIZE
from sim_backend.serving.sampling import SamplingParams

STOP_TYPES = ("eos", "limit", "word", "none")
ROLES = ("system", "user", "assistant")
#: Per-step stage names (facts.md F8). Device stages are simulated; host stages are measured.

STAGES = ("tokenize", "h2d", "infer", "d2h", "sampling", "detokenize", "kv_wait", "framework")


@dataclass(frozen=True)
class ChatRequest:
    """One chat completion request.

    messages: sequence of {"role": system|user|assistant, "content": str};
    the last one's content must not be blank. max_tokens: generated tokens at
    most, an int > 0 (required). stop: stop strings (each non-empty).
    sampling: :class:`SamplingParams`. enable_thinking: Qwen3 thinking mode.
    prompt_tokens: a raw prompt (token ids, no chat template; llama.cpp ``/completion``).
    id_slot / cache_prompt: llama.cpp's slot choice and prefix reuse.
    """

    messages: tuple[dict, ...]
    max_tokens: int | None = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    enable_thinking: bool = False
    client: str = "api"
    #: a raw prompt as token ids (llama.cpp ``/completion``): no chat template; ``messages`` may be empty
    prompt_tokens: tuple[int, ...] | None = None
    #: the slot to run in (llama.cpp ``id_slot``), -1 = any; a busy slot makes the request wait for it
    id_slot: int = -1
    #: reuse the KV of a common prefix left in a slot (llama.cpp ``cache_prompt``)
    cache_prompt: bool = True

    @staticmethod
    def from_prompt(prompt: str, **kw: Any) -> ChatRequest:
        return ChatRequest(messages=({"role": "user", "content": prompt},), **kw)

    @staticmethod
    def from_dict(body: Mapping[str, Any]) -> ChatRequest:
        """Build from a llama.cpp/OpenAI-style JSON body; raises InvalidRequestError.

        ``messages`` (or ``prompt``) and ``max_tokens`` (or ``n_predict``) are
        required; sampling keys use llama.cpp names (``temperature``,
        ``top_k``, ``top_p``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``,
        ``presence_penalty``, ``frequency_penalty``, ``seed``); ``stop`` is a
        string or a list of strings. Values are checked by ``validate_request``
        (called by ``Engine.submit``), not here.
        """
        if not isinstance(body, Mapping):
            raise InvalidRequestError("request body must be a JSON object")
        if "messages" in body:
            msgs = body["messages"]
            if not isinstance(msgs, (list, tuple)):
                raise InvalidRequestError("messages must be a list", param="messages")
            messages = tuple(msgs)
        elif "prompt" in body:
            messages = ({"role": "user", "content": body["prompt"]},)
        else:
            raise InvalidRequestError("'messages' (or 'prompt') is required", param="messages")
        max_tokens = body.get("max_tokens", body.get("n_predict"))
        if max_tokens is None:
            raise InvalidRequestError("max_tokens is required", param="max_tokens")
        names = {f for f in SamplingParams.__dataclass_fields__}
        sp = SamplingParams(**{k: body[k] for k in names if k in body})
        stop = body.get("stop", ())
        if isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
        return ChatRequest(messages=messages, max_tokens=max_tokens, sampling=sp, stop=stop,
                           enable_thinking=body.get("enable_thinking", False), client=str(body.get("client", "api")))


def validate_request(req: ChatRequest, vocab: int = VOCAB_SIZE) -> None:
    """Raise ``InvalidRequestError`` (llama.cpp ``invalid_request_error``) for a bad request.

    Needs no device or tokenizer, so callers (CLI, pane) can check before
    building anything. The context check needs the tokenizer and is done by
    ``Engine.submit``.
    """
    if not isinstance(req, ChatRequest):
        raise InvalidRequestError(f"expected a ChatRequest, got {type(req).__name__}")
    if req.prompt_tokens is not None:
        toks = req.prompt_tokens
        if not isinstance(toks, (tuple, list)) or not toks:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        for i, t in enumerate(toks):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < vocab:
                raise InvalidRequestError(f"prompt[{i}] must be a token id in [0, {vocab}), got {t!r}",
                                          param="prompt")
    else:
        if not isinstance(req.messages, (tuple, list)) or not req.messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(req.messages):
            if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise InvalidRequestError(
                    f"messages[{i}] must be {{'role': one of {', '.join(ROLES)}, 'content': string}}",
                    param="messages")
        if not req.messages[-1]["content"].strip():
            raise InvalidRequestError("the prompt is empty", param="prompt")
    if isinstance(req.id_slot, bool) or not isinstance(req.id_slot, (int, np.integer)) or req.id_slot < -1:
        raise InvalidRequestError(f"id_slot must be -1 (any) or a slot index, got {req.id_slot!r}", param="id_slot")
    if not isinstance(req.cache_prompt, bool):
        raise InvalidRequestError("cache_prompt must be true or false", param="cache_prompt")
    mt = req.max_tokens
    if mt is None:
        raise InvalidRequestError("max_tokens is required", param="max_tokens")
    if isinstance(mt, bool) or not isinstance(mt, (int, np.integer)) or mt <= 0:
        raise InvalidRequestError(f"max_tokens must be a positive integer, got {mt!r}", param="max_tokens")
    if not isinstance(req.stop, (tuple, list)):
        raise InvalidRequestError("stop must be a list of strings", param="stop")
    for s in req.stop:
        if not isinstance(s, str) or s == "":
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}", param="stop")
    if not isinstance(req.enable_thinking, bool):
        raise InvalidRequestError("enable_thinking must be true or false", param="enable_thinking")
    if not isinstance(req.sampling, SamplingParams):
        raise InvalidRequestError("sampling must be SamplingParams", param="sampling")
    req.sampling.validate(vocab)


class RequestState(str, Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class StageTimes:
    """Per-step stage times (facts.md F8).

    h2d_ms / infer_ms / d2h_ms: SIMULATED device ms (cost model; a slow chip is priced per chip).
    tokenize_ms / kv_wait_ms / sampling_ms / detokenize_ms / framework_ms:
    measured host ms (thread CPU time; kv_wait adds the wall time spent parked;
    scripted in tests). ``tokenize_ms`` is the
    request's prompt tokenisation, attributed to its first prefill step (0
    elsewhere). ``framework_ms`` is the rest of the host work of the step (KV
    bookkeeping, buffer set-up, submit, result handling). ``sampling_ms``
    includes BF16 -> FP32 of the logits.
    """

    kind: str
    h2d_ms: float
    infer_ms: float
    d2h_ms: float
    kv_wait_ms: float
    sampling_ms: float
    detokenize_ms: float
    framework_ms: float
    tokenize_ms: float = 0.0
    n_tokens: int = 0
    request_id: int = 0
    source: str = "request"  # "request" (served by the engine) or a maintenance step: "probe", "self-test", ...

    @property
    def device_ms(self) -> float:
        """Simulated device time of the step (h2d + infer + d2h)."""
        return self.h2d_ms + self.infer_ms + self.d2h_ms

    @property
    def host_ms(self) -> float:
        """Measured host time of the step."""
        return self.tokenize_ms + self.kv_wait_ms + self.sampling_ms + self.detokenize_ms + self.framework_ms


@dataclass(frozen=True)
class Timings:
    """llama.cpp ``timings`` plus TTFT / TPOT / ITL / E2E / queue time.

    All ``*_ms`` except ``host_ms`` are SIMULATED milliseconds on the board
    clock: device time plus the host work booked on it (``host_booked_ms``;
    ``host_time`` says how: ``"modeled"``, the facts.md F7 allowance per sampled
    token, or ``"measured"``, this machine's work; see ``HostBooking``) plus
    any wall time parked waiting for KV. ``host_ms`` breaks out the MEASURED
    host time on this machine (tokenize, sampling, detokenize, kv_wait,
    framework) whichever mode books; ``device_ms`` the simulated device time
    (h2d, infer, d2h).

    llama.cpp fields, with llama.cpp's own definitions:
    - prompt_n: prompt tokens processed (cached prefix excluded); cache_n: reused.
    - prompt_ms: prefill start -> first token sampled (includes other slots'
      steps interleaved with its chunks, like llama.cpp's wall clock).
    - predicted_n: tokens generated, EOS included.
    - predicted_ms: first token sampled -> last token sampled (0 when n == 1).
    - predicted_per_token_ms = predicted_ms / predicted_n and
      predicted_per_second = 1e3 * predicted_n / predicted_ms: llama.cpp divides
      the n - 1 gaps by n; ``tpot_ms`` is the exact per-gap figure. None
      where llama.cpp would divide by zero.
    Field metrics (facts.md F7): ttft_ms = arrival -> first visible piece, or ->
    first token sampled if nothing was shown (None if no token was produced,
    whatever the status); tpot_ms = (e2e - ttft) / (n - 1) (None when n < 2);
    itl_ms = gaps between consecutive visible pieces; e2e_ms = arrival -> end;
    queue_ms = prompt tokenised -> slot assigned (None if never assigned; tokenising is host work, booked before).
    arrival_ms / done_ms: the request's timestamps on the simulated clock.
    """

    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float | None
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float | None
    predicted_per_second: float | None
    cache_n: int
    ttft_ms: float | None
    tpot_ms: float | None
    itl_ms: tuple[float, ...]
    e2e_ms: float
    queue_ms: float | None
    host_ms: dict
    device_ms: dict
    numerics: bool
    arrival_ms: float = 0.0
    done_ms: float = 0.0
    host_booked_ms: float = 0.0
    host_time: str = "measured"
    #: "simulated" (everything above, as described) or "wall": a real server's result, where
    #: prompt_ms / predicted_ms are that server's own wall-clock timings and ttft / tpot / itl / e2e
    #: were measured in wall ms by the client (the llama-server planes)
    time_base: str = "simulated"

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["itl_ms"] = list(self.itl_ms)
        d["host_ms"] = dict(self.host_ms)
        d["device_ms"] = dict(self.device_ms)
        if self.time_base == "wall":
            d["clock"] = ("wall ms: prompt_ms / predicted_ms are the server's timings; ttft / tpot / itl / e2e "
                          "were measured by the client")
        else:
            d["clock"] = (f"simulated ms: device time + host work {self.host_time} ({self.host_booked_ms:.3f} ms "
                          "booked); host_ms is measured host time on this machine")
        return d


@dataclass(frozen=True)
class RequestResult:
    """Final outcome of a request. status: finished | failed | cancelled."""

    request_id: int
    status: str
    text: str
    tokens: tuple[int, ...]
    stop_type: str
    stopping_word: str
    error: dict | None
    timings: Timings
    seed: int | None


@dataclass(frozen=True)
class TokenEvent:
    """A visible piece of streamed text (never half a UTF-8 character, never part of a stop string).

    n_tokens: tokens generated so far; sim_ms: when it became visible (simulated ms).
    """

    request_id: int
    text: str
    n_tokens: int
    sim_ms: float


@dataclass(frozen=True)
class DoneEvent:
    request_id: int
    result: RequestResult


class EventStream:
    """The consuming side every request stream shares (in-process handle, HTTP client stream):
    ``next_event`` / ``stream`` / ``result`` over ``_events`` (a queue of TokenEvent | DoneEvent),
    ``_done`` (set with ``_result``). Subclasses provide ``id``, ``done`` and ``cancel``."""

    _events: queue.Queue[TokenEvent | DoneEvent]
    _done: threading.Event
    _result: RequestResult | None
    id: int

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self, reason: str = "cancelled by client") -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def next_event(self, timeout: float) -> TokenEvent | DoneEvent | None:
        """Next event within ``timeout`` host seconds, or None."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def stream(self, timeout: float = 60.0) -> Iterator[TokenEvent | DoneEvent]:
        """Yield events until the DoneEvent. Raises TimeoutError if nothing arrives for ``timeout`` host s
        (the request keeps running; the caller decides whether to cancel).

        A consumer that stops iterating early (the generator is closed or collected) or is
        interrupted (Ctrl-C) cancels the request: a vanished client counts as a cancel.
        """
        try:
            while True:
                ev = self.next_event(timeout)
                if ev is None:
                    raise TimeoutError(f"request {self.id}: no event for {timeout:.0f} s")
                yield ev
                if isinstance(ev, DoneEvent):
                    return
        except GeneratorExit:
            if not self.done:
                self.cancel("client stopped reading the stream")
            raise
        except KeyboardInterrupt:
            if not self.done:
                self.cancel("interrupted by user (Ctrl-C)")
            raise

    def result(self, timeout: float) -> RequestResult:
        """Block up to ``timeout`` host seconds for the final result (TimeoutError otherwise)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not done after {timeout:.1f} s")
        assert self._result is not None
        return self._result


class RequestHandle(EventStream):
    """Client side of a request: stream events, cancel, wait for the result. Thread-safe."""

    def __init__(self, req_id: int, prompt_n: int) -> None:
        self.id = req_id
        self.prompt_n = prompt_n
        self._events: queue.Queue[TokenEvent | DoneEvent] = queue.Queue()
        self._cancel = threading.Event()
        self.cancel_reason = ""
        self._result: RequestResult | None = None
        self._done = threading.Event()
        self._engine_wake: Callable[[], None] = lambda: None
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

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _finish(self, result: RequestResult) -> None:
        self._result = result
        self._events.put(DoneEvent(self.id, result))
        self._done.set()


@dataclass(frozen=True)
class SlotInfo:
    """Observation view of one slot."""

    index: int
    state: str  # idle | prefilling | decoding
    request_id: int | None
    prompt_n: int
    n_prefilled: int
    predicted_n: int
    cached_tokens: int
    numeric: bool | None = None  # the request's tokens come from the model (False: timing-only); None when idle
    max_tokens: int = 0  # the request's n_predict (0 when idle)
    params: dict = field(default_factory=dict)  # the request's sampling parameters, llama.cpp names (idle: {})


def error_dict(e: CalError) -> dict[str, Any]:
    """The ``error`` of a failed RequestResult: the error's own dict (llama.cpp ``code`` / ``message`` /
    ``type``, plus its numbers for KVExhausted) and ``type_name``, the Python class name."""
    d: dict[str, Any] = e.to_dict() if hasattr(e, "to_dict") else {"message": str(e)}
    d.setdefault("type", type(e).__name__)
    d["type_name"] = type(e).__name__
    return d
