"""Confirmation modals for maintenance actions: ``ConfirmModal`` (type the device name: reset, memory clear)
and ``AskModal`` (yes / no: every other maintenance action, from entering exclusive mode to a register read).

The name field has focus, so typing goes straight into it; the default
action is Cancel: Enter confirms only when the field holds the device name
exactly, otherwise Enter cancels (as does Escape or the Cancel button). The
destructive button stays disabled until the name matches. The result
reaches the caller through the ``push_screen`` callback.
"""

from __future__ import annotations

from rich.markup import escape
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label


class ConfirmModal(ModalScreen[bool | None]):
    """Returns True only if the operator typed ``device_name`` and confirmed; False when cancelled,
    None when Enter was pressed on a name that does not match (also a cancel)."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, action: str, detail: str, device_name: str) -> None:
        super().__init__()
        if not device_name:
            raise ValueError("a confirmation needs a non-empty device name to type")
        self.action_name = action
        self.detail = detail
        self.device_name = device_name

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Label(f"[b]{self.action_name}[/b]", id="confirm-title")
            yield Label(self.detail, id="confirm-detail")
            yield Label(f"Type the device name [b]{self.device_name}[/b] to confirm:")
            name = Input(placeholder="device name", id="confirm-name")
            name.cursor_blink = False  # steady, as the panes' inputs (widgets/inputs.py): no repaint twice a second
            yield name
            with Horizontal(id="confirm-buttons"):
                yield Button("Cancel", id="confirm-cancel", variant="primary")
                yield Button(self.action_name, id="confirm-ok", variant="error", disabled=True)

    def on_mount(self) -> None:
        self.query_one("#confirm-name", Input).focus()

    @on(Input.Changed, "#confirm-name")
    def _typed(self, event: Input.Changed) -> None:
        self.query_one("#confirm-ok", Button).disabled = event.value != self.device_name

    @on(Input.Submitted, "#confirm-name")
    def _submitted(self, event: Input.Submitted) -> None:
        # Enter is "confirm" only with the exact name; anything else takes the default, Cancel
        # (None: cancelled because a name was typed that does not match, so the caller can say so)
        if event.value == self.device_name:
            self.dismiss(True)
        else:
            self.dismiss(None if event.value else False)

    @on(Button.Pressed, "#confirm-ok")
    def _ok(self) -> None:
        if self.query_one("#confirm-name", Input).value == self.device_name:
            self.dismiss(True)

    @on(Button.Pressed, "#confirm-cancel")
    def _cancel_pressed(self) -> None:
        self.dismiss(False)

    def action_cancel(self) -> None:
        self.dismiss(False)


class AskModal(ModalScreen[bool]):
    """A yes / no confirmation for a maintenance action that needs no typed name (every one but reset and
    clear memory): ``detail`` says what the action does; Cancel is focused, so Enter (and Escape,
    ``n``, the Cancel button) cancels; ``y`` or the action's button confirms. Returns True only when confirmed.

    A Tab that lands on a maintenance button followed by Enter (the keys of a user moving through the
    fields) therefore opens this modal and, with a second Enter, cancels: nothing runs unconfirmed.
    """

    BINDINGS = [Binding("escape,n", "cancel", "cancel"), Binding("y", "confirm", "confirm")]

    def __init__(self, action: str, detail: str, question: str | None = None) -> None:
        """``action``: the confirm button's label (after ``y``); ``question``: the title, a question naming the
        action (default ``"<action>?"``); ``detail``: what it does to the device."""
        super().__init__()
        self.action_name = action
        self.detail = detail
        self.question = question or f"{action}?"

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Label(f"[b]{escape(self.question)}[/b]", id="confirm-title")
            yield Label(escape(self.detail), id="confirm-detail")
            yield Label("y confirms · Enter (on Cancel), n or Esc cancels", id="ask-keys", classes="dim")
            with Horizontal(id="confirm-buttons"):
                yield Button("Cancel", id="ask-cancel", variant="primary")
                yield Button(Text(f"y {self.action_name}"), id="ask-ok", variant="warning")

    def on_mount(self) -> None:
        self.query_one("#ask-cancel", Button).focus()

    @on(Button.Pressed, "#ask-ok")
    def _ok(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#ask-cancel")
    def _cancel_pressed(self) -> None:
        self.dismiss(False)

    def action_confirm(self) -> None:
        self.dismiss(True)

    def action_cancel(self) -> None:
        self.dismiss(False)
