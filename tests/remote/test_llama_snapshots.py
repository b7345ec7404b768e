"""Snapshot tests (pytest-textual-snapshot) of the console attached to a REAL llama-server, at 80x24, 100x30,
120x36 and 160x48, one pane at a time and in columns.

Deterministic by construction: a server of its own per test (xllamacpp + SmolLM2, one slot, one thread: no
prompt cached by another test), a greedy reply (temperature 0) to the first request it serves, the console's
home (the audit log's directory in the maintenance pane) at the test's own ``tmp_path`` shown as ``~``, and
the reply's wall-clock figures masked (``_short_ms``: TTFT / TPOT read ``<ms>``). The observation pane is not
pictured: its busy % history, tok/s and P95 latencies are wall-clock measurements of the server (tested for
whole headings and figures in test_llama_console instead); in columns the layout is the operator's without it
(chat above maintenance, as ``Layout.without`` gives). A new xllamacpp (llama.cpp build, shown as
``b0-unknown`` in the header) or SmolLM2 wheel may change the greedy reply: regenerate (``--snapshot-update``)
after looking at the picture.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.remote import connect
from calconsole.settings import Settings
from tests.console.pilot_helpers import log_text, wait_for


@pytest.fixture
def own_llama_server() -> Iterator[Any]:
    from tests.real.llama_server import start_llama_server

    server = start_llama_server(n_parallel=1, n_ctx=1024)
    try:
        yield server
    finally:
        server.stop()


def _mask_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """The header's "attached to URL" with the server's ephemeral port masked (a wide header shows it)."""
    import re

    import calconsole.app as app_mod

    real = app_mod.server_render.topbar_parts

    def masked(snap: Any, url: str | None = None, single: bool = False) -> Any:
        return real(snap, None if url is None else re.sub(r":\d+", ":<port>", url), single)

    monkeypatch.setattr(app_mod.server_render, "topbar_parts", masked)


@pytest.fixture
def attached(own_llama_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CalConsoleApp]:
    import calconsole.panes.chat as chat_mod

    monkeypatch.setenv("HOME", str(tmp_path))  # the audit log's directory reads "~/."
    monkeypatch.setattr(chat_mod, "_short_ms", lambda v: "<ms>")  # wall-clock figures: masked
    _mask_port(monkeypatch)
    system = connect(own_llama_server.url, audit_path=tmp_path / "audit.jsonl")
    try:
        # one pane at a time at every size (auto gives it below 120x36; above, the palette's forced mode)
        yield CalConsoleApp(system, load_layout("operator"), refresh_hz=4, settings=Settings(panes="single"))
    finally:
        system.close()


@pytest.fixture
def attached_columns(own_llama_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[CalConsoleApp]:
    """The console in columns (the operator layout less the observation pane: its figures are wall-clock)."""
    import calconsole.panes.chat as chat_mod

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(chat_mod, "_short_ms", lambda v: "<ms>")
    _mask_port(monkeypatch)
    system = connect(own_llama_server.url, audit_path=tmp_path / "audit.jsonl")
    try:
        yield CalConsoleApp(system, load_layout("operator").without("observation"), refresh_hz=4,
                            settings=Settings(panes="columns"))
    finally:
        system.close()


async def exchange(pilot) -> None:
    """A greedy message sent in the chat pane (F2), its reply and figures line in the transcript, the server
    idle again in the header."""
    app = pilot.app
    await pilot.press("f2")
    chat = app.query_one("#chat")
    assert await wait_for(pilot, lambda: chat.size.height > 0 and app.last_snapshot is not None)
    app.query_one("#p-max-tokens").value = "40"
    app.query_one("#p-temperature").value = "0"
    app.query_one("#chat-input").focus()
    await pilot.press(*"Write one sentence about the sea.", "enter")
    assert await wait_for(pilot, lambda: chat.handle is None and chat.full_figures
                          and " tok · " in log_text(app, "#chat-log") and not app.query_one("#chat-log").pending,
                          timeout_s=60)
    assert await wait_for(pilot, lambda: all(s.state == "idle" for s in app.last_snapshot.slots)
                          and "run -" in str(app.query_one("#topbar").render()), timeout_s=20), \
        (str(app.query_one("#topbar").render()), [s.state for s in app.last_snapshot.slots])


async def settle(pilot) -> None:
    for inp in pilot.app.query(Input):
        inp.cursor_blink = False
    pilot.app.screen.refresh(layout=True)
    await pilot.pause()
    await pilot.pause()


def test_chat_pane_on_llama_server_at_80x24(snap_compare, attached: CalConsoleApp) -> None:
    async def run_before(pilot) -> None:
        await exchange(pilot)
        await settle(pilot)

    assert snap_compare(attached, terminal_size=(80, 24), run_before=run_before)


def test_maintenance_pane_on_llama_server_at_80x24(snap_compare, attached: CalConsoleApp) -> None:
    async def run_before(pilot) -> None:
        await exchange(pilot)
        app = pilot.app
        await pilot.press("f3")
        pane = app.query_one("#maintenance")
        assert await wait_for(pilot, lambda: app._focused_pane() is pane)
        await pilot.press("x")  # not offered: refused by the plane, with llama-server's reason
        assert await wait_for(pilot, lambda: "it has no exclusive mode (no admission" in log_text(app, "#m-log"))
        await settle(pilot)

    assert snap_compare(attached, terminal_size=(80, 24), run_before=run_before)


def test_chat_pane_on_llama_server_at_100x30(snap_compare, attached: CalConsoleApp) -> None:
    async def run_before(pilot) -> None:
        await exchange(pilot)
        await settle(pilot)

    assert snap_compare(attached, terminal_size=(100, 30), run_before=run_before)


@pytest.mark.parametrize("size", [(120, 36), (160, 48)])
def test_chat_pane_on_llama_server_one_pane_forced(snap_compare, attached: CalConsoleApp,
                                                   size: tuple[int, int]) -> None:
    async def run_before(pilot) -> None:
        await exchange(pilot)
        assert pilot.app.single
        await settle(pilot)

    assert snap_compare(attached, terminal_size=size, run_before=run_before)


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (120, 36), (160, 48)])
def test_chat_and_maintenance_on_llama_server_in_columns(snap_compare, attached_columns: CalConsoleApp,
                                                         size: tuple[int, int]) -> None:
    """Chat above maintenance: the exchange, and the maintenance pane's llama-server actions (health, clear
    KV, slot save / restore / erase) with no simulator row."""
    async def run_before(pilot) -> None:
        await exchange(pilot)
        app = pilot.app
        assert not app.single
        # drawn: the button and every container up to the pane shown (hidden rows keep their buttons)
        labels = " ".join(str(b.label) for b in app.query("#maintenance Button")
                          if all(w.display for w in b.ancestors_with_self if w is not app.screen))
        assert {"Save", "Restore", "Erase", "Health", "KV"} <= set(labels.replace("…", "").split()), labels
        assert "CCU" not in labels and "Write" not in labels and "Reset" not in labels, labels
        await settle(pilot)

    assert snap_compare(attached_columns, terminal_size=size, run_before=run_before)
