"""Pure functions turning a snapshot (``Snapshot.to_dict()``) into Rich renderables.

No metric is computed here: every number comes from the snapshot. Units are
in every label: "sim" = simulated device time, "wall" = measured host time.
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

HEAT_WIDTH = 12  # cells of the per-layer heat bar
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
    if n >= GIB:
        return f"{n / GIB:.3f} GiB"
    if n >= MIB:
        return f"{n / MIB:.3f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def fmt_ms(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def bar(frac: float, width: int = 30, warn: float = 0.8, crit: float = 0.95) -> Text:
    """A ``value / limit`` bar that turns yellow at ``warn`` and red at ``crit``."""
    frac = max(0.0, min(1.0, frac))
    full = int(round(frac * width))
    style = "red" if frac >= crit else ("yellow" if frac >= warn else "green")
    t = Text("█" * full, style=style)
    t.append("░" * (width - full), style="grey37")
    return t


def mode_text(device: dict) -> Text:
    mode = device.get("mode", "serving")
    style = {"serving": "green", "draining": "yellow", "exclusive": "bold red"}.get(mode, "white")
    t = Text(mode, style=style)
    if device.get("lease_holder"):
        t.append(f" (lease: {device['lease_holder']})", style="red")
    return t


def status_text(device: dict, compact: bool = False) -> Text:
    """The device status as the operator reads it: armed faults are armed (not a failure), a fault
    that fired stays a fault until acknowledged (maintenance key ``a``) or reset.

    ``compact``: one short phrase per kind (header, maintenance mode line); the observation pane
    gives the count and where the last one hit."""
    status = device["status"]
    style = {"ok": "green", "degraded": "yellow"}.get(status, "bold red")
    t = Text(status, style=style)
    fired = device.get("faults_fired") or ()
    if fired:
        kinds = ", ".join(dict.fromkeys(f["fault"] for f in fired))
        last = fired[-1]["detail"]
        t.append(f": {kinds} fired (a acks)" if compact else
                 f": {kinds} fired ({len(fired)} unacknowledged, last {last}; a acknowledges)", style="bold red")
    in_effect = device.get("faults_in_effect") or ()
    if in_effect:
        t.append(f" ({', '.join(in_effect)})", style="yellow")
    armed = device.get("faults_armed") or ()
    if armed:
        t.append(f" · armed: {', '.join(armed)}", style="yellow")
    return t


def numerics_text(device: dict) -> str:
    """What the tokens are made from right now, honest while a long prompt runs timing-only."""
    if not device["numerics"]:
        return "numerics off (timing-only)"
    limit = device.get("numerics_max_prompt")
    running = device.get("timing_only_running") or ()
    if running:
        ids = ", ".join(str(i) for i in running)
        return (f"numerics on, but request{'s' if len(running) > 1 else ''} {ids} timing-only "
                f"(> {limit} new prompt tok)")
    why = device.get("numerics_limit_reason")
    return (f"numerics up to {limit} new prompt tokens ({why or 'limit'}); longer prompts timing-only" if limit
            else "numerics on")


def device_panel(snap: dict) -> Group:
    d = snap["device"]
    head = Text()
    head.append(f"{d['name']} ", style="bold")
    head.append(f"[{d['bundle']}] ")
    head.append_text(status_text(d))
    head.append("  mode ")
    head.append_text(mode_text(d))
    head.append(f"\nCalRT {d['calrt_version']}  fw {d['firmware_commit']}  pacing {d['pacing']}"
                f"{'' if d['pacing'] == 'fast' else ' x' + format(d['pacing_speed'], 'g')}")
    ach = d.get("achieved_speed")
    if ach is not None and d["pacing"] != "fast":
        behind = ach < 0.9 * d["pacing_speed"]
        head.append(f" (achieved x{ach:.2f}{': host behind, streaming slower than sim time' if behind else ''})",
                    style="bold yellow" if behind else "grey62")
    head.append(f"  {numerics_text(d)}  sim clock {snap['sim_now_ms'] / 1e3:.3f} s")
    chips = Table.grid(padding=(0, 2))
    for c in d["chiplets"]:
        st = {"ready": "green", "fault": "red", "cleared": "yellow"}.get(c["state"], "white")
        chips.add_row(Text(f"chip{c['index']}", style="bold"), Text(c["state"], style=st),
                      Text("busy" if c["busy"] else "idle", style="cyan" if c["busy"] else "grey50"),
                      Text(f"jobs {c['jobs_done']}"),
                      Text(f"ccu_exc {c.get('ccu_exceptions', 0)}",
                           style="red" if c.get("ccu_exceptions") else "grey50"),
                      Text(f"slow x{c['slow_factor']:g}", style="red") if c["slow_factor"] != 1 else Text(""))
    link_err = d.get("d2d_link_errors", 0)
    link = Text(f"d2d link chip0<->chip1: {link_err} error{'s' if link_err != 1 else ''} since power-on",
                style="red" if link_err else "grey50")
    return Group(head, chips, link)


def jobs_panel(snap: dict) -> Text:
    j = snap["jobs"]
    t = Text("jobs  ")
    for k, style in (("pending", "yellow"), ("running", "cyan"), ("finished", "green"), ("failed", "red"),
                     ("left", "white")):
        t.append(f"{k} ", style="grey62")
        t.append(f"{j[k]}  ", style=f"bold {style}")
    t.append("(left = pending + running)  ", style="grey50")
    t.append(f"ccu_exc {j['ccu_exceptions']}  resets {j['resets']}", style="grey62")
    return t


def kv_panel(snap: dict) -> Group:
    kv = snap["kv"]
    used, cap = kv["used_tokens"], kv["capacity_tokens"]
    line = Text("KV    ")
    line.append_text(bar(used / cap if cap else 0.0))
    line.append(f"  {used} / {cap} tokens ({100 * used / cap:.1f}%)", style="bold")
    sub = Text(f"      {fmt_bytes(kv['bytes_used_per_chip'])} of {fmt_bytes(kv['bytes_capacity_per_chip'])} per chip"
               f" · blocks {kv['used_blocks']}/{kv['total_blocks']} x{kv['block_size']}"
               f" · requests waited {kv['waits']}, timed out {kv['timeouts']}", style="grey62")
    seqs = ", ".join(f"seq{s}:{n}" for s, n in kv["per_seq_tokens"].items()) or "no sequences"
    return Group(line, sub, Text(f"      {seqs}", style="grey62"))


def slots_panel(snap: dict) -> Table:
    t = plain_table()
    for col in ("slot", "state", "req", "prompt", "prefilled", "generated", "cached"):
        t.add_column(col, justify="right" if col not in ("state",) else "left")
    for s in snap["slots"]:
        st = {"idle": "grey50", "prefilling": "yellow", "decoding": "cyan"}.get(s["state"], "white")
        t.add_row(str(s["index"]), Text(s["state"], style=st), str(s["request_id"] or "-"), _count(s["prompt_n"]),
                  _count(s["n_prefilled"]), _count(s["predicted_n"]), _count(s["cached_tokens"]))
    return t


def _count(v: int | None) -> str:
    return "-" if v is None else str(v)  # None: the server did not report it (a llama-server slot never used)


def requests_panel(snap: dict, settings=None) -> Group:
    """Counters, latency percentiles, goodput and tokens. Goodput is the engine's, against the engine's SLO
    (the snapshot's); ``settings`` (the console's SLO, which colours the header) is named beside it when the
    two differ, so the pane never shows two SLOs without saying which is which."""
    r = snap["requests"]
    c = r["counters"]
    head = Text("requests  ")
    for k in ("submitted", "finished", "failed", "cancelled", "queued", "running", "rejected"):
        head.append(f"{k} ", style="grey62")
        head.append(f"{c[k]}  ", style="bold")
    if not r["balanced"]:
        head.append("UNBALANCED", style="bold red")
    # which requests give samples (metrics.SAMPLED_FROM): a reply stopped after its first token counts in TTFT
    # the note is a line of its own: as the narrow table's title it wrapped into three lines of ~40 columns
    sampled = Text("TTFT, ITL: every request with a token (stopped or failed too) · TPOT, E2E: finished only",
                   style="grey62")
    t = plain_table()
    client = bool(snap.get("server"))  # a llama-server: the latencies are this console's, measured as client
    if client:
        sampled = Text.assemble(sampled, Text(f"\n{r.get('scope', '')}; {r.get('clock', '')}", style="grey62"))
    t.add_column("client wall ms" if client else "sim ms")
    for q in ("p50", "p95", "p99", "n"):
        t.add_column(q, justify="right")
    for k in ("ttft", "tpot", "itl", "e2e", "queue"):
        lat = r["latency_ms"][k]
        t.add_row(k.upper(), fmt_ms(lat["p50"]), fmt_ms(lat["p95"]), fmt_ms(lat["p99"]), str(lat["n"]))
    g = r["goodput"]
    if client:
        tok = r["tokens"]
        return Group(head, sampled, t, Text(f"tokens of these requests: prompt {tok['prompt'] + tok['cached']} "
                                            f"(cached {tok['cached']}) predicted {tok['predicted']}", style="grey70"))
    slo = g["slo"]
    slo_s = ", ".join(f"{k.removesuffix('_ms').upper()} <= {v:g}" for k, v in slo.items() if v is not None)
    n = g["good_requests"]
    rate = (f", {g['tokens_per_s']:.1f} tok/s over the sim time since the first request (idle included)"
            if g["tokens_per_s"] is not None else "")
    console = None if settings is None else {"ttft_ms": settings.slo_ttft_ms, "tpot_ms": settings.slo_tpot_ms,
                                             "e2el_ms": None}
    same = console is not None and all(slo.get(k) == v for k, v in console.items())
    if same:  # the console built this engine with its own SLO: one SLO, named once
        gp = Text(f"goodput against the console SLO ({slo_s} ms sim, settings slo): {n} request"
                  f"{'s' if n != 1 else ''} met it" + rate, style="grey70")
    elif slo_s:
        gp = Text(f"goodput against the engine's SLO ({slo_s} ms sim): {n} request{'s' if n != 1 else ''} "
                  f"met it" + rate, style="grey70")
    else:  # without an SLO every finished request counts: this is plain throughput
        gp = Text(f"goodput: the engine checks no SLO (--slo), so every finished request counts: {n}" + rate,
                  style="grey70")
    if console is not None and not same:
        gp.append(f"\nheader colours: console SLO TTFT {settings.slo_ttft_ms:g} / TPOT {settings.slo_tpot_ms:g} ms "
                  f"(settings slo)", style="grey62")
    tok = r["tokens"]
    # the counters are llama.cpp's: "prompt" counts processed tokens (the reused prefix excluded)
    toks = Text(f"tokens prompt {tok['prompt'] + tok['cached']} (processed {tok['prompt']} + cached {tok['cached']})"
                f" predicted {tok['predicted']}", style="grey70")
    return Group(head, sampled, t, gp, toks)


def stages_panel(snap: dict) -> Table:
    t = plain_table("last step stages (device: sim ms · host: measured ms, CPU time; kv_wait: wall)")
    cols = ("kind", "h2d", "infer", "d2h", "kv_wait", "sampling", "detok", "framework")
    for col in cols:
        t.add_column(col, justify="right" if col != "kind" else "left")
    for kind, s in snap["stages"].items():
        src = s.get("source", "request")
        label = kind if src == "request" else f"{kind} ({src})"  # a maintenance step, not a served request
        t.add_row(label, fmt_ms(s["h2d_ms"], 3), fmt_ms(s["infer_ms"], 2), fmt_ms(s["d2h_ms"], 3),
                  fmt_ms(s["kv_wait_ms"], 3), fmt_ms(s["sampling_ms"], 3), fmt_ms(s["detokenize_ms"], 3),
                  fmt_ms(s["framework_ms"], 3))
    return t


def layers_uniform(step: dict) -> bool:
    """Every layer of the step costs the same (within 1%)."""
    per_layer = [max(layer["chip_us"]) for layer in step.get("layers", ())]
    return bool(per_layer) and max(per_layer) - min(per_layer) <= 0.01 * max(per_layer)


def layers_panel(step: dict, max_rows: int | None = None, capacity: int = 1) -> Any:
    """48-row per-layer table: chip0 / chip1 simulated µs, a heat bar and the slowest category.

    ``capacity``: the bundle's decode batch; a batched step (``batch_seq_ids``) of a batch-N bundle is
    titled as one: its rows and seqs, its times the whole step's.

    The heat bar spans the step's fastest..slowest layer; when every layer
    costs the same (a decode touches 8 experts in every layer) it says so
    instead of drawing 48 identical full bars.
    """
    if not step.get("layers"):
        return Text("no step yet: send a chat message to see per-layer timings", style="grey50")
    layers = step["layers"]
    per_layer = [max(layer["chip_us"]) for layer in layers]
    lo, hi = min(per_layer), max(per_layer)
    uniform = layers_uniform(step)
    riders = step.get("batch_seq_ids") or ()
    what = (f"batched {step['kind']}: {len(riders)}/{capacity} rows, 1 tok each" if capacity > 1 and riders else
            f"{step['kind']}: {step['n_tokens']} tok @ ctx {step['past_len']}")
    title = (f"last {what} · "
             f"{step['sim_us'] / 1e3:.2f} ms sim (h2d {step['h2d_us'] / 1e3:.3f} / "
             f"infer {step['infer_us'] / 1e3:.2f} / "
             f"d2h {step['d2h_us'] / 1e3:.3f} ms) · {step['compute_wall_ms']:.1f} ms wall to compute"
             + (" · all layers equal" if uniform else " · heat: fastest..slowest layer"))
    # title as its own line: a Table title wraps at the (narrow) table width. Narrow headers and a
    # fixed-width heat bar: the category column fits 120 columns (a long header widened "heat" to 29)
    t = plain_table()
    # min widths: in a narrow pane the long op list of the head row must shrink, not "embed" or a figure
    t.add_column("L", justify="right", no_wrap=True, min_width=5)
    n_chips = len(layers[0]["chip_us"])
    for c in range(n_chips):
        t.add_column(f"chip{c} µs", justify="right", no_wrap=True, min_width=len(f"chip{c} µs"))
    t.add_column("heat", width=HEAT_WIDTH if not uniform else None, no_wrap=True, min_width=9)
    # wrappable (the column rich shrinks: the head row lists 4-5 ops), never narrower than its header
    t.add_column("slowest category", overflow="ellipsis", min_width=len("slowest category"))
    outside = {o["part"]: o for o in step.get("outside") or ()}
    last = len(layers) - 1

    def outside_row(part: str, where: str) -> None:
        o = outside.get(part)
        if o is None:
            return
        # its ops in execution order, the costliest in bold (the LM head; in "embed", chip0's embedding
        # is what makes chip0's figure larger than chip1's)
        ops = Text(style="cyan", overflow="ellipsis", no_wrap=True)
        for i, name in enumerate(o["ops"]):
            ops.append((", " if i else "") + name, style="bold cyan" if name == o["slowest_op"] else "cyan")
        t.add_row(Text(part, style="cyan"), *[f"{u:.1f}" for u in o["chip_us"]], Text(where, style="grey50"), ops)

    outside_row("embed", "before L0")
    if uniform:  # 48 identical rows say less than one
        first = layers[0]
        t.add_row(f"0-{last}", *[f"{u:.1f}" for u in first["chip_us"]], Text("uniform", style="grey50"),
                  Text(first["slowest_category"], style="magenta"))
    else:
        rows = layers if max_rows is None else layers[:max_rows]
        for layer, v in zip(rows, per_layer, strict=False):  # rows may be the first max_rows
            heat = bar((v - lo) / (hi - lo), HEAT_WIDTH, warn=0.7, crit=0.95)
            t.add_row(str(layer["layer"]), *[f"{u:.1f}" for u in layer["chip_us"]], heat,
                      Text(layer["slowest_category"], style="magenta"))
    outside_row("head", f"after L{last}")
    parts: list[Any] = [Text(title, style="grey70"), t]
    foot = step_chips_line(step)
    if foot is not None:
        parts.append(foot)
    ex = experts_line(step)
    if ex is not None:
        parts.append(ex)
    return Group(*parts)


def step_chips_line(step: dict) -> Text | None:
    """Per chip: busy (the table's embed + layer + head rows added up) + wait at syncs + submit = the
    step's infer time (simulated µs). None for a step view without the per-chip figures (an older server)."""
    busy, wait = step.get("chip_busy_us") or (), step.get("chip_wait_us") or ()
    if not busy or len(wait) != len(busy) or step.get("submit_us") is None:
        return None
    sep = " / "
    n = len(step.get("layers") or ())
    return Text(f"per chip: busy {sep.join(f'{b:.1f}' for b in busy)} (embed + {n} layers + head) + wait at syncs "
                f"{sep.join(f'{w:.1f}' for w in wait)} + submit {step['submit_us']:.1f} = infer "
                f"{step['infer_us']:.1f} µs sim", style="grey62")


def experts_line(step: dict) -> Text | None:
    """How the step's MoE weights were priced: the router's per-layer choices or the expectation."""
    priced = step.get("experts_priced") or ()
    rule = step.get("experts_rule")
    if not priced or rule is None:
        return None
    lo, hi, mean = min(priced), max(priced), sum(priced) / len(priced)
    if rule == "expectation":
        return Text(f"experts priced: the expectation, {mean:.1f} per layer in every layer (timing-only: "
                    "no router ran, so no per-layer pattern)", style="grey62")
    spread = f"{mean:.1f} in every layer" if hi - lo < 0.05 else f"{lo:.1f}-{hi:.1f} per layer, mean {mean:.1f}"
    return Text(f"experts priced: the router's choices per layer ({spread}; a prefill's scaled to a trained "
                "router's mean)", style="grey62")


def memory_panel(snap: dict) -> Any:
    mem = snap.get("memory") or {}
    chips = mem.get("chips") or mem.get("per_chip") or []
    if not chips:
        return Text("memory map unavailable", style="grey50")
    t = plain_table("memory map per chip: used / reserved / physical")
    t.add_column("chip")
    t.add_column("region")
    t.add_column("kind")
    t.add_column("used", justify="right")
    t.add_column("reserved", justify="right")
    t.add_column("physical", justify="right")
    for ci, chip in enumerate(chips):
        regions = chip.get("regions", chip) if isinstance(chip, dict) else chip
        for reg in regions:
            t.add_row(f"chip{ci}", reg["name"], reg.get("kind", ""), fmt_bytes(reg["used_bytes"]),
                      fmt_bytes(reg["reserved_bytes"]), fmt_bytes(reg["physical_bytes"]))
    return t


def host_panel(snap: dict) -> Text:
    h = snap["host"]
    return Text(f"host (wall)  console process CPU {h['cpu_percent']:.0f}%  RSS {fmt_bytes(h['rss_bytes'])}  "
                f"threads {h['threads']}  system CPU {h['system_cpu_percent']:.0f}%", style="grey70")


def findings_panel(snap: dict) -> Any:
    if not snap["findings"]:
        return Text("manifest: no findings", style="green")
    t = plain_table("manifest findings")
    t.add_column("sev")
    t.add_column("field")
    t.add_column("finding")
    t.add_column("action")
    for f in snap["findings"]:
        st = {"error": "red", "warning": "yellow"}.get(f["severity"], "cyan")
        t.add_row(Text(f["severity"], style=st), f["field"], f["message"], f["action"])
    return t


# --- npu-smi style device table, thresholds, heatmap ------------------------------------------

LEVEL_STYLE = {"ok": "green", "warn": "bold yellow", "crit": "bold red"}


def chip_memory(snap: dict) -> list[dict[str, tuple[int, int, int]]]:
    """Per chip, per kind (dram, sram): (used, reserved, physical) bytes summed over its regions."""
    out = []
    for chip in (snap.get("memory") or {}).get("chips") or ():
        kinds: dict[str, tuple[int, int, int]] = {}
        for reg in chip["regions"]:
            u, r, p = kinds.get(reg["kind"], (0, 0, 0))
            kinds[reg["kind"]] = (u + reg["used_bytes"], r + reg["reserved_bytes"], max(p, reg["physical_bytes"]))
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


def fmt_gib(n: int) -> str:
    return f"{n / GIB:.1f}" if n >= GIB / 10 else f"{n / MIB:.0f}M"


def fmt_pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}%"


def _health(d: dict, compact: bool = False) -> Text:
    status = d["status"]
    word = status.split(":")[0]
    if compact:
        word = {"degraded": "degr", "memory cleared": "clrd", "fault": "FLT"}.get(word, word[:4])
    return Text(word, style={"ok": "green", "degraded": "yellow"}.get(status, "bold red"))


def device_table(snap: dict, compact: bool = False, settings=None) -> Group:
    """npu-smi style: the board row, then one row per chiplet (health, state, busy % of simulated time
    over the last interval, jobs, DRAM and SRAM used / reserved / physical as bars), then the faults.

    ``compact`` (a pane ~40 columns wide): no jobs column, bars with the reserved share only."""
    d = snap["device"]
    load = snap.get("load") or {}
    mems = chip_memory(snap)
    t = Table(box=None, padding=(0, 1, 0, 0), show_edge=False, header_style="bold grey70", pad_edge=False)
    t.add_column("dev", no_wrap=True)
    t.add_column("hlth" if compact else "health", no_wrap=True)
    t.add_column("state", no_wrap=True)
    t.add_column("busy", justify="right", no_wrap=True)
    if not compact:
        t.add_column("jobs", justify="right", no_wrap=True)
    t.add_column("DRAM" if compact else "DRAM used/rsv/phys", no_wrap=True)
    t.add_column("SRAM" if compact else "SRAM used/rsv/phys", no_wrap=True)
    tot = [sum(m.get("dram", (0, 0, 0))[i] for m in mems) for i in range(3)]
    stot = [sum(m.get("sram", (0, 0, 0))[i] for m in mems) for i in range(3)]
    jobs = [] if compact else [str(snap["jobs"]["finished"])]
    # the mode word only: the lease holder is in the header line and the pane's border (in the cell
    # "exclusive (lease: root@host)" took the width of busy, jobs and health, shown as "…")
    mode = Text(d.get("mode", "serving"), style=mode_text(d).style)
    if compact:  # and the mode in 5 cells
        mode = Text({"serving": "serve", "draining": "drain", "exclusive": "excl"}.get(d.get("mode", ""), "?"),
                    style=mode.style)
    t.add_row(Text("board" if compact else d["name"], style="bold"), _health(d, compact), mode,
              Text(fmt_pct(load.get("busy_percent")), style="bold cyan" if load.get("busy_percent") else "grey50"),
              *jobs, _mem_cell(tot, compact), _mem_cell(stot, compact, sram=True))
    for c in d["chiplets"]:
        st = {"ready": "green", "fault": "bold red", "cleared": "yellow"}.get(c["state"], "white")
        m = mems[c["index"]] if c["index"] < len(mems) else {}
        health = Text("ok", style="green")
        # red while a fault that fired is not acknowledged; the cumulative exception count stays in the
        # chiplet line (ccu_exc N) after that, as the device status returns to ok
        if c["state"] == "fault" or (c.get("ccu_exceptions") and d.get("faults_fired")):
            health = Text(f"ccu {c.get('ccu_exceptions', 0)}" if c.get("ccu_exceptions") else "fault",
                          style="bold red")
        elif c["slow_factor"] != 1:
            health = Text(f"slow x{c['slow_factor']:g}", style="yellow")
        jobs = [] if compact else [str(c["jobs_done"])]
        if compact:
            health.truncate(4)
        t.add_row(Text(f"{'' if compact else ' '}chip{c['index']}", style="bold"), health,
                  Text(c["state"][:5], style=st),
                  Text(fmt_pct(c.get("busy_percent")), style="cyan" if c.get("busy_percent") else "grey50"),
                  *jobs, _mem_cell(m.get("dram", (0, 0, 0)), compact), _mem_cell(m.get("sram", (0, 0, 0)), compact,
                                                                                 sram=True))
    faults = Text("faults ", style="grey62")
    fired = d.get("faults_fired") or ()
    parts: list[tuple[str, str]] = []
    if fired:
        parts.append((f"fired {', '.join(dict.fromkeys(f['fault'] for f in fired))} (last {fired[-1]['detail']}; "
                      f"a acknowledges)", "bold red"))
    parts += [(name, "yellow") for name in d.get("faults_in_effect") or ()]
    parts += [(f"armed {name}", "yellow") for name in d.get("faults_armed") or ()]
    link = d.get("d2d_link_errors", 0)
    if link:
        parts.append((f"d2d link errors {link}", "red"))
    if not parts:
        parts.append(("none", "green"))
    for i, (txt, style) in enumerate(parts):
        faults.append(("" if i == 0 else " · ") + txt, style=style)
    n = int(d.get("decode_batch", 1))
    if n > 1:  # a what-if variant: said in every display (C3: the vendor would have to compile it)
        faults.append(f"{' · ' if compact else '   '}{d.get('bundle_status', 'C3')} decode batch {n}",
                      style="bold magenta")
        if not compact:
            faults.append(" (what-if, not the product)", style="magenta")
    elif not compact:
        faults.append("   decode batch 1", style="grey50")
    if not compact:
        faults.append("   busy: % of sim time executing, last interval", style="grey50")
    return Group(t, faults)


def batches_panel(snap: dict, max_rows: int = 6) -> Group:
    """A batch-N variant's decode steps: its status label, then the newest ``max_rows`` steps, each with
    its occupancy (riders/N, as a bar), which slots rode in it (a strip, one cell per slot) and their
    requests, and when it ended (simulated ms)."""
    d = snap["device"]
    n = int(d.get("decode_batch", 1))
    head = Text(f"decode batches · {d.get('bundle_status', 'C3')} variant: {d.get('bundle_label') or d['bundle']}",
                style="bold magenta")
    head.append(" · a what-if calbin the vendor would have to compile, not the product", style="magenta")
    steps = list(snap.get("decode_batches") or ())
    if not steps:
        return Group(head, Text(f"no decode step yet: up to {n} decoding chats ride in each step", style="grey50"))
    occ = [s["occupancy"] for s in steps]
    summary = Text(f"last {len(steps)} decode steps: mean occupancy {sum(occ) / len(occ):.1f}/{n}, "
                   f"max {max(occ)}/{n}", style="grey70")
    n_slots = int(d.get("n_slots") or 1 + max((max(s["slots"], default=0) for s in steps), default=0))
    t = plain_table()
    t.add_column("job", justify="right", no_wrap=True)
    t.add_column("ended ms sim", justify="right", no_wrap=True)
    t.add_column("riders", justify="right", no_wrap=True)
    t.add_column("occupancy", no_wrap=True)
    t.add_column("slot " + "".join(str(i % 10) for i in range(n_slots)), no_wrap=True)
    t.add_column("requests", no_wrap=True, overflow="ellipsis")
    for s in reversed(steps[-max_rows:]):
        strip = Text(" " * len("slot "))
        rode = set(s["slots"])
        for i in range(n_slots):
            strip.append("■" if i in rode else "·", style="bold cyan" if i in rode else "grey50")
        t.add_row(str(s["job_id"]), f"{s['sim_end_ms']:.1f}", f"{s['occupancy']}/{s['capacity']}",
                  bar(s["occupancy"] / max(1, s["capacity"]), min(16, s["capacity"] * 2), warn=2.0, crit=2.0),
                  strip, ", ".join(map(str, s["request_ids"])))
    return Group(head, summary, t)


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


def _mem_cell(m, compact: bool, sram: bool = False) -> Text:
    used, reserved, physical = m
    if compact:
        t = mem_bar(used, reserved, physical, 3)
        t.append(f"{100 * reserved / physical:3.0f}%" if physical else "  -", style="grey70")
        return t
    t = mem_bar(used, reserved, physical, 4 if sram else 6)
    if sram:
        t.append(f" {used / MIB:.1f}/{reserved / MIB:.1f}/{physical / MIB:.0f}M", style="grey70")
    else:
        t.append(f" {fmt_gib(used)}/{fmt_gib(reserved)}/{physical / GIB:.0f}G", style="grey70")
    return t


def header_line(snap: dict, settings, compact: bool = False) -> Text:
    """The figures an operator reads first, each coloured by its threshold (settings.thresholds).

    ``compact``: the same figures in about two 36-column lines."""
    d = snap["device"]
    kv = snap["kv"]
    c = snap["requests"]["counters"]
    lat = snap["requests"]["latency_ms"]
    cap = kv["capacity_tokens"]
    kv_pct = 100 * kv["used_tokens"] / cap if cap else 0.0
    t = Text("KV ")
    t.append_text(bar(kv_pct / 100, 8 if compact else 16, warn=settings.thresholds["kv_percent"].warn / 100,
                      crit=settings.thresholds["kv_percent"].crit / 100))
    t.append(f" {kv_pct:.1f}%", style=settings.style("kv_percent", kv_pct))
    if not compact:
        t.append(f" {kv['used_tokens']}/{cap} tok", style="grey62")
    t.append("  queue " if not compact else " q ")
    t.append(str(c["queued"]), style=settings.style("queue_depth", c["queued"]))
    t.append(f" run {c['running']}", style="grey62")
    tpot = lat["tpot"]["p95"]
    ttft = lat["ttft"]["p95"]
    if compact:
        t.append("\nP95 TTFT ")
        t.append(fmt_ms(ttft, 0), style=settings.style("ttft_slo_ratio", None if ttft is None
                                                       else ttft / settings.slo_ttft_ms))
        t.append(" TPOT ")
        t.append(fmt_ms(tpot), style=settings.style("tpot_slo_ratio", None if tpot is None
                                                    else tpot / settings.slo_tpot_ms))
        t.append(" ms · fail ")
        t.append(f"{c['failed']}/{snap['jobs']['failed']}", style=settings.style("failed", c["failed"]
                                                                                  + snap["jobs"]["failed"]))
        ach = d.get("achieved_speed")
        if ach is not None and d["pacing"] != "fast" and d["pacing_speed"]:
            ratio = ach / d["pacing_speed"]
            if settings.level("pacing_ratio", ratio) != "ok":
                t.append(f" behind x{ach:.2f}", style=settings.style("pacing_ratio", ratio))
        return t
    t.append("  TTFT p95 ")
    t.append(f"{fmt_ms(ttft, 0)} ms", style=settings.style("ttft_slo_ratio", None if ttft is None
                                                          else ttft / settings.slo_ttft_ms))
    t.append("  TPOT p95 ")
    t.append(f"{fmt_ms(tpot)} ms", style=settings.style("tpot_slo_ratio", None if tpot is None
                                                       else tpot / settings.slo_tpot_ms))
    t.append(f" (console SLO {settings.slo_tpot_ms:g})", style="grey50")
    failed = c["failed"] + snap["jobs"]["failed"]
    t.append("  failed ")
    t.append(f"{c['failed']} req / {snap['jobs']['failed']} jobs", style=settings.style("failed", failed))
    ach = d.get("achieved_speed")
    if ach is not None and d["pacing"] != "fast" and d["pacing_speed"]:
        ratio = ach / d["pacing_speed"]
        t.append("  pacing ")
        t.append(f"x{ach:.2f}/{d['pacing_speed']:g}", style=settings.style("pacing_ratio", ratio))
        if settings.level("pacing_ratio", ratio) != "ok":
            t.append(" host behind real time", style=settings.style("pacing_ratio", ratio))
    tps = (snap.get("load") or {}).get("output_tokens_per_s")
    if tps is not None:
        t.append(f"  {tps:.1f} tok/s sim", style="cyan")
    return t


HEAT_STEPS = ("grey23", "dark_green", "green4", "green3", "yellow3", "dark_orange", "red1")


def heat_style(frac: float) -> str:
    """Colour of a heatmap cell on the one shared scale (0 = the scale's low end, 1 = its top)."""
    i = int(max(0.0, min(1.0, frac)) * (len(HEAT_STEPS) - 1) + 0.5)
    return HEAT_STEPS[i]


def layers_heatmap(step: dict, by: str = "chip", width: int = 80) -> Any:
    """Layers x chips (``by`` "chip") or layers x op category (``by`` "category", summed over chips):
    one cell per layer, coloured on one scale from 0 to the step's largest cell (simulated µs), with
    the legend. A slow or faulted chip shows as a hotter row."""
    if not step.get("layers"):
        return Text("no step yet: send a chat message to see per-layer timings", style="grey50")
    layers = step["layers"]
    if by == "chip":
        rows = [(f"chip{c}", [lay["chip_us"][c] for lay in layers]) for c in range(len(layers[0]["chip_us"]))]
    else:
        cats: dict[str, list[float]] = {}
        for li, lay in enumerate(layers):
            for cat, per_chip in lay["category_us"].items():
                cats.setdefault(cat, [0.0] * len(layers))[li] = float(sum(per_chip))
        rows = sorted(cats.items(), key=lambda kv: -sum(kv[1]))
    top = max((max(v) for _, v in rows), default=0.0) or 1.0
    label_w = max(len(name) for name, _ in rows) + 1
    cell = 2 if label_w + 2 * len(layers) + 12 <= width else 1
    out = Text()
    axis = Text(" " * label_w)
    for li in range(len(layers)):
        axis.append(f"{li:<{cell * 8}}" if li % 8 == 0 else "", style="grey50")
    out.append_text(axis[: label_w + cell * len(layers)])
    out.append("  layer\n", style="grey50")
    for name, vals in rows:
        out.append(f"{name:<{label_w}}", style="bold")
        for v in vals:
            out.append("█" * cell, style=heat_style(v / top))
        out.append(f"  max {max(vals):.0f} µs\n", style="grey62")
    legend = Text(" " * label_w + "scale 0 ")
    for i in range(len(HEAT_STEPS)):
        legend.append("██", style=HEAT_STEPS[i])
    # a category's cell is both chips' time: say so, or its max reads above the layer's own time
    legend.append(f" {top:.0f} µs sim per layer{', both chips summed' if by != 'chip' else ''} "
                  "(one scale for every row)", style="grey62")
    out.append_text(legend)
    outside = step.get("outside") or ()
    if outside:  # not cells on the scale: the LM head alone is ~6 layers and would wash the layers out
        sep = " / "
        out.append("\n" + " " * label_w + "outside the layers (rows in the table): "
                   + " · ".join(f"{o['part']} {sep.join(f'{u:.0f}' for u in o['chip_us'])}" for o in outside)
                   + f" µs ({sep.join(f'chip{c}' for c in range(len(outside[0]['chip_us'])))})", style="grey62")
    return out
