"""Headless CLI: snapshot --json, chat --json, over-long prompt, layout errors."""

from __future__ import annotations

import json

import pytest

from calconsole.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_snapshot_json_has_the_documented_keys(capsys):
    code, out, _ = run(capsys, "snapshot", "--json", "--timing-only")
    assert code == 0
    snap = json.loads(out)
    assert len(snap["device"]["chiplets"]) == 2
    assert set(snap["jobs"]) >= {"pending", "running", "finished", "failed"}
    assert snap["kv"]["capacity_tokens"] == 40960 and snap["kv"]["used_tokens"] == 0
    assert snap["last_step"]["layers"] == []  # no step yet
    assert snap["host"]["rss_bytes"] > 0 and "cpu_percent" in snap["host"]
    codes = {f["code"] for f in snap["findings"]}
    assert {"device_memory_unit", "prefill_type_mislabelled", "context_mismatch"} <= codes


def test_chat_json_reports_simulated_timings(capsys):
    code, out, _ = run(capsys, "chat", "Hello, world!", "--max-tokens", "5", "--seed", "7", "--json")
    assert code == 0
    d = json.loads(out)
    assert set(d) >= {"text", "tokens", "stop_type", "timings"}
    t = d["timings"]
    assert set(t) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second", "ttft_ms"}
    assert t["predicted_n"] == len(d["tokens"]) == 5 and d["stop_type"] == "limit"
    assert t["prompt_n"] > 4 and 0 < t["ttft_ms"] < 1000
    # same seed, same tokens
    code, out2, _ = run(capsys, "chat", "Hello, world!", "--max-tokens", "5", "--seed", "7", "--json")
    assert json.loads(out2)["tokens"] == d["tokens"]


def test_chat_help_says_timings_are_simulated(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    out = capsys.readouterr().out
    assert "SIMULATED device milliseconds" in out.replace("\n", " ").replace("  ", " ") or "SIMULATED" in out


def test_overlong_prompt_exits_2_and_allocates_nothing(capsys):
    prompt = "hello " * 41000
    code, out, err = run(capsys, "chat", prompt, "--timing-only", "--max-tokens", "1")
    assert code == 2
    assert "exceed_context_size_error" in err and "40960" in err


def test_invalid_sampling_value_exits_2(capsys):
    code, _, err = run(capsys, "chat", "hi", "--timing-only", "--top-p", "1.5")
    assert code == 2 and "top_p" in err


def test_broken_layout_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("columns: [ {width: 2fr, panes: [{pane: nosuchpane}]} ]\n")
    code, _, err = run(capsys, "--layout", str(bad))
    assert code == 2
    assert str(bad) in err and "nosuchpane" in err
    code, _, err = run(capsys, "--layout", "no-such-layout")
    assert code == 2 and "operator" in err


def test_console_refuses_without_a_terminal(capsys):
    code, _, err = run(capsys)  # pytest's stdout is not a TTY
    assert code == 2 and "snapshot --json" in err
