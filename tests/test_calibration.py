"""Calibration against FACTS F7 (report §10) and MoE pricing rules."""

import numpy as np
import pytest

from sim_backend.calibration import run_calibration
from sim_backend.config import ModelShape
from sim_backend.costmodel import CostModel, expected_experts_touched

SHAPE = ModelShape()


@pytest.fixture(scope="module")
def cases():
    return {c["name"]: c for c in run_calibration()}


def test_every_case_ok(cases):
    bad = {n: c for n, c in cases.items() if not c["ok"]}
    assert not bad, bad


def test_case_set_and_fields(cases):
    for name in ("prefill_27_tok_s", "decode_246_tok_s", "e2e_27_prompt_246_decode"):
        c = cases[name]
        assert c["measured"] is not None and abs(c["error_pct"]) <= 3.0
    assert cases["prefill_27_tok_s"]["measured"] == 184.27
    assert cases["decode_246_tok_s"]["measured"] == 58.25
    assert cases["e2e_27_prompt_246_decode"]["measured"] == 4.41
    assert cases["e2e_27_prompt_246_decode"]["unit"] == "s"
    bands = [c for c in cases.values() if "band" in c]
    assert len(bands) == 6
    for c in bands:
        assert c["measured"] is None and c["band"][0] <= c["simulated"] <= c["band"][1]
    assert cases["decode_ctx_33k"]["band"] == [10.5, 13.5]
    assert cases["prefill_rises_with_prompt_length"]["ok"]
    assert cases["decode_falls_with_context"]["ok"]


def test_expected_experts_touched():
    assert expected_experts_touched(27) == pytest.approx(105.6, abs=0.1)
    assert expected_experts_touched(1) == pytest.approx(8.0)
    assert expected_experts_touched(4096) == pytest.approx(128.0, abs=1e-6)


def test_actual_experts_touched_change_the_time():
    cm = CostModel.load()
    default = cm.price_step(SHAPE, "prefill", 27, 0)
    few = cm.price_step(SHAPE, "prefill", 27, 0, experts_touched=[40] * 48)
    many = cm.price_step(SHAPE, "prefill", 27, 0, experts_touched=[128] * 48)
    assert few.total_us < default.total_us < many.total_us
    # one layer with more experts: only that layer's MoE time changes
    touched = np.full(48, 100)
    touched[7] = 128
    c = cm.price_step(SHAPE, "prefill", 27, 0, experts_touched=touched)
    base = cm.price_step(SHAPE, "prefill", 27, 0, experts_touched=np.full(48, 100))
    diff = c.layer_chip_us - base.layer_chip_us
    assert (diff[7] > 0).all() and np.allclose(np.delete(diff, 7, axis=0), 0)
    # decode with the router's 8 distinct experts equals the expectation
    d = cm.price_step(SHAPE, "decode", 1, 10, experts_touched=[8] * 48)
    assert d.total_us == pytest.approx(cm.price_step(SHAPE, "decode", 1, 10).total_us)


def test_lm_head_share_of_decode_bytes():
    c = CostModel.load().price_step(SHAPE, "decode", 1, 27)
    share = c.dram_bytes["lm_head"] / sum(c.dram_bytes.values())
    assert 0.10 <= share <= 0.20   # STYLE.md: ~15% of decode bytes
