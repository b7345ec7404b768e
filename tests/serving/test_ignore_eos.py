"""llama.cpp's ``ignore_eos``: the end-of-generation ids are never sampled (their logits are -inf), so a reply
runs to ``max_tokens``; without it the same logits end the reply at EOS."""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.model.bf16 import f32_to_bf16
from sim_backend.model.vocab import EOS_IDS, VOCAB_SIZE
from sim_backend.planes import ChatRequest, SamplingParams
from sim_backend.serving.tokens import TokenPipeline

GREEDY = SamplingParams(temperature=0.0, seed=1)


def _logits(best: int, second: int) -> np.ndarray:
    x = np.zeros(VOCAB_SIZE, dtype=np.float32)
    x[best], x[second] = 10.0, 5.0
    return f32_to_bf16(x)


def _pipeline(ignore_eos: bool) -> TokenPipeline:
    req = ChatRequest.from_prompt("hi", max_tokens=4, sampling=GREEDY, ignore_eos=ignore_eos)
    return TokenPipeline(req, [1, 2, 3], n_ctx=4096, max_tokens=4, vocab=VOCAB_SIZE)


def test_eos_at_the_top_ends_the_reply_unless_ignored() -> None:
    eos = min(EOS_IDS)
    logits = _logits(best=eos, second=1000)
    assert _pipeline(False).sample(logits, numeric=True) == eos
    p = _pipeline(True)
    assert p.sample(logits, numeric=True) == 1000
    assert logits.view(np.uint16)[eos] == f32_to_bf16(np.array([10.0], np.float32))[0]  # the device's array untouched


def test_every_eos_id_is_banned() -> None:
    p = _pipeline(True)
    for eos in EOS_IDS:
        assert p.sample(_logits(best=eos, second=77), numeric=True) == 77


def test_ignore_eos_bans_eos_in_f32_logits_too() -> None:
    """A calbin that returns F32 logits (the pilot's C3 variant): the ban is -inf in float32, the device's
    array untouched; with probabilities the raw logits' softmax is of those float32 values."""
    eos = min(EOS_IDS)
    x = np.zeros(VOCAB_SIZE, dtype=np.float32)
    x[eos], x[1000] = 10.0, 5.0
    assert _pipeline(False).sample(x, numeric=True) == eos
    assert _pipeline(True).sample(x, numeric=True) == 1000 and x[eos] == 10.0
    req = ChatRequest.from_prompt("hi", max_tokens=4, sampling=GREEDY, n_probs=2)
    p = TokenPipeline(req, [1, 2, 3], n_ctx=4096, max_tokens=4, vocab=VOCAB_SIZE)
    assert p.sample(x, numeric=True) == eos
    top = p.probs[-1].top
    assert [t.id for t in top] == [eos, 1000] and top[0].logprob - top[1].logprob == pytest.approx(5.0, abs=1e-5)
