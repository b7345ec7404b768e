"""Snapshot tests where the picture matters (pytest-textual-snapshot).

Only deterministic screens: the live console shows host CPU/RSS, which change
from run to run. Regenerate with ``pytest tests/console/test_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

from pathlib import Path

from textual.app import App
from textual.widgets import Input

from calconsole.widgets.confirm import ConfirmModal
from tests.console.pilot_helpers import wait_for

CSS = Path(__file__).resolve().parents[2] / "calconsole" / "styles.tcss"


class ConfirmHost(App):
    CSS_PATH = str(CSS)

    def on_mount(self) -> None:
        self.push_screen(ConfirmModal("Reset device", "Fails in-flight jobs, clears KV, reconfigures the calbin, "
                                      "then runs a health check.", "calculet0"))


async def _cursor_steady(pilot) -> None:
    """The modal's name field focused, its cursor shown without blinking: the cursor blinks every 0.5 s, and a
    loaded host took the picture with it off (proof run 1 beside two CPU hogs: the first picture lost its cursor)."""
    assert await wait_for(pilot, lambda: isinstance(pilot.app.focused, Input))
    for inp in pilot.app.screen.query(Input):
        inp.cursor_blink = False  # shows the cursor (Input._watch_cursor_blink)
    await pilot.pause()


def test_confirm_modal_opens_with_name_field_and_disabled_confirm(snap_compare):
    # name field focused and empty, the destructive button disabled until the device name is typed
    assert snap_compare(ConfirmHost(), terminal_size=(80, 20), run_before=_cursor_steady)


def test_confirm_modal_enabled_after_typing_name(snap_compare):
    async def type_name(pilot):
        await pilot.press(*"calculet0")
        # the picture once the typed name has enabled the button (its Changed handler may run after the keys)
        assert await wait_for(pilot, lambda: not pilot.app.screen.query_one("#confirm-ok").disabled)
        await _cursor_steady(pilot)

    assert snap_compare(ConfirmHost(), terminal_size=(80, 20), run_before=type_name)


async def test_enter_without_the_name_cancels():
    results = []

    class Host(App):
        def on_mount(self) -> None:
            self.push_screen(ConfirmModal("Reset device", "detail", "calculet0"), results.append)

    app = Host()
    async with app.run_test() as pilot:
        await pilot.press("enter")  # nothing typed: plain cancel
        await pilot.pause()
        app.push_screen(ConfirmModal("Reset device", "detail", "calculet0"), results.append)
        await pilot.pause()
        await pilot.press(*"calc", "enter")  # a wrong name: cancel, reported as a mismatch
        await pilot.pause()
    assert results == [False, None]
