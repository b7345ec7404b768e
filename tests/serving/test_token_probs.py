"""Token probabilities (llama.cpp ``n_probs`` / ``post_sampling_probs``): checked against a full softmax
and against the sampler's own draws."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim_backend.model.bf16 import f32_to_bf16
from sim_backend.planes import ChatRequest, SamplingParams
from sim_backend.serving.sampling import N_VALID, Sampler
from sim_backend.serving.token_probs import logit_probs
from sim_backend.serving.tokens import TokenPipeline


def _logits(seed: int, n: int = 151936) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 2.0).astype(np.float32)
    x[rng.choice(min(n, N_VALID), 8, replace=False)] += 6.0
    return x


def _softmax(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max()
    e = np.exp(z)
    return e / e.sum()


def test_logit_probs_are_the_softmax_of_the_valid_ids():
    x = _logits(1)
    tp = logit_probs(x, 7, 10)
    p = _softmax(x[:N_VALID])  # padding rows are not tokens
    order = np.lexsort((np.arange(N_VALID), -x[:N_VALID]))
    assert [t.id for t in tp.top] == [int(i) for i in order[:10]]
    assert [t.logprob for t in tp.top] == pytest.approx([math.log(p[i]) for i in order[:10]], abs=1e-5)
    assert tp.logprob == pytest.approx(math.log(p[7]), abs=1e-5) and not tp.post_sampling
    probs = [math.exp(t.logprob) for t in tp.top]
    assert probs == sorted(probs, reverse=True) and sum(probs) <= 1.0 + 1e-9
    # every id: the whole distribution sums to 1
    full = logit_probs(x[:2048], 0, 4096, n_valid=2048)
    assert len(full.top) == 2048 and math.fsum(math.exp(t.logprob) for t in full.top) == pytest.approx(1.0, abs=1e-5)


def test_logit_probs_top_one_is_the_greedy_token():
    for seed in range(4):
        x = _logits(seed)
        tok = Sampler(SamplingParams.greedy()).sample(x)
        tp = logit_probs(x, tok, 3)
        assert tp.top[0].id == tok and tp.logprob == tp.top[0].logprob


def test_logit_probs_non_finite():
    x = np.full(100, -np.inf, np.float32)
    x[3], x[5] = np.nan, 1.0
    tp = logit_probs(x, 3, 5, n_valid=100)
    assert [t.id for t in tp.top] == [5] and tp.top[0].logprob == 0.0 and tp.logprob == -math.inf
    with pytest.raises(ValueError):
        logit_probs(np.full(10, -np.inf, np.float32), 0, 1, n_valid=10)


CHAINS = [SamplingParams(seed=1), SamplingParams(top_k=0, top_p=1.0, min_p=0.0, temperature=0.7, seed=2),
          SamplingParams(top_k=0, top_p=0.9, min_p=0.0, seed=3), SamplingParams(top_k=5, top_p=1.0, min_p=0.0, seed=4),
          SamplingParams(top_k=0, top_p=1.0, min_p=0.1, temperature=1.5, seed=5)]


@pytest.mark.parametrize("sp", CHAINS, ids=lambda sp: f"k{sp.top_k}-p{sp.top_p}-m{sp.min_p}-t{sp.temperature}")
def test_post_sampling_probs_follow_the_chain(sp: SamplingParams):
    x = _logits(11)
    s = Sampler(sp)
    tok = s.sample(x)
    tp = s.post_sampling_probs(tok, 50)
    assert tp.post_sampling and tp.logprob > -math.inf  # the drawn token had a probability
    ids = [t.id for t in tp.top]
    probs = [math.exp(t.logprob) for t in tp.top]
    assert probs == sorted(probs, reverse=True) and sum(probs) <= 1.0 + 1e-9
    # the candidates after the chain, by the module's convention (descending logit, ties by lower id)
    order = np.lexsort((np.arange(N_VALID), -x[:N_VALID]))
    keep = order if sp.top_k == 0 else order[: sp.top_k]
    if sp.top_p < 1.0:
        # Z over the whole vocabulary while nothing was cut, else over the kept candidates (module docstring)
        cs = np.cumsum(_softmax(x[keep]) if sp.top_k else _softmax(x[:N_VALID])[keep])
        keep = keep[: int(np.searchsorted(cs, sp.top_p)) + 1]
    if sp.min_p > 0.0:
        keep = keep[x[keep].astype(np.float64) >= x.max() + math.log(sp.min_p)]
    q = _softmax(x[keep] / np.float32(sp.temperature))
    assert ids == [int(i) for i in keep[:50]]
    assert probs == pytest.approx(list(q[:50]), rel=1e-6, abs=1e-12)
    assert tok in set(int(i) for i in keep)


def test_post_sampling_probs_match_the_draws():
    # a small vocabulary: the frequencies of seeded draws approach the reported probabilities
    x = _logits(5, 64)
    sp = SamplingParams(top_k=0, top_p=0.95, min_p=0.0, temperature=1.0, seed=7)
    s = Sampler(sp, 64)
    counts: dict[int, int] = {}
    reported: dict[int, float] = {}
    for _ in range(3000):
        tok = s.sample(x)
        counts[tok] = counts.get(tok, 0) + 1
        reported[tok] = math.exp(s.post_sampling_probs(tok, 0).logprob)
    for tok, c in counts.items():
        assert c / 3000 == pytest.approx(reported[tok], abs=0.03)


def test_greedy_post_sampling_is_the_argmax_alone():
    x = _logits(2)
    s = Sampler(SamplingParams.greedy())
    tok = s.sample(x)
    tp = s.post_sampling_probs(tok, 5)
    assert tok == int(np.argmax(x[:N_VALID])) and [(t.id, t.logprob) for t in tp.top] == [(tok, 0.0)]
    with pytest.raises(RuntimeError):
        Sampler(SamplingParams()).post_sampling_probs(0, 1)


def test_pipeline_records_one_entry_per_token_with_pieces():
    req = ChatRequest.from_prompt("hi", max_tokens=4, n_probs=2, sampling=SamplingParams.greedy())
    pl = TokenPipeline(req, [1, 2, 3], n_ctx=100, max_tokens=4)
    x = _logits(3)
    x[151645] = 50.0  # <|im_end|> (special) is the arg-max
    tok = pl.sample(f32_to_bf16(x), True)
    assert tok == 151645 and pl.probs[-1].piece == b"" and pl.probs[-1].top[0].piece == b""
    assert pl.probs[-1].top[1].piece == pl._tok.token_bytes(pl.probs[-1].top[1].id)
    pl.push(tok)
    pl.sample(None, False)  # a timing-only step has no logits: it records no (invented) probabilities
    assert len(pl.probs) == 1
    plain = TokenPipeline(ChatRequest.from_prompt("hi", max_tokens=2), [1], n_ctx=100, max_tokens=2)
    plain.sample(f32_to_bf16(x), True)
    assert plain.probs == []


def test_grammar_stand_in_distribution_is_its_draws():
    # timing-only with a grammar: the stand-in's own distribution (a uniform pick of the allowed ids, leaning to
    # an ending as the reply grows), checked against its seeded draws; a small made-up vocabulary (8 ids: EOS 7,
    # closers 5 and 6) instead of compiling a grammar over Qwen3's (7 s the first time)
    from types import SimpleNamespace

    from sim_backend.serving import grammar as G

    eos, closer = np.zeros(8, bool), np.zeros(8, bool)
    eos[7], closer[5:7] = True, True
    g = G.GrammarMatcher(None, SimpleNamespace(vocab=8, eos=eos, closer=closer))
    for allowed in (np.array([1, 1, 0, 1, 0, 1, 1, 1], bool), np.array([1, 1, 0, 1, 0, 1, 1, 0], bool),
                    np.array([1, 1, 0, 1, 0, 0, 0, 0], bool)):
        for n_gen in (0, 3, 40):
            ids, p = g.stand_in_distribution(n_gen, 40, allowed)
            assert math.fsum(p) == pytest.approx(1.0) and all(allowed[ids])
            rng = np.random.default_rng(n_gen)
            draws = np.array([g.stand_in(rng, n_gen, 40, allowed) for _ in range(3000)])
            freq = [float(np.mean(draws == i)) for i in ids]
            assert freq == pytest.approx(p.tolist(), abs=0.03)


def test_a_biased_request_never_runs_a_timing_only_step():
    """A step without logits cannot honour ``logit_bias``: the pipeline raises rather than draw unbiased (the
    engine refuses such a request before it runs: ``admission.NO_LOGITS_BIAS``); with logits the bias holds."""
    import math

    import numpy as np
    import pytest

    from sim_backend.planes import ChatRequest, SamplingParams
    from sim_backend.serving.tokens import TokenPipeline

    req = ChatRequest(messages=(), prompt_tokens=(1, 2), max_tokens=4, sampling=SamplingParams.greedy(),
                      logit_bias=((3, -math.inf), (8, 5.0)))
    p = TokenPipeline(req, (1, 2), n_ctx=64, max_tokens=4)
    with pytest.raises(ValueError, match="logit_bias needs the model's logits"):
        p.sample(None, False)
    x = np.zeros(p.sampler.vocab_size, np.float32)
    x[3] = 10.0
    assert p.sample(x, True) == 8  # 3 banned, 8 lifted above the rest
