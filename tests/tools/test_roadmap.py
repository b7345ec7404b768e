"""``calconsole bench roadmap``: record shape, status codes, answers and ranges on a tiny matrix
(no timing thresholds: figures are simulated and only their structure and ordering are checked)."""

from __future__ import annotations

import json

import pytest

from calconsole.cli import main
from sim_backend.planes import SLO
from sim_backend.tools.roadmap import RangeModel, Stage, answers

FIELDS = {"stage", "status", "mix", "clients", "requests_per_s", "tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms",
          "goodput", "ranges"}


def test_json_shape(capsys):
    rc = main(["bench", "roadmap", "--json", "--stages", "today,batch4,best+topk", "--mixes", "short",
               "--clients", "1,4", "--requests-per-client", "1", "--max-tokens", "4", "--range-samples", "2"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ranges_from"]["joint_drawn"] == 2 and 0 <= rep["ranges_from"]["joint_kept"] <= 2
    recs = rep["records"]
    assert [(r["stage"], r["clients"]) for r in recs] == [("today", 1), ("today", 4), ("batch4", 1), ("batch4", 4),
                                                           ("best+topk", 1), ("best+topk", 4)]
    for r in recs:
        assert FIELDS <= set(r)
        assert r["mix"] == "short" and r["finished"] == r["clients"] and r["failed"] == 0
        for k in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert set(r[k]) == {"p50", "p95", "p99"}
        lo, hi = r["ranges"]["tokens_per_s"]
        assert lo <= r["tokens_per_s"] <= hi
    assert {r["stage"]: r["status"] for r in recs} == {"today": "C0", "batch4": "C3", "best+topk": "C3"}
    assert rep["best_batch_stage"] == "batch4"
    assert max(r["batch_occupancy"] for r in recs if r["stage"] == "batch4") > 1
    a = rep["answers"]
    assert set(a) == {"today", "batch4", "best+topk"} and a["today"]["gain_over_today"]["short"] == 1.0
    assert set(a["batch4"]["tpot_slo_knee_clients"]) == {"short"}
    assert "SIMULATED" in rep["clock"]


@pytest.mark.parametrize("argv,fragment", [
    (["--stages", "tomorrow"], "--stages"), (["--clients", "3"], "--clients"), (["--mixes", ""], "--mixes"),
    (["--requests-per-client", "0"], "--requests-per-client"), (["--max-tokens", "1"], "--max-tokens"),
    (["--slo", "speed:3"], "SLO"), (["--range-samples", "-1"], "--range-samples"),
])
def test_bad_arguments_exit_2(capsys, argv, fragment):
    assert main(["bench", "roadmap", *argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err and err.count("\n") == 1


def test_answers_knee_and_ranges():
    def rec(stage, c, tps, p95):
        return {"stage": stage, "status": "C0", "mix": "short", "clients": c, "tokens_per_s": tps,
                "tpot_ms": {"p50": p95, "p95": p95, "p99": p95}, "ranges": {"tokens_per_s": [tps, tps]}}

    recs = [rec("today", 1, 50.0, 17.0), rec("today", 8, 50.0, 140.0), rec("today", 16, 50.0, 280.0),
            rec("batch8", 1, 50.0, 17.0), rec("batch8", 8, 90.0, 60.0), rec("batch8", 16, 100.0, 130.0)]
    a = answers(recs, SLO(tpot_ms=100.0))
    assert a["today"]["tpot_slo_knee_clients"]["short"] == 8
    assert a["batch8"]["tpot_slo_knee_clients"]["short"] == 16
    assert a["batch8"]["gain_over_today"]["short"] == pytest.approx(2.0)
    rm = RangeModel()
    assert rm.eff_lo < rm.eff_hi
    lo, hi = rm.factors(Stage("batch8", 8, True), 8.0, 200)
    assert lo < 1.0 < hi
    # a joint model slower than either first-order end widens the pessimistic side, and only it
    from sim_backend.model.costmodel import CostModel

    slow = CostModel.load().with_fitted(attn_vector_tflops=0.1, weight_stream_eff=0.6)
    wide = RangeModel(joint=[slow])
    lo2, hi2 = wide.factors(Stage("batch8", 8, True), 8.0, 200)
    assert lo2 < lo and hi2 == pytest.approx(hi)
