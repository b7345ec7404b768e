"""Observation pane (read-only): renders snapshots, never touches the device.

Top to bottom: the npu-smi style device table (board row, one row per chiplet), the header
figures coloured by their thresholds (KV, queue, TTFT/TPOT P95 against the SLO, failures,
pacing), history graphs (plotext) of KV occupancy and busy %, output tok/s, TTFT/TPOT P95 and
queue depth over a 1 / 5 / 15 min window, then the detail sections: per-layer heatmap and table,
requests, slots, stages, KV, jobs, memory, host, findings. Compact mode (automatic below
120x36, or key ``m``) keeps the device rows, the header figures and one graph (``g`` picks it).
"""

from __future__ import annotations

import time

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.widgets import Static

from ..settings import HISTORY_WINDOWS_S, Settings
from ..widgets import render
from ..widgets.history import GRAPHS, History, HistoryGraph
from ..widgets.render import set_subtitle

#: (widget id, detail section): hidden in compact mode
DETAIL = ("#obs-layers", "#obs-requests", "#obs-slots", "#obs-stages", "#obs-kv", "#obs-jobs", "#obs-memory",
          "#obs-host", "#obs-findings")
HEAT_VIEWS = ("chip", "category")


class ObservationPane(VerticalScroll):
    """Device, load, KV, latency history, per-layer timings, memory, host, findings.

    Fed by ``update_snapshot(snap)`` from the app's refresh timer. Keys: ``t`` cycles the per-layer
    view (last step / decode / prefill), ``h`` the heatmap rows (chips / op categories), ``w`` the
    history window (1 / 5 / 15 min), ``g`` the graph shown in compact mode, ``m`` compact mode.
    """

    BINDINGS = [
        Binding("t", "toggle_step", "per-layer: step/decode/prefill"),
        Binding("h", "toggle_heat", "heatmap: chips/categories"),
        Binding("w", "cycle_window", "history 1/5/15 min"),
        Binding("g", "next_graph", "next graph"),
        Binding("m", "toggle_compact", "compact"),
    ]
    can_focus = True

    def __init__(self, settings: Settings | None = None, **kw) -> None:
        super().__init__(**kw)
        self.settings = settings or Settings()
        self.show_kind = "last_step"
        self.heat_by = "chip"
        self.window_s = float(self.settings.history_window_s)
        self.compact = False
        self.graph_index = 0
        self.history = History()
        self._last: dict | None = None
        self._shape: dict[str, object] = {}
        self._shown: dict[str, object] = {}  # section -> the snapshot data it currently shows
        self._rendered_at: dict[str, float] = {}
        self._last_layout = 0.0

    def compose(self) -> ComposeResult:
        yield Static(id="obs-device")
        yield Static(id="obs-header")
        with Grid(id="obs-graphs"):
            for spec in GRAPHS:
                yield HistoryGraph(spec, id=f"graph-{spec.id}", classes="obs-graph")
        yield Static(id="obs-graph-note", classes="dim")
        yield Static(id="obs-requests")
        yield Static(id="obs-layers")
        yield Static(id="obs-slots")
        yield Static(id="obs-stages")
        yield Static(id="obs-kv")
        yield Static(id="obs-jobs")
        yield Static(id="obs-memory")
        yield Static(id="obs-host")
        yield Static(id="obs-findings")

    # --- keys -----------------------------------------------------------------------------------

    def action_toggle_step(self) -> None:
        order = ["last_step", "last_decode", "last_prefill"]
        self.show_kind = order[(order.index(self.show_kind) + 1) % len(order)]
        self._refresh_layers()

    def action_toggle_heat(self) -> None:
        self.heat_by = HEAT_VIEWS[(HEAT_VIEWS.index(self.heat_by) + 1) % len(HEAT_VIEWS)]
        self._refresh_layers()

    def _refresh_layers(self) -> None:
        if self._last is not None:
            self._shown["#obs-layers"] = self._layers_key(self._last)
            self._render_layers(self._last)

    def action_cycle_window(self) -> None:
        i = HISTORY_WINDOWS_S.index(int(self.window_s)) if int(self.window_s) in HISTORY_WINDOWS_S else 0
        self.set_window(HISTORY_WINDOWS_S[(i + 1) % len(HISTORY_WINDOWS_S)])

    def set_window(self, seconds: float) -> None:
        """History window (host wall s): redraws the graphs at once."""
        self.window_s = float(seconds)
        self.notify(f"history window {seconds / 60:g} min", timeout=2)
        self._draw_graphs(force=True)

    def action_next_graph(self) -> None:
        self.graph_index = (self.graph_index + 1) % len(GRAPHS)
        self._apply_compact()
        self._draw_graphs(force=True)

    def action_toggle_compact(self) -> None:
        self.set_compact(not self.compact)

    def set_compact(self, on: bool) -> None:
        """Compact: device rows, header figures, one graph; the detail sections hidden."""
        if on != self.compact:
            self.compact = on
            self._apply_compact()
            self._shown.pop("#obs-device", None)  # the device table and the header have compact forms
            self._shown.pop("#obs-header", None)
            if self._last is not None:
                self.update_snapshot(self._last)
            self._draw_graphs(force=True)

    def _apply_compact(self) -> None:
        self.set_class(self.compact, "-compact")
        for i, g in enumerate(self.query(HistoryGraph)):
            g.display = not self.compact or i == self.graph_index
        for sel in DETAIL:
            self.query_one(sel).display = not self.compact

    # --- rendering ------------------------------------------------------------------------------

    VIEW_NAMES = {"last_step": "last step", "last_decode": "last decode", "last_prefill": "last prefill"}

    def _layers_key(self, snap: dict) -> tuple:
        return (self.show_kind, self.heat_by, snap[self.show_kind])

    def _render_layers(self, snap: dict) -> None:
        step = snap[self.show_kind]
        view = Text(f"per-layer view: {self.VIEW_NAMES[self.show_kind]} (t cycles last step / decode / prefill; "
                    f"h: heatmap rows {'chips' if self.heat_by == 'chip' else 'op categories'})",
                    style="bold grey70")
        width = max(20, self.size.width - 2)
        heat = render.layers_heatmap(step, self.heat_by, width)
        panel = render.layers_panel(step)
        # the title's length is in the key: its numbers change width (11.9 -> 111.5 ms), the title
        # then wraps to one more line, and without a relayout the table's row was cut off (blank)
        head = panel.renderables[0] if isinstance(panel, Group) else None
        title = head.plain if isinstance(head, Text) else ""
        n_rows = len(step.get("layers", ())[0]["category_us"]) if step.get("layers") and self.heat_by != "chip" else 2
        self._update("#obs-layers", Group(view, heat, panel),
                     (self.show_kind, self.heat_by, n_rows, len(step.get("layers", ())),
                      render.layers_uniform(step), len(title)))

    # widget id -> (snapshot keys it shows, renderer)
    SECTIONS = {
        "#obs-jobs": (("jobs",), render.jobs_panel),
        "#obs-kv": (("kv",), render.kv_panel),
        "#obs-slots": (("slots",), render.slots_panel),
        "#obs-requests": (("requests",), render.requests_panel),
        "#obs-stages": (("stages",), render.stages_panel),
        "#obs-memory": (("memory",), render.memory_panel),
        "#obs-host": (("host",), render.host_panel),
        "#obs-findings": (("findings",), render.findings_panel),
    }

    # heavy tables whose values move every step: re-rendered at most this often (s)
    SLOW_SECTIONS = {"#obs-memory": 2.0, "#obs-layers": 1.0, "#obs-host": 2.0}
    FULL_LAYOUT_EVERY_S = 5.0

    def _update(self, wid: str, renderable, key) -> None:
        """Update a section; a (costly) relayout of the scroll area only when its shape changed.

        ``key`` describes the section's height (rows, wrapping text length bucket);
        every FULL_LAYOUT_EVERY_S a full layout runs anyway.
        """
        now = time.monotonic()
        full = now - self._last_layout >= self.FULL_LAYOUT_EVERY_S
        relayout = full or self._shape.get(wid) != key
        self._shape[wid] = key
        self.query_one(wid, Static).update(renderable, layout=relayout)
        if full:
            self._last_layout = now

    def update_snapshot(self, snap: dict) -> None:
        """Re-render only the sections whose data changed (an idle console stays idle).

        Rendering competes with the simulation for the interpreter: during
        streaming every section changes at every refresh, so heavy tables are
        rate-limited and relayout happens only when a section changes shape.
        """
        if snap is not self._last:
            self.history.record(snap)
        self._last = snap
        set_subtitle(self, render.mode_text(snap["device"]).plain)
        now = time.monotonic()
        # the load's busy % only: its window length (wall s) changes at every sample, idle or not
        dev = (snap["device"], snap["jobs"]["finished"], (snap.get("load") or {}).get("busy_percent"), snap["memory"],
               self.compact)
        if self._shown.get("#obs-device") != dev:
            self._shown["#obs-device"] = dev
            self._update("#obs-device", render.device_table(snap, self.compact, self.settings),
                         (len(snap["device"]["chiplets"]), self.compact))
        header = render.header_line(snap, self.settings, self.compact)
        if self._shown.get("#obs-header") != header.plain:
            self._shown["#obs-header"] = header.plain
            self._update("#obs-header", header, len(header.plain) // 20)
        self._draw_graphs()
        if self.compact:
            return
        for wid, (keys, fn) in self.SECTIONS.items():
            data = tuple(snap[k] for k in keys)
            # compared with what is on screen (not the previous snapshot), so a rate-limited
            # section catches up on a later refresh even when the data has stopped changing
            if self._shown.get(wid) != data:
                period = self.SLOW_SECTIONS.get(wid)
                if period is not None and now - self._rendered_at.get(wid, 0.0) < period:
                    continue
                self._rendered_at[wid] = now
                self._shown[wid] = data
                self._update(wid, fn(snap), _shape_key(snap, keys))
        layers_data = self._layers_key(snap)
        if self._shown.get("#obs-layers") != layers_data and (
                now - self._rendered_at.get("#obs-layers", 0.0) >= self.SLOW_SECTIONS["#obs-layers"]):
            self._rendered_at["#obs-layers"] = now
            self._shown["#obs-layers"] = layers_data
            self._render_layers(snap)

    #: a graph whose figures did not change since it was drawn is redrawn at most this often (s)
    FLAT_REDRAW_S = 30.0

    def _draw_graphs(self, force: bool = False) -> None:
        """Redraw a visible graph about when it would move by one column (at least 2 s apart), one graph
        per refresh (plotting costs ~10 ms a graph, drawn on the UI thread: four at once held keys up),
        and a graph whose figures have not changed since its last draw only every FLAT_REDRAW_S."""
        now = time.monotonic()
        note = (f"{self.window_s / 60:g} min (wall) · w window · g graph" if self.compact else
                f"history: last {self.window_s / 60:g} min (x: host wall time before now; w changes it)")
        notes = self.query_one("#obs-graph-note", Static)
        if self._shown.get("#obs-graph-note") != note:
            self._shown["#obs-graph-note"] = note
            notes.update(note)
        due = []
        for g in self.query(HistoryGraph):
            if not g.display:
                continue
            if force or not g.drawn_at:  # forced, or never drawn (an empty box would read as broken)
                g.draw(self.history, self.window_s, now)
                continue
            period = max(2.0, self.window_s / max(20, g.size.width - 8))
            age = now - g.drawn_at
            if age < period:
                continue
            if age < self.FLAT_REDRAW_S and self.history.unchanged_since(g.drawn_at, g.spec.keys):
                continue
            due.append((g.drawn_at, g))
        if due:
            min(due, key=lambda x: x[0])[1].draw(self.history, self.window_s, now)


def _shape_key(snap: dict, keys: tuple[str, ...]) -> tuple:
    """What decides a section's height: row counts, and text length in 20-char buckets."""
    out: list[int | tuple[int, int] | None] = []
    for k in keys:
        v = snap[k]
        if isinstance(v, (list, tuple)):
            out.append(len(v))
        elif isinstance(v, dict) and k != "host":  # host is one line whatever its numbers
            out.append((len(v), len(str(v)) // 20))
        else:
            out.append(None)
    return tuple(out)
