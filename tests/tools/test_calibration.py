"""Calibration against facts.md F7 (report §10) and MoE pricing rules."""

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.costmodel import CostModel
from sim_backend.model.families.moe_cost import expected_experts_touched, priced_experts_touched
from sim_backend.tools import calibration as cal
from sim_backend.tools import calibration_cases as cal_cases
from sim_backend.tools import calibration_fit as cal_fit
from sim_backend.tools.calibration_cases import run_calibration

SHAPE = ModelShape()
from sim_backend.model.opgraph import CATEGORIES as CATS  # noqa: E402


@pytest.fixture(scope="module")
def cases():
    return {c["name"]: c for c in run_calibration()}


def test_roles_are_honest(cases):
    """Fitted = what the fit uses (3 F7 points, ~2K/~4K/~40K); every other case is held out, predicted once."""
    assert {n for n, c in cases.items() if c["role"] == "fitted"} == set(cal_cases.FIT_CASES) == {
        "prefill_27_tok_s", "decode_246_tok_s", "e2e_27_prompt_246_decode", "decode_ctx_2k", "decode_ctx_4k",
        "decode_ctx_40k"}
    assert {n for n, c in cases.items() if c["role"] == "held-out"} == {
        "decode_ctx_short", "decode_ctx_8k_16k", "decode_ctx_33k", "prefill_rises_with_prompt_length",
        "decode_falls_with_context", "prefill_40960_data_moving"}
    # the report's single ~8K-16K row is ONE case, checked at both ends
    assert cases["decode_ctx_8k_16k"]["contexts"] == [8192, 16384] and len(cases["decode_ctx_8k_16k"][
        "simulated_ends"]) == 2
    assert all(c["mode"] == "timing-only" for c in cases.values())
    # only a band that misses can be explained (the mechanisms' documented limit); nothing else passes by text
    assert all(c["explained"] is None for c in cases.values() if c["ok"] or "band" not in c)


def test_f7_points_and_where_the_mechanisms_cannot_reach_the_bands(cases):
    """The three F7 points within +-3 %; the fitted bands as close as the stated mechanisms get (the
    best achievable, shown, not tuned to): every band miss is explained (the data need concavity,
    linear_bound), within its documented ceiling and no more than 1 point under it (the README's
    figures are the shipped ones, not stale)."""
    for name in ("prefill_27_tok_s", "decode_246_tok_s", "e2e_27_prompt_246_decode"):
        c = cases[name]
        assert c["measured"] is not None and abs(c["error_pct"]) <= 3.0 and c["ok"], c
    assert cases["prefill_27_tok_s"]["measured"] == 184.27
    assert cases["decode_246_tok_s"]["measured"] == 58.25
    assert cases["e2e_27_prompt_246_decode"]["measured"] == 4.41
    assert cases["e2e_27_prompt_246_decode"]["unit"] == "s"
    assert abs(cases["decode_ctx_4k"]["band_miss_pct"]) <= 1.0
    assert abs(cases["decode_ctx_2k"]["band_miss_pct"]) <= 8.0 and abs(cases["decode_ctx_40k"]["band_miss_pct"]) <= 8.0
    for c in cases.values():
        if "band" in c:
            assert c["ok"] == (c["band_miss_pct"] == 0.0)
            if not c["ok"]:
                ceiling = cal_cases.DOCUMENTED_BAND_MISSES[c["name"]]
                assert c["explained"] and ceiling - 1.0 <= abs(c["band_miss_pct"]) <= ceiling, c
                assert cal_cases.case_passes(c)
    assert set(cal_cases.DOCUMENTED_BAND_MISSES) == {n for n, c in cases.items() if "band" in c and not c["ok"]}
    assert cases["decode_ctx_33k"]["band"] == [10.5, 13.5] and cases["decode_ctx_33k"]["measured"] == 12.0
    assert cases["prefill_rises_with_prompt_length"]["ok"]
    assert cases["decode_falls_with_context"]["ok"]


def test_held_out_decode_error(cases):
    """The issue's criterion: RMS over the held-out decode cases (short, ~8K-16K at its middle, ~33K vs 12)
    <= 8 %; the short row and ~33K inside their bands; ~8K-16K inside at 8K and within 3 % of 20 at 16K."""
    s = cal_cases.summarise(list(cases.values()))["timing-only"]
    assert set(s["held_out_decode"]) == set(cal_cases.HELD_OUT_DECODE)
    assert s["held_out_decode_rms_pct"] <= 8.0
    held = [cases[n]["error_pct"] for n in cal_cases.HELD_OUT_DECODE]
    assert s["held_out_decode_rms_pct"] == pytest.approx(cal_cases.rms(held))
    assert cases["decode_ctx_short"]["ok"] and cases["decode_ctx_33k"]["ok"]
    lo8, lo16 = cases["decode_ctx_8k_16k"]["simulated_ends"]
    assert 20.0 <= lo8 <= 30.0 and lo16 >= 20.0 * 0.97
    assert s["data_moving_ok"]


def test_linear_bound_is_what_the_report_supports():
    """Data only: no line through the F7 decode run meets the fitted bands; the best misses ~2K and
    ~40K by ~2.75 % each, predicts ~16K just under 20 tok/s, and a 0.75 ms knee would be needed."""
    b = cal_cases.linear_bound()
    assert b["bands"] == ["decode_ctx_2k", "decode_ctx_4k", "decode_ctx_40k"] and not b["reachable"]
    assert b["t0_ms"] == pytest.approx(1e3 / 58.25) and b["c0"] == 149.5
    assert b["slope_us_per_token"] == pytest.approx(2.10, abs=0.01)
    assert b["worst_miss_pct"] == pytest.approx(2.75, abs=0.05)
    assert b["miss_pct"]["decode_ctx_2k"] == pytest.approx(2.75, abs=0.05)
    assert b["miss_pct"]["decode_ctx_40k"] == pytest.approx(-2.75, abs=0.05)
    assert b["miss_pct"]["decode_ctx_4k"] == 0.0 and b["miss_pct"]["decode_ctx_short"] == 0.0
    assert b["miss_pct"]["decode_ctx_8k_16k"] == pytest.approx(-2.5, abs=0.1)
    assert b["knee_ms"] == pytest.approx(0.75, abs=0.01)
    # the knee is enough: that offset from ~2K on puts every fitted band inside (at the LP's slope)
    s, k = b["knee_slope_us_per_token"], b["knee_ms"] + 1e-6
    for name in b["bands"]:
        (ctx,), (lo, hi) = cal_cases.band_contexts(name), cal_cases.BAND_RANGES[name]
        assert lo - 1e-6 <= 1e3 / (b["t0_ms"] + s * (ctx - b["c0"]) / 1e3 + k) <= hi + 1e-6, name
    # the F7 decode point anywhere within its +-3 % does not rescue a line (slow end: short row and 16K miss)
    slow = cal_cases.linear_bound(decode_tok_s=58.25 * 0.97)
    assert not slow["reachable"] and slow["knee_ms"] > 0.1
    assert slow["miss_pct"]["decode_ctx_8k_16k"] < 0 and slow["miss_pct"]["decode_ctx_short"] < 0
    assert cal_cases.linear_bound(decode_tok_s=58.25 * 1.03)["worst_miss_pct"] > b["worst_miss_pct"]
    # bands a line can meet: reachable, no knee, no miss
    easy = {"a": ((2048,), (40.0, 60.0)), "b": ((40900,), (5.0, 14.0))}
    e = cal_cases.linear_bound(band_table=easy)
    assert e["reachable"] and e["knee_ms"] == 0.0 and e["miss_pct"] == {"a": 0.0, "b": 0.0}


def test_explained_band_misses_are_only_the_documented_limit(cases):
    bound = cal_cases.linear_bound()
    c2k = dict(cases["decode_ctx_2k"])
    assert cal_cases.explain_band_miss(c2k, bound) == c2k["explained"] and "48.94" not in c2k["explained"]
    # beyond the documented ceiling: a failure
    def at(v):
        return {**c2k, "simulated": v, "simulated_ends": [v],
                "band_miss_pct": cal_cases.band_miss_pct("decode_ctx_2k", v)}

    assert cal_cases.explain_band_miss(at(50.0), bound) is None
    # at the other edge than the line leans to (2K too slow): a failure
    assert cal_cases.explain_band_miss(at(37.0), bound) is None
    # a band with no documented limit (the short row) and a bound a line meets explain nothing
    short = {**cases["decode_ctx_short"], "simulated_ends": [57.5], "band_miss_pct": -0.9}
    assert cal_cases.explain_band_miss(short, bound) is None
    assert cal_cases.explain_band_miss(c2k, {**bound, "reachable": True}) is None
    # a shipped model with the vector throughput moved: ~40K then misses on the fast side -> fails
    fast = {c["name"]: c for c in run_calibration(CostModel.load().with_fitted(attn_vector_tflops=0.6))}
    assert not fast["decode_ctx_40k"]["ok"] or not fast["decode_ctx_2k"]["ok"]
    assert not all(cal_cases.case_passes(c) for c in fast.values())


def test_mechanism_reach_fewer_partitions_is_nearer_the_line_never_inside():
    """The assumed attn_cores sets how convex split-KV makes short contexts: the fitted bands prefer the
    fewest partitions (the range's low end), which comes near the data-only line bound, never inside."""
    rows = {r["attn_cores"]: r for r in cal_fit.mechanism_reach(cores=(4, 16))}
    few, shipped = rows[4], rows[16]
    assert few["partitions"] == 2 and shipped["partitions"] == 8
    assert few["cost"] < shipped["cost"] and few["f7_worst_pct"] <= 3.0 and shipped["f7_worst_pct"] <= 3.0
    assert shipped["band_miss_pct"]["decode_ctx_2k"] == pytest.approx(6.4, abs=0.1)
    line = cal_cases.linear_bound()["worst_miss_pct"]
    for r in (few, shipped):
        assert max(abs(v) for v in r["band_miss_pct"].values()) >= line - 1e-6   # never better than the line
        assert r["band_miss_pct"]["decode_ctx_2k"] > 0 and r["band_miss_pct"]["decode_ctx_40k"] < 0
        assert r["tok_s_16k"] < 20.0


def test_protocol_checks(cases):
    checks = cal.protocol_checks(list(cases.values()))
    assert [c["ok"] for c in checks] == [True, True] and "RMS" in checks[1]["what"]
    conv = {"timing-only": {"starts": [{}] * 5, "converged": False, "at_edge": [], "spread_pct": {"x": 7.0}}}
    bad = cal.protocol_checks(list(cases.values()), conv)
    assert not bad[-1]["ok"] and "5 starts" in bad[-1]["detail"]
    edge = {"timing-only": {"starts": [{}] * 2, "converged": True, "at_edge": ["x"], "spread_pct": {"x": 0.1}}}
    e = cal.protocol_checks(list(cases.values()), edge)[-1]
    assert not e["ok"] and "too few to count" in e["detail"] and "at an edge: x" in e["detail"]
    failing = [{**cases["decode_ctx_33k"], "ok": False, "explained": None}]
    assert not cal.protocol_checks(failing)[0]["ok"]


def test_data_moving_case(cases):
    c = cases["prefill_40960_data_moving"]
    assert c["ok"] and abs(c["error_pct"]) <= cal_cases.DATA_MOVING_TOLERANCE_PCT
    assert [m["entries"] for m in c["measured"]] == [444_610, 444_608]
    assert all(chk["ok"] for chk in c["checks"]) and len(c["checks"]) == 5
    # the tolerance is the underived 1 KiB class plus the table's rounding, not slack
    one_kib_share = 75_968 * 1024 / 2**30 / 18.822 * 100
    assert one_kib_share < cal_cases.DATA_MOVING_TOLERANCE_PCT < one_kib_share + 0.05
    # a model whose KV block were 64 KiB would not reproduce the table's 32 KiB class
    other = cal_cases.data_moving_case(CostModel.load().with_fitted(kv_block_kib=64))
    assert not other["ok"]


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
    from sim_backend.tools.calibration_cases import decode_run_us, e2e_cost_model_us

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
        res = system.inference.generate(ChatRequest.from_prompt(ENGINE_PROMPT, max_tokens=8), timeout=30)
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
        res = system.inference.generate(ChatRequest.from_prompt(ENGINE_PROMPT, max_tokens=8), timeout=30)
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
        assert c["role"] == "consistency"   # the FITTED points through the engine: a check, not a prediction
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
            system.inference.generate(req, timeout=60)
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


# --- the fit: shipped values, convergence from spread starts ---------------------

@pytest.fixture(scope="module")
def fit():
    return cal_fit.fit_parameters(full=True)


def test_shipped_yaml_is_the_fit(fit):
    """The YAML's fitted values are what fit_parameters gives (rounded by hand), none at a range edge."""
    cm = CostModel.load()
    assert set(fit["params"]) == set(cal_fit.FIT_FREE)
    for k, v in fit["params"].items():
        assert cm.hw.fitted[k] == pytest.approx(v, rel=0.02, abs=0.01), k
        lo, hi = cm.hw.ranges[k]
        assert lo < v < hi and fit["at_edge"] == [], (k, v)
    # the fit used the fitted cases only
    assert set(fit["residuals"]) == set(cal_cases.FIT_CASES)


def test_fit_converges_from_a_start_where_the_vector_term_is_hidden():
    """Two spread starts (the first puts attn_vector_tflops at 3 TFLOPS, where decode attention is
    DMA-bound and the vector throughput has no gradient): both reach the same parameters (+-5 %).
    ``bench calibrate`` runs the full check from 6 starts."""
    cv = cal_fit.convergence(starts=2)
    assert len(cv["starts"]) == 2 and cv["starts"][0]["start"]["attn_vector_tflops"] > 2.0
    assert cv["converged"] and cv["at_edge"] == [], cv["spread_pct"]
    assert all(v <= cal_fit.CONVERGENCE_PCT for v in cv["spread_pct"].values())
    with pytest.raises(ValueError):
        cal_fit.convergence(starts=0)
    with pytest.raises(ValueError):
        run_calibration(mode="numeric")  # numeric mode needs the router's experts


# --- numeric mode (the console's default) on the three F7 points ------------------

def test_numeric_mode_cost_model_meets_f7():
    touched = cal.router_touched_27()
    cases = {c["name"]: c for c in run_calibration(mode="numeric", touched_27=touched)}
    for name in ("prefill_27_tok_s", "decode_246_tok_s", "e2e_27_prompt_246_decode"):
        c = cases[name]
        assert c["mode"] == "numeric" and abs(c["error_pct"]) <= cal_cases.TOLERANCE_PCT, c


def test_measured_host_time_explains_only_the_miss_its_extra_host_work_accounts_for():
    # bench calibrate --host-time measured exited 1 here: numeric decode -3.86 % (±3 %) with this host
    # booking 0.756 ms a token against the real host's 0.227 (README: "decode then reads about 4 % slower")
    def case(name, err, unit="tok/s"):
        return {"name": name, "unit": unit, "error_pct": err, "ok": abs(err) <= cal_cases.TOLERANCE_PCT,
                "explained": None}

    cases = [case("decode", -3.86), case("e2e", 2.95, "s"), case("faster", 3.5), case("far", -9.0),
             case("e2e_faster", -3.5, "s")]
    cal.explain_measured_host_misses(cases, extra_host_ms=130.0, e2e_ms=4540.0)  # 2.9 % of the request
    got = {c["name"]: c["explained"] for c in cases}
    assert got["decode"] and "130.0 ms" in got["decode"] and "2.9%" in got["decode"]
    assert got["e2e"] is None  # within tolerance: nothing to explain
    assert got["faster"] is None and got["e2e_faster"] is None  # reads faster: not the host's doing
    assert got["far"] is None  # 9 % slower is more than 3 % + 2.9 %
    assert cal_cases.case_passes(cases[0]) and not cal_cases.case_passes(cases[3])
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
        res = system.inference.generate(ChatRequest.from_prompt("hi", max_tokens=2), timeout=30)
    assert res.timings.host_ms["tokenize"] > 0 and res.timings.queue_ms == 0.0
