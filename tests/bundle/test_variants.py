"""Variant bundles (status-coded what-ifs): the shipped batch-4/8/16 decode variants load as C3,
labelled; a batched decode sub-model is accepted only from a bundle that declares it, and every
real defect is still refused, naming file and field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from sim_backend.bundle.manifest import DEFAULT_BUNDLE_DIR, load_bundle
from sim_backend.errors import ManifestError

BUNDLES = DEFAULT_BUNDLE_DIR.parent


@pytest.mark.parametrize("n", [4, 8, 16])
def test_shipped_variants_load_labelled(n):
    b = load_bundle(BUNDLES / f"qwen3-30b-a3b-b{n}")
    prod = load_bundle()
    assert b.status == "C3" and b.decode_batch == n and b.max_batch_size == n and b.shape.max_batch == n
    assert "C3" in b.display_name and f"batch-{n}" in b.display_name
    assert b.submodels["prefill"].input("input_ids").shape == (1, 40960)
    assert b.submodels["decode"].input("input_ids").shape == (n, 1)
    assert b.submodels["decode"].outputs[0].shape == (n, 151936)
    codes = {f.code for f in b.findings}
    assert codes == {f.code for f in prod.findings} | {"variant"}
    v = next(f for f in b.findings if f.code == "variant")
    assert v.severity == "warning" and "not the product's current specification" in v.message
    # the model itself is the production one
    assert b.shape.n_layers == prod.shape.n_layers and b.context == prod.context and b.numeric == prod.numeric


def test_production_bundle_is_c0():
    b = load_bundle()
    assert b.status == "C0" and b.decode_batch == 1 and b.variant_label == "" and "[C0]" in b.display_name


def _variant(tmp_path: Path, n: int = 8) -> Path:
    d = tmp_path / "v"
    shutil.copytree(BUNDLES / f"qwen3-30b-a3b-b{n}", d)
    return d


def _edit(d: Path, fn) -> Path:
    mf = d / "calbin.yaml"
    doc = yaml.safe_load(mf.read_text())
    fn(doc)
    mf.write_text(yaml.safe_dump(doc, sort_keys=False))
    return mf


def _set(path, value):
    def fn(doc):
        node = doc
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return fn


def _drop(key):
    return lambda doc: doc.pop(key)


REFUSED = [
    ("undeclared_batch", _drop("variant"), "max_batch_size", "batch 1 only"),
    ("c0_batch", _set(["variant", "status"], "C0"), "max_batch_size", "status C3"),
    ("c1_batch", _set(["variant", "status"], "C1"), "max_batch_size", "status C3"),
    ("odd_batch", _set(["max_batch_size"], 3), "max_batch_size", "4 / 8 / 16"),
    ("too_big_batch", _set(["max_batch_size"], 32), "max_batch_size", "4 / 8 / 16"),
    ("unknown_status", _set(["variant", "status"], "C9"), "variant.status", "unknown status"),
    ("status_not_str", _set(["variant", "status"], 3), "variant.status", "expected str"),
    ("empty_label", _set(["variant", "label"], "  "), "variant.label", "must say"),
    ("missing_label", lambda d: d["variant"].pop("label"), "variant.label", "missing required"),
    ("variant_not_mapping", _set(["variant"], "C3"), "variant", "expected dict"),
    ("decode_rows_mismatch", _set(["submodels", 1, "inputs", 0, "shape"], [4, 1]), "submodels[1].inputs[0].shape",
     "[8, 1]"),
    ("decode_logits_rows", _set(["submodels", 1, "outputs", 0, "shape"], [1, 151936]),
     "submodels[1].outputs[0].shape", "[8, 151936]"),
    ("decode_two_tokens", _set(["submodels", 1, "inputs", 1, "shape"], [8, 2]), "submodels[1].inputs[1].shape",
     "[8, 1]"),
    ("prefill_batched", _set(["submodels", 0, "inputs", 0, "shape"], [8, 40960]), "submodels[0].inputs[0].shape",
     "[1, 40960]"),
    ("prefill_logits_batched", _set(["submodels", 0, "outputs", 0, "shape"], [8, 151936]),
     "submodels[0].outputs[0].shape", "[1, 151936]"),
    ("chips", _set(["topology", "chips"], 4), "topology.chips", "device has 2"),
    # F32 decode logits beside BF16 prefill logits: one D2H dtype per calbin
    ("logits_dtype", _set(["submodels", 1, "outputs", 0, "dtype"], "f32"), "submodels[1].outputs[0].dtype", "bf16"),
    ("logits_fp16", _set(["submodels", 1, "outputs", 0, "dtype"], "f16"), "submodels[1].outputs[0].dtype", "bf16"),
    ("decode_type", _set(["submodels", 1, "smodel_type"], "llm_prefill"), "submodels[1].smodel_type", "llm_decode"),
]


@pytest.mark.parametrize("fn,fld,fragment", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_variant_defects_refused(tmp_path, fn, fld, fragment):
    d = _variant(tmp_path)
    mf = _edit(d, fn)
    with pytest.raises(ManifestError) as ei:
        load_bundle(d)
    assert ei.value.file == str(mf) and ei.value.field == fld and fragment in ei.value.message


def test_batch1_variant_label_allowed(tmp_path):
    """A labelled variant that keeps batch 1 (e.g. a C1 study bundle) loads with its label."""
    d = tmp_path / "c1"
    shutil.copytree(DEFAULT_BUNDLE_DIR, d)
    _edit(d, _set(["variant"], {"status": "C1", "label": "S8 V-cache study"}))
    b = load_bundle(d)
    assert b.status == "C1" and b.decode_batch == 1 and "S8 V-cache study" in b.display_name


def test_production_copy_declaring_batch_needs_variant(tmp_path):
    d = tmp_path / "p"
    shutil.copytree(DEFAULT_BUNDLE_DIR, d)
    _edit(d, _set(["max_batch_size"], 8))
    with pytest.raises(ManifestError) as ei:
        load_bundle(d)
    assert ei.value.field == "max_batch_size" and "variant with status C3" in ei.value.message


def test_a_c3_variant_may_declare_f32_logits_and_its_d2h_doubles(tmp_path):
    from sim_backend.model.costmodel import default_cost_model

    d = _variant(tmp_path)
    _edit(d, lambda doc: [sm["outputs"][0].update(dtype="f32") for sm in doc["submodels"]])
    b, prod = load_bundle(d), load_bundle(BUNDLES / "qwen3-30b-a3b-b8")
    assert b.logits_dtype == "f32" and prod.logits_dtype == "bf16"
    assert b.shape.logits_bytes_per_token == 151_936 * 4 == 2 * prod.shape.logits_bytes_per_token
    hw = default_cost_model().hw.hardware
    cm = default_cost_model()
    lat = hw["pcie_latency_us"]
    c32, c16 = cm.price_step(b.shape, "prefill", 8, 0), cm.price_step(prod.shape, "prefill", 8, 0)
    assert c32.d2h_us - lat == pytest.approx(2 * (c16.d2h_us - lat))
