"""The console's footer: Textual's ``Footer``, with only the key entries that fit shown, each one whole.

Textual's footer cuts its row at the command palette's entry, in the middle of a word: at 80 columns the chat
pane's last key read ``^s samplin``. Here an entry that does not fit whole is hidden, with every entry after
it (the focused pane's keys come first, so the app's own go first); the ``?`` help screen lists them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.widgets import Footer
from textual.widgets._footer import FooterKey

if TYPE_CHECKING:
    from textual.screen import Screen


class FittedFooter(Footer):
    """``Footer`` showing a leading run of whole key entries: those that fit beside the palette's entry."""

    # what does not fit is hidden, so nothing is there to scroll to: no scrollbar shown and hidden again (each
    # time a layout pass) between a composition and the fit that follows it
    DEFAULT_CSS = """
    FittedFooter {
        overflow-x: hidden;
    }
    """

    #: layout passes to wait for new entries to get their widths before giving up (a later resize fits again)
    FIT_TRIES = 20

    #: what the entries were last composed from (see ``_entries``): a change of bindings that leaves them all
    #: the same (focus moving between two inputs, a pane re-checking its actions) composes nothing
    _composed: tuple[object, ...] | None = None

    def _entries(self, screen: Screen[object]) -> tuple[object, ...]:
        """What ``compose`` draws from ``screen``'s active bindings: key, shown label, action, enabled, tooltip,
        group (in order), and whether the palette's entry is shown."""
        return (self.show_command_palette, self.compact, tuple(
            (b.key, b.key_display, b.description, b.action, b.show, enabled, tooltip, id(b.group))
            for (_node, b, enabled, tooltip) in screen.active_bindings.values()))

    def bindings_changed(self, screen: Screen[object]) -> None:
        """Textual's footer composes its entries again on every change of bindings, each time a layout pass
        of the whole screen; here only when an entry would differ."""
        if self._bindings_ready and self.is_attached and screen is self.screen and screen.app.app_focus:
            if self._entries(screen) == self._composed:
                return
        super().bindings_changed(screen)

    async def recompose(self) -> None:
        if self.is_attached:
            self._composed = self._entries(self.screen)
        await super().recompose()
        self.call_after_refresh(self._fit)  # the new entries have their widths after layout

    def on_resize(self) -> None:
        self.call_after_refresh(self._fit)

    def _fit(self, tries: int = FIT_TRIES) -> None:
        keys = [w for w in self.children if isinstance(w, FooterKey) and not w.has_class("-command-palette")]
        palette = [w for w in self.children if w.has_class("-command-palette")]
        room = self.size.width - sum(w.outer_size.width for w in palette)
        if not keys or self.size.width <= 0:
            return
        if any(w.outer_size.width == 0 and w.display for w in keys + palette):
            if tries > 0:  # not laid out yet: look again after the next refresh
                self.call_after_refresh(self._fit, tries - 1)
            return
        used, fits = 0, True
        for w in keys:
            width = w.outer_size.width or len(w.key_display) + len(w.description) + 3  # a hidden one: as drawn
            fits = fits and used + width <= room
            if fits:
                used += width
            if w.display != fits:
                w.display = fits
