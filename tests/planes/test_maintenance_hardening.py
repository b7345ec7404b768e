"""Maintenance plane under attack (a breaker's findings): stuck jobs, the audit trail, odd arguments."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.errors import MaintenanceRefused
from sim_backend.planes import ChatRequest, TokenEvent
from sim_backend.planes.audit import AuditLogError
from sim_backend.planes.snapshot import Snapshot


def test_a_probe_that_outlives_its_wait_does_not_break_maintenance(make_system):
    s = make_system(pacing=Pacing(PacingMode.REALTIME, speed=1.0), reset_timeout_s=0.3, numerics=False)
    m = s.maintenance
    lease = m.enter_exclusive("alice")
    m.inject_fault(lease, "slow_chip", chip=1, factor=100.0)  # a ~90 ms prefill now takes seconds
    rep = m.probe_request(lease, "hi", 1)
    assert rep["status"] == "failed" and rep["error"]["type"] == "WaitTimeout"
    m.clear_faults(lease)
    # the reset ends the stuck job; its buffer pair comes back and the health check really passes
    rep = m.reset(lease)
    assert rep["ok"], rep["health"]["detail"]
    assert m.probe_request(lease, "hi", 2)["status"] == "finished"
    m.leave_exclusive(lease)


def test_a_probe_longer_than_the_numerics_limit_is_refused(make_system):
    s = make_system(numerics_max_prompt=64)
    m = s.maintenance
    lease = m.enter_exclusive("alice")
    with pytest.raises(MaintenanceRefused, match="takes at most 64"):
        m.probe_request(lease, "hello " * 200, 1)
    for bad in (True, 0, 257):
        with pytest.raises(MaintenanceRefused, match="max_tokens"):
            m.probe_request(lease, "hi", bad)
    with pytest.raises(MaintenanceRefused, match="prompt"):
        m.probe_request(lease, "", 1)
    m.leave_exclusive(lease)


def test_dump_never_overwrites_and_never_touches_the_audit_log(make_system, tmp_path):
    s = make_system()
    m = s.maintenance
    lease = m.enter_exclusive("alice")
    before = m.audit.path.read_bytes()
    with pytest.raises(MaintenanceRefused, match="audit log"):
        m.dump(lease, m.audit.path)
    assert m.audit.path.read_bytes().startswith(before)  # only appended to (the refusal itself)
    existing = tmp_path / "existing.json"
    existing.write_text("keep me")
    with pytest.raises(MaintenanceRefused, match="never overwrite"):
        m.dump(lease, existing)
    assert existing.read_text() == "keep me"
    for bad, why in ((tmp_path / "no" / "such" / "d.json", "does not exist"), ("", "file name"), (5, "file name"),
                     (tmp_path, "exists")):
        with pytest.raises(MaintenanceRefused, match=why):
            m.dump(lease, bad)
    rep = m.dump(lease, tmp_path / "fresh.json")
    assert rep["ok"] and json.loads((tmp_path / "fresh.json").read_text())["format"] == "calconsole-dump/1"
    assert m.dump(lease)["ok"]  # the default dump directory is created
    statuses = [e["status"] for e in m.audit.entries() if e["action"] == "dump"]
    assert statuses == ["refused"] * 6 + ["granted", "granted"]
    m.leave_exclusive(lease)


def test_an_unauditable_enter_exclusive_leaves_the_device_serving(make_system, monkeypatch):
    s = make_system()
    m = s.maintenance

    def disk_full(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(m.audit, "finish", disk_full)
    with pytest.raises(AuditLogError, match="could not be audited"):
        m.enter_exclusive("alice")
    assert m.mode()["mode"] == "serving" and m.lease is None
    monkeypatch.undo()
    assert s.inference.generate(ChatRequest.from_prompt("hi", max_tokens=2), timeout=60).status == "finished"


@pytest.mark.parametrize("holder", ["", "  ", "evil\nname", "\x1b[2Jx", "x" * 65, 5])
def test_holders_are_short_printable_names(make_system, holder):
    m = make_system().maintenance
    with pytest.raises(MaintenanceRefused, match="holder"):
        m.enter_exclusive(holder)
    assert m.mode()["mode"] == "serving"


def test_register_values_are_32_bit_integers_or_plain_digits(make_system):
    m = make_system().maintenance
    lease = m.enter_exclusive("alice")
    for bad in (True, 1.9, float("inf"), b"12", "1_000", "\u0663", "-1", 2**32, -1, "0x1FFFFFFFF", None):
        with pytest.raises(MaintenanceRefused, match="value"):
            m.write_register(lease, "CHIP1_SCRATCH", bad)
    assert m.write_register(lease, "CHIP1_SCRATCH", " 7 ")["new"] == 7
    assert m.write_register(lease, "CHIP1_SCRATCH", "0x10")["new"] == 16
    assert m.write_register(lease, "CHIP1_SCRATCH", 0xFFFFFFFF)["new"] == 0xFFFFFFFF
    for kw in (dict(chip=True), dict(factor=True), dict(count=True)):
        with pytest.raises(MaintenanceRefused):
            m.inject_fault(lease, "slow_chip", **kw)
    m.leave_exclusive(lease)


def test_audit_records_stay_bounded_json(make_system):
    m = make_system().maintenance
    lease = m.enter_exclusive("alice")
    with pytest.raises(MaintenanceRefused):
        m.read_register(lease, "A" * 5_000_000)
    with pytest.raises(MaintenanceRefused):
        m.inject_fault(lease, "slow_chip", chip=float("nan"))
    m.leave_exclusive(lease)
    lines = m.audit.path.read_bytes().splitlines()
    assert max(len(line) for line in lines) < 4096
    for line in lines:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in the audit log"))
    assert not any("corrupt" in e for e in m.audit.read())


def test_golden_check_uses_the_stored_ids_and_reports_damage_in_one_line(tmp_path):
    import shutil

    from sim_backend.bundle.manifest import DEFAULT_BUNDLE_DIR

    bdir = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bdir)
    g = dict(np.load(bdir / "golden.npz"))
    g["input_ids"] = np.array([151644, 872, 198, 6023, 151645, 199], dtype=np.int32)
    np.savez(bdir / "golden.npz", **g)
    p = subprocess.run([sys.executable, "-m", "sim_backend.model.golden", "--check", "--bundle", str(bdir)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and json.loads(p.stdout)["ok"] is False and "input_ids" in p.stdout
    (bdir / "golden.npz").write_bytes(b"PK\x03\x04 damaged")
    p = subprocess.run([sys.executable, "-m", "sim_backend.model.golden", "--check", "--bundle", str(bdir)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_snapshot_wire_form_is_strict_json_after_a_cancelled_request(make_system):
    s = make_system(numerics=False)
    assert s.inference.generate(ChatRequest.from_prompt("hi", max_tokens=3), timeout=60).status == "finished"
    h = s.inference.submit(ChatRequest.from_prompt("cancel me", max_tokens=2000))
    h.cancel("test")  # before its first token: its TTFT is undefined
    h.result(30)
    deadline = time.monotonic() + 10
    while s.observation.snapshot().slots[0].state != "idle" and time.monotonic() < deadline:
        time.sleep(0.01)
    snap = s.observation.snapshot()
    text = json.dumps(snap.to_dict(), allow_nan=False)  # raises on NaN / inf
    back = Snapshot.from_dict(json.loads(text))
    assert back == snap
    assert isinstance(TokenEvent, type)


def test_a_failed_health_check_shows_until_one_passes(make_system, monkeypatch):
    s = make_system(numerics=False)
    m = s.maintenance
    lease = m.enter_exclusive("alice")
    monkeypatch.setattr(s.engine, "buffer_pool_state", lambda timeout=0.0: (0, 1))  # a pair never came back
    assert m.reset(lease)["ok"] is False
    status = s.observation.snapshot().device.status
    assert status.startswith("fault: last health check failed")
    assert m.mode()["health_failed"].startswith("buffer pool full")
    monkeypatch.undo()
    assert m.health_check(lease)["ok"]
    assert s.observation.snapshot().device.status == "ok" and m.mode()["health_failed"] is None
    m.leave_exclusive(lease)


def test_a_chip_given_as_text_is_named_as_given(make_system):
    # inject_fault(chip="1") said "no chip 1 (device has 2)", as if chip 1 did not exist
    from sim_backend.planes import MaintenanceArgumentError

    m = make_system(numerics=False).maintenance
    lease = m.enter_exclusive("alice")
    with pytest.raises(MaintenanceArgumentError, match=r"no chip '1' \(device has 2\)"):
        m.inject_fault(lease, "slow_chip", chip="1")
    assert m.status()["faults"] == []
    m.leave_exclusive(lease)
