"""``calconsole bench serve``: closed-loop streaming load over real HTTP against a live server.

Tiny configurations (1-2 clients, 2-3 requests, timing-only, fast pacing) against a server started
here on 127.0.0.1:0. Only the report's shape, that its counts add up (client against server
/metrics) and the ordering of each request's own times are checked: the figures are wall time
and never asserted against a threshold.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from calconsole.bench import serve as bench_serve
from calconsole.bench.serve_load import (
    Shape,
    histogram_quantile,
    metrics_delta,
    mix_plan,
    parse_metrics,
    prompt_text,
)
from calconsole.cli import build_parser, main
from calconsole.server.face import ServeConfig, ServingFace
from calconsole.server.keys import KeyRing
from calconsole.server.run import ServerThread

API_KEY = "bench-test-api-key-0123456789"
TINY = ["--short", "24:4", "--long", "80:6", "--warmup", "1"]


def _serve(make_system: Any, **config: Any) -> Iterator[ServerThread]:
    system = make_system(numerics=False, maintenance=False)
    face = ServingFace(system.inference, system.observation, None, ServeConfig(host="127.0.0.1", port=0, **config))
    thread = ServerThread(face).start()
    try:
        yield thread
    finally:
        thread.stop()


@pytest.fixture
def server(make_system: Any) -> Iterator[ServerThread]:
    yield from _serve(make_system)


def _run_json(capsys: Any, argv: list[str]) -> dict[str, Any]:
    rc = main(["bench", "serve", "--json", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_registered_under_bench():
    args = build_parser().parse_args(["bench", "serve", "--url", "http://127.0.0.1:1", "--clients", "1,2"])
    assert args.func is bench_serve.run and args.url == "http://127.0.0.1:1" and args.clients == "1,2"


def test_json_against_a_live_server(server: ServerThread, capsys):
    rep = _run_json(capsys, ["--url", server.url, "--clients", "1,2", "--requests", "3", "--mix", "short,mixed", *TINY])
    assert rep["url"] == server.url and not rep["in_process"]
    assert rep["server"]["pacing"] == "fast" and rep["server"]["numerics"] is False
    # without the in-process plane there is no baseline; a fast server cannot be judged against real time
    assert "skipped" in rep["overhead"] and "skipped" in rep["sustained"]
    ka = rep["keepalive"]
    for leg in ("kept_alive", "new_connection"):
        assert 0 < ka[leg]["median_ms"] <= ka[leg]["p95_ms"] and ka[leg]["cpu_ms_per_request"] > 0
    confs = rep["configurations"]
    assert [(c["mix"], c["clients"]) for c in confs] == [("short", 1), ("short", 2), ("mixed", 1), ("mixed", 2)]
    for c in confs:
        req = c["requests"]
        assert req["sent"] == 3 and req["failed"] == 0 and req["completed"] == 3 and not req["errors"]
        assert sum(req["by_shape"].values()) == 3
        assert req["by_shape"] == ({"short": 3} if c["mix"] == "short" else {"short": 2, "long": 1})
        rows = c["per_request"]
        assert len(rows) == 3 and all(r["ok"] for r in rows)
        for r in rows:
            assert r["ttft_ms"] >= 0 and r["e2e_ms"] >= r["ttft_ms"]
            assert r["server_ttft_ms"] >= 0 and r["server_e2e_ms"] >= r["server_ttft_ms"]
            assert r["prompt_tokens"] == (24 if r["shape"] == "short" else 80)
            assert 1 <= r["output_tokens"] <= (4 if r["shape"] == "short" else 6)
            assert r["itl_gaps"] <= r["output_tokens"] - 1
        # the client's counts and the server's /metrics deltas agree (this test is the only client)
        assert c["output_tokens"] == sum(r["output_tokens"] for r in rows)
        assert c["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
        sm = c["server_metrics"]
        assert sm["counters"]["tokens_predicted_total"] == c["output_tokens"]
        assert sm["counters"]["requests_finished_total"] == 3 and sm["counters"]["requests_failed_total"] == 0
        assert sm["histograms"]["e2e_ms"]["count"] == 3 and sm["histograms"]["ttft_ms"]["count"] == 3
        assert sm["histograms"]["itl_ms"]["count"] == c["server_timings"]["itl_ms"]["n"]
        cl = c["client"]
        assert cl["ttft_ms"]["n"] == 3 and cl["e2e_ms"]["n"] == 3
        assert cl["ttft_ms"]["p50"] <= cl["ttft_ms"]["p95"] <= cl["ttft_ms"]["p99"]
        assert cl["request_throughput_rps"] > 0 and cl["output_throughput_tok_s"] > 0
        assert cl["good_requests"] is None  # no --slo


def test_slo_goodput_is_counted_on_both_sides(server: ServerThread, capsys):
    rep = _run_json(capsys, ["--url", server.url, "--clients", "1", "--requests", "2", "--mix", "short",
                             "--phases", "sweep", "--slo", "ttft:1e9,e2el:1e9", *TINY])
    c = rep["configurations"][0]
    assert rep["slo"] == {"ttft_ms": 1e9, "tpot_ms": None, "e2el_ms": 1e9}
    # objectives no request can miss: every completed request is good, client side and server side
    assert c["client"]["good_requests"] == 2 and c["server_timings"]["good_requests"] == 2
    assert c["client"]["goodput_tok_s"] == pytest.approx(c["client"]["output_throughput_tok_s"])


def test_in_process_overhead_and_sustained(capsys):
    rep = _run_json(capsys, ["--clients", "1", "--requests", "2", "--phases", "overhead,sustained",
                             "--overhead-clients", "1", "--duration", "0.5", *TINY])
    assert rep["in_process"] and rep["configurations"] == []
    ov = rep["overhead"]
    row = ov["by_clients"][0]
    assert ov["at_clients"] == 1 and row["clients"] == 1
    for kind in ("http", "plane"):  # two legs of two requests each
        assert row[kind]["requests"] == 4 and row[kind]["completed"] == 4 and row[kind]["output_tokens"] >= 4
    assert ov["overhead_ms_per_token"] == pytest.approx(row["http"]["itl_p50_ms"] - row["plane"]["itl_p50_ms"])
    su = rep["sustained"]
    assert su["speed"] == 1.0 and rep["server"]["sustained_slots"] == 4
    (srow,) = su["by_clients"]
    assert srow["clients"] == 1 and srow["requests"]["failed"] == 0 and srow["requests"]["sent"] >= 1
    assert srow["streams_behind"] <= srow["streams_judged"] <= srow["requests"]["completed"]
    assert su["sustained_streams"] == (1 if srow["sustained"] else 0)
    assert su["limit_found"] is not srow["sustained"]


def test_human_report_prints_the_tables(server: ServerThread, capsys):
    rc = main(["bench", "serve", "--url", server.url, "--clients", "1", "--requests", "2", "--mix", "short",
               "--phases", "sweep,overhead", *TINY])
    out = capsys.readouterr().out
    assert rc == 0
    assert "sweep (closed loop)" in out and "/metrics deltas" in out and "HTTP overhead per token: skipped" in out


def test_a_refused_key_is_a_one_line_error(make_system: Any, capsys, monkeypatch):
    for thread in _serve(make_system, api_keys=KeyRing([("api-1", API_KEY)], "api")):
        monkeypatch.setenv(bench_serve.ENV_API_KEY, "wrong-key-0123456789xyz")
        assert main(["bench", "serve", "--url", thread.url, "--requests", "1", "--clients", "1", *TINY]) == 2
        err = capsys.readouterr().err
        assert "401" in err and "authentication_error" in err and err.count("\n") == 1
        monkeypatch.setenv(bench_serve.ENV_API_KEY, API_KEY)
        rep = _run_json(capsys, ["--url", thread.url, "--requests", "1", "--clients", "1", "--mix", "short",
                                 "--phases", "sweep", *TINY])
        assert rep["configurations"][0]["requests"]["completed"] == 1


def test_an_unreachable_server_is_a_one_line_error(capsys):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--clients", "1", *TINY]) == 2
    err = capsys.readouterr().err
    assert "ConnectError" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, name", [
    (["--clients", "0"], "--clients"), (["--clients", "1,x"], "--clients"), (["--mix", "tiny"], "--mix"),
    (["--phases", "all"], "--phases"), (["--short", "12"], "--short"), (["--long", "40000:4096"], "--long"),
    (["--requests", "0"], "--requests"), (["--duration", "nan"], "--duration"), (["--slo", "ttft:-1"], "--slo"),
    (["--url", "ftp://127.0.0.1"], "--url"), (["--slots", "33"], "--slots"), (["--lag-margin", "-1"], "--lag-margin"),
])
def test_bad_options_exit_2_naming_the_option(argv, name, capsys):
    assert main(["bench", "serve", *argv]) == 2
    err = capsys.readouterr().err
    assert name in err and err.count("\n") == 1


# --- the pieces ------------------------------------------------------------------------------------

def test_mix_plan_counts_and_order():
    assert mix_plan("short", 5, 0) == ["short"] * 5 and mix_plan("long", 3, 0) == ["long"] * 3
    plan = mix_plan("mixed", 20, 7)
    assert plan.count("long") == 2 and len(plan) == 20 and plan == mix_plan("mixed", 20, 7)
    assert mix_plan("mixed", 3, 0).count("long") == 1  # a small run still has one long request
    assert mix_plan("mixed", 1, 0) == ["short"]


def test_prompts_differ_from_the_first_word():
    a, b = prompt_text(1, 50, 0), prompt_text(2, 50, 0)
    assert a.split()[1:] != b.split()[1:] and len(a.split()) == 51 and prompt_text(1, 50, 0) == a


def test_shape_parse():
    assert Shape.parse("short", "128:32") == Shape("short", 128, 32)
    for bad in ("128", "0:4", "4:0", "a:b", "40000:961", "16:5000"):
        with pytest.raises(ValueError, match="--short"):
            Shape.parse("short", bad)


def test_histogram_quantile_interpolates_like_prometheus():
    buckets = [(0.01, 0.0), (0.02, 10.0), (0.05, 20.0), (float("inf"), 20.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.02)
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.015)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.035)
    assert histogram_quantile(0.99, [(0.01, 1.0), (float("inf"), 2.0)]) == pytest.approx(0.01)  # +Inf bucket
    assert histogram_quantile(0.5, [(0.01, 0.0), (float("inf"), 0.0)]) is None


def _text(ttft: list[int], tokens: int) -> str:
    les = ("0.1", "0.5", "+Inf")
    lines = ["# TYPE llamacpp:tokens_predicted_total counter", f"llamacpp:tokens_predicted_total {tokens}",
             "# TYPE llamacpp:time_to_first_token_seconds histogram"]
    lines += [f'llamacpp:time_to_first_token_seconds_bucket{{le="{le}"}} {n}' for le, n in zip(les, ttft, strict=True)]
    lines += [f"llamacpp:time_to_first_token_seconds_count {ttft[-1]}",
              f"llamacpp:time_to_first_token_seconds_sum {0.2 * ttft[-1]}"]
    return "\n".join(lines) + "\n"


def test_metrics_delta_counts_only_the_new_samples():
    before = parse_metrics(_text([1, 2, 2], 10))
    after = parse_metrics(_text([1, 6, 6], 42))
    d = metrics_delta(before, after)
    assert d["counters"] == {"tokens_predicted_total": 32}
    h = d["histograms"]["ttft_ms"]
    assert h["count"] == 4 and h["mean"] == pytest.approx(200.0)
    # the 4 new samples all lie in (0.1, 0.5] s: P50 interpolated halfway through that bucket
    assert h["p50"] == pytest.approx(300.0)
    with pytest.raises(ValueError):
        parse_metrics("llamacpp:x{le=}} not prometheus\n")


def test_a_reply_past_the_timeout_is_a_failed_request(make_system: Any, capsys):
    from sim_backend.compose import Pacing, PacingMode

    system = make_system(numerics=False, maintenance=False, pacing=Pacing(PacingMode.REALTIME))
    face = ServingFace(system.inference, system.observation, None, ServeConfig(host="127.0.0.1", port=0))
    with ServerThread(face) as thread:
        # 200 tokens at ~17 simulated ms each, paced in real time: far more than the 1 s allowed
        assert main(["bench", "serve", "--url", thread.url, "--clients", "1", "--timeout", "1", "--short", "24:200",
                     "--warmup", "1"]) == 2
    err = capsys.readouterr().err
    assert "warm-up request failed: no complete reply within 1 s" in err and err.count("\n") == 1


def test_paired_against_the_real_llama_server_prints_both_columns(llama_server: Any, capsys):
    """--url a llama-server: the paired phase alone, the same mix against it and an in-process calconsole."""
    rc = main(["bench", "serve", "--url", llama_server.url, "--clients", "1", "--requests", "2", "--mix", "short",
               "--health-requests", "5", *TINY])
    out = capsys.readouterr().out
    assert rc == 0
    assert f"llama-server {llama_server.url} | calconsole in-process" in out and "sweep (closed loop)" not in out
    row = next(line for line in out.splitlines() if line.startswith("│ short"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[:4] == ["short", "1", "2/2 | 2/2", "0 | 0"]
    for cell in cells[4:]:  # TTFT / TPOT / E2E P50 and P95: a figure on each side
        left, right = (float(x) for x in cell.split(" | "))
        assert left >= 0 and right >= 0
    assert "paired GET /health, kept-alive: median" in out
