"""One poll of one board as a typed ``BoardSample``, and the fleet's worst-first order.

Two kinds of board server:

- **calconsole** (``calconsole serve`` or a console with ``--listen``): ``GET /snapshot``. Only the fields the
  fleet row needs are decoded (``_Snap``: msgspec skips the rest of the ~tens of KB), so a row costs one
  request and one partial decode. Its latencies and output rate are **simulated** device time
  (``latency_clock`` / ``rate_clock`` = ``"sim"``): the board's own figures.
- **llama-server** (llama.cpp): ``GET /health``, ``/slots`` and ``/metrics`` (``/props`` once). It reports
  no device, no KV occupancy in this build's ``/metrics``, no lease and no faults: those fields stay None
  ("not reported"), never 0. Its output rate is derived from the ``llamacpp:tokens_predicted_total``
  counter's delta over the **wall** time between two polls (``rate_clock`` = ``"wall"``).

``rank`` orders samples worst first: unreachable or refused, then by level (crit, warn, ok), then by
name. Levels use the console's thresholds (``Settings``: KV %, queue depth, TTFT/TPOT P95 against the SLO,
failures), the same colours as the single-board view.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from ..settings import Settings

KINDS = ("calconsole", "llama-server")
#: link states of a board: answering, not answering (transport error or timeout), answering but refusing
#: the key, answering something that is neither kind, or not polled yet
STATES = ("up", "unreachable", "refused", "error", "connecting")
LEVEL_ORDER = {"crit": 0, "warn": 1, "ok": 2}


class BoardSample(msgspec.Struct, frozen=True, kw_only=True):
    """One board at one poll. ``None`` means the board's server does not report that figure.

    ``kv_percent``: % of KV cells in use; ``queue``: requests waiting for a slot; ``running``: requests in a
    slot; ``output_tok_s``: tokens generated per second of ``rate_clock`` (``"sim"``: simulated device s over
    the board's last ~1 s; ``"wall"``: server wall s between two polls); ``ttft_p95_ms`` / ``tpot_p95_ms``:
    P95 in ms of ``latency_clock`` (``"sim"``); ``faults_armed``: fault kinds armed; ``faults_fired``: faults
    fired and not yet acknowledged; ``failed``: failed requests + failed device jobs since start.
    ``taken_unix_s``: host wall time this poll ended; ``last_seen_unix_s``: of the last answered poll.
    ``via``: how the sample came, ``"poll"`` (this console asked: GET requests) or ``"stream"`` (the board
    pushed it on its ``/snapshot/stream``: no request). ``poll_ms``: host wall ms of this poll's round trips
    (None for a streamed sample: nothing was asked, so there is no round trip). ``sample_gap_s``: host wall
    s since this board's previous sample (None for its first): about ``1 / refresh_hz`` while the board keeps
    up. ``level`` is ok / warn / crit, ``reasons`` say why.
    """

    name: str
    url: str
    kind: str | None = None
    state: str = "connecting"
    error: str = ""
    health: str | None = None
    mode: str | None = None
    lease_holder: str | None = None
    kv_percent: float | None = None
    queue: int | None = None
    running: int | None = None
    n_slots: int | None = None
    output_tok_s: float | None = None
    rate_clock: str | None = None
    ttft_p95_ms: float | None = None
    tpot_p95_ms: float | None = None
    latency_clock: str | None = None
    faults_armed: tuple[str, ...] | None = None
    faults_fired: int | None = None
    failed: int | None = None
    model: str | None = None
    build: str | None = None
    taken_unix_s: float = 0.0
    last_seen_unix_s: float | None = None
    via: str | None = None
    poll_ms: float | None = None
    sample_gap_s: float | None = None
    level: str = "warn"
    reasons: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The wire form (one JSON object a board a sample: ``calconsole fleet --json``)."""
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


# --- calconsole: the part of /snapshot the fleet reads (unknown fields are skipped, not refused) ----------

class _Dev(msgspec.Struct, frozen=True):
    name: str = "?"
    bundle: str = ""
    status: str = "?"
    mode: str = "?"
    lease_holder: str | None = None
    faults_armed: tuple[str, ...] = ()
    faults_fired: tuple[Any, ...] = ()
    n_slots: int = 0


class _Jobs(msgspec.Struct, frozen=True):
    failed: int = 0


class _KV(msgspec.Struct, frozen=True):
    used_tokens: int = 0
    capacity_tokens: int = 0


class _Load(msgspec.Struct, frozen=True):
    output_tokens_per_s: float | None = None


class _Snap(msgspec.Struct, frozen=True):
    device: _Dev
    jobs: _Jobs = _Jobs()
    kv: _KV = _KV()
    requests: dict[str, Any] = {}
    load: _Load = _Load()


SNAPSHOT_DECODER = msgspec.json.Decoder(_Snap)


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def from_calconsole(name: str, url: str, body: bytes) -> dict[str, Any]:
    """The row figures of a calconsole ``/snapshot`` body; raises ``msgspec.DecodeError`` /
    ``msgspec.ValidationError`` for a body that is not one."""
    s = SNAPSHOT_DECODER.decode(body)
    req = s.requests if isinstance(s.requests, dict) else {}
    counters = req.get("counters") or {}
    lat = req.get("latency_ms") or {}
    kv_pct = 100.0 * s.kv.used_tokens / s.kv.capacity_tokens if s.kv.capacity_tokens > 0 else None
    return dict(
        kind="calconsole", health=s.device.status, mode=s.device.mode, lease_holder=s.device.lease_holder,
        kv_percent=kv_pct, queue=_int(counters.get("queued")), running=_int(counters.get("running")),
        n_slots=s.device.n_slots or None, output_tok_s=_num(s.load.output_tokens_per_s), rate_clock="sim",
        ttft_p95_ms=_num((lat.get("ttft") or {}).get("p95")), tpot_p95_ms=_num((lat.get("tpot") or {}).get("p95")),
        latency_clock="sim", faults_armed=tuple(str(f) for f in s.device.faults_armed),
        faults_fired=len(s.device.faults_fired),
        failed=(_int(counters.get("failed")) or 0) + s.jobs.failed, model=s.device.bundle or s.device.name,
        slo=(req.get("goodput") or {}).get("slo") or {},
    )


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


# --- llama-server: /health, /slots, /metrics -------------------------------------------------------------

def parse_llamacpp_metrics(text: str) -> dict[str, float]:
    """``llamacpp:`` samples of a Prometheus text exposition, by sample name (no labels in llama-server's).

    Uses prometheus-client's parser. A family with HELP/TYPE lines but no sample (llama-server before its
    first request) is absent from the result, not 0.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("llamacpp:") and not s.labels:
                out[s.name] = float(s.value)
    return out


def from_llama_server(health_status: int, health: Any, slots: Any, metrics: dict[str, float] | None,
                      props: dict[str, Any]) -> dict[str, Any]:
    """The row figures of a llama-server: ``health_status`` the HTTP status of ``/health`` (200 ok, 503
    loading), ``slots`` the ``/slots`` list (None: endpoint off), ``metrics`` the parsed ``/metrics`` (None:
    endpoint off), ``props`` its ``/props``."""
    if health_status == 200:
        status = "ok"
    elif health_status == 503:
        status = "loading"
    else:
        status = "error"
    running = None
    n_slots = _int(props.get("total_slots"))
    if isinstance(slots, list):
        running = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))
        n_slots = len(slots)
    queue = None
    kv = None
    if metrics is not None:
        if "llamacpp:requests_deferred" in metrics:
            queue = int(metrics["llamacpp:requests_deferred"])
        if running is None and "llamacpp:requests_processing" in metrics:
            running = int(metrics["llamacpp:requests_processing"])
        if "llamacpp:kv_cache_usage_ratio" in metrics:  # older builds report it; b6xxx+ do not
            kv = 100.0 * metrics["llamacpp:kv_cache_usage_ratio"]
    model = props.get("model_alias") or props.get("model_path")
    if isinstance(model, str) and "/" in model:
        model = model.rsplit("/", 1)[-1]
    return dict(kind="llama-server", health=status, mode="serving" if status == "ok" else status,
                lease_holder=None, kv_percent=kv, queue=queue, running=running, n_slots=n_slots,
                model=model if isinstance(model, str) else None,
                build=str(props.get("build_info")) if props.get("build_info") is not None else None)


# --- levels and order ------------------------------------------------------------------------------------

def assess(fig: dict[str, Any], settings: Settings) -> tuple[str, tuple[str, ...]]:
    """(level, reasons) of a board's figures against the console's thresholds. The TTFT/TPOT SLO is the
    board's own (``fig['slo']``) where it reports one, else the console's (``settings.slo_*_ms``)."""
    levels: list[tuple[str, str]] = []
    health = fig.get("health")
    if health in ("error", "failed", "lost"):
        levels.append(("crit", f"health {health}"))
    elif health not in (None, "ok"):
        levels.append(("warn", f"health {health}"))
    mode = fig.get("mode")
    if mode not in (None, "serving", "ok", "loading", "error"):
        levels.append(("warn", f"mode {mode}"))
    if fig.get("faults_fired"):
        levels.append(("crit", f"{fig['faults_fired']} fault(s) fired"))
    if fig.get("faults_armed"):
        levels.append(("warn", "faults armed: " + ", ".join(fig["faults_armed"])))
    slo = fig.get("slo") or {}
    checks = [("kv_percent", fig.get("kv_percent"), "KV {:.0f} %"),
              ("queue_depth", fig.get("queue"), "queue {:g}"),
              ("failed", fig.get("failed"), "failed {:g}")]
    for key, slo_key, default in (("ttft", "ttft_ms", settings.slo_ttft_ms), ("tpot", "tpot_ms", settings.slo_tpot_ms)):
        p95 = fig.get(f"{key}_p95_ms")
        target = _num(slo.get(slo_key)) or default
        if p95 is not None and target:
            checks.append((f"{key}_slo_ratio", p95 / target, key.upper() + " P95 {:.2f}x SLO"))
    for name, value, fmt in checks:
        if value is None:
            continue
        level = settings.level(name, float(value))
        if level != "ok":
            levels.append((level, fmt.format(value)))
    if not levels:
        return "ok", ()
    worst = min(levels, key=lambda lv: LEVEL_ORDER[lv[0]])[0]
    return worst, tuple(r for lv, r in sorted(levels, key=lambda lv: LEVEL_ORDER[lv[0]]))


def sort_key(s: BoardSample) -> tuple[int, int, str]:
    """Worst first: a board that does not answer (or refuses us) before any answering one, then crit, warn,
    ok, then by name."""
    down = 0 if s.state in ("unreachable", "refused", "error") else 1
    return down, LEVEL_ORDER.get(s.level, 1), s.name


def rank(samples: list[BoardSample]) -> list[BoardSample]:
    """The samples worst first (see ``sort_key``)."""
    return sorted(samples, key=sort_key)
