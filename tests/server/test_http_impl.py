"""The guards on both HTTP/1.1 implementations of the face (``--http h11`` and ``--http httptools``): a head
deadline, a bound on an unfinished head, JSON 400s, connections registered with the guard, pipelining."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from calconsole.server.conns import GuardedH11Protocol, GuardedHttpToolsProtocol, conn_of
from calconsole.server.face import ServeConfig
from calconsole.server.run import http_impl

from .conftest import wait_until
from .test_conns import HALF_HEAD, raw_request, read_answer

IMPLS = ["h11", "httptools"]


@pytest.fixture(scope="module", params=IMPLS)
def served(request: Any, make_module_server: Any) -> Any:
    return make_module_server(http=request.param, body_timeout_s=1.0)


def _connect(url: str) -> socket.socket:
    host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def test_the_implementation_asked_is_the_one_serving(served: Any) -> None:
    want = GuardedH11Protocol if served.face.config.http == "h11" else GuardedHttpToolsProtocol
    with _connect(served.url) as s:
        s.sendall(HALF_HEAD)
        guard = served.face.conn_guard
        assert wait_until(lambda: any(isinstance(c, want) for c in guard._all()))


def test_a_head_that_never_ends_is_closed_at_its_deadline(served: Any) -> None:
    with _connect(served.url) as s:
        s.sendall(HALF_HEAD)
        t0 = time.monotonic()
        s.settimeout(10)
        assert s.recv(65536) == b""  # closed without an answer, at body_timeout_s (1 s), not at 10 s
        assert time.monotonic() - t0 < 8.0


def test_an_unfinished_head_past_64_kib_is_a_json_400(served: Any) -> None:
    with _connect(served.url) as s:
        s.sendall(HALF_HEAD + b"x" * (70 * 1024))
        status, headers, err = read_answer(s)
    assert status == 400 and headers["connection"] == "close"
    assert err["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("head", [b"GET /health HTTP/1.1\r\nno colon here\r\n\r\n",
                                  b"POST /tokenize HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"])
def test_bad_framing_is_a_json_400_and_a_close(served: Any, head: bytes) -> None:
    status, headers, err = raw_request(served.url, head)
    assert status == 400 and headers["connection"] == "close"
    assert err["error"]["type"] == "invalid_request_error"


def test_pipelined_requests_are_each_answered_and_the_connection_is_idle_after(served: Any) -> None:
    one = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with _connect(served.url) as s:
        s.sendall(one + one + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        s.settimeout(10)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    assert data.count(b"HTTP/1.1 200 OK") == 3


def test_a_request_finds_its_connection_in_its_scope(served: Any) -> None:
    seen: list[Any] = []
    guard = served.face.conn_guard
    with _connect(served.url) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        s.settimeout(10)
        assert b"200 OK" in s.recv(65536)
        assert wait_until(lambda: any(c.served == 1 and c.idle_since is not None for c in guard._all()))
        seen = [c for c in guard._all() if c.served == 1]
    assert seen and conn_of({"calconsole.conn": seen[0]}) is seen[0]


def test_the_http_setting_is_checked() -> None:
    with pytest.raises(ValueError, match="--http"):
        ServeConfig(http="h2").check()
    assert http_impl("auto") == "httptools"  # a dependency: installed with the project
    with pytest.raises(ValueError, match="--http"):
        http_impl("h2")
