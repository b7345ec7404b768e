"""Where a step's time goes, per layer and per chip (simulated µs): the ops outside the layers are
"embed" (before layer 0, the embedding on chip0 only) and "head" (final norm, LM head, logits
after the last layer), a slow chip changes only its own figures, a prefill's per-layer expert
counts show per layer, and everything adds up to the step's infer time on every chip."""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.batching import BatchedCostModel, Variant, price_decode_batch
from sim_backend.model.costmodel import default_cost_model
from sim_backend.model.opgraph import CATEGORIES
from sim_backend.model.stepcost import OUTSIDE_PARTS, StepCost

SHAPE = ModelShape()
STEPS = [("decode", 1, 27, None), ("decode", 1, 30000, None), ("prefill", 27, 0, None), ("prefill", 2048, 100, None),
         ("decode", 1, 27, [1.0, 4.0]), ("prefill", 27, 0, [2.5, 1.0])]


@pytest.fixture(scope="module")
def cm():
    return default_cost_model()


def _role_us(c: StepCost, role: str) -> float:
    assert c.graph is not None
    return float(sum(c.op_us[op.index] for op in c.graph.ops if op.role == role))


def _check_adds_up(c: StepCost) -> None:
    """Per chip: layer rows + embed + head = busy = its own ops; busy + wait + submit = infer."""
    busy = c.layer_chip_us.sum(axis=0) + c.outside_chip_us.sum(axis=0)
    np.testing.assert_allclose(busy, c.chip_busy_us, rtol=1e-12)
    runs = ~np.isnan(c.op_start_us)
    own = [c.op_us[runs[ch]].sum() * c.chip_scale[ch] for ch in range(runs.shape[0])]
    np.testing.assert_allclose(c.chip_busy_us, own, rtol=1e-12)
    np.testing.assert_allclose(c.chip_busy_us + c.chip_wait_us + c.submit_us, c.infer_us, rtol=1e-12)
    assert (c.chip_wait_us >= 0).all() and c.submit_us > 0
    np.testing.assert_allclose(c.outside_chip_category_us.sum(axis=2), c.outside_chip_us, rtol=1e-12)
    assert c.global_us == pytest.approx(c.outside_chip_us.sum(axis=0).max(), rel=1e-12)


@pytest.mark.parametrize("kind,n,past,scale", STEPS)
def test_rows_add_up_to_each_chips_infer_time(cm, kind, n, past, scale):
    c = cm.price_step(SHAPE, kind, n, past, chip_scale=scale)
    assert c.outside_chip_us.shape == (len(OUTSIDE_PARTS), 2)
    assert c.outside_chip_category_us.shape == (len(OUTSIDE_PARTS), 2, len(CATEGORIES))
    _check_adds_up(c)
    d = c.to_dict()
    assert d["outside_parts"] == ["embed", "head"] and len(d["outside_chip_us"]) == 2
    assert d["chip_busy_us"] == pytest.approx(list(c.chip_busy_us))


@pytest.mark.parametrize("kind,n", [("decode", 1), ("prefill", 27)])
def test_embed_is_chip0s_and_head_is_after_the_last_layer(cm, kind, n):
    c = cm.price_step(SHAPE, kind, n, 0)
    embed, head = c.outside_chip_us
    pre = ("embedding", "embed_sync") + (("layout_in",) if kind == "prefill" else ())
    post = (("layout_out",) if kind == "prefill" else ()) + ("final_norm", "lm_head", "logits_gather", "logits_sync")
    assert c.outside_ops == (pre, post)
    # chip0 runs the embedding, chip1 does not: chip0's embed row and busy time are larger by exactly it
    emb = _role_us(c, "embedding")
    assert emb > 0
    assert embed[0] - embed[1] == pytest.approx(emb, rel=1e-12)
    assert c.chip_busy_us[0] - c.chip_busy_us[1] == pytest.approx(emb, rel=1e-9)
    assert c.chip_wait_us[1] == pytest.approx(emb, rel=1e-9)  # chip1 waits for it at the broadcast sync
    # the head (LM head: ~155 MB of int8 weights per chip) is on both chips alike; in decode it is
    # several layers' worth (prefill computes the last token's logits only, its layers are larger)
    assert head[0] == head[1]
    if kind == "decode":
        assert head[0] > 3 * c.layer_chip_us[:, 0].max()
    lm = CATEGORIES.index("quant_matmul")
    assert c.outside_chip_category_us[1, 0, lm] == pytest.approx(_role_us(c, "lm_head"))
    # the layer rows hold no outside op
    for cat in ("embedding", "layout_conversion"):
        assert not c.layer_chip_category_us[..., CATEGORIES.index(cat)].any()


def test_decode_layers_are_uniform_and_the_differences_are_outside(cm):
    c = cm.price_step(SHAPE, "decode", 1, 500)
    assert np.ptp(c.layer_chip_us) == pytest.approx(0.0, abs=1e-9)  # every layer: 8 experts, same context
    # so the per-layer view's only differences are the rows before layer 0 and after the last
    assert c.outside_chip_us[0, 0] != c.outside_chip_us[0, 1]
    assert c.outside_chip_us[1, 0] != pytest.approx(c.layer_chip_us[0, 0], rel=0.5)


def test_slow_chip1_changes_only_chip1s_column(cm):
    base = cm.price_step(SHAPE, "decode", 1, 1000)
    slow = cm.price_step(SHAPE, "decode", 1, 1000, chip_scale=[1.0, 4.0])
    np.testing.assert_array_equal(slow.layer_chip_us[:, 0], base.layer_chip_us[:, 0])
    np.testing.assert_array_equal(slow.outside_chip_us[:, 0], base.outside_chip_us[:, 0])
    np.testing.assert_array_equal(slow.layer_chip_category_us[:, 0], base.layer_chip_category_us[:, 0])
    assert slow.chip_busy_us[0] == pytest.approx(base.chip_busy_us[0], rel=1e-12)
    np.testing.assert_allclose(slow.layer_chip_us[:, 1], 4.0 * base.layer_chip_us[:, 1], rtol=1e-12)
    np.testing.assert_allclose(slow.outside_chip_us[:, 1], 4.0 * base.outside_chip_us[:, 1], rtol=1e-12)
    # chip0 is not slower: it waits for chip1 at every barrier, and the step takes chip1's time
    assert slow.chip_wait_us[0] > 2 * slow.chip_busy_us[0]
    assert slow.infer_us == pytest.approx(slow.chip_busy_us[1] + slow.chip_wait_us[1] + slow.submit_us)


def test_prefill_per_layer_experts_show_per_layer(cm):
    rng = np.random.default_rng(3)
    touched = rng.integers(60, 128, SHAPE.n_layers).astype(float)
    c = cm.price_step(SHAPE, "prefill", 27, 0, experts_touched=touched)
    assert not c.experts_expected
    np.testing.assert_array_equal(c.experts_priced, touched)
    moe = c.layer_chip_category_us[:, 0, CATEGORIES.index("moe_dense_group")]
    # the expert GEMMs follow the router's counts layer by layer (weights stream per touched expert)
    order = np.argsort(touched, kind="stable")
    assert (np.diff(moe[order]) >= -1e-9).all() and moe.max() > 1.5 * moe.min()
    assert np.ptp(c.layer_chip_us[:, 0]) > 0.1 * c.layer_chip_us[:, 0].mean()
    _check_adds_up(c)
    # the expectation prices every layer alike and says so
    e = cm.price_step(SHAPE, "prefill", 27, 0)
    assert e.experts_expected and np.ptp(e.experts_priced) == 0 and e.experts_priced[0] == pytest.approx(105.6, abs=0.1)
    assert np.ptp(e.layer_chip_us) == pytest.approx(0.0, abs=1e-9)


def test_until_op_is_the_step_cut_short(cm):
    c = cm.price_step(SHAPE, "decode", 1, 27, chip_scale=[1.0, 2.0])
    assert c.graph is not None
    sync = next(op.index for op in c.graph.ops if op.role == "embed_sync")
    infer, busy = c.until_op(sync)
    emb, s = _role_us(c, "embedding"), _role_us(c, "embed_sync")
    # chip1 waits for chip0's embedding, then both run the broadcast (chip1 at half speed)
    assert infer == pytest.approx(c.submit_us + emb + 2.0 * s)
    np.testing.assert_allclose(busy, [emb + s, 2.0 * s])
    last = c.op_us.shape[0] - 1
    assert c.until_op(last)[0] == pytest.approx(c.infer_us)
    np.testing.assert_allclose(c.until_op(last)[1], c.chip_busy_us)
    with pytest.raises(IndexError):
        c.until_op(last + 1)


@pytest.mark.parametrize("past", [0, 4000])
def test_batched_pricing_attributes_as_price_step(cm, past):
    ref = cm.price_step(SHAPE, "decode", 1, past, chip_scale=[1.0, 3.0])
    got = price_decode_batch(cm, SHAPE, [past], chip_scale=[1.0, 3.0])
    for f in ("outside_chip_us", "outside_chip_category_us", "chip_busy_us", "chip_wait_us", "experts_priced"):
        np.testing.assert_allclose(getattr(got, f), getattr(ref, f), rtol=1e-9, atol=1e-9, err_msg=f)
    assert got.outside_ops == ref.outside_ops and got.submit_us == ref.submit_us
    assert got.experts_expected and ref.experts_expected


def test_batched_steps_and_variants_add_up(cm):
    b = BatchedCostModel(cm, Variant(s8_v_cache=True, on_device_topk=True))
    batch = b.price_decode_batch(SHAPE, [10, 2000, 30000, 5], chip_scale=[1.0, 2.0])
    _check_adds_up(batch)
    # per sequence: 4 rows through the LM head; the embedding is still chip0's alone (chip1: the sync at 2x)
    embed = batch.outside_chip_us[0]
    assert embed[0] - embed[1] / 2.0 == pytest.approx(_role_us(batch, "embedding"))
    pre = b.price_step(SHAPE, "prefill", 100, 10)
    _check_adds_up(pre)
    counts = b.price_decode_batch(SHAPE, [1, 2], experts_touched=[12.0] * SHAPE.n_layers)
    assert not counts.experts_expected and list(counts.experts_priced) == [12.0] * SHAPE.n_layers


def test_wire_round_trip_keeps_the_attribution(cm):
    import pickle

    c = cm.price_step(SHAPE, "prefill", 27, 0, experts_touched=[90.0] * SHAPE.n_layers)
    back = StepCost.from_wire(pickle.loads(pickle.dumps(c.to_wire())), c.graph)
    for f in ("outside_chip_us", "outside_chip_category_us", "chip_busy_us", "experts_priced"):
        assert np.array_equal(getattr(back, f), getattr(c, f)) and not getattr(back, f).flags.writeable, f
    assert back.outside_ops == c.outside_ops and back.experts_expected is False
