"""Request metrics with the field's definitions (facts.md F7), aggregates and
Prometheus exposition in llama.cpp's ``llamacpp:`` style.

At the planes' seam (it imports nothing of serving, runtime, device or model): the serving engine
records into a ``MetricsRegistry``, and so does a client plane that measures requests itself
(the llama-server planes, in wall ms).

Definitions (all in simulated milliseconds on the device clock, which
includes the host work the engine books on it: the fitted allowance per
token, or this machine's measured work; ``MetricsRegistry.clock``):
- TTFT: request in -> first visible token (or, if no token was ever shown,
  the first token sampled).
- TPOT: (E2E - TTFT) / (n - 1) for n generated tokens; absent when n == 1.
- ITL: every gap between consecutive visible pieces, the first excluded.
- E2E: request in -> done. Queue time: request in -> slot assigned.
- Goodput (vLLM ``--goodput``): finished requests meeting every configured
  SLO (``ttft``, ``tpot``, ``e2el`` in ms; a value <= its SLO meets it; a
  one-token request's TPOT counts as 0), divided by the span from the first
  recorded arrival to the last recorded end (simulated s). Also reported as
  tokens/s of those requests.

Aggregates (P50/P95/P99, mean) are over a window of the most recent
``window`` samples of each latency; the Prometheus histograms and counters
are cumulative since start. Which requests give samples (as vLLM's
``time_to_first_token_seconds`` / ``inter_token_latency_seconds`` and
llama.cpp count them):
- TTFT: EVERY request that produced a first token, whatever its end
  (finished, cancelled or stopped by the user, failed), recorded when that
  token is produced (``on_first_token``); a request ended before its first
  token gives none.
- ITL: every gap between pieces that were actually streamed, of every
  request, recorded as each piece is streamed (``on_token_gap``).
- E2E and TPOT: FINISHED requests only (``on_done``): a cancelled or failed
  request's duration says when it was stopped, not how long a reply takes.
- Queue time: every request that got a slot.
Leaving stopped replies out of TTFT would bias it toward short replies.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from sim_backend.planes.types import SLO

__all__ = ["SLO", "MetricsRegistry", "PromFamily", "exposition", "percentiles", "request_latencies"]

# Histogram bucket upper bounds in seconds (Prometheus convention is base units).
LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: Which requests each latency's samples come from (said in the snapshot and the Prometheus HELP).
SAMPLED_FROM = {
    "ttft": "every request that produced a first token (finished, cancelled or failed after it)",
    "itl": "every streamed piece after the first, of every request (finished, cancelled or failed)",
    "e2e": "finished requests only",
    "tpot": "finished requests with 2 or more tokens only",
    "queue": "every request that got a slot",
}


def request_latencies(arrival_ms: float, piece_times_ms: Sequence[float], done_ms: float,
                      n_tokens: int) -> tuple[float | None, float | None, tuple[float, ...], float]:
    """Compute (TTFT, TPOT, ITL, E2E) in ms from timestamps on one clock.

    piece_times_ms: times at which visible pieces reached the client, in order.
    n_tokens: generated tokens (predicted_n). TTFT is None when nothing was
    shown; TPOT is None when n_tokens < 2 or TTFT is None.
    """
    e2e = done_ms - arrival_ms
    if not piece_times_ms:
        return None, None, (), e2e
    ttft = piece_times_ms[0] - arrival_ms
    itl = tuple(float(b - a) for a, b in pairwise(piece_times_ms))
    tpot = (e2e - ttft) / (n_tokens - 1) if n_tokens > 1 else None
    return ttft, tpot, itl, e2e


def percentiles(values: Iterable[float], qs: Sequence[float] = (50, 95, 99)) -> dict[str, float | None]:
    """{"p50": .., "p95": .., "p99": .., "mean": .., "n": ..}; None values when empty."""
    arr = np.asarray(list(values), dtype=np.float64)
    at = np.percentile(arr, list(qs)) if arr.size else [None] * len(qs)  # one call for every q: the same values
    out: dict[str, float | None] = {f"p{int(q)}": (None if v is None else float(v))
                                    for q, v in zip(qs, at, strict=True)}
    out["mean"] = float(arr.mean()) if arr.size else None
    out["n"] = int(arr.size)
    return out


class _Hist:
    """Cumulative histogram (seconds) + a bounded window of recent samples (ms)."""

    def __init__(self, window: int) -> None:
        self.counts = np.zeros(len(LATENCY_BUCKETS_S), dtype=np.int64)
        self.count = 0
        self.sum_s = 0.0
        self.recent: deque[float] = deque(maxlen=window)
        self._summary: dict[str, float | None] | None = None  # percentiles of ``recent``, until the next sample

    def observe_ms(self, ms: float) -> None:
        s = ms / 1e3
        self.counts += np.asarray(LATENCY_BUCKETS_S) >= s
        self.count += 1
        self.sum_s += s
        self.recent.append(ms)
        self._summary = None

    def summary(self) -> dict[str, float | None]:
        """``percentiles(recent)``, computed once per new sample: the console asks twice a second, and on
        an idle console the same answer cost ~0.9 ms of numpy a snapshot once a request had finished."""
        if self._summary is None:
            self._summary = percentiles(self.recent)
        return dict(self._summary)


class MetricsRegistry:
    """Thread-safe aggregate of finished requests and live gauges.

    Request-state gauges come from the engine through ``set_live``; the
    counters balance: submitted = finished + failed + cancelled + queued + running.
    """

    #: what the latencies' clock includes; the engine sets it from its HostBooking
    clock: str = "simulated device ms (includes the host work booked on the clock)"

    def __init__(self, window: int = 1000, slo: SLO | None = None) -> None:
        self._lock = threading.Lock()
        self.slo = slo if slo is not None else SLO()
        self.submitted = self.finished = self.failed = self.cancelled = self.rejected = 0
        self.prompt_tokens = self.predicted_tokens = self.cache_tokens = 0
        self.prompt_ms_total = self.predicted_ms_total = 0.0
        # llama.cpp's decode-call counters: device steps (prefill chunks and decode steps alike), the
        # slots busy summed over them, and the longest sequence (prompt + generated) seen
        self.n_decode = self.n_busy_slots_total = self.n_tokens_max = 0
        self.good_requests = self.good_tokens = 0
        self.hist = {k: _Hist(window) for k in ("ttft", "itl", "e2e", "tpot", "queue")}
        self.queued = self.running = 0
        self.kv_usage_ratio = 0.0
        self.first_arrival_ms: float | None = None
        self.last_done_ms: float | None = None
        # (sim ms, tokens/s) history for sparklines
        self.history: deque[tuple[float, float, float, float]] = deque(maxlen=600)

    def set_live(self, queued: int, running: int, kv_usage_ratio: float) -> None:
        with self._lock:
            self.queued, self.running, self.kv_usage_ratio = queued, running, kv_usage_ratio

    def on_submitted(self, live: tuple[int, int, float] | None = None) -> None:
        """A request was accepted. ``live`` = (queued, running, kv ratio) after it, set atomically
        so the counters balance at every moment."""
        with self._lock:
            self.submitted += 1
            if live is not None:
                self.queued, self.running, self.kv_usage_ratio = live

    def on_decode(self, n_busy_slots: int) -> None:
        """One device step ran (llama.cpp: one ``llama_decode`` call) while ``n_busy_slots`` slots held requests."""
        with self._lock:
            self.n_decode += 1
            self.n_busy_slots_total += n_busy_slots

    def on_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def on_first_token(self, ttft_ms: float) -> None:
        """A request produced its first token ``ttft_ms`` simulated ms after it arrived.

        Called once per request at that moment, whatever the request's end
        will be (vLLM and llama.cpp count TTFT this way).
        """
        with self._lock:
            self.hist["ttft"].observe_ms(ttft_ms)

    def on_token_gap(self, itl_ms: float) -> None:
        """A piece was streamed ``itl_ms`` simulated ms after the request's previous piece (one ITL sample)."""
        with self._lock:
            self.hist["itl"].observe_ms(itl_ms)

    def on_done(self, status: str, *, prompt_n: int, cache_n: int, predicted_n: int, prompt_ms: float,
                predicted_ms: float, ttft: float | None, tpot: float | None, itl: Sequence[float], e2e: float,
                queue_ms: float | None, done_ms: float, arrival_ms: float | None = None,
                live: tuple[int, int, float] | None = None) -> None:
        """Record a request that ended (status finished | failed | cancelled). Times in simulated ms.

        E2E and TPOT samples (and goodput) come from finished requests only.
        ``ttft`` and ``itl`` are NOT recorded here: the engine recorded them as
        the tokens were produced (``on_first_token`` / ``on_token_gap``), for
        every request; ``ttft`` is used for the SLO check and the history.
        prompt_n: prompt tokens whose KV was written (cached prefix included);
        cache_n: the reused prefix, so ``prompt_tokens_total`` grows by
        ``prompt_n - cache_n`` (processed tokens, as llama.cpp counts them).
        ``live`` = (queued, running, kv ratio) after the request left, set atomically.
        """
        with self._lock:
            if live is not None:
                self.queued, self.running, self.kv_usage_ratio = live
            if status == "finished":
                self.finished += 1
            elif status == "cancelled":
                self.cancelled += 1
            else:
                self.failed += 1
            self.prompt_tokens += prompt_n - cache_n
            self.cache_tokens += cache_n
            self.n_tokens_max = max(self.n_tokens_max, prompt_n + predicted_n)
            self.predicted_tokens += predicted_n
            self.prompt_ms_total += prompt_ms
            self.predicted_ms_total += predicted_ms
            if queue_ms is not None:
                self.hist["queue"].observe_ms(queue_ms)
            if status == "finished":
                if tpot is not None:
                    self.hist["tpot"].observe_ms(tpot)
                self.hist["e2e"].observe_ms(e2e)
                if self.slo.met(ttft, tpot, e2e):
                    self.good_requests += 1
                    self.good_tokens += predicted_n
            start = arrival_ms if arrival_ms is not None else done_ms - e2e
            if self.first_arrival_ms is None or start < self.first_arrival_ms:
                self.first_arrival_ms = start  # earliest arrival among recorded requests
            if self.last_done_ms is None or done_ms > self.last_done_ms:
                self.last_done_ms = done_ms
            tps = predicted_n / (predicted_ms / 1e3) if predicted_ms > 0 else 0.0
            self.history.append((done_ms, tps, ttft if ttft is not None else float("nan"), e2e))

    def summary(self) -> dict[str, Any]:
        """JSON-friendly aggregates: counters, P50/P95/P99 of each latency (sim ms), goodput."""
        with self._lock:
            span_s = ((self.last_done_ms or 0) - (self.first_arrival_ms or 0)) / 1e3
            return {
                "counters": {
                    "submitted": self.submitted, "finished": self.finished, "failed": self.failed,
                    "cancelled": self.cancelled, "queued": self.queued, "running": self.running,
                    "rejected": self.rejected,
                },
                "balanced": self.submitted == self.finished + self.failed + self.cancelled + self.queued + self.running,
                "tokens": {"prompt": self.prompt_tokens, "cached": self.cache_tokens,
                           "predicted": self.predicted_tokens},
                "latency_ms": {k: h.summary() for k, h in self.hist.items()},
                "latency_sampled_from": dict(SAMPLED_FROM),
                "goodput": {
                    "slo": self.slo.to_dict(),
                    "good_requests": self.good_requests,
                    "good_fraction": self.good_requests / self.finished if self.finished else None,
                    "span_s": span_s,
                    "requests_per_s": self.good_requests / span_s if span_s > 0 else None,
                    "tokens_per_s": self.good_tokens / span_s if span_s > 0 else None,
                },
                "kv_cache_usage_ratio": self.kv_usage_ratio,
                "clock": self.clock,
            }

    def history_series(self) -> dict[str, list[float]]:
        """Recent per-request series for sparklines: tokens/s, TTFT ms, E2E ms (oldest first)."""
        with self._lock:
            h = list(self.history)
        return {"tokens_per_s": [x[1] for x in h], "ttft_ms": [x[2] for x in h], "e2e_ms": [x[3] for x in h]}

    # --- Prometheus ---------------------------------------------------------------

    def families(self) -> list[PromFamily]:
        """The metric families of ``/metrics``, in llama-server's order and with its exact names and types.

        llama-server's families first (checked against a real one: tests/server/test_parity_llama_server.py),
        then ours (request counters, KV ratio, latency histograms). Counters are cumulative since start;
        times are simulated device seconds.
        """
        with self._lock:
            def counter(name: str, doc: str, v: float) -> PromFamily:
                return PromFamily(f"llamacpp:{name}", "counter", doc, ((f"llamacpp:{name}", (), v),))

            def gauge(name: str, doc: str, v: float) -> PromFamily:
                return PromFamily(f"llamacpp:{name}", "gauge", doc, ((f"llamacpp:{name}", (), v),))

            pt = self.prompt_ms_total / 1e3
            gt = self.predicted_ms_total / 1e3
            out = [
                counter("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens",
                        self.prompt_tokens),
                counter("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache",
                        self.cache_tokens),
                counter("prompt_seconds_total", "Total time spent processing prompts (simulated device seconds)",
                        pt),
                counter("tokens_predicted_total", "Number of generation tokens processed", self.predicted_tokens),
                counter("tokens_predicted_seconds_total",
                        "Total time spent generating tokens (simulated device seconds)", gt),
                counter("n_decode_total", "Total number of device steps (llama_decode() calls)", self.n_decode),
                # llama-server types this maximum a counter and gives it no _total suffix: so do we
                counter("n_tokens_max", "Largest observed sequence length (prompt + generation)", self.n_tokens_max),
                # no draft model: speculative decoding never runs, its counters stay 0 (llama.cpp exports them anyway)
                counter("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
                counter("spec_decode_num_accepted_tokens_total",
                        "Speculative: Total draft tokens accepted by the target model", 0),
                counter("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps",
                        0),
                gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
                      self.prompt_tokens / pt if pt > 0 else 0.0),
                gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s",
                      self.predicted_tokens / gt if gt > 0 else 0.0),
                gauge("requests_processing", "Number of requests processing", self.running),
                gauge("requests_deferred", "Number of requests deferred (queued)", self.queued),
                gauge("n_busy_slots_per_decode", "Average number of busy slots per device step (llama_decode() call)",
                      self.n_busy_slots_total / self.n_decode if self.n_decode else 0.0),
                # ours beyond llama-server's
                counter("requests_submitted_total", "Requests accepted into the queue", self.submitted),
                counter("requests_finished_total", "Requests that finished", self.finished),
                counter("requests_failed_total", "Requests that failed with an error", self.failed),
                counter("requests_cancelled_total", "Requests cancelled by the client or maintenance", self.cancelled),
                counter("requests_rejected_total", "Requests refused at admission", self.rejected),
                counter("requests_good_total", "Finished requests meeting every configured SLO (goodput)",
                        self.good_requests),
                gauge("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage", self.kv_usage_ratio),
            ]
            for key, name, doc in (("ttft", "time_to_first_token_seconds", "Time to first token"),
                                   ("itl", "inter_token_latency_seconds", "Inter-token latency"),
                                   ("e2e", "e2e_request_latency_seconds", "End-to-end request latency"),
                                   ("tpot", "time_per_output_token_seconds", "Time per output token"),
                                   ("queue", "request_queue_time_seconds", "Time in queue before a slot")):
                h = self.hist[key]
                full = f"llamacpp:{name}"
                samples: list[PromSample] = [(f"{full}_bucket", (("le", _go_float(b)),), int(c))
                                             for b, c in zip(LATENCY_BUCKETS_S, h.counts, strict=True)]
                samples += [(f"{full}_bucket", (("le", "+Inf"),), h.count), (f"{full}_count", (), h.count),
                            (f"{full}_sum", (), h.sum_s)]
                out.append(PromFamily(full, "histogram",
                                      f"{doc} (simulated device seconds); samples from {SAMPLED_FROM[key]}.",
                                      tuple(samples)))
            return out

    def prometheus_text(self) -> str:
        """Prometheus text exposition format (version 0.0.4) of ``families()``, written here rather than by a
        client library so the names and types are exactly llama-server's whatever library is installed
        (prometheus_client 0.26 renames a counter without ``_total``, as llama-server's ``n_tokens_max``)."""
        return exposition(self.families())


#: one sample: (name, ((label, value), ...), value)
PromSample = tuple[str, tuple[tuple[str, str], ...], float]


@dataclass(frozen=True)
class PromFamily:
    """One metric family of a Prometheus text exposition: ``# HELP``, ``# TYPE`` and its samples.

    ``type``: "counter" | "gauge" | "histogram"; ``samples`` written as given (a histogram's ``_bucket`` with
    its ``le`` label, ``_count``, ``_sum``).
    """

    name: str
    type: str
    help: str
    samples: tuple[PromSample, ...]


def _go_float(v: float) -> str:
    """A sample value as Prometheus writes one: integers without a fraction, ``+Inf`` / ``-Inf`` / ``NaN``."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return str(int(v))
    f = float(v)
    if math.isnan(f):
        return "NaN"
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return repr(f)


def _escape(text: str, quote: bool) -> str:
    out = text.replace("\\", "\\\\").replace("\n", "\\n")
    return out.replace('"', '\\"') if quote else out


def exposition(families: Iterable[PromFamily]) -> str:
    """Prometheus text format 0.0.4 (prometheus.io/docs/instrumenting/exposition_formats): for each family a
    ``# HELP name text`` line (backslash and newline escaped), a ``# TYPE name type`` line, then one line per
    sample, ``name{label="value",...} value`` (label values also escape the double quote)."""
    lines: list[str] = []
    for fam in families:
        lines.append(f"# HELP {fam.name} {_escape(fam.help, False)}")
        lines.append(f"# TYPE {fam.name} {fam.type}")
        for name, labels, value in fam.samples:
            lab = ",".join(f'{k}="{_escape(v, True)}"' for k, v in labels)
            lines.append(f"{name}{{{lab}}} {_go_float(value)}" if labels else f"{name} {_go_float(value)}")
    return "\n".join(lines) + "\n"
