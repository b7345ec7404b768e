"""A long mixed soak against the serving face, with the server's RSS every 1,000 requests.

``calconsole bench serve --phases soak --duration S`` runs ``clients`` closed-loop tasks for S host
seconds. Each task cycles through the request kinds an operator's traffic holds (``KINDS``):
streamed chat run to the end, streamed chat the client drops after its first chunk (the server
sees a disconnect and cancels), non-streamed chat, ``/tokenize``, ``/health``, ``/metrics`` and
``/snapshot``. Every 1,000 requests (and every minute) the server's resident set is read from its own ``/snapshot``
(``host.rss_bytes``: the serving process, measured by psutil), so the series is the server's
even when the bench runs in another process (``--url``).

Verdict (``settles``): the RSS growth over the last half of the samples against the growth over
the first half. A leak grows by about the same per request throughout; an allocator warming up
(arenas of new worker threads, caches filling) grows early and then stays flat. The figures and
the rule are printed, so a reader can judge them; a benchmark, not a test.

Leak or warm-up (``trace_top``): with the server in this process, ``tracemalloc`` snapshots taken after the
first sample, at half time and at the end are compared, and the source lines whose live Python allocations
grew the most over each half are reported (KiB and block counts; Python objects only, not numpy's or the
C libraries' own heaps). A leak shows the same lines growing in both halves.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import tracemalloc
from collections.abc import Mapping
from typing import Any

import httpx

from .serve_load import CHAT_PATH, prompt_text

KINDS = ("stream", "drop", "chat", "tokenize", "health", "metrics", "snapshot")
SAMPLE_EVERY = 1000
#: and at least this often (host s), for slow runs (numerics) that take minutes per 1,000 requests
SAMPLE_EVERY_S = 60.0
#: the last half grew by at most this share of the first half's growth (or by at most SETTLED_MB): settled
SETTLE_RATIO = 0.25
SETTLED_MB = 4.0


async def _rss(client: httpx.AsyncClient, headers: Mapping[str, str]) -> int | None:
    try:
        r = await client.get("/snapshot", headers=dict(headers))
        host = r.json().get("host") if r.status_code == 200 else None
        v = host.get("rss_bytes") if isinstance(host, dict) else None
        return int(v) if isinstance(v, (int, float)) else None
    except (httpx.HTTPError, ValueError):
        return None


async def _one(client: httpx.AsyncClient, kind: str, i: int, headers: Mapping[str, str], seed: int,
               timeout_s: float) -> tuple[bool, str | None]:
    """Send request ``i`` of ``kind``; (ok, error text). A dropped stream is ok when its first chunk came."""
    h = dict(headers)
    text = prompt_text(i, 24, seed)
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 8, "temperature": 0.0, "seed": i}
    try:
        async with asyncio.timeout(timeout_s):
            if kind in ("stream", "drop"):
                async with client.stream("POST", CHAT_PATH, json={**chat, "stream": True}, headers=h) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return False, f"{kind}: HTTP {r.status_code}"
                    async for line in r.aiter_lines():
                        if kind == "drop" and line.startswith("data:"):
                            return True, None  # leaving the block closes the connection mid-stream
                        if line.strip() == "data: [DONE]":
                            return True, None
                return kind == "stream", None if kind == "stream" else "drop: stream ended before a chunk"
            if kind == "chat":
                r = await client.post(CHAT_PATH, json=chat, headers=h)
            elif kind == "tokenize":
                r = await client.post("/tokenize", json={"content": text, "with_pieces": True}, headers=h)
            else:
                r = await client.get(f"/{kind}", headers=h)
            return r.status_code == 200, None if r.status_code == 200 else f"{kind}: HTTP {r.status_code}"
    except TimeoutError:
        return False, f"{kind}: no reply within {timeout_s:g} s"
    except httpx.HTTPError as e:
        return False, f"{kind}: {type(e).__name__}"


def verdict(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Settles or grows: the RSS growth (MiB) over the first and the last half of ``samples``.

    ``last_half_growth_pct``: the last half's growth as a percentage of the RSS at its start (the
    share a bound such as "<= 10 % over the last 10 minutes of a 20-minute soak" is stated in).
    """
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    if len(rss) < 4:
        return {"settles": None, "why": f"{len(rss)} RSS samples; at least 4 are needed (run longer)"}
    mid = len(rss) // 2
    first, last = rss[mid] - rss[0], rss[-1] - rss[mid]
    settles = last <= SETTLED_MB or last <= SETTLE_RATIO * max(first, 0.0)
    return {"settles": settles, "first_half_growth_mb": round(first, 1), "last_half_growth_mb": round(last, 1),
            "last_half_growth_pct": round(100.0 * last / rss[mid], 1) if rss[mid] > 0 else None,
            "rule": f"settles when the last half of the samples grew by <= {SETTLED_MB:g} MiB or by <= "
                    f"{SETTLE_RATIO:g} x the first half's growth"}


#: frames of the tracer itself and of the import machinery are not the server's memory
_TRACE_SKIP = tuple(tracemalloc.Filter(False, f) for f in (
    tracemalloc.__file__, "<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>", "<unknown>"))


def _growth(a: tracemalloc.Snapshot, b: tracemalloc.Snapshot, top: int) -> list[dict[str, Any]]:
    """The ``top`` source lines whose live allocations grew most from ``a`` to ``b`` (KiB, blocks)."""
    stats = b.filter_traces(_TRACE_SKIP).compare_to(a.filter_traces(_TRACE_SKIP), "lineno")
    out = []
    for st in sorted(stats, key=lambda st: st.size_diff, reverse=True)[:top]:
        fr = st.traceback[0]
        out.append({"where": f"{fr.filename}:{fr.lineno}", "grew_kib": round(st.size_diff / 1024, 1),
                    "live_kib": round(st.size / 1024, 1), "blocks_grew": st.count_diff})
    return out


async def soak(url: str, headers: Mapping[str, str], *, clients: int, duration_s: float, seed: int = 0,
               timeout_s: float = 60.0, progress: Any = None, trace_top: int = 0) -> dict[str, Any]:
    """Run the soak (module docstring). ``progress(sample)``, if given, sees each RSS sample as it is taken.

    Returns {"requests", "failed", "errors" (first 20), "by_kind", "samples": [{"requests", "wall_s",
    "rss_mb"}], "rss_start_mb", "rss_end_mb", "verdict"}. RSS in MiB of the server process; wall s host time.
    ``trace_top`` > 0 (the server in this process): also "tracemalloc": {"first_half", "last_half",
    "traced_mb"}, the lines whose Python allocations grew most over each half (module docstring); tracing
    slows the run, so its request rate is not comparable with an untraced one.
    """
    n = clients + 4
    counter = itertools.count()
    by_kind = {k: {"sent": 0, "ok": 0} for k in KINDS}
    errors: list[str] = []
    samples: list[dict[str, Any]] = []
    done = 0
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)) as client:
        async def sample() -> None:
            rss = await _rss(client, headers)
            s = {"requests": done, "wall_s": round(time.perf_counter() - t0, 1),
                 "rss_mb": None if rss is None else round(rss / 2**20, 1)}
            samples.append(s)
            if progress is not None:
                progress(s)

        await sample()
        snaps: list[tracemalloc.Snapshot] = []
        was_tracing = tracemalloc.is_tracing()
        if trace_top > 0:
            if not was_tracing:
                tracemalloc.start(1)
            snaps.append(tracemalloc.take_snapshot())
        deadline = time.perf_counter() + duration_s  # of traffic: the first RSS read is not part of it
        half = time.perf_counter() + duration_s / 2
        next_sample = SAMPLE_EVERY
        last_sample = time.perf_counter()

        async def task() -> None:
            nonlocal done, next_sample, last_sample
            while time.perf_counter() < deadline:
                i = next(counter)
                kind = KINDS[i % len(KINDS)]
                ok, err = await _one(client, kind, i, headers, seed, timeout_s)
                by_kind[kind]["sent"] += 1
                by_kind[kind]["ok"] += ok
                if err and len(errors) < 20:
                    errors.append(err)
                done += 1
                if trace_top > 0 and len(snaps) == 1 and time.perf_counter() >= half:
                    snaps.append(tracemalloc.take_snapshot())
                if done >= next_sample or time.perf_counter() - last_sample >= SAMPLE_EVERY_S:
                    if done >= next_sample:
                        next_sample += SAMPLE_EVERY
                    last_sample = time.perf_counter()
                    await sample()

        await asyncio.gather(*(task() for _ in range(clients)))
        await sample()
        traced: dict[str, Any] | None = None
        if trace_top > 0:
            snaps.append(tracemalloc.take_snapshot())
            if len(snaps) == 3:
                traced = {"first_half": _growth(snaps[0], snaps[1], trace_top),
                          "last_half": _growth(snaps[1], snaps[2], trace_top),
                          "traced_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 1)}
            if not was_tracing:
                tracemalloc.stop()
    failed = sum(v["sent"] - v["ok"] for v in by_kind.values())
    rss = [s["rss_mb"] for s in samples if s["rss_mb"] is not None]
    return {"requests": done, "failed": failed, "errors": errors, "by_kind": by_kind, "clients": clients,
            "duration_s": round(time.perf_counter() - t0, 1), "samples": samples,
            "rss_start_mb": rss[0] if rss else None, "rss_end_mb": rss[-1] if rss else None,
            "verdict": verdict(samples), "tracemalloc": traced,
            "clock": "wall s host time; RSS MiB of the server process (its /snapshot)"}
