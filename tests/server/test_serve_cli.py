"""``calconsole serve`` as a process: starts, answers, and stops cleanly on SIGTERM / SIGINT mid-stream."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest


def start(tmp_path, *extra: str) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALCONSOLE_")}
    p = subprocess.Popen([sys.executable, "-m", "calconsole", "serve", "--port", "0", "--timing-only",
                          "--audit-log", str(tmp_path / "audit.jsonl"), *extra],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    assert p.stderr is not None
    end = time.monotonic() + 60
    while time.monotonic() < end:
        line = p.stderr.readline()
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            return p, m.group(1)
        if not line and p.poll() is not None:
            break
    p.kill()
    raise AssertionError("server did not start")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_mid_stream_ends_the_stream_with_an_error_event(tmp_path, sig):
    p, url = start(tmp_path, "--pacing", "realtime", "--speed", "0.5")
    try:
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 2000, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            p.send_signal(sig)
            rest = [x for x in lines if x.startswith("data: ")]
        err = json.loads(rest[-1][len("data: "):])["error"]
        assert err["type"] == "unavailable_error" and "shutting down" in err["message"]
        assert p.wait(timeout=30) == 0
        log = p.stderr.read()
        assert "stopped" in log and "Traceback" not in log
        assert '"POST /v1/chat/completions" 200' in log  # one line per request
    finally:
        if p.poll() is None:
            p.kill()


def test_sigterm_right_after_the_listening_line_is_a_clean_stop(tmp_path):
    """The line is printed once the signal handlers are in place: stopping at once exits 0."""
    p, _ = start(tmp_path)
    try:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        assert "stopped" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()


def test_slo_option_sets_the_engines_goodput_objectives(tmp_path):
    """``serve --slo`` is the SLO the engine checks: /snapshot names it (an attached console shows it as the
    engine's); without it the console's goodput line pointed at an option serve did not have."""
    p, url = start(tmp_path, "--slo", "ttft:500,tpot:40")
    try:
        slo = httpx.get(url + "/snapshot").json()["requests"]["goodput"]["slo"]
        assert slo["ttft_ms"] == 500 and slo["tpot_ms"] == 40 and slo.get("e2el_ms") is None
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0


@pytest.mark.parametrize("spec,word", [("ttft:0", "'ttft'"), ("ttft:5,ttft:6", "twice"), ("speed:3", "speed")])
def test_a_bad_slo_stops_serve_with_code_2_before_the_device_is_built(tmp_path, spec, word):
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALCONSOLE_")}
    r = subprocess.run([sys.executable, "-m", "calconsole", "serve", "--port", "0", "--timing-only",
                        "--audit-log", str(tmp_path / "audit.jsonl"), "--slo", spec],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr
    assert "listening" not in r.stderr


def test_audit_log_is_created_at_start_up(tmp_path):
    """``--audit-log`` names a file in a directory that does not exist yet: ``serve`` with maintenance routes
    creates it (empty) before its listening line, not with the first record hours later."""
    key = tmp_path / "admin.key"
    key.write_text("k" * 32 + "\n")
    key.chmod(0o600)
    log = tmp_path / "new" / "dir" / "serve-audit.jsonl"
    p, url = start(tmp_path, "--admin-key-file", str(key), "--audit-log", str(log))
    try:
        assert log.is_file() and log.stat().st_size == 0
        assert httpx.get(url + "/health").json() == {"status": "ok"}
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
