"""The sampling panel by keys alone: Ctrl+S opens it on its first field, Tab walks every field in the grid's
order down to ``stop`` (then the reset button), and a stop word typed there goes with the next message."""

from __future__ import annotations

import pytest

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.panes.chat import PARAMS
from tests.console.pilot_helpers import wait_for


@pytest.fixture
def fast_system(make_system):
    return make_system(numerics=False, drain_timeout_s=0.5)


@pytest.mark.parametrize("layout", ["chat", "operator"])
async def test_tab_reaches_the_stop_field_and_its_word_is_sent(fast_system, layout, monkeypatch):
    app = CalConsoleApp(fast_system, load_layout(layout))
    async with app.run_test(size=(120, 40)) as pilot:
        inp = app.query_one("#chat-input")
        assert await wait_for(pilot, lambda: app.focused is inp)
        await pilot.press("ctrl+s")
        order = [pid for pid, *_ in PARAMS]
        assert order[-1] == "p-stop"
        assert await wait_for(pilot, lambda: getattr(app.focused, "id", None) == order[0])
        seen = [order[0]]
        for want in order[1:] + ["p-reset"]:
            await pilot.press("tab")
            assert await wait_for(pilot, lambda w=want: getattr(app.focused, "id", None) == w), (seen, app.focused)
            seen.append(want)
        await pilot.press("shift+tab")  # back from the reset button to the stop field
        assert await wait_for(pilot, lambda: getattr(app.focused, "id", None) == "p-stop")
        await pilot.press(*"END")
        await pilot.press("ctrl+s")  # closes the panel, back to the message
        assert await wait_for(pilot, lambda: app.focused is inp and app.query_one("#chat-params").collapsed)
        chat = app.query_one("#chat")
        assert chat.read_params()[2] == ("END",)
        sent = []
        submit = chat.inference.submit
        monkeypatch.setattr(chat.inference, "submit", lambda req: (sent.append(req), submit(req))[1])
        app.query_one("#p-max-tokens").value = "3"
        await pilot.press(*"hello", "enter")
        assert await wait_for(pilot, lambda: chat.history)
        assert [r.stop for r in sent] == [("END",)]
