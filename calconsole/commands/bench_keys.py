"""``calconsole bench keys``: how long a key waits in the console while a long reply streams and ends.

Runs the console headless (Textual ``App.run_test``) on a timing-only
simulator with fast pacing, sends one chat request with a large
``max_tokens`` (40,000 by default: about 200,000 characters of reply) and,
every 5 ms (from a thread, as a terminal driver delivers keys), types a
character into the chat input, timing how long it takes to appear in the
input's value (host wall ms; polled at 1 ms, so figures are at least ~1 ms). Prints the latency during streaming and in
the window around the end of the reply, when the reply is written to the
chat log. A benchmark figure, never a test assertion.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path

from .common import fail, print_json

KEY_EVERY_S = 0.005


def register(bsub) -> None:
    p = bsub.add_parser(
        "keys", help="key latency in the console while a long reply streams and ends (host wall ms)",
        description="Run the console headless on a timing-only simulator, stream one long reply and time "
                    "keys typed into the chat input (host wall ms from the key being posted to the input "
                    "showing it). Reports streaming and end-of-reply latency separately.")
    p.add_argument("--max-tokens", type=int, default=40_000, help="reply length in tokens (default 40000)")
    p.add_argument("--after-s", type=float, default=3.0,
                   help="keep typing this long after the reply ended (host wall s, default 3)")
    p.add_argument("--size", default="120x36", help="terminal size COLSxROWS (default 120x36)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.max_tokens <= 40_000:
        return fail(f"--max-tokens must be in 1..40000, got {args.max_tokens}")
    if not 0 <= args.after_s <= 60:
        return fail(f"--after-s must be in 0..60, got {args.after_s}")
    try:
        cols, rows = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        return fail(f"--size must be COLSxROWS, got {args.size!r}")
    if not (80 <= cols <= 400 and 24 <= rows <= 200):
        return fail(f"--size must be within 80x24..400x200, got {args.size}")
    r = asyncio.run(_measure(args.max_tokens, args.after_s, (cols, rows)))
    r.pop("window_perf_s", None)  # perf_counter bounds, for bench realtime's GC split only
    if args.json:
        print_json(r)
        return 0
    print(f"key latency, host wall ms ({r['reply_chars']} characters, {r['reply_tokens']} tokens; "
          f"terminal {cols}x{rows})")
    for line in key_lines(r):
        print("  " + line)
    return 0


def key_lines(r: dict, label: str = "") -> list[str]:
    """One line per phase (streaming, end of reply) of :func:`_measure`'s key latencies (host wall ms)."""
    out = []
    for k in ("streaming", "end_of_reply"):
        s = r[k]
        name = f"{label}{k:13s}"
        out.append(f"{name}: n {s['n']:4d}  median {s['median_ms']:.1f}  p95 {s['p95_ms']:.1f}  "
                   f"max {s['max_ms']:.1f}" if s["n"] else f"{name}: no keys measured")
    return out


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0, "median_ms": None, "p95_ms": None, "max_ms": None}
    s = sorted(xs)
    return {"n": len(s), "median_ms": statistics.median(s), "p95_ms": s[min(len(s) - 1, int(0.95 * len(s)))],
            "max_ms": s[-1]}


async def _measure(max_tokens: int, after_s: float, size: tuple[int, int]) -> dict:
    from textual import events
    from textual.widgets import Input

    from calconsole.app import CalConsoleApp
    from calconsole.layout import load_layout
    from calconsole.panes.chat import ChatPane
    from sim_backend.compose import Pacing, PacingMode, build_system

    with tempfile.TemporaryDirectory() as tmp:
        system = build_system(pacing=Pacing(PacingMode.FAST), numerics=False,
                              audit_path=Path(tmp) / "audit.jsonl")
        try:
            app = CalConsoleApp(system, load_layout("operator"))
            async with app.run_test(size=size) as pilot:
                chat = app.query_one("#chat", ChatPane)
                inp = app.query_one("#chat-input", Input)
                app.query_one("#p-max-tokens", Input).value = str(max_tokens)
                inp.focus()
                await pilot.pause()
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
                await pilot.pause(0.2)
                arrived.extend([time.perf_counter()] * len(inp.value))
                # keys typed after the end never arrive: fewer arrivals than posts
                samples = [(a, (a - p) * 1e3) for p, a in zip(posted, arrived, strict=False)]
                result = chat.history[-1]["content"] if chat.history else ""
                stats = system.observation.snapshot().requests.tokens
        finally:
            system.close()
    # the reply's end is seen (handle cleared) only once the UI thread is free again: a key held up
    # by the end-of-reply work shows just before or at done_at
    end = [ms for t, ms in samples if done_at is not None and t >= done_at - 0.25]
    streaming = [ms for t, ms in samples if done_at is None or t < done_at - 0.25]
    return {"unit": "host wall ms from key posted to the input showing it", "reply_chars": len(result),
            "window_perf_s": (posted[0] if posted else None, time.perf_counter()),
            "reply_tokens": stats.predicted, "streaming": _stats(streaming), "end_of_reply": _stats(end)}
