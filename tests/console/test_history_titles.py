"""A history graph's title names only the series it can draw (a llama-server build without KV figures)."""

from __future__ import annotations

from calconsole.widgets.history import GRAPHS, History, HistoryGraph


def _graph(key: str) -> HistoryGraph:
    return HistoryGraph(next(g for g in GRAPHS if g.id == key))


def _history(kv: float | None) -> History:
    h = History()
    for t in range(3):
        h.samples.append((float(t), {"kv_percent": kv, "busy_percent": 10.0 * t, "tok_s": None, "ttft_p95": None,
                                     "tpot_p95": None, "queued": 0.0, "running": 0.0}))
    return h


def test_kv_graph_without_kv_figures_is_titled_busy_only() -> None:
    g = _graph("kv-busy")
    g.clock_label = "(wall)"
    g.draw(_history(None), 300.0, now=3.0)
    assert g.titles()[0] == "busy, % (wall)" and all("KV" not in t for t in g.titles())


def test_kv_graph_with_kv_figures_or_no_sample_yet_keeps_its_title() -> None:
    g = _graph("kv-busy")
    g.draw(_history(12.5), 300.0, now=3.0)
    assert g.titles()[0] == "KV use and busy, % (sim)"
    g.draw(History(), 300.0, now=3.0)  # nothing recorded yet: nothing is known missing
    assert g.titles()[0] == "KV use and busy, % (sim)"
