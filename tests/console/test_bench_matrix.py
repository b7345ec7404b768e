"""``calconsole bench matrix``: the length matrix over real HTTP against a live server.

A timing-only, fast-paced server on 127.0.0.1:0 and a shrunk matrix (1 warm-up, 2 runs, 2-3 cells
that run and one the context forbids). Checked: the report's shape, the metadata it took from the
server (nothing assumed), that skipped cells are reported, that counts add up (client against the
server's /metrics), each run's raw token times against its own TTFT/E2E, and the CSV files. No
figure is compared with a threshold: they are wall time on a shared host.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from calconsole.bench import matrix as bench_matrix
from calconsole.bench.matrix import TOKENIZER_PROBE, Cell, ids_sha256, skip_reason
from calconsole.cli import build_parser, main
from calconsole.server.face import ServeConfig, ServingFace
from calconsole.server.keys import KeyRing
from calconsole.server.run import ServerThread

ALIAS = "served-under-test-alias"  # not the bundle's name: the report must take the server's word
API_KEY = "matrix-test-api-key-0123456789"
TINY = ["--quick", "--warmups", "1", "--runs", "2"]


class Live:
    def __init__(self, system: Any, thread: ServerThread) -> None:
        self.system, self.thread, self.url = system, thread, thread.url


def _serve(make_system: Any, **config: Any) -> Iterator[Live]:
    system = make_system(numerics=False, maintenance=False)
    face = ServingFace(system.inference, system.observation, None,
                       ServeConfig(host="127.0.0.1", port=0, model_alias=ALIAS, **config))
    thread = ServerThread(face).start()
    try:
        yield Live(system, thread)
    finally:
        thread.stop()


@pytest.fixture
def server(make_system: Any) -> Iterator[Live]:
    yield from _serve(make_system)


@pytest.fixture
def keyed_server(make_system: Any) -> Iterator[Live]:
    yield from _serve(make_system, api_keys=KeyRing([("api-1", API_KEY)], "api"))


def _run_json(capsys: Any, argv: list[str]) -> dict[str, Any]:
    rc = main(["bench", "matrix", "--json", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_registered_under_bench():
    args = build_parser().parse_args(["bench", "matrix", "--url", "http://127.0.0.1:1", "--quick"])
    assert args.func is bench_matrix.run and args.quick and args.url == "http://127.0.0.1:1"


def test_skip_rule_is_prompt_plus_output_over_n_ctx():
    assert skip_reason(Cell(40900, 60), 40960) is None
    why = skip_reason(Cell(40900, 61), 40960)
    assert why is not None and "40961" in why and "40960" in why


def test_quick_json_against_a_live_server(server: Live, capsys, tmp_path: Path):
    out = tmp_path / "m"
    # 40900 + 61 > n_ctx 40960: that cell is skipped; 40900 + 4 runs
    rep = _run_json(capsys, ["--url", server.url, *TINY, "--prompts", "16,40900", "--outputs", "4,61",
                             "--out", str(out)])
    inf = server.system.inference
    # --- metadata: every label from the server ---
    md = rep["metadata"]["server"]
    assert md["model_alias"] == ALIAS and md["models"] == [ALIAS]
    # llama-server's form b<build>-<commit> (clients check startswith("b")), naming calconsole
    assert md["build_info"].startswith("b") and "calconsole" in md["build_info"] and md["n_ctx"] == inf.n_ctx == 40960
    assert md["chat_template_sha256"] == hashlib.sha256(inf.chat_template.encode()).hexdigest()
    assert md["tokenizer_probe_sha256"] == ids_sha256(inf.tokenize(TOKENIZER_PROBE, parse_special=True))
    snap = server.system.observation.snapshot()
    assert md["device"]["calrt_version"] == snap.device.calrt_version and md["device"]["pacing"] == "fast"
    assert md["bundle"]["bundle"] == snap.device.bundle and md["bundle"]["bundle_status"] == "C0"
    assert md["missing"] == ["bundle_hash"] and rep["metadata"]["server_identity_changed"] is False
    assert rep["metadata"]["request"]["endpoint"] == "/completion"
    assert rep["options"]["warmups"] == 1 and rep["options"]["runs"] == 2
    assert rep["options"]["meets_report_repetitions"] is False
    # --- cells and counts ---
    assert [c["cell"] for c in rep["cells"]] == ["p16-o4", "p16-o61", "p40900-o4", "p40900-o61"]
    skipped = rep["cells"][3]
    assert "40961" in skipped["skipped"] and "runs" not in skipped
    assert rep["counts"] == {"cells": 4, "cells_run": 3, "cells_skipped": 1, "runs_sent": 9, "warmups_sent": 3,
                             "measured": 6, "measured_ok": 6, "measured_failed": 0}
    seeds = set()
    for c in rep["cells"][:3]:
        assert c["skipped"] is None and c["prompt_tokens_exact"]
        runs = c["runs"]
        assert [(r["warmup"], r["run"]) for r in runs] == [(True, 0), (False, 0), (False, 1)]
        for r in runs:
            seeds.add(r["seed"])
            assert r["ok"] and r["prompt_tokens"] == c["prompt"] and 1 <= r["output_tokens"] <= c["output"]
            assert r["model"] == ALIAS
            gs = r["generation_settings"]
            assert gs["seed"] == r["seed"] and gs["n_predict"] == c["output"] and gs["temperature"] == 0
            t = r["server_timings"]
            assert t["prompt_n"] == c["prompt"] and t["cache_n"] == 0 and t["predicted_n"] == r["output_tokens"]
            # raw token times: the first arrival is the TTFT, gaps are the ITL, all before the end
            arr = r["arrivals_ms"]
            assert arr and arr[0] == r["ttft_ms"] and arr == sorted(arr) and arr[-1] <= r["e2e_ms"]
            assert len(r["itl_ms"]) == len(arr) - 1 and r["arrival_tokens"][-1] <= r["output_tokens"]
            assert r["itl_ms"] == pytest.approx([b - a for a, b in zip(arr, arr[1:], strict=False)], abs=1e-6)
        measured = [r for r in runs if not r["warmup"]]
        assert c["requests"]["sent"] == 2 and c["requests"]["completed"] == 2
        assert c["client"]["ttft_ms"]["n"] == 2 and c["client"]["e2e_ms"]["n"] == 2
        assert c["output_tokens"] == sum(r["output_tokens"] for r in measured)
        # the server's /metrics over the measured runs agree with the client (this test is the only client)
        sm = c["server_metrics"]["counters"]
        assert sm["requests_finished_total"] == 2 and sm["tokens_predicted_total"] == c["output_tokens"]
        assert sm["prompt_tokens_total"] == 2 * c["prompt"]
        assert c["server_metrics"]["histograms"]["e2e_ms"]["count"] == 2
        st = c["server_timings"]
        assert st["ttft_ms"]["n"] == 2 and st["device_ms.infer"]["n"] == 2 and st["host_ms.sampling"]["n"] == 2
    assert len(seeds) == 9  # every run its own seed
    # --- files ---
    assert json.loads((out / "matrix.json").read_text()) == rep
    cells_csv = list(csv.DictReader((out / "cells.csv").open()))
    assert [r["cell"] for r in cells_csv] == [c["cell"] for c in rep["cells"]]
    assert cells_csv[3]["skipped"] == skipped["skipped"] and cells_csv[0]["ok"] == "2"
    runs_csv = list(csv.DictReader((out / "runs.csv").open()))
    assert len(runs_csv) == 9 and {r["warmup"] for r in runs_csv} == {"True", "False"}
    tokens_csv = list(csv.DictReader((out / "tokens.csv").open()))
    assert len(tokens_csv) == sum(len(r["arrivals_ms"]) for c in rep["cells"][:3] for r in c["runs"])


def test_api_key_and_in_table_mode(keyed_server: Live, capsys, tmp_path: Path):
    keyf = tmp_path / "key"
    keyf.write_text(f"api-1 {API_KEY}\n")
    rc = main(["bench", "matrix", "--url", keyed_server.url, "--api-key-file", str(keyf), *TINY, "--prompts", "8",
               "--outputs", "3", "--out", str(tmp_path / "o"), "--plot"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert ALIAS in out and "results:" in out and "bundle_hash" in out
    assert "TTFT P50 ms vs prompt tokens" in out and "TPOT P50 ms vs prompt tokens" in out  # --plot
    rep = json.loads((tmp_path / "o" / "matrix.json").read_text())
    assert rep["counts"]["measured_ok"] == 2 and "api_key" not in rep["options"]
    assert API_KEY not in (tmp_path / "o" / "matrix.json").read_text()
    # without the key the server refuses /props: exit 2, one line
    rc = main(["bench", "matrix", "--url", keyed_server.url, *TINY, "--out", str(tmp_path / "p")])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "GET /props: HTTP 401" in err, err


def test_in_process_server_without_url(capsys, tmp_path: Path):
    rep = _run_json(capsys, ["--prompts", "8", "--outputs", "2", "--warmups", "0", "--runs", "1",
                             "--out", str(tmp_path / "o")])
    assert rep["in_process"] and rep["url"] is None and rep["server_in_process"]["slots"] == 1
    assert rep["metadata"]["server"]["total_slots"] == 1 and rep["counts"]["measured_ok"] == 1
    assert rep["cells"][0]["runs"][0]["warmup"] is False


@pytest.mark.parametrize("argv,says", [
    (["--url", "ftp://127.0.0.1:1"], "--url must be"),
    (["--url", "127.0.0.1:8080"], "--url must be"),
    (["--url", "http://127.0.0.1:1"], "cannot reach"),
    (["--runs", "0"], "--runs must be in 1..100000"),
    (["--runs", "abc"], "--runs must be an integer"),
    (["--warmups", "-1"], "--warmups must be in"),
    (["--prompts", ""], "--prompts must be a comma-separated list"),
    (["--prompts", "16,x"], "--prompts must be an integer"),
    (["--outputs", "5000"], "--outputs must be in 1..4096"),
    (["--timeout", "nan"], "--timeout must be in"),
    (["--seed", "-3"], "--seed must be in"),
    (["--speed", "0"], "--speed must be"),
    (["--url", "http://127.0.0.1:1", "--numerics"], "--numerics is for the in-process server"),
])
def test_refusals_exit_2_with_one_line(argv, says, capsys, tmp_path: Path):
    rc = main(["bench", "matrix", *argv, "--out", str(tmp_path / "o")])
    _, err = capsys.readouterr()
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("calconsole: error: ") and says in err, err
    assert not (tmp_path / "o" / "matrix.json").exists()


def test_refuses_an_out_dir_that_holds_results_or_cannot_exist(server: Live, capsys, tmp_path: Path):
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "matrix.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    for out, says in ((tmp_path / "done", "already holds a matrix.json"),
                      (tmp_path / "file" / "sub", "cannot create the directory")):
        rc = main(["bench", "matrix", "--url", server.url, *TINY, "--out", str(out)])
        _, err = capsys.readouterr()
        assert rc == 2 and err.count("\n") == 1 and says in err, err
    assert (tmp_path / "done" / "matrix.json").read_text() == "{}"  # nothing overwritten


def test_a_server_that_is_not_llama_server_compatible(server: Live, capsys, tmp_path: Path):
    rc = main(["bench", "matrix", "--url", server.url + "/elsewhere", *TINY, "--out", str(tmp_path / "o")])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "GET /props: HTTP 404" in err, err


def test_a_run_that_fails_is_kept_and_exits_1(make_system: Any, capsys, tmp_path: Path):
    from sim_backend.compose import Pacing, PacingMode

    # real-time pacing: 64 tokens at ~17 simulated ms each cannot finish inside a 1 s deadline
    system = make_system(numerics=False, maintenance=False, pacing=Pacing(PacingMode.REALTIME))
    face = ServingFace(system.inference, system.observation, None, ServeConfig(host="127.0.0.1", port=0))
    thread = ServerThread(face).start()
    try:
        rc = main(["bench", "matrix", "--url", thread.url, "--prompts", "16", "--outputs", "64", "--warmups", "0",
                   "--runs", "1", "--timeout", "1", "--json", "--out", str(tmp_path / "o")])
    finally:
        thread.stop()
    out, err = capsys.readouterr()
    assert rc == 1 and "1 measured runs failed" in err, err
    rep = json.loads(out)
    assert rep["counts"]["measured_failed"] == 1 and rep["counts"]["measured_ok"] == 0
    (run,) = rep["cells"][0]["runs"]
    assert not run["ok"] and "within 1 s" in run["error"]
    assert rep["cells"][0]["requests"]["errors"] == {run["error"]: 1}
    assert json.loads((tmp_path / "o" / "matrix.json").read_text()) == rep
