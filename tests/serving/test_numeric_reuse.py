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


def test_probabilities_need_logits_refused_when_foreseen_timing_only(make_system):
    """``n_probs`` asks for the model's probabilities: refused at submit when the request would run timing-only
    (numerics off; over the limit; continuing a timing-only turn), and never answered with invented ones."""
    import pytest

    from sim_backend.errors import InvalidRequestError

    off = make_system(numerics=False, n_slots=1)
    with pytest.raises(InvalidRequestError, match=r"would run timing-only: the device runs timing-only \(numerics"):
        off.inference.submit(ChatRequest.from_prompt("hi", max_tokens=2, n_probs=2))
    assert off.observation.snapshot().requests.counters.rejected == 1
    assert off.inference.generate(ChatRequest.from_prompt("hi", max_tokens=2)).status == "finished"

    on = make_system(numerics=True, n_slots=1, numerics_max_prompt=20)
    long_msgs = [{"role": "user", "content": "word " * 40}]
    with pytest.raises(InvalidRequestError, match="over the numeric limit of 20"):
        on.inference.submit(ChatRequest(messages=tuple(long_msgs), max_tokens=2, n_probs=1))
    first = on.inference.generate(ChatRequest(messages=tuple(long_msgs), max_tokens=2, sampling=GREEDY))
    follow = long_msgs + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "ok"}]
    with pytest.raises(InvalidRequestError, match="continues a timing-only turn"):
        on.inference.submit(ChatRequest(messages=tuple(follow), max_tokens=2, n_probs=1))


def test_probabilities_over_the_limit_run_when_a_numeric_prefix_is_reused(make_system):
    system = make_system(numerics=True, n_slots=1, numerics_max_prompt=40)
    first_msgs = [{"role": "user", "content": "tell me about chiplets and their links"}]
    first = system.inference.generate(ChatRequest(messages=tuple(first_msgs), max_tokens=4, sampling=GREEDY))
    second = first_msgs + [{"role": "assistant", "content": first.text},
                           {"role": "user", "content": "and what about the memory map of each one"}]
    req = ChatRequest(messages=tuple(second), max_tokens=3, sampling=GREEDY, n_probs=2)
    assert system.inference.count_prompt_tokens(req) > 40  # over the limit as a whole, not in what it prefills
    res = system.inference.generate(req)
    assert res.timings.numerics is True and len(res.probs) == 3 and all(p.from_logits for p in res.probs)


def test_a_logit_bias_needs_logits_refused_when_foreseen_timing_only(make_system):
    """``logit_bias`` is added to the model's logits: refused at submit when the request would run timing-only
    (numerics off; over the numeric limit), never run unbiased; with the numerics a ban holds and a bias forces."""
    import math

    import pytest

    from sim_backend.errors import InvalidRequestError

    off = make_system(numerics=False, n_slots=1)
    with pytest.raises(InvalidRequestError, match=r"'logit_bias' is added to the model's logits, and this request "
                                                  r"would run timing-only: the device runs timing-only \(numerics"):
        off.inference.submit(ChatRequest.from_prompt("hi", max_tokens=2, logit_bias=((15, -math.inf),)))
    assert off.observation.snapshot().requests.counters.rejected == 1

    on = make_system(numerics=True, n_slots=1, numerics_max_prompt=20)
    with pytest.raises(InvalidRequestError, match="over the numeric limit of 20"):
        on.inference.submit(ChatRequest(messages=({"role": "user", "content": "word " * 40},), max_tokens=2,
                                        logit_bias=((15, 1.0),)))
    plain = on.inference.generate(ChatRequest.from_prompt("hi", max_tokens=4, sampling=GREEDY, ignore_eos=True))
    banned = on.inference.generate(ChatRequest.from_prompt("hi", max_tokens=4, sampling=GREEDY, ignore_eos=True,
                                                           logit_bias=tuple((t, -math.inf) for t in plain.tokens)))
    assert banned.timings.numerics is True and not set(banned.tokens) & set(plain.tokens), (plain.tokens, banned.tokens)
    forced = on.inference.generate(ChatRequest.from_prompt("hi", max_tokens=3, sampling=GREEDY, ignore_eos=True,
                                                           logit_bias=((7, 50.0),)))
    assert list(forced.tokens) == [7, 7, 7]
