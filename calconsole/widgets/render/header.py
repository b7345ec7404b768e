"""The thresholds line: the figures an operator reads first, each coloured by its threshold."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from sim_backend.planes.snapshot import Snapshot

from .common import bar, fmt_ms, not_reported


def header_line(snap: Snapshot, settings: Any, compact: bool = False) -> Text:
    """KV, queue, TTFT / TPOT P95 against the console SLO, failures, pacing and output rate, each coloured by
    its threshold (``settings.thresholds``). ``compact``: the same figures in about two 36-column lines. TTFT / TPOT
    are simulated device ms and say "sim" (every time figure says sim or wall); pacing is sim s per wall s."""
    d, kv = snap.device, snap.kv
    if d is None or kv is None or snap.jobs is None:  # a server that is not this simulator: widgets/server.py
        return not_reported("device thresholds", snap)
    cap = kv.capacity_tokens
    kv_pct = 100 * kv.used_tokens / cap if cap else 0.0
    t = Text("KV ")
    t.append_text(bar(kv_pct / 100, 8 if compact else 16, warn=settings.thresholds["kv_percent"].warn / 100,
                      crit=settings.thresholds["kv_percent"].crit / 100))
    t.append(f" {kv_pct:.1f}%", style=settings.style("kv_percent", kv_pct))
    if not compact:
        t.append(f" {kv.used_tokens}/{cap} tok", style="grey62")
    c, lat = snap.requests.counters, snap.requests.latency_ms
    t.append("  queue " if not compact else " q ")
    t.append(str(c.queued), style=settings.style("queue_depth", c.queued))
    t.append(f" run {c.running}", style="grey62")
    tpot, ttft, failed_req = lat.tpot.p95, lat.ttft.p95, c.failed
    ttft_style = settings.style("ttft_slo_ratio", None if ttft is None else ttft / settings.slo_ttft_ms)
    tpot_style = settings.style("tpot_slo_ratio", None if tpot is None else tpot / settings.slo_tpot_ms)
    jobs_failed = snap.jobs.failed
    ratio = pacing_ratio(snap)
    if compact:
        t.append("\nP95 TTFT ")
        t.append(fmt_ms(ttft, 0), style=ttft_style)
        t.append(" TPOT ")
        t.append(fmt_ms(tpot), style=tpot_style)
        t.append(" ms sim · fail ")  # device time: every figure says sim or wall
        t.append(f"{failed_req}/{jobs_failed}", style=settings.style("failed", failed_req + jobs_failed))
        if ratio is not None and settings.level("pacing_ratio", ratio) != "ok":
            t.append(f" host behind {ratio:.2f}", style=settings.style("pacing_ratio", ratio))
        return t
    t.append("  TTFT p95 ")
    t.append(f"{fmt_ms(ttft, 0)} ms", style=ttft_style)
    t.append(" sim", style="grey62")  # simulated device time, as the graphs and the requests table say
    t.append("  TPOT p95 ")
    t.append(f"{fmt_ms(tpot)} ms", style=tpot_style)
    t.append(" sim", style="grey62")
    t.append(f" (console SLO {settings.slo_tpot_ms:g} ms)", style="grey50")
    t.append("  failed ")
    t.append(f"{failed_req} req / {jobs_failed} steps", style=settings.style("failed", failed_req + jobs_failed))
    if ratio is not None:
        t.append("  pacing ")
        t.append(f"{d.achieved_speed or 0:.2f}/{d.pacing_speed:g} sim s per wall s",
                 style=settings.style("pacing_ratio", ratio))
        if settings.level("pacing_ratio", ratio) != "ok":
            t.append(" host behind real time", style=settings.style("pacing_ratio", ratio))
    tps = snap.load.output_tokens_per_s
    if tps is not None:
        t.append(f"  {tps:.1f} tok/s sim", style="cyan")
    return t


def pacing_ratio(snap: Snapshot) -> float | None:
    """Achieved / asked pacing speed of a paced device (None when pacing is fast or nothing ran paced yet)."""
    d = snap.device
    if d is None or d.achieved_speed is None or d.pacing == "fast" or not d.pacing_speed:
        return None
    return d.achieved_speed / d.pacing_speed
