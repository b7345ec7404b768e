"""Differential tests of constrained decoding: the same ``grammar`` / ``json_schema`` / ``response_format``
request to the real llama-server (SmolLM2, llguidance for schemas) and to ``calconsole serve``: the same
status, error type/code and key set, the same JSON key sets and value types of results and stream events
(``ALLOW`` of tests/server/parity/streams.py is the only allowed difference).

Not compared, because llama-server does not refuse them: a ``json_schema`` that does not compile on
/completion (it answers 200 and generates unconstrained; ours is a 400) and a non-string ``grammar``
(ignored there; ours is a 400 naming the field).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.grammar_check import PERSON
from tests.server.parity.streams import CHAT, MSG, assert_same_error, assert_same_stream, body_of, both, unexplained

RF = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
#: greedy (both sides deterministic); max_tokens bounds the real model's (whitespace-flexible) JSON
G = {"temperature": 0}

SAME = [
    (CHAT, {"messages": MSG, "max_tokens": 24, "response_format": RF, **G}),
    (CHAT, {"messages": MSG, "max_tokens": 24, "response_format": {"type": "json_object"}, **G}),
    (CHAT, {"messages": MSG, "max_tokens": 8, "grammar": 'root ::= ("yes" | "no")', **G}),
    ("/completion", {"prompt": "Answer:", "n_predict": 24, "json_schema": PERSON, **G}),
    ("/completion", {"prompt": "Answer:", "n_predict": 8, "grammar": 'root ::= ("yes" | "no")', **G}),
    ("/v1/completions", {"prompt": "Answer:", "max_tokens": 8, "grammar": 'root ::= ("yes" | "no")', **G}),
    # refusals: a grammar that does not parse (every route, streamed too), a response_format type, a bad schema
    ("/completion", {"prompt": "Hi", "n_predict": 4, "grammar": 'root ::= ("yes" | "no"'}),
    ("/completion", {"prompt": "Hi", "n_predict": 4, "grammar": "root ::= missing", "stream": True}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "grammar": 'root ::= ("yes" | "no"'}),
    (CHAT, {"messages": MSG, "max_tokens": 4, "grammar": 'root ::= ("yes" | "no"'}),
    (CHAT, {"messages": MSG, "max_tokens": 4, "grammar": 'root ::= ("yes" | "no"', "stream": True}),
    (CHAT, {"messages": MSG, "max_tokens": 4, "response_format": {"type": "xml"}}),
    (CHAT, {"messages": MSG, "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}}}),
]


@pytest.mark.parametrize("path,body", SAME, ids=[f"{p} {json.dumps(b)[:60]}" for p, b in SAME])
def test_same_answer(pair: tuple[str, str], path: str, body: dict[str, Any]) -> None:
    ours, theirs = both(pair, "POST", path, body)
    assert ours.status_code == theirs.status_code, (ours.text[:300], theirs.text[:300])
    a, b = body_of(ours), body_of(theirs)
    if theirs.status_code >= 400:
        assert_same_error(a, b)
        ea, eb = a["error"], b["error"]
        if body.get("grammar"):  # llama-server's words lead ours (llguidance's reason follows)
            assert ea["message"].startswith(eb["message"]), (ea, eb)
        if "response_format" in body and body["response_format"]["type"] == "xml":
            assert ea["message"] == eb["message"]
    elif path == "/completion":  # the grammar in effect, as llama-server reports it
        ga, gb = a["generation_settings"]["grammar"], b["generation_settings"]["grammar"]
        assert ga == gb if "grammar" in body else ga.startswith("%llguidance {}\nstart: %json ") and gb.startswith(
            "%llguidance {}\nstart: %json "), (ga, gb)
    assert unexplained(a, b) == []


STREAMS = [
    ("chat", CHAT, {"messages": MSG, "max_tokens": 12, "stream": True, "response_format": RF, **G}),
    ("chat", CHAT, {"messages": MSG, "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True},
                    "response_format": {"type": "json_object"}, **G}),
    ("native", "/completion", {"prompt": "Answer:", "n_predict": 12, "stream": True, "json_schema": PERSON, **G}),
]


@pytest.mark.parametrize("route,path,body", STREAMS, ids=[f"{p} {json.dumps(b)[:50]}" for _, p, b in STREAMS])
def test_same_stream(pair: tuple[str, str], route: str, path: str, body: dict[str, Any]) -> None:
    ours, theirs = both(pair, "POST", path, body)
    assert ours.status_code == theirs.status_code == 200
    assert_same_stream(body_of(ours), body_of(theirs), route)
