"""The fleet view driven as an operator does (Pilot): four boards (one dead, one slow, one in exclusive mode,
one real llama-server), worst first; Enter opens a board's console, Esc returns."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from calconsole.fleet.config import BoardSpec, FleetConfig
from calconsole.fleet.view import BoardScreen, FleetApp, FleetTable, columns_for, sparkline
from tests.fleet.conftest import ADMIN_KEY, dead_url


async def wait_for(pilot: Any, cond: Any, timeout_s: float = 60.0) -> bool:
    """Let the app run until ``cond()`` holds (bounded): no fixed sleeps gate an assertion."""
    import time

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        await pilot.pause()
    return bool(cond())


def key_file(tmp_path: Path, name: str, key: str) -> str:
    p = tmp_path / name
    p.write_text(key + "\n")
    os.chmod(p, 0o600)
    return str(p)


def row_names(app: FleetApp) -> list[str]:
    """The board names as the table shows them, top to bottom (read off the rendered lines)."""
    lines = app.query_one(FleetTable).render().plain.splitlines()[1:]
    return [ln.split()[0] for ln in lines if ln.strip()]


def row_text(app: FleetApp, name: str) -> str:
    lines = app.query_one(FleetTable).render().plain.splitlines()[1:]
    return next(ln for ln in lines if ln.split()[0] == name)


async def test_fleet_of_four_worst_first_then_a_board_console(make_server: Any, gated_board: Any,
                                                             llama_server: Any, tmp_path: Path) -> None:
    maint = make_server(admin_key=ADMIN_KEY)
    lease = maint.system.maintenance.enter_exclusive(holder="alice@ops")
    assert lease is not None
    slow = gated_board(make_server().url)
    cfg = FleetConfig((
        BoardSpec("dead", dead_url()),
        BoardSpec("slow", slow.url),
        BoardSpec("maint", maint.url, admin_key_file=key_file(tmp_path, "admin.key", ADMIN_KEY)),
        BoardSpec("llama", llama_server.url),
    ), refresh_hz=4.0, timeout_s=30.0)
    app = FleetApp(cfg)
    async with app.run_test(size=(160, 40)) as pilot:
        samples = app.monitor.samples
        assert await wait_for(pilot, lambda: samples["dead"].state == "unreachable"
                              and samples["maint"].state == "up" and samples["llama"].state == "up")
        assert await wait_for(pilot, lambda: row_names(app)[:1] == ["dead"])
        # the slow board is still being asked; the others went on without it
        assert samples["slow"].state == "connecting" and slow.requests >= 1
        m = samples["maint"]
        assert (m.mode, m.lease_holder, m.level) == ("exclusive", "alice@ops", "warn"), m
        assert await wait_for(pilot, lambda: row_names(app) == [s.name for s in app.ranked()])
        names = row_names(app)
        # exclusive mode is a warning; the llama-server board is ok
        assert names.index("maint") < names.index("llama"), (names, app.ranked())
        assert "exclusive · alice@ops" in row_text(app, "maint")
        lrow = row_text(app, "llama")
        assert "llama-server" in lrow and "n/r" in lrow  # KV %: not reported by llama-server
        header = app.query_one(FleetTable).render().plain.splitlines()[0]
        assert header.split()[:2] == ["board", "health"] and "KV %" in header
        head = str(app.query_one("#fleet-head").render())
        assert "4 boards" in head and "2 answering" in head  # the slow one has not answered yet
        slow.gate.set()
        assert await wait_for(pilot, lambda: samples["slow"].state == "up")
        # Enter on the board in exclusive mode: its console, with maintenance (its admin key was given)
        await wait_for(pilot, lambda: "maint" in row_names(app))
        for _ in range(row_names(app).index("maint")):  # the cursor starts on the first (worst) row
            await pilot.press("down")
        assert app.selected() == "maint"
        await pilot.press("enter")
        assert await wait_for(pilot, lambda: isinstance(app.screen, BoardScreen))
        screen = app.screen
        assert screen.spec.name == "maint"
        assert await wait_for(pilot, lambda: bool(screen.query("#observation")))
        assert screen.query("#maintenance") and screen.query("#chat")
        assert await wait_for(pilot, lambda: screen.last_snapshot is not None)
        assert screen.last_snapshot.device.mode == "exclusive"
        app._dirty = True
        app._redraw()  # a refresh tick while the board's console covers the table: skipped, no crash
        await pilot.press("escape")
        assert await wait_for(pilot, lambda: not isinstance(app.screen, BoardScreen))
        assert await wait_for(pilot, lambda: len(row_names(app)) == 4)
    maint.system.maintenance.leave_exclusive(lease)


async def test_a_board_whose_console_cannot_open_says_why(tmp_path: Path) -> None:
    app = FleetApp(FleetConfig((BoardSpec("dead", dead_url()),), refresh_hz=4.0))
    async with app.run_test(size=(100, 30)) as pilot:
        assert await wait_for(pilot, lambda: app.monitor.samples["dead"].state == "unreachable")
        assert await wait_for(pilot, lambda: row_names(app) == ["dead"])
        await pilot.press("enter")
        assert await wait_for(pilot, lambda: any("cannot open its console" in str(n.message)
                                                 for n in app._notifications))
        assert not isinstance(app.screen, BoardScreen)


def test_columns_drop_in_order_at_narrow_widths() -> None:
    wide = [c[0] for c in columns_for(200)]
    assert "history" in wide and "poll" in wide
    narrow = [c[0] for c in columns_for(78)]
    assert narrow[:2] == ["board", "health"]
    for must in ("kv", "queue", "running", "rate", "seen"):
        assert must in narrow, narrow
    assert "history" not in narrow and "poll" not in narrow and "kind" not in narrow
    assert sum(w + 2 for _, _, w, _ in columns_for(78)) <= 78


def test_sparkline_scales_to_its_maximum() -> None:
    assert sparkline([0.0, 5.0, 10.0], width=3) == "▁▅█"
    assert sparkline([None, 0.0], width=3) == "  ▁"
