"""The engine stays correct and alive across device resets, KV clears and its own bugs."""

from __future__ import annotations

import pytest

from sim_backend.planes import ChatRequest, SamplingParams
from sim_backend.serving.tokens import TokenPipeline

GREEDY = SamplingParams(temperature=0.0, seed=1)
PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def system(make_module_system):
    return make_module_system(drain_timeout_s=0.5)


def ask(s, text=PROMPT, n=8):
    return s.inference.generate(ChatRequest.from_prompt(text, max_tokens=n, sampling=GREEDY), 120)


@pytest.mark.parametrize("action", ["reset", "clear_kv", "clear_memory"])
def test_prefix_cache_is_dropped_when_the_kv_is_cleared(system, action):
    m = system.maintenance
    r0 = ask(system)
    again = ask(system)
    assert again.timings.cache_n > 0 and again.tokens == r0.tokens  # prefix reuse works
    lease = m.enter_exclusive("test")
    if action == "reset":
        m.reset(lease)
    elif action == "clear_kv":
        m.clear_kv(lease)
    else:
        m.clear_device_memory(lease)
        m.reload_model(lease)
    m.leave_exclusive(lease)
    assert all(slot["cached_tokens"] == 0 for slot in system.observation.snapshot().to_dict()["slots"])
    r1 = ask(system)
    assert r1.status == "finished"
    assert r1.timings.cache_n == 0  # the cells are gone: prefill from scratch
    assert r1.tokens == r0.tokens  # and the same greedy answer


def test_a_bug_fails_one_request_and_the_scheduler_survives(system, monkeypatch):
    calls = {"n": 0}
    orig = TokenPipeline.sample

    def broken_once(self, logits, numeric):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ValueError("no finite logits to sample from")
        return orig(self, logits, numeric)

    monkeypatch.setattr(TokenPipeline, "sample", broken_once)
    bad = ask(system, "first")
    assert bad.status == "failed" and bad.error["type"] == "server_error"
    assert "ValueError" in bad.error["message"]
    good = ask(system, "second")
    assert good.status == "finished" and good.timings.predicted_n == 8
    summary = system.observation.snapshot().requests
    assert summary.balanced and summary.counters.running == 0
    assert ask(system, "third").status == "finished"  # the scheduler thread still serves
