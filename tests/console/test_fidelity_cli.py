"""``calconsole model --json`` (facts.md F3/F4 figures) and ``calconsole trace`` (Chrome trace format)."""

from __future__ import annotations

import itertools
import json

import pytest

from calconsole.cli import main
from sim_backend.model.opgraph import CATEGORIES

GiB = 2**30
MiB = 2**20


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def model_json():
    from calconsole.commands.model import model_info

    # what the command prints, through JSON
    return json.loads(json.dumps(model_info()))


def test_model_json_op_counts_are_f3(model_json):
    sm = model_json["submodels"]
    assert set(sm) == {"prefill", "decode"}
    assert sm["prefill"]["op_count"] == 1496 and sm["decode"]["op_count"] == 1398
    assert sm["prefill"]["per_chip_op_count"] == [1352, 1351]
    assert sm["decode"]["per_chip_op_count"] == [1254, 1253]
    f3 = {"fused_rmsnorm": 193, "quant_matmul": 193, "sync_d2d": 146, "gather": 145, "moe_dense_group": 144,
          "kv_scatter": 96, "fused_rope": 96, "add_residual": 96, "silu": 48, "multiply": 48, "reduce": 48,
          "gate_pre": 48, "gate_post": 48, "flash_attention": 48, "embedding": 1}
    for kind in ("prefill", "decode"):
        cats = sm[kind]["ops_by_category"]
        assert list(cats) == list(CATEGORIES) and sum(cats.values()) == sm[kind]["op_count"]
        for cat, n in f3.items():
            assert cats[cat] == n, (kind, cat)
        per_chip = sm[kind]["ops_by_category_per_chip"]
        assert [sum(d.values()) for d in per_chip] == sm[kind]["per_chip_op_count"]
        assert per_chip[0]["embedding"] == 1 and "embedding" not in per_chip[1]
    assert sm["prefill"]["ops_by_category"]["dynamic_d2d"] == 96 and sm["decode"]["ops_by_category"]["dynamic_d2d"] == 0
    assert sm["prefill"]["ops_by_category"]["layout_conversion"] == 2
    assert sm["decode"]["ops_by_category"]["layout_conversion"] == 0
    assert sm["prefill"]["smodel_type"] == "llm_decode" and sm["prefill"]["effective_type"] == "llm_prefill"


def test_model_json_memory_is_f4(model_json):
    mem = model_json["memory"]
    chips = mem["per_chip"]
    assert len(chips) == 2
    g = lambda b: round(b / GiB, 3)   # noqa: E731
    m = lambda b: round(b / MiB, 3)   # noqa: E731
    assert [g(c["regions"]["parameters"]["reserved_bytes"]) for c in chips] == [8.745, 8.165]
    assert [m(c["regions"]["param_window"]["reserved_bytes"]) for c in chips] == [14.381, 14.381]
    assert [c["regions"]["kv_cache"]["reserved_bytes"] for c in chips] == [48 * 2 * 2 * 128 * 40960 * 2] * 2
    assert [g(c["regions"]["kv_cache"]["reserved_bytes"]) for c in chips] == [1.875, 1.875]
    assert [g(c["dram_reserved_bytes"]) for c in chips] == [14.075, 14.075]
    assert [m(c["sram_reserved_bytes"]) for c in chips] == [16.844, 16.844]
    assert [m(c["sram_physical_bytes"]) for c in chips] == [18.0, 18.0]
    assert [g(c["param_file_bytes"]) for c in chips] == [8.759, 8.179]
    for c in chips:
        for r in c["regions"].values():
            assert set(r) == {"kind", "used_bytes", "reserved_bytes", "physical_bytes"}
            assert 0 <= r["used_bytes"] <= r["reserved_bytes"] <= r["physical_bytes"]
        assert c["sram_reserved_bytes"] <= c["sram_physical_bytes"]
    t = mem["totals"]
    assert g(t["parameters_bytes"]) == 16.910 and g(t["kv_cache_bytes"]) == 3.750
    assert g(t["dram_reserved_bytes"]) == 28.150 and m(t["sram_reserved_bytes"]) == 33.688
    assert m(t["param_window_bytes"]) == 28.762 and g(t["param_file_bytes"]) == 16.938
    assert mem["logits_bytes_per_token"] == 303_872
    assert {k: g(v) for k, v in mem["address_union_bytes"].items()} == {"decode": 10.634, "prefill": 14.091}


def test_model_json_findings(model_json):
    findings = model_json["findings"]
    assert isinstance(findings, list)
    codes = {f["code"] for f in findings}
    assert {"device_memory_unit", "prefill_type_mislabelled", "context_mismatch"} <= codes
    assert all({"severity", "field", "message", "action"} <= f.keys() for f in findings)


def test_model_cli(capsys):
    code, out, _ = run(capsys, "model", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["submodels"]["decode"]["per_chip_op_count"] == [1254, 1253]
    code, out, _ = run(capsys, "model")
    assert code == 0 and "1496" in out and "1352 / 1351" in out and "14.075 GiB" in out
    code, _, err = run(capsys, "model", "--bundle", "/nonexistent/bundle")
    assert code == 2 and "error" in err


def test_trace_writes_chrome_trace_of_every_step(capsys, tmp_path):
    from sim_backend.bundle.shapes import ModelShape
    from sim_backend.model.opgraph import build_graph

    out = tmp_path / "req.json"
    code, stdout, _ = run(capsys, "trace", "--out", str(out), "--max-tokens", "4", "--timing-only", "--json")
    assert code == 0
    summary = json.loads(stdout)
    assert summary["steps"] == {"prefill": 1, "decode": 3} and summary["predicted_n"] == 4
    doc = json.loads(out.read_text())
    assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] in ("ms", "ns")
    evs = doc["traceEvents"]
    for e in evs:
        assert e["ph"] in ("X", "M") and isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and isinstance(e["ts"], float) and e["dur"] >= 0
    tracks = {e["tid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "thread_name"}
    chip_tids = sorted(t for t, n in tracks.items() if n.startswith("chip"))
    assert chip_tids == [0, 1]
    shape = ModelShape()
    pre, dec = build_graph(shape, "prefill"), build_graph(shape, "decode")
    for c in (0, 1):
        ops = [e for e in evs if e["ph"] == "X" and e["tid"] == c]
        # one event per profiled op per step: 1 prefill + 3 decodes
        expect = pre.per_chip_profile_count()[c] + 3 * dec.per_chip_profile_count()[c]
        assert len(ops) == expect == summary["op_events_per_chip"][c]
        assert len(ops) == [1352 + 3 * 1254, 1351 + 3 * 1253][c]
        assert all(e["name"] == f"{e['cat']} L{e['args']['layer']}" or e["name"].endswith(" global") for e in ops)
    steps = sorted((e for e in evs if e["ph"] == "X" and e.get("cat") == "step"), key=lambda e: e["ts"])
    assert [s["args"]["kind"] for s in steps] == ["prefill", "decode", "decode", "decode"]
    assert [s["args"]["past_len"] for s in steps[1:]] == [summary["prompt_n"] + i for i in range(3)]
    for a, b in itertools.pairwise(steps):   # serial device: steps do not overlap on the simulated timeline
        assert b["ts"] >= a["ts"] + a["dur"]


def test_trace_bad_arguments(capsys, tmp_path):
    code, _, err = run(capsys, "trace", "--out", str(tmp_path / "x" / "y.json"), "--timing-only")
    assert code == 2 and "does not exist" in err
    code, _, _ = run(capsys, "trace", "--out", str(tmp_path / "y.json"), "--max-tokens", "0")
    assert code == 2


def test_bench_calibrate_json(capsys):
    # --no-engine: the engine rows measure real host work; their figures are checked in
    # test_calibration.py with host work scripted (no timed assertion here)
    # --no-convergence / --timing-only: the fit and its convergence are checked in tests/tools/test_calibration.py
    code, out, _ = run(capsys, "bench", "calibrate", "--json", "--no-engine", "--no-convergence", "--timing-only")
    doc = json.loads(out)
    cases = doc["cases"]
    assert all({"name", "mode", "role", "measured", "simulated", "unit", "ok", "explained"} <= c.keys() for c in cases)
    assert all(("error_pct" in c) or isinstance(c["simulated"], list) for c in cases)
    # exit 0: the protocol ran and every check holds; the band misses (the best the mechanisms reach) are
    # explained, labelled, and only band cases miss
    assert code == 0 and doc["ok"] and all(chk["ok"] for chk in doc["checks"]) and not all(c["ok"] for c in cases)
    assert all(c["ok"] or ("band" in c and c["explained"]) for c in cases)
    assert not doc["linear_bound"]["reachable"] and doc["linear_bound"]["knee_ms"] > 0
    assert {c["mode"] for c in cases} == {"timing-only"} and set(doc["summary"]) == {"timing-only"}
    assert {c["role"] for c in cases} == {"fitted", "held-out"} and doc["convergence"] == {}
    assert doc["summary"]["timing-only"]["held_out_decode_rms_pct"] <= 8.0
    code, out, _ = run(capsys, "bench", "calibrate", "--no-engine", "--no-loo", "--timing-only")
    assert code == 0 and "decode_246_tok_s" in out and "+-" not in out
    assert "held-out decode RMS" in out and "prefill_40960_data_moving" in out and "miss*" in out
    assert "data-only bound" in out and "documented limit" in out and "FAIL" not in out
