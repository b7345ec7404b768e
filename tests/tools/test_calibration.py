"""Calibration against FACTS F7 (report §10) and MoE pricing rules."""

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.costmodel import CostModel, expected_experts_touched
from sim_backend.tools.calibration import run_calibration

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


# --- host time is counted once in each path ----------------------------------

def test_price_step_never_includes_the_host_allowance():
    cm = CostModel.load()
    other = cm.with_fitted(host_overhead_ms_per_token=5.0)
    for kind, n, past in (("prefill", 27, 0), ("decode", 1, 27)):
        assert cm.price_step(SHAPE, kind, n, past).total_us == other.price_step(SHAPE, kind, n, past).total_us


def test_cost_model_e2e_is_prefill_245_decodes_and_the_allowance():
    from sim_backend.tools.calibration import decode_run_us, e2e_cost_model_us

    cm = CostModel.load()
    device = cm.price_step(SHAPE, "prefill", 27, 0).total_us + decode_run_us(cm, 27, 245)
    assert e2e_cost_model_us(cm.with_fitted(host_overhead_ms_per_token=0.0)) == pytest.approx(device)
    assert e2e_cost_model_us(cm) == pytest.approx(device + cm.host_overhead_ms_per_token * 1e3 * 246)


def _timing_only_system(**kw):
    from sim_backend.planes.system import build_system
    from sim_backend.serving.hosttime import ScriptedHostTimer

    return build_system(numerics=False, maintenance=False, n_slots=1, host_timer=ScriptedHostTimer(0.0), **kw)


def test_engine_path_adds_no_host_allowance():
    """With host work scripted to 0, engine E2E == the sum of its device steps exactly."""
    from sim_backend.model.trace import StepRecorder
    from sim_backend.serving.api import ChatRequest
    from sim_backend.tools.calibration import ENGINE_PROMPT

    with _timing_only_system() as system:
        rec = StepRecorder()
        system.board.add_listener(rec)
        res = system.engine.generate(ChatRequest.from_prompt(ENGINE_PROMPT, max_tokens=8), timeout=30)
        steps = rec.wait_for(8)
    assert [s.kind for s in steps] == ["prefill"] + ["decode"] * 7   # 8 tokens: the 8th is never fed back
    assert steps[0].n_tokens == 27 and [s.past_len for s in steps[1:]] == list(range(27, 34))
    assert res.timings.e2e_ms * 1e3 == pytest.approx(sum(s.sim_us for s in steps), rel=1e-12)
    assert sum(res.timings.host_ms.values()) == 0.0


def test_engine_cases_match_f7():
    """The F7 request through the engine (timing-only, host work scripted to 0: deterministic)."""
    from sim_backend.tools.calibration import run_engine_cases

    with _timing_only_system() as system:
        cases = {c["name"]: c for c in run_engine_cases(system)}
    assert set(cases) == {"engine_e2e_27_prompt_246_decode", "engine_prefill_27_tok_s", "engine_decode_246_tok_s"}
    for c in cases.values():
        assert c["ok"] and abs(c["error_pct"]) <= 3.0, c
        assert c["prompt_n"] == 27 and c["predicted_n"] == 246 and c["numerics"] is False
    assert cases["engine_e2e_27_prompt_246_decode"]["unit"] == "s"
    assert cases["engine_e2e_27_prompt_246_decode"]["measured"] == 4.41


# --- timing-only vs numeric pricing --------------------------------------------

def test_timing_only_and_numeric_price_the_same_routing_statistics_identically():
    """The device prices both modes with one function; only experts_touched differs."""
    from sim_backend.model.trace import StepRecorder
    from sim_backend.planes.system import build_system
    from sim_backend.serving.api import ChatRequest
    from sim_backend.tools.calibration import ENGINE_PROMPT

    req = ChatRequest.from_prompt(ENGINE_PROMPT, max_tokens=2)
    results = {}
    for numerics in (False, True):
        with build_system(numerics=numerics, maintenance=False, n_slots=1) as system:
            rec = StepRecorder()
            system.board.add_listener(rec)
            system.engine.generate(req, timeout=60)
            results[numerics] = rec.wait_for(2)
    cm = CostModel.load()
    t_pre, t_dec = results[False]
    n_pre, n_dec = results[True]
    assert t_pre.experts_touched is None and t_pre.n_tokens == n_pre.n_tokens == 27
    # timing-only == the expectation, given as explicit routing statistics
    expect = [expected_experts_touched(27)] * 48
    assert t_pre.cost.total_us == cm.price_step(SHAPE, "prefill", 27, 0, experts_touched=expect).total_us
    # numeric: the router's actual distinct experts per layer, ints in [8, 128]
    touched = n_pre.experts_touched
    assert len(touched) == 48 and all(isinstance(v, int) and 8 <= v <= 128 for v in touched)
    assert n_dec.experts_touched is not None and all(v == 8 for v in n_dec.experts_touched)
    # same routing statistics -> same price, exactly (every array too)
    for step in (n_pre, n_dec):
        again = cm.price_step(SHAPE, step.kind, step.n_tokens, step.past_len,
                              experts_touched=list(step.experts_touched))
        assert again.total_us == step.cost.total_us
        np.testing.assert_array_equal(again.op_us, step.cost.op_us)
        np.testing.assert_array_equal(again.layer_chip_category_us, step.cost.layer_chip_category_us)
    # and the actual routing is priced differently from the expectation
    assert touched != tuple([round(expect[0])] * 48)
    assert n_pre.cost.total_us != t_pre.cost.total_us
    # decode: 8 distinct experts == expectation for 1 token, so both modes agree
    assert n_dec.cost.total_us == pytest.approx(t_dec.cost.total_us, rel=1e-12)
