"""The maintenance plane over HTTP: leases that expire, typed confirmation, audit with origin."""

from __future__ import annotations

import json

import httpx
import pytest

from sim_backend.compose import Pacing, PacingMode
from tests.server.conftest import ADMIN_KEY, wait_until

DEVICE = "calculet0"


def call(s, path, body=None, method="POST"):
    return httpx.request(method, s.url + path, json=body if method == "POST" else None,
                         headers=s.headers("admin"), timeout=60)


def enter(s, holder="ops"):
    r = call(s, "/maintenance/exclusive", {"holder": holder, "drain_timeout_s": 1})
    assert r.status_code == 200, r.text
    return r.json()



@pytest.fixture
def srv(make_server):
    return make_server(admin_key=ADMIN_KEY, system_kw={"numerics": True}, lease_ttl_s=30.0)


def test_window_over_http(srv):
    lease = enter(srv)
    assert len(lease["lease_id"]) == 32 and lease["holder"] == "admin-1 (ops)" and lease["ttl_s"] == 30.0
    assert lease["drain"] == {"drained": 0, "cancelled": 0, "wall_ms": pytest.approx(lease["drain"]["wall_ms"]),
                              "sim_ms": 0.0}
    lid = lease["lease_id"]
    h = httpx.get(srv.url + "/health")
    assert h.status_code == 503 and h.json()["error"]["type"] == "unavailable_error"
    chat = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 1})
    assert chat.status_code == 503 and "maintenance" in chat.json()["error"]["message"]
    st = call(srv, "/maintenance/status", method="GET").json()
    assert st["mode"] == "exclusive" and st["lease_holder"] == "admin-1 (ops)" and st["http_lease"]["key"] == "admin-1"
    assert "lease_id" not in json.dumps(st)
    assert call(srv, "/maintenance/self-test", {"lease_id": lid}).json()["ok"] is True
    assert call(srv, "/maintenance/health-check", {"lease_id": lid}).json()["ok"] is True
    reg = call(srv, "/maintenance/registers/read", {"lease_id": lid, "key": "D2D_LINK_ERR"}).json()
    assert reg["ok"] is True
    assert call(srv, "/maintenance/faults/inject", {"lease_id": lid, "kind": "slow_chip", "chip": 1,
                                                    "factor": 2.0}).json()["ok"] is True
    assert call(srv, "/maintenance/faults/clear", {"lease_id": lid}).json()["ok"] is True
    probe = call(srv, "/maintenance/probe", {"lease_id": lid, "prompt": "hi", "max_tokens": 2}).json()
    assert probe["ok"] is True and probe["status"] == "finished"
    assert call(srv, "/maintenance/reset", {"lease_id": lid, "device": DEVICE}).json()["ok"] is True
    assert call(srv, "/maintenance/clear-memory", {"lease_id": lid, "device": DEVICE}).json()["ok"] is True
    h = httpx.get(srv.url + "/health")
    assert h.status_code == 503 and "Loading model" in h.json()["error"]["message"]
    assert call(srv, "/maintenance/leave", {"lease_id": lid}).status_code == 403  # memory cleared: reload first
    assert call(srv, "/maintenance/reload", {"lease_id": lid}).json()["ok"] is True
    assert call(srv, "/maintenance/leave", {"lease_id": lid}).json()["ok"] is True
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    entries = srv.system.maintenance.audit.entries()
    granted = [e for e in entries if e["status"] in ("granted", "failed")]
    assert {e["action"] for e in granted} >= {"enter_exclusive", "self_test", "reset", "clear_device_memory",
                                              "reload_model", "leave_exclusive", "probe_request"}
    assert all(e["origin"] and e["origin"]["key"] == "admin-1" and e["origin"]["via"] == "http" for e in granted)
    assert ADMIN_KEY not in srv.system.maintenance.audit.path.read_text()


@pytest.mark.parametrize("body,status,what", [
    ({}, 403, "lease_id is required"),
    ({"lease_id": "0" * 32, "device": DEVICE}, 403, "not the current one"),
    ({"lease_id": None}, 403, "lease_id is required"),
    ({"lease_id": 12345}, 403, "not the current one"),
])
def test_reset_refused_without_the_lease(srv, body, status, what):
    enter(srv)
    before = len(srv.system.maintenance.audit.entries())
    r = call(srv, "/maintenance/reset", body)
    assert r.status_code == status and what in r.json()["error"]["message"]
    new = srv.system.maintenance.audit.entries()[before:]
    assert [e["status"] for e in new] == ["refused"] and new[0]["origin"]["key"] == "admin-1"


def test_reset_needs_the_device_name(srv):
    lid = enter(srv)["lease_id"]
    resets = srv.system.observation.snapshot().jobs.resets
    r = call(srv, "/maintenance/reset", {"lease_id": lid, "device": "calculet1"})
    assert r.status_code == 400 and "device name 'calculet0'" in r.json()["error"]["message"]
    r = call(srv, "/maintenance/clear-memory", {"lease_id": lid})
    assert r.status_code == 400
    assert srv.system.observation.snapshot().jobs.resets == resets
    assert srv.system.observation.snapshot().device.status != "memory cleared"


def test_second_holder_is_refused_and_sees_who_holds_it(srv):
    enter(srv, "alice")
    r = call(srv, "/maintenance/exclusive", {"holder": "bob"})
    assert r.status_code == 403 and "alice" in r.json()["error"]["message"]
    assert call(srv, "/maintenance/status", method="GET").json()["lease_holder"] == "admin-1 (alice)"


def test_bad_maintenance_bodies(srv):
    assert call(srv, "/maintenance/exclusive", {}).status_code == 400
    assert call(srv, "/maintenance/exclusive", {"holder": "x", "drain_timeout_s": "soon"}).status_code == 400
    assert call(srv, "/maintenance/audit?limit=0", method="GET").status_code == 400
    lid = enter(srv)["lease_id"]
    # a bad argument is the caller's mistake (400 invalid_request_error); a state refusal stays 403
    r = call(srv, "/maintenance/faults/inject", {"lease_id": lid, "kind": "meteor"})
    assert r.status_code == 400 and "meteor" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"
    for body in ({"lease_id": lid, "kind": "link_error", "count": -5},
                 {"lease_id": lid, "kind": "slow_chip", "chip": 7, "factor": 2.0}):
        r = call(srv, "/maintenance/faults/inject", body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", body
    r = call(srv, "/maintenance/registers/write", {"lease_id": lid, "key": "NO_SUCH_REG", "value": 1})
    assert r.status_code == 400, r.text
    assert call(srv, "/maintenance/exclusive", {"holder": "bob"}).status_code == 403  # state: already held
    r = call(srv, "/maintenance/probe", {"lease_id": lid, "max_tokens": 10_000})
    assert r.status_code == 400


class StepClock:
    """A host clock the test moves (``LeaseTable(clock=...)``): lease deadlines without waiting for them."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def served_with_a_test_clock(make_server):
    s = make_server(admin_key=ADMIN_KEY, lease_ttl_s=2.0)
    clock = StepClock()
    s.face.leases.clock = clock  # before any lease is granted: the lease reads the table's clock
    return s, clock


def test_lease_lapses_without_renewal(make_server):
    s, clock = served_with_a_test_clock(make_server)
    lid = enter(s, "crashy")["lease_id"]
    assert s.system.maintenance.mode()["mode"] == "exclusive"
    clock.t += 1.9  # within the ttl: still held
    assert call(s, "/maintenance/status", method="GET").json()["http_lease"]["expires_in_s"] == pytest.approx(0.1)
    assert s.system.maintenance.mode()["mode"] == "exclusive"
    clock.t += 0.2  # past it: the reaper (every 0.5 s) takes the lease back
    assert wait_until(lambda: s.system.maintenance.mode()["mode"] == "serving")
    assert httpx.get(s.url + "/health").json() == {"status": "ok"}
    r = call(s, "/maintenance/self-test", {"lease_id": lid})
    assert r.status_code == 403
    actions = [e["action"] for e in s.system.maintenance.audit.entries()]
    assert "lease_expired" in actions and actions.index("lease_expired") < len(actions) - 1
    assert call(s, "/maintenance/lease/renew", {"lease_id": lid}).status_code == 403


def test_renewed_lease_holds(make_server):
    from calconsole.server.maintenance_routes import reap_expired

    s, clock = served_with_a_test_clock(make_server)
    lid = enter(s)["lease_id"]
    for _ in range(4):  # renewed every 1.5 s for 6 s, three times the 2 s ttl
        clock.t += 1.5
        r = call(s, "/maintenance/lease/renew", {"lease_id": lid})
        assert r.status_code == 200 and r.json()["expires_in_s"] == pytest.approx(2.0)
        assert reap_expired(s.face) is None  # what the reaper does finds nothing to take
        assert s.system.maintenance.mode()["mode"] == "exclusive"
    assert call(s, "/maintenance/leave", {"lease_id": lid}).json()["ok"] is True


def test_entering_drains_a_streaming_chat_with_a_reason(make_server):
    s = make_server(admin_key=ADMIN_KEY, system_kw={"pacing": Pacing(PacingMode.REALTIME, 0.5)})
    body = {"messages": [{"role": "user", "content": "long reply"}], "max_tokens": 400, "stream": True}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        r2 = call(s, "/maintenance/exclusive", {"holder": "ops", "drain_timeout_s": 0})
        assert r2.status_code == 200 and r2.json()["drain"]["cancelled"] == 1
        rest = [x for x in lines if x.startswith("data: ")]
    err = json.loads(rest[-1][len("data: "):])["error"]
    assert err["type"] == "unavailable_error" and "maintenance" in err["message"]


def test_a_lease_serves_only_the_admin_key_that_took_it(make_server):
    from calconsole.server.keys import KeyRing

    other = "second-admin-key-5555"
    s = make_server(admin_keys=KeyRing([("alice", ADMIN_KEY), ("bob", other)], "admin"))
    alice = {"Authorization": f"Bearer {ADMIN_KEY}"}
    bob = {"Authorization": f"Bearer {other}"}
    r = httpx.post(s.url + "/maintenance/exclusive", json={"holder": "alice", "drain_timeout_s": 0}, headers=alice)
    assert r.status_code == 200
    lid = r.json()["lease_id"]
    audit = s.system.maintenance.audit
    for path, body in (("/maintenance/clear-kv", {}), ("/maintenance/lease/renew", {}),
                       ("/maintenance/leave", {"force": True}), ("/maintenance/reset", {"device": DEVICE})):
        r = httpx.post(s.url + path, json={"lease_id": lid, **body}, headers=bob)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", path
        assert "admin key 'alice'" in r.json()["error"]["message"]
        last = audit.entries()[-1]
        assert last["status"] == "refused" and last["origin"]["key"] == "bob"
    assert s.system.maintenance.mode()["mode"] == "exclusive"  # bob's leave did not end alice's window
    assert httpx.post(s.url + "/maintenance/clear-kv", json={"lease_id": lid}, headers=alice).status_code == 200
    assert httpx.post(s.url + "/maintenance/leave", json={"lease_id": lid}, headers=alice).status_code == 200
    assert s.system.maintenance.mode()["mode"] == "serving"


def test_the_lease_is_held_under_the_admin_keys_name_and_the_audit_table_shows_who(make_server, capsys,
                                                                                   monkeypatch):
    # a remote console with the ops key held the lease as root@console (its own claim), and
    # 'calconsole audit' showed no caller (the origin was in --json only), refused logins no address
    from calconsole.cli import main

    s = make_server(admin_key=ADMIN_KEY)
    enter(s, holder="root@console")
    assert s.system.observation.snapshot().device.lease_holder == "admin-1 (root@console)"
    bad = httpx.post(s.url + "/maintenance/exclusive", json={"holder": "x"}, headers={"Authorization": "Bearer no"},
                     timeout=60)
    assert bad.status_code == 401
    path = str(s.system.maintenance.audit.path)
    audit = s.system.maintenance.audit
    assert wait_until(lambda: any(e["action"] == "/maintenance/exclusive" for e in audit.entries()))
    capsys.readouterr()
    monkeypatch.setenv("COLUMNS", "250")  # one table row a line
    assert main(["audit", "--audit-log", path, "--all"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "admin-1 from 127.0.0.1:" in out and "no valid key from 127.0.0.1:" in out
