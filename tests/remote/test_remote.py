"""The HTTP client planes beyond the shared contract: attaching, keys, connection loss, lease renewal and lapse.

Servers run in this process on 127.0.0.1:0 (``ServerThread``); every wait is bounded.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from calconsole.remote import RemoteAuthError, ServerUnreachable, connect
from calconsole.server.face import ServingFace
from calconsole.server.run import ServerThread
from sim_backend.planes import ChatRequest, MaintenanceRefused, SamplingParams, TokenEvent
from tests.waits import wait_until

from .conftest import ADMIN_KEY, API_KEY


def long_req(n: int = 4000) -> ChatRequest:
    return ChatRequest.from_prompt("tell me a long story", max_tokens=n, sampling=SamplingParams(seed=3))


# --- attaching ------------------------------------------------------------------------------


def test_without_an_admin_key_there_is_no_maintenance_plane(make_server: Any) -> None:
    s = make_server(api_key=API_KEY, admin_key=ADMIN_KEY)
    with connect(s.url, api_key=API_KEY) as client:
        assert client.maintenance is None
        assert client.observation.snapshot().device.name == s.system.observation.snapshot().device.name


def test_refused_keys_and_a_dead_address_are_typed_errors(make_server: Any) -> None:
    s = make_server(api_key=API_KEY, admin_key=ADMIN_KEY)
    with pytest.raises(RemoteAuthError):
        connect(s.url, api_key="wrong-key-000000")
    with pytest.raises(MaintenanceRefused, match="admin key"):
        connect(s.url, api_key=API_KEY, admin_key=API_KEY)
    n_audit = len(s.system.maintenance.audit.entries())
    assert n_audit >= 1  # the refused admin key was audited by the server
    plain = make_server(api_key=API_KEY)  # no admin key on the server: no maintenance routes
    with pytest.raises(MaintenanceRefused, match="no such maintenance route"):
        connect(plain.url, api_key=API_KEY, admin_key=ADMIN_KEY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    with pytest.raises(ServerUnreachable):
        connect(f"http://127.0.0.1:{port}")
    with pytest.raises(ValueError, match="http"):
        connect("ftp://example.org")


def test_tokenizer_calls_match_the_in_process_plane(make_server: Any) -> None:
    s = make_server()
    local = s.system.inference
    with connect(s.url) as client:
        inf = client.inference
        text = "héllo <|im_end|> wörld"
        for special in (False, True):
            assert inf.tokenize(text, parse_special=special) == local.tokenize(text, parse_special=special)
        ids = local.tokenize("日本語のテキスト")
        assert inf.detokenize(ids) == local.detokenize(ids)
        assert [inf.token_bytes(t) for t in ids] == [local.token_bytes(t) for t in ids]
        msgs = [{"role": "user", "content": "hi"}]
        assert inf.apply_template(msgs) == local.apply_template(msgs)
        assert inf.chat_template == local.chat_template and inf.n_ctx == local.n_ctx


def test_a_raw_prompt_streams_through_v1_completions(make_server: Any) -> None:
    s = make_server()
    with connect(s.url) as client:
        ids = client.inference.tokenize("once upon a time")
        req = ChatRequest(messages=(), prompt_tokens=tuple(ids), max_tokens=5, sampling=SamplingParams(seed=9))
        res = client.inference.generate(req, timeout=60)
        local = s.system.inference.generate(req, timeout=60)
    assert res.status == "finished" and res.tokens == local.tokens and res.timings.predicted_n == 5


# --- connection loss ------------------------------------------------------------------------


def test_stopping_the_server_mid_stream_ends_the_stream_with_the_servers_reason(make_server: Any) -> None:
    s = make_server()
    client = connect(s.url)
    try:
        h = client.inference.submit(long_req())
        assert isinstance(h.next_event(30.0), TokenEvent)
        s.thread.stop()
        res = h.result(30.0)  # bounded: the server's error event, or the lost connection
        assert res.status in ("cancelled", "failed") and h.done
        assert "shutting down" in res.error["message"] or "lost" in res.error["message"]
        # the snapshot now fails with a typed error and the plane says since when it is disconnected
        with pytest.raises(ServerUnreachable):
            client.observation.snapshot()
        assert not client.connected and client.disconnected_since is not None
    finally:
        client.close()


def _dropping_server(chunks: list[bytes]) -> tuple[int, threading.Thread]:
    """A server that answers one request with SSE headers and ``chunks``, then drops the connection."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(10.0)

    def run() -> None:
        try:
            conn, _ = srv.accept()
            conn.settimeout(5.0)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int([ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")]
                         [0])
            while len(rest) < length:
                rest += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-request-id: 7\r\n"
                         b"x-prompt-tokens: 11\r\ntransfer-encoding: chunked\r\n\r\n")
            for c in chunks:
                conn.sendall(f"{len(c):x}\r\n".encode() + c + b"\r\n")
            conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        finally:
            srv.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return srv.getsockname()[1], t


def test_a_dropped_connection_ends_the_stream_failed_never_hung(make_server: Any) -> None:
    from calconsole.remote import Connection, RemoteInferencePlane

    port, t = _dropping_server([b'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
                                b'data: {"choices":[{"index":0,"delta":{"content":"lo"}}]}\n\n'])
    conn = Connection(f"http://127.0.0.1:{port}")
    props = {"default_generation_settings": {"n_ctx": 40960}, "device": {"step_timeout_s": 5.0}}
    inf = RemoteInferencePlane(conn, props, n_vocab=151936)
    try:
        h = inf.submit(ChatRequest.from_prompt("hi", max_tokens=8))
        assert h.id == 7 and h.prompt_n == 11
        events = list(h.stream(timeout=30.0))
        res = h.result(1.0)
    finally:
        conn.close()
        t.join(5.0)
    assert [e.text for e in events[:-1]] == ["Hel", "lo"]
    assert res.status == "failed" and res.error["type"] == "connection_lost" and "lost mid-stream" in \
        res.error["message"]
    assert res.text == "Hello" and res.timings.prompt_n == 11
    assert not conn.connected


def test_the_planes_reconnect_when_the_server_returns(make_server: Any) -> None:
    s = make_server()
    port = s.thread.port
    client = connect(s.url)
    try:
        before = client.observation.snapshot().jobs.finished
        s.thread.stop()
        with pytest.raises(ServerUnreachable):
            client.observation.snapshot()
        with pytest.raises(ServerUnreachable) as ei:  # within the back-off: no new attempt
            client.observation.snapshot()
        assert ei.value.retry_in_s > 0
        face = ServingFace(s.system.inference, s.system.observation, None, s.face.config)
        again = ServerThread(face, port=port).start()
        try:
            def back() -> bool:
                try:
                    client.observation.snapshot()
                except ServerUnreachable:
                    return False
                return True

            assert wait_until(back, timeout=15.0, step=0.2)
            assert client.connected and client.disconnected_since is None
            assert client.inference.generate(long_req(4), timeout=60).status == "finished"
            assert client.observation.snapshot().jobs.finished > before
        finally:
            again.stop()
    finally:
        client.close()


# --- the lease ------------------------------------------------------------------------------


def test_the_lease_is_renewed_past_its_ttl(make_server: Any) -> None:
    s = make_server(admin_key=ADMIN_KEY, lease_ttl_s=2.0)
    with connect(s.url, admin_key=ADMIN_KEY) as client:
        m = client.maintenance
        lease = m.enter_exclusive("renew-test")
        first = s.face.leases.held.expires_mono  # the deadline the grant set (server's host monotonic s)

        def renewed_past_the_first_ttl() -> bool:
            h = s.face.leases.held  # a renewal accepted 1.5 ttl after the grant: the lease outlived its ttl
            return h is not None and h.expires_mono > first + 3.0

        assert wait_until(renewed_past_the_first_ttl, timeout=20.0)
        assert m.lease == lease and m.lease_lost is None
        assert m.read_register(lease, "CHIP0_SCRATCH")["ok"]
        m.leave_exclusive(lease)
        assert m.lease is None and m.mode()["mode"] == "serving"
    statuses = [(e["action"], e["status"]) for e in s.system.maintenance.audit.entries()]
    assert ("renew_lease", "refused") not in statuses  # no renewal was sent after the release


def test_a_lease_the_server_let_lapse_is_reported_lost(make_server: Any) -> None:
    s = make_server(admin_key=ADMIN_KEY, lease_ttl_s=2.0)
    with connect(s.url, admin_key=ADMIN_KEY) as client:
        m = client.maintenance
        lost: list[tuple[str, str]] = []
        m.on_lease_lost(lambda lease, reason: lost.append((lease.holder, reason)))
        lease = m.enter_exclusive("lapse-test")
        m._stop_renewer()  # the holder stops renewing, as a hung console would
        assert wait_until(lambda: s.system.maintenance.mode()["mode"] == "serving", timeout=10.0)
        m._start_renewer(lease, 2.0)  # it wakes up: its next renewal is refused
        assert wait_until(lambda: m.lease is None, timeout=10.0)
        # over HTTP the holder is the admin key's label with the caller's own claim
        assert lost and lost[0][0] == "admin-1 (lapse-test)" and "refused" in lost[0][1]
        assert m.lease_lost is not None and "refused" in m.lease_lost["reason"]
        with pytest.raises(MaintenanceRefused):
            m.reset(lease)
    actions = [e["action"] for e in s.system.maintenance.audit.entries()]
    assert "lease_expired" in actions


def test_a_lease_is_lost_when_the_server_cannot_be_reached_for_a_ttl(make_server: Any) -> None:
    s = make_server(admin_key=ADMIN_KEY, lease_ttl_s=2.0)
    client = connect(s.url, admin_key=ADMIN_KEY)
    try:
        m = client.maintenance
        m.enter_exclusive("unreachable-test")
        s.thread.stop()
        assert wait_until(lambda: m.lease is None, timeout=10.0)
        assert m.lease_lost is not None and "not renewed" in m.lease_lost["reason"]
    finally:
        client.close()


def test_the_snapshot_stream_reader_reads_the_stream_and_stops(make_server: Any) -> None:
    from calconsole.remote import SnapshotStreamReader

    s = make_server()
    got: list[Any] = []
    with connect(s.url) as client:
        feed = SnapshotStreamReader(client.connection, 5.0, got.append).start()
        try:
            assert wait_until(lambda: len(got) >= 2, timeout=10.0)
        finally:
            feed.stop()
        assert not feed.alive
    assert got[0].device.name == s.system.observation.snapshot().device.name
    assert got[1].taken_unix_s > got[0].taken_unix_s


def test_remote_maintenance_types_a_bad_argument_as_the_in_process_plane_does(make_server: Any) -> None:
    # over HTTP a bad argument is 400 and a state refusal 403; the remote plane raised plain
    # MaintenanceRefused for both, where the in-process plane raises MaintenanceArgumentError for the first
    from sim_backend.planes import MaintenanceArgumentError

    s = make_server(admin_key=ADMIN_KEY)
    with connect(s.url, admin_key=ADMIN_KEY) as client:
        m = client.maintenance
        with pytest.raises(MaintenanceRefused) as refused:
            m.reset(None)  # no exclusive mode: the state
        assert not isinstance(refused.value, MaintenanceArgumentError)
        lease = m.enter_exclusive("ops")
        with pytest.raises(MaintenanceArgumentError, match=r"^inject_fault refused: count must be 1\.\.1000, got -5$"):
            m.inject_fault(lease, "link_error", count=-5)
        with pytest.raises(MaintenanceArgumentError, match="no register named"):
            m.read_register(lease, "NOPE")
        assert s.system.maintenance.status()["faults"] == []  # nothing armed by the refusal
        m.leave_exclusive(lease)


def test_remote_requests_are_checked_against_the_served_models_vocabulary() -> None:
    """A token id valid for Qwen3 but outside the pilot's 49152 is refused before anything is sent."""
    from calconsole.remote import Connection, RemoteInferencePlane
    from sim_backend.errors import InvalidRequestError

    conn = Connection("http://127.0.0.1:9")  # nothing is sent: validation comes first
    props = {"default_generation_settings": {"n_ctx": 8192}, "device": {"step_timeout_s": 5.0}}
    inf = RemoteInferencePlane(conn, props, n_vocab=49152)
    try:
        assert inf.n_vocab == 49152
        with pytest.raises(InvalidRequestError, match="49152"):
            inf.submit(ChatRequest(messages=(), prompt_tokens=(1, 49152), max_tokens=4))
    finally:
        conn.close()
