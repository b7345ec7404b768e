"""``InferencePlane`` over HTTP: chat requests stream from ``POST /v1/chat/completions`` (SSE).

A chat request (messages) goes to ``/v1/chat/completions``, a raw prompt (token ids) to
``/v1/completions``, both with ``stream: true``. The response headers give the engine's request
id (``X-Request-Id``) and prompt length (``X-Prompt-Tokens``); each content delta becomes a
``TokenEvent``; the final chunk's ``calconsole`` extension (request id, status, stop type and word,
token ids, error, seed, the whole ``Timings``; ``calconsole.codec``) rebuilds the same
``RequestResult`` the in-process plane returns.

How a stream can end, and the result it gives:

- the final chunk: the server's result, exactly;
- an error event (the request failed, was drained for maintenance, or the server is stopping):
  the server's result (status ``failed`` or ``cancelled`` with its reason) from the event's
  ``calconsole`` extension and timings;
- ``cancel()``: the stream is closed (the socket shut down), which the server turns into a cancel
  within one device step; the result is ``cancelled`` with the caller's reason, built on the
  client (server timings are not received: times 0, ``prompt_n`` from the header, ``predicted_n``
  the pieces seen);
- the connection drops or no byte arrives within the read timeout (the engine's step timeout
  plus the server's 15 s keep-alive plus a margin): ``failed`` with the message "connection ...
  lost", never a hang.

``TokenEvent.n_tokens`` counts the pieces received so far (a piece can be several tokens: the chat
stream does not carry token counts) and ``sim_ms`` is NaN (not on the chat stream); the final
result's tokens and timings are exact.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import msgspec

from sim_backend.planes import (
    ChatRequest,
    InvalidRequestError,
    RequestResult,
    Timings,
    TokenEvent,
    TokenProbs,
    validate_request,
)

from ..codec import logit_bias_to_wire, probs_from_wire, result_from_extension, timings_from_wire
from .connection import Connection, RemoteError, ServerUnreachable
from .sse_stream import SseRequestStream

#: added to the server's step timeout for a stream's read timeout (its SSE keep-alive is every 15 s)
STREAM_MARGIN_S = 45.0


def timings_from(d: Mapping[str, Any]) -> Timings:
    """``Timings`` from its wire form (``calconsole.codec.timings_from_wire``)."""
    return timings_from_wire(d)


def client_timings(prompt_n: int, predicted_n: int) -> Timings:
    """Timings of a request whose end the server never reported: counts known here, times 0 (unknown)."""
    return Timings(prompt_n=prompt_n, prompt_ms=0.0, prompt_per_token_ms=None, prompt_per_second=None,
                   predicted_n=predicted_n, predicted_ms=0.0, predicted_per_token_ms=None,
                   predicted_per_second=None, cache_n=0, ttft_ms=None, tpot_ms=None, itl_ms=(), e2e_ms=0.0,
                   queue_ms=None, host_ms={}, device_ms={}, numerics=False)


def request_body(req: ChatRequest) -> tuple[str, dict[str, Any]]:
    """(route, JSON body) of a request: chat messages to /v1/chat/completions, token ids to /v1/completions."""
    body: dict[str, Any] = {"max_tokens": req.max_tokens, "stream": True, "stop": list(req.stop),
                            "id_slot": req.id_slot, "cache_prompt": req.cache_prompt}
    body.update({k: v for k, v in msgspec.structs.asdict(req.sampling).items() if v is not None})
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.n_probs:  # llama-server's names, read on every generation route
        body.update(n_probs=req.n_probs, post_sampling_probs=req.post_sampling_probs)
    if req.logit_bias:  # ids: the request's strings were tokenized by the face that read them
        body["logit_bias"] = logit_bias_to_wire(req.logit_bias)
    if req.grammar is not None:  # llama-server's fields: GBNF text, or the schema itself
        if req.grammar.kind == "gbnf":
            body["grammar"] = req.grammar.text
        else:
            body["json_schema"] = json.loads(req.grammar.text)
    if req.prompt_tokens is not None:
        body["prompt"] = [int(t) for t in req.prompt_tokens]
        return "/v1/completions", body
    body["messages"] = [{"role": m["role"], "content": m["content"]} for m in req.messages]
    body.update(template_fields(req.enable_thinking, req.add_generation_prompt, req.continue_final_message,
                                req.template_kwargs))
    return "/v1/chat/completions", body


def template_fields(enable_thinking: bool, add_generation_prompt: bool = True, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The chat template's body fields as llama-server reads them (``chat_template_kwargs`` with
    ``enable_thinking`` always given, so the server's default does not decide)."""
    kwargs = {**(template_kwargs or {}), "enable_thinking": bool(enable_thinking)}
    out: dict[str, Any] = {"chat_template_kwargs": kwargs}
    if not add_generation_prompt:
        out["add_generation_prompt"] = False
    if continue_final_message:
        out["continue_final_message"] = True
    return out


class RemoteRequestStream(SseRequestStream):
    """One streaming request (``RequestStream``) to ``calconsole serve``: a reader thread turns SSE chunks
    into events (module docstring: how a stream ends). Thread-safe."""

    def __init__(self, conn: Connection, resp: httpx.Response, *, raw: bool) -> None:
        try:
            rid, prompt_n = int(resp.headers.get("x-request-id", "-1")), int(resp.headers.get("x-prompt-tokens", "0"))
        except ValueError:
            rid, prompt_n = -1, 0
        super().__init__(conn, resp, rid, prompt_n)
        self._raw = raw
        self._probs: list[TokenProbs] = []  # the pieces' token probabilities (when asked for), in order
        self._start(f"calconsole-remote-req{rid}")

    def _end_client(self, status: str, error: dict[str, Any]) -> None:
        self._finish(RequestResult(request_id=self.id, status=status, text="".join(self._pieces), tokens=(),
                                   stop_type="none", stopping_word="", error=error,
                                   timings=client_timings(self._prompt_n, len(self._pieces)), seed=None))

    def _server_result(self, ext: Mapping[str, Any], error: Mapping[str, Any] | None = None) -> RequestResult:
        res = result_from_extension(ext, "".join(self._pieces), request_id=self.id, error=error)
        return msgspec.structs.replace(res, probs=tuple(self._probs)) if self._probs else res

    def _consume(self) -> None:
        for obj in self._chunks():
            if "error" in obj:
                ext = obj.get("calconsole")
                if isinstance(ext, dict):
                    self._finish(self._server_result(ext, obj["error"]))
                else:
                    err = obj["error"]
                    self._end_client("failed", {"type": str(err.get("type", "server_error")),
                                                "message": f"the server ended the stream: {err.get('message')}"})
                return
            ext = obj.get("calconsole")
            source = str(ext.get("logprobs_source", "")) if isinstance(ext, dict) else ""
            for choice in obj.get("choices") or ():
                text = (choice.get("text") if self._raw else (choice.get("delta") or {}).get("content"))
                entries = (choice.get("logprobs") or {}).get("content") or ()
                probs = probs_from_wire(entries, from_logits=not source.startswith("generator"))
                self._probs.extend(probs)
                if text:
                    self._pieces.append(text)
                    self._put(TokenEvent(self.id, text, len(self._pieces), math.nan, probs=probs))
            if isinstance(ext, dict) and "status" in ext:  # the final chunk's extension (pieces carry labels only)
                self._finish(self._server_result(ext))
        if not self._done.is_set():
            raise httpx.RemoteProtocolError("the stream ended without a final chunk")


class RemoteInferencePlane:
    """``InferencePlane`` of a running server (``calconsole serve``).

    ``n_ctx``, ``step_timeout_s`` and ``chat_template`` are read from ``GET /props`` once, at
    construction, and the model's vocabulary size from ``GET /v1/models`` (``meta.n_vocab``, as
    llama-server gives it; ServerUnreachable / RemoteError if either fails). Requests are checked with
    ``validate_request`` against that vocabulary (the pilot's 49152 ids, Qwen3's 151936) before anything
    is sent (the same InvalidRequestError as in-process); the server's refusals come back as the same
    typed errors.
    """

    def __init__(self, conn: Connection, props: Mapping[str, Any] | None = None, n_vocab: int | None = None) -> None:
        self._conn = conn
        if n_vocab is None:
            models = conn.json("GET", "/v1/models")
            try:
                n_vocab = int(models["data"][0]["meta"]["n_vocab"])
            except (KeyError, IndexError, TypeError, ValueError):
                raise RemoteError(200, "server_error",
                                  f"{conn.url}/v1/models does not give the model's n_vocab") from None
        self._n_vocab = n_vocab
        p = props if props is not None else conn.json("GET", "/props")
        self._n_ctx = int(p["default_generation_settings"]["n_ctx"])
        self._step_timeout_s = float(p.get("device", {}).get("step_timeout_s", 120.0))
        self._template = str(p.get("chat_template", ""))
        self._weights = str(p.get("device", {}).get("weights", "synthetic"))
        self._numerics = p.get("device", {}).get("numerics") is not False

    @property
    def n_ctx(self) -> int:
        return self._n_ctx

    @property
    def step_timeout_s(self) -> float:
        return self._step_timeout_s

    @property
    def n_vocab(self) -> int:
        """The server's model vocabulary (``/v1/models`` meta.n_vocab)."""
        return self._n_vocab

    @property
    def chat_template(self) -> str:
        return self._template

    @property
    def weights(self) -> str:
        """The server's model weights: "synthetic" or "real" (``/props`` device.weights)."""
        return self._weights

    @property
    def numerics(self) -> bool:
        """False when the server's device runs timing-only (``/props`` device.numerics)."""
        return self._numerics

    def submit(self, req: ChatRequest) -> RemoteRequestStream:
        """Send the request; returns once the server admitted it (headers received). Raises
        InvalidRequestError / ExceedContextSizeError / UnavailableError (ServerUnreachable if no answer)."""
        validate_request(req, vocab=self._n_vocab)
        path, body = request_body(req)
        resp = self._conn.open_stream(path, body, read_timeout_s=self._step_timeout_s + STREAM_MARGIN_S)
        return RemoteRequestStream(self._conn, resp, raw=req.prompt_tokens is not None)

    def generate(self, req: ChatRequest, timeout: float = 600.0) -> RequestResult:
        """Submit and wait up to ``timeout`` host s; a wait that ends abnormally cancels the request."""
        h = self.submit(req)
        try:
            return h.result(timeout)
        except BaseException:
            h.cancel("caller interrupted")
            raise

    def count_prompt_tokens(self, req: ChatRequest) -> int:
        if req.prompt_tokens is not None:
            return len(req.prompt_tokens)
        body = {"messages": [dict(m) for m in req.messages],
                **template_fields(req.enable_thinking, req.add_generation_prompt, req.continue_final_message,
                                  req.template_kwargs)}
        return int(self._conn.json("POST", "/chat/completions/input_tokens", json_body=body)["input_tokens"])

    def tokenize(self, text: str, *, parse_special: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise InvalidRequestError(f"content must be a string, got {type(text).__name__}", param="content")
        out = self._conn.json("POST", "/tokenize", json_body={"content": text, "parse_special": bool(parse_special)})
        return [int(t) for t in out["tokens"]]

    def detokenize(self, tokens: Sequence[int]) -> str:
        if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
            raise InvalidRequestError("tokens must be a list of token ids", param="tokens")
        return str(self._conn.json("POST", "/detokenize", json_body={"tokens": list(tokens)})["content"])

    def token_bytes(self, token: int) -> bytes:
        out = self._conn.json("POST", "/detokenize", json_body={"tokens": [token], "with_pieces": True})
        piece = out["pieces"][0]["piece"]
        return piece.encode("utf-8") if isinstance(piece, str) else bytes(piece)

    def apply_template(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool = False,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       template_kwargs: Mapping[str, Any] | None = None) -> str:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise InvalidRequestError("messages must be a list", param="messages")
        body = {"messages": [dict(m) if isinstance(m, Mapping) else m for m in messages],
                **template_fields(enable_thinking, add_generation_prompt, continue_final_message, template_kwargs)}
        return str(self._conn.json("POST", "/apply-template", json_body=body)["prompt"])


__all__ = ["RemoteInferencePlane", "RemoteRequestStream", "ServerUnreachable", "client_timings", "timings_from"]
