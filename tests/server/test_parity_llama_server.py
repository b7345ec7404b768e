"""Differential tests: the same request to a real llama-server and to ``calconsole serve``.

Both run in this process on 127.0.0.1 (the session's ``llama_server`` fixture: llama.cpp from
``xllamacpp`` with SmolLM2-135M; ours: a timing-only simulator behind the serving face, 2 slots).
For each request: the same status, the same error ``type``/``code``, the same JSON key set
(recursively) and JSON value types, the same SSE event sequence (role chunk, deltas, finish,
usage, ``[DONE]``). The models differ, so words, token ids and counts are not compared.

What differs on purpose is in ``ALLOW`` (tests/server/parity/streams.py: a path pattern and its reason); nothing
else may differ.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.server.conftest import wait_until
from tests.server.parity.shapes import jtype
from tests.server.parity.streams import (
    CHAT,
    FULL,
    MSG,
    assert_same_error,
    assert_same_stream,
    body_of,
    both,
    call,
    kind_of,
    unexplained,
)

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
    # /infill: SmolLM2 has no FIM tokens (501 there), Qwen3 has: compared on a FIM copy in test_infill_llama_server
    # slot actions without --slot-save-path: 501 on both, erase included
    ("POST", "/slots/0?action=erase", None),
    ("POST", "/slots/0?action=save", {"filename": "a.bin"}),
]


@pytest.mark.parametrize("method,path,body", CASES, ids=[f"{m} {p} {json.dumps(b)[:40]}" for m, p, b in CASES])
def test_same_answer(pair: tuple[str, str], method: str, path: str, body: Any) -> None:
    if path == "/slots":
        # every slot of both has served a request, whatever ran before (llama-server's shared session fixture may
        # have served other modules' requests): an idle slot then shows its last task on both sides
        for u in pair:
            for i in (0, 1):
                assert call(u, "POST", "/completion", {"prompt": "Hi", "n_predict": 1, "id_slot": i}).status_code == 200
        # idle slots on both (a stream of an earlier test may still be ending)
        assert all(wait_until(lambda u=u: not any(s["is_processing"] for s in call(u, "GET", "/slots").json()))
                   for u in pair)
    ours, theirs = both(pair, method, path, body)
    assert ours.status_code == theirs.status_code, (ours.text[:300], theirs.text[:300])
    a, b = body_of(ours), body_of(theirs)
    if theirs.status_code >= 400:
        assert_same_error(a, b)
    assert unexplained(a, b) == []


def test_completion_prompt_lists_give_one_result_each(pair: tuple[str, str]) -> None:
    ours, theirs = both(pair, "POST", "/completion", {"prompt": [[1, 2], [3, 4]], "n_predict": 2})
    a, b = ours.json(), theirs.json()
    assert isinstance(a, list) and isinstance(b, list) and len(a) == len(b) == 2
    assert [x["index"] for x in a] == [x["index"] for x in b] == [0, 1]
    assert unexplained(a, b) == []


def test_empty_messages_is_the_one_status_difference(pair: tuple[str, str]) -> None:
    # allow-listed as status:empty-messages: llama-server answers 200 with a reply to nothing
    ours, theirs = both(pair, "POST", CHAT, {"messages": [], "max_tokens": 1})
    assert theirs.status_code == 200 and ours.status_code == 400
    assert ours.json()["error"]["type"] == "invalid_request_error"


def test_timings_are_numbers_and_rates_follow_llama_server(pair: tuple[str, str]) -> None:
    for url in pair:
        for n in (1, 3):
            t = call(url, "POST", "/completion", {"prompt": "Hi", "n_predict": n}).json()["timings"]
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
        # the end-of-generation ids it set to -inf, bias null (each model its own ids)
        bias = body["generation_settings"]["logit_bias"]
        assert bias and all(set(b) == {"bias", "token"} and b["bias"] is None and isinstance(b["token"], int)
                            for b in bias), bias
    for r in both(pair, "GET", "/props"):
        assert r.json()["default_generation_settings"]["params"]["seed"] == 4294967295


def test_tokens_cached_is_what_the_slot_holds(pair: tuple[str, str]) -> None:
    """``tokens_cached``: llama-server reports the tokens the slot holds after the request (its prompt and the reply
    but the last token), whatever was reused; the reused prefix is ``timings.cache_n``."""
    body = {"prompt": "The quick brown fox jumps", "n_predict": 3, "id_slot": 0, "ignore_eos": True, "temperature": 0}
    for url in pair:
        for _ in range(2):  # fresh, then with the prompt reused but its last token
            r = call(url, "POST", "/completion", body).json()
            assert r["tokens_cached"] == r["tokens_evaluated"] + r["tokens_predicted"] - 1, r
        assert r["timings"]["cache_n"] > 0, r["timings"]


def test_an_idle_slot_keeps_its_last_task(pair: tuple[str, str]) -> None:
    """llama-server keeps an idle slot's last task (id, prompt size, params) and resets its counters."""
    for url in pair:
        r = call(url, "POST", "/completion", {"prompt": "Hello there", "n_predict": 2, "id_slot": 1, "temperature": 0.5,
                                              "ignore_eos": True})
        assert r.status_code == 200
        assert wait_until(lambda u=url: not call(u, "GET", "/slots").json()[1]["is_processing"])
        s1 = call(url, "GET", "/slots").json()[1]
        # the tokens the slot holds: the prompt and the reply but its last token (never fed back)
        held = r.json()["tokens_evaluated"] + r.json()["tokens_predicted"] - 1
        assert s1["n_prompt_tokens"] == held and s1["params"]["temperature"] == 0.5, s1
        assert isinstance(s1["id_task"], int) and s1["id_task"] >= 0
        assert s1["next_token"] == [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0}]
        assert (s1["n_prompt_tokens_processed"], s1["n_prompt_tokens_cache"]) == (0, 0)


def test_seed_minus_one_is_a_random_seed_on_both(pair: tuple[str, str]) -> None:
    # llama-server reads seed -1 as LLAMA_DEFAULT_SEED (a random one); calconsole answered 400
    for r in both(pair, "POST", "/completion", {"prompt": "Hi", "n_predict": 1, "seed": -1}):
        assert r.status_code == 200, r.text
        assert r.json()["generation_settings"]["seed"] == 4294967295
    ours = [call(pair[0], "POST", "/completion", {"prompt": "Hi", "n_predict": 1, "seed": s}).json()
            for s in (-1, -1, 4294967295, 4294967295)]
    drawn = [r["calconsole"]["seed"] for r in ours]
    assert len(set(drawn)) == len(drawn), drawn  # each a fresh random seed, as "no seed"


def test_a_negative_seed_is_read_modulo_2_32_on_both(pair: tuple[str, str]) -> None:
    # llama-server keeps the seed as a uint32: -5 is the fixed seed 4294967291 (the same reply each time), and
    # -2**32-1 wraps to 4294967295, a random one; calconsole refused every seed below -1
    body = {"prompt": "Hi", "n_predict": 3, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    for seed, reported in ((-5, 4294967291), (-2, 4294967294), (-2**31, 2**31), (-2**32 - 1, 4294967295)):
        for r in both(pair, "POST", "/completion", {**body, "seed": seed}):
            assert r.status_code == 200, r.text
            assert r.json()["generation_settings"]["seed"] == reported, (seed, r.json()["generation_settings"])
    for url in pair:  # a fixed seed: the same tokens twice, on each server
        a, b = (call(url, "POST", "/completion", {**body, "seed": -5, "return_tokens": True}).json()
                for _ in range(2))
        assert a["tokens"] == b["tokens"], url
    ours = [call(pair[0], "POST", "/completion", {**body, "seed": s}).json()["calconsole"]["seed"]
            for s in (-5, -5, -2**32 - 1, -2**32 - 1)]
    assert ours[:2] == [4294967291, 4294967291] and ours[2] != ours[3], ours  # the wrapped -1: drawn each time


# --- streams: the event sequence, and each kind of event's shape --------------------------------------------

STREAMS = [
    ("chat", CHAT, {"messages": MSG, "max_tokens": 3, "stream": True, **FULL}),
    ("chat", CHAT, {"messages": MSG, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True},
                    **FULL}),
    ("text", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "stream": True, **FULL}),
    ("native", "/completion", {"prompt": "Hello", "n_predict": 3, "stream": True, **FULL}),
    ("native", "/completion", {"prompt": [1, 2, 3], "n_predict": 2, "stream": True, "return_tokens": True,
                               **FULL}),
]


@pytest.mark.parametrize("route,path,body", STREAMS, ids=[f"{p} {json.dumps(b)[:50]}" for _, p, b in STREAMS])
def test_same_stream(pair: tuple[str, str], route: str, path: str, body: Any) -> None:
    ours, theirs = both(pair, "POST", path, body)
    assert ours.status_code == theirs.status_code == 200
    a, b = body_of(ours), body_of(theirs)
    assert_same_stream(a, b, route)
    if route == "native":  # each piece carries its own token ids, and the prompt's count
        for e in (e for e in a if kind_of(e, route) == "piece"):
            assert e["tokens"] and e["tokens_evaluated"] > 0, e


def test_n_choices_stream(pair: tuple[str, str]) -> None:
    body = {"messages": MSG, "max_tokens": 2, "n": 2, "stream": True, "stream_options": {"include_usage": True},
            **FULL}
    ours, theirs = both(pair, "POST", CHAT, body)
    a, b = body_of(ours), body_of(theirs)
    for events in (a, b):  # per choice: a role chunk, a finish chunk and a usage chunk; one [DONE], last
        kinds = [(kind_of(e, "chat"), e["choices"][0]["index"] if e != "[DONE]" and e["choices"] else None)
                 for e in events]
        for i in (0, 1):
            assert ("role", i) in kinds and ("finish", i) in kinds, kinds
        assert [k for k, _ in kinds].count("usage") == 2 and events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    for kind in ("role", "piece", "finish", "usage"):
        ea = next(e for e in a if e != "[DONE]" and kind_of(e, "chat") == kind)
        eb = next(e for e in b if e != "[DONE]" and kind_of(e, "chat") == kind)
        assert unexplained(ea, eb) == [], kind


def test_busy_slot_shape(make_server: Any, llama_server: Any) -> None:
    from sim_backend.compose import Pacing, PacingMode

    # real-time pacing: a fast-paced simulator could finish before /slots is read
    ours = make_server(system_kw={"n_slots": 2, "pacing": Pacing(PacingMode.REALTIME, 1.0)})
    prime = {"prompt": "Once upon a time there was", "n_predict": 1, "id_slot": 0}
    body = {"prompt": "Once upon a time there was a king", "n_predict": 200, "stream": True, "id_slot": 0,
            "ignore_eos": True}
    shapes = []
    for url in (ours.url, llama_server.url):
        assert call(url, "POST", "/completion", prime).status_code == 200  # the slot then holds a reusable prefix
        with httpx.stream("POST", url + "/completion", json=body, timeout=120) as r:
            lines = r.iter_lines()
            while not (line := next(lines)).startswith("data: "):
                pass
            n_eval = json.loads(line[6:])["tokens_evaluated"]
            slots = httpx.get(url + "/slots", timeout=30).json()
        busy = slots[0]
        assert busy["is_processing"], slots
        shapes.append(busy)
        # the counts as llama-server means them: the slot's prompt is what its KV holds (the prompt and the tokens
        # fed back: one fewer than decoded, or as many while a step is between feeding and sampling), processed
        # the prompt tokens computed, cache those reused from the primed prefix
        n_dec = busy["next_token"][0]["n_decoded"]
        assert n_dec >= 1 and busy["n_prompt_tokens"] in (n_eval + n_dec - 1, n_eval + n_dec), (n_eval, busy)
        assert busy["n_prompt_tokens_processed"] + busy["n_prompt_tokens_cache"] == n_eval, (n_eval, busy)
        assert 0 < busy["n_prompt_tokens_cache"] < n_eval, (n_eval, busy)
    assert isinstance(shapes[0]["next_token"], list) and "n_prompt_tokens_cache" in shapes[0]
    assert unexplained(shapes[0], shapes[1]) == []


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
        r = call(url, "POST", "/completion", {"prompt": "Hello there, my friend", "n_predict": 3, "id_slot": 0})
        assert r.status_code == 200
    for slot, action, body in SLOT_STEPS:
        path = f"/slots/{slot}" + (f"?action={action}" if action else "")
        a, b = call(ours.url, "POST", path, body), call(llama_server_slot_save.url, "POST", path, body)
        assert a.status_code == b.status_code, (path, body, a.text, b.text)
        ja, jb = a.json(), b.json()
        if b.status_code >= 400:
            assert (ja["error"]["type"], ja["error"]["code"]) == (jb["error"]["type"], jb["error"]["code"])
        else:
            assert ja["id_slot"] == jb["id_slot"] == slot and ja.get("filename") == jb.get("filename")
        assert unexplained(ja, jb) == [], (path, body)
    # allow-listed as status:slot-out-of-range
    a, b = (call(u, "POST", "/slots/7?action=erase") for u in (ours.url, llama_server_slot_save.url))
    assert (a.status_code, b.status_code) == (400, 200) and a.json()["error"]["message"].startswith("Invalid slot ID")


# --- /metrics and headers ---------------------------------------------------------------------------------

def _families_as_written(text: str) -> dict[str, tuple[str, frozenset[str]]]:
    """family -> (its ``# TYPE``, the names its samples are written under), read from the text itself: a
    client library's parser renames counters (prometheus_client strips ``_total``), which would hide the very
    difference this compares."""
    fams: dict[str, tuple[str, set[str]]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, current, typ = line.split(" ", 3)
            fams[current] = (typ, set())
        elif line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            assert name.startswith(current), (name, current)  # samples follow their family's TYPE line
            fams[current][1].add(name)
    return {k: (t, frozenset(n)) for k, (t, n) in fams.items()}


def test_metrics_families_and_types(pair: tuple[str, str]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    for u in pair:  # every llama-server family has a sample once a request ran
        assert call(u, "POST", "/completion", {"prompt": "Hi", "n_predict": 2}).status_code == 200
    ours, theirs = both(pair, "GET", "/metrics")
    a, b = _families_as_written(ours.text), _families_as_written(theirs.text)
    assert "llamacpp:n_tokens_max" in b and b["llamacpp:n_tokens_max"][0] == "counter"  # the case in point
    # every family llama-server writes, under the same name, TYPE and sample names (ours may have more)
    differ = {n: (a.get(n), tb) for n, tb in b.items() if a.get(n) != tb}
    assert differ == {}, f"llama-server families we lack or write differently: {differ}"
    # and a client's parser reads the whole of ours
    assert {f.name for f in text_string_to_metric_families(ours.text)}
    for r in (ours, theirs):
        assert int(r.headers["process-start-time-unix"]) > 0


#: the requests whose raw header names are compared: JSON, Prometheus text, an SSE stream, an error, a preflight
HEADER_CASES = [
    ("GET", "/health", None, {}),
    ("GET", "/v1/models", None, {}),
    ("GET", "/metrics", None, {}),
    ("POST", "/completion", {"prompt": "Hi", "n_predict": 1}, {}),
    ("POST", "/completion", {"prompt": "Hi", "n_predict": 2, "stream": True}, {}),
    ("GET", "/no-such-route", None, {}),
    ("GET", "/health", None, {"Origin": "http://localhost:5173"}),
    ("OPTIONS", CHAT, None, {"Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST"}),
]
#: names llama-server writes and we do not (ALLOW header:only-theirs), in lower case
ONLY_THEIRS = {"server", "keep-alive", "access-control-allow-origin", "connection"}


@pytest.mark.parametrize("method,path,body,headers", HEADER_CASES,
                         ids=[f"{m} {p} {sorted(h)}{'' if b is None else ' ' + json.dumps(b)[:30]}"
                              for m, p, b, h in HEADER_CASES])
def test_header_names_as_llama_server_writes_them(pair: tuple[str, str], method: str, path: str, body: Any,
                                                  headers: dict[str, str]) -> None:
    """The raw header names on the wire (``Headers.raw``: as received, not folded): every name both send is
    spelled alike (llama.cpp's test harness keeps headers in a plain dict); the ones only llama-server sends are
    the allow-listed ones."""
    ours, theirs = (call(u, method, path, body, headers=headers) for u in pair)
    assert ours.status_code == theirs.status_code
    a = {k.decode(): v for k, v in ours.headers.raw}
    b = {k.decode(): v for k, v in theirs.headers.raw}
    shared = {k.lower() for k in a} & {k.lower() for k in b}
    assert shared >= {"content-type"} or method == "OPTIONS", (a, b)
    spelled = {k: ([x for x in a if x.lower() == k], [x for x in b if x.lower() == k]) for k in shared}
    assert {k: v for k, v in spelled.items() if v[0] != v[1]} == {}
    only = ONLY_THEIRS | ({"access-control-allow-headers"} if method == "OPTIONS" else set())
    assert {k.lower() for k in b} - {k.lower() for k in a} <= only
    # ours beyond theirs: Date, the stream's request id and prompt tokens, Cache-Control, Vary; all Title-Case
    assert all(k == "-".join(w.capitalize() for w in k.split("-")) for k in a), list(a)


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
