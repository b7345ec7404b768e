"""Memory map, host process, manifest findings, and the observation pane's section bar."""

from __future__ import annotations

from typing import Any

from rich.text import Text

from sim_backend.planes.snapshot import Snapshot

from .common import fmt_bytes, not_reported, plain_table


def memory_panel(snap: Snapshot) -> Any:
    """Every region of each chip's memory plan: used / reserved / physical bytes (facts.md F4)."""
    mem = snap.memory
    if mem is None:
        return not_reported("memory map", snap)
    if not mem.chips:
        return Text("memory map unavailable (the bundle has no memory plan)", style="grey50")
    t = plain_table("memory map per chip: used / reserved / physical")
    for col, right in (("chip", False), ("region", False), ("kind", False), ("used", True), ("reserved", True),
                       ("physical", True)):
        t.add_column(col, justify="right" if right else "left")
    for chip in mem.chips:
        for reg in chip.regions:
            t.add_row(f"chip{chip.chip}", reg.name, reg.kind, fmt_bytes(reg.used_bytes),
                      fmt_bytes(reg.reserved_bytes), fmt_bytes(reg.physical_bytes))
    return t


def host_panel(snap: Snapshot) -> Text:
    """The process serving the device, measured (host wall): CPU %, RSS, threads, system CPU %."""
    h = snap.host
    if h is None:
        return not_reported("host", snap)
    return Text(f"host (wall)  console process CPU {h.cpu_percent:.0f}%  RSS {fmt_bytes(h.rss_bytes)}  "
                f"threads {h.threads}  system CPU {h.system_cpu_percent:.0f}%", style="grey70")


def findings_panel(snap: Snapshot) -> Any:
    """The bundle manifest's findings (warnings and errors) with the field and the action to take."""
    if snap.findings is None:
        return not_reported("manifest findings", snap)
    if not snap.findings:
        return Text("manifest: no findings", style="green")
    t = plain_table("manifest findings")
    for col in ("sev", "field", "finding", "action"):
        t.add_column(col)
    for f in snap.findings:
        st = {"error": "red", "warning": "yellow"}.get(f.severity, "cyan")
        t.add_row(Text(f.severity, style=st), f.field, f.message, f.action)
    return t


def sections_bar(names: list[str], folded: set[str], selected: str, focus: str | None, compact: bool) -> Text:
    """The observation pane's section bar: each section by name, in order (folded ones as ``▸name``, the
    selected one reversed), then the keys; in focus, the focused one and how to leave."""
    if focus is not None:
        t = Text("focus: ", style="bold")
        t.append(focus, style="reverse bold")
        t.append("  [ ] another · f or esc: all sections" if compact else
                 "  (alone) · [ ] previous / next · f or esc: all sections", style="grey50")
        return t
    t = Text("sections ", style="bold grey70")
    for name in names:
        label = f"▸{name}" if name in folded else name
        style = "grey50" if name in folded else "grey85"
        if name == selected:
            style = "reverse bold"
        t.append(label, style=style)
        t.append(" ")
    t.append(" [ ] select z fold { } move f focus", style="grey50")
    return t
