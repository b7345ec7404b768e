"""The fleet view driven as an operator does (Pilot): four boards (one failing, one slow, one in exclusive mode,
one real llama-server), worst first; Enter opens a board's console, Esc returns; a board that does not answer
at all; a state change drawn when its sample arrives."""

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


def failing_board(make_server: Any) -> Any:
    """A served board whose device failed a job: a CCU exception armed (in exclusive mode, as the maintenance
    pane does it) and fired by the next request, not acknowledged: its status reads ``fault``."""
    from sim_backend.planes import ChatRequest

    served = make_server(admin_key=ADMIN_KEY)
    mnt = served.system.maintenance
    lease = mnt.enter_exclusive(holder="setup")
    mnt.inject_fault(lease, "ccu_exception", count=1)
    mnt.leave_exclusive(lease)
    res = served.system.inference.generate(ChatRequest.from_prompt("hi", max_tokens=4), timeout=30)
    assert res.status == "failed", res
    return served


async def test_fleet_of_four_worst_first_then_a_board_console(make_server: Any, gated_board: Any,
                                                             llama_server: Any, tmp_path: Path) -> None:
    """The issue's fleet: one failing (a fault fired), one slow (answers only when released), one in
    exclusive mode (with its admin key), one real llama-server; worst first, each row saying why."""
    failing = failing_board(make_server)
    maint = make_server(admin_key=ADMIN_KEY)
    lease = maint.system.maintenance.enter_exclusive(holder="alice@ops")
    assert lease is not None
    slow = gated_board(make_server().url)
    cfg = FleetConfig((
        BoardSpec("failing", failing.url),
        BoardSpec("slow", slow.url),
        BoardSpec("maint", maint.url, admin_key_file=key_file(tmp_path, "admin.key", ADMIN_KEY)),
        BoardSpec("llama", llama_server.url),
    ), refresh_hz=4.0, timeout_s=30.0)
    app = FleetApp(cfg)
    async with app.run_test(size=(170, 40)) as pilot:
        samples = app.monitor.samples
        assert await wait_for(pilot, lambda: samples["failing"].state == "up"
                              and samples["maint"].state == "up" and samples["llama"].state == "up")
        # the slow board is still being asked; the others went on without it
        assert samples["slow"].state == "connecting" and slow.requests >= 1
        f = samples["failing"]
        assert (f.health, f.level, f.faults_fired) == ("fault", "crit", 1), f
        assert any("fault(s) fired" in r for r in f.reasons) and f.failed is not None and f.failed >= 1
        m = samples["maint"]
        assert (m.mode, m.lease_holder, m.level) == ("exclusive", "alice@ops", "warn"), m
        assert samples["llama"].level == "ok", samples["llama"]
        assert await wait_for(pilot, lambda: row_names(app) == [s.name for s in app.ranked()])
        names = row_names(app)
        # worst first: the failing board (crit), the one in exclusive mode (warn), then the ok llama-server
        assert names.index("failing") < names.index("maint") < names.index("llama"), (names, app.ranked())
        assert "1 fired" in row_text(app, "failing") and "fault" in row_text(app, "failing")
        assert "exclusive · alice@ops" in row_text(app, "maint")
        lrow = row_text(app, "llama")
        assert "llama-server" in lrow and "n/r" in lrow  # KV %: not reported by llama-server
        header = app.query_one(FleetTable).render().plain.splitlines()[0]
        assert header.split()[:2] == ["board", "health"] and "KV %" in header
        assert "every s" in header and "poll rtt ms" in header and "poll ms" not in header
        # a calconsole board pushes its samples (stream: no round trip); the llama-server board is polled
        assert await wait_for(pilot, lambda: samples["maint"].via == "stream")
        assert await wait_for(pilot, lambda: "stream" in row_text(app, "maint"))
        assert samples["llama"].via == "poll" and samples["llama"].poll_ms is not None
        head = str(app.query_one("#fleet-head").render())
        assert "4 boards" in head and "3 answering" in head  # the slow one has not answered yet
        slow.gate.set()
        assert await wait_for(pilot, lambda: samples["slow"].state == "up")
        # its first answer was held: that poll's round trip shows it, a figure apart from the sample gap
        assert samples["slow"].poll_ms is not None and samples["slow"].poll_ms > 100, samples["slow"]
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


async def test_a_state_change_is_drawn_when_its_sample_arrives(make_server: Any) -> None:
    """A board entering exclusive mode is in the table as soon as its sample is recorded, without waiting for
    the next refresh tick (the view redraws at once when a board's state changes, else at the tick)."""
    served = make_server(admin_key=ADMIN_KEY)
    app = FleetApp(FleetConfig((BoardSpec("b", served.url),), refresh_hz=0.2))  # a tick only every 5 s
    async with app.run_test(size=(170, 30)) as pilot:
        assert await wait_for(pilot, lambda: app.monitor.samples["b"].state == "up")
        assert await wait_for(pilot, lambda: "serving" in app.row_text("b"))
        lease = served.system.maintenance.enter_exclusive(holder="bob@ops")
        try:
            poller = app.monitor.pollers[0]
            sample = await poller.poll_once()
            assert sample.mode == "exclusive"
            before = app.redraws
            app.monitor._record(sample)  # what a poll or stream event does on the app's loop
            assert app.redraws == before + 1 and "exclusive · bob@ops" in app.row_text("b")
            app.monitor._record(sample)  # the same state again: left for the tick
            assert app.redraws == before + 1
            # a tick with the same rows repaints nothing (idle boards send the same figures every second)
            app._dirty = True
            app._redraw()  # the second record grew the history: its sparkline may differ once
            table, repaints = app.query_one(FleetTable), []
            original = table.refresh
            table.refresh = lambda *a, **k: (repaints.append(1), original(*a, **k))[1]  # type: ignore[method-assign]
            app._dirty = True
            app._redraw()
            assert app.redraws == before + 3 and repaints == []
        finally:
            served.system.maintenance.leave_exclusive(lease)


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
    assert "history" in wide and "poll" in wide and "gap" in wide
    narrow = [c[0] for c in columns_for(78)]
    assert narrow[:2] == ["board", "health"]
    for must in ("kv", "queue", "running", "rate", "seen"):
        assert must in narrow, narrow
    assert "history" not in narrow and "poll" not in narrow and "gap" not in narrow and "kind" not in narrow
    assert sum(w + 2 for _, _, w, _ in columns_for(78)) <= 78


def test_sparkline_scales_to_its_maximum() -> None:
    assert sparkline([0.0, 5.0, 10.0], width=3) == "▁▅█"
    assert sparkline([None, 0.0], width=3) == "  ▁"
