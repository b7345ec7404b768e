"""The serving face's routes with llama-server's and OpenAI's shapes, over real HTTP (httpx).

One timing-only, fast-paced server per module on 127.0.0.1:0 (no keys); servers with other
settings are built per test.
"""

from __future__ import annotations

import json

import httpx
import pytest

from sim_backend.compose import Pacing, PacingMode
from tests.server.conftest import wait_until

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def srv(make_module_server):
    return make_module_server(system_kw={"n_slots": 2})


def post(srv, path, body, **kw):
    return httpx.post(srv.url + path, json=body, timeout=60, **kw)


def error_of(r: httpx.Response, status: int, type_: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == type_, err
    return err["message"]


def sse_events(raw: bytes) -> list[str]:
    """``data:`` payloads of an SSE body framed as llama-server frames it (``\\n\\n`` between events)."""
    assert raw.endswith(b"\n\n"), raw[-40:]
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        if block.startswith(":"):  # keep-alive comment
            continue
        assert block.startswith("data: ") and "\n" not in block, repr(block)
        out.append(block[len("data: "):])
    return out


# --- monitoring routes ----------------------------------------------------------------------------

def test_health_reads_the_planes_state_not_a_snapshot(srv, monkeypatch):
    """GET /health takes ``observation.health()`` (state only, ~4 µs), never a snapshot (~0.7 ms CPU)."""
    obs = srv.system.observation
    h, dev = obs.health(), obs.snapshot().device
    assert (h.status, h.mode, h.lease_holder) == (dev.status, dev.mode, dev.lease_holder) == ("ok", "serving", None)

    def no_snapshot():
        raise AssertionError("GET /health took a snapshot")

    monkeypatch.setattr(obs, "snapshot", no_snapshot)
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}


def test_health_props_models(srv):
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    props = httpx.get(srv.url + "/props").json()
    dgs = props["default_generation_settings"]
    assert dgs["n_ctx"] == 40960 and dgs["params"]["n_predict"] == -1 and dgs["params"]["temperature"] == 0.8
    assert props["total_slots"] == 2 and "<|im_start|>" in props["chat_template"]
    assert props["build_info"].startswith("b") and props["model_alias"] == "qwen3-30b-a3b"
    dev = props["device"]
    assert len(dev["chiplets"]) == 2 and dev["calrt_version"] and isinstance(dev["findings"], list)
    models = httpx.get(srv.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen3-30b-a3b"


def test_slots_shape(srv):
    slots = httpx.get(srv.url + "/slots").json()
    assert [s["id"] for s in slots] == [0, 1]
    for s in slots:  # llama-server's idle slot: these four keys only
        assert s == {"id": s["id"], "n_ctx": 40960, "speculative": False, "is_processing": False}


def test_metrics_is_prometheus_text(srv):
    from prometheus_client.parser import text_string_to_metric_families

    post(srv, CHAT, {"messages": [{"role": "user", "content": "count me"}], "max_tokens": 3})
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert "llamacpp:prompt_tokens" in fams or "llamacpp:prompt_tokens_total" in fams
    assert any(n.startswith("llamacpp:") for n in fams)


def test_disabled_endpoints_are_501(make_server):
    s = make_server(slots_endpoint=False, metrics_endpoint=False)
    for path in ("/slots", "/metrics"):
        error_of(httpx.get(s.url + path), 501, "not_supported_error")


def test_models_the_calbin_is_not_say_what_serve_offers(srv):
    """llama-server's 501 for embeddings / reranking names its start option; calconsole serve has none, so ours keeps
    llama-server's first sentence (what clients match) and does not send the user after a flag that does not exist."""
    import argparse

    from calconsole.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))  # noqa: SLF001
    options = {o for a in sub.choices["serve"]._actions for o in a.option_strings}  # noqa: SLF001
    assert "--slot-save-path" in options  # the one "Start it with" that stays (routes_slots) is true
    emb, rer = "This server does not support embeddings.", "This server does not support reranking."
    for path, body, first in (("/v1/embeddings", {"input": "hi"}, emb), ("/embedding", {"content": "hi"}, emb),
                              ("/rerank", {"query": "a", "documents": ["b"]}, rer)):
        msg = error_of(httpx.post(srv.url + path, json=body), 501, "not_supported_error")
        assert msg.startswith(first) and "calconsole serve" in msg, msg
        named = {w.strip("`.,") for w in msg.split() if w.strip("`").startswith("--")}
        assert named <= options, (named, msg)  # every option it names is one serve has
        assert "--embeddings" not in msg and "--reranking" not in msg


def test_tokenize_detokenize_template(srv):
    r = post(srv, "/tokenize", {"content": "Hello, world!"}).json()
    assert r == {"tokens": [9707, 11, 1879, 0]}  # facts.md "Tokenizer" reference ids
    pieces = post(srv, "/tokenize", {"content": "Hello, world!", "with_pieces": True}).json()["tokens"]
    assert pieces[0] == {"id": 9707, "piece": "Hello"} and pieces[2] == {"id": 1879, "piece": " world"}
    special = post(srv, "/tokenize", {"content": "<|im_start|>user\nhi<|im_end|>\n"}).json()["tokens"]
    assert special == [151644, 872, 198, 6023, 151645, 198]
    plain = post(srv, "/tokenize", {"content": "<|im_end|>", "parse_special": False}).json()["tokens"]
    assert 151645 not in plain
    assert post(srv, "/detokenize", {"tokens": [9707, 11, 1879, 0]}).json() == {"content": "Hello, world!"}
    # a piece that is not whole UTF-8 is given as bytes
    emoji = post(srv, "/tokenize", {"content": "😀", "with_pieces": True}).json()["tokens"]
    assert all(isinstance(p["piece"], (str, list)) for p in emoji)
    t = post(srv, "/apply-template", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert t["prompt"].startswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    n = post(srv, "/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert n == {"input_tokens": len(post(srv, "/tokenize", {"content": t["prompt"]}).json()["tokens"]),
                 "object": "response.input_tokens"}


def test_chat_template_jinja_matches_renderer(srv):
    """The template /props reports renders exactly what the server feeds the model."""
    jinja2 = pytest.importorskip("jinja2")
    tmpl = jinja2.Environment().from_string(httpx.get(srv.url + "/props").json()["chat_template"])
    convs = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"}, {"role": "user", "content": "again"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>a"}],
    ]
    for msgs in convs:
        for think in (False, True):
            want = post(srv, "/apply-template", {"messages": msgs,
                                                 "chat_template_kwargs": {"enable_thinking": think}}).json()["prompt"]
            if msgs[-1]["role"] == "assistant":  # a prefill: the reply so far, after the generation prompt
                # (thinking closed before it, as llama-server renders a continued reply)
                got = tmpl.render(messages=msgs[:-1], add_generation_prompt=True,
                                  enable_thinking=False) + msgs[-1]["content"]
            else:
                got = tmpl.render(messages=msgs, add_generation_prompt=True, enable_thinking=think)
            assert got == want, (msgs, think)


# --- generation ---------------------------------------------------------------------------------

def test_chat_completion_non_streaming(srv):
    r = post(srv, CHAT, {"model": "x", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5})
    assert r.status_code == 200
    d = r.json()
    assert d["object"] == "chat.completion" and d["id"].startswith("chatcmpl-") and d["model"] == "x"
    ch = d["choices"][0]
    assert ch["message"]["role"] == "assistant" and ch["finish_reason"] in ("stop", "length")
    u = d["usage"]
    assert u["completion_tokens"] == d["timings"]["predicted_n"]
    assert u["prompt_tokens"] == d["timings"]["prompt_n"] + d["timings"]["cache_n"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["prompt_tokens_details"]["cached_tokens"] == d["timings"]["cache_n"]
    ext = d["calconsole"]
    assert ext["status"] == "finished" and len(ext["tokens"]) == u["completion_tokens"]
    if ch["finish_reason"] == "length":
        assert u["completion_tokens"] == 5 and ext["stop_type"] == "limit"


def test_chat_stream_framing_byte_for_byte(srv):
    body = {"messages": [{"role": "user", "content": "stream please"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.url + CHAT, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"].isdigit()
        raw = b"".join(r.iter_bytes())
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    first = chunks[0]
    assert events[0].startswith('{"choices":[{"finish_reason":null,"index":0,"delta":{"role":"assistant",'
                                '"content":null}}],"created":')
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks) and first["id"].startswith("chatcmpl-")
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0]["choices"][0]["delta"] == {}
    assert chunks.index(finals[0]) == len(chunks) - 2  # then the usage chunk
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    assert "cached_tokens" in usage_chunk["usage"]["prompt_tokens_details"]
    assert "timings" in usage_chunk and "timings" not in finals[0]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:-2])
    assert isinstance(text, str)


def test_chat_stream_without_usage_has_timings_in_final_chunk(srv):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", srv.url + CHAT, json=body, timeout=60) as r:
        chunks = [json.loads(e) for e in sse_events(b"".join(r.iter_bytes()))[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "timings" in chunks[-1]
    assert not any("usage" in c for c in chunks)


def test_native_completion_text_and_ids(srv):
    r = post(srv, "/completion", {"prompt": "Hello", "n_predict": 3, "return_tokens": True}).json()
    assert r["stop"] is True and r["stop_type"] == "limit" and r["tokens_predicted"] == 3
    assert len(r["tokens"]) == 3 and r["tokens_evaluated"] == 1 and r["truncated"] is False
    assert set(r) >= {"content", "stopping_word", "tokens_cached", "timings", "generation_settings"}
    ids = post(srv, "/completion", {"prompt": [9707, 11, 1879], "n_predict": 2}).json()
    assert ids["tokens_evaluated"] == 3 and ids["tokens"] == []  # tokens only with return_tokens, as llama.cpp
    mixed = post(srv, "/completion", {"prompt": [9707, ", world"], "n_predict": 1}).json()
    assert mixed["tokens_evaluated"] == 3
    # the prompt is echoed as the model saw it (its ids detokenized), as llama-server does
    assert r["prompt"] == "Hello" and ids["prompt"] == "Hello, world" and mixed["prompt"] == "Hello, world"


def test_native_completion_stream_has_no_done(srv):
    with httpx.stream("POST", srv.url + "/completion", json={"prompt": "Hi", "n_predict": 3, "stream": True},
                      timeout=60) as r:
        events = sse_events(b"".join(r.iter_bytes()))
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events]
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert chunks[-1]["tokens_predicted"] == 3 and chunks[-1]["stop_type"] == "limit"
    assert chunks[-1]["prompt"] == "Hi"


def test_openai_text_completion(srv):
    d = post(srv, "/v1/completions", {"prompt": "Once", "max_tokens": 2}).json()
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"]["completion_tokens"] == 2 and d["usage"]["prompt_tokens"] == 1


def test_id_slot_and_cache_prompt(srv):
    msgs = [{"role": "user", "content": "a prompt long enough to reuse its prefix"}]
    post(srv, CHAT, {"messages": msgs, "max_tokens": 1, "id_slot": 1})
    again = post(srv, CHAT, {"messages": msgs, "max_tokens": 1, "id_slot": 1}).json()
    assert again["timings"]["cache_n"] > 0
    cold = post(srv, CHAT, {"messages": msgs, "max_tokens": 1, "id_slot": 1, "cache_prompt": False}).json()
    assert cold["timings"]["cache_n"] == 0
    error_of(post(srv, CHAT, {"messages": msgs, "max_tokens": 1, "id_slot": 7}), 400, "invalid_request_error")


# --- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,field", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 9}, "n"),  # at most MAX_CHOICES (8)
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
    ({"messages": [{"role": "user", "content": "   "}]}, "prompt"),
])
def test_bad_chat_bodies_are_400_naming_the_field(srv, body, field):
    before = httpx.get(srv.url + "/slots").json()
    msg = error_of(post(srv, CHAT, body), 400, "invalid_request_error")
    assert field in msg, msg
    assert httpx.get(srv.url + "/slots").json() == before


@pytest.mark.parametrize("raw,what", [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
                                      (b"", "empty")])
def test_malformed_bodies_are_400(srv, raw, what):
    r = httpx.post(srv.url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert what in error_of(r, 400, "invalid_request_error")


def test_body_over_limit_is_400(make_server):
    s = make_server(max_body_bytes=2048)
    big = {"messages": [{"role": "user", "content": "x" * 4096}], "max_tokens": 1}
    assert "limit" in error_of(httpx.post(s.url + CHAT, json=big), 400, "invalid_request_error")

    def chunks():  # no Content-Length: the limit holds for a chunked body too
        for _ in range(4):
            yield b" " * 1024

    r = httpx.post(s.url + CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert "limit" in error_of(r, 400, "invalid_request_error")


def test_prompt_of_context_size_is_exceed_context_size_error(srv):
    ids = [9707] * 40960
    r = post(srv, "/completion", {"prompt": ids, "n_predict": 1})
    error_of(r, 400, "exceed_context_size_error")
    err = r.json()["error"]
    assert err["n_prompt_tokens"] == 40960 and err["n_ctx"] == 40960


def test_context_limit_bounds_total_tokens(srv):
    """A prompt of n_ctx - 2 tokens generates 2 tokens at most: usage.total_tokens never exceeds n_ctx."""
    r = post(srv, "/v1/completions", {"prompt": [9707] * 40958, "max_tokens": 50})
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["total_tokens"] == 40960 and u["completion_tokens"] == 2
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_unknown_route_and_method(srv):
    error_of(httpx.get(srv.url + "/nope"), 404, "not_found_error")
    error_of(httpx.get(srv.url + CHAT), 404, "not_found_error")  # llama-server: method and path route together
    error_of(httpx.post(srv.url + "/maintenance/reset", json={}), 404, "not_found_error")


def test_too_many_streams_is_503(make_server):
    s = make_server(max_streams=1, system_kw={"pacing": Pacing(PacingMode.REALTIME, 0.2)})
    # greedy with a seed: the same reply every run (a sampled one could stop at an early end-of-text token, and
    # on a loaded machine the first stream had ended by the time the second request came: 200)
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 200, "stream": True,
            "temperature": 0, "seed": 1}
    with httpx.stream("POST", s.url + CHAT, json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream when collected
        next(lines)
        assert wait_until(lambda: s.face.in_flight == 1)
        second = post(s, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert "busy" in error_of(second, 503, "unavailable_error")
        assert s.face.stats.refused_busy == 1 and s.face.in_flight == 1  # the first one still streams


def test_queue_full_is_503(make_server):
    s = make_server(system_kw={"n_slots": 1, "queue_limit": 0, "pacing": Pacing(PacingMode.REALTIME, 0.2)})
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 200, "stream": True,
            "temperature": 0, "seed": 1}
    with httpx.stream("POST", s.url + CHAT, json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream when collected
        next(lines)  # the role chunk: sent before the request has its slot
        # the one slot taken (under load that came after the first line: /slots still had it free)
        assert wait_until(lambda: httpx.get(s.url + "/slots?fail_on_no_slot=1").status_code == 503)
        second = post(s, CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert "busy" in error_of(second, 503, "unavailable_error")



def test_disconnect_mid_stream_cancels_and_frees_kv(make_server):
    s = make_server(system_kw={"n_slots": 1, "pacing": Pacing(PacingMode.REALTIME, 0.5)})
    obs = s.system.observation
    body = {"messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 500, "stream": True}
    with httpx.stream("POST", s.url + CHAT, json=body, timeout=60) as r:
        lines = r.iter_lines()
        while '"delta":{"content":' not in next(lines):
            pass
        assert obs.snapshot().slots[0].state == "decoding"
    # the client is gone: within one device step (~17 ms simulated, x2 at speed 0.5) plus polling
    assert wait_until(lambda: obs.snapshot().slots[0].state == "idle")
    snap = obs.snapshot()
    assert snap.requests.counters.cancelled == 1 and snap.requests.balanced
    assert snap.kv.used_tokens == 0  # a cancelled reply's sequence is freed


def test_deadline_cancels_with_an_error_event(make_server):
    s = make_server(request_timeout_s=1.0, system_kw={"pacing": Pacing(PacingMode.REALTIME, 0.2)})
    body = {"messages": [{"role": "user", "content": "slow"}], "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", s.url + CHAT, json=body, timeout=60) as r:
        events = sse_events(b"".join(r.iter_bytes()))
    err = json.loads(events[-1])["error"]
    assert err["type"] == "unavailable_error" and "deadline" in err["message"]
    non_stream = post(s, CHAT, {**body, "stream": False})
    assert "deadline" in error_of(non_stream, 503, "unavailable_error")


def test_no_limit_ends_at_the_deadline_with_what_it_generated(make_server):
    # max_tokens -1 (llama-server: until the context is full or a stop) ran a non-streaming request into the
    # 600 s deadline and answered 503 with nothing; the deadline is its limit: 200, finish_reason length
    s = make_server(request_timeout_s=1.0, system_kw={"pacing": Pacing(PacingMode.REALTIME, 0.2)})
    body = {"messages": [{"role": "user", "content": "go on forever"}], "max_tokens": -1}
    r = post(s, CHAT, body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["finish_reason"] == "length" and out["choices"][0]["message"]["content"]
    n = out["usage"]["completion_tokens"]
    assert 0 < n < 40960 - out["usage"]["prompt_tokens"]  # the deadline ended it, not the context
    native = post(s, "/completion", {"prompt": "and on", "n_predict": -1}).json()
    assert native["stop_type"] == "limit" and native["stop"] is True and native["tokens_predicted"] > 0
    with httpx.stream("POST", s.url + CHAT, json={**body, "stream": True}, timeout=60) as st:
        events = sse_events(b"".join(st.iter_bytes()))
    assert events[-1] == "[DONE]" and not any("error" in json.loads(e) for e in events[:-1])
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    counters = s.system.observation.snapshot().requests.counters
    assert counters.finished == 3 and counters.cancelled == 0


def test_a_reader_that_stops_reading_loses_its_slot(make_server):
    """Slow client: once a chunk cannot be sent within send_timeout_s the stream is closed and cancelled."""
    import socket

    s = make_server(send_timeout_s=0.5, system_kw={"n_slots": 1})
    s.thread.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # accepted sockets inherit it: fills fast
    body = json.dumps({"messages": [{"role": "user", "content": "flood"}], "max_tokens": 30000,
                       "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((s.thread.host, s.thread.port))
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        obs = s.system.observation
        assert wait_until(lambda: obs.snapshot().slots[0].state != "idle")
        # never read: the server's sends block, time out, and the request is cancelled
        assert wait_until(lambda: obs.snapshot().requests.counters.cancelled == 1, timeout=30)
        assert obs.snapshot().slots[0].state == "idle" and obs.snapshot().kv.used_tokens == 0
    finally:
        sock.close()


def test_non_streaming_client_that_gives_up_cancels(make_server):
    s = make_server(system_kw={"n_slots": 1, "pacing": Pacing(PacingMode.REALTIME, 0.2)})
    obs = s.system.observation
    body = {"messages": [{"role": "user", "content": "slow one"}], "max_tokens": 500}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(s.url + CHAT, json=body, timeout=httpx.Timeout(60, read=1.0))
    assert wait_until(lambda: obs.snapshot().requests.counters.cancelled == 1)
    assert obs.snapshot().slots[0].state == "idle" and obs.snapshot().kv.used_tokens == 0


def test_props_says_which_host_work_the_timings_book(make_server):
    # /props said "timings are simulated device ms" whether the server books modeled or measured host work
    for mode in ("modeled", "measured"):
        s = make_server(system_kw={"host_time": mode})
        clock = httpx.get(s.url + "/props").json()["device"]["clock"]
        assert clock.startswith("timings are simulated device ms") and f"host work {mode}" in clock, clock


def test_per_token_timings_say_their_clock_books_host_work(make_server):
    # /completion timings_per_token labelled sim_ms "simulated device ms"; the clock also books host work
    s = make_server(system_kw={"host_time": "modeled"})
    r = httpx.post(s.url + "/completion", json={"prompt": "hi", "n_predict": 3, "stream": True,
                                               "timings_per_token": True}, timeout=60)
    chunks = [json.loads(e) for e in sse_events(r.content)]
    per_token = [c["calconsole"] for c in chunks if not c["stop"]]
    assert per_token and all(t["clock"] == "simulated ms: device time + booked host work" for t in per_token)
    final = chunks[-1]["calconsole"]["timings"]
    assert final["host_booked_ms"] > 0 and per_token[-1]["sim_ms"] <= final["done_ms"]


def test_a_timing_only_reply_says_why_in_its_calconsole_timings(make_server):
    # a reply whose tokens are not the model's said "numerics": false over HTTP without the reason the
    # console and `calconsole chat` show; the engine's reason now travels with the timings
    from sim_backend.planes.types import NUMERICS_OFF

    s = make_server()  # numerics off
    body = httpx.post(s.url + "/completion", json={"prompt": "hi", "n_predict": 2}, timeout=60).json()
    t = body["calconsole"]["timings"]
    assert t["numerics"] is False and t["timing_only_reason"] == NUMERICS_OFF
    chat = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2}, timeout=60).json()
    assert chat["calconsole"]["timings"]["timing_only_reason"] == NUMERICS_OFF
    # several choices on /v1/completions (a list of prompts, or n): one extension per choice, as chat has
    for body in ({"prompt": ["hi", "there"], "max_tokens": 2}, {"prompt": "hi", "n": 2, "max_tokens": 2}):
        out = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
        per_choice = out["calconsole"]["choices"]
        assert len(per_choice) == len(out["choices"]) == 2
        assert all(c["timings"]["timing_only_reason"] == NUMERICS_OFF and c["tokens"] for c in per_choice)
