"""``calconsole fleet`` headless (JSON lines, watch, table), ``prometheus-config`` and ``serve --boards``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from calconsole.cli import main
from tests.fleet.conftest import API_KEY, dead_url


def test_json_lines_one_per_board_worst_first(make_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    a, dead = make_server().url, dead_url()
    code = main(["fleet", "--connect", a, "--connect", dead, "--json"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert code == 1  # a board did not answer
    assert [x["url"] for x in lines] == [dead, a]
    assert lines[0]["state"] == "unreachable" and lines[1]["state"] == "up" and lines[1]["kind"] == "calconsole"


def test_watch_prints_count_samples_of_every_board(make_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = make_server().url, make_server().url
    assert main(["fleet", "--connect", a, "--connect", b, "--watch", "--count", "2"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert sorted(x["url"] for x in lines) == sorted([a, a, b, b])


def test_table_names_its_clocks(make_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--connect", make_server().url]) == 0
    out = capsys.readouterr().out
    assert "sim = simulated device time" in out and "ok" in out and "serving" in out


@pytest.mark.parametrize(("argv", "words"), [
    (["fleet"], "give --fleet FILE"),
    (["fleet", "--connect", "nota-url"], "http"),
    (["fleet", "--connect", "http://h:1", "--count", "2"], "--count needs --watch"),
    (["fleet", "--connect", "http://h:1", "--watch", "--count", "0"], "--count must be"),
    (["fleet", "--fleet", "/nonexistent/fleet.yaml"], "file not found"),
])
def test_bad_fleet_arguments_are_one_line_errors(argv: list[str], words: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.count("\n") == 1


def test_prometheus_config_has_a_job_per_board(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "b0.api"
    key.write_text(API_KEY + "\n")
    os.chmod(key, 0o600)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"boards": [{"name": "b0", "url": "http://10.0.0.5:8080", "api_key_file": "b0.api"},
                                                {"name": "b1", "url": "https://10.0.0.6:9443"}]}))
    assert main(["fleet", "prometheus-config", "--fleet", str(fleet)]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    jobs = doc["scrape_configs"]
    assert [j["job_name"] for j in jobs] == ["calconsole-b0", "calconsole-b1"]
    assert jobs[0]["static_configs"] == [{"targets": ["10.0.0.5:8080"], "labels": {"board": "b0"}}]
    assert jobs[0]["authorization"] == {"type": "Bearer", "credentials_file": str(key.resolve())}
    assert jobs[1]["scheme"] == "https" and "authorization" not in jobs[1]
    assert API_KEY not in yaml.safe_dump(doc)  # the key stays in its file
    # a labelled key file would be sent whole as the token: refused with the reason
    key.write_text(f"ops {API_KEY}\n")
    assert main(["fleet", "prometheus-config", "--fleet", str(fleet)]) == 2
    assert "Prometheus sends the whole file" in capsys.readouterr().err


def test_serve_boards_starts_isolated_boards_and_stops_them_all(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-m", "calconsole", "serve", "--boards", "2", "--port", "0",
                             "--timing-only", "--pacing", "fast", "--boards-dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    fleet = tmp_path / "fleet.yaml"
    try:
        assert proc.stderr is not None
        lines = []
        for line in proc.stderr:  # bounded: the launcher gives up on a board after its start timeout
            lines.append(line)
            if "boards listening" in line:
                break
        assert fleet.is_file(), "".join(lines[-20:])
        boards = yaml.safe_load(fleet.read_text())["boards"]
        assert [b["name"] for b in boards] == ["board-0", "board-1"]
        out = subprocess.run([sys.executable, "-m", "calconsole", "fleet", "--fleet", str(fleet), "--json"],
                             capture_output=True, text=True, env=env, timeout=120)
        rows = [json.loads(x) for x in out.stdout.splitlines()]
        assert out.returncode == 0 and {r["state"] for r in rows} == {"up"} and len(rows) == 2
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0
    # every board is gone: its port no longer answers
    import httpx

    for b in boards:
        with pytest.raises(httpx.TransportError):
            httpx.get(b["url"] + "/health", timeout=2)


def test_bench_fleet_prints_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    """``calconsole bench fleet`` over 2 served boards: CPU, sample intervals (every board streamed), the
    event loop's lag and a board entering exclusive mode reaching its sample and its row. Figures only: no
    timing is asserted, only that each was measured."""
    assert main(["bench", "fleet", "--boards", "2", "--seconds", "5", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["boards"] == 2 and r["failed"] == 0 and r["samples"] >= 2
    assert r["streamed"] == r["samples"] and r["polled"] == 0  # calconsole boards push their samples
    assert r["cpu_percent"] > 0 and r["interval_mean_s"] > 0 and r["loop_lag_ms_max"] >= 0
    assert r["change_sample_s"] is not None and r["change_shown_s"] is not None
    assert r["change_shown_s"] >= r["change_sample_s"] > 0
