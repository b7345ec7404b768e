"""The console used as a person uses it: Pilot presses keys and reads widgets."""

from __future__ import annotations

import pytest
from textual.widgets import Button, Static

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from sim_backend.device.clock import Pacing, PacingMode
from tests.console.pilot_helpers import click_button, confirm_ask, log_lines, wait_for


@pytest.fixture
def system(make_system):
    return make_system(pacing=Pacing(PacingMode.REALTIME, speed=1.0), drain_timeout_s=0.5)


async def test_inputs_show_a_steady_cursor_and_no_blink_timer_runs(system):
    """A blinking cursor repainted the focused input's column twice a second: most of an idle console's CPU
    (2.5 -> 1.6 % of a core in tmux, widgets/inputs.py). The cursor is shown, steadily, where one types."""
    from textual.widgets import Input

    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(170, 50)) as pilot:
        inp = app.query_one("#chat-input", Input)
        assert await wait_for(pilot, lambda: app.focused is inp)
        assert all(i.cursor_blink is False for i in app.query(Input))
        assert inp._cursor_visible  # shown while focused
        assert inp._blink_timer is not None and not inp._blink_timer._active.is_set()  # paused: no repaints
        await pilot.press("a")
        assert await wait_for(pilot, lambda: inp.value == "a")
        assert inp._cursor_visible and not inp._blink_timer._active.is_set()  # a key does not start it


def set_max_tokens(app, n):
    app.query_one("#p-max-tokens").value = str(n)


async def test_typed_prompt_streams_reply_and_counters_rise(system, monkeypatch):
    from calconsole.panes.chat import ChatPane

    shown: list[tuple[bool, str]] = []  # (request still running, text on the stream line) per piece
    orig = ChatPane._on_piece

    def on_piece(self, text):
        orig(self, text)
        shown.append((self.handle is not None, str(self.query_one("#chat-stream", Static).render())))

    monkeypatch.setattr(ChatPane, "_on_piece", on_piece)
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(170, 50)) as pilot:
        await wait_for(pilot, lambda: app.last_snapshot is not None)
        finished_before = app.last_snapshot.jobs.finished
        set_max_tokens(app, 80)
        await pilot.click("#chat-input")
        await pilot.press(*"Hello there")
        await pilot.press("enter")
        assert await wait_for(pilot, lambda: app.query_one("#chat").handle is None)
        # the log renders what was written in slices (WrapLog.pending): read it once it has all been drawn
        assert await wait_for(pilot, lambda: not app.query_one("#chat-log").pending)
        # streamed: many pieces arrived while the request was running, shown on the stream line
        assert len(shown) >= 10 and all(running for running, _ in shown)
        assert shown[0][1].startswith("model ") and len(shown[-1][1]) > len(shown[0][1])
        assert str(app.query_one("#chat-stream", Static).render()) == ""  # moved into the log when done
        lines = log_lines(app, "#chat-log")
        assert lines[0] == "you Hello there"
        assert lines[1].startswith("model ")
        # one line of figures under the reply (sim ms, said in the pane's title), the full set on Ctrl+R
        figures = lines[-1].split()
        assert lines[-1].startswith("  TTFT ") and " · 80 tok · limit" in lines[-1], lines[-1]
        assert len(lines[-1]) <= app.query_one("#chat-log").size.width, figures
        assert "sim ms" in str(app.query_one("#chat").border_title)
        await pilot.press("ctrl+r")
        details = app.query_one("#chat-details", Static)
        assert await wait_for(pilot, lambda: details.display)
        metrics = " ".join(str(details.render()).split())
        assert "TTFT" in metrics and "TPOT" in metrics and "sim ms (device time + modeled host work)" in metrics
        assert "generated 80 tok" in metrics and "E2E" in metrics and "seed" in metrics
        await pilot.press("ctrl+r")
        assert await wait_for(pilot, lambda: not details.display)
        # the observation pane's finished-jobs counter rises (1 prefill + 79 decode jobs)
        assert await wait_for(pilot, lambda: app.last_snapshot.jobs.finished >= finished_before + 80)
        jobs_text = str(app.query_one("#obs-jobs", Static).render())
        assert f"finished {app.last_snapshot.jobs.finished}" in jobs_text
        assert app.last_snapshot.kv.used_tokens > 0
        assert len(app.last_snapshot.last_step.layers) == 48


async def test_escape_cancels_and_marks_reply(system):
    app = CalConsoleApp(system, load_layout("chat"))
    async with app.run_test(size=(170, 50)) as pilot:
        set_max_tokens(app, 2000)
        await pilot.click("#chat-input")
        await pilot.press(*"go on")
        await pilot.press("enter")
        assert await wait_for(pilot, lambda: app.query_one("#chat").handle is not None)
        assert await wait_for(pilot, lambda: app.query_one("#chat")._stream_text)  # a reply is streaming
        await pilot.press("escape")
        assert await wait_for(pilot, lambda: app.query_one("#chat").handle is None)
        # the reply line is written in slices (WrapLog.pending): read the log once all of it is drawn
        assert await wait_for(pilot, lambda: not app.query_one("#chat-log").pending)
        lines = log_lines(app, "#chat-log")
        assert any("[cancelled:" in line for line in lines)
        # the prompt comes back to edit or resend, the cursor at its end (it was at the start)
        inp = app.query_one("#chat-input")
        assert inp.value == "go on" and inp.cursor_position == len("go on")
        assert app.query_one("#chat-input").value == "go on"  # prompt restored
        assert app.query_one("#chat").history == []


async def test_reset_disabled_outside_exclusive_and_works_inside(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(170, 50)) as pilot:
        reset = app.query_one("#m-reset", Button)
        clear = app.query_one("#m-clear", Button)
        assert reset.disabled and clear.disabled
        await pilot.click("#m-reset")  # does nothing: no modal
        assert len(app.screen_stack) == 1
        await pilot.click("#m-enter")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: not reset.disabled)
        assert await wait_for(pilot, lambda: app.last_snapshot and app.last_snapshot.device.mode == "exclusive")
        await pilot.click("#m-reset")
        assert await wait_for(pilot, lambda: len(app.screen_stack) == 2)
        modal = app.screen
        assert app.focused.id == "confirm-name"  # typing goes straight into the name field
        assert app.focused.cursor_blink is False and app.focused._cursor_visible  # a steady cursor
        assert modal.query_one("#confirm-ok", Button).disabled
        await pilot.press("enter")  # Enter without the name: the default, Cancel
        assert await wait_for(pilot, lambda: len(app.screen_stack) == 1)
        assert await wait_for(pilot, lambda: any("cancelled" in line for line in log_lines(app, "#m-log")))
        assert app.last_snapshot.jobs.resets == 0
        await click_button(pilot, "#m-reset")  # a second click on the same button
        assert await wait_for(pilot, lambda: len(app.screen_stack) == 2)
        modal = app.screen
        await pilot.press(*"calculet")
        assert modal.query_one("#confirm-ok", Button).disabled  # not the exact name yet
        await pilot.press("0")
        assert not modal.query_one("#confirm-ok", Button).disabled
        await pilot.press("enter")
        assert await wait_for(pilot, lambda: any("reset: ok" in line for line in log_lines(app, "#m-log")))
        assert await wait_for(pilot, lambda: app.last_snapshot.jobs.resets == 1)
        await pilot.click("#m-leave")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: reset.disabled)


async def test_a_second_send_while_submitting_is_refused(system):
    app = CalConsoleApp(system, load_layout("chat"))
    async with app.run_test(size=(170, 50)) as pilot:
        set_max_tokens(app, 30)
        from textual.widgets import Input

        chat = app.query_one("#chat")
        inp = app.query_one("#chat-input", Input)
        # every notice as it is raised (the app's own list drops a notice once its timeout has passed,
        # which on a loaded host can happen before the first look)
        notices: list[str] = []
        notify = app.notify
        app.notify = lambda message, *a, **kw: (notices.append(str(message)), notify(message, *a, **kw))[1]
        # two Enters handled back to back, before the worker has submitted the first request
        inp.post_message(Input.Submitted(inp, "first"))
        inp.post_message(Input.Submitted(inp, "second"))
        # the second was handled (and refused) before anything else: its notice is out, no worker started
        assert await wait_for(pilot, lambda: any("a reply is still streaming" in n for n in notices))
        assert await wait_for(pilot, lambda: chat.handle is None and not chat._submitting and chat.history)
        assert system.observation.snapshot().requests.counters.submitted == 1
        assert [m["content"] for m in chat.history if m["role"] == "user"] == ["first"]


async def test_maintenance_keys_keep_working_after_entering_exclusive(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(170, 50)) as pilot:
        await pilot.press("f3")
        assert app.focused.id == "m-enter"
        await pilot.press("x")
        await confirm_ask(pilot)
        pane = app.query_one("#maintenance")
        assert await wait_for(pilot, lambda: pane.lease is not None)
        await pilot.pause()
        assert app.focused is not None and pane in app.focused.ancestors_with_self and not app.focused.disabled
        await pilot.press("r")  # the pane's key still reaches it: the confirmation opens
        assert await wait_for(pilot, lambda: len(app.screen_stack) == 2)
        await pilot.press("escape")


async def test_hidden_panes_take_no_keys_when_the_terminal_is_too_small(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(170, 50)) as pilot:
        await pilot.resize_terminal(70, 20)
        await pilot.pause()
        assert app.query_one("#too-small").display
        await pilot.press("f2", *"hidden", "enter")
        await pilot.pause()  # the keys' effects, had they any (a submit marks the pane at once), are in
        chat = app.query_one("#chat")
        assert app.query_one("#chat-input").value == "" and not chat._submitting and chat.handle is None
        assert chat.history == [] and system.observation.snapshot().requests.counters.submitted == 0
        await pilot.resize_terminal(170, 50)
        await pilot.pause()
        assert not app.query_one("#too-small").display and app.query_one("#columns").display


def test_start_progress_goes_to_stderr_until_the_console_runs_then_to_the_console(capsys):
    from calconsole.app import StartProgress

    shown: list[str] = []

    class FakeApp:
        def call_from_thread(self, fn, line):
            fn(line)

        def show_start_progress(self, line):
            shown.append(line)

    p = StartProgress()
    p("compiling numerics kernels, 1/2: decode step")
    assert "calconsole: compiling numerics kernels, 1/2" in capsys.readouterr().err
    app = FakeApp()
    assert p.attach(app) == "compiling numerics kernels, 1/2: decode step"  # the console shows it at mount
    p("numerics kernels ready after 40 s: new requests run the numerics")
    assert shown == ["numerics kernels ready after 40 s: new requests run the numerics"]
    assert capsys.readouterr().err == "" and len(p.lines) == 2
