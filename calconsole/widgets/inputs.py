"""Inputs of the console's panes: "?" on an empty input opens the help, decided by the input itself."""

from __future__ import annotations

from textual import events
from textual.geometry import Size
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Input


class HelpKeyInput(Input):
    """An ``Input`` where "?" typed into an empty value runs the app's ``help`` action instead of being typed;
    with any text in it, "?" is typed as usual.

    The input decides when it handles the key, in the order the keys came: every key typed before the "?"
    has been inserted by then. (An app binding of priority decided on the value before the input had
    processed the keys before it, so "what is two plus two?" typed fast opened the help and lost the
    message.) ``check_consume_key`` says "?" is not consumed, so the footer keeps naming the app's help key
    while the input has focus.

    The cursor does not blink (shown steadily): a blinking cursor repaints the focused input's column twice
    a second, the largest part of an idle console's CPU (``calconsole bench keys`` prints the idle CPU).

    A key typed repaints the input only: ``Input`` sets its virtual size (the text's width, for its horizontal
    scroll) as a layout change, a reflow of the whole screen per key (every pane's widgets arranged again,
    ~5 ms of UI time at 120x36). The input's own size never depends on its text unless its width is auto,
    so the virtual size is set first without a layout (Input's watcher then finds it unchanged).
    """

    cursor_blink = reactive(False, init=False)

    def _watch_value(self, value: str) -> None:
        if not self.styles.auto_dimensions:
            self.set_reactive(Widget.virtual_size, Size(self.content_width, 1))
        super()._watch_value(value)

    def check_consume_key(self, key: str, character: str | None) -> bool:
        if character == "?":
            return False
        return super().check_consume_key(key, character)

    async def _on_key(self, event: events.Key) -> None:
        # runs before Input._on_key (Textual dispatches the handlers along the MRO); prevent_default stops it
        if event.character == "?" and not self.value:
            event.stop()
            event.prevent_default()
            await self.run_action("app.help")
