"""``return_progress`` over HTTP: llama-server's prompt-progress chunks, differential against the real llama-server.

With ``return_progress: true`` and ``stream: true`` llama-server sends one chunk when the request takes its slot
(``processed`` = the reused prefix, ``time_ms`` 0) and one after each prompt batch, before the first piece:
``/completion`` an empty piece (``tokens: [0]``, ``tokens_predicted`` 0) with ``prompt_progress``; chat a role chunk
with ``prompt_progress`` (the plain role chunk then comes with the first piece); ``/v1/completions`` an empty text
chunk with it. A request that does not stream gets none; a value that is not a boolean is a 400 on both.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

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
    sequence,
)

P = {"return_progress": True, "stream": True}
STREAMS = [
    ("native", "/completion", {"prompt": "Hello there my friend", "n_predict": 2, **P, **FULL}),
    ("native", "/completion", {"prompt": [1, 2, 3], "n_predict": 2, "return_tokens": True, **P, **FULL}),
    ("chat", CHAT, {"messages": MSG, "max_tokens": 2, **P, **FULL}),
    ("chat", CHAT, {"messages": MSG, "max_tokens": 2, "stream_options": {"include_usage": True}, **P, **FULL}),
    ("text", "/v1/completions", {"prompt": "Hello there", "max_tokens": 2, **P, **FULL}),
]


def progress_of(events: list[Any], route: str) -> list[dict[str, int]]:
    return [e["prompt_progress"] for e in events if kind_of(e, route) == "progress"]


@pytest.mark.parametrize("route,path,body", STREAMS, ids=[f"{p} {json.dumps(b)[:50]}" for _, p, b in STREAMS])
def test_same_progress_stream(pair: tuple[str, str], route: str, path: str, body: dict[str, Any]) -> None:
    ours, theirs = both(pair, "POST", path, body)
    assert ours.status_code == theirs.status_code == 200
    a, b = body_of(ours), body_of(theirs)
    assert_same_stream(a, b, route)  # progress chunks first, then role / pieces, finish, usage, [DONE]
    for events in (a, b):
        prog = progress_of(events, route)
        assert len(prog) >= 2, events  # the start and at least one prompt batch
        first, done = prog[0], prog[-1]
        assert (first["processed"], first["time_ms"]) == (first["cache"], 0), prog
        assert done["processed"] == done["total"] and all(p["total"] == done["total"] for p in prog), prog
        assert [p["processed"] for p in prog] == sorted(p["processed"] for p in prog)
        assert all(isinstance(v, int) for p in prog for v in p.values())
        if route == "native":  # the prompt's size is what the final result says was evaluated
            assert done["total"] == events[-1]["tokens_evaluated"] and events[-1]["stop"] is True
            assert all(e["tokens"] == [0] and e["tokens_predicted"] == 0
                       for e in events if kind_of(e, route) == "progress")
        if route == "chat":  # each progress chunk opens the choice as the role chunk does; the role chunk follows
            assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": None}
                       for e in events if kind_of(e, route) == "progress")


def test_n_choices_each_get_their_progress(pair: tuple[str, str]) -> None:
    """Each choice opens with its progress (llama-server sends a child choice only the parent's last one, when the
    shared prompt is done; ours runs each choice in a slot of its own, so each has its start and its steps)."""
    body = {"messages": MSG, "max_tokens": 2, "n": 2, **P, **FULL}
    for events in map(body_of, both(pair, "POST", CHAT, body)):
        for i in (0, 1):
            mine = [e for e in events if e != "[DONE]" and e["choices"] and e["choices"][0]["index"] == i]
            assert sequence(mine, "chat") == ["progress", "role", "piece", "finish"], mine
            done = progress_of(mine, "chat")[-1]
            assert done["processed"] == done["total"], done


def test_a_reused_prefix_is_the_first_chunks_cache(pair: tuple[str, str]) -> None:
    body = {"prompt": "The quick brown fox jumps over the lazy dog", "n_predict": 1, "id_slot": 0, "temperature": 0}
    for url in pair:
        assert call(url, "POST", "/completion", body).status_code == 200
        longer = {**body, "prompt": body["prompt"] + " twice", **P}
        prog = progress_of(body_of(call(url, "POST", "/completion", longer)), "native")
        assert prog[0]["cache"] > 0 and prog[0]["processed"] == prog[0]["cache"] < prog[-1]["processed"], prog


def test_no_progress_without_a_stream(pair: tuple[str, str]) -> None:
    for path, body in (("/completion", {"prompt": "Hi", "n_predict": 1}), (CHAT, {"messages": MSG, "max_tokens": 1})):
        plain, asked = (both(pair, "POST", path, {**body, **extra}) for extra in ({}, {"return_progress": True}))
        for a, b in zip(plain, asked, strict=True):
            assert a.status_code == b.status_code == 200 and set(a.json()) == set(b.json())
            assert "prompt_progress" not in b.json()


REFUSED = [
    ("/completion", {"prompt": "Hi", "n_predict": 1, "stream": True, "return_progress": "yes"}),
    ("/completion", {"prompt": "Hi", "n_predict": 1, "return_progress": 1}),
    (CHAT, {"messages": MSG, "max_tokens": 1, "return_progress": "yes"}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1, "stream": True, "return_progress": [True]}),
]


@pytest.mark.parametrize("path,body", REFUSED, ids=[f"{p} {json.dumps(b)[:60]}" for p, b in REFUSED])
def test_a_return_progress_that_is_not_a_boolean_is_refused(pair: tuple[str, str], path: str,
                                                             body: dict[str, Any]) -> None:
    ours, theirs = both(pair, "POST", path, body)
    assert ours.status_code == theirs.status_code == 400, (ours.text, theirs.text)
    assert_same_error(ours.json(), theirs.json())
    assert "return_progress" in ours.json()["error"]["message"] and "return_progress" in theirs.json()["error"][
        "message"]


def test_one_chunk_per_prefill_step(make_server: Any) -> None:
    """A prompt over several prefill steps: one progress chunk each, ``processed`` growing by the step's tokens
    (here 4), ``time_ms`` simulated and growing; the pieces come after the last; only the final chunk names
    the slot actually used."""
    s = make_server(system_kw={"n_slots": 2, "prefill_chunk": 4})
    prompt = list(range(100, 114))  # 14 tokens: steps of 4, 4, 4, 2
    events = body_of(call(s.url, "POST", "/completion", {"prompt": prompt, "n_predict": 2, "id_slot": 1, **P}))
    prog = progress_of(events, "native")
    assert [p["processed"] for p in prog] == [0, 4, 8, 12, 14] and {p["total"] for p in prog} == {14}
    times = [p["time_ms"] for p in prog]
    assert times[0] == 0 and times == sorted(times) and times[-1] > 0
    kinds = [kind_of(e, "native") for e in events]
    assert kinds == ["progress"] * 5 + ["piece"] * kinds.count("piece") + ["final"], kinds
    # as llama-server: the partial chunks say id_slot -1, the final one names the slot it ran in
    assert {e["id_slot"] for e in events[:-1]} == {-1} and events[-1]["id_slot"] == 1


def test_openai_sdk_streams_with_progress(pair: tuple[str, str]) -> None:
    client = openai.OpenAI(base_url=pair[0] + "/v1", api_key="none", max_retries=0, timeout=60)
    chunks = list(client.chat.completions.create(model="m", messages=MSG, max_tokens=3, stream=True,
                                                 extra_body={"return_progress": True, **FULL}))
    prog = [c.model_extra["prompt_progress"] for c in chunks if "prompt_progress" in (c.model_extra or {})]
    assert len(prog) >= 2 and prog[-1]["processed"] == prog[-1]["total"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].choices[0].finish_reason == "length"


def test_only_the_final_chunk_names_the_slot(pair: tuple[str, str]) -> None:
    """llama-server's partial chunks (progress and pieces) carry ``id_slot`` -1, even for a request sent to
    slot 1; the final chunk names the slot it ran in. Ours the same, chunk for chunk."""
    body = {"prompt": "Once upon a time", "n_predict": 3, "id_slot": 1, **P, **FULL}
    ours, theirs = both(pair, "POST", "/completion", body)
    assert ours.status_code == theirs.status_code == 200
    for events in (body_of(ours), body_of(theirs)):
        assert {e["id_slot"] for e in events[:-1]} == {-1}, events
        assert events[-1]["stop"] is True and events[-1]["id_slot"] == 1, events[-1]
