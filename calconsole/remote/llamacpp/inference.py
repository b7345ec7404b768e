"""``InferencePlane`` of a stock llama-server (llama.cpp ``tools/server``), over its own routes.

- chat (messages): ``POST /v1/chat/completions`` with ``stream: true`` and
  ``stream_options.include_usage`` and ``verbose``; each ``delta.content`` is a ``TokenEvent``; the final
  chunks carry ``finish_reason``, ``usage``, llama.cpp's ``timings`` and (``verbose``) its ``__verbose``
  result, whose ``stop_type`` / ``stopping_word`` the result takes;
- a raw prompt (token ids): ``POST /completion`` with ``stream: true`` and ``return_tokens``: its
  final chunk has ``stop_type``, ``stopping_word``, the generated ids and ``timings``;
- ``tokenize`` / ``detokenize`` / ``token_bytes``: ``/tokenize`` and ``/detokenize``;
- ``apply_template`` / ``count_prompt_tokens``: ``/apply-template``, then ``/tokenize`` of its prompt
  (special tokens parsed, as the server counts ``prompt_n + cache_n``).

Cancel closes the stream (the socket is shut down): llama-server stops the task and frees the slot
when it sees the client gone. The result is then built here (``cancelled``, counts seen so far).

Times: the result's ``prompt_ms`` / ``predicted_ms`` (and per-token figures) are the SERVER's wall
ms (its ``timings``); ``ttft_ms`` / ``tpot_ms`` / ``itl_ms`` / ``e2e_ms`` are wall ms measured HERE,
as the client (request sent -> first piece / between pieces / last chunk), ``Timings.time_base``
"wall". Every request is also recorded in the shared client ``MetricsRegistry`` the observation
plane reports (its clock says so).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Mapping, Sequence
from itertools import count, pairwise
from typing import Any

import httpx
import msgspec

from sim_backend.planes import (
    ChatRequest,
    InvalidRequestError,
    MetricsRegistry,
    NotOffered,
    RequestResult,
    Timings,
    TokenEvent,
    TokenProbs,
    validate_request,
)

from ...codec import logit_bias_to_wire, probs_from_wire
from ..connection import Connection
from ..inference import template_fields
from ..sse_stream import SseRequestStream

#: host s without a byte on a running stream before it counts as lost (llama-server sends no keep-alive)
STREAM_READ_S = 120.0
#: what the client-measured request metrics are in (the observation plane shows it)
CLIENT_CLOCK = "wall ms measured by this console as client (request sent -> piece received)"
_ids = count(1)


class ClientMetrics:
    """The requests this console sent, measured as client: a ``MetricsRegistry`` (vLLM's TTFT / TPOT /
    ITL / E2E definitions) on the client's wall clock, and the requests in flight. Thread-safe.

    ``summary(kv_ratio)`` is the registry's summary with its ``clock`` naming the client wall clock,
    ``scope`` saying whose requests these are, and the KV ratio the server reported (None: not reported).
    """

    SCOPE = "requests sent by this console (another client's requests are in the server's counters only)"

    def __init__(self) -> None:
        self.registry = MetricsRegistry()
        self.registry.clock = CLIENT_CLOCK
        self._lock = threading.Lock()
        self._running = 0

    def submitted(self) -> None:
        with self._lock:
            self._running += 1
            self.registry.on_submitted(live=(0, self._running, 0.0))

    def rejected(self) -> None:
        self.registry.on_rejected()

    def first_token(self, ttft_ms: float) -> None:
        self.registry.on_first_token(ttft_ms)

    def token_gap(self, itl_ms: float) -> None:
        self.registry.on_token_gap(itl_ms)

    def done(self, status: str, **kw: Any) -> None:
        with self._lock:
            self._running -= 1
            self.registry.on_done(status, live=(0, self._running, 0.0), **kw)

    def summary(self, kv_ratio: float | None) -> dict[str, Any]:
        out = self.registry.summary()
        out["kv_cache_usage_ratio"] = kv_ratio
        out["scope"] = self.SCOPE
        return out

    def history(self) -> dict[str, tuple[float | None, ...]]:
        return {k: tuple(v) for k, v in self.registry.history_series().items()}


def stop_type_of(finish_reason: str | None, stop_words: Sequence[str]) -> str:
    """The stop type when the final chunk has no ``__verbose`` (a build that ignores ``verbose``), from the
    OpenAI ``finish_reason``: "length" -> limit; "stop" -> eos when no stop strings were sent, else
    "eos_or_word" (finish_reason does not say which one ended it); None (no final chunk) -> none."""
    if finish_reason == "length":
        return "limit"
    if finish_reason == "stop":
        return "eos" if not stop_words else "eos_or_word"
    return "none"


class LlamaRequestStream(SseRequestStream):
    """One streaming request to a llama-server (``RequestStream``): a reader thread turns SSE chunks
    into events and measures the client-side latencies. Thread-safe. ``id`` is this console's
    request number (llama-server's chat ids are strings; its task ids are not sent on the stream)."""

    def __init__(self, conn: Connection, resp: httpx.Response, req: ChatRequest, prompt_n: int,
                 sent_s: float, metrics: ClientMetrics) -> None:
        super().__init__(conn, resp, next(_ids), prompt_n)
        self._req = req
        self._raw = req.prompt_tokens is not None
        self._sent_s = sent_s
        self._metrics = metrics
        self._piece_s: list[float] = []
        self._probs: list[TokenProbs] = []  # every streamed token's probabilities (when asked for), in order
        self._start(f"calconsole-llama-req{self.id}")

    # --- results ----------------------------------------------------------------------------

    def _client_latencies(self, end_s: float) -> tuple[float | None, tuple[float, ...], float]:
        ttft = (self._piece_s[0] - self._sent_s) * 1e3 if self._piece_s else None
        itl = tuple((b - a) * 1e3 for a, b in pairwise(self._piece_s))
        return ttft, itl, (end_s - self._sent_s) * 1e3

    def _result_of(self, status: str, *, server: Mapping[str, Any] | None, stop_type: str, stopping_word: str,
                   tokens: tuple[int, ...], error: dict[str, Any] | None, predicted_n: int | None = None,
                   seed: int | None = None) -> RequestResult:
        end_s = time.monotonic()
        ttft, itl, e2e = self._client_latencies(end_s)
        st = server or {}
        n = int(st.get("predicted_n", predicted_n if predicted_n is not None else len(self._pieces)))
        tpot = (e2e - ttft) / (n - 1) if ttft is not None and n >= 2 and status == "finished" else None
        cache_n = int(st.get("cache_n", 0))
        timings = Timings(
            prompt_n=int(st.get("prompt_n", max(0, self._prompt_n - cache_n))),
            prompt_ms=float(st.get("prompt_ms", 0.0)),
            prompt_per_token_ms=_opt(st.get("prompt_per_token_ms")),
            prompt_per_second=_opt(st.get("prompt_per_second")),
            predicted_n=n, predicted_ms=float(st.get("predicted_ms", 0.0)),
            predicted_per_token_ms=_opt(st.get("predicted_per_token_ms")),
            predicted_per_second=_opt(st.get("predicted_per_second")),
            cache_n=cache_n, ttft_ms=ttft, tpot_ms=tpot, itl_ms=itl, e2e_ms=e2e, queue_ms=None,
            host_ms={}, device_ms={}, numerics=True, time_base="wall")
        res = RequestResult(request_id=self.id, status=status, text="".join(self._pieces), tokens=tokens,
                            stop_type=stop_type, stopping_word=stopping_word, error=error, timings=timings,
                            seed=seed, probs=tuple(self._probs))
        self._metrics.done(status, prompt_n=timings.prompt_n + cache_n, cache_n=cache_n, predicted_n=n,
                              prompt_ms=timings.prompt_ms, predicted_ms=timings.predicted_ms, ttft=ttft, tpot=tpot,
                              itl=itl, e2e=e2e, queue_ms=None, done_ms=end_s * 1e3, arrival_ms=self._sent_s * 1e3)
        return res

    def _end(self, status: str, **kw: Any) -> None:
        """Build and hand out the result once (the metrics record it once)."""
        if not self._done.is_set():
            self._finish(self._result_of(status, **kw))

    def _probs_of(self, entries: Any) -> tuple[TokenProbs, ...]:
        """The token probabilities a chunk carries (llama-server's entries), kept for the result."""
        probs = probs_from_wire(entries or ())
        self._probs.extend(probs)
        return probs

    def _piece(self, text: str, probs: tuple[TokenProbs, ...] = ()) -> None:
        now = time.monotonic()
        if not self._piece_s:
            self._metrics.first_token((now - self._sent_s) * 1e3)
        else:
            self._metrics.token_gap((now - self._piece_s[-1]) * 1e3)
        self._pieces.append(text)
        self._piece_s.append(now)
        self._put(TokenEvent(self.id, text, len(self._pieces), math.nan, probs=probs))

    # --- the reader thread -------------------------------------------------------------------

    def _end_client(self, status: str, error: dict[str, Any]) -> None:
        self._end(status, server=None, stop_type="none", stopping_word="", tokens=(), error=error)

    def _consume(self) -> None:
        finish_reason: str | None = None
        verbose: dict[str, Any] = {}  # the final chunk's "__verbose" (llama.cpp's stop_type, stopping_word)
        timings: dict[str, Any] | None = None
        final: dict[str, Any] | None = None
        for obj in self._chunks():
            if not isinstance(obj, dict):
                continue
            if "error" in obj:  # llama-server ends a failed stream with an error event
                err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
                self._end("failed", server=timings, stop_type="none", stopping_word="", tokens=(),
                          error={"type": str(err.get("type", "server_error")), "message": str(err.get("message"))})
                return
            if isinstance(obj.get("timings"), dict):
                timings = obj["timings"]
            if isinstance(obj.get("__verbose"), dict):
                verbose = obj["__verbose"]
            if self._raw:  # /completion chunks: {"content", "stop", ...}
                probs = self._probs_of(obj.get("completion_probabilities"))
                if obj.get("content"):
                    self._piece(str(obj["content"]), probs)
                if obj.get("stop"):
                    final = obj
                    break
                continue
            for choice in obj.get("choices") or ():
                text = (choice.get("delta") or {}).get("content")
                probs = self._probs_of((choice.get("logprobs") or {}).get("content"))
                if text:
                    self._piece(str(text), probs)
                if choice.get("finish_reason"):
                    finish_reason = str(choice["finish_reason"])
        if self._raw:
            if final is None:
                raise httpx.RemoteProtocolError("the stream ended without a final chunk")
            toks = tuple(int(t) for t in final.get("tokens") or ())
            self._end("finished", server=timings, stop_type=str(final.get("stop_type", "none")),
                      stopping_word=str(final.get("stopping_word") or ""), tokens=toks, error=None,
                      predicted_n=int(final.get("tokens_predicted", len(toks))))
        elif finish_reason is None:
            raise httpx.RemoteProtocolError("the stream ended without a finish_reason")
        else:
            self._end("finished", server=timings,
                      stop_type=str(verbose.get("stop_type") or stop_type_of(finish_reason, self._req.stop)),
                      stopping_word=str(verbose.get("stopping_word") or ""), tokens=(), error=None,
                      seed=self._req.sampling.seed)


def _opt(v: Any) -> float | None:
    return None if v is None else float(v)


def request_body(req: ChatRequest) -> tuple[str, dict[str, Any]]:
    """(route, JSON body) in llama-server's names: messages to /v1/chat/completions, ids to /completion."""
    body: dict[str, Any] = {"stream": True, "stop": list(req.stop), "id_slot": req.id_slot,
                            "cache_prompt": req.cache_prompt}
    body.update({k: v for k, v in msgspec.structs.asdict(req.sampling).items() if v is not None})
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.n_probs:
        body.update(n_probs=req.n_probs, post_sampling_probs=req.post_sampling_probs)
    if req.logit_bias:  # ids: the request's strings were tokenized by the face that read them
        body["logit_bias"] = logit_bias_to_wire(req.logit_bias)
    if req.grammar is not None:  # llama-server reads both on every generation route
        if req.grammar.kind == "gbnf":
            body["grammar"] = req.grammar.text
        else:
            body["json_schema"] = json.loads(req.grammar.text)
    if req.prompt_tokens is not None:
        body.update(prompt=[int(t) for t in req.prompt_tokens], n_predict=req.max_tokens, return_tokens=True)
        return "/completion", body
    # verbose: the final chunk also carries llama.cpp's own result ("__verbose": stop_type, stopping_word)
    body.update(messages=[{"role": m["role"], "content": m["content"]} for m in req.messages],
                max_tokens=req.max_tokens, stream_options={"include_usage": True}, verbose=True)
    body.update(template_fields(req.enable_thinking, req.add_generation_prompt, req.continue_final_message,
                                req.template_kwargs))
    return "/v1/chat/completions", body


class LlamaInferencePlane:
    """``InferencePlane`` of a llama-server. ``props``: its ``GET /props``; ``n_vocab`` from ``/v1/models``.

    ``n_ctx``: tokens per slot (``default_generation_settings.n_ctx``: the server splits its context
    evenly over its slots). Requests are checked with ``validate_request`` (ids against this model's
    vocabulary) before anything is sent; the server's refusals come back as the typed errors
    (``ExceedContextSizeError`` with its n_prompt_tokens and n_ctx, ``InvalidRequestError``,
    ``UnavailableError``, ``ServerUnreachable``).
    """

    def __init__(self, conn: Connection, props: Mapping[str, Any], n_vocab: int, metrics: ClientMetrics) -> None:
        self._conn = conn
        self._n_ctx = int(props["default_generation_settings"]["n_ctx"])
        self._template = str(props.get("chat_template", ""))
        self._n_vocab = n_vocab
        self.metrics = metrics
        self.server_kind = "llama-server"

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def step_timeout_s(self) -> float:
        """Longest wait for one event of a running stream (host s): llama-server sends no keep-alive."""
        return STREAM_READ_S

    @property
    def chat_template(self) -> str:
        return self._template

    def submit(self, req: ChatRequest) -> LlamaRequestStream:
        """Send the request; returns once the server answered with a stream (its headers)."""
        validate_request(req, vocab=self._n_vocab)
        prompt_n = self.count_prompt_tokens(req)
        path, body = request_body(req)
        sent = time.monotonic()
        try:
            resp = self._conn.open_stream(path, body, read_timeout_s=STREAM_READ_S)
        except BaseException:
            self.metrics.rejected()
            raise
        self.metrics.submitted()
        return LlamaRequestStream(self._conn, resp, req, prompt_n, sent, self.metrics)

    def generate(self, req: ChatRequest, timeout: float = 600.0) -> RequestResult:
        """Submit and wait up to ``timeout`` host s; a wait that ends abnormally cancels the request."""
        h = self.submit(req)
        try:
            return h.result(timeout)
        except BaseException:
            h.cancel("caller interrupted")
            raise

    def count_prompt_tokens(self, req: ChatRequest) -> int:
        """Prompt tokens as the server counts them (template applied, special tokens parsed)."""
        if req.prompt_tokens is not None:
            return len(req.prompt_tokens)
        prompt = self.apply_template(req.messages, enable_thinking=req.enable_thinking,
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     template_kwargs=req.template_kwargs)
        return len(self.tokenize(prompt, parse_special=True))

    def tokenize(self, text: str, *, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"content must be a string, got {type(text).__name__}", param="content")
        out = self._conn.json("POST", "/tokenize", json_body={"content": text, "parse_special": bool(parse_special)})
        return [int(t) for t in out["tokens"]]

    def detokenize(self, tokens: Sequence[int]) -> str:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise InvalidRequestError("tokens must be a list of token ids", param="tokens")
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self._n_vocab:
                raise InvalidRequestError(f"tokens[{i}] must be a token id in [0, {self._n_vocab}), got {t!r}",
                                          param="tokens")
        return str(self._conn.json("POST", "/detokenize", json_body={"tokens": list(tokens)})["content"])

    def token_bytes(self, token: int) -> bytes:
        """The piece's bytes, from ``/detokenize`` of the one id. NotOffered for a piece that is part of a
        UTF-8 character: llama-server's /detokenize returns U+FFFD for it, not its bytes."""
        text = self.detokenize([token])
        if "\ufffd" in text:
            raise NotOffered("token_bytes", "llama-server", f"token {token} is part of a UTF-8 character and "
                                                            "/detokenize returns U+FFFD, not its bytes")
        return text.encode("utf-8")

    def apply_template(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool = False,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       template_kwargs: Mapping[str, Any] | None = None) -> str:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not (isinstance(m, Mapping) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)):
                raise InvalidRequestError(f"messages[{i}] must be {{'role': string, 'content': string}}",
                                          param="messages")
        body = {"messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                **template_fields(enable_thinking, add_generation_prompt, continue_final_message, template_kwargs)}
        return str(self._conn.json("POST", "/apply-template", json_body=body)["prompt"])


__all__ = ["CLIENT_CLOCK", "ClientMetrics", "LlamaInferencePlane", "LlamaRequestStream", "request_body", "stop_type_of"]
