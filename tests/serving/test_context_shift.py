"""llama-server's context shift on the engine: exact token counts, KV positions and the device time of a shift.

A 64-token context, a raw 4-token prompt, 100 tokens asked for (timing-only numerics keep it fast). Shift off:
the reply stops with ``limit`` at the context end (4 + 60 = 64), ``truncated``. Shift on (n_keep 0): the
first shift comes when the sequence holds 63 tokens (4 prompt + 59 fed): n_left 63, n_discard 31, so 32 remain;
the second at 63 again (31 more fed): 31 more discarded; the reply reaches its 100 tokens.
"""

from __future__ import annotations

import pytest

from sim_backend.compose import build_system
from sim_backend.model.costmodel import CostModel, kv_shift_us
from sim_backend.model.vocab import VOCAB_SIZE
from sim_backend.planes import ChatRequest, SamplingParams
from sim_backend.serving.context_shift import plan_shift
from sim_backend.serving.tokens import TokenPipeline

RESULT_S = 60.0  # bound on waiting a result (host s)
PROMPT = (11, 12, 13, 14)


def _req(n_keep: int = 0, n_discard: int = 0, max_tokens: int = 100) -> ChatRequest:
    return ChatRequest(messages=(), prompt_tokens=PROMPT, max_tokens=max_tokens, ignore_eos=True,
                       sampling=SamplingParams(temperature=0.0, seed=1), n_keep=n_keep, n_discard=n_discard)


def test_plan_is_llama_servers_arithmetic() -> None:
    # n_keep 0: half of the 255 others (the real server's 256-token slot: tests/real/test_context_shift.py)
    p = plan_shift(255, 4, n_keep=0, n_discard=0, n_ctx=256)
    assert (p.n_keep, p.n_left, p.n_discard) == (0, 255, 127)
    p = plan_shift(255, 4, n_keep=-1, n_discard=0, n_ctx=256)  # -1: the whole prompt
    assert (p.n_keep, p.n_left, p.n_discard) == (4, 251, 125)
    p = plan_shift(255, 4, n_keep=3, n_discard=0, n_ctx=256, add_bos=True)  # a BOS the model adds is kept too
    assert (p.n_keep, p.n_discard) == (4, 125)
    p = plan_shift(63, 60, n_keep=1000, n_discard=0, n_ctx=64)  # at most n_ctx - 4 kept
    assert (p.n_keep, p.n_left, p.n_discard) == (60, 3, 1)
    p = plan_shift(63, 4, n_keep=0, n_discard=500, n_ctx=64)  # n_discard given, clamped to n_left - 1
    assert p.n_discard == 62
    with pytest.raises(ValueError):
        plan_shift(3, 1, n_keep=0, n_discard=0, n_ctx=4)


def test_without_context_shift_the_reply_stops_at_the_context_end() -> None:
    with build_system(numerics=False, n_slots=1, maintenance=False, n_ctx=64) as s:
        r = s.inference.generate(_req(), RESULT_S)
        assert (r.status, r.stop_type, r.timings.predicted_n) == ("finished", "limit", 60)
        assert r.truncated and (r.n_shifts, r.n_discarded) == (0, 0)


@pytest.mark.parametrize(("n_keep", "discards"), [(0, (31, 31)), (-1, (29, 29)), (2, (30, 30))])
def test_context_shift_keeps_n_keep_and_discards_half(n_keep: int, discards: tuple[int, ...]) -> None:
    with build_system(numerics=False, n_slots=1, maintenance=False, n_ctx=64, context_shift=True) as s:
        t0 = s.board.busy_us
        r = s.inference.generate(_req(n_keep), RESULT_S)
        assert (r.status, r.stop_type, r.timings.predicted_n) == ("finished", "limit", 100)
        assert r.truncated and (r.n_shifts, r.n_discarded) == (len(discards), sum(discards))
        # the sequence holds prompt + fed tokens less the discarded ones, at positions 0..n-1 (no gap, no overlap)
        held = len(PROMPT) + 100 - 1 - sum(discards)
        cells, pos = s.board.kv.seq_cells(0)
        assert pos.tolist() == list(range(held)) and len(cells) == held
        info = s.engine.slot_info()[0]
        assert (info.n_shifts, info.n_discarded, info.truncated, info.cached_tokens) == (2, sum(discards), True, held)
        assert not s.board.kv.has_shift  # every moved cell was re-rotated (DoShift)
        # each shift moved the cells after the discarded ones: 63 - n_keep - n_discard of them, priced on the device
        keep = len(PROMPT) if n_keep < 0 else n_keep
        moved = [63 - keep - d for d in discards]
        cm = CostModel.load()
        want_us = sum(kv_shift_us(cm.hw, s.board.shape, m) for m in moved)
        busy = s.board.busy_us - t0
        steps_us = busy - want_us  # the rest is the prefill and decode steps
        assert want_us > 0 and steps_us > 0
        assert r.timings.device_ms["infer"] * 1e3 >= want_us  # the shifts count in the request's device time


def test_kept_prompt_survives_the_shift() -> None:
    """n_keep = -1: the prompt's tokens stay at positions 0..3 in the slot's cache; the discarded ones are the
    first generated tokens."""
    with build_system(numerics=False, n_slots=1, maintenance=False, n_ctx=64, context_shift=True) as s:
        r = s.inference.generate(_req(-1, max_tokens=62), RESULT_S)  # one shift: 63 held at the 60th fed token
        assert (r.n_shifts, r.n_discarded) == (1, 29)
        cache = s.engine.slots[0].cache_tokens
        gen = list(r.tokens)
        assert cache[:4] == list(PROMPT)
        assert cache[4:] == gen[29:-1]  # generated 0..28 discarded; the last token is never fed


def test_a_request_that_needs_logits_is_not_shifted() -> None:
    """The numerics do not re-rotate shifted keys: a request with ``n_probs`` or ``logit_bias`` stops at the
    context end as without context shift; any other gets the shift."""
    def pipeline(**kw: object) -> TokenPipeline:
        req = ChatRequest(messages=(), prompt_tokens=PROMPT, max_tokens=100, **kw)  # type: ignore[arg-type]
        return TokenPipeline(req, list(PROMPT), n_ctx=64, max_tokens=100, vocab=VOCAB_SIZE, context_shift=True)

    assert pipeline().context_shift
    assert not pipeline(n_probs=2).context_shift
    assert not pipeline(logit_bias=((5, 1.0),)).context_shift
