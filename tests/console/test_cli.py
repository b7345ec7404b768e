"""Headless CLI: snapshot --json, chat --json, over-long prompt, layout errors."""

from __future__ import annotations

import contextlib
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


def test_host_time_modeled_by_default_and_measured_on_request(capsys):
    """Default: the fitted allowance per sampled token is what the clock books, so two runs give
    identical simulated timings; --host-time measured books this machine's work instead."""
    argv = ["chat", "Hello", "--max-tokens", "4", "--seed", "3", "--json", "--timing-only"]
    runs = []
    for _ in range(2):
        code, out, _ = run(capsys, *argv)
        assert code == 0
        runs.append(json.loads(out)["timings"])
    a, b = runs
    assert a["host_time"] == "modeled" and a["host_booked_ms"] == pytest.approx(4 * 0.204)
    assert (a["ttft_ms"], a["e2e_ms"], a["itl_ms"]) == (b["ttft_ms"], b["e2e_ms"], b["itl_ms"])
    assert "host work modeled" in a["clock"]
    code, out, _ = run(capsys, *argv, "--host-time", "measured")
    t = json.loads(out)["timings"]
    assert code == 0 and t["host_time"] == "measured" and t["host_booked_ms"] > 0
    # booked = every measured part (the KV apply calls too, which host_ms leaves out of its parts)
    assert t["host_booked_ms"] >= sum(t["host_ms"].values()) - t["host_ms"]["kv_wait"] - 1e-9


def test_unknown_host_time_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["chat", "hi", "--host-time", "wall"])
    assert e.value.code == 2
    assert "--host-time" in capsys.readouterr().err


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


def test_console_options_are_checked_before_the_terminal(capsys, monkeypatch, tmp_path):
    # without a terminal a fresh user saw "the console needs a terminal" for a bad --listen, --connect,
    # key file or bundle; with one, those were found only after the simulator was built
    def boom(*a, **k):
        raise AssertionError("the device was built before the options were checked")

    monkeypatch.setattr("calconsole.commands.common.build_from_args", boom)
    for argv, says in ((["--listen", "127.0.0.1:99999"], "argument --listen: expected HOST:PORT"),
                       (["--listen", "0.0.0.0:0"], "refusing to listen on 0.0.0.0 without an API key"),
                       (["--listen", ":0", "--api-key-file", str(tmp_path / "none")], "api key file"),
                       (["--connect", "localhost:8080"], "--connect must be an http:// or https:// URL"),
                       (["--connect", "http://127.0.0.1:1", "--admin-key-file", str(tmp_path / "none")],
                        "admin key file"),
                       (["--bundle", str(tmp_path / "none")], "bundle directory not found")):
        with pytest.raises(SystemExit) if says.startswith("argument") else contextlib.nullcontext() as ex:
            code = main(argv)
        if ex is not None:
            code = ex.value.code
        err = capsys.readouterr().err
        assert code == 2 and says in err and "terminal" not in err, (argv, err)


def test_help_and_a_bad_option_without_a_terminal(capsys):
    # pytest's stdin and stdout are not terminals: argparse answers first, as it does for a person
    for argv, code, says in ((["--help"], 0, "usage: calconsole"), (["--bogus"], 2, "unrecognized arguments: --bogus")):
        with pytest.raises(SystemExit) as ex:
            main(argv)
        out, err = capsys.readouterr()
        assert ex.value.code == code and says in out + err and "terminal" not in err, (argv, err)
