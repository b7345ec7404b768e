"""Helpers shared by the Pilot tests: bounded polling and reading logs as a person would."""

from __future__ import annotations

import re

from textual.widgets import RichLog


async def wait_for(pilot, cond, timeout_s: float = 20.0, step: float = 0.02) -> bool:
    """Poll ``cond`` between UI pauses, bounded by ``timeout_s`` (host wall s)."""
    waited = 0.0
    while waited < timeout_s:
        if cond():
            return True
        await pilot.pause(step)
        waited += step
    return cond()


async def click_button(pilot, sel: str, timeout_s: float = 5.0) -> None:
    """Click a Button as a person would: not while its press effect from the previous click lasts.

    Textual's Button ignores a click while it still shows the ``-active`` press effect
    (0.2 s after a press), so a second click on the same button that quickly is dropped:
    a test clicking it again as soon as the first result arrives is then timing-dependent.
    """
    button = pilot.app.screen.query_one(sel)
    assert await wait_for(pilot, lambda: not button.has_class("-active"), timeout_s), f"{sel} stays pressed"
    assert await pilot.click(sel), f"the click on {sel} landed on another widget"


def log_lines(app, sel: str) -> list[str]:
    """The log's visible lines (as wrapped on screen)."""
    return [line.text for line in app.screen_stack[0].query_one(sel, RichLog).lines]


def log_text(app, sel: str) -> str:
    """The log's text with wrapped lines re-joined (whitespace collapsed)."""
    return re.sub(r"\s+", " ", " ".join(log_lines(app, sel)))


def has(app, sel: str, text: str) -> bool:
    return text in log_text(app, sel)


def typed(snap):
    """A snapshot in its wire form (a dict a test edits) as the typed ``Snapshot`` the panes take."""
    from sim_backend.planes.snapshot import Snapshot

    return snap if isinstance(snap, Snapshot) else Snapshot.from_dict(snap)


def typed_step(step):
    """A step view in its wire form as the typed ``StepView``."""
    import msgspec

    from sim_backend.planes.snapshot import StepView

    return step if isinstance(step, StepView) else msgspec.convert(step, StepView)


async def confirm_ask(pilot, timeout_s: float = 20.0) -> None:
    """Confirm the yes / no question a maintenance action asks first (``AskModal``: every action but reset and
    clear memory, which ask for the typed device name) with ``y``, once it is on screen."""
    from calconsole.widgets.confirm import AskModal

    app = pilot.app
    assert await wait_for(pilot, lambda: isinstance(app.screen, AskModal), timeout_s), type(app.screen).__name__
    await pilot.press("y")
    assert await wait_for(pilot, lambda: not isinstance(app.screen, AskModal), timeout_s)


async def enter_exclusive(pilot, pane, timeout_s: float = 20.0) -> None:
    """Enter exclusive mode the way an operator does: the ``x Exclusive`` button, then ``y`` to its question;
    returns once ``pane`` (the maintenance pane) holds the lease."""
    await click_button(pilot, "#m-enter")
    await confirm_ask(pilot, timeout_s)
    assert await wait_for(pilot, lambda: pane.lease is not None, timeout_s)


def chat_text(app) -> str:
    """The chat transcript's text (``log_text``) followed by the full figures of every reply so far (what Ctrl+R
    shows for the last one; the transcript has one line of figures under each reply)."""
    pane = app.screen_stack[0].query_one("#chat")
    return log_text(app, "#chat-log") + " " + " ".join(pane.full_figures)
