"""Serving sections: requests (counters, latency percentiles, goodput, tokens), slots, stages, jobs, KV."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from sim_backend.planes.snapshot import RequestsView, Snapshot

from .common import bar, fmt_bytes, fmt_ms, not_reported, plain_table

LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue")


def jobs_panel(snap: Snapshot) -> Text:
    """Device job counters: device steps (one prefill chunk or one decode step each), not requests."""
    j = snap.jobs
    if j is None:
        return not_reported("device steps (jobs)", snap)
    t = Text("device steps  ")
    for k, v, style in (("pending", j.pending, "yellow"), ("running", j.running, "cyan"),
                        ("finished", j.finished, "green"), ("failed", j.failed, "red"), ("left", j.left, "white")):
        t.append(f"{k} ", style="grey62")
        t.append(f"{v}  ", style=f"bold {style}")
    t.append("(a job is one prefill or decode step on the device; left = pending + running)  ", style="grey50")
    t.append(f"ccu_exc {j.ccu_exceptions}  resets {j.resets}", style="grey62")
    return t


def kv_panel(snap: Snapshot) -> Any:
    """KV cache occupancy: a bar, tokens, bytes per chip, blocks, waits, per-sequence cells."""
    kv = snap.kv
    if kv is None:
        return not_reported("KV cache", snap)
    used, cap = kv.used_tokens, kv.capacity_tokens
    line = Text("KV    ")
    line.append_text(bar(used / cap if cap else 0.0))
    line.append(f"  {used} / {cap} tokens ({100 * used / cap if cap else 0.0:.1f}%)", style="bold")
    sub = Text(f"      {fmt_bytes(kv.bytes_used_per_chip)} of {fmt_bytes(kv.bytes_capacity_per_chip)} per chip"
               f" · blocks {kv.used_blocks}/{kv.total_blocks} of {kv.block_size} tokens"
               f" · requests waited {kv.waits}, timed out {kv.timeouts}", style="grey62")
    seqs = ", ".join(f"seq{s}:{n}" for s, n in kv.per_seq_tokens.items()) or "no sequences"
    return Group(line, sub, Text(f"      {seqs}", style="grey62"))


def slots_panel(snap: Snapshot) -> Table:
    """One row per serving slot (llama-server's slots): state, request, token counts (context shifts with the
    cached tokens, ``_cached``)."""
    t = plain_table()
    for col in ("slot", "state", "req", "prompt", "prefilled", "generated", "cached"):
        t.add_column(col, justify="right" if col not in ("state",) else "left")
    for s in snap.slots:
        st = {"idle": "grey50", "prefilling": "yellow", "decoding": "cyan"}.get(s.state, "white")
        t.add_row(str(s.index), Text(s.state, style=st), str(s.request_id or "-"), _count(s.prompt_n),
                  _count(s.n_prefilled), _count(s.predicted_n), _cached(s))
    return t


def _cached(s: Any) -> str:
    """The slot's cached tokens; after context shifts (serve --context-shift) also how many and the tokens
    they discarded, e.g. ``41 (2 shifts, -62)``."""
    n = getattr(s, "n_shifts", None)
    if not n:
        return _count(s.cached_tokens)
    return f"{_count(s.cached_tokens)} ({n} shift{'s' if n > 1 else ''}, -{s.n_discarded or 0})"


def _count(v: int | None) -> str:
    return "-" if v is None else str(v)  # None: the server did not report it (a llama-server slot never used)


def requests_panel(snap: Snapshot, settings: Any = None) -> Any:
    """Counters, latency percentiles, goodput and tokens. Goodput is the engine's, against the engine's SLO
    (the snapshot's); ``settings`` (the console's SLO, which colours the header) is named beside it when the
    two differ, so the pane never shows two SLOs without saying which is which."""
    r: RequestsView = snap.requests
    c = r.counters
    head = Text("requests  ")
    for k in ("submitted", "finished", "failed", "cancelled", "queued", "running", "rejected"):
        head.append(f"{k} ", style="grey62")
        head.append(f"{getattr(c, k)}  ", style="bold")
    if not r.balanced:
        head.append("UNBALANCED", style="bold red")
    # which requests give samples (metrics.SAMPLED_FROM): a reply stopped after its first token counts in TTFT
    # the note is a line of its own: as the narrow table's title it wrapped into three lines of ~40 columns
    sampled = Text("TTFT, ITL: every request with a token (stopped or failed too) · TPOT, E2E: finished only",
                   style="grey62")
    t = plain_table()
    client = snap.server is not None  # a llama-server: the latencies are this console's, measured as client
    if client:
        sampled = Text.assemble(sampled, Text(f"\n{r.scope}; {r.clock}", style="grey62"))
    t.add_column("client wall ms" if client else "sim ms")
    for q in ("p50", "p95", "p99", "n"):
        t.add_column(q, justify="right")
    for k in LATENCIES:
        lat = getattr(r.latency_ms, k)
        t.add_row(k.upper(), fmt_ms(lat.p50), fmt_ms(lat.p95), fmt_ms(lat.p99), str(lat.n))
    if client:
        tok = r.tokens
        return Group(head, sampled, t, Text(f"tokens of these requests: prompt {tok.prompt + tok.cached} "
                                            f"(cached {tok.cached}) predicted {tok.predicted}", style="grey70"))
    g = r.goodput
    slo = {"ttft_ms": g.slo.ttft_ms, "tpot_ms": g.slo.tpot_ms, "e2el_ms": g.slo.e2el_ms}
    slo_s = ", ".join(f"{k.removesuffix('_ms').upper()} <= {v:g}" for k, v in slo.items() if v is not None)
    n = g.good_requests
    rate = (f", {g.tokens_per_s:.1f} tok/s over the sim time since the first request (idle included)"
            if g.tokens_per_s is not None else "")
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
    tok = r.tokens
    # the counters are llama.cpp's: "prompt" counts processed tokens (the reused prefix excluded)
    toks = Text(f"tokens prompt {tok.prompt + tok.cached} (processed {tok.prompt} + cached {tok.cached})"
                f" predicted {tok.predicted}", style="grey70")
    return Group(head, sampled, t, gp, toks)


def stages_panel(snap: Snapshot) -> Any:
    """Where the last prefill and decode step's time went: device stages (sim ms), host stages (measured)."""
    if snap.stages is None:
        return not_reported("step stages", snap)
    t = plain_table("last step stages (device: sim ms · host: measured ms, CPU time; kv_wait: wall)")
    cols = ("kind", "h2d", "infer", "d2h", "kv_wait", "sampling", "detok", "framework")
    for col in cols:
        t.add_column(col, justify="right" if col != "kind" else "left")
    for kind, s in snap.stages.items():
        label = kind if s.source == "request" else f"{kind} ({s.source})"  # a maintenance step, not a request
        t.add_row(label, fmt_ms(s.h2d_ms, 3), fmt_ms(s.infer_ms, 2), fmt_ms(s.d2h_ms, 3),
                  fmt_ms(s.kv_wait_ms, 3), fmt_ms(s.sampling_ms, 3), fmt_ms(s.detokenize_ms, 3),
                  fmt_ms(s.framework_ms, 3))
    return t
