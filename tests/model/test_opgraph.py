"""Op graph counts against facts.md F3 (report §5–§6)."""

import pytest

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.opgraph import (
    CATEGORIES,
    build_graph,
    global_op_count,
    per_layer_op_count,
)

F3 = {
    # category: (prefill, decode)
    "fused_rmsnorm": (193, 193),
    "quant_matmul": (193, 193),
    "sync_d2d": (146, 146),
    "gather": (145, 145),
    "moe_dense_group": (144, 144),
    "kv_scatter": (96, 96),
    "fused_rope": (96, 96),
    "add_residual": (96, 96),
    "dynamic_d2d": (96, 0),
    "silu": (48, 48),
    "multiply": (48, 48),
    "reduce": (48, 48),
    "gate_pre": (48, 48),
    "gate_post": (48, 48),
    "flash_attention": (48, 48),
    "embedding": (1, 1),
    "layout_conversion": (2, 0),
}


@pytest.mark.parametrize("kind,total,profile", [
    ("prefill", 1496, [1352, 1351]),
    ("decode", 1398, [1254, 1253]),
])
def test_f3_totals_and_profiles(kind, total, profile):
    g = build_graph(ModelShape(), kind)
    assert g.count() == total
    assert g.per_chip_profile_count() == profile
    col = 0 if kind == "prefill" else 1
    assert g.counts_by_category() == {c: v[col] for c, v in F3.items()}
    assert set(g.counts_by_category()) == set(CATEGORIES)
    assert [op.index for op in g.ops] == list(range(total))


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_embedding_only_on_chip0_and_moe_on_both(kind):
    g = build_graph(ModelShape(), kind)
    emb = [op for op in g.ops if op.category == "embedding"]
    assert len(emb) == 1 and emb[0].chips == (0,) and emb[0].profile_chips == (0,)
    assert all(op.chips == (0, 1) for op in g.ops if op.category != "embedding")
    # facts.md F3: both chips' profiles hold all 144 nbu_moe_dense_group
    for chip in (0, 1):
        moe = [op for op in g.ops_on_chip(chip) if op.category == "moe_dense_group"]
        assert len(moe) == 144
    # the only stable per-chip difference is the embedding (facts.md F3)
    names0 = {op.name for op in g.ops_on_chip(0)}
    names1 = {op.name for op in g.ops_on_chip(1)}
    assert names0 - names1 == {emb[0].name} and not names1 - names0


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_missing_profile_rows_are_per_layer_syncs(kind):
    g = build_graph(ModelShape(), kind)
    unprofiled = [op for op in g.ops if not op.profile_chips]
    assert len(unprofiled) == 144
    assert all(op.category == "sync_d2d" and op.layer >= 0 for op in unprofiled)


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_counts_follow_structure_at_24_layers(kind):
    shape = ModelShape().with_layers(24)
    g = build_graph(shape, kind)
    per_layer, glob = per_layer_op_count(kind), global_op_count(kind)
    assert (per_layer, glob) == ((31, 8) if kind == "prefill" else (29, 6))
    assert g.count() == per_layer * 24 + glob
    # per-layer syncs (3/layer) have no profile row; embedding only on chip0
    full = g.count() - 3 * 24
    assert g.per_chip_profile_count() == [full, full - 1]
    counts = g.counts_by_category()
    assert counts["fused_rmsnorm"] == 4 * 24 + 1
    assert counts["quant_matmul"] == 4 * 24 + 1
    assert counts["sync_d2d"] == 3 * 24 + 2
    assert counts["gather"] == 3 * 24 + 1
    assert counts["moe_dense_group"] == 3 * 24
    assert counts["dynamic_d2d"] == (2 * 24 if kind == "prefill" else 0)
    assert counts["flash_attention"] == 24


def test_graph_is_cached_and_rejects_bad_kind():
    assert build_graph(ModelShape(), "decode") is build_graph(ModelShape(), "decode")
    with pytest.raises(ValueError):
        build_graph(ModelShape(), "mixed")
