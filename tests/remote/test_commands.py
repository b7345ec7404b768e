"""Headless commands with ``--connect``: they act on the server's live device; without it, on a fresh one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from calconsole.cli import main
from sim_backend.planes import ChatRequest, MaintenanceRefused

from .conftest import ADMIN_KEY, API_KEY


def key_file(tmp_path: Path, name: str, key: str) -> str:
    p = tmp_path / name
    p.write_text(key + "\n")
    os.chmod(p, 0o600)
    return str(p)


@pytest.fixture
def served(make_server: Any, tmp_path: Path) -> tuple[Any, list[str], str]:
    s = make_server(api_key=API_KEY, admin_key=ADMIN_KEY)
    return s, ["--connect", s.url, "--api-key-file", key_file(tmp_path, "api", API_KEY)], \
        key_file(tmp_path, "admin", ADMIN_KEY)


def test_snapshot_watch_prints_one_json_line_per_sample_of_the_live_device(served: Any, capsys: Any) -> None:
    s, conn, _ = served
    s.system.inference.generate(ChatRequest.from_prompt("hi", max_tokens=3), timeout=60)
    assert main(["snapshot", *conn, "--watch", "--interval", "0.25", "--count", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    snaps = [json.loads(line) for line in lines]
    # the server's device: the request sent to it directly is counted
    assert all(x["requests"]["counters"]["finished"] == 1 for x in snaps)
    assert snaps[0]["taken_unix_s"] < snaps[1]["taken_unix_s"] < snaps[2]["taken_unix_s"]


def test_snapshot_watch_works_in_process_and_refuses_a_short_interval(capsys: Any) -> None:
    assert main(["snapshot", "--timing-only", "--watch", "--interval", "0.25", "--count", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(json.loads(x)["requests"]["counters"]["finished"] == 0 for x in lines)
    assert main(["snapshot", "--watch", "--interval", "0.1"]) == 2
    assert "--interval must be between 0.25" in capsys.readouterr().err
    assert main(["snapshot", "--count", "2"]) == 2


def test_chat_and_metrics_act_on_the_live_device(served: Any, capsys: Any) -> None:
    s, conn, _ = served
    assert main(["chat", "hello", "--max-tokens", "4", "--seed", "5", "--json", *conn]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "finished" and len(out["tokens"]) == 4
    assert s.system.observation.snapshot().requests.counters.finished == 1
    assert main(["metrics", *conn]) == 0
    text = capsys.readouterr().out
    assert "llamacpp:tokens_predicted_total 4" in text.splitlines()  # an integer, as llama-server writes it
    assert main(["metrics", "--warmup", "2", *conn]) == 2


def test_audit_and_drill_over_http_need_the_admin_key(served: Any, capsys: Any) -> None:
    s, conn, admin = served
    assert main(["audit", *conn]) == 2
    assert "admin key" in capsys.readouterr().err
    # the drill needs the numerics: this server is timing-only, so it says so and exits 2
    assert main(["drill", *conn, "--admin-key-file", admin]) == 2
    assert "timing-only" in capsys.readouterr().err
    with pytest.raises(MaintenanceRefused):
        s.system.maintenance.reset(None)  # one refused action in the server's log
    assert main(["audit", *conn, "--admin-key-file", admin, "--json"]) == 0  # $CALCONSOLE_AUDIT_LOG is set here
    entries = json.loads(capsys.readouterr().out)
    assert [(e["action"], e["status"]) for e in entries][-1] == ("reset", "refused")
    # a local log named on the command line is refused with --connect; the environment's default is not
    assert main(["audit", *conn, "--admin-key-file", admin, "--audit-log", str(Path(admin).parent / "x.jsonl")]) == 2
    assert "names a local file" in capsys.readouterr().err


def test_serve_boards_refuses_an_audit_log_given_but_not_one_from_the_settings(capsys: Any, tmp_path: Path) -> None:
    assert main(["serve", "--boards", "2", "--audit-log", str(tmp_path / "a.jsonl")]) == 2
    assert "each board keeps its own audit log" in capsys.readouterr().err


def test_the_drill_runs_over_http_against_a_numerics_server(make_server: Any, tmp_path: Path, capsys: Any) -> None:
    s = make_server(admin_key=ADMIN_KEY, system_kw={"numerics": True, "drain_timeout_s": 0.3})
    assert main(["drill", "--connect", s.url, "--admin-key-file", key_file(tmp_path, "a", ADMIN_KEY), "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)
    assert len(steps) == 14 and all(st["ok"] for st in steps)
    assert s.system.maintenance.mode()["mode"] == "serving"


def test_an_unreachable_server_is_one_line_and_exit_code_2(capsys: Any) -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    assert main(["snapshot", "--connect", f"http://127.0.0.1:{port}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("calconsole: error: cannot attach") and err.count("\n") == 1


def test_the_console_refuses_connect_with_listen(capsys: Any) -> None:
    assert main(["--connect", "http://127.0.0.1:1", "--listen", "127.0.0.1:0"]) == 2
    assert "give one" in capsys.readouterr().err


def test_simulator_options_with_connect_are_named_as_not_applied(make_server: Any, capsys: Any) -> None:
    # `chat --connect URL --host-time modeled --json` printed the server's measured timings and said nothing
    s = make_server(system_kw={"host_time": "measured"})
    assert main(["chat", "hi", "--max-tokens", "2", "--json", "--connect", s.url, "--host-time", "modeled",
                 "--timing-only", "--slots", "2"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["timings"]["host_time"] == "measured"  # the server's, as it was started
    note = [line for line in out.err.splitlines() if line.startswith("note:")]
    assert note == ["note: --timing-only, --host-time modeled, --slots 2: with --connect the simulator options "
                    "are the server's, not applied here"]
    assert main(["chat", "hi", "--max-tokens", "2", "--json", "--connect", s.url]) == 0
    assert "note:" not in capsys.readouterr().err


def test_audit_log_with_connect_is_named_as_not_applied_and_not_created(make_server: Any, tmp_path: Path,
                                                                         capsys: Any) -> None:
    # `chat --connect URL --audit-log PATH` created an empty PATH and said nothing: the server keeps its log
    s = make_server()
    path = tmp_path / "local-audit.jsonl"
    assert main(["chat", "hi", "--max-tokens", "2", "--json", "--connect", s.url, "--audit-log", str(path)]) == 0
    note = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert note == [f"note: --audit-log {path}: with --connect the simulator options are the server's, "
                    "not applied here"]
    assert not path.exists()
