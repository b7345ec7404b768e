"""Batched decode pricing (sim_backend.model.batching): batch 1 is today's decode price, batch N
costs less than N batch-1 steps, expert bytes follow the distinct experts, switches act as stated."""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.batching import (
    BatchedCostModel,
    Variant,
    expected_union_touched,
    kv_capacity_tokens,
    price_decode_batch,
)
from sim_backend.model.costmodel import default_cost_model

SHAPE = ModelShape()


@pytest.fixture(scope="module")
def cm():
    return default_cost_model()


@pytest.mark.parametrize("past", [0, 26, 2047, 16000, 40959])
def test_batch1_equals_todays_decode(cm, past):
    ref = cm.price_step(SHAPE, "decode", 1, past)
    got = price_decode_batch(cm, SHAPE, [past])
    for a, b in ((got.total_us, ref.total_us), (got.infer_us, ref.infer_us), (got.h2d_us, ref.h2d_us),
                 (got.d2h_us, ref.d2h_us)):
        assert a == pytest.approx(b, rel=1e-9)
    np.testing.assert_allclose(got.op_us, ref.op_us, rtol=1e-9)
    np.testing.assert_allclose(got.layer_chip_us, ref.layer_chip_us, rtol=1e-9)
    for key in ref.dram_bytes:
        assert got.dram_bytes[key] == pytest.approx(ref.dram_bytes[key], rel=1e-9)


def test_batch1_with_numerics_counts_and_slow_chip(cm):
    touched = [8] * SHAPE.n_layers
    ref = cm.price_step(SHAPE, "decode", 1, 300, experts_touched=touched, chip_scale=[1.0, 1.5])
    got = price_decode_batch(cm, SHAPE, [300], touched, chip_scale=[1.0, 1.5])
    assert got.total_us == pytest.approx(ref.total_us, rel=1e-9)
    assert got.chip_scale == ref.chip_scale


def test_default_variant_is_the_base_model(cm):
    bm = BatchedCostModel(cm)
    ref = cm.price_step(SHAPE, "prefill", 27, 0)
    assert bm.price_step(SHAPE, "prefill", 27, 0).total_us == ref.total_us


@pytest.mark.parametrize("n", [4, 8, 16])
@pytest.mark.parametrize("past", [100, 4000])
def test_batch_n_cheaper_than_n_singles(cm, n, past):
    single = cm.price_step(SHAPE, "decode", 1, past).total_us
    batch = price_decode_batch(cm, SHAPE, [past] * n).total_us
    assert single < batch < n * single


def test_batch_grows_with_n(cm):
    totals = [price_decode_batch(cm, SHAPE, [200] * n).total_us for n in (1, 4, 8, 16)]
    assert totals == sorted(totals) and len(set(totals)) == 4


def test_expert_bytes_grow_with_distinct_experts(cm):
    L = SHAPE.n_layers
    costs = [price_decode_batch(cm, SHAPE, [100] * 8, [u] * L) for u in (8, 32, 64)]
    w = [c.dram_bytes["weights"] for c in costs]
    assert w[0] < w[1] < w[2]
    per_expert = (w[1] - w[0]) / ((32 - 8) * L)
    # 3 matrices of H x F/2 W4AF16 weights (0.5625 B) per distinct expert on a chip
    assert per_expert == pytest.approx(3 * SHAPE.hidden * SHAPE.expert_ffn / 2 * 0.5625, rel=1e-9)
    assert costs[0].total_us < costs[1].total_us < costs[2].total_us


def test_kv_read_per_sequence_at_its_own_context(cm):
    a = price_decode_batch(cm, SHAPE, [100, 100, 100, 100])
    b = price_decode_batch(cm, SHAPE, [100, 100, 100, 10000])
    per_token = SHAPE.n_layers * SHAPE.kv_heads_per_chip * 2 * SHAPE.head_dim * 2
    assert b.dram_bytes["kv"] - a.dram_bytes["kv"] == pytest.approx(9900 * per_token, rel=1e-9)
    assert b.past_len == 10000 and b.total_us > a.total_us


def test_d2h_per_sequence(cm):
    one = price_decode_batch(cm, SHAPE, [10])
    eight = price_decode_batch(cm, SHAPE, [10] * 8)
    pcie = cm.hw.hardware["pcie_gbps"] * 1e3
    assert eight.d2h_us - one.d2h_us == pytest.approx(7 * SHAPE.logits_bytes_per_token / pcie, rel=1e-9)


def test_expected_union_and_clamp():
    u = expected_union_touched(8, SHAPE)
    assert u.shape == (48,) and 8 < u[0] < 64
    counts = np.full((2, 48), 8)
    clamped = expected_union_touched(2, SHAPE, counts)
    assert (clamped >= 8).all() and (clamped <= 16).all()
    with pytest.raises(ValueError):
        expected_union_touched(3, SHAPE, counts)


def test_s8_v_cache(cm):
    base = price_decode_batch(cm, SHAPE, [8000] * 4)
    s8 = BatchedCostModel(cm, Variant(s8_v_cache=True)).price_decode_batch(SHAPE, [8000] * 4)
    assert s8.dram_bytes["kv"] == pytest.approx(0.75 * base.dram_bytes["kv"], rel=1e-9)
    assert s8.total_us < base.total_us
    assert kv_capacity_tokens(40960, Variant(s8_v_cache=True)) == 54613
    assert kv_capacity_tokens(40960, Variant()) == 40960
    # batch-1 prefill is switched too (its attention reads the V cache): fewer KV bytes, never slower
    # (a 512-token chunk's attention is compute-bound, so the time may not move)
    bm = BatchedCostModel(cm, Variant(s8_v_cache=True))
    s8p, basep = bm.price_step(SHAPE, "prefill", 512, 8000), cm.price_step(SHAPE, "prefill", 512, 8000)
    assert s8p.total_us <= basep.total_us
    assert s8p.dram_bytes["kv"] == pytest.approx(0.75 * basep.dram_bytes["kv"], rel=1e-9)


def test_on_device_topk(cm):
    v = Variant(on_device_topk=True, topk_k=40)
    base = price_decode_batch(cm, SHAPE, [100] * 8)
    topk = BatchedCostModel(cm, v).price_decode_batch(SHAPE, [100] * 8)
    pcie = cm.hw.hardware["pcie_gbps"] * 1e3
    assert topk.d2h_us == pytest.approx(cm.hw.hardware["pcie_latency_us"] + 8 * 40 * 6 / pcie, rel=1e-9)
    assert topk.total_us < base.total_us
    one = BatchedCostModel(cm, v).price_step(SHAPE, "decode", 1, 100)
    assert one.d2h_us < cm.price_step(SHAPE, "decode", 1, 100).d2h_us


def test_status_codes():
    assert Variant().status() == "C0"
    assert Variant(overlap=True).status() == "C1"
    assert Variant(s8_v_cache=True).status() == "C1"
    assert Variant(on_device_topk=True).status() == "C2"
    assert Variant().status(8) == "C3"


@pytest.mark.parametrize("bad", [dict(past_lens=[]), dict(past_lens=[-1]), dict(past_lens=[40960]),
                                 dict(past_lens=[1, 2], experts_touched=[17] * 48),
                                 dict(past_lens=[1], experts_touched=[8] * 47),
                                 dict(past_lens=[1], chip_scale=[0.5, 1.0])])
def test_refusals(cm, bad):
    with pytest.raises(ValueError):
        price_decode_batch(cm, SHAPE, **bad)


def test_bad_switches(cm):
    with pytest.raises(ValueError):
        Variant(topk_k=0)
    with pytest.raises(ValueError):
        BatchedCostModel(cm, ramp="mean")
    lo = BatchedCostModel(cm, ramp="max").price_decode_batch(SHAPE, [3000] * 8).total_us
    hi = BatchedCostModel(cm, ramp="sum").price_decode_batch(SHAPE, [3000] * 8).total_us
    assert lo < hi
