"""Rendering of a snapshot from a server that is not this simulator (``snap.server``: a llama-server).

Such a snapshot has no device, jobs, KV, steps, memory, stages, host or findings (None): every such
section is drawn as ``absent(...)`` — "not reported by llama-server" — never as zeros. The device
table's place shows the server instead (``server_table``), the thresholds line the server's gauges
and the console's client-measured latencies (``server_header``). Every time says its clock: the
server's counters are its wall time, the request latencies the console's wall time as client.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from sim_backend.planes.snapshot import ServerInfo, Snapshot

#: what each absent section would have shown, for the line that says it is not reported
SECTION_WHAT = {
    "device": "device table (chiplets, health, mode, faults)", "jobs": "device job counters",
    "kv": "KV cache cells and waits", "stages": "step stages", "memory": "device memory map",
    "host": "server host CPU / RSS", "findings": "bundle findings", "per-layer": "per-layer step timings",
    "batches": "batched decode steps",
}


def kind_of(snap: Snapshot) -> str | None:
    """The server kind of a snapshot (``"llama-server"``), or None for the simulator's own."""
    return snap.server.kind if snap.server is not None else None


def absent(section: str, kind: str) -> Text:
    """The one line drawn where a section the server does not report would be."""
    what = SECTION_WHAT.get(section, section)
    return Text.assemble((f"{section}: ", "bold"), (f"not reported by {kind}", "italic grey62"),
                         (f" ({what} exist on the simulated device only)", "grey50"))


def _num(v: Any, fmt: str = "{}") -> str:
    return "not reported" if v is None else fmt.format(v)


def health_style(health: str) -> str:
    return {"ok": "bold green", "loading": "bold yellow"}.get(health, "bold red")


def _server(snap: Snapshot) -> ServerInfo:
    if snap.server is None:
        raise ValueError("not a server snapshot (snap.server is None)")
    return snap.server


def server_table(snap: Snapshot, compact: bool = False, width: int | None = None) -> Group:
    """The server row (kind, build, model, health, slots busy, context) in place of the device table.

    ``width`` (cells, the pane's; None: unknown, the row form): when the row form's headings and values do
    not fit it side by side, the same fields are stacked, one "heading value" row each, every heading whole
    (at 80x24 the row form read ``slo… lla… mod… hea… n_c…``); a value longer than its row wraps."""
    s = _server(snap)
    busy = sum(1 for sl in snap.slots if sl.state != "idle")
    load = snap.load
    fields: list[tuple[str, Text | str]] = [
        (s.kind, s.build), ("model", s.model), ("health", Text(s.health, style=health_style(s.health))),
        ("slots busy", f"{busy}/{s.total_slots}" if s.slots_enabled else "not reported (--slots off)"),
        ("n_ctx/slot", str(s.n_ctx)), ("busy %", "-" if load.busy_percent is None else f"{load.busy_percent:.0f}")]
    row_width = sum(max(len(h), Text(v).cell_len if isinstance(v, str) else v.cell_len) for h, v in fields)
    row_width += 2 * len(fields)  # padding (0, 1): a cell each side of every column
    t = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
    if width is None or row_width <= width:
        for heading, _ in fields:
            t.add_column(heading)
        t.add_row(*(v for _, v in fields))
    else:
        t.show_header = False
        t.add_column(style="bold", no_wrap=True)
        t.add_column(overflow="fold")
        for heading, value in fields:
            t.add_row(heading, value)
    lines: list[Any] = [t]
    if s.health_detail:
        lines.append(Text(f"health: {s.health_detail}", style="yellow"))
    if not compact:
        lines.append(absent("device", s.kind))
        lines.append(Text(f"busy % and tok/s: {load.clock} (counter growth between polls); "
                          f"poll {_num(s.poll_wall_ms, '{:.1f}')} ms wall", style="grey50"))
    return Group(*lines)


def server_header(snap: Snapshot, compact: bool = False) -> Text:
    """The thresholds line for a server: its gauges and counters, and this console's client latencies."""
    s = _server(snap)
    lat = snap.requests.latency_ms
    t = Text()
    if not s.metrics_enabled:
        t.append("metrics: not reported (server runs without --metrics) · ", style="yellow")
    else:
        t.append(f"processing {_num(s.requests_processing)} · deferred {_num(s.requests_deferred)} · ")
        kv = s.kv_cache_usage_ratio
        t.append("KV " + (f"{100 * kv:.0f}%" if kv is not None else "not reported by this build") + " · ")
        tps = snap.load.output_tokens_per_s
        t.append(f"{tps:.1f} tok/s" if tps is not None else "tok/s -")
        t.append(" (server wall) · ")
        if not compact:
            t.append(f"tokens prompt {_num(s.prompt_tokens_total)} predicted {_num(s.tokens_predicted_total)}"
                     " (server total) · ")
    t.append(f"TTFT P95 {_ms(lat.ttft.p95)} · TPOT P95 {_ms(lat.tpot.p95)}")
    t.append(" (client wall, this console's requests)", style="grey62")
    return t


def subtitle(snap: Snapshot) -> str:
    """The observation pane's border subtitle for a server: its kind and health."""
    s = _server(snap)
    return f"{s.kind} · health {s.health}"


def topbar(snap: Snapshot, url: str | None = None) -> Text:
    """The header after "calconsole ": ``llama-server b… · model … · URL · health … · slots …``."""
    bar = Text()
    for i, (part, style, _) in enumerate(topbar_parts(snap, url)):
        if i:
            bar.append(" · ")
        bar.append_text(part if isinstance(part, Text) else Text(part, style=style))
    return bar


def topbar_parts(snap: Snapshot, url: str | None = None, single: bool = False) -> list[tuple[Text | str, str, int]]:
    """The header's figures as (text, style, keep): a narrow header drops the lowest keep first, each figure
    whole (``CalConsoleApp._fit_topbar``); what it drops is in the observation pane's server table. ``single``:
    the status header over one pane, which keeps KV, the queue (llama-server's deferred requests) and the
    running requests."""
    s = _server(snap)
    busy = [sl for sl in snap.slots if sl.state != "idle"]
    parts: list[tuple[Text | str, str, int]] = [(f"{s.kind} {s.build}", "bold", 10),
                                                (Text.assemble("health ", (s.health, health_style(s.health))), "", 10)]
    slots = f"slots {len(busy)}/{s.total_slots} busy" if s.slots_enabled else "slots not reported"
    parts.append((slots, "", 8 if single else 5))  # over one pane "run" names the busy slots' requests
    if single:
        kv = f"KV {s.kv_cache_tokens} tok" if s.kv_cache_tokens is not None else (
            f"KV {100 * s.kv_cache_usage_ratio:.0f}%" if s.kv_cache_usage_ratio is not None else "KV -")
        ids = [f"#{sl.request_id}" for sl in busy if sl.request_id is not None]
        parts += [(kv, "", 9), (f"queue {_num(s.requests_deferred)}", "", 9),
                  ("run " + (" ".join(ids[:2]) + (f" +{len(ids) - 2}" if len(ids) > 2 else "") if ids else "-"), "", 9)]
    if url:
        parts.append((f"attached to {url}", "bold cyan", 7))
    parts.append((f"model {s.model}", "", 6))
    parts.append((f"requests done here {snap.requests.counters.finished}", "", 3))
    return parts


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


__all__ = ["SECTION_WHAT", "absent", "kind_of", "server_header", "server_table", "subtitle", "topbar", "topbar_parts"]
