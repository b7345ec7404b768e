"""Request parsing and response shapes of llama-server and the OpenAI API (no I/O here).

Errors are llama-server's: ``{"error": {"code": <http status>, "message": str, "type": str}}``
with its types (``invalid_request_error`` 400, ``exceed_context_size_error`` 400 with
``n_prompt_tokens`` / ``n_ctx``, ``authentication_error`` 401, ``permission_error`` 403,
``not_found_error`` 404, ``server_error`` 500, ``not_supported_error`` 501,
``unavailable_error`` 503).

Token accounting as llama-server counts it: ``usage.prompt_tokens`` is the whole prompt
(cached tokens included; ``prompt_tokens_details.cached_tokens`` says how many were reused),
``completion_tokens`` the tokens generated (EOS included), ``finish_reason`` ``stop`` for an
EOS or a stop word and ``length`` for the token or context limit. ``timings`` are the
simulator's: simulated device milliseconds (host work measured and included).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import msgspec

from sim_backend.planes import (
    CalError,
    ChatRequest,
    ExceedContextSizeError,
    InvalidRequestError,
    RequestError,
    RequestResult,
    SamplingParams,
)

#: sampling fields a body may carry (llama.cpp names; OpenAI's temperature / top_p / penalties / seed among them)
SAMPLING_FIELDS = SamplingParams.__struct_fields__
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOP_WORDS = 16
MAX_MESSAGES = 1024


class HTTPError(Exception):
    """An error response: ``status`` (HTTP), llama-server ``type``, message, extra body fields."""

    def __init__(self, status: int, type_: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_
        self.message = message
        self.extra = extra
        self.audited = False  # maintenance routes: already in the audit log (else the route audits it)
        #: a refusal to audit (the action's name), written by the route wrapper off the event loop
        self.audit_action: str | None = None
        self.unauthenticated = False  # refused for a missing or wrong admin key: summarised per peer (refusals)

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.status, "message": self.message, "type": self.type, **self.extra}}


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, "invalid_request_error", message)


def from_cal_error(e: CalError) -> HTTPError:
    """The HTTP error for a typed simulator error (request refusals keep their own code and type)."""
    if isinstance(e, ExceedContextSizeError):
        return HTTPError(400, "exceed_context_size_error", str(e), n_prompt_tokens=e.n_prompt_tokens, n_ctx=e.n_ctx)
    if isinstance(e, RequestError):
        return HTTPError(e.http_status, e.error_type, str(e))
    return HTTPError(500, "server_error", f"{type(e).__name__}: {e}")


def result_error(res: RequestResult) -> HTTPError:
    """The HTTP error for a request that ended failed or cancelled (KV exhausted / device not ready
    / drained for maintenance are 503: try again later; device faults are 500)."""
    err = res.error or {}
    msg = str(err.get("message") or res.status)
    kind = str(err.get("type_name") or err.get("type") or "")
    if res.status == "cancelled":
        return HTTPError(503, "unavailable_error", f"request cancelled: {msg}")
    if kind in ("KVExhausted", "DeviceNotReady", "unavailable_error"):
        return HTTPError(503, "unavailable_error", msg)
    return HTTPError(500, "server_error", f"{kind}: {msg}" if kind else msg)


# --- request fields ------------------------------------------------------------------------------

def _int(body: Mapping[str, Any], name: str, default: int | None = None, *, lo: int | None = None,
         hi: int | None = None) -> int | None:
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"'{name}' must be in [{lo}, {hi}], got {v}" if hi is not None
                          else f"'{name}' must be >= {lo}, got {v}")
    return v


def _bool(body: Mapping[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be true or false, got {type(v).__name__}")
    return v


def sampling_from(body: Mapping[str, Any]) -> SamplingParams:
    """SamplingParams from the body's llama.cpp/OpenAI sampling fields; 400 naming a field of the wrong type."""
    kw: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        if name not in body or body[name] is None:
            continue
        v = body[name]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad_request(f"'{name}' must be a number, got {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):
            raise bad_request(f"'{name}' must be finite")
        kw[name] = v
    sp = SamplingParams(**kw)
    try:
        sp.validate()
    except InvalidRequestError as e:
        raise bad_request(str(e)) from None
    return sp


def stop_from(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad_request("'stop' must be a string or a list of strings")
    if len(v) > MAX_STOP_WORDS:
        raise bad_request(f"'stop' holds {len(v)} strings; at most {MAX_STOP_WORDS}")
    return tuple(s for s in v if s)  # llama.cpp skips empty stop words


def max_tokens_from(body: Mapping[str, Any], names: tuple[str, ...], n_ctx: int, default: int) -> int:
    """The generation limit: the first of ``names`` present, else ``default``; -1 = until the context end."""
    for name in names:
        if body.get(name) is not None:
            v = _int(body, name, lo=-1)
            assert v is not None
            if v == 0:
                raise bad_request(f"'{name}' must be a positive integer or -1 (until the context is full)")
            return n_ctx if v == -1 else v
    return n_ctx if default == -1 else default


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: only text parts are served
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'messages[{i}].content[{j}]' must be a text part "
                                  "({\"type\": \"text\", \"text\": ...}); other content is not supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"'messages[{i}].content' must be a string or a list of text parts")


def messages_from(body: Mapping[str, Any]) -> tuple[dict[str, str], ...]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad_request("'messages' is required")
    if not isinstance(msgs, list):
        raise bad_request("'messages' must be a list")
    if not msgs:
        raise bad_request("'messages' must not be empty")
    if len(msgs) > MAX_MESSAGES:
        raise bad_request(f"'messages' holds {len(msgs)} messages; at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, Mapping):
            raise bad_request(f"'messages[{i}]' must be an object")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_request(f"'messages[{i}].role' must be one of system, developer, user, assistant; "
                              f"got {role!r}")
        out.append({"role": ROLES[role], "content": _content_text(m.get("content"), i)})
    return tuple(out)


def _thinking(body: Mapping[str, Any]) -> bool:
    kw = body.get("chat_template_kwargs")
    if kw is None:
        return _bool(body, "enable_thinking", False)
    if not isinstance(kw, Mapping):
        raise bad_request("'chat_template_kwargs' must be an object")
    return _bool(kw, "enable_thinking", False)


def chat_request(body: Mapping[str, Any], *, n_ctx: int, n_predict: int, client: str) -> ChatRequest:
    """``/v1/chat/completions`` body -> ChatRequest (400 naming the field for anything wrong)."""
    if _int(body, "n", 1, lo=1) != 1:
        raise HTTPError(400, "invalid_request_error", "'n': only one choice per request is supported")
    if body.get("logprobs") not in (None, False):
        raise HTTPError(400, "invalid_request_error", "'logprobs' is not supported by this server")
    if body.get("tools"):
        raise HTTPError(400, "invalid_request_error", "'tools' is not supported by this server")
    slot = _int(body, "id_slot", -1, lo=-1)
    return ChatRequest(messages=messages_from(body),
                       max_tokens=max_tokens_from(body, ("max_completion_tokens", "max_tokens", "n_predict"),
                                                  n_ctx, n_predict),
                       sampling=sampling_from(body), stop=stop_from(body), enable_thinking=_thinking(body),
                       client=client, id_slot=-1 if slot is None else slot,
                       cache_prompt=_bool(body, "cache_prompt", True))


def prompt_tokens_from(body: Mapping[str, Any], tokenize: Any) -> tuple[int, ...]:
    """``prompt`` as text, token ids, or a mix of both (llama.cpp) -> token ids."""
    p = body.get("prompt")
    if p is None:
        raise bad_request("'prompt' is required")
    if isinstance(p, str):
        items: list[Any] = [p]
    elif isinstance(p, list):
        if p and all(isinstance(x, str) for x in p) and len(p) > 1:
            raise bad_request("'prompt': one prompt per request (a list of strings asks for several)")
        items = p
    else:
        raise bad_request("'prompt' must be a string or a list of token ids")
    ids: list[int] = []
    for i, x in enumerate(items):
        if isinstance(x, str):
            ids.extend(tokenize(x))
        elif isinstance(x, int) and not isinstance(x, bool):
            ids.append(x)
        else:
            raise bad_request(f"'prompt[{i}]' must be a token id or a string")
    if not ids:
        raise bad_request("'prompt' is empty")
    return tuple(ids)


def completion_request(body: Mapping[str, Any], tokenize: Any, *, n_ctx: int, n_predict: int, client: str,
                       openai: bool) -> ChatRequest:
    """``/completion`` (llama.cpp) or ``/v1/completions`` (OpenAI) body -> a raw-prompt ChatRequest."""
    if openai and _int(body, "n", 1, lo=1) != 1:
        raise bad_request("'n': only one choice per request is supported")
    names = ("max_tokens", "n_predict") if openai else ("n_predict", "max_tokens")
    slot = _int(body, "id_slot", -1, lo=-1)
    return ChatRequest(messages=(), prompt_tokens=prompt_tokens_from(body, tokenize),
                       max_tokens=max_tokens_from(body, names, n_ctx, n_predict), sampling=sampling_from(body),
                       stop=stop_from(body), client=client, id_slot=-1 if slot is None else slot,
                       cache_prompt=_bool(body, "cache_prompt", True))


# --- response shapes ------------------------------------------------------------------------------

def finish_reason(res: RequestResult) -> str:
    return "stop" if res.stop_type in ("eos", "word") else "length"


def timings(res: RequestResult) -> dict[str, Any]:
    """llama.cpp ``timings`` (simulated device ms) first, then the simulator's own fields (TTFT, TPOT,
    ITL, E2E, queue time, host/device split: ``Timings.to_dict``), so a client can rebuild the result."""
    t = res.timings
    base = {"cache_n": t.cache_n, "prompt_n": t.prompt_n, "prompt_ms": t.prompt_ms,
            "prompt_per_token_ms": t.prompt_per_token_ms, "prompt_per_second": t.prompt_per_second,
            "predicted_n": t.predicted_n, "predicted_ms": t.predicted_ms,
            "predicted_per_token_ms": t.predicted_per_token_ms, "predicted_per_second": t.predicted_per_second}
    return {**base, **{k: v for k, v in t.to_dict().items() if k not in base}}


def result_extension(res: RequestResult) -> dict[str, Any]:
    """The ``calconsole`` key of a final chunk / response: what OpenAI's shapes cannot say (the engine's
    request id, llama.cpp's stop type and word, token ids, status, error, seed). Clients ignore it."""
    return {"request_id": res.request_id, "status": res.status, "stop_type": res.stop_type,
            "stopping_word": res.stopping_word, "tokens": list(res.tokens), "error": res.error, "seed": res.seed}


def usage(res: RequestResult) -> dict[str, Any]:
    prompt = res.timings.prompt_n + res.timings.cache_n
    return {"completion_tokens": res.timings.predicted_n, "prompt_tokens": prompt,
            "total_tokens": prompt + res.timings.predicted_n,
            "prompt_tokens_details": {"cached_tokens": res.timings.cache_n}}


def generation_settings(req: ChatRequest, n_ctx: int, model: str) -> dict[str, Any]:
    return {"n_predict": req.max_tokens if req.max_tokens != n_ctx else -1, **msgspec.structs.asdict(req.sampling),
            "stop": list(req.stop), "n_ctx": n_ctx, "model": model, "cache_prompt": req.cache_prompt,
            "id_slot": req.id_slot}


def chat_completion(res: RequestResult, cid: str, created: int, model: str, fingerprint: str) -> dict[str, Any]:
    return {"choices": [{"finish_reason": finish_reason(res), "index": 0,
                         "message": {"role": "assistant", "content": res.text}}],
            "created": created, "model": model, "system_fingerprint": fingerprint, "object": "chat.completion",
            "usage": usage(res), "id": cid, "timings": timings(res), "calconsole": result_extension(res)}


def chat_chunk(cid: str, created: int, model: str, fingerprint: str, delta: dict[str, Any],
               finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], "created": created, "id": cid,
            "model": model, "system_fingerprint": fingerprint, "object": "chat.completion.chunk"}


def text_completion(res: RequestResult, cid: str, created: int, model: str, fingerprint: str) -> dict[str, Any]:
    return {"choices": [{"text": res.text, "index": 0, "logprobs": None, "finish_reason": finish_reason(res)}],
            "created": created, "model": model, "system_fingerprint": fingerprint, "object": "text_completion",
            "usage": usage(res), "id": cid, "timings": timings(res)}


def text_chunk(cid: str, created: int, model: str, fingerprint: str, text: str,
               finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}], "created": created,
            "id": cid, "model": model, "system_fingerprint": fingerprint, "object": "text_completion"}


def native_completion(res: RequestResult, req: ChatRequest, n_ctx: int, model: str, *, id_slot: int,
                      return_tokens: bool, stream: bool, prompt: str = "") -> dict[str, Any]:
    """llama.cpp ``/completion`` final result (in a stream: its last chunk, ``content`` then empty).
    ``prompt``: the prompt as the model saw it (its token ids detokenized, as llama-server echoes it)."""
    t = res.timings
    return {"index": 0, "content": "" if stream else res.text,
            "tokens": list(res.tokens) if return_tokens and not stream else [], "id_slot": id_slot, "stop": True,
            "model": model, "tokens_predicted": t.predicted_n, "tokens_evaluated": t.prompt_n + t.cache_n,
            "generation_settings": generation_settings(req, n_ctx, model), "prompt": prompt,
            "has_new_line": "\n" in res.text, "truncated": False, "stop_type": res.stop_type,
            "stopping_word": res.stopping_word, "tokens_cached": t.cache_n, "timings": timings(res)}
