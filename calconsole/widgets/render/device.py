"""The device: status and mode phrases, the npu-smi style table, the long device panel, decode batches."""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.console import Group
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from sim_backend.planes.snapshot import ChipletInfo, DeviceInfo, MemoryView, Snapshot
from sim_backend.planes.types import NUMERICS_NOT_READY, NUMERICS_OFF, OVER_NUMERIC_LIMIT

from .common import GIB, MIB, bar, fmt_gib, fmt_pct, not_reported, plain_table

#: chip -> kind (dram | sram) -> (used, reserved, physical) bytes
ChipKinds = dict[str, tuple[int, int, int]]


def mode_text(device: DeviceInfo) -> Text:
    """The maintenance mode word, coloured, with the lease holder when one holds it."""
    style = {"serving": "green", "draining": "yellow", "exclusive": "bold red"}.get(device.mode, "white")
    t = Text(device.mode, style=style)
    if device.lease_holder:
        t.append(f" (lease: {device.lease_holder})", style="red")
    return t


def status_text(device: DeviceInfo, compact: bool = False, brief: bool = False) -> Text:
    """The device status as the operator reads it: armed faults are armed (not a failure), a fault
    that fired stays a fault until acknowledged (maintenance key ``a``) or reset.

    ``compact``: one short phrase per kind (header, maintenance mode line); the observation pane
    gives the count and where the last one hit. ``brief`` (a narrow header): the status and what fired only,
    the faults in effect and armed are in the device table's faults line."""
    style = {"ok": "green", "degraded": "yellow"}.get(device.status, "bold red")
    t = Text(device.status, style=style)
    fired = device.faults_fired
    if fired:
        kinds = ", ".join(dict.fromkeys(f.fault for f in fired))
        t.append(f": {kinds} fired (a acks)" if compact else
                 f": {kinds} fired ({len(fired)} unacknowledged, last {fired[-1].detail}; a acknowledges)",
                 style="bold red")
    if brief:
        return t
    if device.faults_in_effect:
        t.append(f" ({', '.join(device.faults_in_effect)})", style="yellow")
    if device.faults_armed:
        t.append(f" · armed: {', '.join(device.faults_armed)}", style="yellow")
    return t


def numerics_text(device: DeviceInfo) -> str:
    """What the tokens are made from right now, honest while a long prompt runs timing-only."""
    if not device.numerics:
        return "numerics off (timing-only)"
    if device.numerics_broken:
        return "numerics worker down: requests fail or run timing-only until a reset or reload"
    if device.numerics_starting:
        return "numerics starting (kernels loading or compiling): requests run timing-only until ready"
    limit = device.numerics_max_prompt
    running = device.timing_only_running
    if running:
        ids = ", ".join(str(i) for i in running)
        return (f"numerics on, but request{'s' if len(running) > 1 else ''} {ids} timing-only "
                f"(> {limit} new prompt tok, or continuing a timing-only turn)")
    why = device.numerics_limit_reason
    return (f"numerics up to {limit} new prompt tokens ({why or 'limit'}); longer prompts timing-only" if limit
            else "numerics on")


def numeric_limit(d: DeviceInfo) -> int:
    """The device's numeric limit as ``timing_only_reason`` takes it: new prompt tokens a request may prefill
    with numerics (``DeviceInfo.numerics_max_prompt``), 0 when the device runs timing-only."""
    return int(d.numerics_max_prompt) if d.numerics else 0


def timing_only_reason(new_tokens: int, cached: int, limit: int | None, *, new_chat_key: str = "",
                       recorded: str = "") -> str:
    """Why a reply ran timing-only (its tokens from the seeded generator, not the model). ``recorded``: the
    reason the engine gave at admission (``Timings.timing_only_reason``), used as it is when there is one;
    else (a server that gives none) inferred from what the reply and the device say: ``new_tokens`` prompt
    tokens it prefilled, ``cached`` reused from a slot's cache, the device's numeric limit ``limit`` (new
    prompt tokens; 0: the device runs timing-only; None: not known). A prefix cached by a timing-only turn
    holds no values, so a later turn that reuses it is timing-only too
    (``sim_backend.serving.admission.choose_slot``) until a new conversation; ``new_chat_key`` names the key
    that starts one, if any. One clause, no trailing period."""
    how = f"({new_chat_key}: a new conversation)" if new_chat_key else "(start a new conversation)"
    if recorded:
        return recorded.replace("(start a new conversation)", how)
    if limit is None:
        return "the device did not compute it"
    if limit <= 0:
        return NUMERICS_OFF
    if new_tokens > limit:
        return OVER_NUMERIC_LIMIT.format(new_tokens=new_tokens, limit=limit)
    if cached > 0:
        return f"it continues a timing-only turn, whose cached prefix holds no values {how}"
    return NUMERICS_NOT_READY


def host_behind(device: DeviceInfo, ratio_ok: float = 0.9) -> float | None:
    """The achieved / asked pacing ratio when the host cannot keep simulated time (below ``ratio_ok``),
    else None; paced runs only. ``achieved_speed`` is simulated s per wall s over the last paced run."""
    ach = device.achieved_speed
    if ach is None or device.pacing == "fast" or not device.pacing_speed:
        return None
    ratio = ach / device.pacing_speed
    return ratio if ratio < ratio_ok else None


def device_panel(snap: Snapshot) -> Any:
    """The long device panel: identity, status, mode, pacing, numerics, one line per chiplet, the d2d link."""
    d = snap.device
    if d is None:
        return not_reported("device", snap)
    head = Text()
    head.append(f"{d.name} ", style="bold")
    head.append(f"[{d.bundle}] ")
    head.append_text(status_text(d))
    head.append("  mode ")
    head.append_text(mode_text(d))
    head.append(f"\nCalRT {d.calrt_version}  fw {d.firmware_commit}  ")
    head.append(f"logits {d.logits_dtype.upper()}", style="bold magenta" if d.logits_dtype != "bf16" else "")
    head.append(f"  pacing {d.pacing}"
                f"{'' if d.pacing == 'fast' else ' at ' + format(d.pacing_speed, 'g') + ' sim s per wall s'}")
    ach = d.achieved_speed
    if ach is not None and d.pacing != "fast":
        behind = host_behind(d) is not None
        head.append(f" (achieved {ach:.2f}{': host behind, streaming slower than sim time' if behind else ''})",
                    style="bold yellow" if behind else "grey62")
    head.append(f"  {numerics_text(d)}  sim clock {(snap.sim_now_ms or 0.0) / 1e3:.3f} s")
    chips = Table.grid(padding=(0, 2))
    for c in d.chiplets:
        st = {"ready": "green", "fault": "red", "cleared": "yellow"}.get(c.state, "white")
        chips.add_row(Text(f"chip{c.index}", style="bold"), Text(c.state, style=st),
                      Text("busy" if c.busy else "idle", style="cyan" if c.busy else "grey50"),
                      Text(f"steps done {c.jobs_done}"),
                      Text(f"ccu_exc {c.ccu_exceptions}", style="red" if c.ccu_exceptions else "grey50"),
                      Text(f"slow {c.slow_factor:g} times", style="red") if c.slow_factor != 1 else Text(""))
    link_err = d.d2d_link_errors
    link = Text(f"d2d link chip0<->chip1: {link_err} error{'s' if link_err != 1 else ''} since power-on",
                style="red" if link_err else "grey50")
    return Group(head, chips, link)


def chip_memory(memory: MemoryView | None) -> list[ChipKinds]:
    """Per chip, per kind (dram, sram): (used, reserved, physical) bytes summed over its regions."""
    out: list[ChipKinds] = []
    for chip in memory.chips if memory is not None else ():
        kinds: ChipKinds = {}
        for reg in chip.regions:
            u, r, p = kinds.get(reg.kind, (0, 0, 0))
            kinds[reg.kind] = (u + reg.used_bytes, r + reg.reserved_bytes, max(p, reg.physical_bytes))
        out.append(kinds)
    return out


def mem_bar(used: int, reserved: int, physical: int, width: int, warn: float = 0.8, crit: float = 0.95) -> Text:
    """``used`` █ then reserved-but-unused ▒ then free ░ over ``physical``; yellow/red by reserved share."""
    if physical <= 0:
        return Text("-" * width, style="grey37")
    fu = max(0.0, min(1.0, used / physical))
    fr = max(fu, min(1.0, reserved / physical))
    nu, nr = int(round(fu * width)), int(round(fr * width))
    style = "red" if fr >= crit else ("yellow" if fr >= warn else "green")
    t = Text("█" * nu, style=style)
    t.append("▒" * (nr - nu), style=style)
    t.append("░" * (width - nr), style="grey37")
    return t


def _mem_cell(m: tuple[int, int, int], level: int, sram: bool = False) -> Text:
    """A memory cell at a detail level (see ``device_table``): bar + used/reserved/physical (0, 1),
    bar + used/physical (2, 3), a short bar + the used share in % (4 and narrower)."""
    used, reserved, physical = m
    if level >= PCT_LEVEL:  # the used share, as the full table's first figure (the bar shows reserved as ▒)
        t = mem_bar(used, reserved, physical, 3)
        t.append(f"{100 * used / physical:3.0f}%" if physical else "  -", style="grey70")
        return t
    t = mem_bar(used, reserved, physical, 4 if sram else 6)
    if sram:
        figs = (f"{used / MIB:.1f}/{reserved / MIB:.1f}/{physical / MIB:.0f}M" if level < 2 else
                f"{used / MIB:.1f}/{physical / MIB:.0f}M")
    else:
        figs = (f"{fmt_gib(used)}/{fmt_gib(reserved)}/{physical / GIB:.0f}G" if level < 2 else
                f"{fmt_gib(used)}/{physical / GIB:.0f}G")
    t.append(" " + figs, style="grey70")
    return t


def _health(d: DeviceInfo, compact: bool = False) -> Text:
    word = d.status.split(":")[0]
    if compact:
        word = {"degraded": "degr", "memory cleared": "clrd", "fault": "FLT"}.get(word, word[:4])
    return Text(word, style={"ok": "green", "degraded": "yellow"}.get(d.status, "bold red"))


def _chip_health(c: ChipletInfo, d: DeviceInfo, compact: bool) -> Text:
    health = Text("ok", style="green")
    # red while a fault that fired is not acknowledged; the cumulative exception count stays in the
    # chiplet line (ccu_exc N) after that, as the device status returns to ok
    if c.state == "fault" or (c.ccu_exceptions and d.faults_fired):
        health = Text(f"ccu {c.ccu_exceptions}" if c.ccu_exceptions else "fault", style="bold red")
    elif c.slow_factor != 1:
        health = Text(f"slow x{c.slow_factor:g}", style="yellow")
    if compact:
        health.truncate(4)
    return health


#: what each narrower level of the device table leaves out, in the order it is left out (said under the table)
DEVICE_LEVELS = (
    "",
    "steps column dropped (the device steps section has it)",
    "steps dropped, reserved bytes shown as ▒ only",
    # short names before the figures go: at 120x36 the table jumped from level 2 (58 columns with the scripted
    # state) to the % rows (37) in a 56-column pane, its figures gone while a third of the width was free
    "short names, steps dropped, reserved bytes shown as ▒ only",
    "compact rows: DRAM/SRAM % used",
    "compact rows, SRAM dropped (the memory section has it)",
    "compact rows, SRAM and state dropped (the mode is in the border)",
)
#: the first level with short names ("board", "serve"), the first with % cells, without SRAM, without state
SHORT_LEVEL, PCT_LEVEL, NO_SRAM_LEVEL, NO_STATE_LEVEL = 3, 4, 5, 6


def device_table(snap: Snapshot, compact: bool = False, settings: object = None, width: int | None = None) -> Any:
    """npu-smi style: the board row, then one row per chiplet (health, state, busy % of simulated time
    over the last interval, device steps done, DRAM and SRAM used / reserved / physical as bars), then
    the faults.

    ``width`` (columns the table may take; None: no limit): the widest level that fits is drawn, never a
    cell cut to "…". Narrower, in this order: the steps column goes, then the reserved figures (the ▒ part
    of the bar still shows them), then the names get short ("board", "serve"), then the compact rows (bars
    with the used share in %), then SRAM, then the state column (``DEVICE_LEVELS`` names each; the faults
    line says which one is drawn). ``compact`` (a pane ~40 columns wide) starts at the compact rows."""
    d = snap.device
    if d is None or snap.jobs is None:
        return not_reported("device", snap)
    first = PCT_LEVEL if compact else 0
    for level in range(first, len(DEVICE_LEVELS)):
        table = _device_rows(snap, level)
        if width is None or _table_width(table) <= width:
            break
    return Group(table, _faults_line(d, level))


def _table_width(table: Table) -> int:
    """Cells the one-line, unwrapped ``table`` of :func:`_device_rows` takes (box none, right padding 1, no
    edge padding): the widest cell of each column plus one between columns. Counted from the cells' text,
    as Rich's measure would give (a test holds the two equal), in ~1/50 of its time: the table is tried at
    up to seven levels twice a second on the UI thread, and Rich's measure cost ~2 ms a level."""
    if not all(c.no_wrap for c in table.columns) or any(
            not isinstance(cell, (str, Text)) for c in table.columns for cell in c._cells):
        return _rich_width(table)
    widths = [max([_cell_width(c.header)] + [_cell_width(cell) for cell in c._cells]) for c in table.columns]
    return sum(widths) + max(0, len(widths) - 1)


def _cell_width(cell: Any) -> int:
    text = cell if isinstance(cell, Text) else Text.from_markup(cell) if isinstance(cell, str) else None
    if text is None:
        return 0
    return max(cell_len(line) for line in text.plain.split("\n"))


def _rich_width(table: Table) -> int:
    """Rich's own measure of ``table`` (cells): the reference :func:`_table_width` counts without."""
    from rich.console import Console

    console = Console(width=1000)
    return Measurement.get(console, console.options, table).maximum


def _device_rows(snap: Snapshot, level: int) -> Table:
    d, jobs_counts = snap.device, snap.jobs
    assert d is not None and jobs_counts is not None
    compact = level >= PCT_LEVEL  # the % cells
    names = level >= SHORT_LEVEL  # "board", the mode in 5 cells
    mems = chip_memory(snap.memory)
    t = Table(box=None, padding=(0, 1, 0, 0), show_edge=False, header_style="bold grey70", pad_edge=False)
    t.add_column("dev", no_wrap=True)
    short = level >= 2  # health in 4 cells ("slow", "ccu 1", "FLT")
    t.add_column("hlth" if short else "health", no_wrap=True)
    if level < NO_STATE_LEVEL:
        t.add_column("state", no_wrap=True)
    t.add_column("busy", justify="right", no_wrap=True)
    if level == 0:
        t.add_column("steps", justify="right", no_wrap=True)
    t.add_column("DRAM" if compact else "DRAM used/rsv/phys" if level < 2 else "DRAM used/phys", no_wrap=True)
    if level < NO_SRAM_LEVEL:
        t.add_column("SRAM" if compact else "SRAM used/rsv/phys" if level < 2 else "SRAM used/phys", no_wrap=True)

    def total(kind: str) -> tuple[int, int, int]:
        return (sum(m.get(kind, (0, 0, 0))[0] for m in mems), sum(m.get(kind, (0, 0, 0))[1] for m in mems),
                sum(m.get(kind, (0, 0, 0))[2] for m in mems))

    def row(name: Text, health: Text, state: Text, busy: Text, steps: str, m: ChipKinds) -> None:
        cells: list[Any] = [name, health]
        if level < NO_STATE_LEVEL:
            cells.append(state)
        cells.append(busy)
        if level == 0:
            cells.append(steps)
        cells.append(_mem_cell(m.get("dram", (0, 0, 0)), level))
        if level < NO_SRAM_LEVEL:
            cells.append(_mem_cell(m.get("sram", (0, 0, 0)), level, sram=True))
        t.add_row(*cells)

    # the mode word only: the lease holder is in the header line and the pane's border (in the cell
    # "exclusive (lease: root@host)" took the width of busy, jobs and health, shown as "…")
    mode = Text(d.mode, style=mode_text(d).style)
    if names:  # and the mode in 5 cells
        mode = Text({"serving": "serve", "draining": "drain", "exclusive": "excl"}.get(d.mode, "?"),
                    style=mode.style)
    busy = snap.load.busy_percent
    row(Text("board" if names else d.name, style="bold"), _health(d, short), mode,
        Text(fmt_pct(busy), style="bold cyan" if busy else "grey50"), str(jobs_counts.finished),
        {"dram": total("dram"), "sram": total("sram")})
    for c in d.chiplets:
        st = {"ready": "green", "fault": "bold red", "cleared": "yellow"}.get(c.state, "white")
        row(Text(f"{'' if names else ' '}chip{c.index}", style="bold"), _chip_health(c, d, short),
            Text(c.state[:5], style=st),
            Text(fmt_pct(c.busy_percent), style="cyan" if c.busy_percent else "grey50"), str(c.jobs_done),
            mems[c.index] if c.index < len(mems) else {})
    return t


def _faults_line(d: DeviceInfo, level: int) -> Text:
    compact = level >= PCT_LEVEL
    faults = Text("faults ", style="grey62")
    fired = d.faults_fired
    parts: list[tuple[str, str]] = []
    if fired:
        parts.append((f"fired {', '.join(dict.fromkeys(f.fault for f in fired))} (last {fired[-1].detail}; "
                      f"a acknowledges)", "bold red"))
    parts += [(name, "yellow") for name in d.faults_in_effect]
    parts += [(f"armed {name}", "yellow") for name in d.faults_armed]
    if d.d2d_link_errors:
        parts.append((f"d2d link errors {d.d2d_link_errors}", "red"))
    if not parts:
        parts.append(("none", "green"))
    for i, (txt, style) in enumerate(parts):
        faults.append(("" if i == 0 else " · ") + txt, style=style)
    n = d.decode_batch
    if n > 1:  # a what-if variant: said in every display (C3: a calbin the vendor would have to compile)
        faults.append(f"{' · ' if compact else '   '}{d.bundle_status} decode batch {n}", style="bold magenta")
        if not compact:
            faults.append(" (what-if, not the product)", style="magenta")
    elif not compact:
        faults.append("   decode batch 1", style="grey50")
    if d.logits_dtype != "bf16":  # a C3 calbin's D2H dtype (the production calbin returns BF16, facts.md F1)
        faults.append(f" · {d.bundle_status} logits {d.logits_dtype.upper()}", style="bold magenta")
    if level == 0:
        faults.append("   busy: % of sim time executing, last interval · steps: device steps done", style="grey50")
    else:
        faults.append(f" · {DEVICE_LEVELS[level]}", style="grey50")
    return faults


def batches_panel(snap: Snapshot, max_rows: int = 6) -> Any:
    """A batch-N variant's decode steps: its status label, then the newest ``max_rows`` steps, each with
    its occupancy (riders/N, as a bar), which slots rode in it (a strip, one cell per slot) and their
    requests, and when it ended (simulated ms)."""
    d = snap.device
    if d is None:
        return not_reported("batches", snap)
    n = d.decode_batch
    head = Text(f"decode batches · {d.bundle_status} variant: {d.bundle_label or d.bundle}", style="bold magenta")
    head.append(" · a what-if calbin the vendor would have to compile, not the product", style="magenta")
    steps = list(snap.decode_batches)
    if not steps:
        return Group(head, Text(f"no decode step yet: up to {n} decoding chats ride in each step", style="grey50"))
    occ = [s.occupancy for s in steps]
    summary = Text(f"last {len(steps)} decode steps: mean occupancy {sum(occ) / len(occ):.1f}/{n}, "
                   f"max {max(occ)}/{n}", style="grey70")
    n_slots = d.n_slots or 1 + max((max(s.slots, default=0) for s in steps), default=0)
    t = plain_table()
    t.add_column("job", justify="right", no_wrap=True)
    t.add_column("ended ms sim", justify="right", no_wrap=True)
    t.add_column("riders", justify="right", no_wrap=True)
    t.add_column("occupancy", no_wrap=True)
    t.add_column("slot " + "".join(str(i % 10) for i in range(n_slots)), no_wrap=True)
    t.add_column("requests", no_wrap=True, overflow="ellipsis")
    for s in reversed(steps[-max_rows:]):
        strip = Text(" " * len("slot "))
        rode = set(s.slots)
        for i in range(n_slots):
            strip.append("■" if i in rode else "·", style="bold cyan" if i in rode else "grey50")
        t.add_row(str(s.job_id), f"{s.sim_end_ms:.1f}", f"{s.occupancy}/{s.capacity}",
                  bar(s.occupancy / max(1, s.capacity), min(16, s.capacity * 2), warn=2.0, crit=2.0),
                  strip, ", ".join(map(str, s.request_ids)))
    return Group(head, summary, t)
