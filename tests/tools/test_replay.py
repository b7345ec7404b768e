"""``calconsole bench replay``: trace loading, the fast path against the token-by-token engine, the F7 truth,
refusals counted by reason, the board search (local processes and dask.distributed's LocalCluster)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from calconsole.bench.replay import DEFAULT_TRACE
from calconsole.cli import main
from sim_backend.model.batching import price_decode_batch
from sim_backend.planes.types import SLO
from sim_backend.tools.replay import replay
from sim_backend.tools.replay_board import ReplayConfig
from sim_backend.tools.replay_engine import replay_on_engine
from sim_backend.tools.replay_prices import StepPrices, prices_for_trace, variant_bundle_dir
from sim_backend.tools.replay_search import find_boards
from sim_backend.tools.replay_trace import Trace, TraceError, load_trace

HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
T0 = "2023-11-16 18:15:46.6805900"


@pytest.fixture(scope="module")
def azure() -> Trace:
    return load_trace(DEFAULT_TRACE)


def test_the_shipped_trace_is_the_whole_hour_with_its_licence(azure):
    assert len(azure) == 19_366
    assert 3500 < azure.span_s <= 3600  # one hour of arrivals (first to last: 3,501.7 s)
    here = Path(DEFAULT_TRACE).parent
    assert "Attribution 4.0 International" in (here / "LICENSE").read_text(encoding="utf-8-sig")
    assert (here / "README.md").is_file()
    st = azure.stats()
    assert st["count"] == 19_366 and st["prompt"]["p50"] > st["output"]["p50"] > 1


@pytest.mark.parametrize(("body", "row", "fld"), [
    ("TIMESTAMP,ContextTokens\n" + T0 + ",10\n", 0, "GeneratedTokens"),
    (HEAD + "yesterday,10,10\n", 1, "TIMESTAMP"),
    (HEAD + T0 + ",10,10\n2023-11-16 18:15:40.0,10,10\n", 2, "TIMESTAMP"),
    (HEAD + T0 + ",-3,10\n", 1, "ContextTokens"),
    (HEAD + T0 + ",10,2.5\n", 1, "GeneratedTokens"),
    (HEAD + T0 + ",10,0\n", 1, "GeneratedTokens"),
    (HEAD + T0 + ",10,10\n" + T0 + ",99999999999999999999,10\n", 2, "ContextTokens"),  # int64 would overflow
    (HEAD + T0 + ",10,20000000\n", 1, "GeneratedTokens"),  # over MAX_TOKENS
    (HEAD + T0 + ",\u00b2,10\n", 1, "ContextTokens"),  # a digit to str.isdigit, not to int()
    (HEAD + "0,10,10\n200000000,10,10\n", 2, "TIMESTAMP"),  # a span of 6 years: seconds were ms
    (HEAD + T0 + ",10,10\n\"" + "9" * 200_000 + ",10,10\n", 2, "CSV"),  # a field past the csv limit
])
def test_a_malformed_trace_names_the_row_and_field(tmp_path, body, row, fld):
    p = tmp_path / "t.csv"
    p.write_text(body)
    with pytest.raises(TraceError) as e:
        load_trace(p)
    assert e.value.row == row and e.value.field == fld and fld in str(e.value)


def test_a_trace_that_is_not_utf8_is_a_trace_error(tmp_path):
    p = tmp_path / "t.csv"
    p.write_bytes(HEAD.encode() + b"0,10,10\n1,\xff\xfe,10\n")
    with pytest.raises(TraceError) as e:
        load_trace(p)
    assert e.value.field == "text" and "UTF-8" in str(e.value)


def test_timestamps_read_as_utc_with_or_without_an_offset_and_a_bom_is_allowed(tmp_path):
    rows = {"naive": "2023-11-16 18:15:46.5", "z": "2023-11-16T18:15:46.5Z", "utc": "2023-11-16 18:15:46.500+00:00",
            "east": "2023-11-16 20:15:46.5+02:00"}
    out = {}
    for name, ts in rows.items():
        p = tmp_path / f"{name}.csv"
        # the second row is one second later in every form; a BOM before the header (Excel's CSV) is no column
        later = ts.replace("46.5", "47.5")
        p.write_bytes(b"\xef\xbb\xbf" + (HEAD + f"{ts},10,10\n{later},10,10\n").encode())
        t = load_trace(p)
        out[name] = t.arrival_s.tolist()
    assert all(v == [0.0, 1.0] for v in out.values()), out
    from sim_backend.tools.replay_trace import _parse_time

    # naive = UTC whatever the machine's zone: the same instant as Z and +00:00, two hours after +02:00's clock
    assert _parse_time(rows["naive"]) == _parse_time(rows["z"]) == _parse_time(rows["utc"]) == _parse_time(rows["east"])
    assert _parse_time("2023-11-16 00:00:00") == 1700092800.0


def test_refused_rows_are_named_by_their_row_in_the_trace_file():
    # rows 1..3 before the cut; the cut's 7 requests are data rows 4..10 of the file
    t = Trace(np.array([0.0] * 3 + [5.0] * 7), np.array([100] * 9 + [40_000]), np.array([10] * 9 + [2000]), "f")
    cut = t.cut(start_s=1.0)
    rep = replay(cut, prices_for_trace(cut), boards=1, cfg=ReplayConfig(queue_limit=0))
    assert rep["rejected_rows"] == {"queue_full": [8, 9], "context": [10]}


def test_the_cli_refuses_bad_settings_in_one_line(capsys):
    for argv in (["--speedup", "0"], ["--speedup", "1e9"], ["--speedup", "nan"], ["--workers", "0", "--find-boards"],
                 ["--bundle", "smollm2-135m-pilot"], ["--find-boards", "qwen3-30b-a3b,smollm2-135m-pilot"],
                 ["--check-engine", "--boards", "40", "--limit", "30"]):
        assert main(["bench", "replay", "--limit", "5", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0], (argv, err)
    assert main(["bench", "replay", "--limit", "5", "--speedup", "1e9"]) == 2
    assert "0.001..1e6" in capsys.readouterr().err


def test_the_cli_says_one_line_and_exits_2_for_a_bad_trace(tmp_path, capsys):
    p = tmp_path / "t.csv"
    p.write_text(HEAD + T0 + ",10,10\n" + T0 + ",x,10\n")
    assert main(["bench", "replay", str(p), "--boards", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 2" in err[0] and "ContextTokens" in err[0] and "Traceback" not in err[0]
    assert main(["bench", "replay", str(tmp_path / "none.csv")]) == 2
    assert main(["bench", "replay", "--attainment", "1.5", "--limit", "3"]) == 2
    assert main(["bench", "replay", "--bundle", "nope", "--limit", "3"]) == 2
    assert main(["bench", "replay", "--find-boards", "qwen3-30b-a3b,nope", "--limit", "3"]) == 2
    assert main(["bench", "replay", "--slo", "ttft:-1", "--limit", "3"]) == 2
    capsys.readouterr()


@pytest.mark.parametrize("variant", ["qwen3-30b-a3b-b4", "qwen3-30b-a3b-b16"])
def test_batched_decode_prices_add_up_as_the_roadmap_prices_them(variant):
    prices = StepPrices.build(variant_bundle_dir(variant), max_context=6000)
    rng = np.random.default_rng(7)
    for n in range(1, prices.decode_batch + 1):
        pasts = [int(x) for x in rng.integers(0, 6000, size=n)]
        want = float(price_decode_batch(prices.cost, prices.shape, pasts).total_us)
        assert prices.decode(pasts) == pytest.approx(want, rel=1e-9)


def test_f7_truth_an_uncontended_request_of_27_in_246_out_takes_4_41_s():
    # facts.md F7: the device's own E2E 4.41 s for 27 prompt tokens and 246 out; the engine gives 4,409 ms
    t = Trace(np.array([0.0]), np.array([27]), np.array([246]), "F7")
    fast = replay(t, prices_for_trace(t), boards=1)
    e2e = fast["metrics"]["e2e_ms"]["p50"]
    assert e2e == pytest.approx(4410.0, rel=0.01)
    eng = replay_on_engine(t, boards=1)
    assert eng["metrics"]["e2e_ms"]["p50"] == pytest.approx(e2e, rel=1e-6)


def _close(a: dict, b: dict, rel: float) -> None:
    for m in ("ttft_ms", "tpot_ms", "e2e_ms", "queue_ms"):
        for q in ("p50", "p95"):
            assert a[m][q] == pytest.approx(b[m][q], rel=rel), (m, q)


@pytest.mark.parametrize(("variant", "boards"),
                         [("qwen3-30b-a3b", 2), ("qwen3-30b-a3b-b4", 1), ("qwen3-30b-a3b-b8", 1)])
def test_the_fast_path_agrees_with_the_token_by_token_engine_on_a_slice(azure, variant, boards):
    # a contended slice (queueing, refusals, prefill chunks of a 4k prompt); outputs cut to keep it quick
    cut = azure.cut(start_s=600, limit=24)
    t = Trace(cut.arrival_s, cut.prompt, np.minimum(cut.output, 48), "slice")
    bundle = variant_bundle_dir(variant)
    fast = replay(t, prices_for_trace(t, bundle), boards=boards)
    eng = replay_on_engine(t, bundle, boards=boards)
    assert fast["rejected"] == eng["rejected"]
    assert fast["finished"] == eng["statuses"].get("finished", 0)
    # the issue's bound is 1 %; the two share the scheduler and prices, so they agree to rounding
    _close(fast["metrics"], eng["metrics"], 1e-6)


def test_refusals_are_counted_by_reason_and_named():
    # 6 requests at once on one board of 4 slots and no queue: 2 refused as busy; one over the context
    t = Trace(np.zeros(7), np.array([100] * 6 + [40_000]), np.array([10] * 6 + [2000]), "burst")
    rep = replay(t, prices_for_trace(t), boards=1, cfg=ReplayConfig(queue_limit=0))
    assert rep["rejected"] == {"queue_full": 2, "context": 1}
    assert rep["rejected_rows"] == {"queue_full": [5, 6], "context": [7]}
    assert rep["finished"] + sum(rep["rejected"].values()) == rep["requests"] == 7


@pytest.mark.parametrize("route", ["round-robin", "least-outstanding", "least-kv"])
def test_every_router_accounts_for_every_request_and_is_deterministic(azure, route):
    t = azure.cut(limit=300)
    prices = prices_for_trace(t)
    a = replay(t, prices, boards=3, cfg=ReplayConfig(route=route))
    b = replay(t, prices, boards=3, cfg=ReplayConfig(route=route))
    assert a["finished"] + sum(a["rejected"].values()) == 300
    assert sum(p["requests"] for p in a["per_board"]) == a["finished"]
    assert a["metrics"] == b["metrics"] and a["rejected"] == b["rejected"]


def test_the_cli_json_has_the_issues_keys(capsys):
    assert main(["bench", "replay", "--limit", "60", "--boards", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for k in ("requests", "trace_seconds", "wall_seconds", "boards", "bundle", "metrics", "goodput", "attainment",
              "rejected", "per_board", "trace"):
        assert k in doc
    assert set(doc["metrics"]) == {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "queue_ms"}
    assert all(set(v) == {"p50", "p95", "p99"} for v in doc["metrics"].values())
    assert len(doc["per_board"]) == 3 and set(doc["per_board"][0]) == {"requests", "busy_pct", "kv_peak_pct"}
    assert doc["requests"] == doc["trace"]["count"] == 60


def test_the_json_timeline_is_strict_json_and_the_ignored_plot_is_said(tmp_path, capsys):
    # one board, no queue, a burst: most arrivals refused, bins with nobody served -> null, never NaN
    p = tmp_path / "burst.csv"
    p.write_text(HEAD + "".join(f"{i // 20},200,50\n" for i in range(60)))
    assert main(["bench", "replay", str(p), "--boards", "1", "--queue-limit", "0", "--json", "--plot"]) == 0
    cap = capsys.readouterr()
    assert "--plot ignored" in cap.err

    def no_nan(c: str) -> None:
        raise AssertionError(f"non-JSON constant {c}")

    doc = json.loads(cap.out, parse_constant=no_nan)
    assert "timeline" in doc and doc["rejected"]["queue_full"] > 0


def test_find_boards_from_the_cli_on_a_dask_scheduler(capsys):
    distributed = pytest.importorskip("distributed")
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None) \
            as cluster:
        # the executor's shutdown takes no cancel_futures on dask: the command must still end cleanly
        assert main(["bench", "replay", "--limit", "40", "--find-boards", "qwen3-30b-a3b-b4",
                     "--scheduler", cluster.scheduler_address, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["answers"]["qwen3-30b-a3b-b4"] >= 1 and doc["executor"].startswith("dask ")


def _check_search(res: dict, variants: list[str]) -> None:
    assert set(res["answers"]) == set(variants)
    for v in variants:
        rows = [r for r in res["search"] if r["variant"] == v]
        n = res["answers"][v]
        assert n is not None and any(r["boards"] == n and r["meets_slo"] for r in rows)
        assert all(not r["meets_slo"] for r in rows if r["boards"] < n)
        assert any(r["boards"] == n - 1 for r in rows) or n == 1  # bisected to the neighbour


def test_find_boards_on_threads(azure):
    t = azure.cut(limit=150)
    slo = SLO(ttft_ms=2000.0, tpot_ms=100.0)
    with ThreadPoolExecutor(2) as ex:
        res = find_boards(t, ["qwen3-30b-a3b", "qwen3-30b-a3b-b8"], ex, slo=slo)
    _check_search(res, ["qwen3-30b-a3b", "qwen3-30b-a3b-b8"])


def test_find_boards_on_a_dask_local_cluster(azure):
    distributed = pytest.importorskip("distributed")
    t = azure.cut(limit=150)
    slo = SLO(ttft_ms=2000.0, tpot_ms=100.0)
    with ThreadPoolExecutor(1) as ex:
        local = find_boards(t, ["qwen3-30b-a3b-b4"], ex, slo=slo)
    # in-process workers (inproc transport): no socket, no dashboard
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) \
            as cluster, distributed.Client(cluster) as client:
        res = find_boards(t, ["qwen3-30b-a3b-b4"], client.get_executor(), slo=slo)
    _check_search(res, ["qwen3-30b-a3b-b4"])
    assert res["answers"] == local["answers"]
    assert [r["attainment"] for r in res["search"]] == [r["attainment"] for r in local["search"]]
