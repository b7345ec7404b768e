"""The Textual app: panes arranged by a layout, fed by snapshots on a timer.

The app talks to the simulator only through the three planes. Snapshots
are taken on a worker thread; device work and generation never run on the
UI's event loop.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Footer, Static

from .layout import Layout
from .messages import SnapshotReady
from .panes.chat import ChatPane
from .panes.observation import ObservationPane
from .widgets.render import mode_text, status_text

MIN_WIDTH, MIN_HEIGHT = 80, 24


class LeaseLost(Message):
    """Remote planes: the maintenance lease this console held lapsed (``reason`` says why)."""

    def __init__(self, lease, reason: str) -> None:
        super().__init__()
        self.lease = lease
        self.reason = reason


class LinkState(Message):
    """Remote planes: the server stopped answering (``since``: host wall unix s) or answers again (None)."""

    def __init__(self, since: float | None) -> None:
        super().__init__()
        self.since = since
log = logging.getLogger(__name__)


class CalConsoleApp(App):
    """calconsole: observation, chat and maintenance panes over one simulated device."""

    CSS_PATH = "styles.tcss"
    TITLE = "calconsole"
    BINDINGS = [
        Binding("ctrl+q", "quit", "quit", priority=True),
        Binding("f1", "focus_pane('observation')", "observation"),
        Binding("f2", "focus_pane('chat')", "chat"),
        Binding("f3", "focus_pane('maintenance')", "maintenance"),
    ]

    def __init__(self, system, layout: Layout, refresh_hz: float | None = None,
                 listen_url: str | None = None) -> None:
        super().__init__()
        self.system = system
        self.listen_url = listen_url  # --listen: where this device's HTTP API is served
        # remote planes (--connect): "attached to URL" in the header, and when the server stopped answering
        self.where = system.describe() if hasattr(system, "describe") else None
        self.disconnected_since: float | None = None
        # --observe-only: the system has no maintenance plane, so the pane is dropped too
        self.layout_spec = layout if system.maintenance is not None else layout.without("maintenance")
        self.refresh_hz = refresh_hz or layout.refresh_hz
        self.last_snapshot: dict | None = None
        # widget references: App.query_one searches the *active* screen, which is a modal at times
        self._topbar = Static(id="topbar")
        self._topbar_text = ""
        self._panes: list = []

    def compose(self) -> ComposeResult:
        yield self._topbar
        with Horizontal(id="columns"):
            for ci, col in enumerate(self.layout_spec.columns):
                with Vertical(classes="column", id=f"col{ci}") as v:
                    v.styles.width = col.width
                    for p in col.panes:
                        pane = self._make_pane(p.pane)
                        pane.styles.height = p.height
                        self._panes.append(pane)
                        yield pane
        yield Static("terminal too small: need at least 80x24", id="too-small")
        yield Footer()

    def _make_pane(self, name: str) -> Widget:
        w: Widget
        if name == "observation":
            w = ObservationPane(id="observation", classes="pane")
            w.border_title = "Observation (read-only)"
        elif name == "chat":
            w = ChatPane(self.system.inference, id="chat", classes="pane")
            w.border_title = "Chat"
        else:
            from .panes.maintenance import MaintenancePane

            device_name = self.system.observation.snapshot().device.name
            w = MaintenancePane(self.system.maintenance, device_name, id="maintenance", classes="pane")
            w.border_title = "Maintenance (guarded)"
        return w

    def on_mount(self) -> None:
        # The start-up objects (tokenizer ranks, weights, CSS, widgets) live as long as the console:
        # frozen, a full garbage collection no longer walks them, which took 60-80 ms of the UI
        # thread every few seconds while a long reply streamed. Collected first, so no garbage is kept.
        gc.collect()
        gc.freeze()
        if self.screen_stack[0].query("#chat-input"):
            self.action_focus_pane("chat")
        # one long-lived sampler thread (nvitop-style): cheaper than a Textual worker per refresh
        self._sampler_stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample_loop, name="calconsole-snapshots", daemon=True)
        self._sampler.start()
        watch_lease = getattr(self.system.maintenance, "on_lease_lost", None)  # remote planes only
        if watch_lease is not None:
            watch_lease(lambda lease, reason: self.post_message(LeaseLost(lease, reason)))
        self._check_size()

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

    def _check_size(self, size=None) -> None:
        size = size or self.size  # in on_resize, self.size can still be the previous size
        base = self.screen_stack[0]
        small = size.width < MIN_WIDTH or size.height < MIN_HEIGHT
        base.query_one("#too-small").display = small
        columns = base.query_one("#columns")
        columns.display = not small
        columns.disabled = small  # hidden panes must not take keystrokes (focus keys included)

    def _sample_loop(self) -> None:
        """Take a snapshot every 1/refresh_hz s off the UI thread and post it (bounded waits only)."""
        period = 1.0 / self.refresh_hz
        conn = getattr(self.system, "connection", None)  # remote planes only
        while not self._sampler_stop.is_set():
            try:
                snap = self.system.observation.snapshot().to_dict()
            except Exception:  # noqa: BLE001 - a failed sample is skipped, the next one retries
                if conn is not None and not conn.connected:
                    # the planes retry with back-off; the header says since when, the panes keep the last snapshot
                    self.post_message(LinkState(conn.disconnected_since))
                else:
                    log.exception("snapshot failed")
            else:
                if self.disconnected_since is not None:
                    self.post_message(LinkState(None))
                self.post_message(SnapshotReady(snap))
            self._sampler_stop.wait(period)

    def on_link_state(self, message: LinkState) -> None:
        since = message.since
        if since == self.disconnected_since:
            return
        self.disconnected_since = since
        if self.last_snapshot is not None:
            self._show_topbar(self.last_snapshot)

    def on_unmount(self) -> None:
        self._sampler_stop.set()
        gc.unfreeze()  # collectable again once the console is gone (tests run many apps in one process)

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        snap = message.snap
        self.last_snapshot = snap
        self._show_topbar(snap)
        for pane in self._panes:
            try:
                pane.update_snapshot(snap)
            except NoMatches:
                pass  # pane still composing; the next refresh fills it

    def _show_topbar(self, snap: dict) -> None:
        d = snap["device"]
        req = snap["requests"]["counters"]
        bar = Text.assemble(("calconsole ", "bold"), f"{d['name']} · ", mode_text(d), " · ",
                            status_text(d, compact=True),
                            f" · requests done {req['finished']} · device steps {snap['jobs']['finished']} · "
                            f"KV {snap['kv']['used_tokens']}/{snap['kv']['capacity_tokens']} · "
                            f"sim clock {snap['sim_now_ms'] / 1e3:.2f} s")
        if self.listen_url:
            bar.append(f" · HTTP API {self.listen_url}")
        if self.where:
            bar.append(f" · {self.where}", "bold cyan")
        if self.disconnected_since is not None:
            lost = time.strftime("%H:%M:%S", time.localtime(self.disconnected_since))
            bar.stylize("grey50")  # the last snapshot, greyed while it cannot be refreshed
            # first, so a narrow terminal still shows it
            bar = Text.assemble(("calconsole ", "bold"), (f"DISCONNECTED since {lost} (retrying) · ", "bold red"),
                                bar[len("calconsole "):])
        if bar.plain != self._topbar_text:  # an idle console redraws nothing
            self._topbar_text = bar.plain
            self._topbar.update(bar, layout=False)


    # the widget each pane's focus key lands on
    FOCUS_TARGET = {"observation": "#observation", "chat": "#chat-input", "maintenance": "#maintenance"}

    def action_focus_pane(self, name: str) -> None:
        """Focus a pane: its main input, or its first enabled focusable widget."""
        targets = self.screen_stack[0].query(self.FOCUS_TARGET[name])
        if not targets:
            return
        target = targets.first()
        if not target.focusable:
            inner = [w for w in target.query("*") if w.focusable]  # skips disabled buttons
            target = inner[0] if inner else target
        target.focus()

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        # hide focus keys for panes this layout (or --observe-only) does not have
        if action == "focus_pane" and parameters:
            return bool(self.screen_stack[0].query(self.FOCUS_TARGET[parameters[0]]))
        return True
