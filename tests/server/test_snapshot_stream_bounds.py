"""Snapshot streams: one address never holds every place, and a stream whose reader takes nothing is cut
within a deadline on its progress, so new streams get a place while non-readers hang."""

from __future__ import annotations

import socket

import httpx

from calconsole.server import routes_snapshot

from .conftest import wait_until


def _raw_stream(s, src: str, hz: float = 10.0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: fills after a few events
    sock.bind((src, 0))
    sock.connect((s.thread.host, s.thread.port))
    sock.sendall(f"GET /snapshot/stream?hz={hz} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock


def _status(s, src: str) -> int:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=src), timeout=10) as c:
        with c.stream("GET", s.url + "/snapshot/stream?hz=1") as r:
            return r.status_code


def test_one_address_holds_at_most_half_of_the_stream_places(make_server):
    s = make_server(max_snapshot_streams=2)
    a = _raw_stream(s, "127.0.0.1")
    try:
        assert a.recv(12) == b"HTTP/1.1 200"
        with httpx.stream("GET", s.url + "/snapshot/stream?hz=1", timeout=10) as r:
            err = r.read()
        assert r.status_code == 503 and b"from 127.0.0.1 (limit 1 an address, of 2)" in err
        assert _status(s, "127.0.0.2") == 200  # another address still gets the other place
    finally:
        a.close()


def test_a_stream_that_is_never_read_is_cut_and_frees_its_place(make_server, monkeypatch):
    monkeypatch.setattr(routes_snapshot, "STALL_S", 0.5)
    s = make_server(max_snapshot_streams=1)
    sock = _raw_stream(s, "127.0.0.3")
    try:
        assert wait_until(lambda: s.face.conn_guard.count() == 1)
        (conn,) = s.face.conn_guard._all()
        # a small kernel send buffer: what the reader does not take waits in user space at once
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        reasons = s.face.conn_guard.stats.by_reason
        assert wait_until(lambda: reasons.get("stream not read for 0.5 s", 0) == 1, timeout=30)
        assert wait_until(lambda: s.face._snap_streams == 0)
        assert _status(s, "127.0.0.4") == 200
    finally:
        sock.close()
