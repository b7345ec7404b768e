"""Shared pieces of the renderers: byte and ms formats, bars, the borderless table, "not reported"."""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from sim_backend.planes.snapshot import Snapshot

GIB = 2**30
MIB = 2**20


def set_subtitle(widget: Any, text: str) -> None:
    """Set a pane's border subtitle only when it changes (each set redraws the whole pane)."""
    if widget.border_subtitle != text:
        widget.border_subtitle = text


def plain_table(title: str | None = None) -> Table:
    """The observation pane's borderless table (optional dim, left-aligned title)."""
    return Table(box=None, padding=(0, 1), show_edge=False, header_style="bold grey70", title=title,
                 title_style="grey62", title_justify="left")


def fmt_bytes(n: float) -> str:
    """Bytes with a binary unit (B, KiB, MiB, GiB)."""
    if n >= GIB:
        return f"{n / GIB:.3f} GiB"
    if n >= MIB:
        return f"{n / MIB:.3f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def fmt_ms(v: float | None, digits: int = 1) -> str:
    """A figure with ``digits`` decimals, "-" for None (no sample)."""
    return "-" if v is None else f"{v:.{digits}f}"


def fmt_gib(n: int) -> str:
    """Bytes as GiB with one decimal, or whole MiB ("512M") under 0.1 GiB."""
    return f"{n / GIB:.1f}" if n >= GIB / 10 else f"{n / MIB:.0f}M"


def fmt_pct(v: float | None) -> str:
    """A percentage without decimals, "-" for None."""
    return "-" if v is None else f"{v:.0f}%"


def bar(frac: float, width: int = 30, warn: float = 0.8, crit: float = 0.95) -> Text:
    """A ``value / limit`` bar that turns yellow at ``warn`` and red at ``crit``."""
    frac = max(0.0, min(1.0, frac))
    full = int(round(frac * width))
    style = "red" if frac >= crit else ("yellow" if frac >= warn else "green")
    t = Text("█" * full, style=style)
    t.append("░" * (width - full), style="grey37")
    return t


def not_reported(what: str, snap: Snapshot) -> Text:
    """The line a section shows when the observed server does not report it (the field is None)."""
    return Text.assemble((f"{what}: ", "bold"), (f"not reported by {snap.source}", "italic grey62"))
