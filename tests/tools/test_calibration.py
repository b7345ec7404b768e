"""Calibration against facts.md F7 (report §10) and MoE pricing rules."""

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.costmodel import CostModel, expected_experts_touched, priced_experts_touched
from sim_backend.tools import calibration as cal
from sim_backend.tools.calibration import run_calibration

SHAPE = ModelShape()
from sim_backend.model.opgraph import CATEGORIES as CATS  # noqa: E402


@pytest.fixture(scope="module")
def cases():
    return {c["name"]: c for c in run_calibration()}


def test_every_case_ok(cases):
    """Every case is ok, except a band miss the report explains, and only by a little."""
    bad = {n: c for n, c in cases.items() if not c["ok"]}
    assert set(bad) <= set(cal.EXPLAINED_BANDS), bad
    for c in bad.values():
        assert c["explained"] and 0 < abs(c["band_miss_pct"]) <= cal.EXPLAINED_MISS_PCT
    assert all(c["explained"] is None for c in cases.values() if c["ok"])
    assert all(c["mode"] == "timing-only" for c in cases.values())
    assert {n for n, c in cases.items() if c["role"] == "fitted"} == set(cal.FIT_CASES)


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
        assert c["measured"] is None and (c["band"][0] <= c["simulated"] <= c["band"][1] or c["explained"])
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


def _timing_only_system(numerics: bool = False, **kw):
    from sim_backend.compose import build_system
    from sim_backend.serving.hosttime import ScriptedHostTimer

    return build_system(numerics=numerics, maintenance=False, n_slots=1, host_timer=ScriptedHostTimer(0.0), **kw)


def test_engine_path_measured_books_only_measured_host_work():
    """host_time="measured" with host work scripted to 0: engine E2E == the sum of its device steps exactly."""
    from sim_backend.model.trace import StepRecorder
    from sim_backend.planes import ChatRequest
    from sim_backend.tools.calibration import ENGINE_PROMPT

    with _timing_only_system(host_time="measured") as system:
        rec = StepRecorder()
        system.board.add_listener(rec)
        res = system.engine.generate(ChatRequest.from_prompt(ENGINE_PROMPT, max_tokens=8), timeout=30)
        steps = rec.wait_for(8)
    assert [s.kind for s in steps] == ["prefill"] + ["decode"] * 7   # 8 tokens: the 8th is never fed back
    assert steps[0].n_tokens == 27 and [s.past_len for s in steps[1:]] == list(range(27, 34))
    assert res.timings.e2e_ms * 1e3 == pytest.approx(sum(s.sim_us for s in steps), rel=1e-12)
    assert sum(res.timings.host_ms.values()) == 0.0
    assert res.timings.host_time == "measured" and res.timings.host_booked_ms == 0.0


@pytest.mark.parametrize("host_step_us", [0.0, 700.0])
def test_engine_path_modeled_books_the_allowance_per_sampled_token_whatever_this_host_does(host_step_us):
    """host_time="modeled" (the default): E2E == device steps + 8 x the fitted allowance, exactly,
    however much host work this machine measures (scripted 0 or 700 µs per reading)."""
    from sim_backend.compose import build_system
    from sim_backend.model.costmodel import CostModel
    from sim_backend.model.trace import StepRecorder
    from sim_backend.planes import ChatRequest
    from sim_backend.serving.hosttime import ScriptedHostTimer
    from sim_backend.tools.calibration import ENGINE_PROMPT

    allowance_ms = CostModel.load().host_overhead_ms_per_token
    with build_system(numerics=False, maintenance=False, n_slots=1,
                      host_timer=ScriptedHostTimer(host_step_us)) as system:
        rec = StepRecorder()
        system.board.add_listener(rec)
        res = system.engine.generate(ChatRequest.from_prompt(ENGINE_PROMPT, max_tokens=8), timeout=30)
        steps = rec.wait_for(8)
    t = res.timings
    assert t.host_time == "modeled"
    assert t.host_booked_ms == pytest.approx(8 * allowance_ms, rel=1e-12)
    assert t.e2e_ms * 1e3 == pytest.approx(sum(s.sim_us for s in steps) + 8 * allowance_ms * 1e3, rel=1e-12)
    # the measured parts are still reported, and differ with the scripted host
    assert (sum(t.host_ms.values()) > 0.0) == (host_step_us > 0.0)


def test_unknown_host_time_is_refused_before_anything_starts():
    import threading

    from sim_backend.compose import build_system

    before = threading.active_count()
    with pytest.raises(ValueError, match="host time must be one of modeled, measured"):
        build_system(numerics=False, maintenance=False, host_time="wall")
    assert threading.active_count() == before


@pytest.mark.parametrize("numerics", [False, True], ids=["timing-only", "numeric"])
def test_engine_cases_match_f7_in_both_modes(numerics):
    """The F7 request through the engine, modeled host time (the default): within 3 % in both modes,
    on any machine (the measured host work is reported beside, not booked)."""
    from sim_backend.compose import build_system
    from sim_backend.tools.calibration import run_engine_cases

    with build_system(numerics=numerics, maintenance=False, n_slots=1) as system:
        cases = {c["name"]: c for c in run_engine_cases(system)}
    assert set(cases) == {"engine_e2e_27_prompt_246_decode", "engine_prefill_27_tok_s", "engine_decode_246_tok_s"}
    for c in cases.values():
        assert c["ok"] and abs(c["error_pct"]) <= 3.0, c
        assert c["prompt_n"] == 27 and c["predicted_n"] == 246 and c["numerics"] is numerics
        assert c["host_time"] == "modeled" and c["mode"] == ("numeric" if numerics else "timing-only")
    assert cases["engine_e2e_27_prompt_246_decode"]["unit"] == "s"
    assert cases["engine_e2e_27_prompt_246_decode"]["measured"] == 4.41


# --- timing-only vs numeric pricing --------------------------------------------

def test_timing_only_and_numeric_price_the_same_routing_statistics_identically():
    """The device prices both modes with one function; numeric mode prices the router's
    per-layer pattern brought to the trained-router mean (priced_experts_touched)."""
    from sim_backend.compose import build_system
    from sim_backend.model.trace import StepRecorder
    from sim_backend.planes import ChatRequest
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
    # numeric: the router's actual distinct experts per layer are reported, ints in [8, 128] ...
    touched = n_pre.experts_touched
    assert len(touched) == 48 and all(isinstance(v, int) and 8 <= v <= 128 for v in touched)
    assert n_dec.experts_touched is not None and all(v == 8 for v in n_dec.experts_touched)
    # ... the synthetic router touches fewer than a trained one would (that is why they are rescaled)
    assert np.mean(touched) < expect[0] - 5
    priced = priced_experts_touched(touched, 27)
    assert np.mean(priced) == pytest.approx(expect[0], rel=1e-9)
    # the per-layer pattern is kept: the same order of layers
    assert (np.argsort(priced, kind="stable") == np.argsort(np.asarray(touched), kind="stable")).all()
    for step, tt in ((n_pre, priced), (n_dec, None)):
        again = cm.price_step(SHAPE, step.kind, step.n_tokens, step.past_len, experts_touched=tt)
        assert again.total_us == step.cost.total_us
        np.testing.assert_array_equal(again.op_us, step.cost.op_us)
        np.testing.assert_array_equal(again.layer_chip_category_us, step.cost.layer_chip_category_us)
    # the per-layer MoE time of a numeric prefill differs between layers (the router's pattern) ...
    moe = CATS.index("moe_dense_group")
    per_layer = n_pre.cost.layer_chip_category_us[:, 0, moe]
    assert per_layer.max() > 1.05 * per_layer.min()
    # ... while the step as a whole is priced like the expectation (F7 holds in both modes)
    assert n_pre.cost.total_us == pytest.approx(t_pre.cost.total_us, rel=5e-3)
    # decode: 8 distinct experts == expectation for 1 token, so both modes agree
    assert n_dec.cost.total_us == pytest.approx(t_dec.cost.total_us, rel=1e-12)


def test_priced_experts_touched_rules():
    assert list(priced_experts_touched([8] * 48, 1)) == [8.0] * 48
    out = priced_experts_touched([60, 90], 27)
    assert out.mean() == pytest.approx(expected_experts_touched(27)) and out[1] == pytest.approx(1.5 * out[0])
    assert priced_experts_touched([127, 1], 27).max() == 128.0   # clipped to the expert count
    with pytest.raises(ValueError):
        priced_experts_touched([], 27)
    with pytest.raises(ValueError):
        priced_experts_touched([0, 5], 27)


# --- held-out validation (leave-one-out) ----------------------------------------

@pytest.fixture(scope="module")
def loo():
    return cal.leave_one_out()


def _band_halfwidth_rms() -> float:
    import math

    return 100 * cal.rms([0.5 * math.log(hi / lo) for _, _, (lo, hi) in cal.DECODE_BANDS])


def test_leave_one_out_predicts_the_decode_cases(loo):
    """Held-out bounds, and why:

    * the 246-token decode point is predicted from the six bands alone within the F7
      tolerance (3 %): the bands carry the context-independent decode time;
    * the band cases' held-out RMS (vs their geometric centres) is below the RMS of the
      bands' own half-widths (18.0 %): on average a held-out band is predicted no worse
      than "somewhere inside the band" would be; a model that misses the trend fails this;
    * at least 4 of the 6 held-out band predictions land inside their band.
    """
    assert set(loo) == set(cal.FIT_CASES) | {"_params"}
    assert abs(loo["decode_246_tok_s"]["loo_error_pct"]) <= cal.TOLERANCE_PCT
    bands = [loo[n] for n, _, _ in cal.DECODE_BANDS]
    assert cal.rms([b["loo_error_pct"] for b in bands]) < _band_halfwidth_rms()
    assert sum(b["in_band"] for b in bands) >= 4
    # the E2E case is predicted with the host allowance at the middle of its range
    assert abs(loo["e2e_27_prompt_246_decode"]["loo_error_pct"]) <= cal.TOLERANCE_PCT


def test_refits_stay_in_their_physical_ranges_and_the_prefill_is_not_predictable(loo):
    ranges = CostModel.load().hw.ranges
    for p in loo["_params"].values():
        for k, v in p.items():
            lo, hi = ranges[k]
            assert lo <= v <= hi, (k, v)
    # without its only point, fp16_compute_eff is identified only by the E2E case (which has the
    # host allowance to trade against) and the prior: the held-out prefill error is large, and it
    # is reported, not hidden.  A second prefill measurement would make it predictable.
    assert loo["prefill_27_tok_s"]["loo_error_pct"] > 10


def test_shipped_yaml_is_the_fit():
    """The YAML's fitted values are what fit_parameters gives (rounded by hand)."""
    cm = CostModel.load()
    fit = cal.fit_parameters(cm)
    for k, v in fit.items():
        assert cm.hw.fitted[k] == pytest.approx(v, rel=0.02, abs=0.01), k


def test_run_calibration_carries_the_held_out_figures(loo):
    cases = run_calibration(loo=loo)
    fitted = [c for c in cases if c["role"] == "fitted"]
    assert len(fitted) == 9 and all({"loo_simulated", "loo_error_pct"} <= c.keys() for c in fitted)
    assert all("loo_in_band" in c for c in fitted if "band" in c)
    # every band that lands outside itself when held out says why (and only those do)
    for c in fitted:
        if "band" in c:
            assert bool(c["loo_explained"]) == (not c["loo_in_band"]), c["name"]
    s = cal.summarise(cases)["timing-only"]
    assert s["loo_rms_pct"] == pytest.approx(cal.rms([c["loo_error_pct"] for c in fitted]))
    assert s["loo_bands_in_band"].endswith("/6")
    with pytest.raises(ValueError):
        run_calibration(mode="numeric")  # numeric mode needs the router's experts


# --- numeric mode (the console's default) on the three F7 points ------------------

def test_numeric_mode_cost_model_meets_f7():
    touched = cal.router_touched_27()
    cases = {c["name"]: c for c in run_calibration(mode="numeric", touched_27=touched)}
    for name in ("prefill_27_tok_s", "decode_246_tok_s", "e2e_27_prompt_246_decode"):
        c = cases[name]
        assert c["mode"] == "numeric" and abs(c["error_pct"]) <= cal.TOLERANCE_PCT, c


def test_measured_host_time_explains_only_the_miss_its_extra_host_work_accounts_for():
    # bench calibrate --host-time measured exited 1 here: numeric decode -3.86 % (±3 %) with this host
    # booking 0.756 ms a token against the real host's 0.227 (README: "decode then reads about 4 % slower")
    def case(name, err, unit="tok/s"):
        return {"name": name, "unit": unit, "error_pct": err, "ok": abs(err) <= cal.TOLERANCE_PCT, "explained": None}

    cases = [case("decode", -3.86), case("e2e", 2.95, "s"), case("faster", 3.5), case("far", -9.0),
             case("e2e_faster", -3.5, "s")]
    cal.explain_measured_host_misses(cases, extra_host_ms=130.0, e2e_ms=4540.0)  # 2.9 % of the request
    got = {c["name"]: c["explained"] for c in cases}
    assert got["decode"] and "130.0 ms" in got["decode"] and "2.9%" in got["decode"]
    assert got["e2e"] is None  # within tolerance: nothing to explain
    assert got["faster"] is None and got["e2e_faster"] is None  # reads faster: not the host's doing
    assert got["far"] is None  # 9 % slower is more than 3 % + 2.9 %
    assert cal.case_passes(cases[0]) and not cal.case_passes(cases[3])
    quick = [case("decode", -3.86)]
    cal.explain_measured_host_misses(quick, extra_host_ms=-20.0, e2e_ms=4400.0)  # a host faster than the real one
    assert quick[0]["explained"] is None


def test_queue_time_is_waiting_for_a_slot_not_tokenising():
    """An idle engine assigns a slot at once: queue time 0 even when tokenising is booked (measured mode)."""
    from sim_backend.compose import build_system
    from sim_backend.planes import ChatRequest
    from sim_backend.serving.hosttime import ScriptedHostTimer

    with build_system(numerics=False, maintenance=False, n_slots=1, host_time="measured",
                      host_timer=ScriptedHostTimer(700.0)) as system:
        res = system.engine.generate(ChatRequest.from_prompt("hi", max_tokens=2), timeout=30)
    assert res.timings.host_ms["tokenize"] > 0 and res.timings.queue_ms == 0.0
