"""``calconsole bench realtime``: real-time factors per backend, the numeric limit, numpy calls per step.

A tiny configuration (one run, short contexts and prompts): the JSON's shape and that every figure is
positive and finite. Figures are wall time and never compared with a threshold.
"""

from __future__ import annotations

import json
import math

import pytest

from calconsole.bench import realtime as bench_realtime
from calconsole.cli import build_parser, main
from sim_backend.tools.realtime_bench import numeric_limit


def test_registered_under_bench():
    args = build_parser().parse_args(["bench", "realtime", "--json", "--runs", "2"])
    assert args.func is bench_realtime.run and args.json and args.runs == 2 and not args.ui


def test_cli_json_tiny_both_backends(capsys):
    rc = main(["bench", "realtime", "--json", "--runs", "1", "--decode-steps", "2", "--contexts", "16,40",
               "--lengths", "8,24"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert {"in_process", "worker", "numeric_limit_tokens", "runs", "decode_steps", "units"} <= set(rep)
    for b in ("in_process", "worker"):
        r = rep[b]
        assert set(r["decode_rtf"]) == {"16", "40"} and set(r["prefill_rtf"]) == {"8", "24"}
        for key in ("decode_rtf", "decode_wall_ms", "decode_sim_ms", "decode_cpu_ms", "decode_cpu_rtf",
                    "prefill_rtf", "prefill_wall_ms", "prefill_sim_ms", "prefill_cpu_ms", "prefill_cpu_rtf"):
            assert all(math.isfinite(v) and v > 0 for v in r[key].values()), (b, key, r[key])
        assert r["prefill_runs"] == {"8": 1, "24": 1}
        assert r["numpy_calls_per_decode_step"] > 0 and r["kernels"] == "compiled"
    # the worker's process does the numerics: this process makes far fewer numpy calls per step
    assert rep["worker"]["numpy_calls_per_decode_step"] < rep["in_process"]["numpy_calls_per_decode_step"]
    assert rep["numeric_limit_tokens"] in (0, 8, 24)
    # the simulated prices do not depend on where the numerics run
    assert rep["worker"]["prefill_sim_ms"] == rep["in_process"]["prefill_sim_ms"]


def test_numeric_limit_is_the_longest_prefix_keeping_real_time():
    assert numeric_limit({"128": 3.0, "256": 1.5, "512": 0.9, "1024": 1.2}) == 256  # 1024 after a miss: no
    assert numeric_limit({"128": 0.5}) == 0
    assert numeric_limit({"128": 2.0, "256": float("nan")}) == 128


@pytest.mark.parametrize("argv, msg", [
    (["--runs", "0"], "--runs must be in 1..50"),
    (["--contexts", "a,b"], "--contexts must be comma-separated integers"),
    (["--lengths", "0"], "--lengths must be 1..8192 tokens each"),
])
def test_bad_options_exit_2(capsys, argv, msg):
    assert main(["bench", "realtime", *argv]) == 2
    assert msg in capsys.readouterr().err


def test_ui_gc_pauses_are_split_at_the_first_key():
    """The console's collect-and-freeze at mount happens before anyone types: it is reported as a
    start-up pause, not as one an operator could feel while a reply streams."""
    import asyncio

    r = asyncio.run(bench_realtime._ui(40))
    assert "window_perf_s" not in r
    assert r["gc_startup"]["gen2_n"] >= 1          # GCPolicy.start's gc.collect() at mount
    for k in ("gc", "gc_startup"):
        g = r[k]
        assert g["n"] >= g["gen2_n"] >= 0 and g["max_ms"] >= g["median_ms"] >= 0.0
    assert r["streaming"]["n"] + r["end_of_reply"]["n"] > 0


def test_a_fill_that_does_not_finish_keeps_what_was_measured_and_names_the_context(monkeypatch):
    """A long KV fill over the worker's step timeout (a busy host) ends the backend's measurement: the
    contexts measured before it stay, the fill is named with the context it was for. The failing step is
    made to fail here (the worker's DeviceError, as its timeout raises it) so the test does not depend on
    how fast the host is; the next test lets a real worker time out."""
    from sim_backend.errors import DeviceError
    from sim_backend.tools import realtime_bench

    real = realtime_bench._run

    def run(board, kind, tokens, p0):
        if kind == "prefill" and p0 >= 16:  # the fill 16..40 for ctx 40; the fill 8..16 for ctx 16 passes
            raise DeviceError("numerics process did not answer during forward_priced (waited 0.5 s)")
        return real(board, kind, tokens, p0)

    monkeypatch.setattr(realtime_bench, "_run", run)
    r = realtime_bench.measure_backend(False, runs=1, decode_steps=1, contexts=[16, 40], prompt_lengths=[8])
    assert set(r["prefill_rtf"]) == {"8"} and set(r["decode_rtf"]) == {"16"}
    assert r["unfinished"] == {"what": "fill KV 16..40 (for decode at ctx 40)", "length": 40,
                               "error": "numerics process did not answer during forward_priced (waited 0.5 s)"}
    assert r["numpy_calls_per_decode_step"] is None


def test_worker_step_timeout_reports_what_was_measured_without_a_traceback(capsys):
    # 1 ms: no 48-layer prefill answers within it, so the worker's first measured step times out
    rc = main(["bench", "realtime", "--runs", "1", "--decode-steps", "1", "--contexts", "16", "--lengths", "8",
               "--step-timeout", "0.001"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in out + err
    assert "in_process (compiled kernels" in out and "ctx 16:" in out  # the in-process figures are there
    assert "NOT MEASURED from here: prefill 8 tokens did not finish (" in out
    assert "numerics process did not answer during forward_priced (waited 0.001 s)" in out
    assert "8 tokens did not finish (not measured)" in out  # the limit line names the length


def test_nothing_measured_exits_2_naming_the_step(capsys):
    rc = main(["bench", "realtime", "--backend", "worker", "--runs", "1", "--decode-steps", "1", "--contexts", "16",
               "--lengths", "8", "--step-timeout", "0.001", "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and "Traceback" not in err
    assert "nothing was measured: worker: prefill 8 tokens did not finish" in err


@pytest.mark.parametrize("value", ["0", "-1", "4000"])
def test_bad_step_timeout_exits_2(capsys, value):
    assert main(["bench", "realtime", "--step-timeout", value]) == 2
    assert "--step-timeout must be in (0, 3600] s" in capsys.readouterr().err
