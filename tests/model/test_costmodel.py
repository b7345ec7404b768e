"""Cost model: API, shapes, sharding behaviour (simulated µs).

No timed assertions here: the host cost of price_step is printed by
``calconsole bench calibrate --timing``.
"""

import json
import math

import numpy as np
import pytest
import yaml

from sim_backend.bundle.shapes import ModelShape
from sim_backend.errors import ManifestError
from sim_backend.model.costmodel import CostModel
from sim_backend.model.hwspec import DEFAULT_HW_PATH, HardwareSpec
from sim_backend.model.opgraph import CATEGORIES

SHAPE = ModelShape()


@pytest.fixture(scope="module")
def cm():
    return CostModel.load()


def test_default_yaml_ships_inside_the_package():
    assert DEFAULT_HW_PATH.is_file()
    assert DEFAULT_HW_PATH.parent.parent.name == "sim_backend"


@pytest.mark.parametrize("kind,n,past", [("decode", 1, 100), ("prefill", 27, 0), ("prefill", 300, 50)])
def test_step_cost_shapes_and_totals(cm, kind, n, past):
    c = cm.price_step(SHAPE, kind, n, past)
    g = cm.graph(SHAPE, kind)
    assert c.total_us == pytest.approx(c.h2d_us + c.infer_us + c.d2h_us)
    assert c.layer_chip_us.shape == (48, 2) and c.layer_chip_us.dtype == np.float64
    assert c.layer_chip_category_us.shape == (48, 2, len(CATEGORIES))
    assert c.categories == CATEGORIES
    assert c.op_us.shape == (g.count(),) and (c.op_us > 0).all()
    assert c.op_start_us.shape == (2, g.count())
    np.testing.assert_allclose(c.layer_chip_category_us.sum(axis=2), c.layer_chip_us)
    # per-layer sums + global ops = everything chip0 runs
    chip0 = np.array([0 in op.chips for op in g.ops])
    assert c.layer_chip_us[:, 0].sum() + c.global_us == pytest.approx(c.op_us[chip0].sum())
    # timeline fits in the infer time; embedding only on chip0
    end = np.nanmax(c.op_start_us + c.op_us)
    assert end <= c.infer_us
    emb = next(op.index for op in g.ops if op.category == "embedding")
    assert np.isnan(c.op_start_us[1, emb]) and c.op_start_us[0, emb] == 0.0
    # chips are aligned at every sync (barrier)
    syncs = [op.index for op in g.ops if op.category == "sync_d2d"]
    np.testing.assert_allclose(c.op_start_us[0, syncs], c.op_start_us[1, syncs])
    assert len(c.slowest_category_per_layer) == 48
    d = json.loads(json.dumps(c.to_dict()))
    assert d["simulated"] is True and len(d["layer_chip_us"]) == 48
    assert len(d["layer_chip_category_us"][0][0]) == len(CATEGORIES)


def test_arrays_are_read_only(cm):
    c = cm.price_step(SHAPE, "decode", 1, 10)
    with pytest.raises(ValueError):
        c.op_us[0] = 1.0


def test_d2h_is_one_token_of_logits(cm):
    hw = cm.hw.hardware
    expect = hw["pcie_latency_us"] + 303_872 / (hw["pcie_gbps"] * 1e3)
    for kind, n in (("decode", 1), ("prefill", 512)):  # prefill: last token's logits only
        assert cm.price_step(SHAPE, kind, n, 0).d2h_us == pytest.approx(expect)
    assert cm.price_step(SHAPE, "prefill", 512, 0).h2d_us > cm.price_step(SHAPE, "decode", 1, 0).h2d_us


def test_kv_reads_grow_with_context(cm):
    fa = CATEGORIES.index("flash_attention")
    short = cm.price_step(SHAPE, "decode", 1, 1000).layer_chip_category_us[..., fa].sum()
    long = cm.price_step(SHAPE, "decode", 1, 30000).layer_chip_category_us[..., fa].sum()
    assert long > 10 * short
    assert cm.price_step(SHAPE, "decode", 1, 30000).total_us > cm.price_step(SHAPE, "decode", 1, 1000).total_us


def test_prefill_attention_is_quadratic(cm):
    fa = CATEGORIES.index("flash_attention")
    t1 = cm.price_step(SHAPE, "prefill", 8192, 0).layer_chip_category_us[..., fa].sum()
    t2 = cm.price_step(SHAPE, "prefill", 16384, 0).layer_chip_category_us[..., fa].sum()
    assert 3.5 < t2 / t1 < 4.5


def test_embedding_and_lm_head_are_priced(cm):
    c = cm.price_step(SHAPE, "decode", 1, 0)
    g = c.graph
    roles = {op.role: op.index for op in g.ops if op.layer < 0}
    assert c.op_us[roles["lm_head"]] > 1000  # ~155 MB of int8 weights per chip
    assert c.op_us[roles["embedding"]] > 0
    assert c.global_us > c.op_us[roles["lm_head"]]


def test_smaller_model_is_cheaper(cm):
    full = cm.price_step(SHAPE, "decode", 1, 100).total_us
    half = cm.price_step(SHAPE.with_layers(24), "decode", 1, 100).total_us
    assert half < 0.6 * full


def test_bad_arguments(cm):
    with pytest.raises(ValueError):
        cm.price_step(SHAPE, "decode", 2, 0)
    with pytest.raises(ValueError):
        cm.price_step(SHAPE, "decode", 1, 40960)
    with pytest.raises(ValueError):
        cm.price_step(SHAPE, "mixed", 1, 0)
    with pytest.raises(ValueError):
        cm.price_step(SHAPE, "decode", 1, 0, experts_touched=[8] * 47)
    with pytest.raises(ValueError):
        cm.price_step(SHAPE, "decode", 1, 0, experts_touched=[9] * 48)


def test_bad_yaml_is_a_manifest_error(tmp_path):
    doc = yaml.safe_load(DEFAULT_HW_PATH.read_text())
    del doc["fitted"]["attn_vector_tflops"]
    p = tmp_path / "hw.yaml"
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(ManifestError) as ei:
        CostModel.load(p)
    assert ei.value.field == "fitted.attn_vector_tflops"
    doc = yaml.safe_load(DEFAULT_HW_PATH.read_text())
    doc["fitted"]["weight_stream_eff"] = 1.7
    with pytest.raises(ManifestError):
        HardwareSpec.from_dict(doc)


# --- Chrome trace (sim_backend/trace.py) --------------------------------------

def test_chrome_trace(cm, tmp_path):
    from sim_backend.model.trace import chrome_trace, write_chrome_trace

    pre = cm.price_step(SHAPE, "prefill", 27, 0)
    dec = cm.price_step(SHAPE, "decode", 1, 27)
    steps = [("prefill 27", pre, 0.0), ("decode 1", dec, pre.total_us)]
    path = write_chrome_trace(tmp_path / "t.json", steps)
    doc = json.loads(path.read_text())
    assert doc == json.loads(json.dumps(chrome_trace(steps)))
    assert doc["displayTimeUnit"] == "ms"
    evs = doc["traceEvents"]
    for e in evs:
        assert {"ph", "pid", "name"} <= e.keys()
        if e["ph"] == "X":
            assert {"ts", "dur", "tid"} <= e.keys() and e["dur"] >= 0
    names = {e["tid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    chip_tids = [t for t, n in names.items() if n.startswith("chip")]
    assert sorted(chip_tids) == [0, 1]
    for chip, expected in ((0, 1352 + 1254), (1, 1351 + 1253)):
        ops = [e for e in evs if e["ph"] == "X" and e["tid"] == chip]
        assert len(ops) == expected
        assert all(e["args"]["chip"] == chip and {"layer", "role"} <= e["args"].keys() for e in ops)
    emb = [e for e in evs if e["ph"] == "X" and e["name"] == "embedding global"]
    assert [e["tid"] for e in emb] == [0, 0]
    assert any(e["name"] == "flash_attention L12" for e in evs)
    pcie = [e for e in evs if e["ph"] == "X" and e["name"] in ("H2D", "D2H logits")]
    assert len(pcie) == 4
    # decode step starts after the prefill ends on the simulated clock
    dec_ops = [e for e in evs if e["ph"] == "X" and e["tid"] == 0 and e["args"]["step"] == "decode 1"]
    assert min(e["ts"] for e in dec_ops) >= pre.total_us


# ------------------------------------ every hardware number is bounded

def _hw_doc():
    return yaml.safe_load(DEFAULT_HW_PATH.read_text())


@pytest.mark.parametrize("sec, key, value", [
    ("hardware", "n_chips", 2.5),
    ("hardware", "n_chips", 10**6),
    ("hardware", "dram_physical_gib", float("inf")),
    ("hardware", "dram_physical_gib", float("nan")),
    ("hardware", "dram_physical_gib", 1e300),
    ("hardware", "sram_physical_mib", 0),
    ("hardware", "pcie_gbps", -1.0),
    ("hardware", "d2d_latency_us", 1e12),
    ("quantisation", "kv_bytes", 100),
    ("quantisation", "expert_bytes_per_weight", 0.0),
    ("memory", "dram_reservation_gib", 1e9),
    ("memory", "param_file_gib", [8.0]),  # one per chip
    ("memory", "param_file_gib", "8.759"),
    ("memory", "param_file_gib", [8.0, float("inf")]),
    ("memory", "address_union_gib", {"decode": 1.0}),
    ("memory", "address_union_gib", {"decode": 1.0, "prefill": "x"}),
    ("memory", "sram_reservation_mib", None),
    ("fitted", "prefill_m_tile", 0),
    ("fitted", "prefill_m_tile", 64.5),
    ("fitted", "host_overhead_ms_per_token", -0.1),
    ("fitted", "attn_cores", 0),
    ("fitted", "kv_block_kib", 32.5),
    ("fitted", "attn_merge_level_us", 6.5),      # inside the hard limits, outside its physical range
    ("hardware", "dram_bw_gbps", 200.0),         # likewise (hardware_ranges)
    ("fitted", "weight_stream_eff", 0.99),       # likewise
    ("fitted", "weight_stream_eff", float("nan")),
])
def test_hardware_numbers_out_of_range_are_refused(sec, key, value):
    doc = _hw_doc()
    doc[sec][key] = value
    with pytest.raises(ManifestError) as e:
        HardwareSpec.from_dict(doc, "hw.yaml")
    assert e.value.file == "hw.yaml" and e.value.field.startswith(f"{sec}.{key}")


def test_hardware_yaml_files_that_cannot_be_parsed(tmp_path):
    import os

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # must not block
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:
        f.truncate(4 << 20)
    digits = tmp_path / "digits.yaml"
    digits.write_text(DEFAULT_HW_PATH.read_text().replace("n_chips: 2", "n_chips: " + "9" * 5000))
    deep = tmp_path / "deep.yaml"
    deep.write_text("hardware: " + "[" * 5000 + "]" * 5000 + "\n")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    for p in (fifo, big, digits, deep, binary, tmp_path / "missing.yaml", tmp_path / ("x" * 300)):
        with pytest.raises(ManifestError) as e:
            HardwareSpec.load(p)
        assert len(str(e.value)) < 600


def test_cli_model_refuses_bad_hardware_yaml(tmp_path, capsys):
    from calconsole.cli import main

    doc = _hw_doc()
    doc["hardware"]["dram_physical_gib"] = 1e300
    p = tmp_path / "hw.yaml"
    p.write_text(yaml.safe_dump(doc))
    assert main(["model", "--json", "--hardware", str(p)]) == 2
    err = capsys.readouterr().err
    assert "hardware.dram_physical_gib" in err and len(err.strip().splitlines()) == 1

@pytest.mark.parametrize("kind,n,past", [("decode", 1, 100), ("prefill", 27, 0)])
def test_slow_chip_is_priced_on_its_own_column(cm, kind, n, past):
    base = cm.price_step(SHAPE, kind, n, past)
    slow = cm.price_step(SHAPE, kind, n, past, chip_scale=[1.0, 4.0])
    assert base.chip_scale == (1.0, 1.0) and slow.chip_scale == (1.0, 4.0)
    # chip0 keeps its own time, chip1 takes 4x; the host link (PCIe) is not the chip
    assert np.allclose(slow.layer_chip_us[:, 0], base.layer_chip_us[:, 0])
    assert np.allclose(slow.layer_chip_us[:, 1], 4.0 * base.layer_chip_us[:, 1])
    assert (slow.h2d_us, slow.d2h_us) == (base.h2d_us, base.d2h_us)
    assert slow.total_us == pytest.approx(slow.h2d_us + slow.infer_us + slow.d2h_us)
    # chips align at every barrier: the slow chip gates the step, by at most its factor
    assert 3.0 * base.infer_us < slow.infer_us <= 4.0 * base.infer_us
    # and the other chip waits at the barriers: its ops start later than in the nominal step
    assert np.nanmax(slow.op_start_us[0]) > 3.0 * np.nanmax(base.op_start_us[0])


@pytest.mark.parametrize("bad", [[1.0], [1.0, 0.5], [1.0, float("nan")], [1.0, float("inf")], [1.0, 2.0, 3.0]])
def test_bad_chip_scale_is_refused(cm, bad):
    with pytest.raises(ValueError, match="chip_scale"):
        cm.price_step(SHAPE, "decode", 1, 10, chip_scale=bad)



# ------------------------------------ physical ranges, KV mechanism, SRAM

def test_every_fitted_parameter_has_a_physical_range_and_lies_in_it():
    hw = HardwareSpec.load()
    assert set(hw.ranges) == set(hw.fitted)
    for k, (lo, hi) in hw.ranges.items():
        assert lo <= hw.fitted[k] <= hi, k


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("ranges"), "ranges"),
    (lambda d: d["ranges"].pop("attn_vector_tflops"), "ranges.attn_vector_tflops"),
    (lambda d: d["ranges"].__setitem__("attn_vector_tflops", [10.0, 1.0]), "ranges.attn_vector_tflops"),
    (lambda d: d["hardware_ranges"].__setitem__("n_chips", [1, 2]), "hardware_ranges.n_chips"),
    (lambda d: d["hardware_ranges"].__setitem__("dram_bw_gbps", [200.0, 100.0]), "hardware_ranges.dram_bw_gbps"),
    (lambda d: d.__setitem__("hardware_ranges", [1, 2]), "hardware_ranges"),
    (lambda d: d["ranges"].__setitem__("weight_stream_eff", [0.5, 1.5]), "ranges.weight_stream_eff[1]"),
    (lambda d: d["ranges"].__setitem__("bogus", [0, 1]), "ranges.bogus"),
])
def test_bad_ranges_section_is_refused(edit, field):
    doc = _hw_doc()
    edit(doc)
    with pytest.raises(ManifestError) as e:
        HardwareSpec.from_dict(doc, "hw.yaml")
    assert e.value.field == field


def test_flash_decode_mechanism(cm):
    """Flash decoding by mechanism (attention_cost.flash_decode): blocks of kv_block_kib, partitions over the
    cores, max(DMA at the shared DRAM rate, vector work) per block, a tree merge of the partitions."""
    from sim_backend.model.attention_cost import flash_decode
    from sim_backend.model.hwspec import sram_workspace_bytes

    f, hw = cm.hw.fitted, cm.hw
    rows = f["kv_block_kib"] * 1024 // (128 * 2)
    one = flash_decode(hw, SHAPE, rows)                  # one block per head: no split, no merge
    assert one.block_rows == rows and one.blocks_per_head == 1 and one.partitions_per_head == 1
    assert one.merge_levels == 0 and one.merge_us == 0.0
    cap = f["attn_cores"] // 2                           # 2 KV heads per chip (facts.md F3)
    big = flash_decode(hw, SHAPE, 40_000)
    assert big.partitions_per_head == cap and big.merge_levels == math.ceil(math.log2(cap))
    assert big.merge_us == pytest.approx(big.merge_levels * f["attn_merge_level_us"])
    assert big.kv_bytes == 40_000 * 2 * 128 * 2 * 2
    # double buffering: both blocks of every partition twice in the workspace (facts.md F4)
    assert big.double_buffered == (2 * 2 * f["kv_block_kib"] * 1024 * 2 * cap <= sram_workspace_bytes(hw))
    # merges in a tree: 4x the partitions cost 2 more levels, not 4x the merge time
    wide = cm.with_fitted(attn_cores=min(32, 4 * f["attn_cores"]))
    w = flash_decode(wide.hw, SHAPE, 40_000)
    assert w.merge_levels - big.merge_levels == math.ceil(math.log2(w.partitions_per_head)) - big.merge_levels
    # the KV stream is never faster than its bytes at the DRAM's sequential rate
    kv_bw = hw.hardware["dram_bw_gbps"] * 1e3 * f["weight_stream_eff"]
    for ctx in (1, 300, 4096, 40_000):
        fd = flash_decode(hw, SHAPE, ctx)
        assert fd.stream_us >= fd.kv_bytes / kv_bw * (1 - 1e-12)
    # vector-bound: a slower vector unit makes long contexts slower in proportion, DMA-bound it does not
    slow = flash_decode(cm.with_fitted(attn_vector_tflops=f["attn_vector_tflops"] / 2).hw, SHAPE, 40_000)
    fast = flash_decode(cm.with_fitted(attn_vector_tflops=4.0).hw, SHAPE, 40_000)
    assert slow.stream_us > 1.9 * big.stream_us or big.stream_us == pytest.approx(big.kv_bytes / kv_bw)
    assert fast.stream_us >= big.kv_bytes / kv_bw * (1 - 1e-12)
    with pytest.raises(ValueError):
        flash_decode(hw, SHAPE, 0)


def test_decode_attention_is_the_flash_decode_op(cm):
    from sim_backend.model.attention_cost import flash_decode

    fa = CATEGORIES.index("flash_attention")
    for past in (10, 5000, 40_000):
        c = cm.price_step(SHAPE, "decode", 1, past)
        fd = flash_decode(cm.hw, SHAPE, past + 1)
        per_layer = c.layer_chip_category_us[0, 0, fa]
        # the op = flash decoding + Q in / output out at SRAM rate + one op issue
        assert per_layer == pytest.approx(fd.us + cm.hw.fitted["per_op_overhead_us"], abs=0.05)
    # family-neutral: a model with twice the KV heads per chip streams twice the bytes
    import dataclasses

    wide = dataclasses.replace(SHAPE, n_kv_heads=8, n_q_heads=32)
    assert flash_decode(cm.hw, wide, 4096).kv_bytes == 2 * flash_decode(cm.hw, SHAPE, 4096).kv_bytes


def test_data_moving_table_of_the_40960_prefill(cm):
    """The derived data-moving entries of the upper-bound prefill (facts.md F3): 245,760 x 64 KiB is the
    dynamic D2D volume (2 per layer x 48 x 40960 tokens x 2048 x 2 B), 122,880 x 32 KiB the KV written
    once and read once (2 x 1.875 GiB, facts.md F4), chip0's 2 extra entries the embedding."""
    from sim_backend.model.attention_cost import data_moving_table

    t = data_moving_table(cm.hw, SHAPE)
    assert [d["blocks"] for d in t] == [{64 * 1024: 245_760, 32 * 1024: 122_880}] * 2
    d2d = next(m for m in t[1]["moves"] if m["what"].startswith("dynamic D2D"))
    assert d2d["bytes"] == 96 * 40960 * 2048 * 2 == 245_760 * 64 * 1024
    assert t[0]["entries"] - t[1]["entries"] == 2
    assert t[1]["bytes"] == 245_760 * 65536 + 122_880 * 32768
    assert abs(t[1]["gib"] - 18.822) / 18.822 < 0.004       # the table's 1 KiB class is not derived (0.38 %)
    assert abs((t[0]["gib"] - t[1]["gib"]) - (18.979 - 18.822)) <= 0.001
    small = data_moving_table(cm.hw, SHAPE, 27)
    assert small[0]["bytes"] < 1e-3 * t[0]["bytes"]
    with pytest.raises(ValueError):
        data_moving_table(cm.hw, SHAPE, 0)


def test_moe_tiles_keep_expert_intermediates_in_sram(cm):
    """Prefill of 2048 tokens: the expert intermediate (n x k x 384 per chip) never reaches DRAM; the
    gathered rows and the expert outputs (n x k x hidden) do."""
    c = cm.price_step(SHAPE, "prefill", 2048, 0)
    n, k, H, Fc, a = 2048, 8, 2048, 384, 2
    moe_dram = 3 * n * k * H * a + n * k * H * a          # 3 grouped GEMMs + the reduce's read
    assert c.dram_bytes["activations"] >= moe_dram * 48
    # in SRAM: at least the tile-resident intermediates (3 GEMMs + SiLU 2x + multiply 3x)
    assert c.sram_bytes >= (3 + 2 + 3) * n * k * Fc * a * 48


def test_small_activations_are_priced_at_sram_bandwidth(cm):
    dec = cm.price_step(SHAPE, "decode", 1, 100)
    assert dec.sram_bytes > 0 and dec.dram_bytes["activations"] < dec.sram_bytes
    # a 2048-token prefill chunk's hidden states (8 MiB) do not fit the 2.463 MiB workspace
    big = cm.price_step(SHAPE, "prefill", 2048, 0)
    assert big.dram_bytes["activations"] > big.sram_bytes
    # slower SRAM makes a decode step slower: the SRAM rate is what prices the small activations
    import dataclasses
    from types import MappingProxyType

    slow_hw = dataclasses.replace(cm.hw, hardware=MappingProxyType({**cm.hw.hardware, "sram_bw_gbps": 50.0}))
    assert CostModel(slow_hw).price_step(SHAPE, "decode", 1, 100).total_us > dec.total_us
    # the workspace is the memory plan's SRAM reservation minus the parameters' window (facts.md F4)
    mem = cm.hw.memory
    assert (mem["sram_reservation_mib"] - mem["param_sram_window_mib"]) == pytest.approx(2.463, abs=1e-3)
