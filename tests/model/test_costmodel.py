"""Cost model: API, shapes, sharding behaviour (simulated µs).

No timed assertions here: the host cost of price_step is printed by
``calconsole bench calibrate --timing``.
"""

import json

import numpy as np
import pytest
import yaml

from sim_backend.bundle.shapes import ModelShape
from sim_backend.errors import ManifestError
from sim_backend.model.costmodel import DEFAULT_HW_PATH, CostModel, HardwareSpec
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
    del doc["fitted"]["kv_row_overhead_bytes"]
    p = tmp_path / "hw.yaml"
    p.write_text(yaml.safe_dump(doc))
    with pytest.raises(ManifestError) as ei:
        CostModel.load(p)
    assert ei.value.field == "fitted.kv_row_overhead_bytes"
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
    ("fitted", "attn_max_splits", 0),
    ("fitted", "attn_kv_block_rows", 100.5),
    ("fitted", "attn_split_merge_us", 6.5),      # inside the hard limits, outside its physical range
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
    (lambda d: d["ranges"].pop("kv_row_overhead_bytes"), "ranges.kv_row_overhead_bytes"),
    (lambda d: d["ranges"].__setitem__("kv_row_overhead_bytes", [10.0, 1.0]), "ranges.kv_row_overhead_bytes"),
    (lambda d: d["ranges"].__setitem__("weight_stream_eff", [0.5, 1.5]), "ranges.weight_stream_eff[1]"),
    (lambda d: d["ranges"].__setitem__("bogus", [0, 1]), "ranges.bogus"),
])
def test_bad_ranges_section_is_refused(edit, field):
    doc = _hw_doc()
    edit(doc)
    with pytest.raises(ManifestError) as e:
        HardwareSpec.from_dict(doc, "hw.yaml")
    assert e.value.field == field


def test_kv_cost_per_context_token_falls_until_the_split_knee(cm):
    """Split-KV merges grow with the context up to block_rows x max_splits tokens, then stay flat:
    the marginal decode cost per context token is higher below the knee than above it."""
    f = cm.hw.fitted
    knee = int(f["attn_kv_block_rows"] * f["attn_max_splits"])

    def us(ctx):
        return cm.price_step(SHAPE, "decode", 1, ctx).total_us

    below = (us(knee - 1) - us(255)) / (knee - 256)
    above = (us(40000) - us(knee + 1)) / (40000 - knee - 1)
    assert below > 1.3 * above
    # without merges the KV cost is linear in the context (only the bytes grow)
    flat = cm.with_fitted(attn_split_merge_us=0.0)
    def fus(ctx):
        return flat.price_step(SHAPE, "decode", 1, ctx).total_us

    a, b = fus(knee) - fus(256), fus(2 * knee - 256) - fus(knee)
    assert a == pytest.approx(b, rel=1e-9)
    # KV rows stream at the weights' efficiency times row / (row + overhead)
    fa = CATEGORIES.index("flash_attention")
    lean = cm.with_fitted(kv_row_overhead_bytes=0.0, attn_split_merge_us=0.0)
    t_lean = lean.price_step(SHAPE, "decode", 1, 30000).layer_chip_category_us[0, 0, fa]
    t_flat = flat.price_step(SHAPE, "decode", 1, 30000).layer_chip_category_us[0, 0, fa]
    row = 128 * 2
    ratio = (row + f["kv_row_overhead_bytes"]) / row
    ov = f["per_op_overhead_us"]
    assert (t_flat - ov) == pytest.approx((t_lean - ov) * ratio, rel=0.02)


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
