"""The numeric prompt limit counts the tokens a request prefills, not a prefix reused from numeric KV."""

from __future__ import annotations

from sim_backend.planes import ChatRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_second_turn_reusing_numeric_kv_stays_numeric(make_system):
    system = make_system(numerics=True, n_slots=1, numerics_max_prompt=40)
    first_msgs = [{"role": "user", "content": "tell me about chiplets and their links"}]
    first = system.inference.generate(ChatRequest(messages=tuple(first_msgs), max_tokens=4, sampling=GREEDY))
    assert first.timings.numerics is True
    n_first = first.timings.prompt_n
    second_msgs = first_msgs + [{"role": "assistant", "content": first.text},
                                {"role": "user", "content": "and what about the memory map of each one"}]
    req = ChatRequest(messages=tuple(second_msgs), max_tokens=4, sampling=GREEDY)
    total = system.inference.count_prompt_tokens(req)
    res = system.inference.generate(req)
    assert total > 40 and res.timings.cache_n > 0  # the whole prompt is over the limit ...
    assert res.timings.prompt_n <= 40 and res.timings.numerics is True  # ... the new part is not
    assert n_first > 0


def test_reuse_of_timing_only_kv_is_not_numeric(make_system):
    system = make_system(numerics=True, n_slots=1, numerics_max_prompt=20)
    long_msgs = [{"role": "user", "content": "word " * 40}]
    first = system.inference.generate(ChatRequest(messages=tuple(long_msgs), max_tokens=2, sampling=GREEDY))
    assert first.timings.numerics is False
    follow = long_msgs + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "ok"}]
    res = system.inference.generate(ChatRequest(messages=tuple(follow), max_tokens=2, sampling=GREEDY))
    # its cached prefix holds no computed values: it cannot become numeric by reusing it
    assert res.timings.numerics is False
