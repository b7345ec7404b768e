"""Observation pane (read-only): renders snapshots, never touches the device."""

from __future__ import annotations

import time

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Sparkline, Static

from ..widgets import render
from ..widgets.render import set_subtitle


class ObservationPane(VerticalScroll):
    """Device, jobs, KV, slots, request metrics, per-layer timings, memory, host, findings.

    Fed by ``update_snapshot(snap)`` from the app's refresh timer. Key ``t``
    cycles the per-layer table: last step / last decode / last prefill (README says the same).
    """

    BINDINGS = [Binding("t", "toggle_step", "per-layer: step/decode/prefill")]
    can_focus = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.show_kind = "last_step"
        self._last: dict | None = None
        self._shape: dict[str, object] = {}
        self._shown: dict[str, object] = {}  # section -> the snapshot data it currently shows
        self._rendered_at: dict[str, float] = {}
        self._last_layout = 0.0

    def compose(self) -> ComposeResult:
        yield Static(id="obs-device")
        yield Static(id="obs-jobs")
        yield Static(id="obs-kv")
        yield Static(id="obs-slots")
        yield Static(id="obs-requests")
        yield Static("tokens/s per finished request (sim):", id="obs-spark-label", classes="dim")
        yield Sparkline([], id="obs-spark")
        yield Static(id="obs-stages")
        yield Static(id="obs-layers")
        yield Static(id="obs-memory")
        yield Static(id="obs-host")
        yield Static(id="obs-findings")

    def action_toggle_step(self) -> None:
        order = ["last_step", "last_decode", "last_prefill"]
        self.show_kind = order[(order.index(self.show_kind) + 1) % len(order)]
        if self._last is not None:
            self._shown["#obs-layers"] = (self.show_kind, self._last[self.show_kind])
            self._render_layers(self._last)

    VIEW_NAMES = {"last_step": "last step", "last_decode": "last decode", "last_prefill": "last prefill"}

    def _render_layers(self, snap: dict) -> None:
        step = snap[self.show_kind]
        view = Text(f"per-layer view: {self.VIEW_NAMES[self.show_kind]} (t cycles last step / decode / prefill)",
                    style="bold grey70")
        panel = render.layers_panel(step)
        # the title's length is in the key: its numbers change width (11.9 -> 111.5 ms), the title
        # then wraps to one more line, and without a relayout the table's row was cut off (blank)
        head = panel.renderables[0] if isinstance(panel, Group) else None
        title = head.plain if isinstance(head, Text) else ""
        self._update("#obs-layers", Group(view, panel),
                     (self.show_kind, len(step.get("layers", ())), render.layers_uniform(step), len(title)))

    # widget id -> (snapshot keys it shows, renderer)
    SECTIONS = {
        "#obs-device": (("device", "sim_now_ms"), render.device_panel),
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
        prev = self._last or {}
        self._last = snap
        set_subtitle(self, render.mode_text(snap["device"]).plain)
        now = time.monotonic()
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
        q = self.query_one
        if prev.get("history") != snap["history"]:
            tps = [x for x in snap["history"]["tokens_per_s"] if isinstance(x, (int, float)) and x == x][-120:]
            spark = q("#obs-spark", Sparkline)
            spark.display = len(tps) >= 2  # a flat placeholder would read as data
            q("#obs-spark-label", Static).display = spark.display
            if spark.display:
                spark.data = tps
        layers_data = (self.show_kind, snap[self.show_kind])
        if self._shown.get("#obs-layers") != layers_data and (
                now - self._rendered_at.get("#obs-layers", 0.0) >= self.SLOW_SECTIONS["#obs-layers"]):
            self._rendered_at["#obs-layers"] = now
            self._shown["#obs-layers"] = layers_data
            self._render_layers(snap)


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
