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

import asyncio
import time
from collections import deque
from typing import Any, Self

from rich.console import RenderableType
from rich.text import Text
from textual.events import Resize
from textual.geometry import Size
from textual.widgets import RichLog

#: a write longer than this is rendered in slices
SLICE_CHARS = 2048
#: UI time one rendering turn may take before yielding to other events (wall s)
TURN_BUDGET_S = 0.008
#: the pause between turns (wall s): long enough for a key to reach its widget through the app
YIELD_S = 0.002
#: widest terminal assumed when bounding what is kept for re-wrapping (cells)
MAX_WIDTH = 1000


class WrapLog(RichLog):
    """``RichLog`` (wrap on, markup off) for plain and styled text.

    ``write(text)`` appends ``text`` (``str`` or ``rich.text.Text``) as one entry.
    ``pending`` is True while some of it is still being rendered.
    """

    def __init__(self, *, max_lines: int, min_width: int = 20, **kw: Any) -> None:
        super().__init__(max_lines=max_lines, min_width=min_width, wrap=True, markup=False, **kw)
        self._entries: deque[str | Text] = deque()  # what was written (str or Text), newest last, for re-wrapping
        self._entries_chars = 0
        self._todo: deque[tuple[Text, bool]] = deque()  # (text, continued) still to render, in order
        self._wrap_width: int | None = None  # the width the lines on screen were wrapped at
        self._scheduled = False
        self._at_end = True  # scrolled to the end as of the last scroll (a resize does not change it)
        self._size_key: tuple[Size, Size, Size] | None = None  # (size, own virtual size, container) last laid out

    @property
    def pending(self) -> bool:
        return bool(self._todo)

    def write(self, content: RenderableType | object, width: int | None = None, expand: bool = False,
              shrink: bool = True, scroll_end: bool | None = None, animate: bool = False) -> Self:
        """Append ``content``; ``str`` and ``Text`` are rendered in slices (a ``Text`` must not be
        changed after it is written). Other renderables are written at once, as by ``RichLog``."""
        if not isinstance(content, (str, Text)):
            return super().write(content, width, expand, shrink, scroll_end, animate)
        # every O(length) operation on a Text costs ~13 ms per 200,000 characters: cut first, then build
        self._remember(content)
        if not self._size_known or self._wrap_width != self._width():
            self._rewrap()  # the width is new: re-wrap what is kept (this entry included)
            return self
        cut, _ = _tail_index(_plain(content), self._width(), self.max_lines)
        if cut:  # this entry alone fills the log: what is queued before it would be trimmed
            self._todo.clear()
        self._todo.append((_as_text(content, cut), False))
        self._schedule()
        return self

    def clear(self) -> Self:
        self._entries.clear()
        self._entries_chars = 0
        self._todo.clear()
        return super().clear()

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        self._at_end = new_value >= self.max_scroll_y

    def _size_updated(self, size: Size, virtual_size: Size, container_size: Size, layout: bool = True) -> bool:
        # ScrollView compares the compositor's virtual size (the widget's area) with its own (its lines): never
        # equal, so every layout pass of the screen (one per key typed in an Input, one per streamed piece)
        # refreshed this log's scrollbar, and that dirty strip widened the frame's repaint to every widget
        # between it and the other dirty regions. Skip the pass when nothing the scrollbar shows has changed.
        key = (size, self.virtual_size, container_size)
        if key == self._size_key:
            return False
        self._size_key = key
        return super()._size_updated(size, virtual_size, container_size, layout)

    def on_resize(self, event: Resize) -> None:
        if event.size.width:
            self._size_known = True  # RichLog's own handler would only replay deferred writes (none here)
            self.call_later(self._check_width)  # after layout, when the content region has its new width
        if self._at_end and self.auto_scroll:
            # a log that followed its end keeps following when it gets shorter (a box opened under
            # it): otherwise its newest lines, a turn just written, hide below the bottom edge
            self.call_after_refresh(self.scroll_end, animate=False, immediate=True)

    # --- internals ------------------------------------------------------------------

    def _width(self) -> int:
        return max(self.scrollable_content_region.width, self.min_width)

    def _check_width(self) -> None:
        if self._wrap_width != self._width():
            self._rewrap()

    def _remember(self, content: str | Text) -> None:
        limit = self.max_lines or 10_000
        cap = limit * MAX_WIDTH  # at any width, this many characters fill max_lines
        if len(content) > cap:
            content = content[len(content) - cap:]
        self._entries.append(content)
        self._entries_chars += len(content)
        # each entry is at least one line: the newest max_lines entries always fill the log
        while len(self._entries) > limit or self._entries_chars - len(self._entries[0]) >= cap:
            self._entries_chars -= len(self._entries.popleft())

    def _visible_tail(self, entries: list[str | Text]) -> list[Text]:
        """The newest entries (the oldest of them possibly cut at a word) whose lines fill ``max_lines``
        at the current width; what comes before would be trimmed anyway."""
        width, need = self._width(), self.max_lines
        out: list[Text] = []
        for content in reversed(entries):
            cut, rows = _tail_index(_plain(content), width, need)
            out.append(_as_text(content, cut))
            if need is not None:
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
        self._todo = deque((t, False) for t in self._visible_tail(list(self._entries)))
        self._schedule()

    def _schedule(self) -> None:
        if not self._scheduled and self._todo:
            self._scheduled = True
            # an async worker on the UI loop: between turns it really yields to the event loop (a
            # chain of call_later callbacks would not: the widget's message pump runs them back to back)
            self.run_worker(self._render_loop(), group="wraplog-render", exit_on_error=False)

    async def _render_loop(self) -> None:
        try:
            while self._todo and self.is_attached:
                self._render_some()
                await asyncio.sleep(YIELD_S)
        finally:
            self._scheduled = False

    def _render_some(self) -> None:
        """Render slices for at most TURN_BUDGET_S.

        ``_todo`` holds (text, continued): ``continued`` means the next item goes on the same
        line (a long text cut into slices once, with ``Text.divide``, not re-sliced per turn).
        """
        width = self._width()
        if self._wrap_width != width:
            self._rewrap()
            return
        t0 = time.perf_counter()
        console = self.app.console
        todo = self._todo
        while todo and time.perf_counter() - t0 < TURN_BUDGET_S:
            text, continued = todo.popleft()
            if not continued and len(text) > SLICE_CHARS:
                todo.extendleft(reversed(_slices(text)))
                continue
            # width given: RichLog would otherwise cap it at the app console's width
            if not continued:
                super().write(text, width=width)
                continue
            lines = text.wrap(console, width)
            if len(lines) > 1:
                super().write(Text("\n").join(lines[:-1]), width=width)
            # the last line may still grow with the next slice: carry it over
            nxt, nxt_continued = todo.popleft()
            todo.appendleft((lines[-1] + nxt if len(lines) else nxt, nxt_continued))


def _slices(text: Text) -> list[tuple[Text, bool]]:
    """``text`` cut before spaces into pieces of at most SLICE_CHARS; all but the last are ``continued``."""
    plain = text.plain
    cuts, pos = [], 0
    while len(plain) - pos > SLICE_CHARS:
        cut = plain.rfind(" ", pos + SLICE_CHARS // 2, pos + SLICE_CHARS)  # end a slice before a space
        pos = cut if cut > pos else pos + SLICE_CHARS
        cuts.append(pos)
    pieces = list(text.divide(cuts))
    return [(p, i < len(pieces) - 1) for i, p in enumerate(pieces)]


def _plain(content: str | Text) -> str:
    return content if isinstance(content, str) else content.plain


def _as_text(content: str | Text, cut: int) -> Text:
    if isinstance(content, str):
        return Text(content[cut:])
    return content[cut:] if cut else content


def _tail_index(plain: str, width: int, need: int | None) -> tuple[int, int]:
    """Where the tail of ``plain`` that wraps to at least ``need`` lines of ``width`` starts (at a
    word), and a lower bound of the lines from there: (0, lines) when the whole text is needed.

    A paragraph takes at least ceil(len / width) lines (one if empty), whatever its words.
    """
    if need is None:
        return 0, 0
    rows, end = 0, len(plain)
    while True:
        start = plain.rfind("\n", 0, end) + 1  # the paragraph [start, end)
        r = max(1, -(-(end - start) // width))
        if rows + r >= need:
            cut = max(start, end - (need - rows) * width)
            if cut > start:  # back to a word start: keeps a little more, never fewer lines
                space = plain.rfind(" ", start, cut)
                cut = space + 1 if space != -1 else start
            return cut, need
        rows += r
        if start == 0:
            return 0, rows
        end = start - 1
