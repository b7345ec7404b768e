"""Keys a fresh user met in the console: Tab order, confirmations of maintenance actions, the help's key list, a
prompt put back after a cancel, the footer at 80 columns, the "sim" labels. Each test failed before its fix.

The chat tests run a timing-only simulator: what they check is the pane, not the model.
"""

from __future__ import annotations

import pytest
from textual.widgets import Footer

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.panes.maintenance import MaintenancePane
from calconsole.widgets import confirm
from calconsole.widgets.confirm import ConfirmModal
from calconsole.widgets.help import HelpScreen
from tests.console.pilot_helpers import confirm_ask, enter_exclusive, has, log_text, wait_for


@pytest.fixture
def fast_system(make_system):
    return make_system(numerics=False, drain_timeout_s=0.5)


#: the yes / no question (absent before it was added: then no screen is one, and the tests say so)
AskModal = getattr(confirm, "AskModal", ())


def footer_text(app) -> str:
    """The footer's row as drawn (the screen's last line)."""
    row = app.screen_stack[0].query_one(Footer).region.y
    return app.screen._compositor.render_strips()[row].text


def entered(system) -> list[dict]:
    return [e for e in system.maintenance.audit.entries() if e["action"] == "enter_exclusive"]


# --- 1. Tab stays in the focused pane; every way into exclusive mode asks first -----------------------


@pytest.mark.parametrize("layout,size", [("operator", (160, 48)), ("chat", (80, 24))])
async def test_tab_from_the_chat_input_stays_in_the_chat_pane(fast_system, layout, size):
    # Tab from the chat input jumped into the maintenance pane, onto "x Exclusive"
    app = CalConsoleApp(fast_system, load_layout(layout))
    async with app.run_test(size=size) as pilot:
        chat, inp = app.query_one("#chat"), app.query_one("#chat-input")
        assert await wait_for(pilot, lambda: app.focused is inp)
        await pilot.press("tab")
        # first the sampling panel (its title opens it), not the transcript and not another pane
        assert await wait_for(pilot, lambda: app.focused is not inp)
        assert app.focused.parent is app.query_one("#chat-params"), app.focused
        for key in ["tab"] * 6 + ["shift+tab"] * 6:
            await pilot.press(key)
            assert chat in app.focused.ancestors_with_self, (key, app.focused)
        app.query_one("#chat-params").collapsed = False  # open: Tab walks its fields, then back to the input
        await pilot.pause()
        seen = set()
        for _ in range(20):
            await pilot.press("tab")
            assert chat in app.focused.ancestors_with_self, app.focused
            seen.add(app.focused.id)
        assert {"p-temperature", "p-stop", "p-reset", "chat-input"} <= seen, seen
        # F3 still moves to the maintenance pane; Tab then walks its buttons and stays there
        await pilot.press("f3")
        pane = app.query_one(MaintenancePane)
        assert await wait_for(pilot, lambda: pane in app.focused.ancestors_with_self)
        for _ in range(8):
            await pilot.press("tab")
            assert pane in app.focused.ancestors_with_self, app.focused
        assert entered(fast_system) == []


async def test_every_way_into_exclusive_mode_asks_first(fast_system):
    # Enter on the focused "x Exclusive" button entered exclusive mode at once, draining the device
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(MaintenancePane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        await pilot.press("f3")
        assert await wait_for(pilot, lambda: app.focused is not None and app.focused.id == "m-enter")
        # the accident: Enter on the button, then Enter again: the question's default is Cancel
        await pilot.press("enter")
        assert await wait_for(pilot, lambda: isinstance(app.screen, AskModal))
        assert await wait_for(pilot, lambda: getattr(app.screen.focused, "id", None) == "ask-cancel")
        await pilot.press("enter")
        assert await wait_for(pilot, lambda: not isinstance(app.screen, AskModal))
        assert pane.lease is None and entered(fast_system) == []
        assert await wait_for(pilot, lambda: has(app, "#m-log", "enter_exclusive: cancelled at the confirmation"))
        # the key asks the same question; Esc and n cancel
        for cancel in ("escape", "n"):
            app.query_one("#m-log").focus()
            await pilot.press("x")
            assert await wait_for(pilot, lambda: isinstance(app.screen, AskModal))
            await pilot.press(cancel)
            assert await wait_for(pilot, lambda: not isinstance(app.screen, AskModal))
        # the palette's command runs the same action
        pane.action_enter()
        assert await wait_for(pilot, lambda: isinstance(app.screen, AskModal))
        await pilot.press("escape")
        assert await wait_for(pilot, lambda: not isinstance(app.screen, AskModal))
        assert pane.lease is None and entered(fast_system) == []
        assert fast_system.maintenance.mode()["mode"] == "serving"
        # confirmed (the button, then y): granted
        await enter_exclusive(pilot, pane)
        assert [e["status"] for e in entered(fast_system)] == ["granted"]


#: every maintenance key that asked no question before (be10793 asked only for x and L), with its plane action
ASKING = [("l", "leave_exclusive"), ("o", "reload_model"), ("t", "self_test"), ("h", "health_check"),
          ("p", "probe_request"), ("k", "clear_kv"), ("d", "dump"), ("1", "inject_fault"), ("f", "inject_fault"),
          ("2", "inject_fault"), ("3", "inject_fault"), ("4", "inject_fault"), ("0", "clear_faults"),
          ("v", "read_register"), ("w", "write_register"), ("e", "dump_registers")]


async def _ask_and_cancel(pilot, cancel: str) -> str:
    """Wait for the yes / no question, cancel it with ``cancel``; the question it asked."""
    app = pilot.app
    assert await wait_for(pilot, lambda: isinstance(app.screen, AskModal)), type(app.screen).__name__
    assert await wait_for(pilot, lambda: getattr(app.screen.focused, "id", None) == "ask-cancel")
    question = app.screen.question
    await pilot.press(cancel)
    assert await wait_for(pilot, lambda: not isinstance(app.screen, AskModal))
    return question


async def test_every_maintenance_action_asks_and_a_cancel_runs_nothing(fast_system):
    # the product rule: every maintenance action is confirmed; t, o, k, d, the faults, the registers and a plain
    # l ran at once (only x and L asked). Keys, buttons and the palette's commands: each asks, names the action,
    # and Enter / Esc / n run nothing and write no audit record; y runs it, audited
    from calconsole.panes.maintenance import ASK, PALETTE

    app = CalConsoleApp(fast_system, load_layout("operator"))
    audit = fast_system.maintenance.audit
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(MaintenancePane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        await enter_exclusive(pilot, pane)
        assert await wait_for(pilot, lambda: not any(w.is_running for w in pane.workers))
        pane.query_one("#m-reg").value = "CHIP0_SCRATCH"
        pane.query_one("#m-reg-value").value = "7"
        records = len(audit.read())
        cancels = ("enter", "escape", "n")
        for i, (key, action) in enumerate(ASKING):
            pane.query_one("#m-log").focus()
            await pilot.press(key)
            question = await _ask_and_cancel(pilot, cancels[i % 3])
            assert question.endswith("?") and len(question) > 20, (key, question)
            if key not in ("v", "w"):
                assert question == ASK[{"1": "fault_ccu", "f": "fault_ccu", "2": "fault_kv", "3": "fault_link",
                                        "4": "fault_slow"}.get(key, action)][1], (key, question)
            else:  # the register question names the register (and the value written)
                assert "CHIP0_SCRATCH" in question and (key == "v" or "7" in question), question
            assert has(app, "#m-log", f"{action}: cancelled at the confirmation"), key
        assert "Run the golden self-test on the device?" in {ASK[a][1] for a in ASK}
        # the buttons and the palette's commands run the same actions: the same questions
        buttons = [b for b, a in pane.BUTTON_ACTIONS.items() if a not in ("enter", "reset", "clear", "acknowledge")]
        assert len(buttons) == 15
        for bid in buttons:
            pane.query_one(f"#{bid}").press()
            await _ask_and_cancel(pilot, "escape")
        palette = [a for _t, _k, a in PALETTE if a not in ("enter", "leave_force", "reset", "clear", "acknowledge")]
        assert len(palette) == 15
        for action in palette:
            getattr(pane, f"action_{action}")()  # what the palette's command calls (app.get_system_commands)
            await _ask_and_cancel(pilot, "n")
        # nothing ran: no audit record, the lease held, no fault armed, the register unchanged
        assert len(audit.read()) == records, audit.entries()[-3:]
        assert pane.lease is not None and fast_system.maintenance.mode()["mode"] == "exclusive"
        assert not fast_system.observation.snapshot().device.faults
        # y runs it: audited, granted
        pane.query_one("#m-log").focus()
        await pilot.press("w")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "CHIP0_SCRATCH: 0 -> 7")), log_text(app, "#m-log")
        assert [(e["action"], e["status"]) for e in audit.entries()][-1] == ("write_register", "granted")
        # acknowledge (no lease needed) asks too: fire a fault first, then a, cancelled, then confirmed
        for key in ("1", "p"):
            await pilot.press(key)
            await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: bool(pane._fired))
        assert await wait_for(pilot, lambda: not any(w.is_running for w in pane.workers))
        records = len(audit.read())
        await pilot.press("a")
        assert await _ask_and_cancel(pilot, "escape") == "Acknowledge the faults that fired?"
        assert len(audit.read()) == records and pane._fired
        await pilot.press("a")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: audit.entries()[-1]["action"] == "acknowledge_faults")


# --- 7. after a memory clear, leaving with force has a key, and it asks first ---------------------


async def test_after_a_memory_clear_L_leaves_with_force_once_confirmed(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    audit = fast_system.maintenance.audit
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(MaintenancePane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        await enter_exclusive(pilot, pane)
        app.query_one("#m-log").focus()
        await pilot.press("c")
        assert await wait_for(pilot, lambda: isinstance(app.screen, ConfirmModal))
        await pilot.press(*pane.device_name, "enter")
        assert await wait_for(pilot, lambda: has(app, "#m-log", "clear_device_memory: ok"))
        app.query_one("#m-log").focus()
        await pilot.press("l")  # a plain leave is refused until the model is reloaded, and says which key forces
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "L leaves with force (it asks first)"))
        assert pane.lease is not None
        await pilot.press("L")
        assert await wait_for(pilot, lambda: isinstance(app.screen, AskModal))
        await pilot.press("enter")  # Cancel, the default
        assert await wait_for(pilot, lambda: has(app, "#m-log", "leave_exclusive (force): cancelled"))
        assert pane.lease is not None and fast_system.maintenance.mode()["mode"] == "exclusive"
        await pilot.press("L")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: pane.lease is None)
        assert fast_system.maintenance.mode()["mode"] == "serving"
        leaves = [e for e in audit.entries() if e["action"] == "leave_exclusive"]
        assert leaves[-1]["args"].get("force") is True and leaves[-1]["status"] == "granted", leaves[-1]
        # named in the help screen (the footer has no room for it)
        app.query_one("#m-log").focus()
        await pilot.press("question_mark")
        assert await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        from tests.console.test_operator_ux import plain

        assert "leave (force)" in plain(app.screen.content)


# --- 2. the help lists each key once ----------------------------------------------------------------


async def test_the_help_lists_pgdn_once(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        assert await wait_for(pilot, lambda: app.focused is app.query_one("#chat-input"))
        await pilot.press("question_mark")
        assert await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        from tests.console.test_operator_ux import plain

        text = plain(app.screen.content)
        assert text.count("pgdn") == 1, [ln for ln in text.splitlines() if "pgdn" in ln]
        assert "pgup/pgdn" in text


# --- 3. a cancelled prompt is put back selected: typing replaces it, Ctrl+L clears it ------------------


async def cancelled_prompt(pilot, app, prompt: str) -> None:
    chat = app.query_one("#chat")
    app.query_one("#p-max-tokens").value = "3000"
    app.query_one("#chat-input").focus()
    await pilot.press(*prompt, "enter")
    assert await wait_for(pilot, lambda: chat.handle is not None and chat._stream_text)
    await pilot.press("escape")
    assert await wait_for(pilot, lambda: chat.handle is None and app.query_one("#chat-input").value == prompt)


async def test_a_cancelled_prompt_comes_back_selected_and_typing_replaces_it(make_system):
    system = make_system(numerics=False)  # paced in real time: the 3000-token reply is still streaming at Esc
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        chat, inp = app.query_one("#chat"), app.query_one("#chat-input")
        await cancelled_prompt(pilot, app, "Count to ten")
        assert inp.selected_text == "Count to ten"  # shown, and selected
        assert "Enter resends it, typing replaces it" in str(app.query_one("#chat-status").render())
        await pilot.press(*"Hi")  # was "Count to tenHi"
        assert inp.value == "Hi"
        # Ctrl+L: a restored prompt goes with the conversation ...
        await pilot.press("ctrl+a", "ctrl+k")  # (empty the input)
        assert inp.value == ""
        await cancelled_prompt(pilot, app, "Count to five")
        await pilot.press("ctrl+l")
        assert await wait_for(pilot, lambda: inp.value == "" and not chat.history)
        # ... while a message the user typed stays: it is the next message
        await pilot.press(*"Hello")
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert inp.value == "Hello"


# --- 5. the footer at 80 columns: whole entries only ------------------------------------------------


async def test_the_footer_shows_whole_entries_at_80_columns(fast_system):
    # the chat pane's footer read "... ^s samplin▏^p palette"
    app = CalConsoleApp(fast_system, load_layout("chat"))
    async with app.run_test(size=(80, 24)) as pilot:
        assert await wait_for(pilot, lambda: app.focused is app.query_one("#chat-input"))
        whole = ("sampling", "chat", "scroll", "help", "cancel", "quit")

        def fitted() -> bool:  # the footer is fitted one refresh after each recompose (widgets/footer.py): wait
            foot = footer_text(app)
            return "^s sampling " in foot and foot.split("▏")[0].split()[-1] in whole

        assert await wait_for(pilot, fitted), footer_text(app)
        foot = footer_text(app)
        for entry in ("? help", "esc cancel", "^l new chat", "pgup/pgdn scroll", "^p palette"):
            assert entry in foot, (entry, foot)
        shown = foot.split("▏")[0].split()
        assert shown[-1] in whole, foot  # no word cut
        # and in the maintenance pane: the entries that fit, each whole
        await pilot.press("f3")
        assert await wait_for(pilot, lambda: "exclusive" in footer_text(app)), footer_text(app)
        words = footer_text(app).split("▏")[0].split()
        pane = app.query_one(MaintenancePane)
        descriptions = " ".join(b.description for b in pane.BINDINGS) + " help"
        assert all(w in descriptions or len(w) <= 2 for w in words), words
        assert "? help" in footer_text(app), footer_text(app)  # the footer always names the help key


async def test_the_audit_log_path_wraps_at_words(fast_system, tmp_path):
    # at 80x24 (chat layout, its columns) the path wrapped mid-word: ".../aud" / "it.jsonl"
    from calconsole.settings import Settings

    app = CalConsoleApp(fast_system, load_layout("chat"), settings=Settings(panes="columns"))
    async with app.run_test(size=(80, 24)) as pilot:
        pane = app.query_one(MaintenancePane)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "audit log"))
        await pilot.pause()
        from tests.console.pilot_helpers import log_lines

        lines = [ln.strip() for ln in log_lines(app, "#m-log")]
        name = pane.maintenance.audit.path.name
        assert any(name in ln.split() for ln in lines), lines  # the file name whole on its line
        assert f"audit log: {name} in " in log_text(app, "#m-log")
        from calconsole.panes.maintenance_text import audit_line

        assert audit_line("audit.jsonl") == "audit log: audit.jsonl"  # a relative name: as given
        home = __import__("pathlib").Path.home()
        assert audit_line(home / ".local/state/calconsole/audit.jsonl") == \
            "audit log: audit.jsonl in ~/.local/state/calconsole"
        assert audit_line(home / "audit.jsonl") == "audit log: audit.jsonl in ~"  # not "~/."


# --- 4. the header's TTFT / TPOT P95 say sim ----------------------------------------------------------


@pytest.mark.parametrize("compact", [False, True])
def test_the_header_latencies_say_sim(fast_system, compact):
    from calconsole.settings import Settings
    from calconsole.widgets.render.header import header_line

    line = header_line(fast_system.observation.snapshot(), Settings(), compact=compact).plain
    if compact:
        assert "ms sim" in line.split("P95 TTFT", 1)[1].split("fail")[0], line
    else:
        assert "TTFT p95 - ms sim" in line and "TPOT p95 - ms sim" in line, line


# --- 8. a negative seed as llama-server reads it: modulo 2**32 ----------------------------------------


def test_a_negative_seed_is_read_modulo_2_32_at_every_edge():
    # measured on the real llama-server (tests/server/test_parity_llama_server.py): -5 is the fixed seed
    # 4294967291, -2**32-1 wraps to 4294967295 (a random one); calconsole refused every seed below -1
    from calconsole.cli import build_parser
    from calconsole.commands.chat import request_from_args
    from calconsole.server.wire import sampling_from
    from sim_backend.errors import InvalidRequestError
    from sim_backend.planes import SamplingParams, seed_or_random

    assert seed_or_random(-5) == 4294967291 and seed_or_random(-2) == 4294967294
    assert seed_or_random(-2**31) == 2**31 and seed_or_random(-2**63) == 0
    assert seed_or_random(-1) is None and seed_or_random(-2**32 - 1) is None  # both wrap to 0xFFFFFFFF
    assert seed_or_random(2**40) == 2**40  # non-negative seeds stay as given: a drawn one is 64-bit
    assert sampling_from({"seed": -5}).seed == 4294967291
    args = build_parser().parse_args(["chat", "hi", "--seed", "-5"])
    assert request_from_args(args, "hi").sampling.seed == 4294967291
    # below int64 (llama-server reads it as a float, converted to uint32 as C++ leaves undefined): refused
    with pytest.raises(InvalidRequestError, match="seed must be in"):
        SamplingParams(seed=seed_or_random(-2**63 - 1)).validate()


async def test_seed_minus_five_in_the_pane_is_a_fixed_seed(fast_system):

    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        chat = app.query_one("#chat")
        app.query_one("#p-seed").value = "-5"
        app.query_one("#p-max-tokens").value = "4"
        replies = []
        for _ in range(2):
            app.query_one("#chat-input").focus()
            await pilot.press(*"hi", "enter")
            assert await wait_for(pilot, lambda: len(chat.history) == 2), str(app.query_one("#chat-status").render())
            replies.append(chat.history[-1]["content"])
            assert await wait_for(pilot, lambda: " seed 4294967291 " in (list(chat.full_figures) or [""])[-1])
            await pilot.press("ctrl+l")  # the same prompt again, from an empty conversation
            assert await wait_for(pilot, lambda: not chat.history)
        assert "-refused" not in app.query_one("#p-seed").classes
        assert replies[0] == replies[1]


# --- a failed action is said once: its type and its action not doubled (a remote console) ---------------


def test_a_remote_device_error_names_its_type_once():
    # the server's 500 says "DeviceError: …" (calconsole/server/wire.from_cal_error); the remote plane prefixed
    # its action and raised DeviceError, so the pane showed "DeviceError: reload_model: DeviceError: …"
    import httpx

    from calconsole.remote.connection import raise_for
    from sim_backend.errors import DeviceError

    body = {"error": {"code": 500, "type": "server_error",
                      "message": "DeviceError: numerics process connection lost during start: exit code 1"}}
    with pytest.raises(DeviceError) as info:
        raise_for(httpx.Response(500, json=body), action="reload_model")
    assert str(info.value) == "reload_model: numerics process connection lost during start: exit code 1"


async def test_a_failed_action_shows_its_type_and_action_once(fast_system):
    from sim_backend.errors import DeviceError

    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(MaintenancePane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        await enter_exclusive(pilot, pane)

        def fails(lease):  # what the remote plane raises for the server's 500 (test above)
            raise DeviceError("reload_model: numerics process connection lost during start")

        pane.maintenance = type("Plane", (), {"reload_model": staticmethod(fails),
                                              "__getattr__": lambda self, n: getattr(fast_system.maintenance, n)})()
        pane.query_one("#m-log").focus()
        await pilot.press("o")
        await confirm_ask(pilot)
        line = "reload_model: refused/failed: DeviceError: numerics process connection lost during start"
        assert await wait_for(pilot, lambda: has(app, "#m-log", line)), log_text(app, "#m-log")
        assert "DeviceError: reload_model" not in log_text(app, "#m-log")
