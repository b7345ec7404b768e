"""Observation pane (read-only): renders snapshots, never touches the device."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Sparkline, Static

from ..widgets import render


class ObservationPane(VerticalScroll):
    """Device, jobs, KV, slots, request metrics, per-layer timings, memory, host, findings.

    Fed by ``update_snapshot(snap)`` from the app's refresh timer. Key ``t``
    switches the per-layer table between the last decode and last prefill.
    """

    BINDINGS = [Binding("t", "toggle_step", "prefill/decode layers")]
    can_focus = True

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.show_kind = "last_step"
        self._last: dict | None = None

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
            self._render_layers(self._last)

    def _render_layers(self, snap: dict) -> None:
        step = snap[self.show_kind]
        self.query_one("#obs-layers", Static).update(render.layers_panel(step))

    def update_snapshot(self, snap: dict) -> None:
        self._last = snap
        self.border_subtitle = render.mode_text(snap["device"]).plain
        q = self.query_one
        q("#obs-device", Static).update(render.device_panel(snap))
        q("#obs-jobs", Static).update(render.jobs_panel(snap))
        q("#obs-kv", Static).update(render.kv_panel(snap))
        q("#obs-slots", Static).update(render.slots_panel(snap))
        q("#obs-requests", Static).update(render.requests_panel(snap))
        tps = [x for x in snap["history"]["tokens_per_s"] if x == x][-120:]
        spark = q("#obs-spark", Sparkline)
        spark.display = len(tps) >= 2  # a flat placeholder would read as data
        q("#obs-spark-label", Static).display = spark.display
        if spark.display:
            spark.data = tps
        q("#obs-stages", Static).update(render.stages_panel(snap))
        self._render_layers(snap)
        q("#obs-memory", Static).update(render.memory_panel(snap))
        q("#obs-host", Static).update(render.host_panel(snap))
        q("#obs-findings", Static).update(render.findings_panel(snap))
