"""What the console shows: status, per-chip times, sampling fields, log wrapping, honest labels (Pilot)."""

from __future__ import annotations

import argparse
import html
import io
import json
import re
from pathlib import Path

import msgspec
import pytest
from rich.console import Console
from rich.text import Text
from textual.app import App

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.widgets import render
from calconsole.widgets.wraplog import SLICE_CHARS, WrapLog
from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.planes.snapshot import RequestsView, TokenCounts
from tests.console.pilot_helpers import click_button, confirm_ask, enter_exclusive, has, typed, wait_for


@pytest.fixture
def system(tmp_path):
    s = build_system(pacing=Pacing(PacingMode.FAST), audit_path=tmp_path / "audit.jsonl", drain_timeout_s=0.5)
    yield s
    s.close()


def topbar(app) -> str:
    return app._topbar_text


def shown(renderable, width: int = 200) -> str:
    """A renderable as the text a person reads."""
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(renderable)
    return console.export_text()


def screen_text(app) -> str:
    svg = app.export_screenshot()
    return html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")


# --- status: armed is armed, fired stays until acknowledged -------------------------------------


async def test_header_shows_armed_then_fired_until_acknowledged(system):
    app = CalConsoleApp(system, load_layout("operator"))
    m = system.maintenance
    async with app.run_test(size=(200, 50)) as pilot:
        pane = app.query_one("#maintenance")
        await enter_exclusive(pilot, pane)
        await click_button(pilot, "#m-f-ccu")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: "armed: ccu_exception x1" in topbar(app))
        assert " · ok · " in topbar(app)  # armed is not a failure
        assert app.query_one("#m-ack").disabled
        await click_button(pilot, "#m-probe")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: "ccu_exception fired" in topbar(app))
        assert "fault: ccu_exception fired (a acks)" in topbar(app)
        assert "fired (1 unacknowledged, last chip0, job" in shown(render.device_panel(app.last_snapshot))
        assert await wait_for(pilot, lambda: "chip0  ready  idle  steps done 0  ccu_exc 1" in shown(
            render.device_panel(app.last_snapshot)))  # on chip0's own row, not on both
        await click_button(pilot, "#m-probe")  # the device serves again: the fault is still shown
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "probe_request: ok"))
        done = system.observation.snapshot().jobs.finished  # the device steps, the probe's included
        # the header from a snapshot taken after the probe (it and the header are set together)
        assert await wait_for(pilot, lambda: app.last_snapshot.jobs.finished >= done)
        assert "fired" in topbar(app)
        await click_button(pilot, "#m-leave")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: pane.lease is None)
        # acknowledging needs no lease: key a in the pane
        assert await wait_for(pilot, lambda: not app.query_one("#m-ack").disabled)
        app.query_one("#m-log").focus()
        await pilot.press("a")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "acknowledge_faults: ok · acknowledged: ccu_exception"))
        assert await wait_for(pilot, lambda: " · ok · " in topbar(app) and "fired" not in topbar(app))
    assert [e["action"] for e in m.audit.entries()][-1] == "acknowledge_faults"


def _scripted():
    return typed(json.loads((Path(__file__).parent / "data" / "scripted_snapshot.json").read_text()))


def test_status_text_and_header_counts_say_what_they_count():
    base = _scripted().device
    d = msgspec.structs.replace(base, status="degraded", faults_in_effect=("slow_chip1 x4",),
                                faults_armed=("link_error x1",), faults_fired=())
    assert render.status_text(d).plain == "degraded (slow_chip1 x4) · armed: link_error x1"
    d = msgspec.structs.replace(base, numerics=True, numerics_max_prompt=1024, timing_only_running=(7,))
    assert render.numerics_text(d) == ("numerics on, but request 7 timing-only (> 1024 new prompt tok, or continuing "
                                       "a timing-only turn)")
    assert render.numerics_text(msgspec.structs.replace(d, timing_only_running=(),
                                                        numerics_limit_reason="--numeric-limit")) == (
        "numerics up to 1024 new prompt tokens (--numeric-limit); longer prompts timing-only")
    assert render.numerics_text(msgspec.structs.replace(d, numerics=False)) == "numerics off (timing-only)"
    assert render.numerics_text(msgspec.structs.replace(d, numerics_starting=True)) == (
        "numerics starting (kernels loading or compiling): requests run timing-only until ready")


async def test_long_prompt_running_timing_only_is_named_in_the_device_line(tmp_path):
    s = build_system(pacing=Pacing(PacingMode.REALTIME, speed=0.05), audit_path=tmp_path / "a.jsonl",
                     numerics_max_prompt=8)
    try:
        from sim_backend.planes import ChatRequest

        h = s.inference.submit(ChatRequest.from_prompt("a prompt longer than eight tokens " * 3, max_tokens=50))
        snap = s.observation.snapshot().to_dict()
        assert h.id in snap["device"]["timing_only_running"]
        assert f"request {h.id} timing-only" in render.device_panel(typed(snap)).renderables[0].plain
        # the console's top bar names it while it runs (the device table has no numerics line)
        app = CalConsoleApp(s, load_layout("operator"))
        async with app.run_test(size=(200, 50)):
            app._show_topbar(typed(snap))  # sets the top bar's text at once: no pause to wait for
            assert f"timing-only: request {h.id}" in topbar(app)
            snap["device"]["timing_only_running"] = []
            app._show_topbar(typed(snap))
            assert "timing-only" not in topbar(app)
            snap["device"]["numerics_starting"] = True  # a first start: the worker compiles its kernels
            app._show_topbar(typed(snap))
            assert "numerics starting: replies timing-only" in topbar(app)
        h.cancel("test over")
    finally:
        s.close()


def test_tokens_line_never_shows_more_cached_than_prompt():
    snap = msgspec.structs.replace(_scripted(), requests=RequestsView(
        tokens=TokenCounts(prompt=2295, cached=2312, predicted=10)))
    toks = render.requests_panel(snap).renderables[-1].plain
    assert toks == "tokens prompt 4607 (processed 2295 + cached 2312) predicted 10"


# --- per-chip times and the stage table -----------------------------------------------------------


async def test_slow_chip_shows_on_its_own_column_and_probe_updates_stages(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(200, 60)) as pilot:
        pane = app.query_one("#maintenance")
        await enter_exclusive(pilot, pane)
        await click_button(pilot, "#m-f-slow")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: "degraded (slow_chip1 x4)" in topbar(app))
        await click_button(pilot, "#m-probe")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "probe_request: ok"))
        assert await wait_for(pilot, lambda: "decode (probe)" in shown(render.stages_panel(app.last_snapshot)))
        step = app.last_snapshot.last_decode
        assert step.sim_us == pytest.approx(step.h2d_us + step.infer_us + step.d2h_us, rel=1e-12)
        layer = step.layers[0].chip_us
        assert layer[1] == pytest.approx(4.0 * layer[0], rel=0.05)


# --- sampling parameters ----------------------------------------------------------------------


async def test_sampling_fields_show_their_whole_value_and_a_refusal_is_visible_and_counted(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(120, 36)) as pilot:
        app.query_one("#chat-params").collapsed = False
        await pilot.pause()
        top_p = app.query_one("#p-top-p")
        top_p.value = "20.95"
        app.query_one("#p-seed").value = "1234567890"
        await pilot.pause()
        for inp in app.query(".param-input"):
            assert inp.content_region.width > max(len(inp.value), 5), (inp.id, inp.value)
        app.query_one("#chat-params").collapsed = True
        inp = app.query_one("#chat-input")
        inp.focus()
        await pilot.pause()
        await pilot.press(*"hello", "enter")
        msg = "invalid_request_error: top_p must be in (0, 1]; got 20.95"
        status = app.query_one("#chat-status")
        assert await wait_for(pilot, lambda: str(status.content) == msg)
        assert status.region.height >= 2  # by the input, seen when the log is scrolled
        assert not has(app, "#chat-log", "top_p must be")  # said once, not also in the transcript
        assert not app.query_one("#chat-params").collapsed and top_p.has_class("-refused")
        assert app.focused is top_p
        # the refused field shows its value (focus selected it all, and under the red mark it read blank)
        assert top_p.value == "20.95" and not top_p.selected_text
        shown = "".join(seg.text for seg in top_p.render_line(0))
        assert "20.95" in shown, shown
        # the prompt is back in the input, the cursor at its end (it was at the start)
        assert inp.value == "hello" and inp.cursor_position == len("hello")
        # a value the pane cannot even parse reads and counts the same way: the engine refuses it
        top_p.value = "0.9"
        app.query_one("#p-temperature").value = "abc"
        inp.focus()
        await pilot.pause()
        await pilot.press("enter")
        msg2 = "invalid_request_error: temperature must be a finite number; got 'abc'"
        assert await wait_for(pilot, lambda: str(status.content) == msg2)
        assert not top_p.has_class("-refused") and app.query_one("#p-temperature").has_class("-refused")
        assert system.observation.snapshot().requests.counters.rejected == 2


# --- the log: slices, re-wrap on resize ------------------------------------------------------


class LogHost(App):
    def __init__(self, max_lines: int = 2000) -> None:
        super().__init__()
        self.max_lines = max_lines

    def compose(self):
        yield WrapLog(id="log", max_lines=self.max_lines)


def _text(n: int) -> str:
    words = ("alpha", "be", "gamma", "delta", "epsilon", "zeta", "etaetaetaeta", "theta")
    out, i = [], 0
    while sum(map(len, out)) < n:
        out.append(words[i % len(words)] + ("\n" if i % 97 == 96 else " "))
        i += 1
    return "".join(out)[:n]


def _rich_lines(text: str, width: int) -> list[str]:
    console = Console(width=width, file=open("/dev/null", "w"))
    return [line.plain.rstrip() for line in Text(text).wrap(console, width)]


async def test_long_text_is_rendered_in_slices_and_wraps_as_one_write():
    text = _text(12 * SLICE_CHARS)
    app = LogHost()
    async with app.run_test(size=(70, 20)) as pilot:
        log = app.query_one(WrapLog)
        log.write(text)
        assert log.pending  # the write returned before the text was rendered
        assert await wait_for(pilot, lambda: not log.pending)
        width = log.scrollable_content_region.width
        assert [s.text.rstrip() for s in log.lines] == _rich_lines(text, width)


async def test_only_the_tail_that_fits_max_lines_is_rendered():
    text = _text(40 * SLICE_CHARS)
    app = LogHost(max_lines=50)
    async with app.run_test(size=(70, 20)) as pilot:
        log = app.query_one(WrapLog)
        log.write("first entry")
        log.write(text)
        assert await wait_for(pilot, lambda: not log.pending)
        assert len(log.lines) == 50
        assert log.lines[-1].text.rstrip() == _rich_lines(text, log.scrollable_content_region.width)[-1]


async def test_logs_rewrap_when_the_pane_is_resized():
    text = _text(3000)
    app = LogHost()
    async with app.run_test(size=(60, 20)) as pilot:
        log = app.query_one(WrapLog)
        log.write(Text(text, style="green"))
        assert await wait_for(pilot, lambda: not log.pending)
        narrow = log.scrollable_content_region.width
        assert max(len(s.text.rstrip()) for s in log.lines) <= narrow
        await pilot.resize_terminal(120, 20)
        assert await wait_for(pilot, lambda: log.scrollable_content_region.width > narrow and not log.pending)
        wide = log.scrollable_content_region.width
        assert [s.text.rstrip() for s in log.lines] == _rich_lines(text, wide)
        await pilot.resize_terminal(50, 20)  # shrinking re-wraps too: nothing is clipped
        assert await wait_for(pilot, lambda: log.scrollable_content_region.width < narrow and not log.pending)
        small = log.scrollable_content_region.width
        assert [s.text.rstrip() for s in log.lines] == _rich_lines(text, small)


async def test_chat_transcript_rewraps_on_resize(system):
    app = CalConsoleApp(system, load_layout("chat"))
    async with app.run_test(size=(100, 30)) as pilot:
        log = app.query_one("#chat-log")
        log.write(_text(600))
        assert await wait_for(pilot, lambda: not log.pending)
        before = log.scrollable_content_region.width
        await pilot.resize_terminal(160, 30)
        assert await wait_for(pilot, lambda: log.scrollable_content_region.width > before and not log.pending)
        assert max(len(s.text.rstrip()) for s in log.lines) > before


# --- words a user has --------------------------------------------------------------------------


def _all_help(parser: argparse.ArgumentParser) -> str:
    out = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.append(_all_help(sub))
    return "\n".join(out)


def test_help_texts_cite_no_documents_the_user_does_not_have():
    from calconsole.cli import build_parser

    text = _all_help(build_parser())
    assert "bench" in text and "keys" in text
    assert not re.search(r"FACTS|report §|§\d", text), re.findall(r".{30}(?:FACTS|§).{30}", text)


async def test_panes_cite_no_documents_and_the_footer_says_what_t_does(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(160, 50)) as pilot:
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        app.query_one("#observation").focus()
        # the footer, as the README says (it is redrawn after the focus moves)
        assert await wait_for(pilot, lambda: "per-layer: step/decode/prefill" in screen_text(app), timeout_s=5)
        screen = screen_text(app)
        assert "FACTS" not in screen and "§" not in screen
    readme = (__import__("pathlib").Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "`t` cycles the per-layer table (last step / decode / prefill)" in readme
