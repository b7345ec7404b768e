"""Slot choice: the longest cached prefix, then LRU; a prefix that holds no values (a timing-only
request's) is never reused for a request that can run with numerics."""

from __future__ import annotations

import pytest

from sim_backend.compose import build_system
from sim_backend.planes import ChatRequest, SamplingParams
from sim_backend.serving.admission import choose_slot
from sim_backend.serving.requests import Slot

GREEDY = SamplingParams(temperature=0.0, seed=3)
LIMIT = 24  # prompt tokens a request may prefill with numerics


def slot(i: int, cache: list[int], numeric: bool, last_used: float = 0.0) -> Slot:
    s = Slot(i)
    s.cache_tokens, s.cache_numeric, s.last_used = list(cache), numeric, last_used
    return s


def test_longest_prefix_then_least_recently_used():
    prompt = [1, 2, 3, 4, 5]
    a, b, c = slot(0, [1, 2, 9], True, 5.0), slot(1, [1, 2, 3, 4], True, 9.0), slot(2, [], True, 1.0)
    assert choose_slot([a, b, c], prompt, cache_prompt=True, numerics=True, numerics_max_prompt=LIMIT) == (b, 4, True)
    d, e = slot(0, [7], True, 5.0), slot(1, [8], True, 2.0)
    assert choose_slot([d, e], prompt, cache_prompt=True, numerics=True, numerics_max_prompt=LIMIT) == (e, 0, True)


def test_at_least_one_prompt_token_is_prefilled_and_cache_prompt_false_reuses_nothing():
    prompt = [1, 2, 3]
    s = slot(0, [1, 2, 3, 4], True)
    assert choose_slot([s], prompt, cache_prompt=True, numerics=True, numerics_max_prompt=LIMIT) == (s, 2, True)
    assert choose_slot([s], prompt, cache_prompt=False, numerics=True, numerics_max_prompt=LIMIT) == (s, 0, True)


def test_a_timing_only_prefix_is_not_reused_by_a_request_that_can_run_numeric():
    prompt = [1, 2, 3, 4, 5]
    timing_only = slot(0, [1, 2, 3, 9, 9], False)
    assert choose_slot([timing_only], prompt, cache_prompt=True, numerics=True,
                       numerics_max_prompt=LIMIT) == (timing_only, 0, True)
    # with another slot free, the one where it runs with numerics wins even with a shorter prefix
    numeric = slot(1, [1, 9], True)
    assert choose_slot([timing_only, numeric], prompt, cache_prompt=True, numerics=True,
                       numerics_max_prompt=LIMIT) == (numeric, 1, True)


def test_a_request_that_runs_timing_only_anyway_still_reuses_a_timing_only_prefix():
    prompt = list(range(40))  # more than LIMIT new tokens: timing-only whatever it reuses
    timing_only = slot(0, list(range(30)), False)
    assert choose_slot([timing_only], prompt, cache_prompt=True, numerics=True,
                       numerics_max_prompt=LIMIT) == (timing_only, 30, False)
    # a device without numerics: prefixes are prefixes
    assert choose_slot([timing_only], prompt[:5], cache_prompt=True, numerics=False,
                       numerics_max_prompt=LIMIT) == (timing_only, 4, False)


@pytest.fixture(scope="module")
def plane_results():
    """Through the inference plane, one slot: a long prompt runs timing-only, then short chats follow
    (the sequence a console user ran: one 412-token prompt, then "hi", "what is two plus two", "hello")."""
    long_prompt = " ".join(f"word{i}" for i in range(60))
    with build_system(numerics=True, n_slots=1, maintenance=False, numerics_max_prompt=LIMIT) as s:
        inf = s.inference
        first = inf.generate(ChatRequest.from_prompt(long_prompt, max_tokens=2, sampling=GREEDY), 120)
        short = [inf.generate(ChatRequest.from_prompt(p, max_tokens=2, sampling=GREEDY), 120)
                 for p in ("hi", "what is two plus two", "hello")]
        again = [inf.generate(ChatRequest.from_prompt(long_prompt, max_tokens=2, sampling=GREEDY), 120)
                 for _ in range(2)]
        slots = s.observation.snapshot().slots
    return first, short, again, slots


def test_short_chats_after_a_timing_only_request_run_with_numerics(plane_results):
    first, short, _, _ = plane_results
    assert first.status == "finished" and first.timings.numerics is False and first.timings.prompt_n > LIMIT
    assert short[0].timings.cache_n == 0  # the slot held only a valueless prefix: nothing reused
    for r in short:
        assert r.status == "finished" and r.timings.numerics is True, r.timings
    assert short[2].timings.cache_n > 0  # a prefix with values (the chat template's) is reused


def test_a_long_prompt_still_reuses_its_own_timing_only_prefix(plane_results):
    _, _, again, slots = plane_results
    assert [r.timings.numerics for r in again] == [False, False]
    assert again[1].timings.cache_n > LIMIT  # the second reuses the first's cells (timing-only either way)
    assert slots[0].state == "idle"
