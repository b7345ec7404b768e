"""The console attached to a running server (``calconsole --connect``), driven with Pilot.

The server runs in this process on 127.0.0.1:0; the console gets the remote planes and cannot
tell them from the in-process ones. Every wait is bounded.
"""

from __future__ import annotations

from typing import Any

from textual.widgets import Static

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.remote import connect
from calconsole.server.face import ServingFace
from calconsole.server.run import ServerThread
from sim_backend.planes import ChatRequest
from tests.console.pilot_helpers import chat_text, click_button, confirm_ask, log_text, wait_for

from .conftest import ADMIN_KEY


def topbar(app: CalConsoleApp) -> str:
    return str(app.query_one("#topbar", Static).render())


async def test_an_attached_console_streams_chat_and_another_client_sees_it(make_server: Any) -> None:
    s = make_server()
    client = connect(s.url)
    watcher = connect(s.url)
    try:
        app = CalConsoleApp(client, load_layout("operator"))
        async with app.run_test(size=(170, 50)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            assert f"attached to {s.url}" in topbar(app)
            # without an admin key there is no maintenance pane, and no key reaches a maintenance route
            assert not app.screen_stack[0].query("#maintenance")
            assert app.check_action("focus_pane", ("maintenance",)) is False
            app.query_one("#p-max-tokens").value = "12"
            await pilot.click("#chat-input")
            await pilot.press(*"Hello there")
            await pilot.press("enter")
            assert await wait_for(pilot, lambda: app.query_one("#chat").handle is None)
            assert "generated 12 tok" in chat_text(app)
            # the console's counters follow the server's device...
            assert await wait_for(pilot, lambda: app.last_snapshot.requests.counters.finished == 1)
            # ...and a second attached client sees the same request
            assert watcher.observation.snapshot().requests.counters.finished == 1
            # a request from elsewhere (an HTTP client of the same server) shows in this console too
            watcher.inference.generate(ChatRequest.from_prompt("hi", max_tokens=3), timeout=60)
            assert await wait_for(pilot, lambda: app.last_snapshot.requests.counters.finished == 2)
    finally:
        watcher.close()
        client.close()


async def test_losing_the_server_shows_disconnected_and_the_console_recovers(make_server: Any) -> None:
    s = make_server()
    port = s.thread.port
    client = connect(s.url)
    again = None
    try:
        app = CalConsoleApp(client, load_layout("operator"), refresh_hz=4)
        async with app.run_test(size=(170, 50)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            s.thread.stop()
            assert await wait_for(pilot, lambda: "DISCONNECTED since" in topbar(app))
            assert app.last_snapshot is not None  # the last snapshot stays on screen
            face = ServingFace(s.system.inference, s.system.observation, None, s.face.config)
            again = ServerThread(face, port=port).start()
            assert await wait_for(pilot, lambda: "DISCONNECTED" not in topbar(app), timeout_s=20.0)
            assert client.connected
    finally:
        if again is not None:
            again.stop()
        client.close()


async def test_the_maintenance_window_works_over_http_with_the_lease(make_server: Any) -> None:
    s = make_server(admin_key=ADMIN_KEY, system_kw={"drain_timeout_s": 0.3})
    client = connect(s.url, admin_key=ADMIN_KEY)
    try:
        app = CalConsoleApp(client, load_layout("operator"))
        async with app.run_test(size=(170, 50)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            assert app.screen_stack[0].query("#maintenance")
            await click_button(pilot, "#m-enter")
            await confirm_ask(pilot)
            assert await wait_for(pilot, lambda: app.query_one("#maintenance").lease is not None)
            mode = s.system.maintenance.mode()
            # over HTTP the holder is the admin key's label with the console's claim: "admin-1 (user@console)"
            assert mode["mode"] == "exclusive" and mode["lease_holder"].startswith("admin-1 (")
            assert mode["lease_holder"].endswith("@console)")
            assert await wait_for(pilot, lambda: app.last_snapshot.device.mode == "exclusive")
            await click_button(pilot, "#m-leave")
            await confirm_ask(pilot)
            assert await wait_for(pilot, lambda: app.query_one("#maintenance").lease is None)
            assert s.system.maintenance.mode()["mode"] == "serving"
        entries = s.system.maintenance.audit.entries()
        granted = [e for e in entries if e["action"] == "enter_exclusive" and e["status"] == "granted"]
        assert granted  # through the server's lease and audit
    finally:
        client.close()


async def test_a_lease_lost_with_the_server_is_reported_in_the_pane(make_server: Any) -> None:
    s = make_server(admin_key=ADMIN_KEY, lease_ttl_s=2.0, system_kw={"drain_timeout_s": 0.3})
    client = connect(s.url, admin_key=ADMIN_KEY)
    try:
        app = CalConsoleApp(client, load_layout("operator"), refresh_hz=4)
        async with app.run_test(size=(170, 50)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            await click_button(pilot, "#m-enter")
            await confirm_ask(pilot)
            pane = app.query_one("#maintenance")
            assert await wait_for(pilot, lambda: pane.lease is not None)
            s.thread.stop()
            assert await wait_for(pilot, lambda: pane.lease is None, timeout_s=15.0)
            assert await wait_for(pilot, lambda: "lease lost: not renewed for 2 s" in log_text(app, "#m-log"))
            assert "DISCONNECTED since" in topbar(app)
    finally:
        client.close()
