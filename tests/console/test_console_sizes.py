"""The whole console at every size from 80x24 up: no figure an operator needs is cut to "…".

A fake system hands out the scripted snapshot (a fault fired on chip0, chip1 slow x4, KV near full), so the
pictures are the same at every run; the clock the graphs read is frozen. Its inference plane is a real
timing-only simulator (a seeded generator's tokens, modeled host work: the same reply and figures at every run),
so each picture has a chat exchange on it. Snapshot tests at 80x24, 100x30, 120x36 and 160x48 (operator
layout) in both pane modes (one at a time, the layout's columns), and 80x24 (chat layout, columns).
Below the layout's breakpoint (120x36) the console shows one pane at a time: the checks of a pane's text
show that pane first (F1 / F2), as an operator does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from textual.widgets import Input

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.panes.observation import ObservationPane
from calconsole.settings import Settings
from calconsole.widgets import history as history_mod
from calconsole.widgets.history import HistoryGraph, x_ticks, y_ticks
from tests.console.pilot_helpers import typed, wait_for

SCRIPTED = typed(json.loads((Path(__file__).parent / "data" / "scripted_snapshot.json").read_text()))
SIZES = [(80, 24), (100, 30), (120, 36), (160, 48)]


class _Observation:
    def snapshot(self):
        return SCRIPTED


class _Maintenance:
    audit = SimpleNamespace(path="audit.jsonl")
    drain_timeout_s = 5.0
    last_drain = None

    def offers(self, method: str) -> bool:
        return True


class FakeSystem:
    """The three planes a console needs to draw itself; requests run on ``inference`` when one is given (a
    real simulator's plane), else nothing runs one."""

    def __init__(self, inference=None) -> None:
        self.observation = _Observation()
        self.inference = inference if inference is not None else SimpleNamespace()
        self.maintenance = _Maintenance()

    def close(self) -> None:
        pass


@pytest.fixture
def frozen_clock(monkeypatch):
    class Clock:
        @staticmethod
        def monotonic() -> float:
            return 1299.0

    import calconsole.panes.observation as obs_mod

    monkeypatch.setattr(history_mod, "time", Clock)
    monkeypatch.setattr(obs_mod, "time", Clock)


def console(layout: str = "operator", panes: str = "auto", inference=None) -> CalConsoleApp:
    return CalConsoleApp(FakeSystem(inference), load_layout(layout), settings=Settings(panes=panes))


async def show(pilot, key: str) -> None:
    """F1 / F2 / F3: the pane shown (one at a time) and focused, once it is laid out."""
    app = pilot.app
    await pilot.press(key)
    name = {"f1": "observation", "f2": "chat", "f3": "maintenance"}[key]
    assert await wait_for(pilot, lambda: app.query_one(f"#{name}").size.height > 0
                          and app._focused_pane() is app.query_one(f"#{name}"))


async def _drawn(pilot) -> None:
    """Until the console is drawn for its size: the device table in the form that fits the pane's width (the
    first snapshot can come before the layout knows it), every shown graph drawn."""
    app = pilot.app
    pane = app.query_one(ObservationPane)
    if not pane.display or not pane.size.height:  # one pane at a time and another one shown: nothing to wait for
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        for inp in app.query(Input):
            inp.cursor_blink = False
        await pilot.pause()
        return

    def settled() -> bool:
        shown = pane._shown.get("#obs-device")
        return (app.last_snapshot is not None and isinstance(shown, tuple) and shown[-1] is not None
                and shown[-1] == pane._table_width() and app.query_one("#obs-device").size.height > 0
                and all(g.drawn_at for g in pane.query(HistoryGraph) if g.display))

    assert await wait_for(pilot, settled)
    for inp in app.query(Input):  # a blinking cursor would make every picture a coin toss
        inp.cursor_blink = False
    # one more layout pass from what is shown now: a section whose text got a line shorter after the last
    # layout (seen under load: one blank row under the device table) takes its height from it again
    app.screen.refresh(layout=True)
    await pilot.pause()
    await pilot.pause()


def _device_lines(app) -> list[str]:
    dev = app.query_one("#obs-device")
    return [strip.text for strip in dev.render_lines(dev.region.reset_offset)]


@pytest.mark.parametrize("panes", ["columns", "single"])
@pytest.mark.parametrize("layout", ["operator", "chat"])
@pytest.mark.parametrize("size", SIZES)
async def test_no_device_figure_and_no_header_part_is_cut(frozen_clock, size, layout, panes):
    # at 120x36 the device table read "dev hea… sta… b… …" with busy "9…"; --layout chat at 80x24
    # "bo… ok se… 0% ██▒ … ███ 9…"; the header lost its end
    app = console(layout, panes)
    async with app.run_test(size=size) as pilot:
        if panes == "single":
            await show(pilot, "f1")
        await _drawn(pilot)
        lines = _device_lines(app)
        table = "\n".join(lines).split("faults")[0]
        assert "…" not in table, table
        assert "97%" in table and "25%" in table  # board and chip busy
        # a memory figure on the board row: used/reserved/physical, used/physical or the used share
        assert re.search(r"\d+%|\d/\d+[GM]", table.splitlines()[1].split("97%")[1])
        top = str(app.query_one("#topbar").render())
        assert top.startswith("calconsole calculet0 · serving · fault") and "…" not in top
        assert len(top) <= size[0]


@pytest.mark.parametrize("panes", ["columns", "single"])
@pytest.mark.parametrize("layout", ["operator", "chat"])
@pytest.mark.parametrize("size", SIZES)
async def test_every_graph_keeps_its_title_and_the_chat_banner_is_whole(frozen_clock, size, layout, panes):
    # at 120x36 the TTFT / TPOT graph had no title (plotext drops one wider than the plot) and at 80x24 the
    # chat banner read "synthetic weights: the text is not…"
    app = console(layout, panes)
    async with app.run_test(size=size) as pilot:
        if panes == "single":
            await show(pilot, "f1")
        await _drawn(pilot)
        shown = [g for g in app.query(HistoryGraph) if g.display and g.size.width]
        assert shown
        for g in shown:
            top = g.render().plain.split("\n")[0]
            assert any(t in top for t in g.titles()), (g.spec.id, g.size, top)
        if panes == "single":
            await show(pilot, "f2")
        notice = app.query_one("#chat-notice")
        text = str(notice.render())
        assert text and "…" not in text and len(text) <= notice.size.width, (text, notice.size)


async def test_at_120x36_the_device_table_keeps_its_memory_figures(frozen_clock):
    # at 120x36 the table went from used/physical figures (58 columns) straight to the % rows in a 56-column
    # pane, a third of it free: now the names get short first and both memories keep used/physical
    app = console(panes="columns")
    async with app.run_test(size=(120, 36)) as pilot:
        await _drawn(pilot)
        board = _device_lines(app)[1]
        assert board.startswith("board") and "/32G" in board and "/36M" in board, _device_lines(app)
        assert "%" in board.split("/32G")[0]  # the busy % stays


@pytest.fixture
def timing_only(make_system):
    """A timing-only simulator (FAST pacing) of its own (no prompt cached by an earlier test): seeded tokens,
    modeled host work, the same reply and figures every run."""
    return make_system(numerics=False)


async def chat_exchange(pilot, max_tokens: int = 128) -> None:
    """A message sent in the chat pane (F2 shows it when one pane is shown at a time), its reply (seed 7)
    and figures in the transcript, then the console drawn for its size."""
    app = pilot.app
    app.query_one("#p-seed").value = "7"
    app.query_one("#p-max-tokens").value = str(max_tokens)
    if app.single:
        await show(pilot, "f2")
    app.query_one("#chat-input").focus()
    await pilot.press(*"Tell me about the device", "enter")
    chat = app.query_one("#chat")
    assert await wait_for(pilot, lambda: chat.full_figures and chat.handle is None
                          and not app.query_one("#chat-log").pending)
    await _drawn(pilot)


#: auto at each size (one pane at a time below 120x36, the columns from there), and the other mode forced (the
#: palette's "Panes: ...") at each size
MODES = [(size, "auto") for size in SIZES] + [((80, 24), "columns"), ((100, 30), "columns"), ((120, 36), "single"),
                                               ((160, 48), "single")]


@pytest.mark.parametrize(("size", "panes"), MODES)
def test_console_at_each_size(snap_compare, frozen_clock, timing_only, size, panes):
    assert snap_compare(console(panes=panes, inference=timing_only.inference), terminal_size=size,
                        run_before=chat_exchange)


def test_chat_layout_at_80x24(snap_compare, frozen_clock):
    assert snap_compare(console("chat", "columns"), terminal_size=(80, 24), run_before=_drawn)


def test_graph_ticks_are_even_and_every_time_label_fits():
    assert y_ticks(100.0) == [0.0, 25.0, 50.0, 75.0, 100.0]  # was 100.0 / 83.3 / 50.0 / 33.3 / 0.0
    for peak in (0.3, 1.0, 7.0, 58.2 * 1.1, 80.0, 913.0):
        t = y_ticks(peak)
        steps = {round(b - a, 9) for a, b in zip(t, t[1:], strict=False)}
        assert len(steps) == 1 and t[0] == 0.0 and t[-1] >= peak, (peak, t)
    for window in (60, 300, 900):
        for width in (20, 28, 40, 80):
            xs = x_ticks(window, width)
            assert xs[-1] == 0 and len(xs) >= 2
            # a label every X_LABEL_COLS columns at most: none is dropped by the plot
            assert len(xs) <= max(2, (width - 8) // history_mod.X_LABEL_COLS + 1), (window, width, xs)


def test_compact_memory_figure_is_the_used_share_and_says_so():
    # compact 'DRAM 88%' was the reserved share while the full table leads with used: now both lead with used
    from rich.console import Console

    from calconsole.widgets import render

    def text(width):
        c = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
        c.print(render.device_table(SCRIPTED, width=width))
        return c.export_text()

    mem = render.chip_memory(SCRIPTED.memory)
    used = sum(m["dram"][0] for m in mem)
    reserved = sum(m["dram"][1] for m in mem)
    physical = sum(m["dram"][2] for m in mem)
    assert round(100 * used / physical) != round(100 * reserved / physical)  # the two readings differ here
    compact = text(38)
    board = compact.splitlines()[1]
    assert f"{100 * used / physical:3.0f}%" in board and f"{100 * reserved / physical:3.0f}%" not in board
    assert "DRAM/SRAM % used" in " ".join(compact.split())
    assert "used/rsv/phys" in text(120)
