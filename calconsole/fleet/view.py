"""The fleet view: one row per board, worst first; Enter opens that board's console, Esc returns.

The rows come from ``FleetMonitor`` (one poll task per board on this app's event loop, each with its own
back-off: a slow or dead board never delays another row). The table is redrawn at most once per refresh
and only when a sample changed. Every figure says its clock: a calconsole board's latencies and output
rate are simulated device time (``sim``), a llama-server's rate is derived from its counters over wall
time (``wall``); what a server does not report reads ``n/r``, never 0.

``BoardScreen`` is the single-board console (observation, chat and, with the board's admin key,
maintenance) over that board's remote planes, pushed over the fleet; ``Esc`` (or ``F10``, which works from
the chat input too) pops it and closes its connection, releasing a lease it still holds.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widget import Widget
from textual.widgets import Footer, Static

from sim_backend.planes.snapshot import Snapshot

from ..feed import SnapshotFeed
from ..layout import Layout, load_layout
from ..messages import SnapshotReady
from ..panes.focus import PANE_BINDINGS, focus_pane
from ..settings import LEVEL_STYLE, Settings
from .config import BoardSpec, FleetConfig
from .poller import FleetMonitor, read_key
from .sample import BoardSample, rank

SPARK = "▁▂▃▄▅▆▇█"
NR = "n/r"  # not reported by this board's server


def sparkline(values: list[float | None], width: int = 12) -> str:
    """The last ``width`` values as block characters scaled to their own maximum (blank where None)."""
    vals = values[-width:]
    top = max((v for v in vals if v is not None), default=0.0)
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
        elif top <= 0:
            out.append(SPARK[0])
        else:
            out.append(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))])
    return "".join(out).rjust(width)


def ago(t: float | None, now: float) -> str:
    """``now``, ``12 s``, ``3 min``, ``2 h`` since host wall time ``t``; ``never`` for None."""
    if t is None:
        return "never"
    d = max(0.0, now - t)
    if d < 2:
        return "now"
    if d < 120:
        return f"{d:.0f} s"
    if d < 7200:
        return f"{d / 60:.0f} min"
    return f"{d / 3600:.0f} h"


#: (key, header, min width, priority): columns drop in rising priority order when the terminal is narrow
COLUMNS: tuple[tuple[str, str, int, int], ...] = (
    ("board", "board", 10, 99),
    ("health", "health", 8, 98),
    ("mode", "mode · lease", 12, 90),
    ("kv", "KV %", 5, 95),
    ("queue", "queue", 5, 94),
    ("running", "run", 5, 93),
    ("rate", "out tok/s", 11, 92),
    ("ttft", "TTFT P95", 12, 85),
    ("tpot", "TPOT P95", 11, 80),
    ("faults", "faults", 10, 70),
    ("seen", "seen", 6, 88),
    ("kind", "kind", 12, 40),
    ("gap", "every s", 7, 32),
    ("poll", "poll rtt ms", 11, 30),
    ("history", "tok/s history", 14, 20),
)


def columns_for(width: int) -> list[tuple[str, str, int, int]]:
    """The columns that fit ``width`` cells (each takes its minimum plus 2 cells of padding), in table order,
    dropping the lowest-priority ones first: history, poll rtt ms, every s, kind, faults, TPOT, TTFT ..."""
    keep = list(COLUMNS)
    while len(keep) > 3 and sum(c[2] + 2 for c in keep) > width:
        keep.remove(min(keep, key=lambda c: c[3]))
    return keep


def _ms(v: float | None, clock: str | None) -> str:
    if v is None:
        return NR if clock is None else "–"
    return f"{v:,.0f} ms {clock}" if v >= 100 else f"{v:.1f} ms {clock}"


def cells(s: BoardSample, history: list[float | None], settings: Settings, now: float,
          interval_s: float | None = None) -> dict[str, Text]:
    """The row of one board as styled cells, by column key.

    ``every s`` is the host wall s between the board's last two samples (yellow past 1.5 x ``interval_s``,
    the fleet's refresh interval, when given); ``poll rtt ms`` the host wall ms one poll's requests took,
    or ``stream`` for a board that pushes its samples (``/snapshot/stream``: no request, no round trip).
    """
    level_style = LEVEL_STYLE.get(s.level, "white")
    up = s.state == "up"
    out: dict[str, Text] = {"board": Text(s.name, style="bold")}
    if not up:
        out["health"] = Text(s.state, style="bold red")
    else:
        out["health"] = Text(s.health or NR, style=level_style)
    mode = s.mode if s.mode is not None else NR
    lease = f" · {s.lease_holder}" if s.lease_holder else ""
    out["mode"] = Text(f"{mode}{lease}", style="bold red" if s.mode == "exclusive" else
                       "yellow" if s.mode == "draining" else "")
    out["kv"] = Text(NR if s.kv_percent is None else f"{s.kv_percent:.0f}",
                     style=settings.style("kv_percent", s.kv_percent) if s.kv_percent is not None else "dim")
    out["queue"] = Text(NR if s.queue is None else str(s.queue),
                        style=settings.style("queue_depth", s.queue) if s.queue is not None else "dim")
    run = NR if s.running is None else (f"{s.running}/{s.n_slots}" if s.n_slots else str(s.running))
    out["running"] = Text(run, style="" if s.running is not None else "dim")
    out["rate"] = Text(NR if s.output_tok_s is None else f"{s.output_tok_s:.1f} {s.rate_clock}",
                       style="" if s.output_tok_s is not None else "dim")
    out["ttft"] = Text(_ms(s.ttft_p95_ms, s.latency_clock), style="" if s.latency_clock else "dim")
    out["tpot"] = Text(_ms(s.tpot_p95_ms, s.latency_clock), style="" if s.latency_clock else "dim")
    if s.faults_armed is None and s.faults_fired is None:
        out["faults"] = Text(NR, style="dim")
    elif s.faults_fired:
        out["faults"] = Text(f"{s.faults_fired} fired", style="bold red")
    elif s.faults_armed:
        out["faults"] = Text("armed " + ",".join(s.faults_armed), style="yellow")
    else:
        out["faults"] = Text("none", style="green")
    seen = ago(s.last_seen_unix_s, now)
    out["seen"] = Text(seen, style="" if up else "bold red")
    out["kind"] = Text(s.kind or "?", style="cyan" if s.kind else "dim")
    gap = s.sample_gap_s
    out["gap"] = Text("–" if gap is None else f"{gap:.1f}",
                      style="yellow" if gap is not None and interval_s and gap > 1.5 * interval_s else "")
    if s.via == "stream":
        out["poll"] = Text("stream", style="dim")
    else:
        out["poll"] = Text("–" if s.poll_ms is None else f"{s.poll_ms:.0f}" if s.poll_ms >= 10 else f"{s.poll_ms:.1f}",
                           style="yellow" if (s.poll_ms or 0) > 1000 else "")
    out["history"] = Text(sparkline(history), style="cyan")
    if not up:  # nothing is known of a board that does not answer: blank, not "not reported"
        for k in ("kv", "queue", "running", "rate", "ttft", "tpot", "faults", "mode"):
            out[k] = Text("–", style="dim")
    return out


def state_of(s: BoardSample) -> tuple[Any, ...]:
    """What makes a board's row a different state, not just newer figures: link state, level, health, mode,
    lease holder, faults fired (a change of any of these is redrawn at once)."""
    return s.state, s.level, s.health, s.mode, s.lease_holder, s.faults_fired


class FleetTable(Widget, can_focus=True):
    """The board rows as one block of fixed-width lines (one ``Text`` a redraw), with a row cursor.

    A ``DataTable`` re-rendered every cell of every row at each 1 Hz update (its cache keys on the update
    count), ~7 % of a core for 16 boards on these machines; columns here are padded to their widest cell
    and joined, so a redraw is one ``Text`` of N lines. Up/Down/PgUp/PgDn/Home/End move the cursor, Enter
    posts ``Open(name)``; the rows scroll so the cursor stays visible.
    """

    BINDINGS = [
        Binding("up", "move(-1)", "up", show=False),
        Binding("down", "move(1)", "down", show=False),
        Binding("pageup", "move(-10)", "page up", show=False),
        Binding("pagedown", "move(10)", "page down", show=False),
        Binding("home", "move(-100000)", "first", show=False),
        Binding("end", "move(100000)", "last", show=False),
        Binding("enter", "open", "open board"),
    ]

    class Open(Message):
        """Enter on a row: open that board's console."""

        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    class Highlighted(Message):
        """The cursor moved to another board."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.order: list[str] = []
        self.header: list[tuple[str, str]] = []
        self.rows: dict[str, dict[str, Text]] = {}
        self.cursor_row = 0
        self._top = 0
        self._drawn: tuple[Any, ...] = ()

    def set_rows(self, columns: list[tuple[str, str]], order: list[str], rows: dict[str, dict[str, Text]],
                 keep: str | None) -> None:
        """Show ``rows`` (cells by column key) in ``order``; the cursor stays on board ``keep`` if present."""
        self.header, self.order, self.rows = columns, order, rows
        if keep in order:
            self.cursor_row = order.index(keep)
        self.cursor_row = max(0, min(self.cursor_row, len(order) - 1))
        # repaint only when something on screen differs: idle boards give the same rows every second, and a
        # repaint of 16 rows is most of the view's CPU
        drawn = (tuple(columns), tuple(order), self.cursor_row,
                 tuple((n, k, c.plain, str(c.style), tuple(c.spans)) for n in order for k, c in rows[n].items()))
        if drawn != self._drawn:
            self._drawn = drawn
            self.refresh()

    def on_focus(self) -> None:
        self.refresh()  # the cursor row's style follows the focus (reverse / underline)

    def on_blur(self) -> None:
        self.refresh()

    def action_move(self, delta: int) -> None:
        if not self.order:
            return
        row = max(0, min(len(self.order) - 1, self.cursor_row + delta))
        if row != self.cursor_row:
            self.cursor_row = row
            self.refresh()
            self.post_message(self.Highlighted())

    def action_open(self) -> None:
        if self.order:
            self.post_message(self.Open(self.order[self.cursor_row]))

    def render(self) -> Text:
        keys = [k for k, _ in self.header]
        widths = {k: max([len(h)] + [len(self.rows[n][k].plain) for n in self.order]) for k, h in self.header}
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append("  ".join(h.ljust(widths[k]) for k, h in self.header).rstrip(), style="bold")
        body = max(1, self.size.height - 1)
        if self.cursor_row < self._top:
            self._top = self.cursor_row
        elif self.cursor_row >= self._top + body:
            self._top = self.cursor_row - body + 1
        self._top = max(0, min(self._top, max(0, len(self.order) - body)))
        for i in range(self._top, min(len(self.order), self._top + body)):
            name = self.order[i]
            line = Text()
            for j, k in enumerate(keys):
                if j:
                    line.append("  ")
                cell = self.rows[name][k]
                line.append_text(cell)
                line.append(" " * (widths[k] - len(cell.plain)))
            if i == self.cursor_row:
                line.stylize("reverse" if self.has_focus else "underline")
            out.append("\n")
            out.append_text(line)
        return out


class FleetApp(App[None]):
    """One row per board, worst first (see the module docstring). ``transports``: per-board httpx async
    transports for tests (None: real sockets)."""

    CSS_PATH = str(Path(__file__).resolve().parent.parent / "styles.tcss")  # the panes' styles (BoardScreen)
    CSS = """
    #fleet-head { height: 2; background: $boost; padding: 0 1; }
    #fleet-table { height: 1fr; }
    #fleet-detail { height: 3; padding: 0 1; color: $text-muted; }
    """
    TITLE = "calconsole fleet"
    BINDINGS = [
        Binding("ctrl+q", "quit", "quit", priority=True),
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
    ]

    def __init__(self, config: FleetConfig, settings: Settings | None = None, layout: Layout | None = None,
                 transports: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.config = config
        self.settings = settings or Settings()
        self.layout_spec = layout
        self.monitor = FleetMonitor(config, self.settings, on_change=self._changed, transports=transports)
        self._dirty = True
        self._order: list[str] = []
        self._states: dict[str, tuple[Any, ...]] = {}
        self._head_text: Text | None = None
        self._detail_text: Text | None = None
        self.redraws = 0

    def compose(self) -> ComposeResult:
        # kept as references: App.query_one searches the active screen, which is a board's console at times
        self._head = Static(id="fleet-head")
        self._table = FleetTable(id="fleet-table")
        self._detail = Static(id="fleet-detail")
        yield self._head
        yield self._table
        yield self._detail
        yield Footer()

    def on_mount(self) -> None:
        self.monitor.start()
        self.set_interval(1.0 / self.config.refresh_hz, self._redraw)
        self._redraw()
        self._table.focus()

    async def on_unmount(self) -> None:
        await self.monitor.stop()

    def _changed(self, sample: BoardSample) -> None:
        """A board's new sample (on this app's loop). The table is redrawn at the next refresh tick, or at once
        when the board's state changed (``state_of``): a state change shows as soon as its sample arrives,
        within one refresh interval of the change, not up to a tick later."""
        self._dirty = True
        state = state_of(sample)
        if self._states.get(sample.name) != state:
            self._states[sample.name] = state
            self._redraw()

    def on_resize(self) -> None:
        self._dirty = True
        self._redraw()

    def ranked(self) -> list[BoardSample]:
        """The latest sample of every board, worst first."""
        return rank(list(self.monitor.samples.values()))

    def _redraw(self) -> None:
        if not self._dirty or len(self.screen_stack) > 1:
            return  # nothing new, or a board's console (or help) covers the table: redrawn on return
        self._dirty = False
        self.redraws += 1
        table = self._table
        now = time.time()
        samples = self.ranked()
        cols = columns_for(self.size.width - 2)
        selected = self.selected()
        interval = 1.0 / self.config.refresh_hz
        rows = {s.name: cells(s, [h[1] for h in self.monitor.history[s.name]], self.settings, now, interval)
                for s in samples}
        self._order = [s.name for s in samples]
        table.set_rows([(k, h) for k, h, _, _ in cols], self._order, rows, selected)
        up = sum(1 for s in samples if s.state == "up")
        crit = sum(1 for s in samples if s.level == "crit")
        warn = sum(1 for s in samples if s.level == "warn")
        head = Text.assemble(("calconsole fleet ", "bold"), f"{len(samples)} boards · ",
                             (f"{up} answering", "green" if up == len(samples) else "bold red"), " · ",
                             (f"{crit} crit", "bold red" if crit else "green"), " · ",
                             (f"{warn} warn", "bold yellow" if warn else "green"),
                             f" · {self.config.refresh_hz:g} Hz each · worst first\n",
                             ("sim: simulated device time · wall: server wall time · n/r: not reported · every s: "
                              "host s between a board's samples · poll rtt: one poll's round trip (stream: pushed, "
                              "no request)", "dim"))
        if head != self._head_text:  # rich Text compares its text and styles; an unchanged line is not repainted
            self._head_text = head
            self._head.update(head)
        self._show_detail()

    def on_fleet_table_highlighted(self, event: FleetTable.Highlighted) -> None:
        self._show_detail()

    def _show_detail(self) -> None:
        table = self._table
        if not self._order or not 0 <= table.cursor_row < len(self._order):
            return
        s = self.monitor.samples[self._order[table.cursor_row]]
        what = f"{s.kind or 'unknown kind'} at {s.url}"
        if s.model:
            what += f" · model {s.model}"
        if s.build:
            what += f" · build {s.build}"
        why = "; ".join(s.reasons) if s.reasons else "within every threshold"
        detail = Text.assemble((s.name, "bold"), f": {what}\n", (why, LEVEL_STYLE.get(s.level, "white")),
                               "\nEnter opens this board's console (observation, chat; maintenance with its admin "
                               "key); Esc there returns here")
        if detail != self._detail_text:
            self._detail_text = detail
            self._detail.update(detail)

    def row_text(self, name: str) -> str:
        """The plain text of board ``name``'s row as last set in the table ("" when it has none yet)."""
        row = self._table.rows.get(name)
        return "  ".join(c.plain for c in row.values()) if row else ""

    def selected(self) -> str | None:
        table = self._table
        if not self._order or not 0 <= table.cursor_row < len(self._order):
            return None
        return self._order[table.cursor_row]

    def on_fleet_table_open(self, event: FleetTable.Open) -> None:
        self.action_open_board(event.name)

    def action_open_board(self, name: str | None = None) -> None:
        """Attach to the selected board (in a worker: connecting is blocking I/O) and push its console."""
        name = name or self.selected()
        if name is None:
            return
        self._open_console(self.monitor.spec(name))

    @work(thread=True, exclusive=True, group="attach")
    def _open_console(self, spec: BoardSpec) -> None:
        from ..remote import connect

        try:
            api = read_key(spec.api_key_file, "api")
            admin = read_key(spec.admin_key_file, "admin")
            system = connect(spec.url, api_key=api, admin_key=admin)
        except Exception as e:  # noqa: BLE001 - any failure to attach is the operator's to read, not a crash
            self.call_from_thread(self.notify, f"{spec.name}: cannot open its console: {e}", severity="error",
                                  timeout=10)
            return
        layout = self.layout_spec or load_layout("operator")
        self.call_from_thread(self.push_screen, BoardScreen(spec, system, layout, self.settings))

    def action_help(self) -> None:
        self.notify("Up/Down select a board · Enter opens its console (Esc or F10 returns) · q quits. Rows are "
                    "worst first: not answering, then crit, warn, ok. Maintenance acts on one board at a time, "
                    "with that board's admin key and lease; no fleet-wide action is offered.", timeout=15)


class BoardScreen(Screen[None]):
    """One board's console over its remote planes: the layout's panes, fed by a sampler thread.

    Closing (Esc / F10) stops the sampler and closes the board's connection on a thread (a held lease is
    released, bounded by the remote plane's own timeouts).
    """

    BINDINGS = [
        Binding("f10", "back", "fleet", priority=True),
        # priority, so it comes before the panes' own Esc; it steps aside (SkipAction) while a reply streams
        # or an observation section is shown alone, where Esc has its pane meaning first
        Binding("escape", "back", "back to fleet", priority=True),
        *PANE_BINDINGS,
    ]

    def __init__(self, spec: BoardSpec, system: Any, layout: Layout, settings: Settings) -> None:
        super().__init__()
        self.spec = spec
        self.system = system
        self.settings = settings
        self.layout_spec = layout if system.maintenance is not None else layout.without("maintenance")
        self.refresh_hz = layout.refresh_hz
        self.last_snapshot: Snapshot | None = None
        self._panes: list[Any] = []
        # the console's own feed (feed.py): one sampler thread, typed snapshots
        self.feed = SnapshotFeed(system, lambda: self.refresh_hz, lambda snap: self.post_message(SnapshotReady(snap)))
        self._topbar = Static(id="topbar")

    def compose(self) -> ComposeResult:
        from ..panes.chat import ChatPane
        from ..panes.observation import ObservationPane

        yield self._topbar
        with Horizontal(id="columns"):
            for ci, col in enumerate(self.layout_spec.columns):
                with Vertical(classes="column", id=f"col{ci}") as v:
                    v.styles.width = col.width
                    for p in col.panes:
                        pane: Any
                        if p.pane == "observation":
                            pane = ObservationPane(self.settings, id="observation", classes="pane")
                            pane.border_title = "Observation (read-only)"
                        elif p.pane == "chat":
                            pane = ChatPane(self.system.inference, id="chat", classes="pane")
                            pane.border_title = "Chat"
                        else:
                            from ..panes.maintenance import MaintenancePane

                            pane = MaintenancePane(self.system.maintenance, self.system.device_name,
                                                   id="maintenance", classes="pane")
                            pane.border_title = f"Maintenance (guarded) · {self.spec.name} only"
                        pane.styles.height = p.height
                        self._panes.append(pane)
                        yield pane
        yield Footer()

    def on_mount(self) -> None:
        self._topbar.update(Text.assemble(("calconsole ", "bold"), (self.spec.name, "bold cyan"),
                                          f" · attached to {self.spec.url} · Esc / F10: back to the fleet"))
        self.feed.start()
        self.action_focus_pane("observation")

    def on_snapshot_ready(self, message: SnapshotReady) -> None:
        self.last_snapshot = message.snap
        for pane in self._panes:
            try:
                pane.update_snapshot(message.snap)
            except Exception:  # noqa: BLE001, S112 - a pane still composing fills at the next refresh
                continue

    def action_focus_pane(self, name: str) -> None:
        focus_pane(self, name)

    def action_back(self) -> None:
        from textual.actions import SkipAction

        for chat in self.query("#chat"):
            if getattr(chat, "handle", None) is not None and chat.has_focus_within:
                raise SkipAction()  # Esc cancels the streaming reply first (the chat pane's binding)
        for obs in self.query("#observation"):
            if getattr(obs, "focused_section", None) is not None and obs.has_focus_within:
                raise SkipAction()  # Esc shows every section again first
        self.close_board()
        self.app.pop_screen()

    def close_board(self) -> None:
        """Stop sampling and close the board's connection on a thread (releases a held lease, bounded)."""
        self.feed.stop(timeout_s=0.0)
        system = self.system
        threading.Thread(target=system.close, name=f"close-{self.spec.name}", daemon=True).start()
