"""Attacks on the serving face by a careless or hostile client, each a defect found and fixed.

Every test drives a real server on 127.0.0.1:0 (``make_server``) or a ``calconsole serve``
process, and checks the invariants after the attack: a llama-server error body (never a
traceback), ``/health`` still answering, nothing left in flight.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import time

import httpx
import pytest

from tests.server.conftest import ADMIN_KEY, wait_until
from tests.server.test_serve_cli import start as start_process

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _is_error(r: httpx.Response, status: int, type_: str = "invalid_request_error") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] == type_ and err["message"]
    return err


@pytest.fixture(scope="module")
def srv(make_module_server):
    return make_module_server(admin_key=ADMIN_KEY)


# --- lone UTF-16 surrogates in a body: 400 (llama-server's JSON parser refuses them), not a 500 -------------

@pytest.mark.parametrize("path,raw", [
    ("/v1/chat/completions", b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"model":"\\ud800"}'),
    ("/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"stream":true,"model":"\\udc00x"}'),
    ("/apply-template", b'{"messages":[{"role":"user","content":"a\\ud800"}]}'),
])
def test_lone_surrogate_in_the_body_is_a_400(srv, path, raw):
    r = httpx.post(srv.url + path, content=raw, timeout=30)
    assert "surrogate" in _is_error(r, 400)["message"]
    assert srv.face.in_flight == 0
    # a valid pair is an ordinary character
    ok = httpx.post(srv.url + "/tokenize", content=b'{"content":"\\ud83d\\ude00"}')
    assert ok.status_code == 200 and ok.json()["tokens"]


# --- wrong types that escaped as 500s ------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [[1], "x", 3])
def test_oai_completions_stream_options_of_the_wrong_type_is_a_400(srv, opts):
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True,
                                                      "stream_options": opts})
    assert "stream_options" in _is_error(r, 400)["message"]


# "²", "①", an Arabic-Indic one: str.isdigit() is true for them, int() fails or reads a non-ASCII digit
@pytest.mark.parametrize("limit", ["%C2%B2", "%E2%91%A0", "%D9%A1"])
def test_audit_limit_with_unicode_digits_is_a_400(srv, limit):
    r = httpx.get(srv.url + "/maintenance/audit?limit=" + limit, headers=srv.headers("admin"))
    assert "limit" in _is_error(r, 400)["message"]


# --- the access log: one line per request, whatever the path holds -------------------------------------------

def test_access_log_line_cannot_be_forged_through_the_path(srv, caplog):
    with caplog.at_level(logging.INFO, logger="calconsole.serve"):
        r = httpx.get(srv.url + "/nope%0D%0A2099-01-01 calconsole.serve FORGED%1b[2J")
        assert r.status_code == 404
        assert wait_until(lambda: any("FORGED" in m for m in caplog.messages))
    lines = [m for m in caplog.messages if "FORGED" in m]
    assert len(lines) == 1 and "\n" not in lines[0] and "\r" not in lines[0] and "\x1b" not in lines[0]


# --- a client gone mid-body: a refusal, not an internal error with a traceback in the log ------------------

def test_client_gone_mid_body_is_not_an_internal_error(srv, caplog):
    with caplog.at_level(logging.INFO, logger="calconsole.serve"):
        s = socket.create_connection((srv.thread.host, srv.thread.port))
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"content\":")
        time.sleep(0.2)  # let the request reach the body read (the defect shows without it too)
        s.close()
        assert wait_until(lambda: any('"POST /tokenize"' in m for m in caplog.messages))
    assert not any("internal error" in m for m in caplog.messages)
    assert not any(r.exc_info for r in caplog.records)
    assert httpx.get(srv.url + "/health").status_code == 200


# --- maintenance: every call is audited, also one refused for a bad body --------------------------------------

@pytest.mark.parametrize("path,body", [
    ("/maintenance/exclusive", {"holder": "x", "drain_timeout_s": "soon"}),
    ("/maintenance/reset", b"{not json"),
    ("/maintenance/faults/acknowledge", {}),
    ("/maintenance/audit?limit=all", None),
])
def test_maintenance_refusal_for_a_bad_body_is_audited(srv, path, body):
    audit = srv.system.maintenance.audit
    before = len(audit.entries())
    if body is None:
        r = httpx.get(srv.url + path, headers=srv.headers("admin"))
    else:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(srv.url + path, headers=srv.headers("admin"), **kw)
    assert r.status_code == 400
    new = audit.entries()[before:]
    assert len(new) == 1 and new[0]["status"] == "refused" and new[0]["origin"]["key"] == "admin-1"
    assert new[0]["origin"]["remote"].startswith("127.0.0.1:")
    assert ADMIN_KEY not in audit.path.read_text()


# --- connections that never send a request must not lock everyone out ---------------------------------------

def test_idle_and_half_sent_connections_do_not_exhaust_the_server(make_server):
    s = make_server(max_streams=1, max_snapshot_streams=1, body_timeout_s=1.0)
    limit = s.face.request_bound.max_active  # the old connection cap: requests in progress now (conns)
    socks = []
    try:
        for i in range(limit + 4):
            c = socket.create_connection((s.thread.host, s.thread.port))
            if i % 2:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers that never end (slowloris)
            socks.append(c)

        def health_ok() -> bool:
            try:
                return httpx.get(s.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(health_ok, timeout=15)
        for c in socks:  # the server closed them: at the head deadline, or answered 503 to make room
            c.settimeout(5)
            try:
                data = b""
                while chunk := c.recv(4096):
                    data += chunk
                assert data == b"" or data.startswith(b"HTTP/1.1 503 ")
            except ConnectionResetError:
                pass
    finally:
        for c in socks:
            c.close()


# --- SIGTERM: open streams end with an unavailable_error event (README), whatever their pace ------------------

def _last_data(lines) -> dict:
    rest = [x for x in lines if x.startswith("data: ")]
    assert rest, "stream ended without an event"
    return json.loads(rest[-1][len("data: "):])


@pytest.mark.parametrize("route", ["chat", "snapshot"])
def test_sigterm_ends_a_fast_stream_with_an_error_event(tmp_path, route):
    p, url = start_process(tmp_path, "--pacing", "realtime", "--speed", "4")
    try:
        if route == "chat":
            req = httpx.stream("POST", url + "/v1/chat/completions", timeout=30,
                               json={"messages": [{"role": "user", "content": "go on"}], "max_tokens": 20000,
                                     "stream": True})
        else:
            req = httpx.stream("GET", url + "/snapshot/stream?hz=0.1", timeout=30)
        with req as r:
            lines = r.iter_lines()
            next(lines)
            p.send_signal(signal.SIGTERM)
            last = _last_data(lines)
        assert last["error"]["type"] == "unavailable_error" and "shutting down" in last["error"]["message"]
        assert p.wait(timeout=30) == 0
        assert "Traceback" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()


def test_leave_with_a_bad_field_is_audited(make_server):
    s = make_server(admin_key=ADMIN_KEY)
    h = s.headers("admin")
    lid = httpx.post(s.url + "/maintenance/exclusive", json={"holder": "ops"}, headers=h).json()["lease_id"]
    audit = s.system.maintenance.audit
    before = len(audit.entries())
    r = httpx.post(s.url + "/maintenance/leave", json={"lease_id": lid, "force": "yes"}, headers=h)
    assert "'force'" in _is_error(r, 400)["message"]
    new = audit.entries()[before:]
    assert [e["status"] for e in new] == ["refused"] and "force" in str(new[0])
    assert lid not in json.dumps(new)  # the refusal names no lease id (the holder's secret)
    assert httpx.post(s.url + "/maintenance/leave", json={"lease_id": lid}, headers=h).status_code == 200
