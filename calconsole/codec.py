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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sim_backend.planes import RequestResult, Timings

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
            "timings": timings_to_wire(res.timings)}


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
                         seed=None if seed is None else int(seed))


__all__ = ["LLAMA_TIMINGS", "llama_timings", "result_extension", "result_from_extension", "timings_from_wire",
           "timings_to_wire"]
