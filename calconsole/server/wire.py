"""Request parsing and response shapes of llama-server and the OpenAI API (no I/O here).

Errors are llama-server's: ``{"error": {"code": <http status>, "message": str, "type": str}}``
with its types (``invalid_request_error`` 400, ``exceed_context_size_error`` 400 with
``n_prompt_tokens`` / ``n_ctx``, ``authentication_error`` 401, ``permission_error`` 403,
``not_found_error`` 404, ``server_error`` 500, ``not_supported_error`` 501,
``unavailable_error`` 503).

Token accounting as llama-server counts it: ``usage.prompt_tokens`` is the whole prompt
(cached tokens included; ``prompt_tokens_details.cached_tokens`` says how many were reused),
``completion_tokens`` the tokens generated (EOS included), ``finish_reason`` ``stop`` for an
EOS or a stop word and ``length`` for the token or context limit. ``timings`` are llama-server's
nine numbers (simulated device milliseconds, host work booked on that clock); the simulator's own
fields ride in the ``calconsole`` key (``calconsole.codec``).

Public helpers for the routes: ``flag`` / ``integer`` (typed body fields, 400 naming the field),
``template_options`` (``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``),
``stream_options``.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from sim_backend.planes import (
    CalError,
    ChatRequest,
    ExceedContextSizeError,
    Grammar,
    InvalidRequestError,
    ProgressEvent,
    RequestError,
    RequestResult,
    SamplingParams,
    seed_or_random,
)

from .. import __version__
from ..codec import llama_timings, result_extension
from .httperror import HTTPError as HTTPError
from .httperror import bad_request as bad_request
from .logprobs import probs_request

#: sampling fields a body may carry (llama.cpp names; OpenAI's temperature / top_p / penalties / seed among them)
SAMPLING_FIELDS = SamplingParams.__struct_fields__
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: llama-server's seed for "no seed given" (LLAMA_DEFAULT_SEED: a random one is drawn)
DEFAULT_SEED = 4294967295
_V = [int(x) if x.isdigit() else 0 for x in (__version__.split(".") + ["0", "0"])[:3]]
#: the build number in llama-server's ``b<build>-<commit>`` form (clients check ``startswith("b")``):
#: calconsole's version as one integer (0.1.0 -> 100), "sim" for the commit
BUILD_INFO = f"b{_V[0] * 10000 + _V[1] * 100 + _V[2]}-calconsole-sim"
#: the samplers llama-server lists, in its order, and the neutral values of the ones the simulator
#: does not run (reported as in effect: they are off)
SAMPLERS = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
_OFF_SAMPLERS: dict[str, Any] = {
    "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
    "xtc_threshold": 0.1, "typical_p": 1.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
    "dry_penalty_last_n": 64, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "adaptive_target": -1.0,
    "adaptive_decay": 0.9}
MAX_STOP_WORDS = 16
MAX_MESSAGES = 1024


def dumps(obj: Any) -> str:
    """Compact JSON, as llama-server writes it (``data: {...}`` lines byte for byte)."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


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
    if kind == "invalid_request_error":  # refused once admitted (admission.NO_LOGITS): the request's, not ours
        return HTTPError(400, "invalid_request_error", msg)
    return HTTPError(500, "server_error", f"{kind}: {msg}" if kind else msg)


# --- request fields ------------------------------------------------------------------------------

def integer(body: Mapping[str, Any], name: str, default: int | None = None, *, lo: int | None = None,
            hi: int | None = None) -> int | None:
    """``body[name]`` as an int (``default`` when absent or null); 400 naming the field if it is not an
    integer or is outside [lo, hi]."""
    v = body.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{name}' must be an integer, got {type(v).__name__}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise bad_request(f"'{name}' must be in [{lo}, {hi}], got {v}" if hi is not None
                          else f"'{name}' must be >= {lo}, got {v}")
    return v


def flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    """``body[name]`` as a bool (``default`` when absent or null); 400 naming the field otherwise."""
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
        kw[name] = seed_or_random(v) if name == "seed" else v  # -1 / 4294967295: random, as llama-server
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
            v = integer(body, name, lo=-1)
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
    # the last message's rules (a trailing assistant message is a prefill, two are refused unless
    # continue_final_message) are the chat template's: ChatRequest.continue_final_message
    return tuple(out)


def stream_options(body: Mapping[str, Any]) -> bool:
    """``stream_options.include_usage`` (OpenAI): whether a stream ends with a usage chunk."""
    opts = body.get("stream_options") or {}
    if not isinstance(opts, Mapping):
        raise bad_request("'stream_options' must be an object")
    return flag(opts, "include_usage", False)


def template_options(body: Mapping[str, Any], *, thinking_default: bool = False,
                     server_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The chat template's request fields as llama-server reads them, as ``ChatRequest`` /
    ``apply_template`` keywords: ``enable_thinking``, ``add_generation_prompt``, ``continue_final_message``,
    ``template_kwargs``. 400 naming the field for a wrong type.

    - ``chat_template_kwargs``: template variables (any JSON values) over the server's
      (``--chat-template-kwargs``); its ``enable_thinking`` (a boolean; a string is llama-server's 400)
      sets the thinking mode, else a top-level ``enable_thinking`` (calconsole's), else
      ``reasoning_effort: "none"`` turns it off, else ``thinking_default`` (llama-server's: on when the
      template has a thinking mode). Another ``reasoning_effort`` is a template variable, as llama-server
      gives it.
    - ``add_generation_prompt`` (default true) and ``continue_final_message`` (true or ``"content"``; false):
      see ``ChatRequest``. ``"reasoning_content"`` is refused: messages carry no reasoning content here.
    """
    kw_body = body.get("chat_template_kwargs")
    if kw_body is not None and not isinstance(kw_body, Mapping):
        raise bad_request("'chat_template_kwargs' must be an object")
    kwargs: dict[str, Any] = {**(server_kwargs or {}), **(kw_body or {})}
    think: bool | None = None
    if "enable_thinking" in kwargs and kwargs["enable_thinking"] is not None:
        v = kwargs.pop("enable_thinking")
        if isinstance(v, str):  # llama-server's words
            raise bad_request('invalid type for "enable_thinking" (expected boolean, got string)')
        if not isinstance(v, bool):
            raise bad_request(f"'chat_template_kwargs.enable_thinking' must be true or false, got {type(v).__name__}")
        think = v
    kwargs.pop("enable_thinking", None)
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request(f"'reasoning_effort' must be a string, got {type(effort).__name__}")
    if think is None and body.get("enable_thinking") is not None:
        think = flag(body, "enable_thinking", False)
    if think is None and effort == "none":
        think = False
    if effort is not None and effort != "none":
        kwargs.setdefault("reasoning_effort", effort)
    cfm = body.get("continue_final_message")
    if cfm is None or cfm is False:
        cont = False
    elif cfm is True or cfm == "content":
        cont = True
    elif cfm == "reasoning_content":
        raise bad_request("'continue_final_message': \"reasoning_content\" is not supported by this server "
                          "(messages carry no reasoning content); continue the content instead")
    else:  # llama-server's words
        raise bad_request('Invalid continue_final_message: expected a boolean, "content" or "reasoning_content"')
    return {"enable_thinking": thinking_default if think is None else think,
            "add_generation_prompt": flag(body, "add_generation_prompt", True), "continue_final_message": cont,
            "template_kwargs": kwargs or None}


def thinking(body: Mapping[str, Any], default: bool = False) -> bool:
    """The thinking mode a body asks for (``template_options``' ``enable_thinking``)."""
    return bool(template_options(body, thinking_default=default)["enable_thinking"])


def chat_request(body: Mapping[str, Any], *, n_ctx: int, n_predict: int, client: str,
                 template: Mapping[str, Any] | None = None,
                 logit_bias: tuple[tuple[int, float], ...] = ()) -> ChatRequest:
    """``/v1/chat/completions`` body -> ChatRequest (400 naming the field for anything wrong).
    ``template``: the body's ``template_options`` (default: read here with thinking off by default);
    ``logit_bias``: the body's, as ``logit_bias_from`` read it (it needs the model's tokenizer)."""
    choices_of(body)
    n_probs, post = probs_request(body, chat=True)
    if body.get("tools"):
        raise HTTPError(400, "invalid_request_error", "'tools' is not supported by this server")
    slot = integer(body, "id_slot", -1, lo=-1)
    return ChatRequest(messages=messages_from(body),
                       max_tokens=max_tokens_from(body, ("max_completion_tokens", "max_tokens", "n_predict"),
                                                  n_ctx, n_predict),
                       sampling=sampling_from(body), stop=stop_from(body),
                       client=client, id_slot=-1 if slot is None else slot,
                       cache_prompt=flag(body, "cache_prompt", True), ignore_eos=flag(body, "ignore_eos", False),
                       n_probs=n_probs, post_sampling_probs=post, grammar=grammar_from(body),
                       logit_bias=logit_bias, return_progress=return_progress(body), **_shift(body),
                       **(template_options(body) if template is None else template))


#: prompts one /completion body may ask for (llama-server has no limit; each takes a generation slot)
MAX_PROMPTS = 16


#: an object key that is a token id: what C's ``strtol(key, &end, 10)`` reads to the key's end (llama-server's
#: test ``*end == 0``): blanks, a sign, digits; an empty key reads as id 0 there, and does here
_ID_KEY = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")
#: the largest finite float32 (llama-server keeps a bias as a C ``float``: a larger one is +-inf there)
_FLT_MAX = 3.4028234663852886e38
#: a bias of -inf bans the token; in JSON it is ``false`` (llama-server's spelling; JSON has no -inf)
BAN = -math.inf


def _bias_value(v: Any, where: str) -> float:
    """A bias as llama-server keeps one: a number as a C ``float`` (rounded to float32; beyond its range +-inf,
    as llama-server's ``get<float>()`` makes it), ``false`` for -inf (a ban). 400 for anything else (llama-server
    skips the entry without a word: the client would never learn its bias did nothing)."""
    if v is False:
        return BAN
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad_request(f"'logit_bias' {where}: a bias must be a number, or false to ban the token; "
                          f"got {json.dumps(v)[:40]}")
    f = float(v)
    if not math.isfinite(f):  # NaN / Infinity / 1e999 literals: llama-server's JSON parser refuses them (400)
        raise bad_request(f"'logit_bias' {where}: a bias must be a finite number (false bans the token)")
    if abs(f) > _FLT_MAX:
        return math.copysign(math.inf, f)
    try:
        return float(struct.unpack("<f", struct.pack("<f", f))[0])
    except OverflowError:  # rounds past the largest float32
        return math.copysign(math.inf, f)


def logit_bias_from(body: Mapping[str, Any], tokenize: Callable[[str], Sequence[int]],
                    n_vocab: int) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` read as llama-server's ``params_from_json_cmpl`` reads it, in the order given:

    - a list of ``[key, bias]`` pairs: ``key`` a token id (an integer) or a string, each of whose tokens
      (``tokenize``: no special tokens parsed, none added) gets the bias;
    - an object ``{key: bias}`` (OpenAI's form): a key ``strtol`` reads whole (``"15"``, ``" +15"``; ``""`` is
      id 0, as there) is a token id, any other key a string to tokenize;
    - ``bias``: a number (a float32, as there), or ``false`` to ban the token (-inf);
    - a token id outside ``[0, n_vocab)`` is skipped, as llama-server skips it (ids of another model's
      vocabulary); ``null`` / ``[]`` / ``{}``: no bias.

    400 ``invalid_request_error`` for what llama-server skips without a word: ``logit_bias`` of another type, an
    entry that is not a ``[key, bias]`` pair, a key that is neither an integer nor a string, a bias that is not a
    number or ``false``. Returns (token id, bias) pairs; an id may repeat (its biases add up when applied)."""
    lb = body.get("logit_bias")
    out: list[tuple[int, float]] = []

    def add_id(tok: int, bias: float) -> None:
        if 0 <= tok < n_vocab:
            out.append((tok, bias))

    if lb is None:
        return ()
    if isinstance(lb, list):
        for i, el in enumerate(lb):
            if not isinstance(el, list) or len(el) != 2:
                raise bad_request(f"'logit_bias[{i}]' must be a [token, bias] pair (token: an id or a string), "
                                  f"got {json.dumps(el)[:40]}")
            key, bias = el[0], _bias_value(el[1], f"[{i}]")
            if isinstance(key, int) and not isinstance(key, bool):
                add_id(key, bias)
            elif isinstance(key, str):
                out.extend((int(t), bias) for t in tokenize(key))
            else:
                raise bad_request(f"'logit_bias[{i}]': the token must be an integer id or a string, "
                                  f"got {json.dumps(key)[:40]}")
    elif isinstance(lb, Mapping):
        for key, value in lb.items():
            bias = _bias_value(value, f"[{json.dumps(key)[:40]}]")
            if key == "" or _ID_KEY.fullmatch(key):
                add_id(int(key) if key else 0, bias)
            else:
                out.extend((int(t), bias) for t in tokenize(key))
    else:
        raise bad_request("'logit_bias' must be a list of [token, bias] pairs or an object {token: bias} "
                          f"(token: an id or a string; bias: a number, or false to ban it), got {type(lb).__name__}")
    return tuple(out)


def logit_bias_setting(pairs: Sequence[tuple[int, float]]) -> list[dict[str, Any]]:
    """``generation_settings.logit_bias`` entries of (token id, bias) pairs, as llama-server writes them: a
    non-finite bias (a ban) is null (nlohmann writes non-finite numbers as null)."""
    return [{"bias": b if math.isfinite(b) else None, "token": int(t)} for t, b in pairs]


def _schema_text(schema: Any, name: str) -> str:
    if not isinstance(schema, (Mapping, bool)):
        raise bad_request(f"'{name}' must be a JSON schema (an object), got {type(schema).__name__}")
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def grammar_from(body: Mapping[str, Any]) -> Grammar | None:
    """The constraint of a body (llama-server's fields), or None. ``grammar`` (GBNF text; llama-server's
    ``%llguidance`` Lark too) wins over a schema; then ``response_format`` (``json_object``: its ``schema``,
    else any JSON object; ``json_schema``: ``json_schema.schema``, else any JSON value; ``text``: none),
    then ``json_schema``. llama-server honours ``response_format`` on chat only; here on every generation
    route. 400 for a field of the wrong type or another ``response_format.type`` (llama-server's words).
    Whether the grammar compiles is the engine's check (also 400)."""
    g = body.get("grammar")
    if g is not None and not isinstance(g, str):
        raise bad_request(f"'grammar' must be a string (GBNF), got {type(g).__name__}")
    if g:
        return Grammar("gbnf", g)
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, Mapping):
            raise bad_request(f"'response_format' must be an object, got {type(rf).__name__}")
        kind = rf.get("type")
        if kind == "json_object":
            schema = rf.get("schema")
            return Grammar("json_schema", _schema_text({"type": "object"} if schema is None else schema,
                                                       "response_format.schema"))
        if kind == "json_schema":
            wrap = rf.get("json_schema")
            if wrap is None:
                wrap = {}
            if not isinstance(wrap, Mapping):
                raise bad_request("'response_format.json_schema' must be an object ({\"name\": ..., \"schema\": ...})")
            schema = wrap.get("schema")
            return Grammar("json_schema", _schema_text({} if schema is None else schema,
                                                       "response_format.json_schema.schema"))
        if kind not in (None, "", "text"):
            raise bad_request(f'response_format type must be one of "text" or "json_object", but got: {kind}')
    js = body.get("json_schema")
    if js is not None:
        return Grammar("json_schema", _schema_text(js, "json_schema"))
    return None


def grammar_setting(g: Grammar | None) -> str:
    """``generation_settings.grammar`` as llama-server reports it: the GBNF given, or for a schema the
    llguidance grammar it compiles (``%llguidance {}\nstart: %json <schema>``); "" for none."""
    if g is None:
        return ""
    return g.text if g.kind == "gbnf" else "%llguidance {}\nstart: %json " + g.text


#: choices one request may ask for (``n``); each takes a generation place
MAX_CHOICES = 8


def choices_of(body: Mapping[str, Any]) -> int:
    """``n``: how many choices (OpenAI), 1..``MAX_CHOICES``; 400 naming the field otherwise."""
    n = integer(body, "n", 1, lo=1, hi=MAX_CHOICES)
    return 1 if n is None else n


def prompts_from(body: Mapping[str, Any]) -> list[Any]:
    """``prompt`` split as llama-server splits it: a string, or a list holding a token id anywhere (ids,
    or ids mixed with strings) is one prompt; any other list (strings, id lists, prompt objects
    ``{"prompt_string": ...}``) is one prompt per element. Each item is then given to
    ``prompt_tokens_from`` as a ``prompt``. 400 for an empty list, a bad element or over ``MAX_PROMPTS``."""
    p = body.get("prompt")
    if p is None:
        raise bad_request("'prompt' is required")
    if isinstance(p, str):
        return [p]
    if not isinstance(p, list):
        raise bad_request("'prompt' must be a string, a list of token ids, or a list of prompts")
    if not p:
        raise bad_request("'prompt' must not be empty")
    if any(isinstance(x, int) and not isinstance(x, bool) for x in p):
        return [p]  # ids, or ids mixed with strings: one prompt
    if len(p) > MAX_PROMPTS:
        raise bad_request(f"'prompt' holds {len(p)} prompts; at most {MAX_PROMPTS}")
    out: list[Any] = []
    for i, x in enumerate(p):
        if isinstance(x, dict):
            x = x.get("prompt_string")
            if not isinstance(x, str):
                raise bad_request(f"'prompt[{i}]': a prompt object needs a 'prompt_string' string "
                                  "(multimodal data is not supported)")
        if not isinstance(x, (str, list)):
            raise bad_request(f"'prompt[{i}]' must be a string, a list of token ids or a prompt object")
        out.append(x)
    return out


def prompt_tokens_from(body: Mapping[str, Any], tokenize: Any) -> tuple[int, ...]:
    """One prompt (``body["prompt"]``: text, token ids, or a mix of both, as llama.cpp) -> token ids."""
    p = body.get("prompt")
    if p is None:
        raise bad_request("'prompt' is required")
    if isinstance(p, str):
        items: list[Any] = [p]
    elif isinstance(p, list):
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
                       openai: bool, logit_bias: tuple[tuple[int, float], ...] = ()) -> ChatRequest:
    """``/completion`` (llama.cpp) or ``/v1/completions`` (OpenAI) body with one prompt (``body["prompt"]``,
    as ``prompts_from`` split it) -> a raw-prompt ChatRequest. ``logit_bias``: the body's (``logit_bias_from``)."""
    if openai:
        choices_of(body)
    n_probs, post = probs_request(body, chat=False)
    names = ("max_tokens", "n_predict") if openai else ("n_predict", "max_tokens")
    slot = integer(body, "id_slot", -1, lo=-1)
    return ChatRequest(messages=(), prompt_tokens=prompt_tokens_from(body, tokenize),
                       max_tokens=max_tokens_from(body, names, n_ctx, n_predict), sampling=sampling_from(body),
                       stop=stop_from(body), client=client, id_slot=-1 if slot is None else slot,
                       cache_prompt=flag(body, "cache_prompt", True), ignore_eos=flag(body, "ignore_eos", False),
                       n_probs=n_probs, post_sampling_probs=post, grammar=grammar_from(body),
                       logit_bias=logit_bias, return_progress=return_progress(body), **_shift(body))


def _shift(body: Mapping[str, Any]) -> dict[str, Any]:
    """llama-server's context-shift fields of a request: ``n_keep`` (prompt tokens a shift keeps, -1 = all;
    default 0) and ``n_discard`` (tokens a shift drops, 0 = half; default 0); 400 for a non-integer or one
    below -1 / 0."""
    keep = integer(body, "n_keep", 0, lo=-1)
    discard = integer(body, "n_discard", 0, lo=0)
    return {"n_keep": 0 if keep is None else keep, "n_discard": 0 if discard is None else discard}


def return_progress(body: Mapping[str, Any]) -> bool:
    """llama-server's ``return_progress``: prompt-progress chunks, in stream mode only (a request that does not
    stream gets none, as there). 400 naming the field for a value that is not a boolean (llama-server ignores
    such a value with a warning in its log; the client would not learn why no progress came)."""
    asked = flag(body, "return_progress", False)
    return asked and flag(body, "stream", False)


# --- response shapes ------------------------------------------------------------------------------

def finish_reason(res: RequestResult) -> str:
    return "stop" if res.stop_type in ("eos", "word") else "length"


def timings(res: RequestResult) -> dict[str, int | float]:
    """llama-server's ``timings`` (simulated device ms; numbers only). The simulator's own fields
    (TTFT, TPOT, ITL, E2E, queue, host/device split) are in ``result_extension(res)["timings"]``."""
    return llama_timings(res.timings)


def usage(res: RequestResult) -> dict[str, Any]:
    prompt = res.timings.prompt_n + res.timings.cache_n
    return {"completion_tokens": res.timings.predicted_n, "prompt_tokens": prompt,
            "total_tokens": prompt + res.timings.predicted_n,
            "prompt_tokens_details": {"cached_tokens": res.timings.cache_n}}


def sampling_settings(sp: SamplingParams, *, n_predict: int, stream: bool = False,
                      per_token: bool = False, ignore_eos: bool = False, n_probs: int = 0,
                      post_sampling_probs: bool = False, n_keep: int = 0, n_discard: int = 0) -> dict[str, Any]:
    """llama-server's sampling ``params`` (as ``/props`` and ``/slots`` give them): ours where the simulator
    samples with them, llama.cpp's neutral values for the samplers it does not run (they are off);
    ``seed`` is the one asked for, ``DEFAULT_SEED`` for none (the drawn one is ``calconsole.seed``)."""
    d = msgspec.structs.asdict(sp)
    return {"seed": DEFAULT_SEED if d["seed"] is None else d["seed"], "temperature": d["temperature"],
            "dynatemp_range": _OFF_SAMPLERS["dynatemp_range"], "dynatemp_exponent": _OFF_SAMPLERS["dynatemp_exponent"],
            "top_k": d["top_k"], "top_p": d["top_p"], "min_p": d["min_p"], "top_n_sigma": _OFF_SAMPLERS["top_n_sigma"],
            "xtc_probability": _OFF_SAMPLERS["xtc_probability"], "xtc_threshold": _OFF_SAMPLERS["xtc_threshold"],
            "typical_p": _OFF_SAMPLERS["typical_p"], "repeat_last_n": d["repeat_last_n"],
            "repeat_penalty": d["repeat_penalty"], "presence_penalty": d["presence_penalty"],
            "frequency_penalty": d["frequency_penalty"],
            **{k: _OFF_SAMPLERS[k] for k in ("dry_multiplier", "dry_base", "dry_allowed_length", "dry_penalty_last_n",
                                             "mirostat", "mirostat_tau", "mirostat_eta", "adaptive_target",
                                             "adaptive_decay")},
            "max_tokens": n_predict, "n_predict": n_predict, "n_keep": n_keep, "n_discard": n_discard,
            "ignore_eos": ignore_eos,
            "stream": stream, "n_probs": n_probs, "min_keep": 0, "chat_format": "Content-only",
            "reasoning_format": "none", "reasoning_in_content": False, "generation_prompt": "",
            "samplers": list(SAMPLERS),
            "speculative.types": "none", "timings_per_token": per_token, "post_sampling_probs": post_sampling_probs,
            "backend_sampling": False, "lora": []}


def generation_settings(req: ChatRequest, n_ctx: int, *, stream: bool = False,
                        per_token: bool = False, eog_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """llama-server's ``generation_settings`` of a ``/completion`` result: the sampling params plus the
    stop words, ``logit_bias`` (always present: the request's (token, bias) pairs in its order, then with
    ``ignore_eos`` each of the model's end-of-generation ids ``eog_ids``, as llama-server appends them; a ban's
    -inf is null there, ``logit_bias_setting``), the grammar (``grammar_setting``; never lazy) and
    ``dry_sequence_breakers``, in llama-server's key order."""
    n_predict = req.max_tokens if req.max_tokens is not None and req.max_tokens != n_ctx else -1
    base = sampling_settings(req.sampling, n_predict=n_predict, stream=stream, per_token=per_token,
                             ignore_eos=req.ignore_eos, n_probs=req.n_probs,
                             post_sampling_probs=req.post_sampling_probs, n_keep=req.n_keep,
                             n_discard=req.n_discard)
    out: dict[str, Any] = {}
    for k, v in base.items():
        if k == "mirostat":
            out["dry_sequence_breakers"] = ["\n", ":", "\"", "*"]
        if k == "max_tokens":
            out["stop"] = list(req.stop)
        if k == "n_probs":  # -inf is null in llama-server's JSON (nlohmann writes non-finite numbers as null)
            eog = [(t, BAN) for t in eog_ids] if req.ignore_eos else []
            out["logit_bias"] = logit_bias_setting([*req.logit_bias, *eog])
        if k == "chat_format":
            out.update(grammar=grammar_setting(req.grammar), grammar_lazy=False, grammar_triggers=[],
                       preserved_tokens=[])
        out[k] = v
    return out


def native_chunk(text: str, tokens: list[int], *, id_slot: int, n_predicted: int, n_evaluated: int,
                 timings: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed ``/completion`` chunk: the piece, its token ids, the counts so far (llama-server's shape)."""
    c: dict[str, Any] = {"index": 0, "content": text, "tokens": tokens, "stop": False, "id_slot": id_slot,
                         "tokens_predicted": n_predicted, "tokens_evaluated": n_evaluated}
    if timings is not None:
        c["timings"] = timings
    return c


def native_progress_chunk(ev: ProgressEvent, *, index: int, id_slot: int) -> dict[str, Any]:
    """A streamed ``/completion`` prompt-progress chunk, as llama-server sends it (``return_progress``): an empty
    piece (its ``tokens`` the placeholder id 0 llama-server's partial result carries: no token was generated,
    ``tokens_predicted`` says 0) with ``prompt_progress`` {total, cache, processed, time_ms}."""
    c = native_chunk("", [0], id_slot=id_slot, n_predicted=0, n_evaluated=ev.total)
    c["index"] = index
    c["prompt_progress"] = ev.to_json()
    return c


def prefill_of(req: ChatRequest) -> str:
    """The text a chat request's reply continues (its trailing assistant message, or its last message with
    ``continue_final_message``), else "": llama-server returns it with the continuation."""
    m = req.messages
    if m and (req.continue_final_message or m[-1]["role"] == "assistant"):
        return str(m[-1]["content"])
    return ""


def usage_of(results: list[RequestResult]) -> dict[str, Any]:
    """``usage`` of several choices or prompts: completion tokens summed (OpenAI's count), prompt tokens
    once per distinct request (n choices of one prompt share it)."""
    u = [usage(r) for r in results]
    return {"completion_tokens": sum(x["completion_tokens"] for x in u), "prompt_tokens": u[0]["prompt_tokens"],
            "total_tokens": u[0]["prompt_tokens"] + sum(x["completion_tokens"] for x in u),
            "prompt_tokens_details": {"cached_tokens": u[0]["prompt_tokens_details"]["cached_tokens"]}}


def chat_completion(results: RequestResult | list[RequestResult], cid: str, created: int, model: str,
                    fingerprint: str, prefill: str = "") -> dict[str, Any]:
    """``/v1/chat/completions`` response, one choice per result (``n``); ``prefill``: the assistant message
    it continued (llama-server returns it with the continuation; a stream sends the continuation only)."""
    rs = results if isinstance(results, list) else [results]
    out = {"choices": [{"finish_reason": finish_reason(r), "index": i,
                        "message": {"role": "assistant", "content": prefill + r.text}} for i, r in enumerate(rs)],
           "created": created, "model": model, "system_fingerprint": fingerprint, "object": "chat.completion",
           "usage": usage(rs[0]) if len(rs) == 1 else usage_of(rs), "id": cid, "timings": timings(rs[0]),
           "calconsole": result_extension(rs[0])}
    if len(rs) > 1:
        out["calconsole"] = {**result_extension(rs[0]), "choices": [result_extension(r) for r in rs]}
    return out


def chat_chunk(cid: str, created: int, model: str, fingerprint: str, delta: dict[str, Any],
               finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"choices": [{"finish_reason": finish, "index": index, "delta": delta}], "created": created, "id": cid,
            "model": model, "system_fingerprint": fingerprint, "object": "chat.completion.chunk"}


def text_completion(results: list[RequestResult], cid: str, created: int, model: str,
                    fingerprint: str) -> dict[str, Any]:
    """``/v1/completions`` response: one choice per prompt (its ``index``), usage summed over them."""
    choices = [{"text": r.text, "index": i, "logprobs": None, "finish_reason": finish_reason(r)}
               for i, r in enumerate(results)]
    u = [usage(r) for r in results]
    total = {"completion_tokens": sum(x["completion_tokens"] for x in u),
             "prompt_tokens": sum(x["prompt_tokens"] for x in u), "total_tokens": sum(x["total_tokens"] for x in u),
             "prompt_tokens_details": {"cached_tokens": sum(x["prompt_tokens_details"]["cached_tokens"] for x in u)}}
    out = {"choices": choices, "created": created, "model": model, "system_fingerprint": fingerprint,
           "object": "text_completion", "usage": total, "id": cid, "timings": timings(results[0])}
    # as chat_completion: the first result's extension, and one per choice when there are several (a list of
    # prompts or ``n``), so each choice's token ids, timings and timing-only reason are there
    ext = result_extension(results[0])
    if len(results) > 1:
        ext["choices"] = [result_extension(r) for r in results]
    out["calconsole"] = ext
    return out


def text_chunk(cid: str, created: int, model: str, fingerprint: str, text: str,
               finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"choices": [{"text": text, "index": index, "logprobs": None, "finish_reason": finish}], "created": created,
            "id": cid, "model": model, "system_fingerprint": fingerprint, "object": "text_completion"}


def tokens_cached(res: RequestResult) -> int:
    """llama-server's ``tokens_cached`` of a ``/completion`` result: the tokens the slot's KV holds once the
    request is done (its ``slot.prompt``: the whole prompt, reused part included, and the reply but its last
    token, which is never fed back), not the reused prefix (that is ``timings.cache_n``), as the real
    llama-server reports it (tests/server/test_parity_llama_server.py ``test_tokens_cached_is_what_the_slot_holds``)."""
    t = res.timings
    return t.prompt_n + t.cache_n + max(0, t.predicted_n - 1) - res.n_discarded  # less what context shifts dropped


def truncated(res: RequestResult, n_ctx: int) -> bool:
    """llama-server's ``truncated``: the context filled, so a shift dropped tokens (``res.truncated``) or the
    reply stopped at the context end (``limit`` with prompt + predicted = ``n_ctx``: the face's ``--ctx-size``
    cuts the generation limit there, ``ServingFace.fit_context``)."""
    t = res.timings
    return res.truncated or (res.stop_type == "limit" and t.prompt_n + t.cache_n + t.predicted_n >= n_ctx)


def native_completion(res: RequestResult, req: ChatRequest, n_ctx: int, model: str, *, id_slot: int,
                      return_tokens: bool, stream: bool, prompt: str = "", index: int = 0,
                      per_token: bool = False, eog_ids: tuple[int, ...] = ()) -> dict[str, Any]:
    """llama.cpp ``/completion`` final result (in a stream: its last chunk, ``content`` then empty).
    ``prompt``: the prompt as the model saw it (its token ids detokenized, as llama-server echoes it);
    ``eog_ids``: the model's end-of-generation ids (``generation_settings``)."""
    t = res.timings
    return {"index": index, "content": "" if stream else res.text,
            "tokens": list(res.tokens) if return_tokens and not stream else [], "id_slot": id_slot, "stop": True,
            "model": model, "tokens_predicted": t.predicted_n, "tokens_evaluated": t.prompt_n + t.cache_n,
            "generation_settings": generation_settings(req, n_ctx, stream=stream, per_token=per_token,
                                                       eog_ids=eog_ids),
            "prompt": prompt,
            "has_new_line": "\n" in res.text, "truncated": truncated(res, n_ctx), "stop_type": res.stop_type,
            "stopping_word": res.stopping_word, "tokens_cached": tokens_cached(res), "timings": timings(res),
            "calconsole": result_extension(res)}
