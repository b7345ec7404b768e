"""``calconsole bench step``: wall ms per decode step (in-process numerics vs the console's worker).

Only the shape of the report and the refusals are tested; the figures are wall time and never asserted.
"""

from __future__ import annotations

import json

from calconsole.bench import step as bench_step
from calconsole.cli import build_parser, main


def test_registered_under_bench():
    args = build_parser().parse_args(["bench", "step", "--json", "--mode", "worker", "--steps", "50"])
    assert args.func is bench_step.run and args.json and args.mode == "worker" and args.steps == 50


def test_cli_json_in_process(capsys):
    rc = main(["bench", "step", "--json", "--mode", "in-process", "--steps", "3", "--tokens-per-request", "3",
               "--context", "20"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and set(rep) == {"in-process", "unit"} and "wall ms per decode step" in rep["unit"]
    r = rep["in-process"]
    assert r["mode"] == "in-process" and r["steps"] == 3
    # 3 tokens per request: prefill + 2 decodes, one decode-to-decode gap each; three requests were needed
    assert r["requests"] == 3
    assert r["median_ms"] > 0 and r["p95_ms"] >= r["median_ms"] and r["process_cpu_median_ms"] >= 0
    assert 1 <= r["context_min"] <= r["context_max"]
    assert "token_ids" not in r


def test_cli_refuses_bad_arguments(capsys):
    for argv, name in ((["--steps", "0"], "--steps"), (["--context", "0"], "--context"),
                       (["--tokens-per-request", "1"], "--tokens-per-request")):
        assert main(["bench", "step", *argv]) == 2
        err = capsys.readouterr().err
        assert name in err and err.count("\n") == 1


def test_pilot_bundle_prints_simulated_time_beside_wall(capsys):
    from pathlib import Path

    pilot = Path(__file__).resolve().parents[2] / "sim_backend" / "bundles" / "smollm2-135m-pilot"
    rc = main(["bench", "step", "--bundle", str(pilot), "--mode", "in-process", "--steps", "2",
               "--tokens-per-request", "3", "--context", "20", "--prefill", "16"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| sim " in out and "prefill 16 tokens: wall" in out and "tok/s" in out
