"""Every refusal of the serving face: keys, admin routes, binds, key files, logs that never hold a key."""

from __future__ import annotations

import logging
import os

import httpx
import pytest

from calconsole.cli import main
from calconsole.server.face import ServeConfig
from calconsole.server.keys import KeyRing, KeySourceError, load_keys, parse_key_file
from tests.server.conftest import ADMIN_KEY, API_KEY, wait_until

MAINT_PATHS = ["/maintenance/status", "/maintenance/audit", "/maintenance/exclusive", "/maintenance/lease/renew",
               "/maintenance/leave", "/maintenance/reset", "/maintenance/clear-memory", "/maintenance/reload",
               "/maintenance/clear-kv", "/maintenance/self-test", "/maintenance/health-check", "/maintenance/dump",
               "/maintenance/registers", "/maintenance/registers/read", "/maintenance/registers/write",
               "/maintenance/faults/inject", "/maintenance/faults/clear", "/maintenance/faults/acknowledge",
               "/maintenance/probe"]


@pytest.fixture(scope="module")
def keyed(make_module_server):
    return make_module_server(api_key=API_KEY, admin_key=ADMIN_KEY)


def test_health_needs_no_key_everything_else_does(keyed):
    assert httpx.get(keyed.url + "/health").status_code == 200
    for path in ("/props", "/slots", "/metrics", "/v1/models", "/snapshot"):
        r = httpx.get(keyed.url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        r = httpx.get(keyed.url + path, headers={"Authorization": "Bearer wrong-key-123456"})
        assert r.status_code == 401, path
        assert httpx.get(keyed.url + path, headers=keyed.headers("api")).status_code == 200, path
    r = httpx.post(keyed.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 1})
    assert r.status_code == 401
    assert httpx.get(keyed.url + "/props", headers={"X-Api-Key": API_KEY}).status_code == 200
    assert httpx.get(keyed.url + "/props", headers={"Authorization": f"Basic {API_KEY}"}).status_code == 401


def test_api_key_never_opens_maintenance_and_refusals_are_audited(keyed):
    audit = keyed.system.maintenance.audit
    before = len(audit.entries())
    r = httpx.post(keyed.url + "/maintenance/exclusive", json={"holder": "mallory"}, headers=keyed.headers("api"))
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.get(keyed.url + "/maintenance/status")
    assert r.status_code == 401
    keyed.face.refusals.flush(audit, force=True)  # the window's summary, as at its end or at stop
    new = audit.entries()[before:]
    # the first refusal of a window per address is written in full, the ones after it are summarised
    assert 1 <= len(new) <= 2 and all(e["status"] == "refused" for e in new)
    assert all(e["origin"]["remote"].startswith("127.0.0.1") for e in new)
    assert sum(e["args"].get("count", 1) if e["action"] == "refused_unauthenticated" else 1 for e in new) >= 2
    assert keyed.system.maintenance.mode()["mode"] == "serving"
    text = audit.path.read_text()
    assert API_KEY not in text and ADMIN_KEY not in text
    assert httpx.get(keyed.url + "/maintenance/status", headers=keyed.headers("admin")).status_code == 200


def test_admin_key_does_not_open_the_api(keyed):
    assert httpx.get(keyed.url + "/props", headers=keyed.headers("admin")).status_code == 401


def test_no_maintenance_route_exists_without_an_admin_key(make_server):
    s = make_server(api_key=API_KEY, system_kw={"maintenance": True})
    assert s.face.maintenance is None
    for path in MAINT_PATHS:
        for method in ("GET", "POST"):
            r = httpx.request(method, s.url + path, json={}, headers=s.headers("api"))
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (method, path)
    assert s.system.maintenance.mode()["mode"] == "serving"


def test_keys_never_reach_the_log(make_server, caplog):
    s = make_server(api_key=API_KEY, admin_key=ADMIN_KEY)
    with caplog.at_level(logging.INFO, logger="calconsole.serve"):
        httpx.get(s.url + "/props", headers=s.headers("api"))
        httpx.get(s.url + "/props", headers={"Authorization": "Bearer not-the-key-000"})
        httpx.get(s.url + "/maintenance/status", headers=s.headers("admin"))
        # the access line is written once the response is sent: the client may read it first
        assert wait_until(lambda: sum('"GET /' in r.getMessage() for r in caplog.records) >= 3)
    lines = [r.getMessage() for r in caplog.records if r.name == "calconsole.serve"]
    assert len(lines) >= 3 and any("key=api-1" in x for x in lines) and any("key=admin-1" in x for x in lines)
    joined = "\n".join(lines)
    assert API_KEY not in joined and ADMIN_KEY not in joined and "not-the-key" not in joined


def test_keyring_compares_every_key():
    ring = KeyRing([("a", "first-key-000"), ("b", "second-key-00")], "api")
    assert ring.match("second-key-00") == "b" and ring.match("first-key-000") == "a"
    assert ring.match("second-key-0") is None and ring.match("") is None and ring.match(None) is None
    with pytest.raises(KeySourceError, match="at least 8"):
        KeyRing([("a", "short")], "api")
    with pytest.raises(KeySourceError, match="distinct"):
        KeyRing([("a", "first-key-000"), ("a", "other-key-000")], "api")


def test_admin_key_equal_to_api_key_is_refused():
    cfg = ServeConfig(api_keys=KeyRing([("x", "same-key-1234")], "api"),
                      admin_keys=KeyRing([("y", "same-key-1234")], "admin"))
    with pytest.raises(ValueError, match="admin key must differ"):
        cfg.check()


def _key_file(tmp_path, text, mode=0o600):
    p = tmp_path / "keys"
    p.write_text(text)
    os.chmod(p, mode)
    return p


def test_key_files(tmp_path):
    p = _key_file(tmp_path, "# ops keys\nalice alice-key-0001\n\nbob-key-000002\n")
    assert parse_key_file(p, "api") == [("alice", "alice-key-0001"), ("api-2", "bob-key-000002")]
    assert load_keys("api", key_file=p).labels == ("alice", "api-2")
    with pytest.raises(KeySourceError, match="readable or writable by other users"):
        parse_key_file(_key_file(tmp_path, "k-000000001\n", 0o644), "api")
    with pytest.raises(KeySourceError, match="holds no key"):
        parse_key_file(_key_file(tmp_path, "# nothing\n"), "api")
    with pytest.raises(KeySourceError, match="line 1"):
        parse_key_file(_key_file(tmp_path, "a b c\n"), "api")
    with pytest.raises(KeySourceError, match="No such file"):
        parse_key_file(tmp_path / "missing", "admin")
    assert load_keys("api", env={"CALCONSOLE_API_KEY": "env-key-00001"}).labels == ("api-env",)
    assert load_keys("api", env={}) is None


@pytest.mark.parametrize("argv,msg", [
    (["serve", "--host", "192.0.2.1", "--port", "0"], "without an API key"),  # TEST-NET: never bindable here
    (["serve", "--api-key-file", "/nonexistent/keys"], "api key file"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-streams", "0"], "max_streams"),
    (["serve", "--queue-limit", "0"], "--queue-limit"),
    (["serve", "--lease-ttl", "1"], "--lease-ttl must be in [2, 3600]"),
    (["serve", "--ctx-size", "0"], "--ctx-size"),
    (["serve", "--request-timeout", "0"], "request_timeout_s"),
    (["serve", "--port", "BUSY"], "Address already in use"),
])
def test_serve_refuses_bad_start_up(argv, msg, capsys, monkeypatch, tmp_path):
    import socket

    import calconsole.commands.serve as serve_cmd

    def boom(*a, **k):  # a first start compiles the kernels for minutes: every check comes before it
        raise AssertionError("the simulator was built before the options and the port were checked")

    monkeypatch.setattr(serve_cmd, "build_from_args", boom)
    monkeypatch.delenv("CALCONSOLE_API_KEY", raising=False)
    monkeypatch.delenv("CALCONSOLE_ADMIN_KEY", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        argv = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in argv]
        rc = main(argv + ["--timing-only", "--audit-log", str(tmp_path / "a.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and "Traceback" not in err, err


def test_unauthenticated_refusals_are_summarised_per_peer_off_the_event_loop(make_server):
    import threading

    s = make_server(api_key=API_KEY, admin_key=ADMIN_KEY)
    audit = s.system.maintenance.audit
    writers: list[str] = []
    event = audit.event

    def spy(*a, **k):
        writers.append(threading.current_thread().name)
        return event(*a, **k)

    audit.event = spy
    before = len(audit.read())
    with httpx.Client(base_url=s.url) as c:
        for i in range(40):
            path = "/maintenance/status" if i % 2 else "/maintenance/reset"
            assert c.request("GET" if i % 2 else "POST", path, headers={"Authorization": "Bearer wrong-key-0"},
                             json=None if i % 2 else {}).status_code == 401
    assert s.face.refusals.counted == 39
    assert len(audit.read()) - before == 1  # one record, not forty
    s.face.refusals.flush(audit, force=True)
    new = audit.entries()[-2:]
    assert new[0]["status"] == "refused" and new[0]["result"].startswith("authentication failed")
    summary = new[1]
    assert summary["action"] == "refused_unauthenticated" and summary["status"] == "refused"
    assert summary["args"]["count"] == 39 and summary["args"]["remote"] == "127.0.0.1"
    assert summary["args"]["paths"] == {"/maintenance/status": 20, "/maintenance/reset": 19}
    assert summary["origin"] == {"remote": "127.0.0.1", "key": "(none)", "via": "http"}
    # every write ran in a worker thread, never on the server's event loop thread
    assert writers and "calconsole-serve" not in writers
    r = httpx.get(s.url + "/maintenance/audit?limit=1", headers=s.headers("admin"))
    assert r.status_code == 200 and r.json()["more"] is True
    assert [e["action"] for e in r.json()["entries"]] == ["refused_unauthenticated"]


def test_key_headers_are_read_as_a_real_llama_server_reads_them(keyed):
    """Bearer or X-Api-Key (Authorization decides when both are sent; another scheme is refused), and the
    refusal's body, as the real llama-server answers on /slots."""
    from tests.real.llama_server import start_llama_server

    real = start_llama_server(configure=lambda p: setattr(p, "api_keys", [API_KEY]), n_parallel=1, n_ctx=512)
    try:
        for headers in ({}, {"Authorization": f"Bearer {API_KEY}"}, {"X-Api-Key": API_KEY},
                        {"Authorization": f"Basic {API_KEY}"},
                        {"Authorization": "Bearer wrong-key-1", "X-Api-Key": API_KEY},
                        {"Authorization": f"Bearer {API_KEY}", "X-Api-Key": "wrong-key-1"}):
            theirs = httpx.get(real.url + "/slots", headers=headers, timeout=10)
            ours = httpx.get(keyed.url + "/slots", headers=headers, timeout=10)
            assert ours.status_code == theirs.status_code, headers
            if theirs.status_code == 401:
                assert ours.json() == theirs.json()
    finally:
        real.stop()
