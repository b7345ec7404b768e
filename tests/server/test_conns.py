"""Connection limits (``calconsole.server.conns``): half-open connections cannot lock anyone out, one address
cannot hold more than its share, over-limit answers are llama-server's JSON, and request framing is strict."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from calconsole.server.bounds import RequestBound
from calconsole.server.conns import ConnLimits

from .conftest import ADMIN_KEY, wait_until

HALF_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


@contextlib.contextmanager
def half_open(url: str, n: int) -> Iterator[list[socket.socket]]:
    """``n`` connections that each sent the start of a request head and never its end."""
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    socks = []
    try:
        for _ in range(n):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(HALF_HEAD)
            socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def read_answer(s: socket.socket) -> tuple[int, dict[str, str], Any]:
    """Status, headers and JSON body of the one response the server wrote before closing ``s``."""
    s.settimeout(10)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


def raw_request(url: str, data: bytes) -> tuple[int, dict[str, str], Any]:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        return read_answer(s)


@pytest.fixture(scope="module")
def served(make_module_server: Any) -> Any:
    return make_module_server(admin_key=ADMIN_KEY)


def test_half_open_connections_leave_health_and_the_admin_room(served: Any) -> None:
    # more half-open connections than the old connection cap (16 + 8 + 64): every request was a plain 503
    with half_open(served.url, 120):
        assert wait_until(lambda: served.face.conn_guard.count() >= 120)
        r = httpx.get(served.url + "/health", timeout=10, trust_env=False)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
        r = httpx.get(served.url + "/maintenance/status", headers=served.headers("admin"), timeout=10,
                      trust_env=False)
        assert r.status_code == 200 and r.json()["mode"] == "serving"


def test_one_address_cannot_hold_more_than_its_bound_open(make_server: Any) -> None:
    s = make_server(conn_limits=ConnLimits(max_idle_per_peer=4, max_conns_per_peer=4, min_idle_s=60.0))
    with half_open(s.url, 4):
        assert wait_until(lambda: s.face.conn_guard.count("127.0.0.1") == 4)
        # the fifth is answered at once in llama-server's shape and closed: nothing idle long enough to close
        with half_open(s.url, 1) as (fifth,):
            status, headers, body = read_answer(fifth)
        assert status == 503 and headers["connection"] == "close"
        assert headers["content-type"].startswith("application/json")
        assert body["error"]["type"] == "unavailable_error" and body["error"]["code"] == 503
        assert "too many open connections from 127.0.0.1 (limit 4)" in body["error"]["message"]
        assert s.face.conn_guard.count("127.0.0.1") == 4 and s.face.conn_guard.stats.refused == 1


def test_idle_connections_past_their_budget_make_room_oldest_first(make_server: Any) -> None:
    s = make_server(conn_limits=ConnLimits(max_idle_per_peer=3, min_idle_s=0.0))
    guard = s.face.conn_guard
    with half_open(s.url, 3) as old:
        assert wait_until(lambda: guard.count("127.0.0.1") == 3)
        with half_open(s.url, 1):
            assert wait_until(lambda: guard.stats.evicted_idle == 1)
            status, _, body = read_answer(old[0])  # the oldest idle one, answered and closed
            assert status == 503 and body["error"]["type"] == "unavailable_error"
            assert "sent no request" in body["error"]["message"]
            # a client that sends its head at once is served while the budget is full
            r = httpx.get(s.url + "/health", timeout=10, trust_env=False)
            assert r.status_code == 200
            assert guard.count("127.0.0.1") <= 3


def test_closes_for_an_idle_budget_are_paced_per_address(make_server: Any) -> None:
    # bench slowloris, 200 reconnecting from the probes' address at load ~20: each admit closed every connection
    # past the budget idle >= min_idle_s, and on a starved loop all were by the next admit: ~100 closes (and
    # reconnects, each an accept and a 503) a second took the server's CPU and /health waited 1-2.7 s (P95).
    # Budget 1, two closes in the bucket and (almost) no refill: the third connection past the budget stays.
    s = make_server(conn_limits=ConnLimits(max_idle_per_peer=1, min_idle_s=0.0, budget_closes_per_s=1e-3,
                                           budget_close_burst=2))
    guard = s.face.conn_guard
    socks: list[socket.socket] = []
    try:
        for k in range(1, 5):  # one at a time: the k-th is admitted before the next connects
            socks.append(socket.create_connection((s.thread.host, s.thread.port), timeout=10))
            socks[-1].sendall(HALF_HEAD)
            assert wait_until(lambda k=k: guard.count("127.0.0.1") + guard.stats.evicted_idle == k), k
        assert guard.stats.evicted_idle == 2 and guard.stats.paced >= 1
        assert guard.count("127.0.0.1") == 2  # over its budget of 1: the head deadline closes it
        for old in socks[:2]:  # the two oldest, answered in llama-server's shape
            status, _, body = read_answer(old)
            assert status == 503 and "sent no request" in body["error"]["message"]
        r = httpx.get(s.url + "/health", timeout=10, trust_env=False)  # a client is served meanwhile
        assert r.status_code == 200
    finally:
        for c in socks:
            c.close()


def test_a_head_the_late_loop_has_not_read_yet_is_not_closed_as_idle(make_server: Any) -> None:
    # bench slowloris at load ~20 on 2 CPUs: the admin got 7 of 100 /health probes as 503 "sent no request":
    # its head waited unread in the kernel while a starved loop accepted reconnects, each of which closed the
    # connections idle >= min_idle_s, the probe among them. Here the loop is held while a client connects and
    # sends its whole head and an attacker connects behind it: the attacker's admit sees the client idle.
    import threading

    s = make_server(conn_limits=ConnLimits(max_idle_per_peer=1, min_idle_s=0.0))
    guard = s.face.conn_guard
    with half_open(s.url, 1):
        assert wait_until(lambda: guard.count("127.0.0.1") == 1)
        loop = next(iter(guard._all())).loop  # the server's event loop
    assert wait_until(lambda: guard.count("127.0.0.1") == 0)
    held, release = threading.Event(), threading.Event()
    loop.call_soon_threadsafe(lambda: (held.set(), release.wait(60)))
    assert held.wait(30)
    host, port = s.thread.host, s.thread.port
    client = socket.create_connection((host, port), timeout=10)
    attacker = socket.create_connection((host, port), timeout=10)
    try:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        attacker.sendall(HALF_HEAD)
        release.set()  # both accepted in one go: the client's connection_made, then the attacker's admit
        status, _, body = read_answer(client)
        assert status == 200 and body == {"status": "ok"}, body
        assert guard.stats.spared_unread >= 1 and guard.stats.evicted_idle == 0
    finally:
        release.set()
        client.close()
        attacker.close()


def test_requests_in_progress_are_bounded_with_room_for_health() -> None:
    release = anyio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["path"] == "/slow":
            await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    bound = RequestBound(app, max_active=1, reserve=1)

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=bound), base_url="http://t") as c:
            async with anyio.create_task_group() as tg:
                tg.start_soon(c.get, "/slow")
                with anyio.fail_after(10):
                    while bound.active < 1:
                        await anyio.sleep(0.01)
                r = await c.get("/other")
                assert r.status_code == 503 and r.json()["error"]["type"] == "unavailable_error"
                assert (await c.get("/health")).status_code == 200  # the reserve
                release.set()

    anyio.run(main)
    assert bound.refused == 1


def test_content_length_with_transfer_encoding_is_refused(served: Any) -> None:
    body = b'{"content":"hi"}'
    req = (b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
           % (len(body), len(body), body))
    status, headers, err = raw_request(served.url, req)
    assert status == 400 and headers["connection"] == "close"
    assert err["error"]["type"] == "invalid_request_error" and "Transfer-Encoding" in err["error"]["message"]


def test_a_malformed_head_is_answered_in_json(served: Any) -> None:
    status, headers, err = raw_request(served.url, b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n")
    assert status == 400 and headers["content-type"].startswith("application/json")
    assert err["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/props/", "/health/", "/maintenance/status/"])
def test_no_redirect_is_built_from_the_host_header(served: Any, path: str) -> None:
    status, headers, err = raw_request(served.url, b"GET %s HTTP/1.1\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
                                       % path.encode())
    assert "location" not in headers
    assert status == 404 and err["error"]["type"] == "not_found_error"


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="max_idle_per_peer"):
        ConnLimits(max_idle_per_peer=0).check()
    with pytest.raises(ValueError, match="budget_closes_per_s"):
        ConnLimits(budget_closes_per_s=0.0).check()
    with pytest.raises(ValueError, match="budget_close_burst"):
        ConnLimits(budget_close_burst=0).check()
    with pytest.raises(ValueError, match="idle budget"):
        ConnLimits(max_idle_per_peer=10, max_conns_per_peer=5).check()


def test_large_tokenize_and_detokenize_count_against_the_bound_off_the_event_loop(make_server: Any) -> None:
    import threading

    from calconsole.server.face import HEAVY_BODY_BYTES

    s = make_server(max_streams=1)
    threads: list[str] = []
    real = s.face.inference.token_bytes

    def spy(t: int) -> bytes:
        threads.append(threading.current_thread().name)
        return real(t)

    s.face.inference.token_bytes = spy  # type: ignore[method-assign]
    big_text = "river stone " * (HEAVY_BODY_BYTES // 12 + 100)
    big_ids = {"tokens": [1000] * (HEAVY_BODY_BYTES // 5 + 100), "with_pieces": True}
    s.face._enter_generation()  # the one generation place is taken (as by a stream in flight)
    try:
        for path, big in (("/tokenize", {"content": big_text, "with_pieces": True}), ("/detokenize", big_ids)):
            rb = httpx.post(s.url + path, json=big, timeout=60, trust_env=False)
            assert rb.status_code == 503 and rb.json()["error"]["type"] == "unavailable_error", path
            assert "busy" in rb.json()["error"]["message"]
        small = httpx.post(s.url + "/tokenize", json={"content": "hi there", "with_pieces": True}, timeout=60,
                           trust_env=False)
        assert small.status_code == 200 and [p["piece"] for p in small.json()["tokens"]] == ["hi", " there"]
    finally:
        s.face._leave_generation()
    r2 = httpx.post(s.url + "/detokenize", json=big_ids, timeout=120, trust_env=False)
    assert r2.status_code == 200 and len(r2.json()["pieces"]) == len(big_ids["tokens"])
    assert s.face.in_flight == 0
    assert threads and "calconsole-serve" not in threads  # pieces built in worker threads, not on the loop


class _GoneTransport:
    """A transport whose peer is gone: ``write_eof`` fails as the kernel does on a socket never or no longer
    connected (ENOTCONN, errno 107, seen over the connection cap)."""

    def __init__(self) -> None:
        self.written = b""
        self.aborted = False

    def is_closing(self) -> bool:
        return self.aborted

    def write(self, data: bytes) -> None:
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        import errno

        raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:  # pragma: no cover - must not be reached on this path
        raise AssertionError("close after a failed write_eof: abort is what ends a gone peer")


def test_answer_and_close_to_a_gone_peer_is_quiet_and_counted() -> None:
    from types import SimpleNamespace

    from calconsole.server.conns import ConnectionGuard, ConnLimits, GuardedH11Protocol

    guard = ConnectionGuard(ConnLimits())
    t = _GoneTransport()
    conn = SimpleNamespace(closing=False, transport=t, guard=guard, loop=None, linger_s=2.0, idle_since=None, peer="?")
    GuardedH11Protocol.close_with(conn, b"HTTP/1.1 503 Service Unavailable\r\n\r\n")  # type: ignore[arg-type]
    assert conn.closing and t.aborted
    assert t.written.startswith(b"HTTP/1.1 503")
    assert guard.stats.peer_gone == 1
    GuardedH11Protocol.close_with(conn, b"again")  # type: ignore[arg-type]
    assert guard.stats.peer_gone == 1  # already closing: nothing more is written or counted


def _kept_alive(s: Any) -> socket.socket:
    """A connection that was served one /health and is kept alive (a client's pool)."""
    c = socket.create_connection((s.thread.host, s.thread.port), timeout=10)
    c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while not data.endswith(b'{"status":"ok"}'):
        chunk = c.recv(65536)
        assert chunk, data
        data += chunk
    assert data.startswith(b"HTTP/1.1 200")
    return c


def test_kept_alive_connections_are_not_closed_for_an_idle_budget(make_server: Any) -> None:
    """A pooled client's idle connection is not closed to make room for a new one: its next request is
    answered; the never-served connections past the budget are the ones closed."""
    s = make_server(conn_limits=ConnLimits(max_idle_per_peer=2, min_idle_s=0.0))
    guard = s.face.conn_guard
    pool = [_kept_alive(s) for _ in range(3)]  # over the budget of 2 by themselves
    try:
        assert wait_until(lambda: guard.count("127.0.0.1") == 3)
        with half_open(s.url, 1) as fresh, contextlib.ExitStack() as more:
            assert wait_until(lambda: guard.count("127.0.0.1") == 4
                              and all(c.unread_bytes() == 0 for c in guard._all()))  # its head start read
            more.enter_context(half_open(s.url, 1))
            assert wait_until(lambda: guard.stats.evicted_idle == 1)  # the never-served one, for the newer
            assert guard.count("127.0.0.1") == 4
            status, _, body = read_answer(fresh[0])
            assert status == 503 and "sent no request" in body["error"]["message"]
            for c in pool:
                c.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                assert read_answer(c)[:1] == (200,)
    finally:
        for c in pool:
            c.close()


def _read_one(c: socket.socket) -> tuple[int, bytes]:
    """Status and body of one Content-Length response on a connection kept open."""
    c.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    n = int(next(ln.split(b":", 1)[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")))
    while len(body) < n:
        body += c.recv(65536)
    return int(head.split()[1]), body


def test_past_the_connection_cap_a_reserve_serves_health_and_the_admin_first(make_server: Any) -> None:
    s = make_server(admin_key=ADMIN_KEY, conn_limits=ConnLimits(
        max_conns=16, max_idle=16, max_idle_per_peer=16, min_idle_s=60.0, reserve_conns=2))
    guard = s.face.conn_guard
    admin_head = (b"GET /maintenance/status HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Authorization: Bearer " + ADMIN_KEY.encode() + b"\r\n\r\n")
    with half_open(s.url, 16):
        assert wait_until(lambda: guard.count() == 16)
        status, _, body = raw_request(s.url, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert status == 503 and "connection cap" in body["error"]["message"]
        assert raw_request(s.url, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0] == 200
        assert wait_until(lambda: guard.count() == 16)
        with half_open(s.url, 2) as reserve:
            assert wait_until(lambda: guard.count() == 18 and all(c.unread_bytes() == 0 for c in guard._all()))
            admin = socket.create_connection((s.thread.host, s.thread.port), timeout=10)
            try:
                admin.sendall(admin_head)  # the reserve is full: its oldest half-open makes room
                assert _read_one(admin)[0] == 200 and guard.stats.reserve_evicted == 1
                assert read_answer(reserve[0])[0] == 503
                assert wait_until(lambda: all(c.unread_bytes() == 0 for c in guard._all()))
                with half_open(s.url, 1):  # the admin's kept-alive connection is not the one closed for it
                    assert wait_until(lambda: guard.stats.reserve_evicted == 2)
                    assert read_answer(reserve[1])[0] == 503
                    admin.sendall(admin_head)
                    assert _read_one(admin)[0] == 200
            finally:
                admin.close()
