"""A fresh user's findings on the console (hardening, third pass): each test failed before its fix.

The chat tests run a fast-paced, timing-only simulator: what they check is the pane, not the model.
"""

from __future__ import annotations

import json
import socket

import pytest
from textual.widgets import Footer

from calconsole.app import CalConsoleApp
from calconsole.cli import main
from calconsole.layout import load_layout
from calconsole.widgets.help import HelpScreen
from tests.console.pilot_helpers import log_lines, wait_for


@pytest.fixture
def fast_system(make_system):
    return make_system(numerics=False, drain_timeout_s=0.5)


def you_lines(app) -> list[str]:
    return [line for line in log_lines(app, "#chat-log") if line.startswith("you ")]


def footer_text(app) -> str:
    """The footer's row as drawn (the screen's last line)."""
    row = app.screen_stack[0].query_one(Footer).region.y
    return app.screen._compositor.render_strips()[row].text


# --- 1. a "?" typed fast at the end of a message ------------------------------------------------


def type_burst(app, text: str) -> None:
    """Keys as a terminal delivers a fast typist's: every key posted before the app handles any (the driver's
    input thread parses one read's bytes and posts each key at once; Pilot.press waits for the app to go idle
    after each key, so on its own it never shows the race)."""
    from textual import events
    from textual.keys import _character_to_key

    for ch in text:
        app._driver.send_message(events.Key("enter", "\r") if ch == "\r" else events.Key(_character_to_key(ch), ch))


@pytest.mark.parametrize("typing", ["pilot", "burst"])
async def test_a_question_mark_typed_fast_ends_the_message_and_opens_no_help(fast_system, typing):
    # the app's priority "?" binding looked at the input's value before the input had handled the keys
    # typed before it: the help opened and the message was lost
    app = CalConsoleApp(fast_system, load_layout("operator"))
    msg = "what is two plus two?"
    async with app.run_test(size=(160, 48)) as pilot:
        inp = app.query_one("#chat-input")
        assert await wait_for(pilot, lambda: app.focused is inp)
        app.query_one("#p-max-tokens").value = "2"
        if typing == "pilot":
            await pilot.press(*msg, "enter")  # in one go, as fast as Pilot types
        else:
            type_burst(app, msg + "\r")
        assert await wait_for(pilot, lambda: app.query_one("#chat").history or isinstance(app.screen, HelpScreen))
        assert not isinstance(app.screen, HelpScreen)
        assert app.query_one("#chat").history[0] == {"role": "user", "content": msg}
        assert you_lines(app) == [f"you {msg}"]
        # "?" on the empty input still opens the help (typed alone or at the start of a burst), and the footer
        # still names it
        assert "? help" in footer_text(app), footer_text(app)
        type_burst(app, "?")
        assert await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        assert inp.value == ""


# --- 2. a refused send adds no "you ..." line ----------------------------------------------------


async def test_a_refused_send_adds_no_transcript_line(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        chat = app.query_one("#chat")
        app.query_one("#p-temperature").value = "-1"
        app.query_one("#p-max-tokens").value = "2"
        for _ in range(3):  # each refused send put another "you hello" in the transcript
            app.query_one("#chat-input").focus()
            await pilot.press(*"hello", "enter")
            assert await wait_for(pilot, lambda: "temperature" in str(app.query_one("#chat-status").render()))
            assert await wait_for(pilot, lambda: app.query_one("#chat-input").value == "hello")
            assert not chat._submitting
            app.query_one("#chat-input").value = ""
        assert you_lines(app) == []
        app.query_one("#p-temperature").value = "0.8"
        app.query_one("#chat-input").focus()
        await pilot.press(*"hello", "enter")
        assert await wait_for(pilot, lambda: chat.history)
        assert you_lines(app) == ["you hello"]


# --- 3. the sampling panel has a key, named in the footer and the help; the focused field shows --------


async def test_ctrl_s_opens_the_sampling_panel_on_its_first_field_and_closes_it(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        inp = app.query_one("#chat-input")
        assert await wait_for(pilot, lambda: app.focused is inp)
        assert await wait_for(pilot, lambda: "sampling" in footer_text(app)), footer_text(app)
        panel = app.query_one("#chat-params")
        assert panel.collapsed
        await pilot.press("ctrl+s")
        first = app.query_one("#p-temperature")
        assert await wait_for(pilot, lambda: app.focused is first)
        assert not panel.collapsed
        await pilot.pause()
        other = app.query_one("#p-top-k")
        # marked: the focused field's background differs from the others' (a compact input has no border)
        assert first.styles.background != other.styles.background
        assert first.styles.text_style.bold and not other.styles.text_style.bold
        await pilot.press("tab")
        assert await wait_for(pilot, lambda: app.focused is other)
        await pilot.press("ctrl+s")  # from inside the panel: closed, back to the message
        assert await wait_for(pilot, lambda: app.focused is inp and panel.collapsed)
        await pilot.press("question_mark")
        assert await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        from tests.console.test_operator_ux import plain

        assert "^s           sampling" in plain(app.screen.content)


# --- 4. seed -1: a random seed, as llama-server --------------------------------------------------


async def test_seed_minus_one_in_the_pane_is_a_random_seed(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        chat = app.query_one("#chat")
        app.query_one("#p-seed").value = "-1"
        app.query_one("#p-max-tokens").value = "2"
        sp, _, _ = chat.read_params()
        assert sp.seed is None
        app.query_one("#chat-input").focus()
        await pilot.press(*"hi", "enter")
        assert await wait_for(pilot, lambda: chat.history), str(app.query_one("#chat-status").render())
        assert "-refused" not in app.query_one("#p-seed").classes
        assert await wait_for(pilot, lambda: " seed " in " ".join(chat.full_figures))


def test_seed_minus_one_and_llama_default_seed_are_random_in_every_edge():
    from calconsole.server.wire import sampling_from
    from sim_backend.planes import seed_or_random

    assert seed_or_random(-1) is None and seed_or_random(4294967295) is None
    assert seed_or_random(7) == 7 and seed_or_random(None) is None and seed_or_random(-1.0) == -1.0
    assert sampling_from({"seed": -1}).seed is None
    assert sampling_from({"seed": 4294967295}).seed is None  # llama-server's LLAMA_DEFAULT_SEED: random
    assert sampling_from({"seed": 12}).seed == 12
    from calconsole.cli import build_parser
    from calconsole.commands.chat import request_from_args

    args = build_parser().parse_args(["chat", "hi", "--seed", "-1"])
    assert request_from_args(args, "hi").sampling.seed is None


# --- 7. calconsole audit piped: one line per entry ------------------------------------------------


def test_audit_piped_prints_each_entry_on_one_full_line(make_system, tmp_path, monkeypatch, capsys):
    log = tmp_path / "audit.jsonl"
    system = make_system(numerics=False, audit_path=log)
    m = system.maintenance
    lease = m.enter_exclusive("a-holder-with-a-rather-long-name-for-the-audit-table")
    m.write_register(lease, "CHIP0_SCRATCH", "0x1234")
    m.leave_exclusive(lease)
    monkeypatch.delenv("COLUMNS", raising=False)
    capsys.readouterr()
    assert main(["audit", "--audit-log", str(log)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if "exclusive" in line or "register" in line]
    # folded at 80 columns, an entry took several lines and its arguments were cut between them
    assert any(len(line) > 80 for line in rows), out
    enter = [line for line in rows if "enter_exclusive" in line]
    assert len(enter) == 1 and "a-holder-with-a-rather-long-name-for-the-audit-table" in enter[0], out


# --- 8. a bad settings file: the same typed error for every command -------------------------------


@pytest.mark.parametrize("argv", [[], ["snapshot", "--json"], ["audit"]])
def test_a_bad_settings_file_stops_every_command_with_the_same_error(tmp_path, monkeypatch, capsys, argv):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("refresh_hz: fast\n")
    monkeypatch.setenv("CALCONSOLE_CONFIG", str(cfg))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"settings {cfg}: key 'refresh_hz'" in err, err
    assert "Traceback" not in err


# --- 9. --listen on a busy port: refused before the device is built ---------------------------------


def test_listen_on_a_busy_port_is_refused_before_the_device_is_built(monkeypatch, capsys):
    import calconsole.commands.common as common

    built = []
    monkeypatch.setattr(common, "build_from_args", lambda *a, **k: built.append(1))
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        assert main(["--listen", f"127.0.0.1:{port}"]) == 2
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert f"--listen 127.0.0.1:{port}: cannot listen" in err and "in use" in err, err
    assert built == []


# --- 10. a timing-only device does not say "synthetic weights" -------------------------------------


@pytest.mark.parametrize(("numerics", "word"), [(False, "timing-only"), (True, "synthetic weights")])
async def test_a_timing_only_device_says_so_in_the_chat_banner(make_system, numerics, word):
    app = CalConsoleApp(make_system(numerics=numerics), load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        banner = app.query_one("#chat-notice")
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        await pilot.pause()
        assert str(banner.render()).startswith(word), str(banner.render())
        if not numerics:
            assert "synthetic" not in str(banner.render()) and "seeded generator" in str(banner.tooltip)


def test_settings_error_text_is_one_line(tmp_path, monkeypatch):
    from calconsole.settings import SettingsError, load_settings

    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({"theme": 3}))
    with pytest.raises(SettingsError) as e:
        load_settings(cfg)
    assert "\n" not in str(e.value)
