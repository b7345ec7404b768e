"""``calconsole --listen``: the console's own device served over HTTP; a client's request shows in the console."""

from __future__ import annotations

import argparse

import httpx
import pytest

from calconsole.app import CalConsoleApp
from calconsole.cli import parse_listen, start_listening
from calconsole.layout import load_layout
from tests.console.pilot_helpers import wait_for


@pytest.mark.parametrize("spec,want", [("127.0.0.1:8080", ("127.0.0.1", 8080)), (":0", ("127.0.0.1", 0)),
                                       ("[::1]:9000", ("::1", 9000))])
def test_parse_listen(spec, want):
    assert parse_listen(spec) == want


@pytest.mark.parametrize("spec", ["8080", "host:", "host:99999", "host:http"])
def test_parse_listen_refuses(spec):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_listen(spec)


def test_listen_on_an_open_address_needs_a_key(make_system, monkeypatch):
    monkeypatch.delenv("CALCONSOLE_API_KEY", raising=False)
    system = make_system(numerics=False)
    # TEST-NET-1 (RFC 5737): refused for want of a key before any bind, and not bindable if it were tried
    args = argparse.Namespace(listen="192.0.2.1:0", api_key_file=None, admin_key_file=None)
    with pytest.raises(ValueError, match="without an API key"):
        start_listening(args, system)


async def test_http_client_drives_the_device_the_console_shows(make_system):
    system = make_system(numerics=False)
    args = argparse.Namespace(listen="127.0.0.1:0", api_key_file=None, admin_key_file=None)
    server = start_listening(args, system)
    try:
        app = CalConsoleApp(system, load_layout("operator"), listen_url=server.url)
        async with app.run_test(size=(160, 48)) as pilot:
            assert await wait_for(pilot, lambda: f"HTTP API {server.url}" in app._topbar_text)
            async with httpx.AsyncClient(timeout=60) as client:
                r = await client.post(server.url + "/v1/chat/completions",
                                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
            assert r.status_code == 200
            assert await wait_for(pilot, lambda: "requests done 1" in app._topbar_text)
    finally:
        server.stop()
