"""``POST /infill``: llama-server's fill-in-the-middle completion.

The prompt is built as llama-server builds it (``format_prompt_infill`` in llama.cpp's
tools/server/server-common.cpp, its checks in server-context.cpp's infill operation), then generated and
answered as ``/completion`` answers (same body fields, same response shape):

    [FIM_REP]myproject\\n                       (when the vocabulary has a repo token; Qwen3's <|repo_name|>)
    [FIM_SEP]{filename}\\n{text}                 per ``input_extra`` chunk (filename default "tmp")
    [FIM_SEP]filename\\n
    [FIM_PRE]{input_prefix}{prompt}[FIM_SUF]{input_suffix}[FIM_MID]

the prefix cut to its last ``3*(n_batch/4)`` tokens, the suffix to its first ``max(0, n_batch/4 - (2 +
len(prompt)))``, the extra context to its last ``min(max(0, n_ctx - n_batch - 2*n_predict), len)`` tokens
(``n_predict`` the server's ``-n``, -1 by default, as there); ``--spm-infill`` puts the suffix part first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from . import wire
from .wire import HTTPError

if TYPE_CHECKING:
    from .context import ServingFace

#: the special tokens' texts in Qwen3's vocabulary (llama.cpp finds its FIM tokens by these texts)
FIM_TEXTS = {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>", "rep": "<|repo_name|>",
             "sep": "<|file_sep|>"}
#: llama-server's names of the three required tokens in its 501
_NEEDED = (("pre", "prefix"), ("suf", "suffix"), ("mid", "middle"))


@dataclass(frozen=True)
class FimTokens:
    """The vocabulary's FIM token ids (None: the vocabulary has none)."""

    pre: int | None
    suf: int | None
    mid: int | None
    rep: int | None
    sep: int | None

    def missing(self) -> str:
        """llama-server's 501 words for the missing required tokens ("" when none is missing)."""
        gone = "".join(f"{name} token is missing. " for key, name in _NEEDED if getattr(self, key) is None)
        return f"Infill is not supported by this model: {gone}" if gone else ""


def fim_tokens(tokenize_special: Callable[[str], list[int]]) -> FimTokens:
    """Each FIM text that ``tokenize_special`` (specials parsed) gives as one id is the vocabulary's token."""
    ids = {}
    for key, text in FIM_TEXTS.items():
        got = tokenize_special(text)
        ids[key] = got[0] if len(got) == 1 else None
    return FimTokens(**ids)


def _json_type(v: Any) -> str:
    """nlohmann::json's type name of a JSON value (llama-server's type errors name it)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return "string" if isinstance(v, str) else "array" if isinstance(v, list) else "object"


def _mixed(v: Any, tokenize: Callable[[str], list[int]]) -> list[int]:
    """llama-server's ``tokenize_mixed`` without special tokens: a string, or a list of strings and ids.
    400 with nlohmann's words for another type, as llama-server answers."""
    if isinstance(v, str):
        return tokenize(v)
    if not isinstance(v, list):
        raise wire.bad_request(f"[json.exception.type_error.302] type must be string, but is {_json_type(v)}")
    out: list[int] = []
    for p in v:
        if isinstance(p, str):
            out += tokenize(p)
        elif isinstance(p, (int, float)):  # nlohmann reads a boolean as a number too: true is id 1
            out.append(int(p))
        else:
            raise wire.bad_request(f"[json.exception.type_error.302] type must be number, but is {_json_type(p)}")
    return out


def check_body(body: Mapping[str, Any]) -> list[dict[str, str]]:
    """The body's ``input_extra`` chunks after llama-server's checks, in its order and words (400):
    ``input_extra`` a list of ``{"text": string, "filename": string (optional)}``, then ``input_suffix`` and
    ``input_prefix`` present (nlohmann's out_of_range words; the suffix is looked up first there)."""
    extra: Any = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise wire.bad_request('"input_extra" must be an array of {"filename": string, "text": string}')
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise wire.bad_request('extra_context chunk must contain a "text" field with a string value')
        if "filename" in chunk and not isinstance(chunk["filename"], str):
            raise wire.bad_request('extra_context chunk\'s "filename" field must be a string')
    for key in ("input_suffix", "input_prefix"):
        if key not in body:
            raise wire.bad_request(f"[json.exception.out_of_range.403] key '{key}' not found")
    return list(extra)


def infill_prompt(body: Mapping[str, Any], fim: FimTokens, tokenize: Callable[[str], list[int]],
                  prompt_tokens: Sequence[int], *, n_batch: int, n_predict: int, n_ctx: int,
                  spm_infill: bool = False) -> list[int]:
    """The token ids of llama-server's infill prompt (module docstring). ``tokenize``: text -> ids with no
    special tokens parsed; ``prompt_tokens``: the body's ``prompt`` (specials parsed). 400 as ``check_body``
    and for an ``input_prefix`` / ``input_suffix`` that is neither a string nor a list of strings and ids."""
    assert fim.pre is not None and fim.suf is not None and fim.mid is not None
    extra_chunks = check_body(body)
    prefix = _mixed(body["input_prefix"], tokenize)
    suffix = _mixed(body["input_suffix"], tokenize)
    extra: list[int] = []
    if fim.rep is not None:
        extra += [fim.rep, *tokenize("myproject\n")]
    for chunk in extra_chunks:
        if fim.sep is not None:
            extra += [fim.sep, *tokenize(chunk.get("filename", "tmp") + "\n")]
        else:  # llama-server's chunk separator when the vocabulary has no file separator
            extra += tokenize("\n\n--- snippet ---\n\n")
        extra += tokenize(chunk["text"])
    if fim.sep is not None:
        extra += [fim.sep, *tokenize("filename\n")]
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt_tokens))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    pre = [fim.pre, *prefix[len(prefix) - n_prefix:], *prompt_tokens]
    suf = [fim.suf, *suffix[:n_suffix]]
    first, last = (suf, pre) if spm_infill else (pre, suf)
    return [*extra[len(extra) - n_extra:], *first, *last, fim.mid]


async def infill(face: ServingFace, request: Request) -> Response:
    """``POST /infill``: 501 (llama-server's words) when the vocabulary lacks a FIM token, else the
    prompt built here answered by ``/completion``'s code."""
    from .routes_generate import completion_of

    body = await face.read_json(request)
    inference = face.inference

    def build() -> list[int]:
        fim = fim_tokens(lambda t: inference.tokenize(t, parse_special=True))
        if fim.missing():
            raise HTTPError(501, "not_supported_error", fim.missing())
        check_body(body)
        prompt = body.get("prompt")
        ids = inference.tokenize(prompt, parse_special=True) if isinstance(prompt, str) and prompt else []
        return infill_prompt(body, fim, lambda t: inference.tokenize(t, parse_special=False), ids,
                             n_batch=face.config.n_batch, n_predict=face.config.n_predict, n_ctx=face.n_ctx,
                             spm_infill=face.config.spm_infill)

    tokens = await face.call(build)
    return await completion_of(face, {**body, "prompt": tokens}, request)
