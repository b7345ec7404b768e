"""``ObservationPlane`` of a stock llama-server: polled from its own routes into the typed ``Snapshot``.

One ``snapshot()`` reads ``GET /health`` (ok | loading | error), ``GET /slots`` (when the server was
started with ``--slots``) and ``GET /metrics`` (with ``--metrics``; the ``llamacpp:`` families parsed
by ``prometheus_client``'s text parser); ``/props`` (model, n_ctx, total_slots, chat template, build)
was read at attach and is read again when the link comes back (the server may have been restarted).

What a llama-server reports fills ``Snapshot.server`` (``ServerInfo``), ``slots`` and ``load``; the
request metrics (``requests``, ``history``) are the requests THIS console sent, measured as client
(``ClientMetrics``). Everything only the simulator has (device, jobs, KV, steps, memory, stages, host,
findings, the simulated clock) is None: absent, not zero. KV use is in ``ServerInfo`` when the build
exports ``llamacpp:kv_cache_usage_ratio`` / ``kv_cache_tokens`` (newer builds do not).

Load (``LoadInfo``, clock "llama-server wall time"): from two samples of the cumulative counters at
least ``interval_s`` apart (the newest such pair): ``busy_percent`` = growth of
``prompt_seconds_total + tokens_predicted_seconds_total`` over the wall window (capped at 100: the
server sums its slots' times, which overlap when slots run together), ``output_tokens_per_s`` =
growth of ``tokens_predicted_total`` per wall second. None before two samples or without /metrics.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sim_backend.planes import CalError, Health, Snapshot
from sim_backend.planes.snapshot import LoadInfo, RequestsView, ServerInfo, SlotView, convert

from ..connection import Connection, health_of, raise_for
from .inference import ClientMetrics

READ_S = 10.0
LOAD_CLOCK = "llama-server wall time"
#: llamacpp: sample -> ServerInfo field
COUNTERS = {
    "llamacpp:prompt_tokens_total": "prompt_tokens_total",
    "llamacpp:prompt_tokens_cached_total": "prompt_tokens_cached_total",
    "llamacpp:prompt_seconds_total": "prompt_seconds_total",
    "llamacpp:tokens_predicted_total": "tokens_predicted_total",
    "llamacpp:tokens_predicted_seconds_total": "tokens_predicted_seconds_total",
    "llamacpp:n_decode_total": "n_decode_total",
    "llamacpp:n_tokens_max": "n_tokens_max",
    # llama-server types n_tokens_max as a counter without the _total suffix (and so does calconsole serve
    # since it writes its own exposition); a calconsole before that wrote it through prometheus_client,
    # which appends _total to a counter's sample: the sample arrives under this name from one of those
    "llamacpp:n_tokens_max_total": "n_tokens_max",
    "llamacpp:prompt_tokens_seconds": "prompt_tokens_seconds",
    "llamacpp:predicted_tokens_seconds": "predicted_tokens_seconds",
    "llamacpp:requests_processing": "requests_processing",
    "llamacpp:requests_deferred": "requests_deferred",
    "llamacpp:n_busy_slots_per_decode": "n_busy_slots_per_decode",
    "llamacpp:kv_cache_usage_ratio": "kv_cache_usage_ratio",
    "llamacpp:kv_cache_tokens": "kv_cache_tokens",
}
_INTS = {"prompt_tokens_total", "prompt_tokens_cached_total", "tokens_predicted_total", "n_decode_total",
         "n_tokens_max", "requests_processing", "requests_deferred", "kv_cache_tokens"}


def parse_metrics(text: str) -> dict[str, float | int]:
    """The ``llamacpp:`` samples of a Prometheus text exposition, as ``ServerInfo`` field -> value.
    CalError for text the parser refuses."""
    out: dict[str, float | int] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                field = COUNTERS.get(sample.name)
                if field is not None and not sample.labels:
                    out[field] = int(sample.value) if field in _INTS else float(sample.value)
    except ValueError as e:
        raise CalError(f"llama-server /metrics is not Prometheus text: {e}") from None
    return out


def slot_view(s: Mapping[str, Any]) -> SlotView:
    """One ``/slots`` entry as a ``SlotView`` (counts None where the server did not report them).

    An idle slot that has run keeps, in llama-server's ``/slots``, its last task's ``id_task``, prompt counts
    and ``params``: they stay in the view (``last_request_id``, ``max_tokens``, ``params``), while
    ``request_id`` is None (no request running)."""
    busy = bool(s.get("is_processing"))
    nxt = s.get("next_token")
    decoded = None
    if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict):
        decoded = nxt[0].get("n_decoded")
    elif isinstance(nxt, dict):
        decoded = nxt.get("n_decoded")
    raw = s.get("params")
    params: dict[str, Any] = raw if isinstance(raw, dict) else {}
    keep = ("temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "presence_penalty",
            "frequency_penalty", "n_predict")
    task = _int(s.get("id_task"))
    return SlotView(index=int(s["id"]), state="processing" if busy else "idle",
                    request_id=task if busy else None,
                    prompt_n=_int(s.get("n_prompt_tokens")), n_prefilled=_int(s.get("n_prompt_tokens_processed")),
                    predicted_n=_int(decoded), cached_tokens=_int(s.get("n_prompt_tokens_cache")),
                    max_tokens=int(params.get("n_predict", 0) or 0),
                    params={k: params[k] for k in keep if k in params},
                    n_ctx=_int(s.get("n_ctx")), last_request_id=task)


def _int(v: Any) -> int | None:
    return None if v is None or isinstance(v, bool) else int(v)


class LlamaObservationPlane:
    """Read-only view of a llama-server. Nothing here changes the server (GETs only).

    ``props``: the server's ``/props`` at attach. ``metrics``: the client measurements shared with the
    inference plane. ``interval_s``: the shortest window the load figures are computed over (wall s).
    Thread-safe. ``snapshot()`` raises ``ServerUnreachable`` while the server does not answer (the
    connection's back-off applies) and CalError for an answer that is not llama-server's.
    """

    def __init__(self, conn: Connection, props: Mapping[str, Any], metrics: ClientMetrics,
                 interval_s: float = 1.0, on_props: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        self._conn = conn
        self._props = dict(props)
        self._metrics = metrics
        self._interval_s = interval_s
        self._lock = threading.Lock()
        # (taken monotonic s, busy seconds, predicted tokens) of recent samples, oldest first
        self._samples: deque[tuple[float, float, int]] = deque(maxlen=64)
        self._slots_enabled = bool(props.get("endpoint_slots", True))
        self._metrics_enabled = bool(props.get("endpoint_metrics", True))
        self._on_props = on_props
        self._stale_props = False
        conn.on_state_change(self._link)

    @property
    def connection(self) -> Connection:
        return self._conn

    @property
    def props(self) -> dict[str, Any]:
        return self._props

    def _link(self, up: bool) -> None:
        if up:
            self._stale_props = True  # re-read /props at the next snapshot: a restarted server may differ
        else:
            with self._lock:
                self._samples.clear()  # counters restart with the server: no delta across a gap

    def _get(self, path: str) -> httpx.Response:
        resp = self._conn.call("GET", path, read_timeout_s=READ_S, gate=True)
        return resp

    def health(self) -> Health:
        """The server's ``GET /health``: ok, loading (503) or error, with its message."""
        return health_of(self._get("/health"))

    def metrics_text(self) -> str:
        """The server's own ``/metrics`` text (``llamacpp:`` names). CalError when it runs without --metrics."""
        resp = self._get("/metrics")
        if resp.status_code == 501:
            raise CalError("this llama-server runs without --metrics: GET /metrics is not offered")
        if resp.status_code != 200:
            raise_for(resp)
        return resp.text

    def snapshot(self) -> Snapshot:
        """One observation: /health, /slots, /metrics (a few ms on loopback)."""
        t0 = time.perf_counter()
        if self._stale_props:
            self._stale_props = False
            props = self._conn.json("GET", "/props", read_timeout_s=READ_S)
            if isinstance(props, dict):
                self._props = props
                if self._on_props is not None:
                    self._on_props(props)
        health = self.health()
        status, detail = health.status, health.detail
        slots: tuple[SlotView, ...] = ()
        if self._slots_enabled:
            resp = self._get("/slots")
            if resp.status_code == 200:
                data = resp.json()
                slots = tuple(slot_view(s) for s in data if isinstance(s, dict) and "id" in s)
            elif resp.status_code == 501:
                self._slots_enabled = False  # started without --slots; never asked again
            elif resp.status_code != 503:
                raise_for(resp)
        counters: dict[str, float | int] = {}
        if self._metrics_enabled:
            resp = self._get("/metrics")
            if resp.status_code == 200:
                counters = parse_metrics(resp.text)
            elif resp.status_code == 501:
                self._metrics_enabled = False
            elif resp.status_code != 503:
                raise_for(resp)
        now = time.monotonic()
        load = self._load(now, counters)
        p = self._props
        model_path = str(p.get("model_path") or p.get("model_alias") or "")
        server = ServerInfo(
            kind="llama-server", url=self._conn.url, build=str(p.get("build_info", "?")),
            model=os.path.basename(model_path) or "?", n_ctx=int(p["default_generation_settings"]["n_ctx"]),
            total_slots=int(p.get("total_slots", len(slots))), chat_template=str(p.get("chat_template", "")),
            health=status, health_detail=detail, metrics_enabled=self._metrics_enabled,
            slots_enabled=self._slots_enabled, poll_wall_ms=(time.perf_counter() - t0) * 1e3,
            **counters)  # type: ignore[arg-type]
        return Snapshot(taken_unix_s=time.time(), sim_now_ms=None, device=None, jobs=None, kv=None, last_step=None,
                        last_prefill=None, last_decode=None, memory=None, slots=slots,
                        requests=convert(self._metrics.summary(server.kv_cache_usage_ratio), RequestsView),
                        stages=None,
                        history=self._metrics.history(), host=None, findings=None, load=load, server=server)

    def _load(self, now: float, c: Mapping[str, float | int]) -> LoadInfo:
        base = LoadInfo(interval_s=self._interval_s, clock=LOAD_CLOCK)
        if "prompt_seconds_total" not in c or "tokens_predicted_total" not in c:
            return base
        busy_s = float(c["prompt_seconds_total"]) + float(c.get("tokens_predicted_seconds_total", 0.0))
        tokens = int(c["tokens_predicted_total"])
        with self._lock:
            ref = None
            for s in self._samples:  # the newest sample at least interval_s old
                if now - s[0] >= self._interval_s:
                    ref = s
            if ref is None and self._samples:
                ref = self._samples[0]
            self._samples.append((now, busy_s, tokens))
        if ref is None or now <= ref[0] or tokens < ref[2]:
            return base  # first sample, or the counters went back (a restarted server)
        window = now - ref[0]
        busy = min(100.0, max(0.0, (busy_s - ref[1]) / window * 100.0))
        return LoadInfo(interval_s=self._interval_s, clock=LOAD_CLOCK, window_wall_s=window, busy_percent=busy,
                        output_tokens_per_s=(tokens - ref[2]) / window)


__all__ = ["LOAD_CLOCK", "LlamaObservationPlane", "parse_metrics", "slot_view"]
