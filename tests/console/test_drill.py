"""``calconsole drill``: the scripted maintenance window, its JSON, exit code and audit trail."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from calconsole.cli import main
from sim_backend.planes.audit import AuditLog

EXPECTED = [
    ("reset", False), ("submit_request", True), ("enter_exclusive", True), ("submit_request", False),
    ("reset", True), ("self_test", True), ("inject_fault", True), ("probe_request", True),
    ("probe_request", True), ("clear_device_memory", True), ("probe_request", True), ("reload_model", True),
    ("leave_exclusive", True), ("submit_request", True),
]


def run_drill(*extra: str) -> tuple[int, str]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["drill", *extra])
    return rc, buf.getvalue()


def test_drill_json_passes_and_every_step_is_audited(tmp_path):
    path = tmp_path / "audit.jsonl"
    rc, out = run_drill("--json", "--audit-log", str(path))
    steps = json.loads(out)
    assert rc == 0, json.dumps(steps, indent=1)
    assert [(s["action"], s["granted"]) for s in steps] == EXPECTED
    for s in steps:
        assert set(s) == {"step", "action", "granted", "ok", "detail", "sim_ms", "wall_ms"}
        assert s["ok"] is True and s["wall_ms"] >= 0 and s["sim_ms"] >= 0 and s["detail"]
    by = {i + 1: s for i, s in enumerate(steps)}
    assert "refused as expected" in by[1]["detail"]
    assert "cancelled" in by[3]["detail"] and "device entering maintenance" in by[3]["detail"]
    assert "unavailable_error: device in maintenance" in by[4]["detail"]
    assert "health healthy" in by[5]["detail"]
    assert by[6]["detail"].startswith("pass")
    assert "CCUException" in by[8]["detail"] and by[9]["detail"].startswith("finished")
    assert "DeviceNotReady" in by[11]["detail"]
    assert by[14]["detail"].startswith("finished")
    assert by[3]["sim_ms"] > 0  # the drain advanced simulated time (steps ran until the cancel)
    # the audit log has each maintenance call (granted or refused) and one drill record per step
    entries = AuditLog(path).entries()
    drill = [e for e in entries if e["action"].startswith("drill:")]
    assert [e["action"] for e in drill] == [f"drill:{a}" for a, _ in EXPECTED]
    assert all(e["status"] == "ok" for e in drill)
    calls = [(e["action"], e["status"]) for e in entries if not e["action"].startswith("drill:")]
    assert calls == [("reset", "refused"), ("enter_exclusive", "granted"), ("reset", "granted"),
                     ("self_test", "granted"), ("inject_fault", "granted"), ("probe_request", "failed"),
                     ("probe_request", "granted"), ("clear_device_memory", "granted"), ("probe_request", "failed"),
                     ("reload_model", "granted"), ("leave_exclusive", "granted")]


def test_drill_exits_nonzero_when_a_step_misbehaves(tmp_path, monkeypatch):
    import sim_backend.model.golden as golden

    def unreadable(path, dtype="bf16"):
        raise ValueError("golden file damaged")

    monkeypatch.setattr(golden, "load_golden", unreadable)
    rc, out = run_drill("--json", "--audit-log", str(tmp_path / "a.jsonl"))
    steps = json.loads(out)
    assert rc == 1
    bad = [s for s in steps if not s["ok"]]
    assert [s["action"] for s in bad] == ["self_test"] and "golden file damaged" in bad[0]["detail"]
    assert steps[-1]["action"] == "submit_request" and steps[-1]["ok"]  # the window still closed cleanly


def test_drill_table_output(tmp_path):
    rc, out = run_drill("--audit-log", str(tmp_path / "a.jsonl"))
    assert rc == 0 and "drill passed" in out and "enter_exclusive" in out and "sim ms" in out


def test_drill_rejects_bad_drain_timeout(tmp_path):
    rc, _ = run_drill("--drain-timeout", "-1", "--audit-log", str(tmp_path / "a.jsonl"))
    assert rc == 2


@pytest.mark.parametrize("argv", [["drill", "--help"], ["audit", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 0
    assert "sim" in capsys.readouterr().out
