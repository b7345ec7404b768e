"""Observation pane (read-only): renders snapshots, never touches the device.

Top to bottom: the npu-smi style device table (board row, one row per chiplet), the header
figures coloured by their thresholds (KV, queue, TTFT/TPOT P95 against the SLO, failures,
pacing), history graphs (plotext) of KV occupancy and busy %, output tok/s, TTFT/TPOT P95 and
queue depth over a 1 / 5 / 15 min window, then the detail sections: per-layer heatmap and table,
requests, slots, stages, KV, jobs, memory, host, findings. With a batch-N variant bundle (C3) a
"batches" section shows each recent decode step's occupancy and the slots that rode in it.
Compact mode (automatic below 120x36, or key ``m``) keeps the device rows, the header figures
and one graph (``g`` picks it).

Sections (``settings.SECTIONS``) can be folded (``z``), moved (``{`` / ``}``) and focused (``f``: one
shown alone, full height); ``[`` / ``]`` select one. The arrangement is written to the settings file
at each change and restored at start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from rich.console import Group, RenderableType
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Vertical, VerticalScroll
from textual.visual import VisualType
from textual.widgets import Static

from sim_backend.planes.snapshot import Snapshot, StepView

from ..settings import HISTORY_WINDOWS_S, SECTIONS, Settings, SettingsError, save_sections
from ..widgets import render
from ..widgets import server as server_render
from ..widgets.history import GRAPHS, History, HistoryGraph
from ..widgets.render import set_subtitle
from .focus import HELP_BINDING

#: section name (settings.SECTIONS) -> the widget that shows it
SECTION_WIDGET = {"device": "#obs-device", "thresholds": "#obs-header", "graphs": "#obs-graphs-box",
                  "batches": "#obs-batches", "requests": "#obs-requests", "per-layer": "#obs-layers",
                  "slots": "#obs-slots", "stages": "#obs-stages", "kv": "#obs-kv", "jobs": "#obs-jobs",
                  "memory": "#obs-memory", "host": "#obs-host", "findings": "#obs-findings"}
assert set(SECTION_WIDGET) == set(SECTIONS)
#: what compact mode keeps (the other sections are hidden there, folded or not)
COMPACT_SECTIONS = ("device", "thresholds", "graphs")
HEAT_VIEWS = ("chip", "category")


class ObservationPane(VerticalScroll):
    """Device, load, KV, latency history, per-layer timings, memory, host, findings.

    Fed by ``update_snapshot(snap)`` from the app's refresh timer. Keys: ``t`` cycles the per-layer
    view (last step / decode / prefill), ``h`` the heatmap rows (chips / op categories), ``w`` the
    history window (1 / 5 / 15 min), ``g`` the graph shown in compact mode, ``m`` compact mode.
    """

    BINDINGS = [
        HELP_BINDING,
        Binding("t", "toggle_step", "per-layer: step/decode/prefill"),
        Binding("h", "toggle_heat", "heatmap: chips/categories"),
        Binding("w", "cycle_window", "history 1/5/15 min"),
        Binding("g", "next_graph", "next graph"),
        Binding("m", "toggle_compact", "compact"),
        Binding("left_square_bracket", "select_section(-1)", "previous section", show=False),
        Binding("right_square_bracket", "select_section(1)", "next section"),
        Binding("z", "fold_section", "fold"),
        Binding("Z", "unfold_all", "unfold every section", show=False),
        Binding("left_curly_bracket", "move_section(-1)", "move section up", show=False),
        Binding("right_curly_bracket", "move_section(1)", "move section down", show=False),
        Binding("f", "focus_section", "focus section"),
        Binding("escape", "unfocus_section", "show every section (leave focus)", show=False),
    ]
    HELP_EXTRA = ("Sections (top to bottom, named in the bar at the top of the pane): [ and ] select one "
                  "(in focus: show the previous / next alone), z folds or unfolds it, { and } move it up or "
                  "down, f shows it alone at full height (f or Esc again: all), Z unfolds all. The "
                  "arrangement is saved in the settings file at each change and restored at start. "
                  "Compact mode keeps the device table, the thresholds line and one graph whatever is folded.")
    can_focus = True

    def __init__(self, settings: Settings | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.settings = settings or Settings()
        self.show_kind = "last_step"
        self.heat_by = "chip"
        self.window_s = float(self.settings.history_window_s)
        self.compact = False
        self.graph_index = 0
        self.history = History()
        self._last: Snapshot | None = None
        self._shape: dict[str, object] = {}
        self._shown: dict[str, object] = {}  # section -> the snapshot data it currently shows
        self._rendered_at: dict[str, float] = {}
        self._last_layout = 0.0
        self.order: list[str] = list(self.settings.section_order)
        self.folded: set[str] = set(self.settings.sections_folded)
        self.focused_section: str | None = self.settings.section_focus
        self.selected: str = self.focused_section or self.order[0]
        self.shown_sections: set[str] = set()
        self._fresh: set[str] = set()  # just made visible: rendered at once, past the rate limits
        self._save_failed = False
        self._composed = False

    def compose(self) -> ComposeResult:
        yield Static(id="obs-sections")
        for name in self.order:
            if name == "graphs":
                with Vertical(id="obs-graphs-box"):
                    with Grid(id="obs-graphs"):
                        for spec in GRAPHS:
                            yield HistoryGraph(spec, id=f"graph-{spec.id}", classes="obs-graph")
                    yield Static(id="obs-graph-note", classes="dim")
            else:
                yield Static(id=SECTION_WIDGET[name][1:])

    def on_mount(self) -> None:
        self._composed = True
        self._apply_arrangement()

    # --- keys -----------------------------------------------------------------------------------

    def reports_layers(self) -> bool:
        """Whether the attached plane reports per-layer steps: the simulator (and a calconsole server) does, a
        llama-server does not (its per-layer section says so)."""
        return self._last is None or server_render.kind_of(self._last) is None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """The per-layer keys (t, h) only where the plane reports per-layer steps: not on a llama-server's
        footer or help."""
        if action in ("toggle_step", "toggle_heat"):
            return self.reports_layers()
        return True

    def help_bindings(self) -> list[BindingType]:
        """The pane's key bindings the help lists (those ``check_action`` allows now)."""
        return [b for b in self.BINDINGS if not isinstance(b, Binding) or self.check_action(b.action, ()) is not False]

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
        self._apply_arrangement()

    def action_toggle_compact(self) -> None:
        self.set_compact(not self.compact)

    def set_compact(self, on: bool) -> None:
        """Compact: device rows, header figures, one graph; the detail sections hidden."""
        if on != self.compact:
            self.compact = on
            self._shown.pop("#obs-device", None)  # the device table and the header have compact forms
            self._shown.pop("#obs-header", None)
            self._apply_arrangement()

    # --- sections: fold, reorder, focus ---------------------------------------------------------

    def applicable(self, name: str) -> bool:
        """A section with something to show on this device (batches: a batch-N variant only)."""
        if name == "batches":
            return self._last is not None and self._last.device is not None and self._last.device.decode_batch > 1
        return True

    def listed(self) -> list[str]:
        """The sections the bar names and the cursor visits, top to bottom."""
        return [n for n in self.order if self.applicable(n)]

    def _is_visible(self, name: str) -> bool:
        if not self.applicable(name):
            return False
        if self.focused_section is not None and self.applicable(self.focused_section):
            return name == self.focused_section
        if self.compact:
            return name in COMPACT_SECTIONS
        return name not in self.folded

    def _apply_arrangement(self) -> None:
        """Order, fold, focus and compact as they now stand: widget order and display, then a re-render."""
        if not self._composed:
            return
        self.set_class(self.compact, "-compact")
        focus = self.focused_section if self.focused_section is not None and self.applicable(
            self.focused_section) else None
        self.set_class(focus is not None, "-focus")
        self.set_class(focus == "graphs", "-focus-graphs")
        previous = None
        for name in self.order:
            w = self.query_one(SECTION_WIDGET[name])
            if previous is None:
                self.move_child(w, after=self.query_one("#obs-sections"))
            else:
                self.move_child(w, after=previous)
            previous = w
        was = self.shown_sections
        self.shown_sections = {n for n in self.order if self._is_visible(n)}
        self._fresh |= self.shown_sections - was
        for name in self.order:
            self.query_one(SECTION_WIDGET[name]).display = name in self.shown_sections
        for i, g in enumerate(self.query(HistoryGraph)):
            g.display = not self.compact or i == self.graph_index
        self._size_graphs()
        self._render_bar()
        if self._last is not None:  # before the first snapshot a drawn graph would only say "no data yet"
            self.update_snapshot(self._last)
            self._draw_graphs(force=True)

    def on_resize(self) -> None:
        if self.has_class("-focus-graphs"):
            self._size_graphs()
        shown = self._shown.get("#obs-device")
        if self._last is not None and not (isinstance(shown, tuple) and shown[-1] == self._table_width()):
            self.update_snapshot(self._last)  # the device table picks the form that fits the new width

    def _table_width(self) -> int | None:
        """Columns the device table may take (the pane's content width); None before layout."""
        w = self.scrollable_content_region.width
        return max(20, w) if w > 0 else None  # already less a vertical scrollbar when one is shown

    def _size_graphs(self) -> None:
        """Focused, the graphs share the pane's height (inline styles); otherwise the stylesheet's rows."""
        grid = self.query_one("#obs-graphs", Grid)
        rows: int | None = None
        if self.has_class("-focus-graphs"):
            n_rows = 1 if self.compact else -(-len(GRAPHS) // 2)
            rows = max(6, (self.size.height - 5) // n_rows)  # less the bar and the note
        grid.styles.grid_rows = None if rows is None else str(rows)
        for g in self.query(HistoryGraph):
            g.styles.height = rows

    def _render_bar(self) -> None:
        bar = self.query_one("#obs-sections", Static)
        focus = self.focused_section if self.focused_section is not None and self.applicable(
            self.focused_section) else None
        # compact (about 40 columns): no bar unless a section is focused (it says how to leave)
        bar.display = not self.compact or focus is not None
        t = render.sections_bar(self.listed(), self.folded, self.selected, focus, self.compact)
        if self._shown.get("#obs-sections") != t.plain + str(t.spans):
            self._shown["#obs-sections"] = t.plain + str(t.spans)
            bar.update(t)

    def _arrangement_changed(self) -> None:
        """Apply, and keep it: the pane's settings, and the settings file's ``sections`` key."""
        self.settings = self.settings.replace(section_order=tuple(self.order),
                                              sections_folded=tuple(n for n in self.order if n in self.folded),
                                              section_focus=self.focused_section)
        self._apply_arrangement()
        try:
            save_sections(self.settings)
        except (OSError, SettingsError) as e:
            if not self._save_failed:  # once: a read-only config directory must not nag at every key
                self.notify(f"section arrangement not saved: {e}", severity="warning")
            self._save_failed = True
        else:
            self._save_failed = False

    def _step(self, name: str, delta: int) -> str:
        names = self.listed()
        if name not in names:
            return names[0]
        return names[(names.index(name) + delta) % len(names)]

    def action_select_section(self, delta: int) -> None:
        """Select the previous / next section; in focus, show that one alone instead."""
        self.selected = self._step(self.selected, delta)
        if self.focused_section is not None:
            self.focus_section(self.selected)
            return
        self._render_bar()
        if self.compact:  # no bar in compact: say which one
            self.notify(f"section {self.selected} selected (f shows it alone)", timeout=2)

    def fold_section(self, name: str) -> None:
        """Fold (hide all but its name in the bar) or unfold a section."""
        self.folded ^= {name}
        self.selected = name
        self._arrangement_changed()

    def action_fold_section(self) -> None:
        self.fold_section(self.selected)

    def action_unfold_all(self) -> None:
        self.folded = set()
        self._arrangement_changed()

    def move_section(self, name: str, delta: int) -> None:
        """Move a section up (-1) or down (+1), past the next listed section."""
        names = self.listed()
        if name not in names:
            return
        i = names.index(name)
        j = i + delta
        if not 0 <= j < len(names):
            return
        other = names[j]
        self.order.remove(name)
        k = self.order.index(other)
        self.order.insert(k if delta < 0 else k + 1, name)
        self.selected = name
        self._arrangement_changed()

    def action_move_section(self, delta: int) -> None:
        self.move_section(self.selected, delta)

    def focus_section(self, name: str | None) -> None:
        """Show ``name`` alone at full height (None: every section again)."""
        self.focused_section = name
        if name is not None:
            self.selected = name
        self._arrangement_changed()
        self.scroll_home(animate=False)

    def action_focus_section(self) -> None:
        self.focus_section(None if self.focused_section == self.selected else self.selected)

    def action_unfocus_section(self) -> None:
        if self.focused_section is not None:
            self.focus_section(None)

    def reset_sections(self) -> None:
        """The default arrangement: every section in the default order, none folded, no focus."""
        self.order, self.folded, self.focused_section = list(SECTIONS), set(), None
        self._arrangement_changed()

    # --- rendering ------------------------------------------------------------------------------

    VIEW_NAMES = {"last_step": "last step", "last_decode": "last decode", "last_prefill": "last prefill"}

    def _shown_step(self, snap: Snapshot) -> StepView | None:
        step: StepView | None = getattr(snap, self.show_kind)
        return step

    def _layers_key(self, snap: Snapshot) -> tuple[object, ...]:
        return (self.show_kind, self.heat_by, self._shown_step(snap))

    def _render_layers(self, snap: Snapshot) -> None:
        step = self._shown_step(snap)
        if step is None:
            return
        view = Text(f"per-layer view: {self.VIEW_NAMES[self.show_kind]} (t cycles last step / decode / prefill; "
                    f"h: heatmap rows {'chips' if self.heat_by == 'chip' else 'op categories'})",
                    style="bold grey70")
        width = max(20, self.size.width - 2)
        capacity = snap.device.decode_batch if snap.device is not None else 1
        if capacity > 1 and step.batch_seq_ids:
            view.append(f"\nbatched decode step: {len(step.batch_seq_ids)}/{capacity} rows "
                        f"(seqs {', '.join(map(str, step.batch_seq_ids))}); the times are the whole "
                        f"step's, all riders together", style="bold magenta")
        heat = render.layers_heatmap(step, self.heat_by, width)
        panel = render.layers_panel(step, capacity=capacity)
        # the title's length is in the key: its numbers change width (11.9 -> 111.5 ms), the title
        # then wraps to one more line, and without a relayout the table's row was cut off (blank)
        # the footer lines (per-chip busy/wait, experts, the heatmap's outside-the-layers line) wrap too
        texts = [r.plain for r in panel.renderables if isinstance(r, Text)] if isinstance(panel, Group) else []
        heat_last = heat.plain.rsplit("\n", 1)[-1] if isinstance(heat, Text) else ""
        n_rows = len(step.layers[0].category_us) if step.layers and self.heat_by != "chip" else 2
        self._update("#obs-layers", Group(view, heat, panel),
                     (self.show_kind, self.heat_by, n_rows, len(step.layers), len(view.plain),
                      render.layers_uniform(step), tuple(len(x) for x in texts), len(step.outside),
                      len(heat_last)))

    # widget id -> (snapshot keys it shows, renderer)
    SECTIONS = {
        "#obs-jobs": (("jobs",), render.jobs_panel),
        "#obs-kv": (("kv",), render.kv_panel),
        "#obs-slots": (("slots",), render.slots_panel),
        "#obs-requests": (("requests",), render.requests_panel),
        "#obs-batches": (("decode_batches", "device"), render.batches_panel),
        "#obs-stages": (("stages",), render.stages_panel),
        "#obs-memory": (("memory",), render.memory_panel),
        "#obs-host": (("host",), render.host_panel),
        "#obs-findings": (("findings",), render.findings_panel),
    }

    # heavy tables whose values move every step: re-rendered at most this often (s)
    SLOW_SECTIONS = {"#obs-memory": 2.0, "#obs-layers": 1.0, "#obs-host": 2.0}
    FULL_LAYOUT_EVERY_S = 5.0

    def _update(self, wid: str, renderable: VisualType, key: object) -> None:
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

    def update_snapshot(self, snap: Snapshot) -> None:
        """Re-render only the sections whose data changed (an idle console stays idle).

        Rendering competes with the simulation for the interpreter: during
        streaming every section changes at every refresh, so heavy tables are
        rate-limited and relayout happens only when a section changes shape.
        """
        if snap is not self._last:
            self.history.record(snap)
        batched = self.applicable("batches")
        had_layers = self.reports_layers()
        self._last = snap
        if self.reports_layers() != had_layers:  # the first snapshot of a server: its keys in the footer
            self.refresh_bindings()
        if self.applicable("batches") != batched:  # the first snapshot says what the bundle is
            self._apply_arrangement()
            return
        kind = server_render.kind_of(snap)  # a llama-server: no device sections (None), said so
        set_subtitle(self, server_render.subtitle(snap) if kind else
                     render.mode_text(snap.device).plain if snap.device is not None else "")
        now = time.monotonic()
        visible = self.shown_sections
        fresh, self._fresh = self._fresh, set()
        # a hidden (folded, compact, not focused) section is not rendered at all: it costs nothing
        if "device" in visible and kind:
            width = self._table_width()
            table = server_render.server_table(snap, self.compact, width)
            key = ("server", snap.server, snap.slots, snap.load.busy_percent, self.compact, width)
            if self._shown.get("#obs-device") != key:
                self._shown["#obs-device"] = key
                detail = bool(snap.server and snap.server.health_detail)
                self._update("#obs-device", table, ("server", self.compact, detail))
        elif "device" in visible and snap.device is not None and snap.jobs is not None:
            # the load's busy % only: its window length (wall s) changes at every sample, idle or not
            width = self._table_width()
            dev = (snap.device, snap.jobs.finished, snap.load.busy_percent, snap.memory, self.compact, width)
            if self._shown.get("#obs-device") != dev:
                self._shown["#obs-device"] = dev
                # the widest form that fits: columns drop in a stated order, no figure becomes "…"
                table = render.device_table(snap, self.compact, self.settings, width=width)
                # the faults line wraps: its length is part of the shape (a fault that fired later
                # kept the rows of "faults none", its detail cut, until something else moved)
                faults = table.renderables[-1]
                self._update("#obs-device", table, (len(snap.device.chiplets), self.compact,
                                                    len(faults.plain) if isinstance(faults, Text) else None))
        if "thresholds" in visible:
            header = (server_render.server_header(snap, self.compact) if kind
                      else render.header_line(snap, self.settings, self.compact))
            if self._shown.get("#obs-header") != header.plain:
                self._shown["#obs-header"] = header.plain
                self._update("#obs-header", header, len(header.plain) // 20)
        self._draw_graphs()
        for wid, (keys, fn) in self.SECTIONS.items():
            name = self.WIDGET_SECTION[wid]
            if name not in visible:
                continue
            data = tuple(getattr(snap, k) for k in keys)
            if kind and any(v is None for v in data):  # a section the server does not report
                if self._shown.get(wid) != ("absent", kind):
                    self._shown[wid] = ("absent", kind)
                    self._update(wid, server_render.absent(name, kind), ("absent",))
                continue
            # compared with what is on screen (not the previous snapshot), so a rate-limited
            # section catches up on a later refresh even when the data has stopped changing
            if self._shown.get(wid) != data:
                period = self.SLOW_SECTIONS.get(wid)
                if period is not None and name not in fresh and now - self._rendered_at.get(wid, 0.0) < period:
                    continue
                self._rendered_at[wid] = now
                self._shown[wid] = data
                self._update(wid, self._section(fn, snap), _shape_key(snap, keys))
        if "per-layer" not in visible:
            return
        if self._shown_step(snap) is None:
            if kind and self._shown.get("#obs-layers") != ("absent", kind):
                self._shown["#obs-layers"] = ("absent", kind)
                self._update("#obs-layers", server_render.absent("per-layer", kind), ("absent",))
            return
        layers_data = self._layers_key(snap)
        if self._shown.get("#obs-layers") != layers_data and ("per-layer" in fresh or (
                now - self._rendered_at.get("#obs-layers", 0.0) >= self.SLOW_SECTIONS["#obs-layers"])):
            self._rendered_at["#obs-layers"] = now
            self._shown["#obs-layers"] = layers_data
            self._render_layers(snap)

    WIDGET_SECTION = {w: n for n, w in SECTION_WIDGET.items()}

    def _section(self, fn: Callable[..., RenderableType], snap: Snapshot) -> RenderableType:
        """A detail renderer; the requests panel also names the console's SLO (the header's colours)."""
        return fn(snap, self.settings) if fn is render.requests_panel else fn(snap)

    #: a graph whose figures did not change since it was drawn is redrawn at most this often (s)
    FLAT_REDRAW_S = 30.0

    def _draw_graphs(self, force: bool = False) -> None:
        """Redraw a visible graph about when it would move by one column (at least 2 s apart), one graph
        per refresh (plotting costs ~10 ms a graph, drawn on the UI thread: four at once held keys up),
        and a graph whose figures have not changed since its last draw only every FLAT_REDRAW_S."""
        if "graphs" not in self.shown_sections:
            return
        now = time.monotonic()
        note = (f"{self.window_s / 60:g} min (wall) · w window · g graph" if self.compact else
                f"history: last {self.window_s / 60:g} min (x: host wall time before now; w changes it)")
        wall = self._last is not None and server_render.kind_of(self._last)
        if wall:
            note += " · busy % and tok/s: server wall; TTFT/TPOT: client wall"
        notes = self.query_one("#obs-graph-note", Static)
        if self._shown.get("#obs-graph-note") != note:
            self._shown["#obs-graph-note"] = note
            notes.update(note)
        due = []
        for g in self.query(HistoryGraph):
            if wall and g.clock_label is None:
                g.clock_label, g.drawn_at = "(wall)", 0.0  # redrawn now with its title
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


def _shape_key(snap: Snapshot, keys: tuple[str, ...]) -> tuple[int | tuple[int, int] | None, ...]:
    """What decides a section's height: row counts, and text length in 20-char buckets."""
    out: list[int | tuple[int, int] | None] = []
    for k in keys:
        v = getattr(snap, k)
        if isinstance(v, (list, tuple)):
            out.append(len(v))
        elif v is not None and k != "host":  # host is one line whatever its numbers
            b = msgspec.to_builtins(v)
            out.append((len(b) if isinstance(b, dict) else 0, len(str(b)) // 20))
        else:
            out.append(None)
    return tuple(out)
