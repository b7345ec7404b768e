"""What a key and a streamed piece make the console draw again: the input and the reply box, not the screen.

At 120x36 a key typed into an input reflowed every pane's widgets (Input sets its virtual size as a layout
change), and every layout pass refreshed the transcript's and the maintenance log's scrollbars (ScrollView
compares the compositor's virtual size with its own lines, never equal), whose dirty strips widened each
frame's repaint to the whole right column: ~35 ms key -> frame p95 (``calconsole bench keys``). These tests
count layout passes and dirty regions (integers, not times)."""

from __future__ import annotations

import pytest
from rich.text import Text
from textual._compositor import Compositor
from textual.geometry import Region
from textual.widgets import Input, Static

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.panes.chat import STREAM_TAIL_CHARS, ChatPane
from calconsole.widgets.footer import FittedFooter
from calconsole.widgets.wraplog import WrapLog
from sim_backend.device.clock import Pacing, PacingMode
from tests.console.pilot_helpers import wait_for


@pytest.fixture
def system(make_system):
    return make_system(pacing=Pacing(PacingMode.FAST), numerics=False)


@pytest.fixture
def quiet(monkeypatch):
    """``quiet(app)`` stops the app's observation updates (twice a second): not what these tests count."""
    orig = CalConsoleApp.on_snapshot_ready

    def on_snapshot_ready(self, message):
        if not getattr(self, "_quiet_for_test", False):
            orig(self, message)

    monkeypatch.setattr(CalConsoleApp, "on_snapshot_ready", on_snapshot_ready)
    return lambda app: setattr(app, "_quiet_for_test", True)


class Frames:
    """Counts Compositor.reflow calls and keeps the dirty regions each render_update drew."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reflows = 0
        self.dirty: list[Region] = []
        reflow, render_update = Compositor.reflow, Compositor.render_update
        frames = self

        def counted_reflow(comp, parent, size):
            frames.reflows += 1
            return reflow(comp, parent, size)

        def kept_update(comp, *a, **k):
            frames.dirty.extend(comp._dirty_regions)
            return render_update(comp, *a, **k)

        monkeypatch.setattr(Compositor, "reflow", counted_reflow)
        monkeypatch.setattr(Compositor, "render_update", kept_update)

    def reset(self) -> None:
        self.reflows, self.dirty = 0, []


def pending(app) -> bool:
    """Whether a widget of the screen (or one of its scrollbars, which are not in the DOM) has a layout pass to
    ask for: asked before a count starts, it would be counted."""
    for w in app.screen.walk_children(with_self=True):
        for x in (w, w._horizontal_scrollbar, w._vertical_scrollbar, w._scrollbar_corner):
            if x is not None and x._layout_required:
                return True
    return False


async def settle(pilot, tries: int = 50) -> None:
    """Pause until a pause starts and ends with no layout pass pending (a pass can ask for another: the footer's
    fit changes its virtual size, which asks for one more)."""
    for _ in range(tries):
        before = pending(pilot.app)
        await pilot.pause()
        if not before and not pending(pilot.app):
            return
    raise AssertionError("the console kept asking for layout passes")


async def test_typing_into_the_chat_input_lays_out_nothing_and_repaints_only_the_input(system, monkeypatch, quiet):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(120, 36)) as pilot:
        inp = app.query_one("#chat-input", Input)
        inp.focus()
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        quiet(app)
        # settled first: the footer shows the input's keys (focusing it composes the footer again) and no widget
        # has a layout pass pending (one asked for before the count would be counted)
        footer = app.query_one(FittedFooter)
        assert await wait_for(pilot, lambda: footer._composed == footer._entries(app.screen) and not pending(app))
        await settle(pilot)
        frames = Frames(monkeypatch)
        await pilot.press(*"hello world, how are you")
        assert await wait_for(pilot, lambda: inp.value == "hello world, how are you")
        await pilot.pause()
        assert frames.reflows == 0
        box = inp.region
        assert frames.dirty and all(box.contains_region(r) for r in frames.dirty), (box, frames.dirty)
        # the text still scrolls inside the input when it is longer than the input (its virtual size is kept)
        await pilot.press(*("x" * 80))
        assert await wait_for(pilot, lambda: inp.scroll_x > 0)
        assert inp.virtual_size.width == inp.content_width


async def test_a_streaming_reply_redraws_the_chat_pane_and_not_the_maintenance_pane(system, monkeypatch, quiet):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(120, 36)) as pilot:
        chat = app.query_one("#chat", ChatPane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        app.query_one("#p-max-tokens", Input).value = "40000"  # ~30 s of streaming: cancelled below
        inp = app.query_one("#chat-input", Input)
        inp.focus()
        inp.value = "hi"
        await pilot.press("enter")
        stream = app.query_one("#chat-stream", Static)
        # once the live box is at its max-height its later pieces change neither its height nor the layout
        assert await wait_for(pilot, lambda: len(chat._stream_text) > STREAM_TAIL_CHARS, timeout_s=60)
        await pilot.pause()
        shown = stream.render()
        assert len(Text.from_markup(str(shown)).wrap(app.console, stream.content_region.width)) > stream.size.height
        quiet(app)
        await pilot.pause()
        frames = Frames(monkeypatch)
        pieces = len(chat._stream_text)
        assert await wait_for(pilot, lambda: len(chat._stream_text) > pieces + 400 or chat.handle is None,
                              timeout_s=60)
        assert chat.handle is not None, "the reply ended early"
        assert frames.reflows == 0
        maint = app.query_one("#maintenance").region
        assert frames.dirty and not any(r.overlaps(maint) for r in frames.dirty), frames.dirty
        # the transcript's scrollbar still follows its lines: the log scrolls to the reply when it lands
        await pilot.press("escape")
        assert await wait_for(pilot, lambda: chat.handle is None, timeout_s=60)
        log = app.query_one("#chat-log", WrapLog)
        assert await wait_for(pilot, lambda: not log.pending and 0 < log.max_scroll_y == log.scroll_y)


async def test_the_footer_composes_again_only_when_an_entry_changes(system, quiet, monkeypatch):
    # Textual's footer composed all its entries (and laid out the screen) on every change of bindings: three
    # times for each confirmation opened and closed, ~250 ms an action at 160x48. Now only when an entry differs
    from calconsole.panes.maintenance import MaintenancePane
    from calconsole.widgets.confirm import AskModal

    composed: list[int] = []
    recompose = FittedFooter.recompose

    async def counted(self):
        composed.append(1)
        await recompose(self)

    monkeypatch.setattr(FittedFooter, "recompose", counted)
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        quiet(app)
        pane = app.query_one(MaintenancePane)
        footer = app.screen_stack[0].query_one(FittedFooter)
        pane.query_one("#m-log").focus()
        await pilot.pause()
        entries = [k.key for k in footer.query("FooterKey")]
        composed.clear()
        for _ in range(3):  # a question opened and cancelled: the same entries before and after
            await pilot.press("x")
            assert await wait_for(pilot, lambda: isinstance(app.screen, AskModal))
            await pilot.press("escape")
            assert await wait_for(pilot, lambda: not isinstance(app.screen, AskModal))
            await pilot.pause()
        assert composed == [] and [k.key for k in footer.query("FooterKey")] == entries
        app.query_one("#chat-input").focus()  # another pane's keys: composed again, and they are shown
        assert await wait_for(pilot, lambda: composed != [])
        assert await wait_for(pilot, lambda: [k.key for k in footer.query("FooterKey")] != entries)
