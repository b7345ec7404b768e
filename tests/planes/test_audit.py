"""Audit log: durable JSON lines, started/finished pairing, crash mid-action, ``calconsole audit``."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sim_backend.planes.audit as audit_mod
from calconsole.cli import main
from sim_backend.planes.audit import AuditLog, default_audit_path, summarize

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*argv: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    return rc, buf.getvalue()


def test_records_are_fsynced_json_lines_with_who_what_when(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(audit_mod.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    log = AuditLog(tmp_path / "sub" / "dir" / "audit.jsonl")
    aid = log.start("reset", {"timeout_s": 10})
    assert len(synced) == 1  # durable before the action runs
    log.finish(aid, "reset", {"timeout_s": 10}, granted=True, ok=True, result={"ok": True}, duration_ms=12.3456,
               sim_ms=1.5)
    assert len(synced) == 2  # ... and before it is reported done
    lines = (tmp_path / "sub" / "dir" / "audit.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    assert [r["phase"] for r in recs] == ["started", "finished"]
    for r in recs:
        assert r["id"] == aid and r["action"] == "reset" and r["args"] == {"timeout_s": 10}
        assert r["user"] == log.user and r["pid"] == os.getpid() and r["time"] and r["unix_s"] > 0
    assert recs[1]["result"] == {"ok": True} and recs[1]["duration_ms"] == 12.346 and recs[1]["sim_ms"] == 1.5
    (e,) = log.entries()
    assert e["status"] == "granted" and e["duration_ms"] == 12.346


def test_written_with_aiofiles(tmp_path, monkeypatch):
    opened = []
    real_open = audit_mod.aiofiles.open

    def spy(*a, **k):
        opened.append(a[0])
        return real_open(*a, **k)

    monkeypatch.setattr(audit_mod.aiofiles, "open", spy)
    AuditLog(tmp_path / "a.jsonl").start("x", {})
    assert opened == [tmp_path / "a.jsonl"]


async def test_append_from_inside_a_running_event_loop(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl")
    log.start("from_loop", {})  # e.g. called on the Textual event loop thread
    await asyncio.sleep(0)
    assert log.read()[0]["action"] == "from_loop"


def test_default_path_env_and_state_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("CALCONSOLE_AUDIT_LOG", str(tmp_path / "env.jsonl"))
    assert default_audit_path() == tmp_path / "env.jsonl"
    assert AuditLog().path == tmp_path / "env.jsonl"
    monkeypatch.delenv("CALCONSOLE_AUDIT_LOG")
    p = default_audit_path()
    assert p.name == "audit.jsonl" and "calconsole" in str(p.parent)


def test_summarize_statuses_and_corrupt_lines(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl")
    a = log.start("reset", {})
    log.finish(a, "reset", {}, granted=False, ok=False, result="reset refused: no lease", duration_ms=1)
    b = log.start("self_test", {})
    log.finish(b, "self_test", {}, granted=True, ok=False, result={"ok": False}, duration_ms=1)
    log.start("clear_device_memory", {})  # never finished
    log.event("drill:reset", {"step": 1}, granted=False, ok=True, result="refused as expected", duration_ms=2)
    with open(log.path, "a") as f:
        f.write("{not json\n")
    statuses = [(e["action"], e["status"]) for e in summarize(log.read())]
    assert statuses == [("reset", "refused"), ("self_test", "failed"), ("clear_device_memory", "did not finish"),
                        ("drill:reset", "ok"), ("?", "corrupt")]


def test_audit_command_json_and_table(tmp_path):
    path = tmp_path / "a.jsonl"
    # a named log that does not exist is a typo, not an empty log: exit 2 naming the path (was exit 0, [])
    rc, out = run_cli("audit", "--audit-log", str(tmp_path / "a.jsnol"), "--json")
    assert rc == 2 and out == ""
    path.touch()
    rc, out = run_cli("audit", "--audit-log", str(path), "--json")
    assert rc == 0 and json.loads(out) == []
    log = AuditLog(path)
    a = log.start("write_register", {"key": "BOARD_ID", "value": 1})
    log.finish(a, "write_register", {"key": "BOARD_ID", "value": 1}, granted=False, ok=False,
               result="write_register refused: register BOARD_ID is read-only", duration_ms=0.5)
    log.start("reset", {"timeout_s": 10})
    rc, out = run_cli("audit", "--audit-log", str(path), "--json")
    entries = json.loads(out)
    assert rc == 0 and [e["status"] for e in entries] == ["refused", "did not finish"]
    assert entries[0]["args"] == {"key": "BOARD_ID", "value": 1} and entries[0]["user"]
    rc, out = run_cli("audit", "--audit-log", str(path), "--json", "--raw")
    assert [r["phase"] for r in json.loads(out)] == ["started", "finished", "started"]
    rc, out = run_cli("audit", "--audit-log", str(path))
    assert rc == 0 and "did not finish" in out and "refused" in out and "write_register" in out
    rc, out = run_cli("audit", "--audit-log", str(path), "--json", "--tail", "1")
    assert [e["action"] for e in json.loads(out)] == ["reset"]
    # the top-level option works too
    rc, out = run_cli("--audit-log", str(path), "audit", "--json")
    assert len(json.loads(out)) == 2


CRASH = r"""
import os, sys
from sim_backend.compose import build_system
s = build_system(numerics=False, audit_path=sys.argv[1])
m = s.maintenance
lease = m.enter_exclusive("alice", drain_timeout_s=0)
def crash(*a, **k):
    os._exit(3)  # the process dies in the middle of the reset
s.board.reset = crash
m.reset(lease)
"""


def test_crash_mid_action_leaves_started_without_finished(tmp_path):
    path = tmp_path / "audit.jsonl"
    out = subprocess.run([sys.executable, "-c", CRASH, str(path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 3, out.stderr
    recs = AuditLog(path).read()
    assert [(r["action"], r["phase"]) for r in recs] == [("enter_exclusive", "started"),
                                                         ("enter_exclusive", "finished"), ("reset", "started")]
    entries = AuditLog(path).entries()
    assert entries[-1]["action"] == "reset" and entries[-1]["status"] == "did not finish"
    cli = subprocess.run([sys.executable, "-m", "calconsole", "audit", "--audit-log", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "160"})
    assert cli.returncode == 0 and "did not finish" in cli.stdout


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_audit_tail_must_be_positive(tmp_path, bad, capsys):
    assert main(["audit", "--audit-log", str(tmp_path / "a.jsonl"), "--tail", bad]) == 2


def test_the_log_rotates_at_its_size_cap_and_keeps_its_backups(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl", max_bytes=8192, backups=2)
    for i in range(300):
        log.event("probe", {"i": i}, granted=True, ok=True, result="ok", duration_ms=0.0)
    files = [log.path, *log.rotated_paths()]
    assert [p.name for p in files] == ["a.jsonl", "a.jsonl.1", "a.jsonl.2"] and log.rotations >= 3
    assert all(p.stat().st_size <= 8192 for p in files)
    assert not (tmp_path / "a.jsonl.3").exists()  # the oldest was dropped: disk use is bounded
    kept = [r["args"]["i"] for r in log.read_all()]
    assert kept == list(range(300 - len(kept), 300))  # every kept record, in order, none torn


def test_tail_reads_the_newest_entries_from_the_end(tmp_path, monkeypatch):
    from sim_backend.planes import audit as audit_mod

    log = AuditLog(tmp_path / "a.jsonl")
    for i in range(100):
        a = log.start("reset", {"i": i})
        log.finish(a, "reset", {"i": i}, granted=True, ok=True, result="done", duration_ms=1.0)
    log.start("self_test", {})  # still running (or crashed)
    with open(log.path, "a") as f:
        f.write("{not json\n")
    parsed: list[int] = []
    real = audit_mod.parse_line
    monkeypatch.setattr(audit_mod, "parse_line", lambda raw, n=0: parsed.append(1) or real(raw, n))
    entries, more = log.tail(3)
    assert [e["status"] for e in entries] == ["granted", "did not finish", "corrupt"] and more
    assert entries[0]["args"] == {"i": 99} and entries[0]["duration_ms"] == 1.0
    assert len(parsed) < 20  # the tail was read, not the 200 lines before it
    monkeypatch.setattr(audit_mod, "parse_line", real)
    every = summarize(log.read())
    for n in (1, 2, 50, 102):
        got, more = log.tail(n)
        assert [(e["id"], e["status"]) for e in got] == [(e["id"], e["status"]) for e in every[-n:]]
        assert more == (n < len(every))
    assert log.tail(10_000) == (log.tail(102)[0], False)


def test_tail_continues_into_the_rotated_files(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl", max_bytes=4096, backups=3)
    for i in range(40):
        log.event("probe", {"i": i}, granted=True, ok=True, result="ok", duration_ms=0.0)
    assert log.rotated_paths()
    n_current = len(log.read())
    entries, more = log.tail(n_current + 5)
    assert [e["args"]["i"] for e in entries] == list(range(40 - n_current - 5, 40))


def test_tail_bounds_an_overlong_line(tmp_path, monkeypatch):
    from sim_backend.planes import audit as audit_mod

    monkeypatch.setattr(audit_mod, "MAX_LINE_BYTES", 1000)
    monkeypatch.setattr(audit_mod, "TAIL_BLOCK_BYTES", 256)
    log = AuditLog(tmp_path / "a.jsonl")
    log.event("before", {}, granted=True, ok=True, result="ok", duration_ms=0.0)
    with open(log.path, "a") as f:
        f.write("x" * 5000 + "\n")
    log.event("after", {}, granted=True, ok=True, result="ok", duration_ms=0.0)
    entries, more = log.tail(3)
    assert [e["action"] for e in entries] == ["before", "?", "after"] and not more
    assert "longer than 1000 bytes" in entries[1]["result"]


def test_a_named_audit_log_that_does_not_exist_is_refused_naming_it(tmp_path, capsys):
    typo = tmp_path / "audti.jsonl"
    assert main(["audit", "--audit-log", str(typo)]) == 2
    err = capsys.readouterr().err
    assert f"no audit log at {typo}" in err and "Traceback" not in err and not typo.exists()
    # a rotated log whose current file is not yet written again is read, not refused
    (tmp_path / "audti.jsonl.1").write_text("")
    assert main(["audit", "--audit-log", str(typo)]) == 0


def test_the_audit_command_reads_the_tail_without_parsing_the_whole_log(tmp_path, monkeypatch):
    """``calconsole audit`` (default: the last 1,000 entries) on a 40,002-record log parses about the records it
    shows, read from the end, not every line of the file (a 200k-record log took 15-21 s and 0.5 GB before);
    ``--tail 5`` parses about 10."""
    path = tmp_path / "big.jsonl"
    log = AuditLog(path)
    a = log.start("probe", {})
    log.finish(a, "probe", {}, granted=True, ok=True, result="ok", duration_ms=1.0)
    lines = path.read_text().splitlines()
    assert len(lines) == 2
    with path.open("a") as f:  # 20,000 more started/finished pairs, the same record shape
        for _ in range(20_000):
            f.write(lines[0] + "\n" + lines[1] + "\n")
    parsed = [0]
    real = json.loads

    class CountingJson:
        def __getattr__(self, name):
            return getattr(json, name)

        @staticmethod
        def loads(s, *a, **k):
            parsed[0] += 1
            return real(s, *a, **k)

    monkeypatch.setattr(audit_mod, "json", CountingJson())
    rc, out = run_cli("audit", "--audit-log", str(path), "--json")
    assert rc == 0 and len(json.loads(out)) == 1_000
    assert parsed[0] <= 2_100, parsed[0]  # 2 records an entry, of 40,002 lines
    parsed[0] = 0
    rc, out = run_cli("audit", "--audit-log", str(path), "--json", "--tail", "5")
    assert rc == 0 and len(json.loads(out)) == 5 and parsed[0] <= 60, parsed[0]
