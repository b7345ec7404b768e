"""Constrained decoding over HTTP: ``grammar`` (GBNF), ``json_schema`` and ``response_format`` on
/v1/chat/completions, /v1/completions and /completion, streamed and not, with raw httpx and the OpenAI SDK;
the output parses and conforms for many seeds (a timing-only simulator: the seeded stand-in draws under the
grammar's mask), and a grammar or schema that does not compile is a 400 in llama-server's shape."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest

from tests.grammar_check import GBNF, GBNF_RE, PERSON, violations

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Describe a user as JSON."}]
RF_PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def srv(make_module_server: Any) -> Any:
    return make_module_server(system_kw={"n_slots": 2})


@pytest.fixture(scope="module")
def client(srv: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def post(srv: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def sse(r: httpx.Response) -> list[Any]:
    return [e if e == "[DONE]" else json.loads(e) for e in re.findall(r"^data: (.*)$", r.text, re.M)]


def test_chat_json_schema_conforms_for_many_seeds(srv: Any) -> None:
    texts = set()
    for seed in range(6):
        r = post(srv, CHAT, {"messages": MSG, "max_tokens": 256, "seed": seed, "response_format": RF_PERSON})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["finish_reason"] == "stop" and violations(json.loads(ch["message"]["content"]), PERSON) == []
        texts.add(ch["message"]["content"])
    assert len(texts) > 3


@pytest.mark.parametrize("extra", [{"response_format": {"type": "json_object"}}, {"json_schema": {"type": "object"}},
                                   {"response_format": {"type": "json_object", "schema": PERSON}}],
                         ids=["json_object", "json_schema", "json_object+schema"])
def test_chat_stream_joins_to_json(srv: Any, extra: dict[str, Any]) -> None:
    for seed in range(2):
        r = post(srv, CHAT, {"messages": MSG, "max_tokens": 256, "seed": seed, "stream": True, **extra})
        assert r.status_code == 200
        events = sse(r)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
        value = json.loads(text)
        assert isinstance(value, dict)
        if "schema" in extra.get("response_format", {}):
            assert violations(value, PERSON) == []


def test_completion_routes_honour_grammar_and_schema(srv: Any) -> None:
    for seed in range(2):
        native = post(srv, "/completion", {"prompt": "Answer:", "n_predict": 32, "seed": seed, "grammar": GBNF})
        assert native.status_code == 200 and GBNF_RE.fullmatch(native.json()["content"]), native.text
        assert native.json()["stop_type"] == "eos" and native.json()["generation_settings"]["grammar"] == GBNF
        streamed = sse(post(srv, "/completion", {"prompt": "Answer:", "n_predict": 32, "seed": seed, "stream": True,
                                                 "grammar": GBNF}))
        assert GBNF_RE.fullmatch("".join(e["content"] for e in streamed)), streamed
        oai = post(srv, "/v1/completions", {"prompt": "JSON:", "max_tokens": 256, "seed": seed, "json_schema": PERSON})
        assert violations(json.loads(oai.json()["choices"][0]["text"]), PERSON) == []
        rf = post(srv, "/v1/completions", {"prompt": "JSON:", "max_tokens": 256, "seed": seed,
                                           "response_format": RF_PERSON, "stream": True})
        text = "".join(e["choices"][0]["text"] for e in sse(rf)[:-1])
        assert violations(json.loads(text), PERSON) == []
    schema = post(srv, "/completion", {"prompt": "x", "n_predict": 64, "json_schema": {"type": "object"}}).json()
    assert schema["generation_settings"]["grammar"] == '%llguidance {}\nstart: %json {"type":"object"}'


BAD: list[tuple[dict[str, Any], str]] = [
    ({"grammar": 'root ::= ("yes" | "no"'}, "Failed to initialize samplers: failed to parse grammar"),
    ({"json_schema": {"type": "objectx"}}, "Failed to initialize samplers: failed to parse grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}, "objectx"),
    ({"response_format": {"type": "xml"}}, 'response_format type must be one of "text" or "json_object"'),
    ({"response_format": "json"}, "'response_format' must be an object"),
    ({"grammar": 5}, "'grammar' must be a string"),
    ({"json_schema": "x"}, "'json_schema' must be a JSON schema"),
]


@pytest.mark.parametrize("extra,words", BAD, ids=[json.dumps(b)[:40] for b, _ in BAD])
def test_a_bad_grammar_is_a_400_on_every_route(srv: Any, extra: dict[str, Any], words: str) -> None:
    for path, body in (("/completion", {"prompt": "hi", "n_predict": 4}), ("/v1/completions", {"prompt": "hi"}),
                       (CHAT, {"messages": MSG, "max_tokens": 4})):
        for stream in (False, True):
            r = post(srv, path, {**body, **extra, "stream": stream})
            assert r.status_code == 400, (path, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["code"] == 400 and words in err["message"], err


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    role: Literal["admin", "user", "guest"]
    active: bool


def test_openai_sdk_structured_outputs(client: openai.OpenAI) -> None:
    for seed in range(2):
        r = client.chat.completions.create(model="m", messages=MSG, max_tokens=256, seed=seed,  # type: ignore[arg-type]
                                           response_format=RF_PERSON)  # type: ignore[arg-type]
        assert violations(json.loads(r.choices[0].message.content or ""), PERSON) == []
        # the SDK's own structured-output helper: a pydantic model to a strict schema, parsed back
        parsed = client.chat.completions.parse(model="m", messages=MSG, max_tokens=256, seed=seed,  # type: ignore[arg-type]
                                               response_format=Person)
        p = parsed.choices[0].message.parsed
        assert isinstance(p, Person) and 0 <= p.age <= 150
    stream = client.chat.completions.create(model="m", messages=MSG, max_tokens=256, seed=5, stream=True,  # type: ignore[arg-type]
                                            response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)
    with pytest.raises(openai.BadRequestError, match="failed to parse grammar"):
        client.chat.completions.create(model="m", messages=MSG, max_tokens=4,  # type: ignore[arg-type]
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "objectx"}}})
