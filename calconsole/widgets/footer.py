"""The console's footer: Textual's ``Footer``, with only the key entries that fit shown, each one whole.

Textual's footer cuts its row at the command palette's entry, in the middle of a word: at 80 columns the chat
pane's last key read ``^s samplin``. Here an entry that does not fit whole is hidden, with every entry after
it (the focused pane's keys come first, so the app's own go first); the ``?`` help screen lists them all.
"""

from __future__ import annotations

from textual.widgets import Footer
from textual.widgets._footer import FooterKey


class FittedFooter(Footer):
    """``Footer`` showing a leading run of whole key entries: those that fit beside the palette's entry."""

    #: layout passes to wait for new entries to get their widths before giving up (a later resize fits again)
    FIT_TRIES = 20

    async def recompose(self) -> None:
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
