"""History of snapshot figures over the last 15 minutes, and the graphs that draw it (plotext).

``History.record(snap)`` keeps, per snapshot, figures read from it (no metric is computed here:
busy % and output tok/s come from ``Snapshot.load``, latencies from the request metrics, all in
simulated device time). The x axis is host wall seconds before now: snapshots are taken on a wall
clock (nvitop draws its history the same way).
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from textual.app import RenderResult
from textual_plotext import PlotextPlot

from sim_backend.planes.snapshot import Snapshot

MAX_WINDOW_S = 900.0


@dataclass(frozen=True)
class Series:
    key: str
    label: str


@dataclass(frozen=True)
class GraphSpec:
    """One graph: its series, title (with units and the time base), shorter forms of the title for a narrow
    graph (longest first), and a fixed y range if any."""

    id: str
    title: str
    series: tuple[Series, ...]
    y_max: float | None = None  # fixed top of the scale (percentages); None: from the data
    short_titles: tuple[str, ...] = ()
    #: (series key, titles longest first) for when that series was never reported (a llama-server build
    #: without KV figures): the title names only what the graph can draw
    titles_without: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def titles(self) -> tuple[str, ...]:
        """The title, then its shorter forms (the graph shows the longest that fits)."""
        return (self.title, *self.short_titles)

    def titles_for(self, missing: frozenset[str]) -> tuple[str, ...]:
        """The titles when the series of ``missing`` (keys) have no figure at all."""
        return next((t for key, t in self.titles_without if key in missing), self.titles)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.series)


GRAPHS: tuple[GraphSpec, ...] = (
    GraphSpec("kv-busy", "KV use and busy, % (sim)",
              (Series("kv_percent", "KV %"), Series("busy_percent", "busy %")), 100.0,
              ("KV, busy % (sim)", "KV, busy %"),
              (("kv_percent", ("busy, % (sim)", "busy % (sim)", "busy %")),)),
    GraphSpec("tok-s", "output tokens/s (sim)", (Series("tok_s", "tok/s"),), None,
              ("output tok/s (sim)", "tok/s (sim)", "tok/s")),
    # plotext drops a title wider than the plot: at 120x36 this graph had none (its y labels are the widest)
    GraphSpec("latency", "TTFT / TPOT P95, ms (sim)", (Series("ttft_p95", "TTFT"), Series("tpot_p95", "TPOT")), None,
              ("TTFT/TPOT P95 ms (sim)", "TTFT/TPOT P95 ms", "P95 ms")),
    GraphSpec("queue", "queue depth, requests", (Series("queued", "queued"), Series("running", "running")), None,
              ("queue, requests", "queue")),
)


def figures(snap: Snapshot) -> dict[str, float | None]:
    """The plotted figures of one snapshot (None: not reported, or no sample yet)."""
    kv = snap.kv
    if kv is None:  # a llama-server: KV % only where its build reports the ratio
        ratio = snap.server.kv_cache_usage_ratio if snap.server is not None else None
        kv_percent = None if ratio is None else 100.0 * ratio
    else:
        cap = kv.capacity_tokens
        kv_percent = 100.0 * kv.used_tokens / cap if cap else None
    r = snap.requests
    return {"kv_percent": kv_percent, "busy_percent": snap.load.busy_percent, "tok_s": snap.load.output_tokens_per_s,
            "ttft_p95": r.latency_ms.ttft.p95, "tpot_p95": r.latency_ms.tpot.p95,
            "queued": float(r.counters.queued), "running": float(r.counters.running)}


class History:
    """Figures per snapshot, kept MAX_WINDOW_S of host wall time."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, dict[str, float | None]]] = deque()

    def record(self, snap: Snapshot, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.samples.append((now, figures(snap)))
        while self.samples and now - self.samples[0][0] > MAX_WINDOW_S:
            self.samples.popleft()

    def unchanged_since(self, t: float, keys: tuple[str, ...]) -> bool:
        """No figure of ``keys`` changed in the samples recorded after host time ``t`` (monotonic s)."""
        prev = None
        for ts, f in reversed(self.samples):
            cur = tuple(f.get(k) for k in keys)
            if prev is not None and cur != prev:
                return False
            prev = cur
            if ts <= t:
                return True
        return True

    def series(self, key: str, window_s: float, now: float | None = None,
               max_points: int = 400) -> tuple[list[float], list[float]]:
        """(seconds before now, values) of ``key`` within the window, at most ``max_points`` (evenly thinned)."""
        now = time.monotonic() if now is None else now
        pts = [(t - now, f[key]) for t, f in self.samples if now - t <= window_s and f.get(key) is not None]
        if len(pts) > max_points:
            step = len(pts) / max_points
            pts = [pts[int(i * step)] for i in range(max_points)] + [pts[-1]]
        return [p[0] for p in pts], [float(p[1]) for p in pts if p[1] is not None]


#: window (s) -> tick step (s): round minutes past one minute
TICK_STEP_S = {60: 15, 300: 60, 900: 180}


def _tick_label(s: float) -> str:
    s = abs(s)
    return "now" if s == 0 else f"-{s / 60:g}m" if s % 60 == 0 else f"-{s:g}s"


#: tick steps (s) the time axis may use, and the y scale's step mantissas
X_STEPS_S = (15, 30, 60, 120, 150, 180, 300, 450, 900)
Y_STEPS = (1.0, 2.0, 2.5, 5.0)
#: columns a time label needs with its gap ("-15m" and a space or two)
X_LABEL_COLS = 6


def x_ticks(window_s: float, width: int) -> list[float]:
    """Ticks of the time axis (s before now, ending at 0 = "now"): round steps, as many as fit ``width``
    columns with a label each (plotext drops the labels that collide: "-2m" went missing at 20 columns)."""
    room = max(2, (max(0, width - 8)) // X_LABEL_COLS + 1)  # less the y labels
    preferred = TICK_STEP_S.get(int(window_s), window_s / 4)
    # a step that divides the window first (the left edge gets its label), then any that fits
    order = [st for st in X_STEPS_S if window_s % st == 0] + [st for st in X_STEPS_S if window_s % st]
    step = next((st for st in order if st >= preferred and window_s / st + 1 <= room),
                next((st for st in order if window_s / st + 1 <= room), window_s))
    n = int(window_s // step)
    return [-n * step + i * step for i in range(n + 1)]


def y_ticks(peak: float, n: int = 4) -> list[float]:
    """``n + 1`` evenly spaced ticks from 0 to a round top at or above ``peak`` (steps of 1, 2, 2.5 or 5 x 10^k):
    100 gives 0 / 25 / 50 / 75 / 100 (plotext's own were 100.0 / 83.3 / 50.0 / 33.3 / 0.0)."""
    peak = max(peak, 1e-9)
    raw = peak / n
    k = math.floor(math.log10(raw))
    step = next(m * 10 ** k for m in (*Y_STEPS, 10.0) if m * 10 ** k >= raw - 1e-12)
    if peak <= 1.0 and step < 0.25:
        step = 0.25  # an empty graph reads 0..1
    return [round(i * step, 10) for i in range(n + 1)]


class HistoryGraph(PlotextPlot):
    """A braille line graph of one ``GraphSpec`` with its y scale, a time axis and a legend."""

    def __init__(self, spec: GraphSpec, **kw: Any) -> None:
        super().__init__(**kw)
        self.spec = spec
        #: replaces "(sim)" in the title when the figures are not simulated (a llama-server: wall clocks)
        self.clock_label: str | None = None
        self.drawn_at = 0.0
        self._built: tuple[tuple[int, int], RenderResult] | None = None  # (size, renderable) of the last build
        self._window_s: float | None = None  # the window of the last draw (host wall s)
        self._missing: frozenset[str] = frozenset()  # series never reported in the history (keys)

    def titles(self) -> tuple[str, ...]:
        """The spec's titles, longest first (those naming only the series reported), with the clock label in
        place of "(sim)" when one is set."""
        titles = self.spec.titles_for(self._missing)
        if not self.clock_label:
            return titles
        return tuple(t.replace("(sim)", self.clock_label) for t in titles)

    def render(self) -> RenderResult:
        """The plot, built once per ``draw`` and size: a repaint (a relayout, a scroll) reuses it. The title is
        the longest of ``titles()`` that plotext draws at this size (it drops a title wider than the plot)."""
        size = (self.size.width, self.size.height)
        if self._built is None or self._built[0] != size:
            if self._window_s is not None:  # the time labels that fit the new width
                ticks = x_ticks(self._window_s, self.size.width)
                self.plt.xticks(ticks, [_tick_label(t) for t in ticks])
            built: RenderResult | None = None
            for title in self.titles():
                self.plt.title(title)
                built = super().render()
                # a rich Text (textual-plotext: Text.from_ansi); the title is its top line
                if title in getattr(built, "plain", title).split("\n", 1)[0]:
                    break
            if built is None:  # a spec with no title: the plot untitled
                built = super().render()
            self._built = (size, built)
        return self._built[1]

    def draw(self, history: History, window_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.drawn_at = now
        plt = self.plt
        plt.clear_figure()
        self._missing = frozenset(s.key for s in self.spec.series
                                  if history.samples and not any(f.get(s.key) is not None for _, f in history.samples))
        plt.title(self.titles()[0])  # render() picks the form that fits
        top = self.spec.y_max
        peak = 0.0
        for s in self.spec.series:
            xs, ys = history.series(s.key, window_s, now)
            if xs:
                plt.plot(xs, ys, marker="braille", label=s.label)
                peak = max(peak, max(ys))
        if not any(history.series(s.key, window_s, now)[0] for s in self.spec.series):
            plt.text("no data yet", x=-window_s / 2, y=0.5)
            peak = 1.0
        plt.xlim(-window_s, 0)
        self._window_s = window_s
        ticks = x_ticks(window_s, self.size.width)
        plt.xticks(ticks, [_tick_label(t) for t in ticks])
        # the scale starts at 0 (a bar or line never reads against its own minimum), evenly ticked
        yt = y_ticks(top if top is not None else peak * 1.1)
        plt.ylim(0, yt[-1])
        plt.yticks(yt, [f"{v:g}" for v in yt])
        self._built = None
        self.refresh()
