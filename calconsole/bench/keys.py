"""``calconsole bench keys``: how long a key waits in the console while a long reply streams and ends.

Runs the console headless (Textual ``App.run_test``) on a timing-only
simulator with fast pacing, sends one chat request with a large
``max_tokens`` (40,000 by default: about 200,000 characters of reply) and,
every 5 ms (from a thread, as a terminal driver delivers keys), types a
character into the chat input, timing how long it takes to appear in the
input's value (host wall ms; polled at 1 ms, so figures are at least ~1 ms). Prints the latency during streaming and in
the window around the end of the reply, when the reply is written to the
chat log. Beside it run ``--busy-loops`` CPU busy loops (child processes, default 1: the condition the
key-latency target is stated for), and the console's idle CPU is measured over ``--idle-s`` before the
request and again after the reply (this process's CPU time, all its threads: UI, engine, device, as % of
one core). ``--numerics`` runs the console as it starts by default instead (the numerics in their worker
process on both cores, realtime pacing), and the idle windows then also give the worker's CPU. A benchmark
figure, never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from calconsole.bench.busy import MAX_BUSY_LOOPS, BusyLoops, ChildrenCpuMeter, CpuMeter

from ..commands.common import fail, print_json
from ..settings import PANE_MODES
from . import BenchParsers

KEY_EVERY_S = 0.005


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser(
        "keys", help="key latency in the console while a long reply streams and ends (host wall ms)",
        description="Run the console headless on a timing-only simulator (--numerics: as it starts by default, "
                    "the numerics in their worker), stream one long reply and time keys typed into the chat "
                    "input (host wall ms from the key being posted to the input showing it). Reports streaming "
                    "and end-of-reply latency separately.")
    p.add_argument("--max-tokens", type=int, default=40_000, help="reply length in tokens (default 40000)")
    p.add_argument("--after-s", type=float, default=3.0,
                   help="keep typing this long after the reply ended (host wall s, default 3)")
    p.add_argument("--size", default="120x36", help="terminal size COLSxROWS (default 120x36)")
    p.add_argument("--busy-loops", type=int, default=1,
                   help=f"CPU busy loops (child processes) running beside the console for the whole bench, "
                        f"0..{MAX_BUSY_LOOPS} (default 1)")
    p.add_argument("--idle-s", type=float, default=5.0,
                   help="window of the console's idle CPU, measured before the request and after the reply "
                        "(host wall s, 0..120, default 5; 0: not measured)")
    p.add_argument("--numerics", action="store_true",
                   help="run the console as it starts by default instead: the numerics in their worker process "
                        "(compiled kernels, both cores), realtime pacing; use a --max-tokens the device streams "
                        "in reasonable time (3000: about a minute)")
    p.add_argument("--panes", choices=PANE_MODES, default="auto",
                   help="pane mode: auto (one pane at a time below the layout's size, the columns above it), "
                        "single or columns (forced, as the palette does); default auto")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.max_tokens <= 40_000:
        return fail(f"--max-tokens must be in 1..40000, got {args.max_tokens}")
    if not 0 <= args.after_s <= 60:
        return fail(f"--after-s must be in 0..60, got {args.after_s}")
    if not 0 <= args.busy_loops <= MAX_BUSY_LOOPS:
        return fail(f"--busy-loops must be in 0..{MAX_BUSY_LOOPS}, got {args.busy_loops}")
    if not 0 <= args.idle_s <= 120:
        return fail(f"--idle-s must be in 0..120, got {args.idle_s}")
    try:
        cols, rows = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        return fail(f"--size must be COLSxROWS, got {args.size!r}")
    if not (80 <= cols <= 400 and 24 <= rows <= 200):
        return fail(f"--size must be within 80x24..400x200, got {args.size}")
    try:
        r = asyncio.run(_measure(args.max_tokens, args.after_s, (cols, rows), busy_loops=args.busy_loops,
                                 idle_s=args.idle_s, numerics=args.numerics, panes=args.panes))
    except OSError as e:
        return fail(f"could not start a busy loop: {e}")
    r.pop("window_perf_s", None)  # perf_counter bounds, for bench realtime's GC split only
    if args.json:
        print_json(r)
        return 0
    sim = ("numerics worker, realtime pacing" if args.numerics else "timing-only simulator, fast pacing")
    mode = "one pane at a time (chat)" if r["single_pane"] else "the layout's columns"
    print(f"key latency, host wall ms ({r['reply_chars']} characters, {r['reply_tokens']} tokens; "
          f"terminal {cols}x{rows}, {mode}; {sim}; {busy_text(r['busy_loops'])})")
    for line in key_lines(r) + idle_lines(r):
        print("  " + line)
    return 0


def busy_text(b: dict[str, Any]) -> str:
    """``"1 busy loop beside the console (got 99 % of a core)"`` from :meth:`BusyLoops.summary`."""
    if not b["n"]:
        return "no busy loop beside the console"
    got = ", ".join("?" if p is None else f"{p:.0f} %" for p in b["cpu_percent"])
    return f"{b['n']} busy loop{'s' if b['n'] > 1 else ''} beside the console (got {got} of a core)"


def idle_lines(r: dict[str, Any], label: str = "") -> list[str]:
    """The console's idle CPU windows of :func:`_measure` (before the request, after the reply)."""
    out = []
    for k, name in (("idle_before", "before the request"), ("idle_after", "after the reply")):
        w = r.get(k)
        if w is None:
            continue
        out.append(f"{label}idle CPU {name}: {w['percent_of_a_core']:.2f} % of a core "
                   f"({w['cpu_s'] * 1e3:.0f} ms process CPU over {w['wall_s']:.1f} s wall)")
        wk = r.get(k + "_worker")
        if wk is not None:
            out.append(f"{label}  its numerics worker meanwhile: {wk['percent_of_a_core']:.2f} % of a core "
                       f"({wk['cpu_s'] * 1e3:.0f} ms CPU)")
    return out


def key_lines(r: dict[str, Any], label: str = "") -> list[str]:
    """One line per phase (streaming, end of reply) of :func:`_measure`'s key latencies (host wall ms)."""
    out = []
    for k in ("streaming", "end_of_reply"):
        s = r[k]
        name = f"{label}{k:13s}"
        out.append(f"{name}: n {s['n']:4d}  median {s['median_ms']:.1f}  p95 {s['p95_ms']:.1f}  "
                   f"max {s['max_ms']:.1f}" if s["n"] else f"{name}: no keys measured")
    return out


def _stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0, "median_ms": None, "p95_ms": None, "max_ms": None}
    s = sorted(xs)
    return {"n": len(s), "median_ms": statistics.median(s), "p95_ms": s[min(len(s) - 1, int(0.95 * len(s)))],
            "max_ms": s[-1]}


async def _measure(max_tokens: int, after_s: float, size: tuple[int, int], *, busy_loops: int = 0,
                   idle_s: float = 0.0, numerics: bool = False, panes: str = "auto") -> dict[str, Any]:
    """Key latency while one reply streams and ends (module docstring), with ``busy_loops`` busy child
    processes running throughout and, if ``idle_s`` > 0, the console's idle CPU over ``idle_s`` host s
    before the request and after the reply. Returns ``{"streaming", "end_of_reply": {n, median_ms, p95_ms,
    max_ms}, "idle_before", "idle_after": CpuWindow.to_dict() or None, "busy_loops": BusyLoops.summary(),
    "reply_chars", "reply_tokens", "window_perf_s", "unit", "single_pane"}``. OSError if a busy loop cannot
    start. ``panes``: the pane mode (``PANE_MODES``; "auto" follows the layout's size, as the console does).
    ``numerics``: the console as it starts by default (numerics in their worker process, realtime pacing),
    not the timing-only simulator at fast pacing; the idle windows then also give the worker's CPU
    (``idle_before_worker`` / ``idle_after_worker``)."""
    with BusyLoops(busy_loops) as loops:
        r = await _measure_beside(max_tokens, after_s, size, idle_s, numerics=numerics, exclude=loops.pids,
                                  panes=panes)
    r["busy_loops"] = loops.summary()
    return r


async def _idle(idle_s: float, exclude: list[int] | None = None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(this process's CPU window, its other child processes' window when ``exclude`` is given) over idle_s."""
    if idle_s <= 0:
        return None, None
    m = CpuMeter()
    kids = ChildrenCpuMeter(exclude) if exclude is not None else None
    await asyncio.sleep(idle_s)  # the app's loop (same event loop) runs its timers and repaints meanwhile
    return m.window().to_dict(), (kids.window().to_dict() if kids is not None else None)


async def _measure_beside(max_tokens: int, after_s: float, size: tuple[int, int], idle_s: float, *,
                          numerics: bool = False, exclude: list[int] | None = None,
                          panes: str = "auto") -> dict[str, Any]:
    from textual import events
    from textual.widgets import Input

    from calconsole.app import CalConsoleApp
    from calconsole.layout import load_layout
    from calconsole.panes.chat import ChatPane
    from sim_backend.compose import Pacing, PacingMode, build_system

    with tempfile.TemporaryDirectory() as tmp:
        # --numerics: as the console starts by default (the worker's start waited for: a reply that ran
        # timing-only while the kernels load would measure the wrong thing)
        system = build_system(pacing=Pacing(PacingMode.REALTIME if numerics else PacingMode.FAST), numerics=numerics,
                              numerics_process=numerics, audit_path=Path(tmp) / "audit.jsonl")
        try:
            app = CalConsoleApp(system, load_layout("operator"))
            async with app.run_test(size=size) as pilot:
                if panes != "auto":
                    app.set_pane_mode(panes)
                    await pilot.pause()
                chat = app.query_one("#chat", ChatPane)
                inp = app.query_one("#chat-input", Input)
                app.query_one("#p-max-tokens", Input).value = str(max_tokens)
                inp.focus()
                await pilot.pause()
                idle_before, worker_before = await _idle(idle_s, exclude if numerics else None)
                inp.value = "hi"
                await pilot.press("enter")
                deadline = time.perf_counter() + 60.0
                while chat.handle is None and not chat.history:  # the worker submits (a short reply may end first)
                    if time.perf_counter() > deadline:
                        raise RuntimeError("the chat request did not start within 60 s")
                    await asyncio.sleep(0.005)
                # keys come from a thread, every KEY_EVERY_S of wall time, as a terminal driver delivers
                # what a person types: a key typed while the UI thread is busy waits for it
                posted: list[float] = []
                stop = threading.Event()

                def typist() -> None:
                    while not stop.is_set():
                        key = events.Key("x", "x")
                        key.set_sender(app)
                        posted.append(time.perf_counter())
                        driver = app._driver
                        assert driver is not None  # run_test's headless driver
                        driver.send_message(key)
                        stop.wait(KEY_EVERY_S)

                arrived: list[float] = []
                done_at = None
                thread = threading.Thread(target=typist, daemon=True)
                thread.start()
                try:
                    while done_at is None or time.perf_counter() - done_at < after_s:
                        await asyncio.sleep(0.001)
                        now = time.perf_counter()
                        if inp.value:
                            arrived.extend([now] * len(inp.value))
                            inp.value = ""  # the chars that showed since the last look, then start over
                        if done_at is None and chat.handle is None:
                            done_at = now
                finally:
                    stop.set()
                    thread.join(1.0)
                # keys posted just before the typist stopped still arrive: polled as above for 0.2 s (a blind
                # 0.2 s pause stamped them at its end, a ~200 ms "latency" the console never had)
                settle = time.perf_counter() + 0.2
                while time.perf_counter() < settle:
                    await asyncio.sleep(0.001)
                    if inp.value:
                        arrived.extend([time.perf_counter()] * len(inp.value))
                        inp.value = ""
                await pilot.pause()
                idle_after, worker_after = await _idle(idle_s, exclude if numerics else None)
                # keys typed after the end never arrive: fewer arrivals than posts
                samples = [(a, (a - p) * 1e3) for p, a in zip(posted, arrived, strict=False)]
                result = chat.history[-1]["content"] if chat.history else ""
                stats = system.observation.snapshot().requests.tokens
                single = app.single
        finally:
            system.close()
    # the reply's end is seen (handle cleared) only once the UI thread is free again: a key held up
    # by the end-of-reply work shows just before or at done_at
    end = [ms for t, ms in samples if done_at is not None and t >= done_at - 0.25]
    streaming = [ms for t, ms in samples if done_at is None or t < done_at - 0.25]
    return {"unit": "host wall ms from key posted to the input showing it", "reply_chars": len(result),
            "window_perf_s": (posted[0] if posted else None, time.perf_counter()),
            "reply_tokens": stats.predicted, "streaming": _stats(streaming), "end_of_reply": _stats(end),
            "idle_before": idle_before, "idle_after": idle_after, "idle_before_worker": worker_before,
            "idle_after_worker": worker_after, "numerics": numerics, "single_pane": single}
