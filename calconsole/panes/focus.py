"""The pane focus keys, shared by the console (``CalConsoleApp``) and a fleet board (``BoardScreen``)."""

from __future__ import annotations

from textual.binding import Binding
from textual.dom import DOMNode

#: the widget each pane's focus key lands on (the chat pane: its input)
FOCUS_TARGET = {"observation": "#observation", "chat": "#chat-input", "maintenance": "#maintenance"}

#: F1 / F2 / F3 focus the observation, chat and maintenance panes
PANE_BINDINGS = [
    Binding("f1", "focus_pane('observation')", "observation"),
    Binding("f2", "focus_pane('chat')", "chat"),
    Binding("f3", "focus_pane('maintenance')", "maintenance"),
]


#: first in each pane's bindings: the footer lists the focused pane's keys before the app's, so at 80 columns the
#: app's "? help" fell off the end once the chat pane had a fourth key; a pane's own entry keeps it in view
#: (the app's binding stays for a focus outside the panes). Not a priority binding (see CalConsoleApp.BINDINGS).
HELP_BINDING = Binding("question_mark", "app.help", "help")


def focus_pane(root: DOMNode, name: str) -> None:
    """Focus pane ``name`` (a ``FOCUS_TARGET`` key) under ``root``: its main input, or its first enabled
    focusable widget (a disabled button is skipped); nothing when the layout has no such pane.
    Raises KeyError for an unknown name."""
    targets = root.query(FOCUS_TARGET[name])
    if not targets:
        return
    target = targets.first()
    if not target.focusable:
        inner = [w for w in target.query("*") if w.focusable]
        target = inner[0] if inner else target
    target.focus()
