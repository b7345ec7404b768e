"""What a slow reader can hold: replies in pieces with a send deadline, a bound on the size of a reply,
and on how many heavy replies are produced or sent at once (``conns.ReplyGuard``, ``replies``)."""

from __future__ import annotations

import json
import socket
from typing import Any

import anyio
import httpx
import pytest

from calconsole.server import replies
from calconsole.server.bounds import ReplyGuard
from calconsole.server.replies import PIECE_BYTES, json_pieces

from .conftest import wait_until


def test_json_pieces_are_the_json_of_the_whole_in_bounded_pieces():
    items = [{"id": i, "piece": "é\"" * (i % 3)} for i in range(20_000)]
    pieces = json_pieces({"content": "x"}, "pieces", iter(items), 1 << 30)
    assert len(pieces) > 1 and all(len(p) <= PIECE_BYTES for p in pieces)
    assert json.loads(b"".join(pieces)) == {"content": "x", "pieces": items}
    assert json.loads(b"".join(json_pieces({}, "tokens", iter(()), 100))) == {"tokens": []}
    assert json.loads(b"".join(json_pieces({"content": "y"}, None, (), 100))) == {"content": "y"}


def test_json_pieces_stop_at_the_limit():
    with pytest.raises(replies.ReplyTooLarge):
        json_pieces({}, "tokens", iter(range(10_000)), 1000)


def test_detokenize_with_pieces_answers_in_pieces(make_server):
    s = make_server()
    ids = [9707, 11, 1879, 0] * 5000  # 20,000 ids: a ~0.5 MB reply, over several pieces
    r = httpx.post(s.url + "/detokenize", json={"tokens": ids, "with_pieces": True}, timeout=60)
    assert r.status_code == 200 and int(r.headers["Content-Length"]) == len(r.content) > 2 * PIECE_BYTES
    body = r.json()
    assert body["content"] == "Hello, world!" * 5000
    assert [p["id"] for p in body["pieces"]] == ids and body["pieces"][0] == {"id": 9707, "piece": "Hello"}


def test_a_reply_over_its_limit_is_a_400(make_server, monkeypatch):
    monkeypatch.setattr(replies, "REPLY_PER_BODY", 2)
    s = make_server(max_body_bytes=4096)
    r = httpx.post(s.url + "/detokenize", json={"tokens": [1] * 1000, "with_pieces": True}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error" and "8192 bytes" in err["message"]


def _scope(path: str = "/detokenize", size: int = 1 << 20, peer: str = "127.0.0.1") -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "client": (peer, 1),
            "headers": [(b"content-length", str(size).encode())]}


def test_heavy_replies_beyond_their_places_are_503():
    """Two places, one an address: a second heavy reply of one address and a third of any are refused at once;
    a small body or another route is not heavy."""
    release = anyio.Event()
    sent: list[tuple[str, list[dict[str, Any]]]] = []

    async def app(scope, receive, send):
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = ReplyGuard(app, None, send_timeout_s=5.0, heavy_body_bytes=65536, places=2)

    async def one(name: str, scope: dict[str, Any]) -> None:
        out: list[dict[str, Any]] = []

        async def send(m):
            out.append(m)

        await guard(scope, None, send)
        sent.append((name, out))

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, "a1", _scope(peer="10.0.0.1"))
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(one, "a2", _scope(peer="10.0.0.1"))  # this address's one place is taken
            tg.start_soon(one, "b1", _scope(path="/tokenize", peer="10.0.0.2"))
            await anyio.wait_all_tasks_blocked()
            assert guard.active == 2
            tg.start_soon(one, "c1", _scope(peer="10.0.0.3"))  # every place is taken
            tg.start_soon(one, "small", _scope(size=1000, peer="10.0.0.3"))
            tg.start_soon(one, "other", _scope(path="/completion", peer="10.0.0.3"))
            await anyio.wait_all_tasks_blocked()
            release.set()

    anyio.run(main)
    status = {name: out[0]["status"] for name, out in sent}
    assert status == {"a1": 200, "b1": 200, "a2": 503, "c1": 503, "small": 200, "other": 200}
    msg = {name: json.loads(out[1]["body"])["error"]["message"] for name, out in sent if out[0]["status"] == 503}
    assert "for 10.0.0.1 (limit 1 an address)" in msg["a2"] and "(limit 2)" in msg["c1"]
    assert guard.active == 0


def test_a_big_body_message_is_sent_in_pieces_and_a_piece_not_taken_ends_the_reply():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x" * (3 * PIECE_BYTES + 5)})

    guard = ReplyGuard(app, None, send_timeout_s=0.2, heavy_body_bytes=65536, places=1)
    got: list[int] = []

    async def send(m):
        if m["type"] == "http.response.body":
            got.append(len(m["body"]))
            if len(got) == 2:
                await anyio.sleep_forever()  # the reader stops taking pieces

    anyio.run(guard, _scope(path="/x", size=0), None, send)
    assert got == [PIECE_BYTES, PIECE_BYTES]  # the rest is dropped, the app is not held


def test_a_client_that_never_reads_a_big_reply_is_cut_by_the_send_deadline(make_server):
    s = make_server(send_timeout_s=0.5)
    body = json.dumps({"tokens": [9707] * 10_000, "with_pieces": True}).encode()  # a ~260 KB reply
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server's queue fills soon
    try:
        sock.connect((s.thread.host, s.thread.port))
        assert wait_until(lambda: s.face.conn_guard.count() == 1)
        # the kernel's send buffer made small, as a reply bigger than it is (~4 MB on Linux) finds it
        (conn,) = s.face.conn_guard._all()
        conn.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.sendall(b"POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        stats = s.face.conn_guard.stats
        assert wait_until(lambda: stats.send_deadline >= 1, timeout=30)
        assert wait_until(lambda: s.face.conn_guard.count() == 0, timeout=10)
    finally:
        sock.close()
    assert httpx.get(s.url + "/health").status_code == 200
