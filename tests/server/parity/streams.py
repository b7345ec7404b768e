"""What the differential tests share: the allow-list, the same request to both servers, and the comparison of
their answers and of their SSE streams (event kinds and sequences).

``pair`` (tests/server/conftest.py) is ``(our url, llama-server's url)``. A stream's events are ``data:`` payloads
(JSON, or ``"[DONE]"``); their kinds: ``role``, ``piece``, ``progress`` (a ``prompt_progress`` chunk), ``finish``,
``usage``, ``final`` (``/completion``'s last chunk), ``error``, ``done``. Routes: ``chat``, ``text``
(``/v1/completions``) and ``native`` (``/completion``).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from tests.server.parity.shapes import allowed, diff

#: path patterns (fnmatch; see tests/server/parity/shapes.py) where calconsole differs on purpose
ALLOW: dict[str, str] = {
    "calconsole": "calconsole's extension of a result/chunk: request id, status, stop type, token ids, seed, "
                  "the whole Timings (TTFT/TPOT/ITL/E2E, host/device split); clients ignore unknown keys",
    "[].calconsole": "the same extension on each result of a prompt list",
    "device": "/props: the simulated device (chiplets, firmware, pacing, findings, clock label)",
    "data[].meta.*": "/v1/models: GGUF facts (n_embd, n_params, size, ftype, vocab_type) that the simulated "
                     "calbin does not expose through the planes; n_vocab, n_ctx, n_ctx_train are given",
    "metrics:extra-families": "/metrics: calconsole's request counters, latency histograms (vLLM definitions) "
                              "and kv_cache_usage_ratio beside every llamacpp: family llama-server has",
    "header:access-control-allow-headers": "CORS preflight: Starlette echoes the requested headers where "
                                           "llama-server writes '*' (both allow any header), and writes "
                                           "none when none were requested",
    "header:only-theirs": "headers llama-server (cpp-httplib) writes that we do not: 'Server: llama.cpp' (we are "
                          "not it), 'Keep-Alive: timeout=5, max=100' (uvicorn keeps the connection 5 s too and "
                          "counts no requests; the header is advisory), an empty 'Access-Control-Allow-Origin' "
                          "on a request without Origin (it allows nothing), 'Connection: close' after a 404 "
                          "(cpp-httplib closes; we keep the connection for the next request)",
    "status:empty-messages": "an empty 'messages' list: 400 (OpenAI refuses it) where llama-server renders an "
                             "empty chat and generates",
    "status:malformed-logit-bias": "a 'logit_bias' entry that is not a [token, bias] pair, a token neither an id nor "
                                   "a string, a bias neither a number nor false, or 'logit_bias' of another type: "
                                   "400 naming it where llama-server skips it without a word (TODO in its "
                                   "params_from_json_cmpl) and generates unbiased",
    "status:slot-out-of-range": "POST /slots/{id} for a slot that does not exist: 400 'Invalid slot ID' where "
                                "llama-server answers 200 and saves / erases nothing",
}
assert len(ALLOW) <= 12

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Say hi."}]
#: greedy and ``ignore_eos``: every stream has its pieces on both sides (a sampled reply of the real model could
#: end at EOS at once, or stop on a partial UTF-8 character, and stream no piece: the sequences then differ)
FULL = {"temperature": 0, "ignore_eos": True}


def call(url: str, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    """One request (JSON body), 120 s timeout."""
    return httpx.request(method, url + path, json=body, timeout=120, **kw)


def both(pair: tuple[str, str], method: str, path: str, body: Any = None) -> tuple[httpx.Response, httpx.Response]:
    """The same request to ours, then to llama-server: (ours, theirs)."""
    return call(pair[0], method, path, body), call(pair[1], method, path, body)


def body_of(r: httpx.Response) -> Any:
    """A response's body: an SSE stream's ``data:`` payloads (decoded; ``"[DONE]"`` kept), JSON, or text."""
    ct = r.headers.get("content-type", "")
    if "event-stream" in ct:
        return [e if e == "[DONE]" else json.loads(e) for e in re.findall(r"^data: (.*)$", r.text, re.M)]
    return r.json() if "json" in ct else r.text


def unexplained(ours: Any, theirs: Any) -> list[str]:
    """The shape differences (``shapes.diff``) no ``ALLOW`` entry explains."""
    return [d for d in diff(ours, theirs) if not allowed(d, ALLOW)]


def kind_of(ev: Any, route: str) -> str:
    """The kind of one stream event (module docstring)."""
    if ev == "[DONE]":
        return "done"
    if "error" in ev:
        return "error"
    if "prompt_progress" in ev:
        return "progress"
    if route == "native":
        return "final" if ev.get("stop") else "piece"
    if not ev.get("choices"):
        return "usage"
    ch = ev["choices"][0]
    if ch.get("finish_reason"):
        return "finish"
    if "delta" in ch and "role" in ch["delta"]:
        return "role"
    return "piece"


def sequence(events: list[Any], route: str) -> list[str]:
    """The kinds of a stream's events in order, a run of pieces (or of progress events) as one."""
    out: list[str] = []
    for ev in events:
        k = kind_of(ev, route)
        if not (out and out[-1] == k and k in ("piece", "progress")):
            out.append(k)
    return out


def assert_same_error(a: Any, b: Any) -> None:
    """Two error bodies: the same ``type`` and ``code``, the same keys."""
    ea, eb = a["error"], b["error"]
    assert (ea["type"], ea["code"]) == (eb["type"], eb["code"]), (ea, eb)
    assert set(ea) == set(eb), (ea, eb)


def assert_same_stream(a: list[Any], b: list[Any], route: str) -> None:
    """Two streams' events: the same sequence of kinds, and the first event of each kind of the same shape."""
    assert sequence(a, route) == sequence(b, route), (a, b)
    for kind in dict.fromkeys(sequence(b, route)):
        if kind == "done":
            continue
        ea = next(e for e in a if kind_of(e, route) == kind)
        eb = next(e for e in b if kind_of(e, route) == kind)
        assert unexplained(ea, eb) == [], (kind, ea, eb)
