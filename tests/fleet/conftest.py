"""Boards for the fleet tests: served in-process simulators, a dead address, a gated slow board."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.conftest import ADMIN_KEY, API_KEY, ServerFactory, wait_until

__all__ = ["ADMIN_KEY", "API_KEY", "wait_until"]


@pytest.fixture
def make_server(make_system: Any) -> Iterator[ServerFactory]:
    f = ServerFactory(make_system)
    yield f
    f.stop_all()


def dead_url() -> str:
    """A loopback URL nothing listens on (a port that was just free)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class GatedBoard:
    """A board that answers only when released: every request waits on ``gate`` (at most ``hold_s`` host
    s), then is forwarded to ``target`` (a real served board). ``requests`` counts requests received."""

    def __init__(self, target: str, hold_s: float = 60.0) -> None:
        self.target = target
        self.gate = threading.Event()
        self.requests = 0
        board = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                board.requests += 1
                board.gate.wait(hold_s)
                r = httpx.get(board.target + self.path, timeout=30)
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def gated_board() -> Iterator[Any]:
    made: list[GatedBoard] = []

    def make(target: str) -> GatedBoard:
        g = GatedBoard(target)
        made.append(g)
        return g

    yield make
    for g in made:
        g.stop()
