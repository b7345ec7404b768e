"""Numerics: the two-chiplet sharded model equals a single-device reference."""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape, NumericShape
from sim_backend.model.bf16 import f32_to_bf16
from sim_backend.model.layer_ops import apply_rope, rope_tables, route
from sim_backend.model.numerics import ReferenceModel, ShardedModel, StepNumerics
from sim_backend.model.weights import FIRST_PADDING_ID, make_weights

SHAPE = ModelShape()  # all 48 layers, 32:4 GQA, 128 experts top-8, vocab 151936
NUM = NumericShape()


@pytest.fixture(scope="module")
def models():
    sharded = ShardedModel(SHAPE, NUM, n_cells=256)
    ref = ReferenceModel(SHAPE, NUM, sharded.weights)
    return sharded, ref


def test_two_chips_equal_single_device_reference_prefill_then_decode(models):
    sharded, ref = models
    prompt = np.array([151644, 872, 198, 9707, 11, 1879, 0, 151645, 198, 151644, 77091, 198])
    n = prompt.size
    pos = np.arange(n)
    # non-contiguous cells: attention must gather the sequence's cells by position
    cells = np.arange(n) * 2 + 7
    a = sharded.forward(prompt, pos, cells, cells, pos)
    b = ref.forward(prompt, pos)
    assert a.logits.shape == (SHAPE.vocab,) and a.logits.dtype == np.float32
    assert np.isfinite(a.logits).all()
    np.testing.assert_allclose(a.logits, b.logits, atol=2e-4, rtol=1e-4)
    assert a.experts_touched == b.experts_touched
    assert len(a.experts_touched) == 48 and all(8 <= t <= 128 for t in a.experts_touched)
    all_cells, all_pos = list(cells), list(pos)
    tok = int(np.argmax(b.logits))
    for step in range(4):
        p = n + step
        c = 200 + step
        all_cells.append(c)
        all_pos.append(p)
        a = sharded.forward(np.array([tok]), np.array([p]), np.array([c]), np.array(all_cells), np.array(all_pos))
        b = ref.forward(np.array([tok]), np.array([p]))
        np.testing.assert_allclose(a.logits, b.logits, atol=2e-4, rtol=1e-4)
        assert a.experts_touched == [8] * 48  # one token: exactly its top-8
        tok = int(np.argmax(b.logits))


def test_kv_written_per_chip_at_step_cells(models):
    sharded, _ = models
    chip0, chip1 = sharded.chips
    # each chip holds 2 of the 4 KV heads (facts.md F3) for all 48 layers
    assert chip0.k_cache.shape == (48, 2, 256, NUM.head_dim)
    assert np.abs(chip0.k_cache[:, :, 7]).sum() > 0 and np.abs(chip1.v_cache[:, :, 7]).sum() > 0
    assert np.abs(chip0.k_cache[:, :, 8]).sum() == 0  # cell 8 was never written
    assert not np.allclose(chip0.k_cache[:, :, 7], chip1.k_cache[:, :, 7])  # different heads


def test_router_top8_weights_renormalised():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((5, NUM.hidden)).astype(np.float32)
    w = make_weights(SHAPE, NUM)
    ids, wt = route(h, w.layers[0].router, 8)
    assert ids.shape == (5, 8) and wt.shape == (5, 8)
    np.testing.assert_allclose(wt.sum(axis=1), 1.0, rtol=1e-6)
    assert all(len(set(row)) == 8 for row in ids.tolist())
    assert (np.diff(wt, axis=1) <= 1e-7).all()  # descending by probability


def test_rope_theta_1e6_rotation_preserves_norm_and_relative_position():
    cos, sin = rope_tables(np.array([0, 5, 1000]), 16, 1e6)
    x = np.random.default_rng(1).standard_normal((3, 1, 16)).astype(np.float32)
    y = apply_rope(x, cos, sin)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(y[0], x[0])  # position 0 is the identity


def test_weights_are_deterministic_and_padding_ids_biased_down():
    a = make_weights.__wrapped__(SHAPE.with_layers(2), NUM)
    b = make_weights.__wrapped__(SHAPE.with_layers(2), NUM)
    assert np.array_equal(a.layers[1].gate, b.layers[1].gate)
    assert (a.lm_bias[FIRST_PADDING_ID:] < -10).all() and (a.lm_bias[:FIRST_PADDING_ID] == 0).all()


def test_routing_spreads_like_a_trained_router(models):
    """27 distinct random tokens should touch close to 128*(1-(120/128)^27) ~ 105.6 experts per layer
    (the cost model prices expert weights by these); deep layers must not collapse onto a few experts."""
    sharded, _ = models
    ids = np.random.default_rng(0).integers(0, 151000, 27)
    cells = np.arange(100, 127)
    out = sharded.forward(ids, np.arange(27), cells, cells, np.arange(27))
    assert np.mean(out.experts_touched) > 90
    assert min(out.experts_touched[24:]) > 80


def test_step_numerics_converts_to_bf16_once():
    logits = np.array([1.0, -2.5, 3.140625, 1.0 + 2.0**-8], dtype=np.float32)
    out = StepNumerics(logits=logits, experts_touched=[8])
    bits = out.bf16()
    assert bits.dtype == np.uint16 and np.array_equal(bits, f32_to_bf16(logits))
    assert out.bf16() is bits and out.logits_bf16 is bits  # kept, not converted again
    given = StepNumerics(logits=None, experts_touched=[8], logits_bf16=bits)  # as the worker returns it
    assert given.bf16() is bits
    with pytest.raises(ValueError, match="no logits"):
        StepNumerics(logits=None, experts_touched=[8]).bf16()


def test_softmax_without_max_only_where_scores_are_bounded_and_the_fallback_matches_reference():
    """The attention softmax skips its max only when the q/k norm weights prove |score| <= SCORE_BOUND;
    a layer whose q_norm is scaled 60x (its raw scores then overflow exp(), so skipping the max there
    gives NaN) takes the max-subtracting path, and both paths give the single-device reference's logits
    (prefill, then decode)."""
    import copy
    import dataclasses

    from sim_backend.model.layer_ops import SCORE_BOUND

    shape = SHAPE.with_layers(4)
    w = copy.deepcopy(make_weights(shape, NUM))
    w.layers[2] = dataclasses.replace(w.layers[2], q_norm=w.layers[2].q_norm * np.float32(60.0))
    sharded = ShardedModel(shape, NUM, n_cells=64, weights=w)
    ref = ReferenceModel(shape, NUM, w)
    assert sharded._score_bounds() == [True, True, False, True]
    qn, kn = np.abs(w.layers[2].q_norm).max(), np.abs(w.layers[2].k_norm).max()
    assert np.sqrt(NUM.head_dim) * qn * kn > SCORE_BOUND  # the bound the check uses, past the limit
    prompt = np.random.default_rng(3).integers(0, 151000, 21)  # 21 tokens: full and partial query blocks
    pos = np.arange(prompt.size)
    a = sharded.forward(prompt, pos, pos, pos, pos)
    b = ref.forward(prompt, pos)
    np.testing.assert_allclose(a.logits, b.logits, atol=2e-4, rtol=1e-4)
    tok = int(np.argmax(b.logits))
    p = np.array([prompt.size])
    ctx = np.arange(prompt.size + 1)
    a = sharded.forward(np.array([tok]), p, p, ctx, ctx)
    b = ref.forward(np.array([tok]), p)
    np.testing.assert_allclose(a.logits, b.logits, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("n,past,stride", [(37, 0, 1), (16, 11, 1), (9, 4, 3), (1, 7, 1)])
def testprefill_attention_without_max_equals_the_max_path(n, past, stride):
    """Blocked causal attention: the no-max path (precomputed diagonal masks for contiguous positions,
    the general mask otherwise) equals the max-subtracting path; partial blocks and a chunk after past keys."""
    from sim_backend.model.layer_ops import prefill_attention

    rng = np.random.default_rng(n + past)

    def unit(*s):
        x = rng.standard_normal(s, dtype=np.float32)
        return x / np.sqrt((x * x).mean(-1, keepdims=True))

    G, group, D = 4, 8, NUM.head_dim
    q, k = unit(G, n, group, D), unit(G, past + n, D)
    v = rng.standard_normal((G, past + n, D), dtype=np.float32)
    k_pos = np.arange(past + n) * stride
    q_pos = k_pos[past:]
    fast = prefill_attention(q, k, v, q_pos, k_pos, no_max=True)
    slow = prefill_attention(q, k, v, q_pos, k_pos, no_max=False)
    np.testing.assert_allclose(fast, slow, atol=1e-5, rtol=1e-5)
    # the last query sees every key: its output is the plain softmax average
    s = np.einsum("gnd,gtd->gnt", q[:, -1] / np.sqrt(D), k)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(fast[:, -1], np.einsum("gnt,gtd->gnd", p, v), atol=1e-5)
