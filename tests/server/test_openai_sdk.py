"""The real ``openai`` Python SDK against the serving face: existing clients work unchanged."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest

from tests.server.conftest import API_KEY


@pytest.fixture(scope="module")
def srv(make_module_server):
    return make_module_server(api_key=API_KEY, system_kw={"n_slots": 4, "queue_limit": 16})


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]


def test_chat_non_streaming(client):
    r = client.chat.completions.create(model="qwen3-30b-a3b", messages=MSGS, max_tokens=6, seed=7, temperature=0.7)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 6 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    again = client.chat.completions.create(model="qwen3-30b-a3b", messages=MSGS, max_tokens=6, seed=7,
                                           temperature=0.7)
    assert again.choices[0].message.content == r.choices[0].message.content  # same seed, same tokens


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(model="qwen3-30b-a3b", messages=MSGS, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"] or finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5 or finishes == ["stop"]
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert len({c.id for c in chunks}) == 1


def test_text_completion(client):
    r = client.completions.create(model="qwen3-30b-a3b", prompt="The chiplet", max_tokens=3)
    assert r.object == "text_completion" and r.usage.completion_tokens == 3


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["qwen3-30b-a3b"]


def test_over_long_prompt_is_bad_request(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi " * 41000}],
                                       max_tokens=4)
    assert ei.value.status_code == 400 and "context" in str(ei.value)


def test_bad_parameter_is_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="m", messages=MSGS, max_tokens=2, top_p=1.5)


def test_wrong_key_is_authentication_error(srv):
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="not-the-right-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="m", messages=MSGS, max_tokens=2)


def test_eight_concurrent_streams(client, srv):
    def one(i: int) -> tuple[int, int]:
        text, usage = [], None
        for c in client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"stream {i}"}],
                                                max_tokens=8, stream=True, stream_options={"include_usage": True}):
            if c.choices and c.choices[0].delta.content:
                text.append(c.choices[0].delta.content)
            if c.usage:
                usage = c.usage
        assert usage is not None
        return i, usage.completion_tokens

    with cf.ThreadPoolExecutor(8) as ex:
        results = sorted(ex.map(one, range(8)))
    assert [i for i, _ in results] == list(range(8))
    assert all(n <= 8 for _, n in results)
    snap = srv.system.observation.snapshot()
    assert snap.requests.balanced and snap.kv.used_tokens >= 0
    assert all(s.state == "idle" for s in snap.slots)
