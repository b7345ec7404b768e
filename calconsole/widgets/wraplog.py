"""A RichLog that re-wraps its text when its width changes and renders long text in slices.

Textual's ``RichLog`` wraps each write once, at the width it has then, and
renders a write in one call on the UI thread: a 200,000-character reply
blocks keys for a third of a second, and the lines keep their old wrapping
when the pane is resized. ``WrapLog`` keeps what was written (bounded) and

- renders text in slices of about ``SLICE_CHARS`` characters, a few
  milliseconds of UI time each, so keys and refreshes run in between;
  the wrapping is the same as one write would give (a slice ends before a
  space and its last, still open line is carried into the next slice);
- skips the part of a write that would be trimmed anyway by ``max_lines``
  (a line holds at most ``width`` characters, so the tail is enough);
- re-wraps everything it keeps when its width changes.

Rich renderables other than text are written at once, as ``RichLog`` does.
"""

from __future__ import annotations

import time
from collections import deque

from rich.text import Text
from textual.events import Resize
from textual.widgets import RichLog

#: a write longer than this is rendered in slices
SLICE_CHARS = 4096
#: UI time one rendering turn may take before yielding to other events (wall s)
TURN_BUDGET_S = 0.010
#: widest terminal assumed when bounding what is kept for re-wrapping (cells)
MAX_WIDTH = 1000


class WrapLog(RichLog):
    """``RichLog`` (wrap on, markup off) for plain and styled text.

    ``write(text)`` appends ``text`` (``str`` or ``rich.text.Text``) as one entry.
    ``pending`` is True while some of it is still being rendered.
    """

    def __init__(self, *, max_lines: int, min_width: int = 20, **kw) -> None:
        super().__init__(max_lines=max_lines, min_width=min_width, wrap=True, markup=False, **kw)
        self._entries: deque[Text] = deque()  # what was written, newest last (for re-wrapping)
        self._entries_chars = 0
        self._todo: deque[Text] = deque()  # text still to render, in order
        self._wrap_width: int | None = None  # the width the lines on screen were wrapped at
        self._scheduled = False

    @property
    def pending(self) -> bool:
        return bool(self._todo)

    def write(self, content, width=None, expand=False, shrink=True, scroll_end=None, animate=False):
        if not isinstance(content, (str, Text)):
            return super().write(content, width, expand, shrink, scroll_end, animate)
        text = Text(content) if isinstance(content, str) else content.copy()
        text.expand_tabs()
        self._remember(text)
        if not self._size_known or self._wrap_width != self._width():
            self._rewrap()  # the width is new: re-wrap what is kept (this entry included)
            return self
        tail = self._visible_tail([text])[0]
        if len(tail) < len(text):  # this entry alone fills the log: what is queued before it would be trimmed
            self._todo.clear()
        self._todo.append(tail)
        self._schedule()
        return self

    def clear(self):
        self._entries.clear()
        self._entries_chars = 0
        self._todo.clear()
        return super().clear()

    def on_resize(self, event: Resize) -> None:
        if event.size.width:
            self._size_known = True  # RichLog's own handler would only replay deferred writes (none here)
            self.call_later(self._check_width)  # after layout, when the content region has its new width

    # --- internals ------------------------------------------------------------------

    def _width(self) -> int:
        return max(self.scrollable_content_region.width, self.min_width)

    def _check_width(self) -> None:
        if self._wrap_width != self._width():
            self._rewrap()

    def _remember(self, text: Text) -> None:
        limit = self.max_lines or 10_000
        cap = limit * MAX_WIDTH  # at any width, this many characters fill max_lines
        if len(text) > cap:
            text = text[len(text) - cap:]
        self._entries.append(text)
        self._entries_chars += len(text)
        # each entry is at least one line: the newest max_lines entries always fill the log
        while len(self._entries) > limit or self._entries_chars - len(self._entries[0]) >= cap:
            self._entries_chars -= len(self._entries.popleft())

    def _visible_tail(self, entries: list[Text]) -> list[Text]:
        """The newest entries (the oldest of them possibly cut at a word) whose lines fill ``max_lines``
        at the current width; what comes before would be trimmed anyway."""
        if self.max_lines is None:
            return list(entries)
        width, need = self._width(), self.max_lines
        out: list[Text] = []
        for text in reversed(entries):
            tail, rows = _tail_rows(text, width, need)
            out.append(tail)
            need -= rows
            if need <= 0:
                break
        return out[::-1]

    def _rewrap(self) -> None:
        super().clear()
        if not self._size_known:
            self._todo.clear()
            return
        self._wrap_width = self._width()
        self._todo = deque(self._visible_tail(list(self._entries)))
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._todo:
            self._scheduled = True
            self.call_later(self._render_some)

    def _render_some(self) -> None:
        """Render slices for at most TURN_BUDGET_S, then yield to the event loop."""
        self._scheduled = False
        width = self._width()
        if self._wrap_width != width:
            self._rewrap()
            return
        t0 = time.perf_counter()
        console = self.app.console
        while self._todo and time.perf_counter() - t0 < TURN_BUDGET_S:
            text = self._todo.popleft()
            if len(text) <= SLICE_CHARS:
                super().write(text)
                continue
            cut = text.plain.rfind(" ", SLICE_CHARS // 2, SLICE_CHARS)  # end the slice before a space
            cut = cut if cut > 0 else SLICE_CHARS
            lines = text[:cut].wrap(console, width)
            if len(lines) > 1:
                super().write(Text("\n").join(lines[:-1]))
            # the last line may still grow with the next slice: carry it over
            self._todo.appendleft(lines[-1] + text[cut:] if len(lines) else text[cut:])
        self._schedule()


def _tail_rows(text: Text, width: int, need: int) -> tuple[Text, int]:
    """``text``, or its tail from a word start, wrapping to at least ``need`` lines of ``width``.

    Returns (tail, a lower bound of its lines). A paragraph takes at least ceil(len / width)
    lines (one if empty), whatever its words.
    """
    plain = text.plain
    rows, end = 0, len(plain)
    while True:
        start = plain.rfind("\n", 0, end) + 1  # the paragraph [start, end)
        r = max(1, -(-(end - start) // width))
        if rows + r >= need:
            cut = max(start, end - (need - rows) * width)
            if cut > start:  # back to a word start: keeps a little more, never fewer lines
                space = plain.rfind(" ", start, cut)
                cut = space + 1 if space != -1 else start
            return (text[cut:] if cut else text), need
        rows += r
        if start == 0:
            return text, rows
        end = start - 1
