"""Token probabilities over HTTP: ``n_probs`` / ``post_sampling_probs`` on /completion, ``logprobs`` /
``top_logprobs`` on chat, ``logprobs`` on /v1/completions.

Differential against the real llama-server (the session's ``llama_server`` fixture; the same status,
error type and words, key sets and JSON types, list lengths, stream event sequence) with the numerics on
behind ours (the probabilities of the logits the simulated device returned); the math on ours; the OpenAI
SDK reads them. A request that would run timing-only has no logits: it is refused, never answered with
invented probabilities.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest

from calconsole.server.logprobs import LOWEST_LOGPROB, MAX_N_PROBS, SOURCE_LOGITS, token_text
from tests.server.parity.streams import CHAT, MSG, assert_same_stream, body_of, kind_of, unexplained
from tests.server.parity.streams import FULL as SAME  # deterministic on both: greedy, the real model cannot end early


@pytest.fixture(scope="module")
def numeric(make_module_server: Any) -> str:
    """Ours with the numerics on: the probabilities come from the logits the simulated device returned."""
    return make_module_server(system_kw={"n_slots": 1, "numerics": True}).url


@pytest.fixture(scope="module")
def npair(numeric: str, llama_server: Any) -> tuple[str, str]:
    """(ours with the numerics on, a real llama-server): both have logits to give probabilities from."""
    return numeric, llama_server.url


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def entries_of(doc: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The probability entries of a response or chunk, per choice (native: one list)."""
    if "choices" in doc:
        return [(c.get("logprobs") or {}).get("content") or [] for c in doc["choices"]]
    return [doc.get("completion_probabilities") or []]


def top_lens(doc: dict[str, Any]) -> list[list[int]]:
    return [[len(e.get("top_logprobs", e.get("top_probs", []))) for e in es] for es in entries_of(doc)]


# --- the same answer as llama-server -------------------------------------------------------------------

CASES = [
    ("/completion", {"prompt": "Hello", "n_predict": 2, "n_probs": 3}),
    ("/completion", {"prompt": "Hello", "n_predict": 2, "n_probs": 3, "post_sampling_probs": True}),
    ("/completion", {"prompt": "Hello", "n_predict": 2, "n_probs": True}),
    ("/completion", {"prompt": "Hello", "n_predict": 2, "n_probs": -1}),
    ("/completion", {"prompt": [[1, 2], "Hello"], "n_predict": 1, "n_probs": 2}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": True, "top_logprobs": 2}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": True}),  # 20 each
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": True, "top_logprobs": 0}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": 1}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "n_probs": 2}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": True, "top_logprobs": 2, "n": 2}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": True, "top_logprobs": 2, "post_sampling_probs": True}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "logprobs": 2}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "logprobs": True}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "logprobs": 1, "post_sampling_probs": True}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "logprobs": -1}),
    # refusals, in llama-server's words
    (CHAT, {"messages": MSG, "max_tokens": 2, "top_logprobs": 2}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": False, "top_logprobs": 2}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": "yes", "top_logprobs": 2}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": "yes"}),
    ("/completion", {"prompt": "Hello", "n_predict": 1, "n_probs": "a"}),
    ("/completion", {"prompt": "Hello", "n_predict": 1, "n_probs": 1, "post_sampling_probs": "yes"}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 1, "logprobs": "a"}),
]


@pytest.mark.parametrize("path,body", CASES, ids=[f"{p} {str(b)[:60]}" for p, b in CASES])
def test_same_answer_as_llama_server(npair: tuple[str, str], path: str, body: dict[str, Any]) -> None:
    body = {**body, **SAME}
    ours, theirs = (post(u, path, body) for u in npair)
    assert ours.status_code == theirs.status_code, (ours.text[:300], theirs.text[:300])
    a, b = ours.json(), theirs.json()
    if theirs.status_code >= 400:
        assert a["error"] == b["error"]  # code, type and llama-server's message
        return
    assert unexplained(a, b) == []
    docs = (a, b) if isinstance(a, dict) else (a[0], b[0])
    if body.get("post_sampling_probs"):  # as many tokens (the candidates left depend on the model)
        assert [len(x) for x in top_lens(docs[0])] == [len(x) for x in top_lens(docs[1])]
    else:  # as many tokens, as many alternatives each
        assert top_lens(docs[0]) == top_lens(docs[1])


STREAMS = [
    ("native", "/completion", {"prompt": "Hello", "n_predict": 3, "n_probs": 2}),
    ("native", "/completion", {"prompt": "Hello", "n_predict": 3, "n_probs": 2, "post_sampling_probs": True}),
    ("chat", CHAT, {"messages": MSG, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
                    "stream_options": {"include_usage": True}}),
    ("chat", CHAT, {"messages": MSG, "max_tokens": 3, "logprobs": True, "top_logprobs": 1,
                    "post_sampling_probs": True}),
    ("text", "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "logprobs": 2}),
]


@pytest.mark.parametrize("route,path,body", STREAMS, ids=[f"{p} {str(b)[:60]}" for _, p, b in STREAMS])
def test_same_stream_as_llama_server(npair: tuple[str, str], route: str, path: str, body: dict[str, Any]) -> None:
    body = {**body, **SAME, "stream": True}
    ours, theirs = (post(u, path, body) for u in npair)
    assert ours.status_code == theirs.status_code == 200
    a, b = body_of(ours), body_of(theirs)
    assert_same_stream(a, b, route)
    pieces = [e for e in a if kind_of(e, route) == "piece"]
    assert pieces and all(entries_of(e)[0] for e in pieces)  # every piece carries its tokens' probabilities
    assert sum(len(entries_of(e)[0]) for e in pieces) == 3  # one entry per token (no EOS: ignore_eos)


# --- the math, from the logits the simulated device returned -------------------------------------------

def test_greedy_top_one_is_the_chosen_token_and_probabilities_sum_below_one(numeric: str) -> None:
    r = post(numeric, "/completion", {"prompt": "The lighthouse", "n_predict": 4, "temperature": 0, "n_probs": 5,
                                      "return_tokens": True}).json()
    cp = r["completion_probabilities"]
    assert [e["id"] for e in cp] == r["tokens"][: len(cp)] and len(cp) == r["tokens_predicted"]
    for e in cp:
        top = e["top_logprobs"]
        assert len(top) == 5 and top[0]["id"] == e["id"] and top[0]["logprob"] == e["logprob"]  # greedy = top-1
        lps = [t["logprob"] for t in top]
        assert lps == sorted(lps, reverse=True) and all(v <= 0 for v in lps)
        assert math.fsum(math.exp(v) for v in lps) <= 1.0 + 1e-9
        assert e["bytes"] == top[0]["bytes"] and e["token"] == token_text(bytes(e["bytes"]))
    assert r["calconsole"]["logprobs_source"] == SOURCE_LOGITS


def test_post_sampling_probabilities(numeric: str) -> None:
    greedy = post(numeric, "/completion", {"prompt": "The lighthouse", "n_predict": 2, "temperature": 0,
                                           "n_probs": 3, "post_sampling_probs": True}).json()
    for e in greedy["completion_probabilities"]:  # greedy: the arg-max alone, as llama-server lists it
        assert e["prob"] == 1.0 and [(t["id"], t["prob"]) for t in e["top_probs"]] == [(e["id"], 1.0)]
    sampled = post(numeric, "/completion", {"prompt": "The lighthouse", "n_predict": 3, "temperature": 1.0,
                                            "seed": 5, "top_k": 20, "n_probs": 30,
                                            "post_sampling_probs": True}).json()
    for e in sampled["completion_probabilities"]:
        probs = [t["prob"] for t in e["top_probs"]]
        assert 0 < len(probs) <= 20 and math.fsum(probs) == pytest.approx(1.0, abs=1e-6)  # all top-k candidates
        assert probs == sorted(probs, reverse=True) and 0 < e["prob"] <= probs[0]
        assert e["id"] in [t["id"] for t in e["top_probs"]]  # the drawn token was a candidate


def test_chat_streamed_entries_equal_the_whole_reply(numeric: str) -> None:
    body = {"messages": MSG, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = post(numeric, CHAT, body).json()["choices"][0]["logprobs"]["content"]
    events = body_of(post(numeric, CHAT, {**body, "stream": True}))
    streamed = [x for e in events if e != "[DONE]" for x in entries_of(e)[0]]
    assert [e["id"] for e in streamed] == [e["id"] for e in whole][: len(streamed)]
    for s, w in zip(streamed, whole, strict=False):
        assert s["logprob"] == pytest.approx(w["logprob"], abs=1e-6)  # same prompt, same logits (cached prefix)


def test_stop_word_tokens_are_dropped_from_a_whole_reply(numeric: str) -> None:
    r = post(numeric, "/completion", {"prompt": "The lighthouse", "n_predict": 6, "temperature": 0,
                                      "n_probs": 1, "return_tokens": True}).json()
    # the first non-blank greedy token after the first one is the stop word (the simulator is deterministic)
    words = [token_text(bytes(e["bytes"])) for e in r["completion_probabilities"][1:]]
    word = next((w for w in words if w.strip()), "")
    assert word.strip(), f"every greedy token after the first is blank: {words!r}"
    stopped = post(numeric, "/completion", {"prompt": "The lighthouse", "n_predict": 6, "temperature": 0,
                                            "n_probs": 1, "stop": [word.strip()]}).json()
    assert stopped["stop_type"] == "word"
    assert len(stopped["completion_probabilities"]) < stopped["tokens_predicted"]
    # streamed, as llama-server: a piece for every token, the stop word's too (with the text before the word)
    events = body_of(post(numeric, "/completion", {"prompt": "The lighthouse", "n_predict": 6, "temperature": 0,
                                                 "n_probs": 1, "stop": [word.strip()], "stream": True}))
    pieces = [e for e in events if not e["stop"]]
    assert sum(len(e["tokens"]) for e in pieces) == events[-1]["tokens_predicted"]
    assert sum(len(entries_of(e)[0]) for e in pieces) == events[-1]["tokens_predicted"]
    assert word.strip() not in "".join(e["content"] for e in pieces) and events[-1]["stop_type"] == "word"


# --- timing-only: no logits, so no probabilities: refused, in llama-server's error shape -------------------

TIMING_ONLY = [
    ("/completion", {"prompt": "Hello", "n_predict": 2, "n_probs": 3}),
    ("/completion", {"prompt": "Hello", "n_predict": 2, "n_probs": 3, "stream": True}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": True, "top_logprobs": 1}),
    (CHAT, {"messages": MSG, "max_tokens": 2, "logprobs": True, "stream": True}),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "logprobs": 2}),
    ("/completion", {"prompt": "Hello", "n_predict": 2, "n_probs": 2, "grammar": 'root ::= "a" | "b"'}),
]


@pytest.mark.parametrize("path,body", TIMING_ONLY, ids=[f"{p} {str(b)[:60]}" for p, b in TIMING_ONLY])
def test_timing_only_requests_for_probabilities_are_refused(pair: tuple[str, str], path: str,
                                                             body: dict[str, Any]) -> None:
    """Ours timing-only (numerics off): 400 ``invalid_request_error`` saying it runs timing-only and why, with
    llama-server's error body (the real server's own 400 for comparison); the same request without
    probabilities is served."""
    r = post(pair[0], path, body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    theirs = post(pair[1], "/completion", {"prompt": "x", "n_predict": "a"}).json()["error"]  # a 400 of theirs
    assert set(err) == set(theirs) and err["code"] == 400 and err["type"] == "invalid_request_error"
    assert "timing-only" in err["message"] and "numerics off" in err["message"], err
    plain = {k: v for k, v in body.items() if k not in ("n_probs", "logprobs", "top_logprobs")}
    assert post(pair[0], path, plain).status_code == 200


def test_over_the_numeric_limit_is_refused_with_that_reason(make_server: Any) -> None:
    """Numerics on, but a prompt over the numeric limit would run timing-only: refused, naming the limit; a
    short prompt is served with the logits' probabilities."""
    url = make_server(system_kw={"n_slots": 1, "numerics": True, "numerics_max_prompt": 8}).url
    r = post(url, "/completion", {"prompt": "one two three four five six seven eight nine ten eleven",
                                  "n_predict": 1, "n_probs": 2})
    assert r.status_code == 400 and "over the numeric limit of 8" in r.json()["error"]["message"], r.text
    ok = post(url, "/completion", {"prompt": "Hi", "n_predict": 1, "n_probs": 2}).json()
    assert ok["calconsole"]["logprobs_source"] == SOURCE_LOGITS and len(ok["completion_probabilities"]) == 1


def test_refusals_beyond_llama_server(pair: tuple[str, str]) -> None:
    r = post(pair[0], "/completion", {"prompt": "Hello", "n_predict": 1, "n_probs": MAX_N_PROBS + 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert str(MAX_N_PROBS) in r.json()["error"]["message"]


def test_token_text_cuts_an_incomplete_character() -> None:
    assert token_text("é".encode()[:1]) == "" and token_text(b"a\xe6\xbe") == "a" and token_text(b"ab") == "ab"
    assert token_text("é".encode()) == "é" and token_text(b"\xff") == "\ufffd"
    assert LOWEST_LOGPROB < -1e38


# --- the OpenAI SDK reads them ---------------------------------------------------------------------------

def test_openai_sdk_reads_logprobs(numeric: str) -> None:
    client = openai.OpenAI(base_url=numeric + "/v1", api_key="none", max_retries=0, timeout=60)
    r = client.chat.completions.create(model="m", messages=MSG, max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and isinstance(c.token, str) and isinstance(c.bytes, list) for c in content)
    chunks = list(client.chat.completions.create(model="m", messages=MSG, max_tokens=3, logprobs=True,
                                                 top_logprobs=1, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert streamed and all(len(c.top_logprobs) == 1 for c in streamed)
    with pytest.raises(openai.BadRequestError, match="top_logprobs requires logprobs"):
        client.chat.completions.create(model="m", messages=MSG, max_tokens=1, top_logprobs=2)
    # /v1/completions: llama-server's entries under the SDK's legacy Logprobs model (kept as its extra field)
    text = client.completions.create(model="m", prompt="Hello", max_tokens=2, logprobs=2)
    entries = text.choices[0].logprobs.model_extra["content"]
    assert len(entries) == 2 and all(len(e["top_logprobs"]) == 2 for e in entries)


# --- the remote planes carry them (calconsole serve and a real llama-server) -----------------------------

def test_remote_planes_carry_the_probabilities(npair: tuple[str, str], pair: tuple[str, str], tmp_path: Any) -> None:
    from calconsole.remote import connect
    from sim_backend.errors import InvalidRequestError
    from sim_backend.planes import ChatRequest, DoneEvent, SamplingParams, TokenEvent

    req = ChatRequest.from_prompt("Say hi.", max_tokens=3, sampling=SamplingParams.greedy(), ignore_eos=True,
                                  n_probs=2)
    for i, url in enumerate(npair):
        with connect(url, audit_path=tmp_path / f"audit-{i}.jsonl") as system:
            events = list(system.inference.submit(req).stream(timeout=60))
            res = events[-1].result
            assert isinstance(events[-1], DoneEvent) and res.status == "finished", res
            streamed = [p for e in events if isinstance(e, TokenEvent) for p in e.probs]
            assert len(streamed) == 3 and res.probs == tuple(streamed)
            assert all(len(p.top) == 2 and p.from_logits for p in streamed)
            # greedy: the top-1 is the token chosen
            assert all(p.top[0].id == p.id and p.logprob == pytest.approx(p.top[0].logprob) for p in streamed)
    # a timing-only server's refusal reaches the remote plane typed, with its reason
    with connect(pair[0], audit_path=tmp_path / "audit-t.jsonl") as system, \
            pytest.raises(InvalidRequestError, match="timing-only"):
        list(system.inference.submit(req).stream(timeout=60))


def test_codec_reads_back_what_the_face_writes() -> None:
    import json

    from calconsole.codec import probs_from_wire, probs_json
    from sim_backend.planes import TokenLogprob, TokenProbs

    probs = (TokenProbs(5, -0.25, (TokenLogprob(5, -0.25, b"a"), TokenLogprob(7, -math.inf, b"\xe6"))),
             TokenProbs(9, -1.5, (TokenLogprob(9, -1.5, b""),), post_sampling=True, piece=b"xy"))
    back = probs_from_wire(json.loads(json.dumps(probs_json(probs))))
    assert [(p.id, p.post_sampling, [t.id for t in p.top]) for p in back] == [(5, False, [5, 7]), (9, True, [9])]
    assert back[0].top[1].logprob == -math.inf and back[0].top[1].piece == b"\xe6"  # a zero probability
    assert back[1].logprob == pytest.approx(-1.5) and back[1].piece == b"xy"
