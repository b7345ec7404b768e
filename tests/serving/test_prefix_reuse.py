"""Multi-turn chat reuses the common prefix: only the suffix is prefilled (``timings.cache_n``),
and the reused KV gives the same greedy tokens as a fresh system (numeric mode)."""

from __future__ import annotations

import pytest

from sim_backend.compose import build_system
from sim_backend.planes import ChatRequest, SamplingParams

RESULT_S = 120.0
GREEDY = SamplingParams(temperature=0.0, seed=7)


@pytest.fixture(scope="module")
def turns():
    """Run turn 1 and turn 2 on one system; turn 2 alone on a fresh one."""
    turn1 = ({"role": "system", "content": "You are a terse assistant."},
             {"role": "user", "content": "Name three prime numbers."})
    with build_system(numerics=True, n_slots=2, maintenance=False) as s:
        r1 = s.inference.generate(ChatRequest(messages=turn1, max_tokens=8, sampling=GREEDY), RESULT_S)
        assert r1.status == "finished"
        turn2 = turn1 + ({"role": "assistant", "content": r1.text},
                         {"role": "user", "content": "Now three even ones, please."})
        req2 = ChatRequest(messages=turn2, max_tokens=8, sampling=GREEDY)
        total2 = s.inference.count_prompt_tokens(req2)
        r2 = s.inference.generate(req2, RESULT_S)
    with build_system(numerics=True, n_slots=2, maintenance=False) as fresh:
        r2_fresh = fresh.inference.generate(req2, RESULT_S)
    return r1, r2, r2_fresh, total2


def test_second_turn_prefills_only_the_suffix(turns):
    r1, r2, r2_fresh, total2 = turns
    assert r2.status == "finished"
    t = r2.timings
    assert t.cache_n > 0
    assert t.prompt_n == total2 - t.cache_n
    # turn 1's prompt is shared up to its "<|im_start|>assistant\n" header: the Qwen3 template renders the
    # empty "<think>\n\n</think>\n\n" (4 tokens) for the generation prompt but not for a past assistant turn
    assert t.cache_n >= r1.timings.prompt_n - 4
    assert r2_fresh.timings.cache_n == 0 and r2_fresh.timings.prompt_n == total2
    assert t.prompt_ms < r2_fresh.timings.prompt_ms  # simulated device time: fewer tokens prefilled


def test_reused_kv_gives_the_same_greedy_output(turns):
    _, r2, r2_fresh, _ = turns
    assert r2.timings.numerics and r2_fresh.timings.numerics
    assert r2.tokens == r2_fresh.tokens
    assert r2.text == r2_fresh.text
