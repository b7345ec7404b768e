"""One pane at a time below the layout's breakpoint, the columns above it.

Pilot drives a timing-only simulator (FAST pacing: a 128-token reply in well under a second of wall time).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.widgets import Static

from calconsole.app import CalConsoleApp
from calconsole.layout import SINGLE_PANE_BELOW, LayoutError, load_layout
from calconsole.settings import Settings, load_settings
from tests.console.pilot_helpers import wait_for

PANES = ("observation", "chat", "maintenance")


@pytest.fixture
def system(make_system):
    return make_system(numerics=False)


def shown(app: CalConsoleApp) -> list[str]:
    """The panes drawn now (on screen with rows), by name."""
    return [p.pane_name for p in app._panes if p.display and p.size.height > 0 and p.parent.display]


async def settle(pilot, cond) -> None:
    assert await wait_for(pilot, cond), shown(pilot.app)


async def send(pilot, text: str, max_tokens: int = 128) -> None:
    app = pilot.app
    app.query_one("#p-max-tokens").value = str(max_tokens)
    app.query_one("#p-seed").value = "7"
    app.query_one("#chat-input").focus()
    await pilot.press(*text, "enter")
    chat = app.query_one("#chat")
    await settle(pilot, lambda: chat.full_figures and chat.handle is None and not app.query_one("#chat-log").pending)


async def test_at_80x24_the_chat_pane_shows_prompt_whole_reply_and_figures(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, lambda: app.single and shown(app) == ["chat"])
        await pilot.press("f2")
        await send(pilot, "Tell me about the device")
        log = app.query_one("#chat-log")
        await pilot.pause()
        lines = [line.text for line in log.lines]
        assert lines[0] == "you Tell me about the device"
        assert lines[1].startswith("model ")
        assert lines[-1].startswith("  TTFT ") and lines[-1].endswith(" · 128 tok · limit · timing-only"), lines[-1]
        # every line of the exchange on screen at once: nothing scrolled away
        assert len(lines) <= log.size.height and log.scroll_y == 0, (len(lines), log.size)
        assert log.size.width >= 70  # the pane has the terminal's width


async def test_f_keys_switch_the_pane_and_tab_stays_inside_it(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot, lambda: shown(app) == ["chat"])
        for key, name in (("f1", "observation"), ("f3", "maintenance"), ("f2", "chat")):
            await pilot.press(key)
            pane = app.query_one(f"#{name}")
            await settle(pilot, lambda pane=pane, name=name: shown(app) == [name] and app._focused_pane() is pane)
            assert pane.outer_size.width == 100 and pane.outer_size.height == 28  # the terminal less header, footer
            title = str(pane.border_title)
            others = [k for k, n in (("F1", "observation"), ("F2", "chat"), ("F3", "maintenance")) if n != name]
            assert all(k in title for k in others), title  # the title says how to reach the others
        chat = app.query_one("#chat")
        for _ in range(8):  # Tab never leaves the shown pane (the sampling panel, its reset, the input...)
            await pilot.press("tab")
            await pilot.pause()
            assert app.focused is not None and chat in app.focused.ancestors_with_self, app.focused
        assert shown(app) == ["chat"]


async def test_the_status_header_keeps_board_state_kv_queue_and_the_running_request(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(pilot, lambda: app.last_snapshot is not None and "KV " in str(app.query_one("#topbar").render()))
        top = str(app.query_one("#topbar", Static).render())
        assert top.startswith("calconsole calculet0 · serving · ok · KV 0/") and " · queue 0 · run -" in top, top
        assert len(top) <= 80


async def test_above_the_breakpoint_the_three_panes_show(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=SINGLE_PANE_BELOW) as pilot:
        await settle(pilot, lambda: sorted(shown(app)) == sorted(PANES))
        assert not app.single
        await pilot.resize_terminal(SINGLE_PANE_BELOW[0] - 1, SINGLE_PANE_BELOW[1])
        await settle(pilot, lambda: shown(app) == ["chat"])  # the pane focused before stays shown
        await pilot.press("f3")
        await settle(pilot, lambda: shown(app) == ["maintenance"])
        await pilot.resize_terminal(*SINGLE_PANE_BELOW)
        await settle(pilot, lambda: sorted(shown(app)) == sorted(PANES))
        assert app._focused_pane() is app.query_one("#maintenance")


async def test_the_palette_forces_either_mode_and_it_is_saved(system, tmp_path):
    path = tmp_path / "config.yaml"
    app = CalConsoleApp(system, load_layout("operator"), settings=Settings(path=path))
    async with app.run_test(size=(160, 48)) as pilot:
        await settle(pilot, lambda: len(shown(app)) == 3)
        titles = [c.title for c in app.get_system_commands(app.screen) if c.title.startswith("Panes: ")]
        assert len(titles) == 3, titles
        app.set_pane_mode("single")
        await settle(pilot, lambda: shown(app) == ["chat"])
        app.action_save_settings()
        assert load_settings(path, environ={}).panes == "single"
        await pilot.resize_terminal(80, 24)
        app.set_pane_mode("columns")
        await settle(pilot, lambda: len(shown(app)) == 3)  # three narrow panes, as asked
        app.set_pane_mode("auto")
        await settle(pilot, lambda: shown(app) == ["chat"])
    # a saved mode is the next start's
    again = CalConsoleApp(system, load_layout("operator"), settings=load_settings(path, environ={}))
    async with again.run_test(size=(160, 48)) as pilot:
        await settle(pilot, lambda: shown(again) == ["chat"])


def _layout(tmp_path: Path, extra: str) -> Path:
    p = tmp_path / "mine.yaml"
    p.write_text("columns:\n  - panes:\n      - {pane: observation}\n  - panes:\n      - {pane: chat}\n" + extra)
    return p


async def test_a_layout_sets_the_breakpoint(system, tmp_path):
    layout = load_layout(str(_layout(tmp_path, "single_pane_below: {width: 100, height: 30}\n")))
    assert layout.single_pane_below == (100, 30)
    app = CalConsoleApp(system, layout)
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot, lambda: sorted(shown(app)) == ["chat", "observation"])
        await pilot.resize_terminal(99, 30)
        await settle(pilot, lambda: shown(app) == ["chat"])
    assert load_layout(str(_layout(tmp_path, "single_pane_below: {height: 40}\n"))).single_pane_below == (120, 40)
    for bad, field in (("single_pane_below: 120", "single_pane_below"),
                       ("single_pane_below: {width: 79}", "single_pane_below.width"),
                       ("single_pane_below: {height: true}", "single_pane_below.height"),
                       ("single_pane_below: {rows: 30}", "single_pane_below")):
        with pytest.raises(LayoutError) as e:
            load_layout(str(_layout(tmp_path, bad + "\n")))
        assert e.value.field == field, (bad, str(e.value))


async def test_the_compile_notice_is_in_the_header_and_no_toast_covers_a_modal():
    from textual.widgets._toast import Toast, ToastRack

    from calconsole.widgets.help import HelpScreen
    from tests.console.test_console_sizes import console

    app = console(panes="columns")
    async with app.run_test(size=(160, 48), notifications=True) as pilot:  # toasts drawn (run_test's default: not)
        await settle(pilot, lambda: app.last_snapshot is not None)
        app.show_start_progress("compiling numerics kernels, 1/3: decode step (first start after install)")
        top = app.query_one("#topbar")
        await settle(pilot, lambda: "kernels compiling 1/3: replies timing-only" in str(top.render()))
        assert not app._notifications  # in the header, not a toast
        await pilot.press("f2", "question_mark")
        await settle(pilot, lambda: isinstance(app.screen, HelpScreen))
        app.notify("settings saved", timeout=30)
        await pilot.pause()
        assert app.screen.query(ToastRack)  # a rack there, to be kept hidden
        assert not any(r.display and r.query(Toast) for r in app.screen.query(ToastRack))  # not over the help
        await pilot.press("escape")
        await settle(pilot, lambda: not isinstance(app.screen, HelpScreen))
        base = app.screen_stack[0]
        await settle(pilot, lambda: any(r.display and r.query(Toast) for r in base.query(ToastRack)))
        app.show_start_progress("numerics kernels ready after 31 s: new requests run the numerics")
        await settle(pilot, lambda: "compiling" not in str(top.render()))
