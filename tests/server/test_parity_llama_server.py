"""Differential tests: the same request to a real llama-server and to ``calconsole serve``.

Both run in this process on 127.0.0.1 (the session's ``llama_server`` fixture: llama.cpp from
``xllamacpp`` with SmolLM2-135M; ours: a timing-only simulator behind the serving face, 2 slots).
For each request: the same status, the same error ``type``/``code``, the same JSON key set
(recursively) and JSON value types, the same SSE event sequence (role chunk, deltas, finish,
usage, ``[DONE]``). The models differ, so words, token ids and counts are not compared.

What differs on purpose is in ``ALLOW`` (a path pattern and its reason); nothing else may differ.
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from tests.server.conftest import wait_until
from tests.server.parity.shapes import allowed, diff, jtype

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
                                           "llama-server writes '*' (both allow any header)",
    "status:empty-messages": "an empty 'messages' list: 400 (OpenAI refuses it) where llama-server renders an "
                             "empty chat and generates",
    "status:slot-out-of-range": "POST /slots/{id} for a slot that does not exist: 400 'Invalid slot ID' where "
                                "llama-server answers 200 and saves / erases nothing",
}
assert len(ALLOW) <= 12

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def pair(make_module_server: Any, llama_server: Any) -> tuple[str, str]:
    ours = make_module_server(system_kw={"n_slots": 2})
    return ours.url, llama_server.url


def _call(url: str, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
    return httpx.request(method, url + path, json=body, timeout=120, **kw)


def _body(r: httpx.Response) -> Any:
    ct = r.headers.get("content-type", "")
    if "event-stream" in ct:
        return [e if e == "[DONE]" else json.loads(e) for e in re.findall(r"^data: (.*)$", r.text, re.M)]
    return r.json() if "json" in ct else r.text


def _unexplained(ours: Any, theirs: Any) -> list[str]:
    return [d for d in diff(ours, theirs) if not allowed(d, ALLOW)]


def both(pair: tuple[str, str], method: str, path: str, body: Any = None) -> tuple[httpx.Response, httpx.Response]:
    return _call(pair[0], method, path, body), _call(pair[1], method, path, body)


# --- plain JSON routes: status, error type/code, key sets and value types ----------------------------------

CASES = [
    ("GET", "/health", None),
    ("GET", "/props", None),
    ("GET", "/slots", None),
    ("GET", "/v1/models", None),
    ("POST", "/tokenize", {"content": "hello world"}),
    ("POST", "/tokenize", {"content": "hello world", "with_pieces": True}),
    ("POST", "/detokenize", {"tokens": [1, 2, 3]}),
    ("POST", "/apply-template", {"messages": MSG}),
    ("POST", "/chat/completions/input_tokens", {"messages": MSG}),
    ("POST", "/completion", {"prompt": "Hello", "n_predict": 3}),
    ("POST", "/completion", {"prompt": [1, 2, 3], "n_predict": 2}),
    ("POST", "/completion", {"prompt": [[1, 2], "Hello"], "n_predict": 2}),
    ("POST", "/completion", {"prompt": [{"prompt_string": "Hello"}], "n_predict": 1}),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 3}),
    ("POST", "/v1/completions", {"prompt": ["Hello", "Bye"], "max_tokens": 2}),
    ("POST", CHAT, {"messages": MSG, "max_tokens": 3}),
    ("POST", CHAT, {"messages": MSG + [{"role": "assistant", "content": "Hi"}], "max_tokens": 2}),
    ("POST", CHAT, {"messages": MSG, "max_tokens": 2, "n": 2}),
    ("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "n": 2}),
    # refusals
    ("POST", CHAT, {"messages": MSG + [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
                    "max_tokens": 2}),
    ("POST", "/completion", {"prompt": [], "n_predict": 1}),
    ("POST", "/completion", {"prompt": "x", "n_predict": "a"}),
    ("GET", "/no-such-route", None),
    ("POST", "/health", None),
    ("GET", CHAT, None),
    ("POST", "/v1/embeddings", {"input": "hi"}),
    ("POST", "/embedding", {"content": "hi"}),
    ("POST", "/rerank", {"query": "a", "documents": ["b"]}),
    ("POST", "/infill", {"input_prefix": "def f(", "input_suffix": "):"}),
    # slot actions without --slot-save-path: 501 on both, erase included
    ("POST", "/slots/0?action=erase", None),
    ("POST", "/slots/0?action=save", {"filename": "a.bin"}),
]


@pytest.mark.parametrize("method,path,body", CASES, ids=[f"{m} {p} {json.dumps(b)[:40]}" for m, p, b in CASES])
def test_same_answer(pair: tuple[str, str], method: str, path: str, body: Any) -> None:
    if path == "/slots":  # idle slots on both (a stream of an earlier test may still be ending)
        assert all(wait_until(lambda u=u: not any(s["is_processing"] for s in _call(u, "GET", "/slots").json()))
                   for u in pair)
    ours, theirs = both(pair, method, path, body)
    assert ours.status_code == theirs.status_code, (ours.text[:300], theirs.text[:300])
    a, b = _body(ours), _body(theirs)
    if theirs.status_code >= 400:
        ea, eb = a["error"], b["error"]
        assert (ea["type"], ea["code"]) == (eb["type"], eb["code"]), (ea, eb)
        assert set(ea) == set(eb), (ea, eb)
    assert _unexplained(a, b) == []


def test_completion_prompt_lists_give_one_result_each(pair: tuple[str, str]) -> None:
    ours, theirs = both(pair, "POST", "/completion", {"prompt": [[1, 2], [3, 4]], "n_predict": 2})
    a, b = ours.json(), theirs.json()
    assert isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 2
    assert [x["index"] for x in a] == [x["index"] for x in b] == [0, 1]
    assert _unexplained(a, b) == []


def test_empty_messages_is_the_one_status_difference(pair: tuple[str, str]) -> None:
    # allow-listed as status:empty-messages: llama-server answers 200 with a reply to nothing
    ours, theirs = both(pair, "POST", CHAT, {"messages": [], "max_tokens": 1})
    assert theirs.status_code == 200 and ours.status_code == 400
    assert ours.json()["error"]["type"] == "invalid_request_error"


def test_timings_are_numbers_and_rates_follow_llama_server(pair: tuple[str, str]) -> None:
    for url in pair:
        for n in (1, 3):
            t = _call(url, "POST", "/completion", {"prompt": "Hi", "n_predict": n}).json()["timings"]
            assert all(jtype(v) == "number" for v in t.values()), t
            if t["predicted_n"] == 1:
                assert t["predicted_per_second"] == 0.0
            elif t["predicted_n"] > 1:
                want = 1e3 * (t["predicted_n"] - 1) / t["predicted_ms"]
                assert t["predicted_per_second"] == pytest.approx(want, rel=1e-3)


def test_fingerprint_and_settings(pair: tuple[str, str]) -> None:
    ours, theirs = both(pair, "POST", CHAT, {"messages": MSG, "max_tokens": 1})
    assert ours.json()["system_fingerprint"].startswith("b") and theirs.json()["system_fingerprint"].startswith("b")
    for r in both(pair, "POST", "/completion", {"prompt": "Hi", "n_predict": 1}):
        gs = r.json()["generation_settings"]
        assert gs["logit_bias"] == [] and gs["seed"] == 4294967295
    for r in both(pair, "POST", "/completion", {"prompt": "Hi", "n_predict": 4, "ignore_eos": True, "temperature": 0}):
        body = r.json()  # no EOS: the reply runs to n_predict
        assert body["generation_settings"]["ignore_eos"] is True and body["tokens_predicted"] == 4, body
    for r in both(pair, "GET", "/props"):
        assert r.json()["default_generation_settings"]["params"]["seed"] == 4294967295


# --- streams: the event sequence, and each kind of event's shape --------------------------------------------

def _kind(ev: Any, route: str) -> str:
    if ev == "[DONE]":
        return "done"
    if "error" in ev:
        return "error"
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


def _sequence(events: list[Any], route: str) -> list[str]:
    out: list[str] = []
    for ev in events:
        k = _kind(ev, route)
        if not (out and out[-1] == k == "piece"):
            out.append(k)
    return out


#: greedy and ``ignore_eos``: every stream has its pieces on both sides (a sampled reply of the real model could
#: end at EOS at once, or stop on a partial UTF-8 character, and stream no piece: the sequences then differ)
_FULL = {"temperature": 0, "ignore_eos": True}
STREAMS = [
    ("chat", CHAT, {"messages": MSG, "max_tokens": 3, "stream": True, **_FULL}),
    ("chat", CHAT, {"messages": MSG, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
                    **_FULL}),
    ("text", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True, **_FULL}),
    ("native", "/completion", {"prompt": "Hello", "n_predict": 3, "stream": True, **_FULL}),
    ("native", "/completion", {"prompt": [1, 2, 3], "n_predict": 2, "stream": True, "return_tokens": True,
                               **_FULL}),
]


@pytest.mark.parametrize("route,path,body", STREAMS, ids=[f"{p} {json.dumps(b)[:50]}" for _, p, b in STREAMS])
def test_same_stream(pair: tuple[str, str], route: str, path: str, body: Any) -> None:
    ours, theirs = both(pair, "POST", path, body)
    assert ours.status_code == theirs.status_code == 200
    a, b = _body(ours), _body(theirs)
    assert _sequence(a, route) == _sequence(b, route), (a, b)
    for kind in dict.fromkeys(_sequence(b, route)):
        if kind == "done":
            continue
        ea = next(e for e in a if _kind(e, route) == kind)
        eb = next(e for e in b if _kind(e, route) == kind)
        assert _unexplained(ea, eb) == [], kind
    if route == "native":  # each piece carries its own token ids, and the prompt's count
        for e in (e for e in a if _kind(e, route) == "piece"):
            assert e["tokens"] and e["tokens_evaluated"] > 0, e


def test_n_choices_stream(pair: tuple[str, str]) -> None:
    body = {"messages": MSG, "max_tokens": 2, "n": 2, "stream": True, "stream_options": {"include_usage": True},
            **_FULL}
    ours, theirs = both(pair, "POST", CHAT, body)
    a, b = _body(ours), _body(theirs)
    for events in (a, b):  # per choice: a role chunk, a finish chunk and a usage chunk; one [DONE], last
        kinds = [(_kind(e, "chat"), e["choices"][0]["index"] if e != "[DONE]" and e["choices"] else None)
                 for e in events]
        for i in (0, 1):
            assert ("role", i) in kinds and ("finish", i) in kinds, kinds
        assert [k for k, _ in kinds].count("usage") == 2 and events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    for kind in ("role", "piece", "finish", "usage"):
        ea = next(e for e in a if e != "[DONE]" and _kind(e, "chat") == kind)
        eb = next(e for e in b if e != "[DONE]" and _kind(e, "chat") == kind)
        assert _unexplained(ea, eb) == [], kind


def test_busy_slot_shape(make_server: Any, llama_server: Any) -> None:
    from sim_backend.compose import Pacing, PacingMode

    # real-time pacing: a fast-paced simulator could finish before /slots is read
    ours = make_server(system_kw={"n_slots": 2, "pacing": Pacing(PacingMode.REALTIME, 1.0)})
    body = {"prompt": "Once upon a time", "n_predict": 200, "stream": True}
    shapes = []
    for url in (ours.url, llama_server.url):
        with httpx.stream("POST", url + "/completion", json=body, timeout=120) as r:
            lines = r.iter_lines()
            while not next(lines).startswith("data: "):
                pass
            slots = httpx.get(url + "/slots", timeout=30).json()
        busy = [s for s in slots if s["is_processing"]]
        assert busy, slots
        shapes.append(busy[0])
    assert isinstance(shapes[0]["next_token"], list) and "n_prompt_tokens_cache" in shapes[0]
    assert _unexplained(shapes[0], shapes[1]) == []


SLOT_STEPS = [  # (slot, action, body): in this order on both servers, each slot's cache from the prompt below
    (0, "save", {"filename": "p0.bin"}),
    (0, "erase", None),
    (0, "restore", {"filename": "p0.bin"}),
    (1, "restore", {"filename": "p0.bin"}),
    (0, "restore", {"filename": "missing.bin"}),
    (0, "save", {"filename": "../escape.bin"}),
    (0, "save", {"filename": "/tmp/abs.bin"}),
    (0, "save", {}),
    (0, "save", {"filename": 5}),
    (0, "save", None),
    ("x", "erase", None),
    (0, "bogus", None),
    (0, None, None),
]


def test_slot_actions(make_server: Any, llama_server_slot_save: Any, tmp_path: Any) -> None:
    ours = make_server(system_kw={"n_slots": 2}, slot_save_path=str(tmp_path))
    for url in (ours.url, llama_server_slot_save.url):
        r = _call(url, "POST", "/completion", {"prompt": "Hello there, my friend", "n_predict": 3, "id_slot": 0})
        assert r.status_code == 200
    for slot, action, body in SLOT_STEPS:
        path = f"/slots/{slot}" + (f"?action={action}" if action else "")
        a, b = _call(ours.url, "POST", path, body), _call(llama_server_slot_save.url, "POST", path, body)
        assert a.status_code == b.status_code, (path, body, a.text, b.text)
        ja, jb = a.json(), b.json()
        if b.status_code >= 400:
            assert (ja["error"]["type"], ja["error"]["code"]) == (jb["error"]["type"], jb["error"]["code"])
        else:
            assert ja["id_slot"] == jb["id_slot"] == slot and ja.get("filename") == jb.get("filename")
        assert _unexplained(ja, jb) == [], (path, body)
    # allow-listed as status:slot-out-of-range
    a, b = (_call(u, "POST", "/slots/7?action=erase") for u in (ours.url, llama_server_slot_save.url))
    assert (a.status_code, b.status_code) == (400, 200) and a.json()["error"]["message"].startswith("Invalid slot ID")


# --- /metrics and headers ---------------------------------------------------------------------------------

def test_metrics_families_and_types(pair: tuple[str, str]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    ours, theirs = both(pair, "GET", "/metrics")
    fam = [{f.name: f.type for f in text_string_to_metric_families(r.text)} for r in (ours, theirs)]
    missing = {n: t for n, t in fam[1].items() if fam[0].get(n) != t}
    assert missing == {}, f"llama-server families we lack or type differently: {missing}"
    for r in (ours, theirs):
        assert int(r.headers["process-start-time-unix"]) > 0


def test_cors_preflight(pair: tuple[str, str]) -> None:
    h = {"Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST",
         "Access-Control-Request-Headers": "content-type,authorization"}
    ours, theirs = (httpx.options(u + CHAT, headers=h, timeout=30) for u in pair)
    assert ours.status_code == theirs.status_code == 200
    for k in ("access-control-allow-origin", "access-control-allow-credentials", "access-control-allow-methods"):
        assert ours.headers.get(k) == theirs.headers.get(k), k
    assert theirs.headers["access-control-allow-headers"] == "*"  # ALLOW header:access-control-allow-headers
    assert "authorization" in ours.headers["access-control-allow-headers"].lower()
    # an actual request from that page gets the origin back
    r = httpx.get(pair[0] + "/health", headers={"Origin": "http://localhost:5173"}, timeout=30)
    assert r.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_cors_origins_restrict(make_server: Any) -> None:
    s = make_server(cors_origins=("https://app.example",))
    pre = {"Access-Control-Request-Method": "POST"}
    ok = httpx.options(s.url + CHAT, headers={"Origin": "https://app.example", **pre}, timeout=30)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    bad = httpx.options(s.url + CHAT, headers={"Origin": "http://localhost:3000", **pre}, timeout=30)
    assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    # default: only pages served from this machine
    d = make_server()
    assert httpx.options(d.url + CHAT, headers={"Origin": "https://evil.example", **pre}, timeout=30).status_code == 400
