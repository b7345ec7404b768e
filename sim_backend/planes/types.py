"""The planes' value types: what a client builds (``ChatRequest``, ``SamplingParams``, ``SLO``) and
receives (``TokenEvent``, ``DoneEvent``, ``RequestResult`` with llama.cpp-style ``Timings``,
``StageTimes``), whichever plane serves it (in-process simulator, remote serving face, llama-server).

This module sits at the seam: it imports nothing of ``sim_backend`` but the typed errors
(import-linter contract "contracts, types and snapshot import nothing of serving, runtime,
device, model"), so a remote client loads no simulator code. The serving engine builds these
types; the face and the remote planes encode and decode them.

Every type is a frozen ``msgspec.Struct`` (like the snapshot sections): attributes cannot be
assigned; ``msgspec.structs.asdict`` / ``replace`` / ``fields`` work on them.

Times in ``Timings`` and events are SIMULATED ms on the board clock; ``host_ms`` parts are
measured host CPU ms on this machine.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import msgspec

from sim_backend.errors import InvalidRequestError

#: llama.cpp ``stop_type`` values.
STOP_TYPES = ("eos", "limit", "word", "none")
#: Chat message roles a request may carry.
ROLES = ("system", "user", "assistant")
#: Per-step stage names (facts.md F8). Device stages (h2d, infer, d2h) are simulated; host stages measured.
STAGES = ("tokenize", "h2d", "infer", "d2h", "sampling", "detokenize", "kv_wait", "framework")
#: Rows of the logits vector of Qwen3-30B-A3B (facts.md F1: 151936 BF16 logits per decode step): the
#: bound on token ids and ``top_k`` when a caller does not pass the served model's own vocabulary.
VOCAB_SIZE = 151936

_GREEDY_TOP_P = 1e-6


def _is_real(v: object) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


#: seeds that ask for a random one, as llama-server reads them: -1 and LLAMA_DEFAULT_SEED (0xFFFFFFFF, the same
#: value as llama.cpp's uint32 seed; ``calconsole.server.wire.DEFAULT_SEED``)
RANDOM_SEEDS = (-1, 0xFFFFFFFF)


#: the most negative seed an edge reads as llama-server does (int64's minimum: JSON integers it parses as int64)
MIN_WRAPPED_SEED = -(2**63)


def seed_or_random(seed: Any) -> Any:
    """``seed`` as ``SamplingParams.seed`` takes it, read as llama-server reads a request's seed.

    llama-server keeps the seed as a uint32 (``LLAMA_DEFAULT_SEED`` 0xFFFFFFFF asks for a random one), so a
    negative integer is taken modulo 2**32: -1 is 4294967295 (random), -5 is the fixed seed 4294967291, and the
    same request with -5 gives the same reply. Measured against the real server (xllamacpp's llama-server,
    ``tests/server/test_parity_llama_server.py``): ``generation_settings.seed`` reads 4294967291 for -5,
    4294967294 for -2, 2147483648 for -2**31, and 4294967295 (random) for -2**32-1.

    Returns None (a random seed) for an integer in ``RANDOM_SEEDS`` or a negative one in [-2**63, 0) that wraps
    to 0xFFFFFFFF; a negative integer in that range otherwise wraps to ``seed % 2**32``; anything else is
    returned unchanged, so ``SamplingParams.validate`` refuses what is not a seed (a seed below -2**63, which
    llama-server reads as a float whose conversion to uint32 C++ leaves undefined, is refused with its bounds;
    a non-negative seed stays as given, up to 2**64 - 1: a drawn seed is 64-bit and must replay as drawn).
    """
    if not _is_int(seed):
        return seed
    if MIN_WRAPPED_SEED <= seed < 0:
        seed = int(seed) % 2**32
    return None if seed in RANDOM_SEEDS else seed


class SamplingParams(msgspec.Struct, frozen=True):
    """Per-request sampling parameters (llama.cpp server names and defaults).

    temperature: >= 0; 0 means greedy. top_k: 0 disables. top_p: (0, 1], 1
    disables. min_p: [0, 1], 0 disables (relative to the top token's
    probability). repeat_penalty: (0, 10], 1 disables; applied over the last
    ``repeat_last_n`` tokens (0 disables, -1 = all given). presence /
    frequency penalties: [-2, 2] (OpenAI semantics, subtracted from logits).
    seed: non-negative int, or None for a random seed (the serving sampler
    exposes the one it drew so the run can be replayed); the edges that read a
    seed from a person or a client map llama-server's -1 to None (``seed_or_random``).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    @classmethod
    def greedy(cls, **overrides: Any) -> SamplingParams:
        """Greedy decoding (temperature 0): always the arg-max token."""
        return cls(**{"temperature": 0.0, **overrides})

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_p < _GREEDY_TOP_P

    @property
    def has_penalties(self) -> bool:
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    def validate(self, vocab_size: int = VOCAB_SIZE) -> None:
        """Raise :class:`InvalidRequestError` (``param`` = field name) on a bad value or type.

        ``vocab_size``: the served model's logits rows (``top_k`` may not exceed it)."""
        for name in self.__struct_fields__:
            v = getattr(self, name)
            if name == "seed":
                if v is not None and not _is_int(v):
                    raise InvalidRequestError(f"seed must be an integer or null; got {v!r}", param="seed")
            elif name in ("top_k", "repeat_last_n"):
                if not _is_int(v):
                    raise InvalidRequestError(f"{name} must be an integer; got {v!r}", param=name)
            elif not _is_real(v) or not math.isfinite(v):
                raise InvalidRequestError(f"{name} must be a finite number; got {v!r}", param=name)

        def bad(name: str, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"{name} must be {rule}; got {getattr(self, name)!r}", param=name)

        if self.temperature < 0:
            raise bad("temperature", ">= 0")
        if not 0 <= self.top_k <= vocab_size:
            raise bad("top_k", f"in [0, {vocab_size}] (0 disables)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not 0 < self.repeat_penalty <= 10:
            raise bad("repeat_penalty", "in (0, 10]")
        if self.repeat_last_n < -1:
            raise bad("repeat_last_n", ">= -1 (-1 = whole context, 0 disables)")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", "in [-2, 2]")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise bad("seed", "in [0, 2**64) or null for a random seed (where a person or a client gives it, "
                      "-2**63..-1 too, read modulo 2**32 as llama-server: -1 is a random one)")


#: grammar kinds a request may carry (``Grammar.kind``)
GRAMMAR_KINDS = ("gbnf", "json_schema")
#: characters a grammar or schema text may hold (a GBNF of a few hundred rules is ~20 k)
MAX_GRAMMAR_CHARS = 1 << 20


class Grammar(msgspec.Struct, frozen=True):
    """A constraint on the generated text (llama.cpp's constrained decoding).

    kind: ``"gbnf"`` (llama.cpp GBNF; a text starting ``%llguidance`` is llguidance's Lark) or
    ``"json_schema"`` (``text`` is the schema as JSON). The engine compiles it when the request is
    submitted and refuses one that does not compile (``InvalidRequestError``, 400).
    """

    kind: str
    text: str


class ChatRequest(msgspec.Struct, frozen=True):
    """One chat completion request.

    messages: sequence of {"role": system|user|assistant, "content": str};
    the last one's content must not be blank. max_tokens: generated tokens at
    most, an int > 0 (required). stop: stop strings (each non-empty).
    sampling: :class:`SamplingParams`. enable_thinking: Qwen3 thinking mode (the chat template's
    ``enable_thinking`` variable).
    prompt_tokens: a raw prompt (token ids, no chat template; llama.cpp ``/completion``).
    id_slot / cache_prompt: llama.cpp's slot choice and prefix reuse. ignore_eos: llama.cpp's (EOS never
    sampled). grammar: a :class:`Grammar` the generated text must match (``grammar`` / ``json_schema`` /
    ``response_format`` of a llama-server body), or None.
    add_generation_prompt / continue_final_message: the chat template's last-message rules
    (llama-server's; ``sim_backend.model.chat_template.continuation_of``): a trailing assistant message
    is always continued; ``continue_final_message`` continues any last message (then
    ``add_generation_prompt`` must be false). template_kwargs: more chat template variables
    (llama-server's ``chat_template_kwargs``, JSON values; a template that does not name one ignores it).
    """

    messages: tuple[dict[str, Any], ...]
    max_tokens: int | None = 256
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    enable_thinking: bool = False
    client: str = "api"
    #: a raw prompt as token ids (llama.cpp ``/completion``): no chat template; ``messages`` may be empty
    prompt_tokens: tuple[int, ...] | None = None
    #: the slot to run in (llama.cpp ``id_slot``), -1 = any; a busy slot makes the request wait for it
    id_slot: int = -1
    #: reuse the KV of a common prefix left in a slot (llama.cpp ``cache_prompt``)
    cache_prompt: bool = True
    #: never sample an end-of-generation token (llama.cpp ``ignore_eos``: their logits are set to -inf),
    #: so generation runs to ``max_tokens``, a stop word or the context end
    ignore_eos: bool = False
    #: report each generated token's probability and the ``n_probs`` most probable tokens at its step
    #: (llama.cpp ``n_probs``; OpenAI ``top_logprobs``); 0: none
    n_probs: int = 0
    #: the probabilities after the sampler chain (penalties, top-k, top-p, min-p, temperature) instead of
    #: the softmax of the raw logits (llama.cpp ``post_sampling_probs``)
    post_sampling_probs: bool = False
    #: the text must match this grammar (constrained decoding), or None
    grammar: Grammar | None = None
    #: (token id, bias) pairs added to the model's logits first in the sampler chain (llama.cpp ``logit_bias``):
    #: ``-inf`` bans the token, ``+inf`` (a bias past float32's range, as llama-server reads one) leaves only
    #: such tokens to draw from; the same id twice adds both, as llama.cpp's logit-bias sampler does. Needs
    #: logits: a request with biases that would run timing-only is refused (``admission.NO_LOGITS_BIAS``)
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: render the generation prompt after the messages (llama-server's ``add_generation_prompt``)
    add_generation_prompt: bool = True
    #: continue the last message, whatever its role (llama-server's ``continue_final_message``)
    continue_final_message: bool = False
    #: more chat template variables (llama-server's ``chat_template_kwargs`` but ``enable_thinking``)
    template_kwargs: dict[str, Any] | None = None
    #: stream a ``ProgressEvent`` when the request takes its slot and after each prefill step (llama-server's
    #: ``return_progress``, which it honours in stream mode only)
    return_progress: bool = False
    #: llama.cpp's ``n_keep`` / ``n_discard`` for a context shift: prompt tokens kept (-1 = all) and tokens
    #: discarded (0 = half of those after the kept ones); see ``sim_backend.serving.context_shift``
    n_keep: int = 0
    n_discard: int = 0

    @staticmethod
    def from_prompt(prompt: str, **kw: Any) -> ChatRequest:
        """One user message ``prompt``; ``kw`` are the other fields."""
        return ChatRequest(messages=({"role": "user", "content": prompt},), **kw)

    @staticmethod
    def from_dict(body: Mapping[str, Any]) -> ChatRequest:
        """Build from a llama.cpp/OpenAI-style JSON body; raises InvalidRequestError.

        ``messages`` (or ``prompt``) and ``max_tokens`` (or ``n_predict``) are
        required; sampling keys use llama.cpp names (``temperature``,
        ``top_k``, ``top_p``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``,
        ``presence_penalty``, ``frequency_penalty``, ``seed``); ``stop`` is a
        string or a list of strings. Values are checked by ``validate_request``
        (called by the inference plane's ``submit``), not here.
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
        sp = SamplingParams(**{k: body[k] for k in SamplingParams.__struct_fields__ if k in body})
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

    Needs no device or tokenizer, so callers (CLI, pane, remote planes) can check before
    building or sending anything. ``vocab``: the served model's vocabulary rows (token ids and
    ``top_k`` are bounded by it). The context check needs the tokenizer and is the plane's.
    """
    if not isinstance(req, ChatRequest):
        raise InvalidRequestError(f"expected a ChatRequest, got {type(req).__name__}")
    if req.prompt_tokens is not None:
        toks = req.prompt_tokens
        if not isinstance(toks, (tuple, list)) or not toks:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        for i, t in enumerate(toks):
            if not _is_int(t) or not 0 <= t < vocab:
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
    if not _is_int(req.id_slot) or req.id_slot < -1:
        raise InvalidRequestError(f"id_slot must be -1 (any) or a slot index, got {req.id_slot!r}", param="id_slot")
    if not isinstance(req.cache_prompt, bool):
        raise InvalidRequestError("cache_prompt must be true or false", param="cache_prompt")
    if not _is_int(req.n_probs) or not 0 <= req.n_probs <= vocab:
        raise InvalidRequestError(f"n_probs must be an integer in [0, {vocab}], got {req.n_probs!r}", param="n_probs")
    if not isinstance(req.post_sampling_probs, bool):
        raise InvalidRequestError("post_sampling_probs must be true or false", param="post_sampling_probs")
    if not isinstance(req.logit_bias, (tuple, list)):
        raise InvalidRequestError("logit_bias must be a list of (token id, bias) pairs", param="logit_bias")
    for pair in req.logit_bias:
        ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and _is_int(pair[0]) and _is_real(pair[1])
        if not ok or not 0 <= pair[0] < vocab or math.isnan(pair[1]):
            raise InvalidRequestError(f"logit_bias entries must be (token id in [0, {vocab}), a bias: a number, "
                                      f"-inf to ban the token), got {pair!r}", param="logit_bias")
    mt = req.max_tokens
    if mt is None:
        raise InvalidRequestError("max_tokens is required", param="max_tokens")
    if not _is_int(mt) or mt <= 0:
        raise InvalidRequestError(f"max_tokens must be a positive integer, got {mt!r}", param="max_tokens")
    if not isinstance(req.stop, (tuple, list)):
        raise InvalidRequestError("stop must be a list of strings", param="stop")
    for s in req.stop:
        if not isinstance(s, str) or s == "":
            raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}", param="stop")
    if not isinstance(req.return_progress, bool):
        raise InvalidRequestError("return_progress must be true or false", param="return_progress")
    if not isinstance(req.enable_thinking, bool):
        raise InvalidRequestError("enable_thinking must be true or false", param="enable_thinking")
    for flag in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(getattr(req, flag), bool):
            raise InvalidRequestError(f"{flag} must be true or false", param=flag)
    if req.template_kwargs is not None and (not isinstance(req.template_kwargs, Mapping) or not all(
            isinstance(k, str) for k in req.template_kwargs)):
        raise InvalidRequestError("template_kwargs must be an object with string keys", param="chat_template_kwargs")
    if not isinstance(req.sampling, SamplingParams):
        raise InvalidRequestError("sampling must be SamplingParams", param="sampling")
    req.sampling.validate(vocab)
    g = req.grammar
    if g is not None:
        if not isinstance(g, Grammar) or g.kind not in GRAMMAR_KINDS or not isinstance(g.text, str) or not g.text:
            raise InvalidRequestError(f"grammar must be a Grammar of kind {' or '.join(GRAMMAR_KINDS)} with a "
                                      "non-empty text", param="grammar")
        if len(g.text) > MAX_GRAMMAR_CHARS:
            raise InvalidRequestError(f"the grammar holds {len(g.text)} characters; at most {MAX_GRAMMAR_CHARS}",
                                      param="grammar")


class StageTimes(msgspec.Struct, frozen=True):
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
    #: the served request the step belongs to; None for a maintenance step (``source`` says which)
    request_id: int | None = None
    source: str = "request"  # "request" (served by the engine) or a maintenance step: "probe", "self-test", ...

    @property
    def device_ms(self) -> float:
        """Simulated device time of the step (h2d + infer + d2h)."""
        return self.h2d_ms + self.infer_ms + self.d2h_ms

    @property
    def host_ms(self) -> float:
        """Measured host time of the step."""
        return self.tokenize_ms + self.kv_wait_ms + self.sampling_ms + self.detokenize_ms + self.framework_ms


#: ``Timings.timing_only_reason``'s words (``sim_backend.serving.admission.timing_only_why``), one clause each,
#: no trailing period (the console and ``calconsole chat`` show them after "timing-only (tokens not from the
#: model: ...)")
NUMERICS_OFF = "the device runs timing-only (numerics off)"
NUMERICS_NOT_READY = "the numerics were not ready (kernels still compiling)"
NUMERICS_DOWN = "the numerics worker is down (reset or reload the model)"
#: a template (``new_tokens``, ``limit``)
OVER_NUMERIC_LIMIT = "{new_tokens} new prompt tokens, over the numeric limit of {limit}"
#: a template (``prompt_n``, ``limit``): ``admission.choose_slot`` reuses a prefix without values only for a
#: prompt over the limit as a whole (else it starts afresh with numerics), so a new conversation, with a
#: shorter prompt, is the way
CONTINUES_TIMING_ONLY = ("it continues a timing-only turn, whose cached prefix holds no values, and its whole "
                         "prompt ({prompt_n} tokens) is over the numeric limit of {limit} (start a new conversation)")


class Timings(msgspec.Struct, frozen=True):
    """llama.cpp ``timings`` plus TTFT / TPOT / ITL / E2E / queue time.

    All ``*_ms`` except ``host_ms`` are SIMULATED milliseconds on the board
    clock: device time plus the host work booked on it (``host_booked_ms``;
    ``host_time`` says how: ``"modeled"``, the facts.md F7 allowance per sampled
    token, or ``"measured"``, this machine's work) plus any wall time parked
    waiting for KV. ``host_ms`` breaks out the MEASURED host time on this machine
    (tokenize, sampling, detokenize, kv_wait, framework) whichever mode books;
    ``device_ms`` the simulated device time (h2d, infer, d2h).

    llama.cpp fields, with llama.cpp's own definitions:
    - prompt_n: prompt tokens processed (cached prefix excluded); cache_n: reused.
    - prompt_ms: prefill start -> first token sampled (includes other slots'
      steps interleaved with its chunks, like llama.cpp's wall clock).
    - predicted_n: tokens generated, EOS included.
    - predicted_ms: first token sampled -> last token sampled (0 when n == 1).
    - predicted_per_token_ms = predicted_ms / (predicted_n - 1) and
      predicted_per_second = 1e3 * (predicted_n - 1) / predicted_ms, as
      llama-server reports them (the first token costs no decode step);
      0.0 for one token, as llama-server gives.
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
    host_ms: dict[str, float]
    device_ms: dict[str, float]
    numerics: bool
    arrival_ms: float = 0.0
    done_ms: float = 0.0
    host_booked_ms: float = 0.0
    host_time: str = "measured"
    #: "simulated" (everything above, as described) or "wall": a real server's result, where
    #: prompt_ms / predicted_ms are that server's own wall-clock timings and ttft / tpot / itl / e2e
    #: were measured in wall ms by the client (the llama-server planes)
    time_base: str = "simulated"
    #: why the tokens are not the model's when ``numerics`` is False, as the engine decided at admission (one
    #: clause: numerics off or not ready, over the numeric limit, or continuing a timing-only turn); "" else
    timing_only_reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON form: every field, lists for tuples, plus ``clock`` (what the ms figures measure)."""
        d = {k: getattr(self, k) for k in self.__struct_fields__}
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


class TokenLogprob(msgspec.Struct, frozen=True):
    """One token and its natural-log probability (``logprob <= 0``; ``exp(logprob)`` is the probability);
    ``piece``: the bytes it adds to the text (maybe part of a UTF-8 character; ``b""`` for a special
    token, which the text never shows)."""

    id: int
    logprob: float
    piece: bytes = b""


class TokenProbs(msgspec.Struct, frozen=True):
    """The probabilities of one generation step (a request with ``ChatRequest.n_probs`` > 0).

    ``id`` / ``logprob``: the token sampled and its natural-log probability; ``top``: the ``n_probs`` most
    probable tokens, most probable first (ties: lower id first), fewer when the distribution has fewer
    tokens with a probability above 0. Which distribution: ``post_sampling`` False, the softmax of the
    step's raw logits over the tokenizer's ids (no penalty, no temperature: llama.cpp's default);
    True, the candidates the sampler chain left, renormalised (greedy: the arg-max with probability 1).
    A timing-only step has no logits: the distribution is the seeded generator's (uniform over the
    ordinary text ids), and the request's ``Timings.numerics`` is False.
    """

    id: int
    logprob: float
    top: tuple[TokenLogprob, ...]
    post_sampling: bool = False
    #: the sampled token's bytes (as ``TokenLogprob.piece``)
    piece: bytes = b""
    #: False for a timing-only step: the seeded generator's distribution, not the model's logits
    from_logits: bool = True


class RequestResult(msgspec.Struct, frozen=True):
    """Final outcome of a request. status: finished | failed | cancelled; ``stop_type`` one of
    ``STOP_TYPES``; ``error``: llama.cpp's error object (code, message, type) when not finished;
    ``probs``: one ``TokenProbs`` per generated token (aligned with ``tokens``) when the request asked
    for ``n_probs``, else empty; ``id_slot``: the slot it ran in (llama-server reports it; a client may
    send it back as ``id_slot`` or save that slot), -1 when it never took one or the plane does not say."""

    request_id: int
    status: str
    text: str
    tokens: tuple[int, ...]
    stop_type: str
    stopping_word: str
    error: dict[str, Any] | None
    timings: Timings
    seed: int | None
    probs: tuple[TokenProbs, ...] = ()
    id_slot: int = -1
    #: the context filled (llama-server's ``truncated``): shifted, or stopped at the context end
    truncated: bool = False
    #: context shifts and the tokens they discarded (``sim_backend.serving.context_shift``)
    n_shifts: int = 0
    n_discarded: int = 0


class TokenEvent(msgspec.Struct, frozen=True):
    """A visible piece of streamed text (never half a UTF-8 character, never part of a stop string).

    n_tokens: tokens generated so far; sim_ms: when it became visible (simulated ms); tokens: the ids
    generated since the previous event (the piece's tokens; llama-server's per-chunk ``tokens``);
    probs: their ``TokenProbs`` (aligned with ``tokens``) when the request asked for ``n_probs``.
    """

    request_id: int
    text: str
    n_tokens: int
    sim_ms: float
    tokens: tuple[int, ...] = ()
    probs: tuple[TokenProbs, ...] = ()
    #: the slot the request runs in (llama-server's per-chunk ``id_slot``); -1 when the plane does not say
    id_slot: int = -1


class ProgressEvent(msgspec.Struct, frozen=True):
    """How far the prompt's processing has come (llama-server's ``prompt_progress``, sent to a request that
    asked for it: ``ChatRequest.return_progress``): once when the request takes its slot (``processed`` =
    ``cache``, ``time_ms`` 0), then after each prefill step.

    total: the prompt's tokens (chat template applied); cache: those reused from the slot's cached prefix;
    processed: prompt tokens whose KV the slot holds so far, the cached ones included (llama-server's
    ``slot.prompt.tokens.size()``), so ``processed == total`` after the last step; time_ms: SIMULATED ms
    since the request took its slot (llama-server: wall ms since its prompt processing began);
    id_slot: the slot, -1 when the plane does not say.
    """

    request_id: int
    total: int
    cache: int
    processed: int
    time_ms: float
    id_slot: int = -1

    def to_json(self) -> dict[str, int]:
        """llama-server's ``prompt_progress`` object: ``{total, cache, processed, time_ms}``, integers
        (its ``time_ms`` is a whole number of ms)."""
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": int(self.time_ms)}


class DoneEvent(msgspec.Struct, frozen=True):
    """The last event of a request's stream: its final result."""

    request_id: int
    result: RequestResult


#: what a request's stream yields: visible pieces, prompt progress (only when asked for), then its end
StreamEvent = TokenEvent | ProgressEvent | DoneEvent


class SLO(msgspec.Struct, frozen=True):
    """Service-level objectives for goodput, in simulated ms; None = not checked (vLLM ``--goodput``)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms", "e2el_ms"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"SLO {name} must be a positive number of ms or None, got {v!r}")

    @staticmethod
    def parse(spec: str) -> SLO:
        """``"ttft:500,tpot:50,e2el:5000"`` (ms, vLLM's ``--goodput`` keys) -> SLO.

        Raises ValueError for an unknown key, an empty value or a key given twice."""
        kw: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, _, val = part.partition(":")
            if key not in ("ttft", "tpot", "e2el") or not val:
                raise ValueError(f"bad SLO {part[:60]!r}: expected ttft:MS, tpot:MS or e2el:MS")
            if f"{key}_ms" in kw:  # the last one would win silently
                raise ValueError(f"SLO field '{key}' given twice")
            kw[f"{key}_ms"] = float(val)
        return SLO(**kw)

    def to_dict(self) -> dict[str, float | None]:
        """``{"ttft_ms", "tpot_ms", "e2el_ms"}`` (simulated ms or None)."""
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2el_ms": self.e2el_ms}

    def met(self, ttft: float | None, tpot: float | None, e2e: float) -> bool:
        """True if every configured objective is met (simulated ms; ttft None fails a TTFT SLO; tpot None
        counts as 0)."""
        if self.ttft_ms is not None and (ttft is None or ttft > self.ttft_ms):
            return False
        if self.tpot_ms is not None and tpot is not None and tpot > self.tpot_ms:
            return False
        if self.e2el_ms is not None and e2e > self.e2el_ms:
            return False
        return True


__all__ = ["RANDOM_SEEDS", "ROLES", "SLO", "STAGES", "STOP_TYPES", "VOCAB_SIZE", "ChatRequest", "DoneEvent",
           "RequestResult", "SamplingParams", "StageTimes", "Timings", "TokenEvent", "TokenLogprob", "TokenProbs",
           "seed_or_random", "validate_request"]
