"""Closed-loop load over real HTTP against ``/v1/chat/completions`` (``calconsole bench serve``).

Clients are asyncio tasks sharing one ``httpx.AsyncClient``; each sends its next request when
the previous one ended (closed loop, vLLM's ``--max-concurrency`` without a request rate).
Every request streams (``stream: true``, ``stream_options.include_usage``) and is parsed with
httpx-sse. Per request, on the client's clock (host wall ms, ``time.perf_counter``), with the
definitions of vLLM's ``benchmark_serving.py`` (``backend_request_func``):

- sent: just before the request is written (vLLM's ``st``);
- TTFT: sent -> the first chunk whose ``delta.content`` is non-empty. vLLM stamps the first
  chunk carrying ``choices``, which for llama-server and us is the role-only
  ``{"role": "assistant"}`` chunk; we wait for visible text (facts.md F7: "first visible token");
- ITL: the gaps between consecutive content chunks (one chunk per visible piece);
- E2E: sent -> the last ``data:`` chunk before ``[DONE]`` (the usage chunk; vLLM's ``latency``);
- TPOT: (E2E - TTFT) / (n - 1), n = ``usage.completion_tokens`` (None when n < 2);
- goodput (vLLM ``--goodput``): requests meeting every SLO (<=; TPOT counts as 0 when n < 2)
  per second of the run, and their output tokens per second (facts.md F7's definition).

``stream_completion`` times llama.cpp's native ``/completion`` the same way (token-id prompts of an
exact length; ``calconsole bench matrix``).

Beside them the server's own figures: the ``timings`` of each final chunk (SIMULATED device ms:
``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2e_ms``, ``queue_ms``) and the change of the server's
``/metrics`` (histograms in simulated seconds) between a scrape before and after the run,
parsed with prometheus_client's text parser; quantiles from those histograms are Prometheus's
``histogram_quantile`` (linear inside a bucket), so they are only as fine as the buckets.

``plane_closed_loop`` runs the same workload straight on an in-process inference plane (no
HTTP): the baseline the HTTP overhead per token is measured against.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from httpx_sse import SSEError, aconnect_sse
from prometheus_client.parser import text_string_to_metric_families

#: words that are one Qwen3 token each with their leading space (checked when written; the prompt
#: length every request really had is reported from ``usage.prompt_tokens``)
WORDS = ("time data light river stone music table window garden paper market signal engine bridge forest "
         "letter number system water morning evening city road field school story voice answer question "
         "family friend power energy circuit memory clock board chip layer token model server client stream "
         "metric cache queue batch kernel vector matrix tensor device driver packet socket thread worker").split()

CHAT_PATH = "/v1/chat/completions"
COMPLETION_PATH = "/completion"
MIXES = {"short": 0.0, "long": 1.0, "mixed": 0.1}  # fraction of long requests (facts.md F8: 10% long + 90% short)
PERCENTILES = (50, 95, 99)  # facts.md F8: P50/P95/P99
#: the server's histograms compared (``llamacpp:`` names, simulated seconds)
HISTOGRAMS = {"ttft_ms": "llamacpp:time_to_first_token_seconds", "itl_ms": "llamacpp:inter_token_latency_seconds",
              "tpot_ms": "llamacpp:time_per_output_token_seconds", "e2e_ms": "llamacpp:e2e_request_latency_seconds",
              "queue_ms": "llamacpp:request_queue_time_seconds"}
COUNTERS = ("prompt_tokens_total", "tokens_predicted_total", "requests_submitted_total", "requests_finished_total",
            "requests_failed_total", "requests_cancelled_total", "requests_rejected_total", "requests_good_total")


class BenchError(Exception):
    """The benchmark cannot go on (server unreachable, warm-up refused, bad reply): a one-line reason."""


@dataclass(frozen=True)
class Shape:
    """A request class: templated prompt tokens (as ``usage.prompt_tokens`` counts them) and
    ``max_tokens``. Defaults from facts.md F8's length matrix: short 128 -> 32, long 4096 -> 128."""

    name: str
    prompt_tokens: int
    output_tokens: int

    @staticmethod
    def parse(name: str, spec: str, n_ctx: int = 40960) -> Shape:
        """``"PROMPT:OUTPUT"`` -> Shape; ValueError (one line, naming ``--NAME``) otherwise."""
        p, sep, o = spec.partition(":")
        try:
            prompt, out = int(p), int(o)
        except ValueError:
            prompt = out = -1
        if not sep or prompt < 1 or out < 1:
            raise ValueError(f"--{name} must be PROMPT:OUTPUT tokens, two positive integers, got {spec!r}")
        if out > 4096:
            raise ValueError(f"--{name}: at most 4096 output tokens per request, got {out}")
        if prompt + out >= n_ctx:
            raise ValueError(f"--{name}: prompt + output must stay below the {n_ctx}-token context, "
                             f"got {prompt} + {out}")
        return Shape(name, prompt, out)


def mix_plan(mix: str, n: int, seed: int) -> list[str]:
    """Shape name ("short"/"long") of each of ``n`` requests, in a seeded order.

    ``mixed``: round(10% of n) long requests, at least one when n >= 2 (so a small run still
    has one; it then is more than 10%)."""
    frac = MIXES[mix]
    n_long = round(frac * n)
    if 0 < frac < 1 and n >= 2:
        n_long = max(1, n_long)
    plan = ["long"] * n_long + ["short"] * (n - n_long)
    random.Random(seed).shuffle(plan)
    return plan


def prompt_text(index: int, n_words: int, seed: int) -> str:
    """The user message of request ``index``: a fixed-width tag and ``n_words`` seeded words.

    Every prompt differs from its first word on, so the server's prefix reuse
    (``cache_prompt``) only ever finds the chat template's header in common."""
    r = random.Random(seed * 1_000_003 + index)
    return f"[{index % 10000:04d}] " + " ".join(r.choice(WORDS) for _ in range(max(1, n_words)))


def request_body(text: str, max_tokens: int, seed: int, model: str | None) -> dict[str, Any]:
    """The streaming chat body every client sends (greedy, as vLLM's benchmark does)."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                            "temperature": 0.0, "seed": seed, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    return body


# --- one request ---------------------------------------------------------------------------------

@dataclass
class Record:
    """One request as the client saw it. Client times: host wall ms; ``server``: the final chunk's
    ``timings`` (simulated device ms), None when the request failed."""

    shape: str
    ok: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    server: dict[str, Any] | None = None
    #: raw arrival of every content chunk: host wall ms since the request was sent, and the tokens
    #: generated by then (the chunk's ``tokens_predicted`` on /completion; the chunk count on chat)
    arrivals_ms: list[float] = field(default_factory=list)
    arrival_tokens: list[int] = field(default_factory=list)
    #: the final chunk's other fields (/completion: ``model``, ``generation_settings``, ``stop_type``...)
    final: dict[str, Any] | None = None

    def row(self) -> dict[str, Any]:
        """The request in a report: client figures (wall ms), the server's (simulated ms), no gap lists."""
        srv = self.server or {}
        return {"shape": self.shape, "ok": self.ok, "error": self.error, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms,
                "e2e_ms": self.e2e_ms, "itl_gaps": len(self.itl_ms),
                "server_ttft_ms": srv.get("ttft_ms"), "server_e2e_ms": srv.get("e2e_ms"),
                "server_queue_ms": srv.get("queue_ms")}

    @property
    def tpot_ms(self) -> float | None:
        """(E2E - TTFT) / (n - 1) (vLLM); None when n < 2 or the request failed."""
        n = self.output_tokens
        if not self.ok or n is None or n < 2 or self.ttft_ms is None or self.e2e_ms is None:
            return None
        return (self.e2e_ms - self.ttft_ms) / (n - 1)


def _error_text(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw).get("error") or {}
        return f"HTTP {status} {err.get('type', '')}: {err.get('message', '')}".strip()
    except (ValueError, AttributeError):
        return f"HTTP {status}: {raw[:200].decode('utf-8', 'replace')}"


async def stream_chat(client: httpx.AsyncClient, body: Mapping[str, Any], shape: str,
                      headers: Mapping[str, str] | None = None, timeout_s: float | None = None) -> Record:
    """Send one streaming chat request and time it (module docstring). Never raises for a
    failed request: the Record says ``ok=False`` and why (HTTP status and llama-server error,
    an error event mid-stream, a transport error or timeout, a stream without usage or ``[DONE]``).
    ``timeout_s``: the whole request's deadline (host s); leaving it closes the stream, which
    the server counts as a disconnect and cancels."""
    return await _timed(_stream_sse(client, CHAT_PATH, body, shape, headers, native=False), shape, timeout_s)


async def stream_completion(client: httpx.AsyncClient, body: Mapping[str, Any], shape: str,
                            headers: Mapping[str, str] | None = None, timeout_s: float | None = None) -> Record:
    """The same for llama.cpp's native streaming ``/completion`` (``stream: true``; a prompt of
    token ids is sent as given, no chat template): content chunks ``{"content", "stop": false}``,
    then one ``"stop": true`` chunk with ``tokens_evaluated`` (prompt tokens), ``tokens_predicted``
    (n) and ``timings``, and no ``[DONE]``. E2E ends at that final chunk; TTFT, ITL and TPOT as above."""
    return await _timed(_stream_sse(client, COMPLETION_PATH, body, shape, headers, native=True), shape, timeout_s)


async def _timed(coro: Awaitable[Record], shape: str, timeout_s: float | None) -> Record:
    try:
        async with asyncio.timeout(timeout_s):
            return await coro
    except TimeoutError:
        return Record(shape, error=f"no complete reply within {timeout_s:g} s")


async def _stream_sse(client: httpx.AsyncClient, path: str, body: Mapping[str, Any], shape: str,
                      headers: Mapping[str, str] | None, *, native: bool) -> Record:
    rec = Record(shape)
    first = last_content = last_data = None
    usage: dict[str, Any] | None = None
    done = False
    st = time.perf_counter()
    try:
        async with aconnect_sse(client, "POST", path, json=dict(body), headers=dict(headers or {})) as es:
            r = es.response
            if r.status_code != 200:
                rec.error = _error_text(r.status_code, await r.aread())
                return rec
            async for ev in es.aiter_sse():
                now = time.perf_counter()
                if ev.data == "[DONE]":
                    done = True
                    break
                try:
                    d = json.loads(ev.data)
                except ValueError:
                    rec.error = f"a data event is not JSON: {ev.data[:80]!r}"
                    return rec
                if not isinstance(d, dict):
                    rec.error = f"a data event is not a JSON object: {ev.data[:80]!r}"
                    return rec
                if "error" in d:
                    e = d["error"] if isinstance(d["error"], dict) else {"message": d["error"]}
                    rec.error = f"error event: {e.get('type', '')}: {e.get('message', '')}"
                    return rec
                if native:
                    content = d.get("content")
                    final = d.get("stop") is True
                else:
                    choices = d.get("choices")
                    content = (choices[0].get("delta") or {}).get("content") if choices else None
                    final = False
                if content:
                    if last_content is None:
                        first = now
                    else:
                        rec.itl_ms.append((now - last_content) * 1e3)
                    last_content = now
                    rec.arrivals_ms.append((now - st) * 1e3)
                    n_so_far = d.get("tokens_predicted") if native else None
                    rec.arrival_tokens.append(n_so_far if isinstance(n_so_far, int) else len(rec.arrivals_ms))
                if d.get("usage"):
                    usage = d["usage"]
                ext = d.get("calconsole")  # calconsole serve's full timings (llama-server's stay numbers-only)
                if isinstance(ext, dict) and isinstance(ext.get("timings"), dict):
                    rec.server = ext["timings"]
                elif isinstance(d.get("timings"), dict) and (final or not native):
                    rec.server = d["timings"]
                last_data = now
                if final:  # /completion's last chunk: the counts llama-server reports, then the stream ends
                    usage = {"prompt_tokens": d.get("tokens_evaluated", 0),
                             "completion_tokens": d.get("tokens_predicted", 0)}
                    rec.final = {k: v for k, v in d.items() if k not in ("content", "tokens", "timings")}
                    done = True
                    break
    except SSEError as e:
        rec.error = f"not an SSE stream: {e}"
        return rec
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return rec
    if not done:
        rec.error = "stream ended without its final chunk" if native else "stream ended without [DONE]"
    elif usage is None:
        rec.error = "no usage chunk (stream_options.include_usage not honoured)"
    elif first is None:
        rec.error = "no content chunk: nothing to time TTFT by"  # vLLM also counts this request failed
    else:
        assert last_data is not None
        rec.ok = True
        rec.ttft_ms = (first - st) * 1e3
        rec.e2e_ms = (last_data - st) * 1e3
        rec.prompt_tokens = int(usage.get("prompt_tokens", 0))
        rec.output_tokens = int(usage.get("completion_tokens", 0))
    return rec


# --- closed loop ---------------------------------------------------------------------------------

async def closed_loop(send: Callable[[int], Awaitable[Record]], clients: int, *, n_requests: int | None = None,
                      duration_s: float | None = None) -> tuple[list[Record], float]:
    """``clients`` tasks, each sending request i = 0, 1, ... (shared counter) when its previous one
    ended, until ``n_requests`` were sent or ``duration_s`` (host wall s) passed; requests in
    flight then still finish. Returns (records in completion order, wall seconds of the run)."""
    if n_requests is None and duration_s is None:
        raise ValueError("closed_loop needs n_requests or duration_s")
    counter = itertools.count()
    records: list[Record] = []
    t0 = time.perf_counter()
    deadline = t0 + duration_s if duration_s is not None else math.inf

    async def client_task() -> None:
        while time.perf_counter() < deadline:
            i = next(counter)
            if n_requests is not None and i >= n_requests:
                return
            records.append(await send(i))

    await asyncio.gather(*(client_task() for _ in range(clients)))
    return records, time.perf_counter() - t0


def plane_closed_loop(inference: Any, requests: Sequence[tuple[str, Any]], clients: int,
                      timeout_s: float) -> tuple[list[Record], float]:
    """The same closed loop straight on an inference plane (``sim_backend.planes.InferencePlane``):
    ``clients`` threads submit ``(shape, ChatRequest)`` items in order and time TokenEvents with
    visible text as the HTTP client times content chunks (TTFT, ITL; E2E to the DoneEvent;
    n = the result's ``predicted_n``). Host wall ms; the no-HTTP baseline of the overhead."""
    from sim_backend.planes import CalError, DoneEvent, TokenEvent

    lock = threading.Lock()
    todo = iter(requests)
    records: list[Record] = []

    def worker() -> None:
        while True:
            with lock:
                item = next(todo, None)
            if item is None:
                return
            shape, req = item
            rec = Record(shape)
            st = time.perf_counter()
            deadline = st + timeout_s
            first = last = None
            try:
                h = inference.submit(req)
                while True:
                    ev = h.next_event(max(0.01, deadline - time.perf_counter()))
                    now = time.perf_counter()
                    if ev is None:
                        if now >= deadline:
                            h.cancel("bench timeout")
                            rec.error = f"no result within {timeout_s:g} s"
                            break
                        continue
                    if isinstance(ev, TokenEvent) and ev.text:
                        if last is None:
                            first = now
                        else:
                            rec.itl_ms.append((now - last) * 1e3)
                        last = now
                    elif isinstance(ev, DoneEvent):
                        res = ev.result
                        if res.status != "finished":
                            rec.error = f"{res.status}: {(res.error or {}).get('message', '')}"
                        elif first is None:
                            rec.error = "no visible token"
                        else:
                            rec.ok = True
                            rec.ttft_ms = (first - st) * 1e3
                            rec.e2e_ms = (now - st) * 1e3
                            rec.output_tokens = res.timings.predicted_n
                            rec.prompt_tokens = res.timings.prompt_n + res.timings.cache_n
                            rec.server = res.timings.to_dict()
                        break
            except CalError as e:
                rec.error = f"{type(e).__name__}: {e}"
            with lock:
                records.append(rec)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, name=f"bench-plane-{i}", daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * max(1, len(requests)) + 10.0)
    return records, time.perf_counter() - t0


# --- statistics ----------------------------------------------------------------------------------

def dist(values: Sequence[float | None]) -> dict[str, Any] | None:
    """{n, mean, p50, p95, p99} (numpy's linear percentiles, as vLLM) of the non-None values; None if none."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return None
    out: dict[str, Any] = {"n": int(v.size), "mean": float(v.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(v, p))
    return out


def _met(slo: Any, ttft: float | None, tpot: float | None, e2e: float | None) -> bool:
    """vLLM's goodput test (each configured SLO >= the value; TPOT of a 1-token reply counts as 0)."""
    if slo is None:
        return True
    return bool(slo.met(ttft, tpot if tpot is not None else 0.0, e2e if e2e is not None else math.inf))


def summarize(records: Sequence[Record], duration_s: float, slo: Any = None) -> dict[str, Any]:
    """Counts, client-side distributions (host wall ms), throughput and goodput (per wall second of
    the run), and the server's final-chunk timings (simulated ms) of the same requests.

    ``slo``: ``sim_backend.planes.SLO`` (ms) or None; applied to the client figures (wall ms) for
    the client goodput and to the server's figures (simulated ms) for the server goodput."""
    ok = [r for r in records if r.ok]
    dur = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    good = [r for r in ok if _met(slo, r.ttft_ms, r.tpot_ms, r.e2e_ms)]
    srv = [r.server for r in ok if r.server is not None]
    good_srv = [r for r in ok if r.server is not None
                and _met(slo, r.server.get("ttft_ms"), r.server.get("tpot_ms"), r.server.get("e2e_ms"))]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[str(r.error)] = errors.get(str(r.error), 0) + 1
    by_shape: dict[str, int] = {}
    for r in records:
        by_shape[r.shape] = by_shape.get(r.shape, 0) + 1
    return {
        "requests": {"sent": len(records), "completed": len(ok), "failed": len(records) - len(ok),
                     "by_shape": by_shape, "errors": errors},
        "duration_s": duration_s,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "prompt_tokens_per_request": dist([r.prompt_tokens for r in ok]),
        "client": {
            "clock": "host wall ms (client side)",
            "ttft_ms": dist([r.ttft_ms for r in ok]), "tpot_ms": dist([r.tpot_ms for r in ok]),
            "itl_ms": dist([g for r in ok for g in r.itl_ms]), "e2e_ms": dist([r.e2e_ms for r in ok]),
            "request_throughput_rps": len(ok) / dur, "output_throughput_tok_s": out_tokens / dur,
            "total_token_throughput_tok_s": (in_tokens + out_tokens) / dur,
            "good_requests": len(good) if slo is not None else None,
            "request_goodput_rps": len(good) / dur if slo is not None else None,
            "goodput_tok_s": sum(r.output_tokens or 0 for r in good) / dur if slo is not None else None,
        },
        "server_timings": {
            "clock": "simulated device ms (final chunk 'timings')",
            "ttft_ms": dist([t.get("ttft_ms") for t in srv]), "tpot_ms": dist([t.get("tpot_ms") for t in srv]),
            "itl_ms": dist([g for t in srv for g in (t.get("itl_ms") or [])]),
            "e2e_ms": dist([t.get("e2e_ms") for t in srv]), "queue_ms": dist([t.get("queue_ms") for t in srv]),
            "good_requests": len(good_srv) if slo is not None else None,
        },
    }


def mean_itl(rec: Record) -> float | None:
    """Mean client gap (ms) between content chunks: decode span / gaps; None with fewer than 2 chunks."""
    return sum(rec.itl_ms) / len(rec.itl_ms) if rec.itl_ms else None


def mean_sim_itl(rec: Record) -> float | None:
    """Mean simulated gap (ms) between visible pieces from the server's final-chunk ``itl_ms``."""
    itl = (rec.server or {}).get("itl_ms") or []
    return sum(itl) / len(itl) if itl else None


# --- /metrics ------------------------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, Any]:
    """Prometheus text -> {"samples": {name: value} (unlabelled samples), "histograms": {family:
    {"buckets": [(le, cumulative count)], "count", "sum"}}}. ValueError on text that does not parse."""
    samples: dict[str, float] = {}
    hists: dict[str, dict[str, Any]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "histogram":
            h = hists.setdefault(fam.name, {"buckets": [], "count": 0.0, "sum": 0.0})
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    h["buckets"].append((float(s.labels["le"]), float(s.value)))
                elif s.name.endswith("_count"):
                    h["count"] = float(s.value)
                elif s.name.endswith("_sum"):
                    h["sum"] = float(s.value)
            h["buckets"].sort()
            continue
        for s in fam.samples:
            if not s.labels:
                samples[s.name] = float(s.value)
    return {"samples": samples, "histograms": hists}


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile`` on cumulative buckets [(le, count)] (le ascending, +Inf
    last): linear interpolation inside the bucket holding rank q * total; in the +Inf bucket the
    upper bound of the last finite one. None for an empty histogram."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_le, lo_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo_le
            if count == lo_count:
                return le
            return lo_le + (le - lo_le) * (rank - lo_count) / (count - lo_count)
        lo_le, lo_count = le, count
    return lo_le


def metrics_delta(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, Any]:
    """What changed on the server between two ``parse_metrics`` results: the ``llamacpp:`` counters
    of COUNTERS and, per histogram of HISTOGRAMS, the count, the mean and P50/P95/P99 of the new
    samples in SIMULATED ms (bucket-interpolated; see ``histogram_quantile``)."""
    sb, sa = before["samples"], after["samples"]
    counters = {c: sa.get(f"llamacpp:{c}", 0.0) - sb.get(f"llamacpp:{c}", 0.0) for c in COUNTERS
                if f"llamacpp:{c}" in sa}
    hists: dict[str, Any] = {}
    for key, fam in HISTOGRAMS.items():
        ha, hb = after["histograms"].get(fam), before["histograms"].get(fam)
        if ha is None:
            continue
        prev = dict(hb["buckets"]) if hb else {}
        buckets = [(le, c - prev.get(le, 0.0)) for le, c in ha["buckets"]]
        n = ha["count"] - (hb["count"] if hb else 0.0)
        s = ha["sum"] - (hb["sum"] if hb else 0.0)
        entry: dict[str, Any] = {"count": int(round(n)), "mean": s / n * 1e3 if n > 0 else None}
        for p in PERCENTILES:
            v = histogram_quantile(p / 100, buckets)
            entry[f"p{p}"] = v * 1e3 if v is not None else None
        hists[key] = entry
    return {"clock": "simulated device ms (histograms in simulated s; quantiles interpolated in buckets)",
            "counters": {k: int(round(v)) if float(v).is_integer() else v for k, v in counters.items()},
            "histograms": hists}


async def scrape(client: httpx.AsyncClient, headers: Mapping[str, str] | None = None
                 ) -> tuple[dict[str, Any] | None, str | None]:
    """GET /metrics parsed, or (None, the reason it is not available)."""
    try:
        r = await client.get("/metrics", headers=dict(headers or {}))
    except httpx.HTTPError as e:
        return None, f"/metrics: {type(e).__name__}: {e}"
    if r.status_code != 200:
        return None, _error_text(r.status_code, r.content)
    try:
        return parse_metrics(r.text), None
    except ValueError as e:
        return None, f"/metrics is not Prometheus text: {e}"


# --- prompts of a given length -------------------------------------------------------------------

async def count_prompt_tokens(client: httpx.AsyncClient, text: str, headers: Mapping[str, str]) -> int:
    """Tokens of ``text`` as one user message after the server's chat template (POST /apply-template:
    our ``n_prompt_tokens``, or llama-server's templated ``prompt`` counted by POST /tokenize)."""
    body = {"messages": [{"role": "user", "content": text}]}
    try:
        r = await client.post("/apply-template", json=body, headers=dict(headers))
        if r.status_code != 200:
            raise BenchError(f"POST /apply-template: {_error_text(r.status_code, r.content)}")
        d = r.json()
        if isinstance(d.get("n_prompt_tokens"), int):
            return int(d["n_prompt_tokens"])
        r = await client.post("/tokenize", json={"content": d.get("prompt", ""), "parse_special": True},
                              headers=dict(headers))
        if r.status_code != 200:
            raise BenchError(f"POST /tokenize: {_error_text(r.status_code, r.content)}")
        return len(r.json()["tokens"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise BenchError(f"cannot count prompt tokens on the server: {type(e).__name__}: {e}") from None


async def words_for(client: httpx.AsyncClient, shape: Shape, seed: int, headers: Mapping[str, str]) -> int:
    """How many words ``prompt_text`` needs so the templated prompt has ``shape.prompt_tokens`` tokens
    (measured on the server; prompts shorter than the template's own tokens get one word)."""
    n0 = await count_prompt_tokens(client, prompt_text(0, 1, seed), headers)
    words = max(1, shape.prompt_tokens - n0 + 1)
    for _ in range(3):  # one word per token; a second look only if the tokenizer merged something
        n = await count_prompt_tokens(client, prompt_text(0, words, seed), headers)
        if n == shape.prompt_tokens or words == 1 and n > shape.prompt_tokens:
            break
        words = max(1, words + shape.prompt_tokens - n)
    return words
