"""Token probabilities on the wire: which request fields ask for them, and llama-server's shapes.

Requests (llama-server's rules, as its server reads them; checked against the real server in
``tests/server/test_parity_llama_server.py``):

- ``/completion``: ``n_probs`` (a number; a float is truncated, ``true`` is 1, 0 or below: none) and
  ``post_sampling_probs`` (a bool);
- ``/v1/chat/completions``: ``logprobs: true`` asks for ``top_logprobs`` per token (default 20; a
  negative or fractional count gives none, a non-number the default); ``top_logprobs`` without
  ``logprobs: true`` is 400 ``top_logprobs requires logprobs to be set to true``; ``n_probs`` and
  ``post_sampling_probs`` are read as on ``/completion``;
- ``/v1/completions``: ``logprobs`` is the count (``true`` is 1), unless ``n_probs`` gives one;
- a field of the wrong JSON type is 400 with llama-server's words (``Field 'n_probs': [json.exception.
  type_error.302] type must be number, but is string``). Beyond llama-server: more than
  ``MAX_N_PROBS`` per token is 400 (each list is held for the whole reply and sent; llama-server sends
  up to its whole vocabulary, 5 MB a token for SmolLM2's 49152).

Responses (written by ``calconsole.codec.probs_json``, read back by its ``probs_from_wire``):
``completion_probabilities`` (``/completion``) or ``logprobs: {"content": [...]}`` (OpenAI routes), one entry
per token: ``id``, ``token`` (its text, an incomplete UTF-8 tail cut), ``bytes``, ``logprob`` and
``top_logprobs`` (entries of ``id``, ``token``, ``bytes``, ``logprob``); with ``post_sampling_probs``:
``prob`` and ``top_probs`` (probabilities in [0, 1]). A probability of 0 is ``logprob`` -3.4028234663852886e38
(llama-server's ``logarithm(0)``: the lowest float, JSON has no -inf). The probabilities are the plane's
(``sim_backend.planes.TokenProbs``): from the logits the device returned, which the ``calconsole`` key says
(``logprobs_source``), never the OpenAI shape. A request that would run timing-only has no logits: the engine
refuses it (400, ``sim_backend.serving.admission.NO_LOGITS``). ``SOURCE_GENERATOR`` is how a calconsole before
that labelled the seeded generator's distribution; the remote planes still read it as not from logits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sim_backend.planes import RequestResult, TokenProbs

from ..codec import LOWEST_LOGPROB, probs_json, token_text
from .httperror import bad_request

#: the most tokens one step may list (``n_probs`` / ``top_logprobs`` / ``logprobs``)
MAX_N_PROBS = 1000
#: OpenAI's default count when ``logprobs: true`` gives no ``top_logprobs`` (llama-server's 20)
DEFAULT_TOP_LOGPROBS = 20
SOURCE_LOGITS = "logits: the softmax of the logits the simulated device returned (post_sampling_probs: after the " \
                "sampler chain)"
SOURCE_GENERATOR = "generator: timing-only request (no logits); the distribution the seeded generator drew from " \
                   "(uniform over the ordinary text ids, or a grammar's stand-in over the ids it allows)"


def _json_type(v: Any) -> str:
    """nlohmann::json's name of a decoded value's type (llama-server's error messages)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _number(body: Mapping[str, Any], name: str) -> int | None:
    """An integer field as llama-server reads it: a number (a float truncated), ``true``/``false`` as 1/0;
    absent or null: None; another type: 400 with llama-server's message."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, int):
        return v
    if isinstance(v, float) and math.isfinite(v):
        return int(v)
    raise bad_request(f"Field '{name}': [json.exception.type_error.302] type must be number, but is {_json_type(v)}")


def probs_request(body: Mapping[str, Any], *, chat: bool) -> tuple[int, bool]:
    """``(n_probs, post_sampling_probs)`` a body asks for (module docstring); 0: no probabilities."""
    post = body.get("post_sampling_probs")
    if post is None:
        post = False
    elif not isinstance(post, bool):
        raise bad_request("Field 'post_sampling_probs': [json.exception.type_error.302] type must be boolean, "
                          f"but is {_json_type(post)}")
    n: int | None = None
    if chat:
        lp, top = body.get("logprobs"), body.get("top_logprobs")
        if lp is True:
            if top is None:
                n = DEFAULT_TOP_LOGPROBS
            elif isinstance(top, int):  # a bool too, as 0/1
                n = int(top)
            elif isinstance(top, float):
                n = 0  # llama-server lists nothing for a fractional count
            else:
                n = DEFAULT_TOP_LOGPROBS  # its lenient read: a non-number is the default
        elif top is not None:
            raise bad_request("top_logprobs requires logprobs to be set to true")
    if n is None:
        n = _number(body, "n_probs") or 0
    if n == 0 and body.get("logprobs") is not None and not (chat and isinstance(body["logprobs"], bool)):
        # OpenAI's count (/v1/completions), read when n_probs gave none
        n = _number(body, "logprobs") or 0
    n = max(n, 0)
    if n > MAX_N_PROBS:
        raise bad_request(f"token probabilities: at most {MAX_N_PROBS} per token ('n_probs' / 'top_logprobs' / "
                          f"'logprobs'), got {n}")
    return n, post


def source_of(probs: Sequence[TokenProbs]) -> str:
    """What the probabilities were computed from (the ``calconsole.logprobs_source`` label)."""
    return SOURCE_LOGITS if all(p.from_logits for p in probs) else SOURCE_GENERATOR


def final_probs(res: RequestResult, tokenize: Callable[[str], Sequence[int]]) -> tuple[TokenProbs, ...]:
    """A whole reply's probabilities as llama-server returns them: those of a stop word's tokens (as many
    as the word tokenizes to, ``tokenize(word)``) are dropped."""
    probs = res.probs
    if res.stop_type == "word" and res.stopping_word and probs:
        drop = min(len(probs), len(tokenize(res.stopping_word)))
        probs = probs[: len(probs) - drop]
    return probs


__all__ = ["DEFAULT_TOP_LOGPROBS", "LOWEST_LOGPROB", "MAX_N_PROBS", "final_probs", "probs_json", "probs_request",
           "source_of", "token_text"]
