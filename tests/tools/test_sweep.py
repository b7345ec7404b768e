"""Prompt-length sweep with joint ranges (sim_backend/tools/sweep.py, `calconsole bench sweep`)."""

from __future__ import annotations

import json

import pytest

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.costmodel import CostModel
from sim_backend.tools import sweep as sw

SHAPE = ModelShape()


@pytest.fixture(scope="module")
def cm():
    return CostModel.load()


SAMPLES = 6   # a few joint draws (one refit each, ~2 s); `bench sweep` draws 32


@pytest.fixture(scope="module")
def small(cm):
    return sw.sweep(cm, prompts=(27, 2049, 40900), contexts=(27, 2048, 16384), samples=SAMPLES)


def test_ttft_is_the_engine_chunks_and_a_leftover_token_is_a_decode_step(cm):
    expect = (cm.price_step(SHAPE, "prefill", 2048, 0).total_us + cm.price_step(SHAPE, "decode", 1, 2048).total_us)
    assert sw.ttft_us(cm, 2049) == pytest.approx(expect, rel=1e-12)
    assert sw.ttft_us(cm, 27) == cm.price_step(SHAPE, "prefill", 27, 0).total_us
    assert sw.ttft_us(cm, 1) == cm.price_step(SHAPE, "decode", 1, 0).total_us
    with pytest.raises(ValueError):
        sw.ttft_us(cm, 0)
    with pytest.raises(ValueError):
        sw.ttft_us(cm, 40961)


def test_every_figure_has_a_range_around_its_value(small):
    kept = {"shipped"} | {d["name"] for d in small["joint"]["draws"] if d["kept"]}
    rows = [r["ttft_ms"] for r in small["prompts"]] + [r["prefill_tok_s"] for r in small["prompts"]] + [
        r["decode_tok_s"] for r in small["contexts"]]
    for fig in rows:
        assert fig["low"] <= fig["value"] <= fig["high"]
        assert {fig["low_by"], fig["high_by"]} <= kept
    assert small["joint"]["drawn"] == SAMPLES and small["joint"]["kept"] == len(kept) - 1
    # the report's band rides along where it gives one (facts.md F7)
    bands = {r["context"]: r["band"] for r in small["contexts"]}
    assert bands[27] is None and bands[2048][:2] == [38.0, 46.0] and bands[16384][:2] == [20.0, 30.0]
    json.dumps(small)


def test_draws_move_assumed_parameters_and_hardware_peaks_jointly_inside_their_ranges(cm, small):
    from sim_backend.tools.calibration_cases import (
        FIT_CASES,
        POINT_CASES,
        TOLERANCE_PCT,
        case_error_pct,
        evaluate_cases,
    )

    hw_r, f_r = cm.hw.hardware_ranges, cm.hw.ranges
    assert {"dram_bw_gbps", "peak_fp16_tflops", "sram_bw_gbps", "d2d_link_gbps", "pcie_gbps"} <= set(hw_r)
    draws = small["joint"]["draws"]
    for d in draws:
        for key, v in d["values"].items():
            sec, k = key.split(".")
            lo, hi = (hw_r if sec == "hardware" else f_r)[k]
            assert lo <= v <= hi, (key, v)
        # several parameters move at once in every draw (not one at a time)
        assert sum(v != (cm.hw.hardware if k.startswith("hardware") else cm.hw.fitted)[k.split(".")[1]]
                   for k, v in d["values"].items()) >= 10
        assert d["kept"] == (d["why"] is None) and (d["kept"] or d["rule"])
    # a kept draw's refit reproduces the three F7 points within the tolerance
    d = next(d for d in draws if d["kept"])
    hw = {k.split(".")[1]: v for k, v in d["values"].items() if k.startswith("hardware")}
    fx = {k.split(".")[1]: (int(v) if isinstance(cm.hw.fitted[k.split(".")[1]], int) else v)
          for k, v in d["values"].items() if k.startswith("fitted")}
    m = cm.with_hardware(**hw).with_fitted(**fx, **d["fit"])
    sims = evaluate_cases(m, names=FIT_CASES)
    assert all(abs(case_error_pct(c, sims[c])) <= TOLERANCE_PCT for c in POINT_CASES)


def test_long_prompt_range_is_wide_and_the_measured_point_is_pinned(small):
    far = next(r for r in small["prompts"] if r["prompt_tokens"] == 40900)["ttft_ms"]
    # no long-prefill measurement: 40,900 tokens rest on assumed parameters, a wide range
    assert far["high"] > 1.2 * far["low"]
    # the measured 27-token point is pinned: every kept draw is refitted to it
    pt = next(r for r in small["prompts"] if r["prompt_tokens"] == 27)["prefill_tok_s"]
    assert pt["high"] / pt["low"] < 1.06
    with pytest.raises(ValueError):
        sw.joint_models(CostModel.load(), 0)


def _run(capsys, *argv):
    from calconsole.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_sweep_json_table_and_plot(capsys, monkeypatch, small):
    monkeypatch.setattr(sw, "sweep", lambda cm, **kw: small)
    code, out, _ = _run(capsys, "bench", "sweep", "--json")
    assert code == 0 and json.loads(out)["prompts"][-1]["ttft_ms"]["high"] == small["prompts"][-1]["ttft_ms"]["high"]
    code, out, _ = _run(capsys, "bench", "sweep", "--plot")
    assert code == 0
    assert "[low .. high]" in out and "40900" in out and f"joint sample: {SAMPLES} draws" in out
    assert "38-46 (~2K)" in out
    assert "TTFT vs prompt length (simulated)" in out and "decode rate vs context (simulated)" in out
    assert "\x1b[" not in out   # not a terminal: plain text


def test_cli_sweep_bad_hardware_is_one_line_exit_2(capsys, tmp_path):
    p = tmp_path / "hw.yaml"
    p.write_text("hardware: 1\n")
    code, _, err = _run(capsys, "bench", "sweep", "--hardware", str(p))
    assert code == 2 and len(err.strip().splitlines()) == 1


def test_cli_sweep_bad_samples_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        _run(capsys, "bench", "sweep", "--samples", "0")
    assert e.value.code == 2
