"""The wire forms the serving face writes and the remote planes read: encode and decode in one place.

A streamed or whole result carries two parts:

- ``timings``: llama-server's nine numbers exactly (``cache_n``, ``prompt_n``, ``prompt_ms``,
  ``prompt_per_token_ms``, ``prompt_per_second``, ``predicted_n``, ``predicted_ms``,
  ``predicted_per_token_ms``, ``predicted_per_second``), numbers only (llama-server never sends
  null there; clients iterate it), simulated ms;
- ``calconsole``: what llama-server's and OpenAI's shapes cannot say: the engine's request id,
  status, llama.cpp stop type and word, token ids, error, seed, and the whole ``Timings``
  (``Timings.to_dict``: TTFT, TPOT, ITL, E2E, queue, host/device split, clock label). Clients
  that do not know it ignore it.

``result_extension`` writes the ``calconsole`` key, ``result_from_extension`` reads it back into
the same ``RequestResult``; ``tests/remote/test_codec.py`` round-trips random results through JSON.

Token probabilities travel in llama-server's entries (``probs_json``: ``completion_probabilities`` or
``choices[].logprobs.content``), read back by ``probs_from_wire`` (from ``calconsole serve`` or a
real llama-server alike).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from sim_backend.planes import RequestResult, Timings, TokenLogprob, TokenProbs

#: llama-server's ``timings`` keys, in its order
LLAMA_TIMINGS = ("cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                 "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second")
_TIMING_FIELDS = Timings.__struct_fields__


def llama_timings(t: Timings) -> dict[str, int | float]:
    """llama-server's ``timings`` object: its nine keys, numbers only (a rate it cannot compute is 0.0)."""
    out: dict[str, int | float] = {}
    for k in LLAMA_TIMINGS:
        v = getattr(t, k)
        out[k] = 0.0 if v is None else v
    return out


def timings_to_wire(t: Timings) -> dict[str, Any]:
    """The whole ``Timings`` as JSON-ready data (``Timings.to_dict``: lists, dicts, a clock label)."""
    return t.to_dict()


def timings_from_wire(d: Mapping[str, Any]) -> Timings:
    """``Timings`` from ``timings_to_wire``'s form; KeyError/TypeError if a field is missing or malformed."""
    kw = {k: d[k] for k in _TIMING_FIELDS if k in d}
    kw["itl_ms"] = tuple(float(x) for x in kw["itl_ms"])
    kw["host_ms"] = dict(kw["host_ms"])
    kw["device_ms"] = dict(kw["device_ms"])
    return Timings(**kw)


def result_extension(res: RequestResult) -> dict[str, Any]:
    """The ``calconsole`` key of a final chunk, a whole response or a stream's error event."""
    return {"request_id": res.request_id, "status": res.status, "stop_type": res.stop_type,
            "stopping_word": res.stopping_word, "tokens": list(res.tokens), "error": res.error, "seed": res.seed,
            "timings": timings_to_wire(res.timings),
            # context shifts (--context-shift): how many, the tokens they dropped; truncated: the context filled
            "truncated": res.truncated, "n_shifts": res.n_shifts, "n_discarded": res.n_discarded}


def result_from_extension(ext: Mapping[str, Any], text: str, *, request_id: int = -1,
                          error: Mapping[str, Any] | None = None) -> RequestResult:
    """The ``RequestResult`` a ``result_extension`` encodes; ``text`` is the reply (the stream's pieces
    joined, or the response's content), ``request_id`` the fallback when the key lacks one, ``error``
    the event's own error body when the extension has none. KeyError/TypeError for a malformed key."""
    err = ext.get("error") or (dict(error) if error else None)
    seed = ext.get("seed")
    return RequestResult(request_id=int(ext.get("request_id", request_id)), status=str(ext["status"]), text=text,
                         tokens=tuple(int(t) for t in ext.get("tokens") or ()),
                         stop_type=str(ext.get("stop_type", "none")), stopping_word=str(ext.get("stopping_word") or ""),
                         error=dict(err) if err else None, timings=timings_from_wire(ext["timings"]),
                         seed=None if seed is None else int(seed), truncated=bool(ext.get("truncated", False)),
                         n_shifts=int(ext.get("n_shifts", 0)), n_discarded=int(ext.get("n_discarded", 0)))


#: llama-server's log of a zero probability (``std::numeric_limits<float>::lowest()``: JSON has no -inf)
LOWEST_LOGPROB = -3.4028234663852886e38


def token_text(piece: bytes) -> str:
    """A token's text as llama-server writes it: an incomplete UTF-8 character at the end is cut (its
    ``validate_utf8``), anything else invalid becomes U+FFFD."""
    cut = len(piece)
    for back in range(1, min(4, len(piece)) + 1):  # a lead byte whose sequence runs past the end
        b = piece[-back]
        if b & 0xC0 == 0x80:
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        if need > back:
            cut = len(piece) - back
        break
    return piece[:cut].decode("utf-8", errors="replace")


def _value(logprob: float, post: bool) -> tuple[str, float]:
    if post:
        return "prob", math.exp(logprob)
    return "logprob", logprob if logprob > LOWEST_LOGPROB else LOWEST_LOGPROB


def _top(t: TokenLogprob, post: bool) -> dict[str, Any]:
    k, v = _value(t.logprob, post)
    return {"id": t.id, "token": token_text(t.piece), "bytes": list(t.piece), k: v}


def probs_json(probs: Sequence[TokenProbs]) -> list[dict[str, Any]]:
    """llama-server's entries for ``probs``: ``id``, ``token``, ``bytes``, ``logprob`` and ``top_logprobs``
    (``prob`` and ``top_probs``, probabilities in [0, 1], for ``post_sampling`` ones)."""
    out = []
    for p in probs:
        k, v = _value(p.logprob, p.post_sampling)
        out.append({"id": p.id, "token": token_text(p.piece), "bytes": list(p.piece), k: v,
                    "top_probs" if p.post_sampling else "top_logprobs": [_top(t, p.post_sampling) for t in p.top]})
    return out


def _logprob_of(e: Mapping[str, Any]) -> float:
    if "prob" in e:
        p = float(e["prob"])
        return math.log(p) if p > 0 else -math.inf
    v = float(e["logprob"])
    return -math.inf if v <= LOWEST_LOGPROB else v


def probs_from_wire(entries: Sequence[Mapping[str, Any]], *, from_logits: bool = True) -> tuple[TokenProbs, ...]:
    """``TokenProbs`` from llama-server's entries (``probs_json``'s form); ``from_logits``: False when the
    server said they are a timing-only generator's. KeyError/TypeError/ValueError for a malformed entry."""
    out = []
    for e in entries:
        post = "prob" in e
        top = tuple(TokenLogprob(int(t["id"]), _logprob_of(t), bytes(t["bytes"]))
                    for t in e["top_probs" if post else "top_logprobs"])
        out.append(TokenProbs(int(e["id"]), _logprob_of(e), top, post_sampling=post, piece=bytes(e["bytes"]),
                              from_logits=from_logits))
    return tuple(out)


#: a finite JSON number past float32's range: llama-server (and the face) read it as a +inf bias (JSON has no inf)
_INF_BIAS = 1e39


def logit_bias_to_wire(pairs: Sequence[tuple[int, float]]) -> list[list[Any]]:
    """``logit_bias`` of a request as the remote planes send it: ``[[id, bias], ...]`` pairs, a ban (-inf) as
    ``false`` (llama-server's spelling), +inf as a number past float32's range (read back as +inf)."""
    out: list[list[Any]] = []
    for t, b in pairs:
        v: Any = False if b == -math.inf else _INF_BIAS if b == math.inf else float(b)
        out.append([int(t), v])
    return out


__all__ = ["LLAMA_TIMINGS", "LOWEST_LOGPROB", "llama_timings", "logit_bias_to_wire", "probs_from_wire", "probs_json",
           "result_extension", "result_from_extension", "timings_from_wire", "timings_to_wire", "token_text"]
