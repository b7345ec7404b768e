"""Prompt-processing progress (llama-server's ``return_progress``) and what an idle slot keeps, on the scripted board.

The board prices every prefill step at 400 ms simulated (tests/serving/test_engine_scripted.py), so the progress
events' ``time_ms`` are exact: 0 when the request takes its slot, then 400 ms more after each prefill chunk.
"""

from __future__ import annotations

import msgspec
import pytest

from sim_backend.errors import InvalidRequestError
from sim_backend.planes import ChatRequest, DoneEvent, ProgressEvent, TokenEvent
from tests.serving.test_engine_scripted import GREEDY, Harness, ids, make, words  # noqa: F401 - make: fixture

PROMPT = tuple(ids(" the quick brown fox jumps over the lazy dog and runs far away"))


def events_of(h: Harness, req: ChatRequest, tokens: list[int]) -> list[object]:
    h.script(req, tokens)
    return list(h.engine.submit(req).stream(timeout=30))


def test_progress_at_start_and_after_each_prefill_chunk_then_the_pieces(make) -> None:  # noqa: F811
    h = make(prefill_chunk=5)
    req = ChatRequest(messages=(), prompt_tokens=PROMPT, max_tokens=2, sampling=GREEDY, return_progress=True)
    events = events_of(h, req, words("A", " b"))
    kinds = [type(e).__name__ for e in events]
    n = len(PROMPT)
    chunks = -(-n // 5)
    # the 0 % event, one per chunk, then the pieces (the last chunk's progress before its first token), the end
    assert kinds == ["ProgressEvent"] * (chunks + 1) + ["TokenEvent", "TokenEvent", "DoneEvent"], kinds
    prog = [e for e in events if isinstance(e, ProgressEvent)]
    assert [p.processed for p in prog] == [0, *[min(n, 5 * (i + 1)) for i in range(chunks)]]
    assert all(p.total == n and p.cache == 0 for p in prog)
    assert [p.time_ms for p in prog] == [400.0 * i for i in range(chunks + 1)]  # simulated ms since the slot
    assert prog[0].to_json() == {"total": n, "cache": 0, "processed": 0, "time_ms": 0}
    slot = events[-1].result.id_slot
    assert slot >= 0 and {p.id_slot for p in prog} == {slot}
    assert {e.id_slot for e in events if isinstance(e, TokenEvent)} == {slot}  # the slot actually used


def test_a_reused_prefix_is_the_first_events_processed_and_cache(make) -> None:  # noqa: F811
    h = make(n_slots=1)
    first = ChatRequest(messages=(), prompt_tokens=PROMPT, max_tokens=1, sampling=GREEDY)
    events_of(h, first, words("A"))
    again = msgspec.structs.replace(first, prompt_tokens=PROMPT + tuple(ids(" again")), return_progress=True)
    prog = [e for e in events_of(h, again, words("B")) if isinstance(e, ProgressEvent)]
    n = len(again.prompt_tokens)
    # the whole first prompt is reused (llama-server: processed = the slot's prompt so far, the cache included)
    assert [(p.cache, p.processed, p.total) for p in prog] == [(len(PROMPT), len(PROMPT), n), (len(PROMPT), n, n)]


def test_no_progress_unless_asked_for(make) -> None:  # noqa: F811
    h = make(prefill_chunk=4)
    req = ChatRequest(messages=(), prompt_tokens=PROMPT, max_tokens=2, sampling=GREEDY)
    events = events_of(h, req, words("A", " b"))
    assert not any(isinstance(e, ProgressEvent) for e in events) and isinstance(events[-1], DoneEvent)


def test_return_progress_must_be_a_bool(make) -> None:  # noqa: F811
    h = make()
    with pytest.raises(InvalidRequestError, match="return_progress"):
        h.engine.submit(ChatRequest(messages=(), prompt_tokens=PROMPT, max_tokens=1, return_progress="yes"))  # type: ignore[arg-type]


def test_an_idle_slot_keeps_its_last_request(make) -> None:  # noqa: F811
    h = make(n_slots=1)
    (never,) = h.engine.slot_info()
    assert (never.state, never.request_id, never.last_request_id, never.prompt_n, never.params) == (
        "idle", None, None, 0, {})
    req = ChatRequest(messages=(), prompt_tokens=PROMPT, max_tokens=3, sampling=GREEDY)
    res = events_of(h, req, words("A", " b", " c"))[-1].result
    (idle,) = h.engine.slot_info()
    assert idle.state == "idle" and idle.request_id is None and idle.last_request_id == res.request_id
    assert (idle.prompt_n, idle.n_prefilled, idle.predicted_n, idle.max_tokens) == (len(PROMPT), len(PROMPT), 3, 3)
    assert idle.params["temperature"] == GREEDY.temperature
    assert idle.cached_tokens == len(PROMPT) + 2  # the KV it keeps now: the prompt and the tokens fed back
    h.engine.slot_actions.erase(0)
    (erased,) = h.engine.slot_info()
    assert erased.last_request_id == res.request_id and erased.cached_tokens == 0
