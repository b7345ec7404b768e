"""``calconsole bench overlap``: serial vs ping/pong overlapped, measured in one run.

Figures are compared on the SIMULATED clock with scripted host work (deterministic), never on wall time.
"""

from __future__ import annotations

import json

import pytest

from calconsole.bench import overlap as bench_overlap
from calconsole.bench.overlap import measure_overlap
from calconsole.cli import build_parser, main
from sim_backend.serving.hosttime import ScriptedHostTimer


def test_registered_under_bench():
    args = build_parser().parse_args(["bench", "overlap", "--json", "--requests", "4"])
    assert args.func is bench_overlap.run and args.json and args.requests == 4


def test_overlap_hides_host_work_on_the_simulated_clock():
    # 300 us per host-timer reading: a few ms of host work per step, booked on the simulated clock
    rep = measure_overlap(n_requests=2, max_tokens=8, numerics=False,
                          host_timer_factory=lambda: ScriptedHostTimer(300.0))
    s, o = rep["serial"], rep["overlapped"]
    assert (s["max_inflight"], o["max_inflight"]) == (1, 2)
    assert rep["same_tokens"] and s["tokens"] == o["tokens"] == 16
    # same device work both ways (the same step prices, summed in another order: equal to rounding)
    assert s["device_s"] == pytest.approx(o["device_s"], rel=1e-12)
    assert s["host_s"] > 0
    assert o["sim_s"] < s["sim_s"]  # host work overlapped with the other request's device steps
    assert 1.0 < rep["gain"]["tokens_per_s"] <= rep["bound"] * 1.001
    assert rep["gain"]["requests_per_s"] == rep["gain"]["tokens_per_s"]


def test_cli_json(capsys):
    rc = main(["bench", "overlap", "--json", "--timing-only", "--requests", "2", "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    rep = json.loads(out)
    for mode in ("serial", "overlapped"):
        m = rep[mode]
        assert m["requests_per_s"] > 0 and m["tokens_per_s"] > 0
        assert m["wall_requests_per_s"] > 0 and m["wall_tokens_per_s"] > 0
        assert m["requests"] == 2 and m["tokens"] == 8
    assert set(rep["gain"]) >= {"requests_per_s", "tokens_per_s", "wall_tokens_per_s"}
    assert "SIMULATED" in rep["clock"] and "wall" in rep["clock"]


def test_cli_text_and_bad_args(capsys):
    rc = main(["bench", "overlap", "--timing-only", "--requests", "1", "--max-tokens", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "serial" in out and "overlapped" in out and "simulated" in out.lower()
    assert main(["bench", "overlap", "--requests", "0"]) == 2
    assert "--requests" in capsys.readouterr().err
