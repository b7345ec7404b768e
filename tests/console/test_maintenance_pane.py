"""A full maintenance window walked in the console with Pilot, and the --observe-only guarantee."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from textual.widgets import Button

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.panes.maintenance import MaintenancePane
from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from tests.console.pilot_helpers import chat_text, click_button, confirm_ask, enter_exclusive, has, log_text, wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def system(make_system):
    return make_system(drain_timeout_s=0.5)


async def chat(pilot, app, text: str, max_tokens: int) -> None:
    app.query_one("#p-max-tokens").value = str(max_tokens)
    app.query_one("#chat-input").focus()
    await pilot.pause()  # focus() is applied on the next message-loop turn
    assert app.focused.id == "chat-input"
    await pilot.press(*text)
    await pilot.press("enter")


async def test_full_maintenance_window(system):
    app = CalConsoleApp(system, load_layout("operator"))
    m = system.maintenance
    async with app.run_test(size=(160, 50)) as pilot:
        pane = app.query_one(MaintenancePane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        # outside exclusive mode every guarded button is disabled and the keys do nothing
        for sel in ("#m-reset", "#m-clear", "#m-reload", "#m-selftest", "#m-f-ccu", "#m-probe", "#m-leave"):
            assert app.query_one(sel, Button).disabled, sel
        app.query_one("#m-reset").focus()  # disabled: focus stays elsewhere in the app
        app.query_one("#m-log").focus()
        await pilot.pause()
        assert app.focused.id == "m-log"
        await pilot.press("r", "c", "t", "p", "f", "l")
        # each key was handled (it says why it did nothing), then: nothing opened, nothing reached the plane
        assert await wait_for(pilot, lambda: all(has(app, "#m-log", f"key {k}: enter exclusive mode first (x)")
                                                 for k in "rctpfl")), log_text(app, "#m-log")
        assert len(app.screen_stack) == 1 and pane.lease is None
        assert m.audit.entries() == []  # nothing reached the plane

        # a chat reply is streaming ...
        await chat(pilot, app, "hello", 3000)
        chat_pane = app.query_one("#chat")
        assert await wait_for(pilot, lambda: chat_pane.handle is not None and chat_pane._stream_text)
        # ... when the operator enters exclusive mode; the mode a snapshot reports while the drain runs
        # (read inside the engine's drain itself: a sampling thread could be starved past a 0.5 s drain)
        seen: list[str] = []
        drain = system.engine.gate.drain

        def drain_and_look(*a, **k):
            seen.append(m.mode()["mode"])
            return drain(*a, **k)

        system.engine.gate.drain = drain_and_look
        await enter_exclusive(pilot, pane)
        seen.append(m.mode()["mode"])
        assert seen == ["draining", "exclusive"]  # the bounded drain (0.5 s) shows as a mode
        assert await wait_for(pilot, lambda: chat_pane.handle is None)
        cancelled = "[cancelled: device entering maintenance: not finished within the 0.5 s drain]"
        assert cancelled in log_text(app, "#chat-log")
        assert await wait_for(pilot, lambda: app.last_snapshot.device.mode == "exclusive")
        assert app.last_snapshot.device.lease_holder == pane.holder
        assert "exclusive" in str(app.query_one("#chat").border_subtitle)

        # a chat typed now is refused at once
        await chat(pilot, app, "are you there", 4)
        assert await wait_for(pilot, lambda: "unavailable_error: device in maintenance"
                              in str(app.query_one("#chat-status").content))

        # reset: the modal opens with the name field focused; Enter cancels unless the name is typed
        await click_button(pilot, "#m-reset")
        assert await wait_for(pilot, lambda: len(app.screen_stack) == 2)
        modal = app.screen
        assert app.focused.id == "confirm-name"
        ok_button = modal.query_one("#confirm-ok", Button)
        assert ok_button.disabled
        modal.query_one("#confirm-name").focus()
        await pilot.pause()
        await pilot.press(*"calculet")
        assert ok_button.disabled  # not the full name yet
        await pilot.press("0")
        assert not ok_button.disabled
        await click_button(pilot, "#confirm-ok")
        assert await wait_for(pilot, lambda: has(app, "#m-log", "reset: ok"))
        assert "health ok: healthy" in log_text(app, "#m-log")
        assert await wait_for(pilot, lambda: app.last_snapshot.jobs.resets == 1)

        # clear memory: Escape at the confirmation does nothing
        await click_button(pilot, "#m-clear")
        assert await wait_for(pilot, lambda: len(app.screen_stack) == 2)
        await pilot.press("escape")
        assert await wait_for(pilot, lambda: has(app, "#m-log", "clear_device_memory: cancelled at the confirmation"))
        assert not system.board.memory_cleared

        # golden self-test
        await click_button(pilot, "#m-selftest")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "self_test: ok · pass: max abs error"))

        # CCU fault: visible in the snapshot; the next request fails typed, the one after succeeds
        await click_button(pilot, "#m-f-ccu")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: "ccu_exception x1" in app.last_snapshot.device.faults)
        await click_button(pilot, "#m-probe")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "request failed: CCUException")), \
            log_text(app, "#m-log")
        await click_button(pilot, "#m-probe")  # a second click on the same button: see click_button
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "probe_request: ok · request finished"))
        assert await wait_for(pilot, lambda: app.last_snapshot.device.faults == ()
                              or app.last_snapshot.device.faults == [])

        # leave exclusive and chat again
        await click_button(pilot, "#m-leave")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "left exclusive mode"))
        assert app.query_one("#m-reset", Button).disabled
        await chat(pilot, app, "hi again", 6)
        assert await wait_for(pilot,
                              lambda: chat_pane.handle is None and "generated 6 tok" in chat_text(app))

    actions = [(e["action"], e["status"]) for e in m.audit.entries()]
    assert actions == [("enter_exclusive", "granted"), ("reset", "granted"), ("self_test", "granted"),
                       ("inject_fault", "granted"), ("probe_request", "failed"), ("probe_request", "granted"),
                       ("leave_exclusive", "granted")]


async def test_the_header_follows_a_maintenance_action_at_once(make_system):
    # the header said "serving" for seconds after the lease was granted: it waited for the next refresh
    app = CalConsoleApp(make_system(numerics=False, drain_timeout_s=0.5), load_layout("operator"))
    async with app.run_test(size=(160, 50)) as pilot:
        pane = app.query_one(MaintenancePane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        app.refresh_hz = 0.001  # the feed's slowest period (100 s): only a sample the action asks for comes in time
        assert " serving " in app._topbar_text
        await enter_exclusive(pilot, pane)
        assert await wait_for(pilot, lambda: " exclusive (lease: " in app._topbar_text), app._topbar_text
        await click_button(pilot, "#m-leave")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: pane.lease is None)
        assert await wait_for(pilot, lambda: " serving " in app._topbar_text), app._topbar_text


async def test_clear_memory_offers_reload_and_leaving_needs_it(make_system):
    # timing-only: clear, reload and registers are the same actions; the numerics (weights to make twice,
    # at start and at the reload) are not what this checks
    system = make_system(numerics=False, drain_timeout_s=0.5)
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(160, 50)) as pilot:
        pane = app.query_one(MaintenancePane)
        await enter_exclusive(pilot, pane)
        app.query_one("#m-log").focus()
        await pilot.pause()
        await pilot.press("c")  # the key opens the same confirmation
        assert await wait_for(pilot, lambda: len(app.screen_stack) == 2)
        app.screen.query_one("#confirm-name").focus()
        await pilot.pause()
        await pilot.press(*"calculet0", "enter")
        assert await wait_for(pilot, lambda: has(app, "#m-log", "model is reloaded: press Reload"))
        assert system.board.memory_cleared
        assert app.focused.id == "m-reload"
        await click_button(pilot, "#m-leave")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "reload the model first"))
        assert pane.lease is not None
        await click_button(pilot, "#m-reload")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "reload_model: ok"))
        # registers: read any, write only writable ones
        app.query_one("#m-reg").value = "BOARD_ID"
        await click_button(pilot, "#m-reg-read")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "BOARD_ID (0x0000) = "))
        app.query_one("#m-reg-value").value = "7"
        await click_button(pilot, "#m-reg-write")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "register BOARD_ID is read-only"))
        app.query_one("#m-reg").value = "chip1_scratch"
        # the second click on Write: a click within 0.2 s of the first is dropped by Textual's
        # Button (press effect), which made this step fail on fast machines
        await click_button(pilot, "#m-reg-write")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "CHIP1_SCRATCH: 0 -> 7"))
        await click_button(pilot, "#m-leave")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: pane.lease is None)


# --- --observe-only never reaches the maintenance plane ------------------------------------------


def _all_binding_keys(app) -> list[str]:
    from calconsole.panes.chat import ChatPane
    from calconsole.panes.observation import ObservationPane

    keys = []
    for cls in (CalConsoleApp, ChatPane, ObservationPane, MaintenancePane):
        for b in cls.BINDINGS:
            key = b.key if hasattr(b, "key") else b[0]
            keys += [k.strip() for k in key.split(",")]
    return [k for k in dict.fromkeys(keys) if k != "ctrl+q"]


async def test_observe_only_never_constructs_the_plane(monkeypatch, tmp_path):
    import sim_backend.planes.maintenance as maint

    def boom(*a, **k):
        raise AssertionError("InProcessMaintenance constructed in observe-only mode")

    monkeypatch.setattr(maint.InProcessMaintenance, "__init__", boom)
    system = build_system(pacing=Pacing(PacingMode.FAST), maintenance=False, numerics=False,
                          audit_path=tmp_path / "a.jsonl")
    try:
        assert system.maintenance is None
        app = CalConsoleApp(system, load_layout("operator"))
        async with app.run_test(size=(160, 50)) as pilot:
            assert not app.query("#maintenance") and not app.query(MaintenancePane)
            keys = _all_binding_keys(app)
            assert {"f3", "x", "r", "c"} <= set(keys)
            for target in ("#chat-input", "#observation", None):
                if target:
                    app.query_one(target).focus()
                for k in keys:
                    await pilot.press(k)  # returns once the key is handled (the app idle again)
                    while len(app.screen_stack) > 1:  # a screen a key opened (the help): closed again
                        await pilot.press("escape")
            await pilot.press("ctrl+q")
    finally:
        system.close()
    assert not (tmp_path / "a.jsonl").exists()


def _run_py(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_snapshot_json_does_not_import_the_maintenance_plane():
    code = (
        "import sys, io, contextlib, json\n"
        "from calconsole.cli import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    rc = main(['snapshot', '--json', '--timing-only'])\n"
        "snap = json.loads(buf.getvalue())\n"
        "assert rc == 0 and snap['device']['mode'] == 'serving'\n"
        "loaded = sorted(m for m in sys.modules if 'maintenance' in m)\n"
        "print(json.dumps(loaded))\n"
    )
    out = _run_py(code)
    assert out.returncode == 0, out.stderr
    # the command modules (drill, audit) are imported to build the parser, but none of them
    # imports sim_backend.planes.maintenance or the maintenance pane at module level
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_observe_only_console_does_not_import_the_maintenance_plane(tmp_path):
    code = (
        "import sys, asyncio\n"
        "from calconsole.app import CalConsoleApp\n"
        "from calconsole.layout import load_layout\n"
        "from sim_backend.compose import build_system\n"
        "s = build_system(numerics=False, maintenance=False, audit_path=sys.argv[1])\n"
        "app = CalConsoleApp(s, load_layout('operator'))\n"
        "async def go():\n"
        "    async with app.run_test(size=(160, 50)) as pilot:\n"
        "        for k in ['f3', 'x', 'r', 'c', 't', 'p', 'f', 'l', 'f1', 'f2', 'escape', 'ctrl+l']:\n"
        "            await pilot.press(k)\n"
        "        await pilot.pause(0.3)\n"
        "asyncio.run(go())\n"
        "s.close()\n"
        "bad = sorted(m for m in sys.modules if 'maintenance' in m)\n"
        "assert bad == [], bad\n"
    )
    out = _run_py(code, str(tmp_path / "audit.jsonl"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert not (tmp_path / "audit.jsonl").exists()
