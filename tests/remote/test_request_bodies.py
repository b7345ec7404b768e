"""What the remote planes send: every request field a server acts on reaches its body."""

from __future__ import annotations

import pytest

from calconsole.remote.inference import request_body as serve_body
from calconsole.remote.llamacpp.inference import request_body as llama_body
from sim_backend.planes import ChatRequest, Grammar, SamplingParams


@pytest.mark.parametrize("build", [serve_body, llama_body], ids=["calconsole serve", "llama-server"])
def test_ignore_eos_and_sampling_reach_the_body(build) -> None:
    req = ChatRequest.from_prompt("hi", max_tokens=5, ignore_eos=True, stop=("x",),
                                  sampling=SamplingParams(temperature=0.0, seed=3))
    path, body = build(req)
    assert path.endswith("/chat/completions")
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["seed"] == 3 and body["stop"] == ["x"]
    assert "ignore_eos" not in build(ChatRequest.from_prompt("hi", max_tokens=5))[1]  # the server's default
    raw_path, raw = build(ChatRequest(messages=(), prompt_tokens=(1, 2), max_tokens=2, ignore_eos=True))
    assert raw["prompt"] == [1, 2] and raw["ignore_eos"] is True and raw_path in ("/v1/completions", "/completion")


@pytest.mark.parametrize("build", [serve_body, llama_body], ids=["calconsole serve", "llama-server"])
def test_a_grammar_reaches_the_body_in_llama_servers_fields(build) -> None:
    _, body = build(ChatRequest.from_prompt("hi", grammar=Grammar("gbnf", 'root ::= "a"')))
    assert body["grammar"] == 'root ::= "a"' and "json_schema" not in body
    _, raw = build(ChatRequest(messages=(), prompt_tokens=(1,), grammar=Grammar("json_schema", '{"type":"object"}')))
    assert raw["json_schema"] == {"type": "object"} and "grammar" not in raw
    assert "grammar" not in build(ChatRequest.from_prompt("hi"))[1]
