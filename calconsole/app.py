"""The Textual app: panes arranged by a layout, fed by snapshots on a timer.

The app talks to the simulator only through the three planes. Snapshots
are taken on a worker thread; device work and generation never run on the
UI's event loop.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rich.text import Text
from textual import events
from textual.actions import SkipAction
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Input, Static
from textual.widgets._toast import ToastRack  # Textual's toast container (no public name); see _refresh_notifications

from sim_backend.planes.snapshot import Snapshot

from .feed import SnapshotFeed
from .gcpolicy import GCPolicy
from .layout import Layout
from .messages import SnapshotReady
from .panes.chat import ChatPane
from .panes.focus import HELP_BINDING, PANE_BINDINGS, focus_pane
from .panes.observation import ObservationPane
from .settings import COMPACT_BELOW, HISTORY_WINDOWS_S, PANE_MODES, Settings, save_settings
from .widgets import server as server_render
from .widgets.footer import FittedFooter
from .widgets.help import HelpScreen, help_renderable
from .widgets.render import mode_text, status_text

MIN_WIDTH, MIN_HEIGHT = 80, 24
#: the palette's words for each pane mode (settings.PANE_MODES)
PANE_MODE_TEXT = {"auto": "by terminal size (one at a time below the layout's breakpoint)",
                  "single": "one at a time, full size (F1 / F2 / F3)", "columns": "side by side, whatever the size"}


if TYPE_CHECKING:  # imported where used: an --observe-only console never loads the maintenance pane
    from textual.binding import BindingType
    from textual.geometry import Size

    from sim_backend.planes import InferencePlane, Lease, ObservationPlane

    from .panes.maintenance import MaintenancePane
    from .panes.maintenance_planes import PaneMaintenancePlane


class ConsoleSystem(Protocol):
    """What the app reads of the system it is handed: the in-process ``System``, a ``RemoteSystem`` or a
    ``LlamaServerSystem`` (``calconsole.commands.common.AnySystem``); ``maintenance`` is None without a
    maintenance plane (--observe-only, or no admin key)."""

    @property
    def inference(self) -> InferencePlane: ...

    @property
    def observation(self) -> ObservationPlane: ...

    @property
    def maintenance(self) -> PaneMaintenancePlane | None: ...


class LeaseLost(Message):
    """Remote planes: the maintenance lease this console held lapsed (``reason`` says why)."""

    def __init__(self, lease: Lease, reason: str) -> None:
        super().__init__()
        self.lease = lease
        self.reason = reason


class LinkState(Message):
    """Remote planes: the server stopped answering (``since``: host wall unix s) or answers again (None)."""

    def __init__(self, since: float | None) -> None:
        super().__init__()
        self.since = since


class CalConsoleApp(App[None]):
    """calconsole: observation, chat and maintenance panes over one simulated device."""

    CSS_PATH = "styles.tcss"
    TITLE = "calconsole"
    BINDINGS = [
        # first, so a narrow footer still names it. Not a priority binding: a priority binding decides before
        # the focused input has handled the keys typed before "?" (typed fast, "two plus two?" opened the help
        # and lost the message). The panes' inputs (HelpKeyInput) run it themselves when "?" meets an empty
        # value; any other widget lets "?" reach this binding.
        Binding("question_mark", "help", "help"),
        Binding("ctrl+q", "quit", "quit", priority=True),
        *PANE_BINDINGS,
    ]
    #: refresh rates the palette offers (Hz)
    REFRESH_CHOICES = (0.5, 1.0, 2.0, 4.0)
    #: themes the palette offers by name (Textual's own "Change theme" lists them all)
    THEMES = ("textual-dark", "textual-light", "nord", "gruvbox", "monokai", "solarized-light")

    def __init__(self, system: ConsoleSystem, layout: Layout, refresh_hz: float | None = None,
                 listen_url: str | None = None, settings: Settings | None = None,
                 start_notes: tuple[str, ...] = (), start_progress: StartProgress | None = None) -> None:
        super().__init__()
        #: the numerics' start-up lines (kernels compiling on a first start), shown as notifications
        self.start_progress = start_progress
        self.settings = settings or Settings()
        #: shown as notifications once mounted (e.g. simulator options --connect does not apply)
        self.start_notes = tuple(start_notes)
        self.system = system
        self.listen_url = listen_url  # --listen: where this device's HTTP API is served
        # remote planes (--connect): "attached to URL" in the header, and when the server stopped answering
        self.where = system.describe() if hasattr(system, "describe") else None
        self.disconnected_since: float | None = None
        # --observe-only: the system has no maintenance plane, so the pane is dropped too
        self.layout_spec = layout if system.maintenance is not None else layout.without("maintenance")
        self.refresh_hz = refresh_hz or self.settings.refresh_hz or layout.refresh_hz
        # the columns' widths and the panes' heights as CSS (App reads self.CSS once, at start): the single-pane
        # rules in styles.tcss are more specific and override them
        self.CSS = self.layout_spec.css()  # type: ignore[misc]  # App reads self.CSS, an instance's is its own
        #: "auto" (one pane at a time below the layout's single_pane_below), "single" or "columns" (PANE_MODES)
        self.pane_mode = self.settings.panes
        #: one pane at a time now; ``active_pane``: the one shown then (a PANES name)
        self.single = False
        self.active_pane: str | None = None
        #: the numerics kernels' compile stage shown in the header ("1/3") while they compile; None otherwise
        self.compiling: str | None = None
        self.last_snapshot: Snapshot | None = None
        # widget references: App.query_one searches the *active* screen, which is a modal at times
        self._topbar = Static(id="topbar")
        self._topbar_text = ""
        # the panes (ObservationPane, ChatPane, MaintenancePane), each given pane_name and base_title by compose:
        # attributes no Widget declares, so read as Any
        self._panes: list[Any] = []
        self.gc_policy = GCPolicy()
        self._last_input = self._steps_changed = time.monotonic()
        self._idle_steps: tuple[int | None, int, int] | None = None

    def compose(self) -> ComposeResult:
        yield self._topbar
        with Horizontal(id="columns"):
            for ci, col in enumerate(self.layout_spec.columns):
                with Vertical(classes="column", id=f"col{ci}"):
                    for p in col.panes:
                        pane: Any = self._make_pane(p.pane)
                        pane.pane_name = p.pane
                        pane.base_title = pane.border_title
                        self._panes.append(pane)
                        yield pane
        yield Static("terminal too small: need at least 80x24", id="too-small")
        yield FittedFooter()  # whole key entries only: at 80 columns the last one read "^s samplin"

    def _make_pane(self, name: str) -> Widget:
        w: Widget
        if name == "observation":
            w = ObservationPane(self.settings, id="observation", classes="pane")
            w.border_title = "Observation (read-only)"
        elif name == "chat":
            w = ChatPane(self.system.inference, id="chat", classes="pane")
            w.border_title = w.legend()
        else:
            from .panes.maintenance import MaintenancePane

            device = self.system.observation.snapshot().device
            # a server without a device (llama-server) names itself for the confirmations
            device_name = device.name if device is not None else str(getattr(self.system, "device_name", "?"))
            plane = self.system.maintenance
            assert plane is not None  # without a plane the layout has no maintenance pane (__init__)
            w = MaintenancePane(plane, device_name, id="maintenance", classes="pane")
            w.border_title = "Maintenance (guarded)"
        return w

    def on_mount(self) -> None:
        if self.settings.theme in self.available_themes:
            self.theme = self.settings.theme
        else:
            self.notify(f"settings: theme {self.settings.theme!r} is not known; using {self.theme}",
                        severity="warning")
        # The start-up objects (tokenizer ranks, weights, CSS, widgets) live as long as the console,
        # and so does much of what a reply leaves (transcript lines, caches): frozen at start and
        # after every full collection, a full collection walks only what is new (gcpolicy.py)
        self.gc_policy.start()
        for note in self.start_notes:  # on stderr too, but a full-screen console hides stderr until it exits
            self.notify(note, severity="warning", timeout=10)
        if self.start_progress is not None:
            last = self.start_progress.attach(self)
            if last is not None:
                self.show_start_progress(last)
        if self.screen_stack[0].query("#chat-input"):
            self.action_focus_pane("chat")
        # one long-lived sampler thread, the same for in-process and remote planes (feed.py)
        self.feed = SnapshotFeed(self.system, lambda: self.refresh_hz,
                                 lambda snap: self.post_message(SnapshotReady(snap)),
                                 lambda since: self.post_message(LinkState(since)))
        self.feed.start()
        watch_lease = getattr(self.system.maintenance, "on_lease_lost", None)  # remote planes only
        if watch_lease is not None:
            watch_lease(lambda lease, reason: self.post_message(LeaseLost(lease, reason)))
        self._check_size()

    def show_start_progress(self, line: str) -> None:
        """A numerics start-up line (UI thread): "compiling ..." lives in the header (``compiling``: the stage,
        e.g. "1/3", with "replies timing-only") until the kernels are ready, never in a toast over the help or a
        confirmation (it stayed up ~30 s); the "ready" line (or the failure) is a notification."""
        if line.startswith("compiling"):
            m = re.search(r"\b(\d+/\d+)\b", line)
            self.compiling = m.group(1) if m else "…"
            self._refit_topbar()
        elif line.startswith("numerics kernels ready") or line.startswith("numerics did not start"):
            self.compiling = None
            self._refit_topbar()
            self.notify(line, title="numerics", timeout=15,
                        severity="information" if "ready" in line else "error")
        else:  # another start stage (building the weights)
            self.notify(line, title="numerics", timeout=10)

    def _refresh_notifications(self) -> None:
        """Notifications never cover a modal screen (help, a confirmation, the palette): while one is up its
        toasts stay hidden; back on the console the ones not yet expired show (Textual calls this on every
        screen's resume and every notify)."""
        screen = self.screen_stack[-1] if self.screen_stack else None
        if screen is not None and screen is not self.screen_stack[0]:
            for rack in screen.query(ToastRack):
                rack.display = False
            return
        super()._refresh_notifications()

    def on_maintenance_pane_state_changed(self, message: MaintenancePane.StateChanged) -> None:
        feed = getattr(self, "feed", None)
        if feed is not None:
            feed.poke()  # the header and panes from a sample taken now, not at the next refresh

    def on_lease_lost(self, message: LeaseLost) -> None:
        self.notify(f"maintenance lease of {message.lease.holder} lost: {message.reason}", severity="error",
                    timeout=30)
        pane: Any
        for pane in self.screen_stack[0].query("#maintenance"):
            if getattr(pane, "lease", None) is not None and pane.lease.id == message.lease.id:
                pane.lease = None
                pane._log(f"lease lost: {message.reason}; the device is serving again", "bold red")
                pane._sync_buttons()

    def on_resize(self, event: events.Resize) -> None:
        self._check_size(event.size)
        if self.last_snapshot is not None:  # the header keeps what fits the new width
            self.call_after_refresh(self._refit_topbar)

    def _refit_topbar(self) -> None:
        if self.last_snapshot is not None:
            self._show_topbar(self.last_snapshot)

    def _check_size(self, size: Size | None = None) -> None:
        size = size or self.size  # in on_resize, self.size can still be the previous size
        base = self.screen_stack[0]
        small = size.width < MIN_WIDTH or size.height < MIN_HEIGHT
        base.query_one("#too-small").display = small
        columns = base.query_one("#columns")
        columns.display = not small
        columns.disabled = small  # hidden panes must not take keystrokes (focus keys included)
        if self.settings.compact == "auto":
            self._set_compact(size.width < COMPACT_BELOW[0] or size.height < COMPACT_BELOW[1])
        else:
            self._set_compact(self.settings.compact == "on")
        w, h = self.layout_spec.single_pane_below
        small_for_columns = size.width < w or size.height < h
        self._set_single(self.pane_mode == "single" or (self.pane_mode == "auto" and small_for_columns))

    def _set_single(self, on: bool) -> None:
        """One pane at a time (``on``) or the layout's columns: classes on the base screen and the shown pane
        and its column; styles.tcss draws them (``Screen.-single``). The pane shown: on leaving the columns the
        focused one, else the last shown; at start the chat (the first in the layout without one)."""
        if not self._panes:
            return
        names = [p.pane_name for p in self._panes]
        focused = self._focused_pane()
        if self.active_pane not in names:  # the first time: the chat (Textual's auto-focus picks the first pane)
            active = "chat" if "chat" in names else names[0]
        elif on and not self.single and focused is not None:  # from the columns: the pane one was working in
            active = getattr(focused, "pane_name", self.active_pane)
        else:
            active = self.active_pane
        changed = on != self.single
        self.single = on
        self._show_pane(active)
        self.screen_stack[0].set_class(on, "-single")
        if changed and self.last_snapshot is not None:
            self.call_after_refresh(self._refit_topbar)  # the status header's figures differ by mode

    def _show_pane(self, name: str | None) -> None:
        """Mark pane ``name`` (and its column) as the one shown in single-pane mode; the border titles say
        which keys show the others."""
        self.active_pane = name
        keys = {"observation": "F1 obs", "chat": "F2 chat", "maintenance": "F3 maint"}
        for column in self.screen_stack[0].query(".column"):
            column.set_class(any(getattr(p, "pane_name", None) == name for p in column.children), "-active")
        for pane in self._panes:
            pane.set_class(pane.pane_name == name, "-active")
            others = " · ".join(keys[p.pane_name] for p in self._panes if p is not pane)
            pane.border_title = f"{pane.base_title} · {others}" if self.single and others else pane.base_title

    def set_pane_mode(self, mode: str) -> None:
        """The palette's choice: "auto", "single" or "columns" (PANE_MODES); "save settings" keeps it."""
        self.pane_mode = mode
        self._check_size()
        focused = self._focused_pane()
        if focused is None and self.active_pane is not None:
            self.action_focus_pane(self.active_pane)
        self.notify(f"panes: {PANE_MODE_TEXT[mode]}", timeout=3)

    def _observation(self) -> ObservationPane | None:
        panes = self.screen_stack[0].query(ObservationPane)
        return panes.first() if panes else None

    def _set_compact(self, on: bool) -> None:
        obs = self._observation()
        if obs is not None:
            obs.set_compact(on)

    def on_link_state(self, message: LinkState) -> None:
        since = message.since
        if since == self.disconnected_since:
            return
        self.disconnected_since = since
        if self.last_snapshot is not None:
            self._show_topbar(self.last_snapshot)

    def on_unmount(self) -> None:
        feed = getattr(self, "feed", None)
        if feed is not None:
            feed.stop(timeout_s=0.0)  # a daemon: it ends within one period, the UI does not wait for it
        self.gc_policy.stop()  # collectable again once the console is gone (tests run many apps in one process)

    async def on_event(self, event: events.Event) -> None:
        if isinstance(event, events.InputEvent):
            self._last_input = time.monotonic()  # someone types: no deep collection now (gcpolicy)
        await super().on_event(event)

    #: no key or mouse event and no device step for this long (wall s): the console is idle
    IDLE_S = 2.0

    def _maybe_idle_gc(self, snap: Snapshot) -> None:
        jobs = snap.jobs
        if jobs is None:  # a server without device jobs (llama-server): its slots say whether it works
            busy = sum(1 for s in snap.slots if s.state != "idle")
            done = snap.server.n_decode_total if snap.server is not None else None
            steps: tuple[int | None, int, int] = (done, 0, busy)
        else:
            steps = (jobs.finished, jobs.failed, jobs.left)
        now = time.monotonic()
        if steps != self._idle_steps:
            self._idle_steps, self._steps_changed = steps, now
        elif (steps[2] == 0 and now - self._steps_changed >= self.IDLE_S
              and now - self._last_input >= self.IDLE_S):
            self.gc_policy.idle()

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        snap = message.snap
        self.last_snapshot = snap
        self._maybe_idle_gc(snap)
        self._show_topbar(snap)
        for pane in self._panes:
            try:
                pane.update_snapshot(snap)
            except NoMatches:
                pass  # pane still composing; the next refresh fills it

    def _show_topbar(self, snap: Snapshot) -> None:
        # not this simulator: the server's kind, build and model (widgets/server.py)
        if snap.server is not None or snap.device is None:
            server_parts = server_render.topbar_parts(snap, getattr(self.system, "url", None), self._status_in_header())
            self._topbar_bar(self._fit_topbar(server_parts, keep_first=2))
            return
        d = snap.device
        kv = "-" if snap.kv is None else f"{snap.kv.used_tokens}/{snap.kv.capacity_tokens}"
        # (text, style, keep): at a narrow width the parts with the lowest keep go first, so where the
        # console is attached, its mode and its status are never cut
        parts: list[tuple[Text | str, str, int]] = [
            (f"{d.name}", "", 9), (mode_text(d), "", 9), (status_text(d, compact=True), "", 9)]
        compiling = self.compiling is not None
        if compiling:  # first start: the kernels compile (the notice lives here, not in a toast, until ready)
            parts.append((f"kernels compiling {self.compiling}: replies timing-only", "bold yellow", 9))
        if self.where:
            parts.append((self.where, "bold cyan", 8))
        if self.listen_url:
            parts.append((f"HTTP API {self.listen_url}", "", 7))
        if d.numerics and d.numerics_starting and not compiling:  # starting (no stage reported yet)
            parts.append(("numerics starting: replies timing-only", "bold yellow", 8))
        if d.numerics and d.timing_only_running:  # (a timing-only device: the chat pane's banner says it)
            ids = ", ".join(str(i) for i in d.timing_only_running)
            parts.append((f"timing-only: request{'s' if len(d.timing_only_running) > 1 else ''} {ids}",
                          "bold yellow", 8))
        status = self._status_in_header()
        if status:  # the status header over one pane: board state, KV, queue and the running request
            parts += [(f"KV {kv}", "", 9), (f"queue {snap.requests.counters.queued}", "", 9),
                      (running_text(snap), "", 9)]
        parts += [(f"requests done {snap.requests.counters.finished}", "", 4),
                  (f"device steps {'-' if snap.jobs is None else snap.jobs.finished}", "", 2),
                  *([] if status else [(f"KV {kv}", "", 3)]),
                  (f"sim clock {(snap.sim_now_ms or 0.0) / 1e3:.2f} s", "", 1)]
        brief = status_text(d, compact=True, brief=True)
        self._topbar_bar(self._fit_topbar(parts, keep_first=3, brief=brief))

    def _status_in_header(self) -> bool:
        """KV, queue and the running request kept in the header: over one pane, or in columns without the
        observation pane (nowhere else would show them)."""
        return self.single or "observation" not in self.layout_spec.panes()

    def _fit_topbar(self, parts: list[tuple[Text | str, str, int]], keep_first: int,
                    brief: Text | str | None = None) -> Text:
        """The header from ``parts`` (text, style, keep) that fits the terminal's width: the lowest keep goes
        first (of equal keeps the rightmost), each part whole or not at all; the first ``keep_first`` always
        stay (the third, a device's status, shortened to ``brief`` when even they do not fit)."""
        parts = list(parts)
        width = self.size.width - 1 if self.size.width else 1000
        if self.disconnected_since is not None:
            width -= len("DISCONNECTED since 00:00:00 (retrying) · ")
        while True:
            bar = Text("calconsole ", style="bold")
            for i, (part, style, _) in enumerate(parts):
                if i:
                    bar.append(" · ")
                bar.append_text(part if isinstance(part, Text) else Text(part, style=style))
            if bar.cell_len <= width:
                return bar
            if len(parts) <= keep_first:
                if brief is None or parts[2][0] == brief:
                    return bar
                parts[2] = (brief, "", 9)  # the status without what is in effect or armed (the table has it)
                continue
            # the device's name, mode and status (a server's kind and health), first in the list, stay
            del parts[min(range(keep_first, len(parts)), key=lambda i: (parts[i][2], -i))]

    def _topbar_bar(self, bar: Text) -> None:
        if self.disconnected_since is not None:
            lost = time.strftime("%H:%M:%S", time.localtime(self.disconnected_since))
            bar.stylize("grey50")  # the last snapshot, greyed while it cannot be refreshed
            # first, so a narrow terminal still shows it
            bar = Text.assemble(("calconsole ", "bold"), (f"DISCONNECTED since {lost} (retrying) · ", "bold red"),
                                bar[len("calconsole "):])
        if bar.plain != self._topbar_text:  # an idle console redraws nothing
            self._topbar_text = bar.plain
            self._topbar.update(bar, layout=False)

    def action_focus_pane(self, name: str) -> None:
        """Focus a pane: its main input, or its first enabled focusable widget. One pane at a time: show it
        first (a hidden widget takes no focus), then focus it once it is laid out."""
        if self.single and any(p.pane_name == name for p in self._panes):
            if name != self.active_pane:
                self._show_pane(name)
                self.call_after_refresh(focus_pane, self.screen_stack[0], name)
                return
        focus_pane(self.screen_stack[0], name)

    # --- help, palette --------------------------------------------------------------------------

    def _focused_pane(self) -> Widget | None:
        focused = self.screen_stack[0].focused
        pane: Widget
        for pane in self._panes:
            if focused is not None and pane in focused.ancestors_with_self:
                return pane
        return None

    def action_focus_next(self) -> None:
        """Tab: the next focusable widget of the focused pane, wrapping around inside it (F1 / F2 / F3 move
        between panes). Tab from the chat input had jumped into the maintenance pane, onto "x Exclusive"."""
        if not self._focus_within_pane(1):
            super().action_focus_next()

    def action_focus_previous(self) -> None:
        """Shift+Tab: the previous focusable widget of the focused pane, wrapping around inside it."""
        if not self._focus_within_pane(-1):
            super().action_focus_previous()

    def _focus_within_pane(self, step: int) -> bool:
        """Move focus ``step`` places along the focused pane's own focus chain; False (Textual's own move) on a
        modal screen or with no pane focused."""
        screen = self.screen
        if screen is not self.screen_stack[0]:
            return False
        pane = self._focused_pane()
        if pane is None:
            return False
        chain = [w for w in screen.focus_chain if pane in w.ancestors_with_self]
        if not chain:
            return False
        current = screen.focused
        i = chain.index(current) if current in chain else (-1 if step > 0 else 0)
        chain[(i + step) % len(chain)].focus()
        return True

    def action_help(self) -> None:
        """``?``: the keys of the focused pane and the global ones, the figures, the thresholds.

        Steps aside (the key types ``?``) in an input that holds text, and on a modal screen (the help
        screen closes on ``?``; a confirmation takes it as text)."""
        if self.screen is not self.screen_stack[0]:
            raise SkipAction()
        focused = self.screen_stack[0].focused
        if isinstance(focused, Input) and focused.value:
            raise SkipAction()
        pane = self._focused_pane()

        def keys(bindings: Iterable[BindingType]) -> list[tuple[str, str]]:
            out: list[tuple[str, str]] = []
            for b in bindings:
                if not isinstance(b, Binding) or not b.description or b is HELP_BINDING:  # listed as global
                    continue
                # a footer-hidden key whose entry another key's entry names already ("pgup/pgdn scroll", then
                # "pgdn scroll" again): listed once
                if not b.show and any(d == b.description for _, d in out):
                    continue
                out.append((self.get_key_display(b), b.description))
            return out

        title = str(pane.border_title) if pane is not None else "no pane focused (F1 / F2 / F3 focus one)"
        extra = getattr(pane, "HELP_EXTRA", "") if pane is not None else ""
        global_keys = keys(self.BINDINGS) + [("ctrl+p", "command palette: every action, layouts, refresh, "
                                                         "history window, compact mode, theme, export snapshot")]
        bindings = getattr(pane, "help_bindings", lambda: pane.BINDINGS)() if pane is not None else []
        pane_keys = list(getattr(pane, "HELP_KEYS", ())) + keys(bindings) if pane is not None else []
        content = help_renderable(title, pane_keys, global_keys, self.settings, extra)
        self.push_screen(HelpScreen(content))

    def get_system_commands(self, screen: Screen[object]) -> Iterable[SystemCommand]:
        """The palette (Ctrl+P): Textual's commands, then the console's own."""
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help: keys, figures and thresholds", "the ? screen", self.action_help)
        yield SystemCommand("Export snapshot to a file", "write the current snapshot as JSON (wire form) "
                            "in the current directory", self.action_export_snapshot)
        yield SystemCommand("Save settings", f"write layout, theme, refresh, history window, compact mode and "
                            f"thresholds to {self.settings.path}", self.action_save_settings)
        obs = self._observation()
        if obs is not None:
            yield SystemCommand("Compact mode: toggle", "observation pane: device rows, header figures, one graph",
                                obs.action_toggle_compact)
            for w in HISTORY_WINDOWS_S:
                yield SystemCommand(f"History window: {w // 60} min", "the graphs' time span (host wall time)",
                                    lambda w=w: obs.set_window(w))
            if obs.reports_layers():  # not a llama-server's: it reports no per-layer steps
                yield SystemCommand("Per-layer view: cycle step / decode / prefill", "observation key t",
                                    obs.action_toggle_step)
                yield SystemCommand("Per-layer heatmap: chips / op categories", "observation key h",
                                    obs.action_toggle_heat)
            for name in obs.listed():
                state = "unfold" if name in obs.folded else "fold"
                yield SystemCommand(f"Section {name}: {state}", "observation key z on the selected section "
                                    "(saved in the settings file)", lambda name=name: obs.fold_section(name))
                yield SystemCommand(f"Section {name}: focus (shown alone)", "observation key f; f or Esc "
                                    "shows every section again", lambda name=name: obs.focus_section(name))
                yield SystemCommand(f"Section {name}: move up", "observation key {",
                                    lambda name=name: obs.move_section(name, -1))
                yield SystemCommand(f"Section {name}: move down", "observation key }",
                                    lambda name=name: obs.move_section(name, 1))
            yield SystemCommand("Sections: show every section (leave focus)", "observation key f or Esc",
                                lambda: obs.focus_section(None))
            yield SystemCommand("Sections: unfold all", "observation key Z", obs.action_unfold_all)
            yield SystemCommand("Sections: default arrangement", "every section in the default order, none "
                                "folded, no focus (saved in the settings file)", obs.reset_sections)
        for hz in self.REFRESH_CHOICES:
            yield SystemCommand(f"Refresh rate: {hz:g} Hz", f"snapshots per second (now {self.refresh_hz:g})",
                                lambda hz=hz: self.set_refresh(hz))
        w, h = self.layout_spec.single_pane_below
        for mode in PANE_MODES:
            yield SystemCommand(f"Panes: {PANE_MODE_TEXT[mode]}", f"now {PANE_MODE_TEXT[self.pane_mode]}; the "
                                f"layout's breakpoint is {w}x{h} (save settings to keep it)",
                                lambda mode=mode: self.set_pane_mode(mode))
        for name in ("operator", "chat"):
            yield SystemCommand(f"Layout: {name} (default at next start)", "saved in the settings file; the panes "
                                "keep their state now", lambda name=name: self.set_default_layout(name))
        for theme in self.THEMES:
            if theme in self.available_themes:
                yield SystemCommand(f"Theme: {theme}", "colours (save settings to keep it)",
                                    lambda theme=theme: setattr(self, "theme", theme))
        from .panes.maintenance import PALETTE, MaintenancePane

        panes = self.screen_stack[0].query(MaintenancePane)
        if panes:
            m = panes.first()
            for title, key, action in PALETTE:
                if not m.offers_action(action):  # a llama-server: only what it offers
                    continue
                yield SystemCommand(f"Maintenance: {title}", f"key {key} in the maintenance pane (F3)",
                                    lambda action=action: getattr(m, f"action_{action}")())

    def set_refresh(self, hz: float) -> None:
        self.refresh_hz = hz
        self.notify(f"refresh {hz:g} Hz", timeout=2)

    def set_default_layout(self, name: str) -> None:
        self.settings = self.settings.replace(layout=name)
        self.action_save_settings()

    def current_settings(self) -> Settings:
        """The settings as the console now runs (what 'save settings' writes)."""
        obs = self._observation()
        kw: dict[str, Any] = {"theme": self.theme, "refresh_hz": self.refresh_hz, "panes": self.pane_mode}
        if obs is not None:
            kw["history_window_s"] = int(obs.window_s)
            kw.update(section_order=obs.settings.section_order, sections_folded=obs.settings.sections_folded,
                      section_focus=obs.settings.section_focus)
            if self.settings.compact != "auto":
                kw["compact"] = "on" if obs.compact else "off"
        return self.settings.replace(**kw)

    def action_save_settings(self) -> None:
        self.settings = self.current_settings()
        try:
            path = save_settings(self.settings)
        except OSError as e:
            self.notify(f"settings not saved: {e}", severity="error")
            return
        self.notify(f"settings saved to {path}", timeout=4)

    def action_export_snapshot(self, directory: Path | None = None) -> Path | None:
        """Write the last snapshot (wire form) as JSON; returns the path (None if there is none yet)."""
        if self.last_snapshot is None:
            self.notify("no snapshot yet", severity="warning")
            return None
        path = (directory or Path.cwd()) / f"calconsole-snapshot-{time.strftime('%Y%m%d-%H%M%S')}.json"
        try:
            path.write_text(json.dumps(self.last_snapshot.to_dict(), indent=1), encoding="utf-8")
        except OSError as e:
            self.notify(f"snapshot not written: {e}", severity="error")
            return None
        self.notify(f"snapshot written to {path}", timeout=4)
        return path

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # hide focus keys for panes this layout (or --observe-only) does not have: the panes composed, not a
        # query of the DOM (asked for each key each time the bindings are looked at: ~1 ms a query at 160x48)
        if action == "focus_pane" and parameters:
            return any(p.pane_name == parameters[0] for p in self._panes)
        return True


def running_text(snap: Snapshot) -> str:
    """The requests running now, from the slots: ``run #12``, ``run #12 #13 +2`` (at most two ids), ``run -``."""
    ids = [s.request_id for s in snap.slots if s.request_id is not None and s.state != "idle"]
    if not ids:
        return "run -"
    shown = " ".join(f"#{i}" for i in ids[:2])
    return f"run {shown}" + (f" +{len(ids) - 2}" if len(ids) > 2 else "")


class StartProgress:
    """Start-up lines of the numerics (``build_system``'s ``numerics_progress``), from any thread: printed on
    stderr until the console runs, then shown by it (``CalConsoleApp.show_start_progress``). ``lines``: all
    of them so far."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self._app: CalConsoleApp | None = None
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        with self._lock:
            self.lines.append(line)
            app = self._app
        if app is None:
            print(f"calconsole: {line}", file=sys.stderr, flush=True)
            return
        try:
            app.call_from_thread(app.show_start_progress, line)
        except RuntimeError:
            pass  # the console is closing: nothing left to show it on

    def attach(self, app: CalConsoleApp) -> str | None:
        """From now on lines go to ``app``; returns the last line so far (None if none), for it to show."""
        with self._lock:
            self._app = app
            return self.lines[-1] if self.lines else None
