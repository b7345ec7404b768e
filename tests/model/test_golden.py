"""The golden self-test: passes on any CPU / BLAS build, fails when the numerics are broken.

Nothing here asserts bit-exact floats across machines. What is asserted is the documented rule
(``golden.compare``): every logit within one BF16 step + ``golden.max_abs_error`` and the same
top-1 token. Other BLAS kernels are exercised for real through OpenBLAS's ``OPENBLAS_CORETYPE``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from sim_backend.model import golden as G
from sim_backend.model.numerics import ShardedModel
from sim_backend.model.weights import make_weights


@pytest.fixture(scope="module")
def stored(bundle):
    return G.load_golden(bundle.golden_file)


def run_golden_job(bundle, model: ShardedModel | None = None) -> np.ndarray:
    """The golden job (one 6-token prefill) on ``model``; returns BF16 bits (uint16, vocab)."""
    model = model or ShardedModel(bundle.shape, bundle.numeric, n_cells=8)
    ids = np.asarray(G.GOLDEN_IDS, dtype=np.int64)
    pos = np.arange(len(ids), dtype=np.int64)
    out = model.forward(ids, pos, pos.copy(), pos.copy(), pos.copy())
    return G._f32_to_bf16_bits(out.logits)


# --- the bound itself --------------------------------------------------------------------------


def test_bf16_step_is_the_spacing_of_bf16_values():
    x = np.array([1.0, 1.5, 2.0, 7.9, 8.0, 40.3, -40.3, 0.0], dtype=np.float32)
    step = G.bf16_step(x)
    assert step.tolist()[:7] == [2**-7, 2**-7, 2**-6, 2**-5, 2**-4, 2**-2, 2**-2]
    assert 0 < step[7] < 1e-30
    # next BF16 value above x is exactly x + step for these BF16-representable x
    bits = G._f32_to_bf16_bits(np.array([1.0, 8.0, 32.0], dtype=np.float32))
    nxt = G.bf16_bits_to_f32(bits + 1)
    assert (nxt - G.bf16_bits_to_f32(bits)).tolist() == G.bf16_step(np.array([1.0, 8.0, 32.0])).tolist()


def test_one_rounding_step_everywhere_passes_and_a_step_plus_margin_fails(stored):
    want = stored.expected
    one_up = G._f32_to_bf16_bits(want) + np.where(want > 0, 1, 0).astype(np.uint16)  # +1 step on positives
    rep = G.compare(stored, one_up, 0.05)
    assert rep["ok"] and rep["n_bf16_steps"] > 50_000 and rep["n_mismatched"] == 0
    # the largest positive logit moved by one step + 0.06: over the bound, whatever the machine
    bad = want.copy()
    i = int(np.argmax(want))
    bad[i] += float(G.bf16_step(want[i:i + 1])[0]) + 0.06
    rep = G.compare(stored, G._f32_to_bf16_bits(bad), 0.05)
    assert not rep["ok"] and rep["n_mismatched"] >= 1 and rep["worst_of_bound"] > 1


def test_top1_must_agree_and_non_finite_or_wrong_shape_fails(stored):
    want = stored.expected.copy()
    a, b = np.argsort(-want)[:2]
    swapped = want.copy()
    swapped[a], swapped[b] = want[b], want[a]
    rep = G.compare(stored, G._f32_to_bf16_bits(swapped), 100.0)  # within a huge bound, but top-1 moved
    assert not rep["ok"] and not rep["top1_match"] and rep["n_mismatched"] == 0
    nan = want.copy()
    nan[123] = np.nan
    assert not G.compare(stored, G._f32_to_bf16_bits(nan), 0.05)["ok"]
    short = G.compare(stored, stored.logits[:-1], 0.05)
    assert not short["ok"] and short["max_abs_error"] is None and "shape" in short["detail"]


def test_stored_golden_top1_lead_guarantees_top1_agreement(stored, bundle):
    want = stored.expected
    top = np.argsort(-want)[:2]
    lead = float(want[top[0]] - want[top[1]])
    bound = float(G.error_bound(want[top[:1]], want[top[:1]], bundle.golden_max_abs_error)[0])
    assert lead > 2 * bound


# --- on this machine and under other BLAS kernels ----------------------------------------------


def test_healthy_model_passes_here(bundle, stored):
    rep = G.compare(stored, run_golden_job(bundle), bundle.golden_max_abs_error)
    assert rep["ok"], rep


def test_decode_path_agrees_with_the_prefill_golden(bundle, stored):
    """A different kernel order (5-token prefill, then a decode step) is still within the bound."""
    model = ShardedModel(bundle.shape, bundle.numeric, n_cells=8)
    ids = np.asarray(G.GOLDEN_IDS, dtype=np.int64)
    pos = np.arange(6, dtype=np.int64)
    model.forward(ids[:5], pos[:5], pos[:5].copy(), pos[:5].copy(), pos[:5].copy())
    out = model.forward(ids[5:], pos[5:], pos[5:].copy(), pos.copy(), pos.copy())
    assert G.compare(stored, G._f32_to_bf16_bits(out.logits), bundle.golden_max_abs_error)["ok"]


@pytest.mark.parametrize("coretype", ["Prescott", "Sandybridge", "Zen"])
def test_check_passes_under_other_blas_kernels(coretype):
    """``python -m sim_backend.model.golden --check`` with OpenBLAS forced onto another CPU's kernels.

    On this project's numpy wheels (OpenBLAS DYNAMIC_ARCH) these kernels give float32 logits that
    differ from the file's in the last bits, which is exactly what a fresh machine sees. With a BLAS
    that ignores the variable the check simply runs on the native kernels.
    """
    env = dict(os.environ, OPENBLAS_CORETYPE=coretype)
    p = subprocess.run([sys.executable, "-m", "sim_backend.model.golden", "--check"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    rep = json.loads(p.stdout)
    assert rep["ok"] and rep["device"]["top1_match"] and rep["f32_topk_drift"] <= G.F32_DRIFT_ATOL


# --- broken numerics fail ----------------------------------------------------------------------


def _broken_models(bundle):
    """(name, model) pairs, each with one realistic corruption; weights copied, never the cached ones."""
    shape, num = bundle.shape, bundle.numeric

    def fresh(weights=None):
        return ShardedModel(shape, num, n_cells=8, weights=weights)

    m = fresh()
    m.chips[0].layers[24]["wo"][...] *= 1.02  # 2% error in one chip's attention output, one layer
    yield "attention weight 2%", m
    w = copy.deepcopy(make_weights(shape, num))
    w.layers[10] = dataclasses.replace(w.layers[10], router=w.layers[10].router[:, ::-1].copy())  # routing
    yield "router columns reversed", fresh(w)
    m = fresh()
    m.chips[1].layers[40]["down"][...] = 0.0  # one chip's expert down-projections lost in one layer
    yield "expert weights zeroed", m
    w = copy.deepcopy(make_weights(shape, num))
    half = shape.vocab // shape.n_chips
    w.lm_head[:, half:half + 50] += 0.5  # 50 columns of chip 1's half (the compiled path reads its BF16 copy)
    yield "LM head region", fresh(w)


def test_corrupted_numerics_fail_the_check(bundle, stored):
    for name, model in _broken_models(bundle):
        rep = G.compare(stored, run_golden_job(bundle, model), bundle.golden_max_abs_error)
        assert not rep["ok"], (name, rep)
        assert rep["n_mismatched"] >= 10, (name, rep)  # broken numerics move many logits, not one


def test_corrupted_kv_cell_fails(bundle, stored):
    model = ShardedModel(bundle.shape, bundle.numeric, n_cells=8)
    ids = np.asarray(G.GOLDEN_IDS, dtype=np.int64)
    pos = np.arange(6, dtype=np.int64)
    model.forward(ids[:5], pos[:5], pos[:5].copy(), pos[:5].copy(), pos[:5].copy())
    model.k_cache[:, :, :, 2] *= -1.0  # one cached token's keys corrupted on both chips
    out = model.forward(ids[5:], pos[5:], pos[5:].copy(), pos.copy(), pos.copy())
    assert not G.compare(stored, G._f32_to_bf16_bits(out.logits), bundle.golden_max_abs_error)["ok"]


# --- damaged golden files: one typed error, naming the file ------------------------------------


def test_damaged_golden_files_raise_one_typed_error(tmp_path, bundle):
    src = bundle.golden_file.read_bytes()
    cases = {}
    (tmp_path / "truncated.npz").write_bytes(src[: len(src) // 2])
    cases["truncated.npz"] = "damaged"
    (tmp_path / "text.npz").write_text("not a zip")
    cases["text.npz"] = "damaged"
    np.savez(tmp_path / "noids.npz", logits=np.zeros(4, np.uint16))
    cases["noids.npz"] = "input_ids"
    np.savez(tmp_path / "obj.npz", input_ids=np.array([1, 2], dtype=object), logits=np.zeros(4, np.uint16))
    cases["obj.npz"] = "damaged"
    np.savez(tmp_path / "strlogits.npz", input_ids=np.array([1]), logits=np.array(["a", "b"]))
    cases["strlogits.npz"] = "logits"
    np.savez(tmp_path / "noint.npz", input_ids=np.array([1.5]), logits=np.zeros(4, np.uint16))
    cases["noint.npz"] = "input_ids"
    (tmp_path / "dir.npz").mkdir()
    cases["dir.npz"] = "not a regular file"
    os.mkfifo(tmp_path / "fifo.npz")
    cases["fifo.npz"] = "not a regular file"
    cases["missing.npz"] = "cannot read"
    with zipfile.ZipFile(tmp_path / "badmeta.npz", "w") as z:
        for name in ("input_ids", "logits"):
            with z.open(name + ".npy", "w") as f:
                np.lib.format.write_array(f, np.zeros(3, np.int32 if name == "input_ids" else np.uint16))
        with z.open("meta.npy", "w") as f:
            np.lib.format.write_array(f, np.array("{not json"))
    cases["badmeta.npz"] = "meta"
    for name, expect in cases.items():
        with pytest.raises(G.GoldenFileError, match=expect) as ei:
            G.load_golden(tmp_path / name)
        assert name in str(ei.value)


def test_self_test_on_a_truncated_golden_fails_cleanly(tmp_path, bundle, monkeypatch):
    from sim_backend.compose import build_system

    bad = tmp_path / "golden.npz"
    bad.write_bytes(bundle.golden_file.read_bytes()[:1000])
    from sim_backend.device.clock import Pacing, PacingMode

    system = build_system(pacing=Pacing(PacingMode.FAST), audit_path=tmp_path / "audit.jsonl")
    try:
        monkeypatch.setattr(system.board, "bundle", dataclasses.replace(system.board.bundle, golden_file=bad))
        m = system.maintenance
        lease = m.enter_exclusive("alice")
        rep = m.self_test(lease)
        assert rep["ok"] is False and "golden file unreadable" in rep["detail"] and "golden.npz" in rep["detail"]
        last = m.audit.entries()[-1]
        assert last["status"] == "failed" and "internal error" not in json.dumps(last)
        m.leave_exclusive(lease)
    finally:
        system.close()


# --- an F32 calbin's golden (the pilot, a C3 variant) ----------------------------------------------


def test_f32_golden_rule_has_no_rounding_step(bundle):
    from pathlib import Path

    from sim_backend.bundle.manifest import load_bundle

    pilot = load_bundle(Path(bundle.path).parent / "smollm2-135m-pilot")
    g = G.load_golden(pilot.golden_file, pilot.logits_dtype)
    assert g.dtype == "f32" and g.logits.dtype == np.float32 and g.logits.shape == (49152,)
    want = g.expected
    i = int(np.argmax(np.abs(want)))
    near, far = want.copy(), want.copy()
    near[i] += 0.04 * np.sign(want[i])  # inside max_abs_error: F32 has no rounding step to add
    far[i] -= 0.06 * np.sign(want[i])
    rep = G.compare(g, near, 0.05)
    assert rep["ok"] and rep["dtype"] == "f32" and rep["n_differ"] == 1 and "BF16" not in rep["rule"]
    rep = G.compare(g, far, 0.05)
    assert not rep["ok"] and rep["n_mismatched"] == 1
    # the device's dtype must be the golden's: BF16 bits against an F32 golden are not compared
    rep = G.compare(g, G._f32_to_bf16_bits(want), 0.05)
    assert not rep["ok"] and rep["max_abs_error"] is None and "bf16" in rep["detail"] and "regenerate" in rep["detail"]


def test_f32_device_refuses_a_bf16_golden_file_typed(stored, bundle):
    with pytest.raises(G.GoldenFileError) as ei:
        G.load_golden(bundle.golden_file, "f32")
    assert ei.value.field == "logits" and "BF16 bits" in ei.value.message and "--write" in ei.value.message
    with pytest.raises(ValueError, match="unknown logits dtype"):
        G.load_golden(bundle.golden_file, "fp8")
