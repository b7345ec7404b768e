"""The numeric prompt limit: a measured default with its reason, ``--numeric-limit N`` for another."""

from __future__ import annotations

import json
import re

import pytest

from calconsole.cli import build_parser, main
from sim_backend.compose import NUMERIC_LIMIT_REASON, NUMERIC_PROMPT_LIMIT, build_system


def test_default_limit_and_its_reason_reach_the_snapshot(tmp_path):
    with build_system(maintenance=False, n_slots=1, numerics=True) as s:
        d = s.observation.snapshot().to_dict()["device"]
    assert d["numerics_max_prompt"] == NUMERIC_PROMPT_LIMIT and d["numerics_limit_reason"] == NUMERIC_LIMIT_REASON
    with build_system(maintenance=False, n_slots=1, numerics=False) as s:
        d = s.observation.snapshot().to_dict()["device"]
    assert d["numerics_max_prompt"] == 0 and d["numerics_limit_reason"] == ""


def test_option_parses_for_console_and_serve():
    assert build_parser().parse_args(["--numeric-limit", "64"]).numeric_limit == 64
    assert build_parser().parse_args(["serve", "--numeric-limit", "64"]).numeric_limit == 64


def test_prompt_over_the_option_runs_timing_only_and_the_reply_says_so(capsys):
    # 'hello there' with the chat template is more than 3 tokens: timing-only
    assert main(["chat", "hello there", "--numeric-limit", "3", "--max-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["timings"]["numerics"] is False
    assert main(["chat", "hello there", "--numeric-limit", "4096", "--max-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["timings"]["numerics"] is True


@pytest.mark.parametrize("value", ["0", "40961"])
def test_out_of_range_exits_2_with_one_line(capsys, value):
    assert main(["chat", "hi", "--numeric-limit", value]) == 2
    err = capsys.readouterr().err
    assert "--numeric-limit must be in 1..40960" in err and err.count("\n") == 1


def test_build_system_refuses_a_limit_below_one():
    with pytest.raises(ValueError, match="numerics_max_prompt"):
        build_system(maintenance=False, numerics_max_prompt=0)


def test_the_chat_command_says_why_a_reply_ran_timing_only(capsys):
    """A timing-only reply says so on the command line, and why (here: more new prompt tokens than the
    limit); a numeric one does not."""
    assert main(["chat", "hello there", "--numeric-limit", "3", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "timing-only: the tokens are the seeded generator's, not the model's" in err
    assert re.search(r"\(\d+ new prompt tokens, over the numeric limit of 3\)", err), err
    assert main(["chat", "hello there", "--numeric-limit", "4096", "--max-tokens", "2"]) == 0
    assert "timing-only" not in capsys.readouterr().err


@pytest.mark.parametrize("new, cached, limit, says", [
    (300, 0, 256, "300 new prompt tokens, over the numeric limit of 256"),
    (152, 496, 256, "it continues a timing-only turn, whose cached prefix holds no values (Ctrl+L: a new "
                    "conversation)"),
    (10, 0, 256, "the numerics were not ready (kernels still compiling)"),
    (10, 0, 0, "the device runs timing-only (numerics off)"),
    (10, 0, None, "the device did not compute it"),
])
def test_timing_only_reason(new, cached, limit, says):
    from calconsole.widgets.render import timing_only_reason

    assert timing_only_reason(new, cached, limit, new_chat_key="Ctrl+L") == says


async def test_a_turn_after_a_timing_only_turn_says_it_continues_one_and_a_new_chat_runs_numerics():
    """The chat a fresh user tried: a short turn (numerics), a turn over the limit (timing-only, over the
    limit), a short turn after it (timing-only: its cached prefix came from the timing-only turn, and the
    reply line names Ctrl+L), then Ctrl+L and the same short turn with numerics again."""
    from calconsole.app import CalConsoleApp
    from calconsole.layout import load_layout
    from tests.console.pilot_helpers import wait_for

    with build_system(maintenance=False, n_slots=1, numerics=True, numerics_max_prompt=40) as s:
        app = CalConsoleApp(s, load_layout("chat"))
        async with app.run_test(size=(200, 60)) as pilot:
            app.query_one("#p-max-tokens").value = "3"
            chat = app.query_one("#chat")

            async def turn(text: str) -> str:
                n = len(chat.full_figures)
                await pilot.click("#chat-input")
                app.query_one("#chat-input").value = text
                await pilot.press("enter")
                assert await wait_for(pilot, lambda: chat.handle is None and not chat._submitting
                                      and not chat.query_one("#chat-log").pending
                                      and len(chat.full_figures) > n, 60.0)
                return chat.full_figures[-1]  # the reply's full figures (Ctrl+R shows them)

            assert await wait_for(pilot, lambda: chat._numeric_limit == 40)  # the first snapshot came
            first = await turn("hi")
            assert "timing-only" not in first, first
            second = await turn(" ".join(["word"] * 60))
            assert "timing-only (tokens not from the model:" in second and "over the numeric limit of 40" in second
            third = await turn("and again")
            assert "cached" in third and "it continues a timing-only turn" in third and "Ctrl+L" in third, third
            await pilot.press("ctrl+l")
            fourth = await turn("and again")
            assert "timing-only" not in fourth, fourth


def test_the_engine_records_why_a_request_ran_timing_only():
    """The reason is the engine's own, decided at admission (``Timings.timing_only_reason``), for each way a
    request runs timing-only; "" for one with numerics."""
    from sim_backend.planes import ChatRequest, SamplingParams
    from sim_backend.planes.types import CONTINUES_TIMING_ONLY, NUMERICS_OFF

    def ask(s, text):
        return s.inference.generate(ChatRequest.from_prompt(text, max_tokens=2, sampling=SamplingParams(seed=1)),
                                    60).timings

    with build_system(maintenance=False, n_slots=1, numerics=True, numerics_max_prompt=40) as s:
        short = ask(s, "hi")
        assert short.numerics is True and short.timing_only_reason == ""
        long = ask(s, " ".join(["word"] * 60))
        assert long.numerics is False
        assert long.timing_only_reason == f"{long.prompt_n} new prompt tokens, over the numeric limit of 40"
        # the same conversation continued: its prefix (from the timing-only turn) is reused, holds no values
        # (choose_slot reuses such a prefix only for a prompt over the limit as a whole: the reason says so)
        more = ask(s, " ".join(["word"] * 60) + " and again")
        whole = more.prompt_n + more.cache_n
        assert more.numerics is False and more.cache_n > 0 and whole > 40
        assert more.timing_only_reason == CONTINUES_TIMING_ONLY.format(prompt_n=whole, limit=40)
        assert "start a new conversation" in more.timing_only_reason
        # a short turn after it in a new conversation: numerics again (the prefix without values not reused)
        assert ask(s, "and again").timing_only_reason == ""
    with build_system(maintenance=False, n_slots=1, numerics=False) as s:
        off = ask(s, "hi")
        assert off.numerics is False and off.timing_only_reason == NUMERICS_OFF


def test_chat_json_gives_the_reason_with_the_timings(capsys):
    assert main(["chat", "hello there", "--numeric-limit", "3", "--max-tokens", "2", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)["timings"]
    assert t["numerics"] is False
    assert t["timing_only_reason"] == f"{t['prompt_n']} new prompt tokens, over the numeric limit of 3"
    assert main(["chat", "hello there", "--numeric-limit", "4096", "--max-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["timings"]["timing_only_reason"] == ""


def test_a_recorded_reason_is_shown_as_it_is_with_the_new_chat_key():
    from calconsole.widgets.render import timing_only_reason
    from sim_backend.planes.types import CONTINUES_TIMING_ONLY, NUMERICS_NOT_READY

    # the recorded reason wins over what the reply's counts would suggest (here: "over the limit")
    assert timing_only_reason(300, 0, 256, recorded=NUMERICS_NOT_READY) == NUMERICS_NOT_READY
    continues = CONTINUES_TIMING_ONLY.format(prompt_n=300, limit=256)
    assert timing_only_reason(10, 290, 256, new_chat_key="Ctrl+L", recorded=continues) == (
        "it continues a timing-only turn, whose cached prefix holds no values, and its whole prompt (300 tokens) is "
        "over the numeric limit of 256 (Ctrl+L: a new conversation)")
    assert timing_only_reason(10, 290, 256, recorded=continues) == continues
