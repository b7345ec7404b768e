"""Typed, immutable observation snapshots: what ``ObservationPlane.snapshot()`` returns.

Every section is a frozen ``msgspec.Struct``: attributes cannot be assigned, sequences are
tuples, and the few maps (per-sequence KV tokens, per-category layer times) are copies owned
by the snapshot, so nothing reachable from a snapshot can change the device.

A section a server does not report is ABSENT (None), never zero: a snapshot of a stock llama-server
(``server`` set, its ``kind`` "llama-server") has no device, jobs, KV, steps, memory, stages, host or
findings; a snapshot of this simulator has no ``server``.

Units are in the field names: ``*_us`` / ``*_ms`` under steps and requests are SIMULATED
device time; ``host`` and ``*_wall_ms`` are measured host wall time; stage host parts are
measured host CPU ms. ``Snapshot.to_dict()`` is the JSON wire form (``calconsole snapshot
--json``, ``GET /snapshot``); ``Snapshot.from_dict()`` reads it back with type checks, so an
in-process and a remote observation plane hand out the same type.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
import msgspec.inspect

from sim_backend.errors import Finding

from .types import StageTimes


class _Frozen(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the snapshot sections (frozen, keyword-only)."""


class ChipletInfo(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One chiplet: ``state`` ready|busy|cleared|fault; ``slow_factor`` >= 1 (1 = nominal).

    ``busy_us``: simulated µs the chip spent executing its own ops since power-on (waiting at a
    sync is not busy); ``busy_percent``: its share of the simulated time of the last load interval
    (``LoadInfo``), None before there are two samples.
    """

    index: int
    state: str
    busy: bool
    slow_factor: float
    jobs_done: int
    ccu_exceptions: int = 0
    busy_us: float = 0.0
    busy_percent: float | None = None


class FaultEvent(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A fault that fired and is not yet acknowledged: its name and where it hit (chip, job)."""

    fault: str
    detail: str


class DeviceInfo(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The board: identity, health ``status``, maintenance ``mode``, pacing and faults.

    ``pacing_speed``: simulated seconds per wall second asked for; ``achieved_speed`` the measured
    ratio over the last paced run (None before one). ``faults``: armed or in-effect fault names;
    ``faults_armed`` waiting to fire, ``faults_in_effect`` acting on every job (a slow chip),
    ``faults_fired`` happened and not yet acknowledged (``status`` is "fault" until then).
    ``timing_only_running``: ids of running requests whose tokens come from the seeded generator
    (prompts over ``numerics_max_prompt`` tokens; 0 = the device runs timing-only);
    ``numerics_limit_reason`` says where that limit comes from (the measurement behind the
    default, or the option that set it; "" when the device runs timing-only).
    ``numerics_starting``: the numerics worker is still starting (kernels loading, or compiling on a first
    start): requests admitted meanwhile run timing-only. ``numerics_broken``: it failed to start, died or
    hung: until a reset or reload requests fail (it died serving) or run timing-only (it never started).
    """

    name: str
    bundle: str
    status: str
    mode: str
    lease_holder: str | None
    calrt_version: str
    firmware_commit: str
    pacing: str
    pacing_speed: float
    numerics: bool
    achieved_speed: float | None
    chiplets: tuple[ChipletInfo, ...]
    faults: tuple[str, ...]
    faults_armed: tuple[str, ...] = ()
    faults_in_effect: tuple[str, ...] = ()
    faults_fired: tuple[FaultEvent, ...] = ()
    d2d_link_errors: int = 0
    context_tokens: int
    numerics_max_prompt: int = 0
    numerics_limit_reason: str = ""
    timing_only_running: tuple[int, ...] = ()
    numerics_starting: bool = False
    numerics_broken: bool = False
    n_slots: int
    admitting: bool
    #: report status code of the loaded bundle (C0 today's calbin; C3 a variant the vendor would compile)
    bundle_status: str = "C0"
    #: the variant's label as its manifest states it ("" for the production bundle)
    bundle_label: str = ""
    #: the model's weights: "synthetic" (drawn from a seed) or "real" (the pilot's GGUF)
    weights: str = "synthetic"
    #: sequences one decode step may carry (1 today, facts.md F1; N for a batch-N variant)
    decode_batch: int = 1
    #: dtype of the logits the device returns over D2H: "bf16" (the production calbin, facts.md F1) or
    #: "f32" (a C3 variant that declares it: the dense pilot); ``MemoryView.logits_bytes_per_token`` its bytes
    logits_dtype: str = "bf16"


class Health(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a health probe needs and nothing more (``ObservationPlane.health()``, GET /health): state only,
    no counters, no percentiles, no host figures, so it costs microseconds instead of a snapshot's ms.

    ``status``: ``DeviceInfo.status``'s words for the simulator (ok | degraded | fault... | memory cleared);
    for a server that only answers its /health: "ok", "loading" (503) or "error" (anything else), with
    its message in ``detail``. ``mode``: serving | draining | exclusive ("serving" for a server that
    reports none); ``lease_holder``: who holds the maintenance lease, if anyone.
    """

    status: str
    mode: str = "serving"
    lease_holder: str | None = None
    detail: str = ""


class JobCounts(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Device job counters (device steps, not requests)."""

    submitted: int
    pending: int
    running: int
    finished: int
    failed: int
    left: int
    ccu_exceptions: int
    resets: int


class KVInfo(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """KV cache occupancy (tokens = cells; bytes per chip) and wait counters.

    ``waits`` / ``timeouts``: requests the engine parked for cells / that timed out;
    ``kv_wait_wall_ms``: host wall ms spent waiting; ``per_seq_tokens``: seq id (str) -> cells.
    """

    used_tokens: int
    capacity_tokens: int
    free_tokens: int
    used_blocks: int
    total_blocks: int
    block_size: int
    bytes_used_per_chip: int
    bytes_capacity_per_chip: int
    per_seq_tokens: dict[str, int]
    waits: int
    timeouts: int
    kv_wait_wall_ms: float
    apply_calls: int
    apply_full_attempts: int


class LayerTiming(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One decoder layer of a step: simulated µs per chip, and per op category per chip."""

    layer: int
    chip_us: tuple[float, ...]
    category_us: dict[str, tuple[float, ...]]
    slowest_category: str


class OutsideTiming(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Ops of a step outside the decoder layers, simulated µs per chip (and per op category per chip).

    ``part``: "embed" (before layer 0: the embedding, on chip0 only, and its broadcast sync; in
    prefill the input layout conversion) or "head" (after the last layer: final norm, LM head,
    logits gather and sync; in prefill the output layout conversion). ``ops``: their roles in
    execution order; ``slowest_op`` the one that costs most.
    """

    part: str
    ops: tuple[str, ...]
    chip_us: tuple[float, ...]
    category_us: dict[str, tuple[float, ...]]
    slowest_op: str


class StepView(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The last device step of a kind (all times simulated µs, but ``compute_wall_ms``: host wall).

    ``kind`` is None (and everything else empty) before the first step.

    Per chip ``c``: the ``layers`` rows' ``chip_us[c]`` + the ``outside`` rows' ``chip_us[c]`` =
    ``chip_busy_us[c]``, and ``chip_busy_us[c] + chip_wait_us[c] + submit_us = infer_us`` (a chip
    waits at a barrier while the other finishes). ``experts_priced``: per layer, the distinct
    experts the MoE weights were priced with; ``experts_rule`` "per-layer counts" (the router's
    choices, numeric mode) or "expectation" (timing-only: the same mean for every layer).
    """

    kind: str | None = None
    job_id: int | None = None
    seq_id: int | None = None
    n_tokens: int | None = None
    past_len: int | None = None
    sim_us: float | None = None
    h2d_us: float | None = None
    infer_us: float | None = None
    d2h_us: float | None = None
    global_us: float | None = None
    sim_end_ms: float | None = None
    compute_wall_ms: float | None = None
    experts_touched: tuple[int, ...] = ()
    numerics: bool | None = None
    layers: tuple[LayerTiming, ...] = ()
    time_unit: str | None = None
    #: a batched decode step: the seq ids that rode in it, in order (() for a batch-1 step)
    batch_seq_ids: tuple[int, ...] = ()
    outside: tuple[OutsideTiming, ...] = ()
    chip_busy_us: tuple[float, ...] = ()
    chip_wait_us: tuple[float, ...] = ()
    submit_us: float | None = None
    experts_priced: tuple[float, ...] = ()
    experts_rule: str | None = None


class BatchStepView(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One batched decode step (continuous batching on a batch-N variant): ``occupancy`` of
    ``capacity`` rows, the ``slots`` and ``request_ids`` that rode in it, ``sim_end_ms`` simulated."""

    job_id: int
    occupancy: int
    capacity: int
    slots: tuple[int, ...]
    request_ids: tuple[int, ...]
    sim_end_ms: float


class MemoryRegion(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One region of a chip's memory plan (bytes); ``kind`` dram|sram."""

    name: str
    kind: str
    used_bytes: int
    reserved_bytes: int
    physical_bytes: int


class ChipMemory(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One chip's memory plan (bytes)."""

    chip: int
    dram_reserved_bytes: int
    sram_reserved_bytes: int
    regions: tuple[MemoryRegion, ...]


class MemoryView(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per-chip memory map (facts.md F4) with KV use filled in; all sizes bytes. Empty if no plan."""

    unit: str = "bytes"
    kv_used_tokens: int = 0
    kv_bytes_per_token_per_chip: int = 0
    logits_bytes_per_token: int = 0
    param_file_bytes: tuple[int, ...] = ()
    param_estimate_bytes: tuple[int, ...] = ()
    address_union_bytes: dict[str, int] = {}
    chips: tuple[ChipMemory, ...] = ()


class SlotView(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One serving slot (llama-server's slot): its request and token counts.

    From a llama-server's ``/slots``: ``index`` ``id``, ``state`` processing | idle (``is_processing``),
    ``request_id`` ``id_task`` (None when idle), ``prompt_n`` ``n_prompt_tokens``, ``n_prefilled``
    ``n_prompt_tokens_processed``, ``cached_tokens`` ``n_prompt_tokens_cache``, ``predicted_n``
    ``next_token[0].n_decoded``, ``n_ctx`` the slot's context; a count the server did not report
    (a slot that never ran) is None. An idle slot keeps its last request's counts, ``max_tokens`` and
    ``params`` (llama-server's ``/slots`` keeps an idle slot's last task) and names it in
    ``last_request_id`` (None before its first request, or where the source does not say).
    """

    index: int
    state: str
    request_id: int | None
    prompt_n: int | None
    n_prefilled: int | None
    predicted_n: int | None
    cached_tokens: int | None
    numeric: bool | None = None
    #: the request's n_predict and sampling parameters (llama.cpp names); idle: the last request's (0 / {} if none)
    max_tokens: int = 0
    params: dict[str, Any] = {}
    #: context tokens of this slot (llama-server reports it per slot; None from the simulator)
    n_ctx: int | None = None
    #: the request it serves or last served (``id_task``; kept while idle), None if none yet or not reported
    last_request_id: int | None = None
    #: the request's prompt tokens reused from the slot's cached prefix (llama-server's ``n_prompt_tokens_cache``
    #: of a busy slot), None where the source does not say (in-process ``cached_tokens`` is what the KV holds)
    reused_tokens: int | None = None
    #: the request's context shifts and the tokens they discarded, whether its context filled (llama-server's
    #: ``truncated``) and its ``n_keep`` (``sim_backend.serving.context_shift``); None where the source does not say
    n_shifts: int | None = None
    n_discarded: int | None = None
    truncated: bool | None = None
    n_keep: int | None = None


class HostInfo(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """This process, measured: CPU % since the previous snapshot, RSS bytes, threads, system CPU %."""

    cpu_percent: float
    rss_bytes: int
    threads: int
    system_cpu_percent: float


class LoadInfo(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Load over the last interval, from two samples of cumulative counters (simulated device time).

    ``window_sim_ms``: simulated ms between the samples (0: the simulated clock did not move, so
    nothing ran and every figure is 0); ``window_wall_s``: host wall s between them (about
    ``interval_s``, longer when snapshots are rarer). ``busy_percent``: share of the simulated
    window the board spent executing steps (h2d + infer + d2h; a step counts when it ends, so a
    step longer than the window is capped at 100). ``output_tokens_per_s``: tokens generated per
    simulated second. All None before the second sample.

    ``clock`` names the time the figures are in: "simulated device time" for this simulator;
    for a llama-server "llama-server wall time" (``window_sim_ms`` None; ``busy_percent`` is the
    server's own prompt + generation seconds counters' growth over the wall window, capped at 100,
    ``output_tokens_per_s`` its generated-tokens counter's growth per wall second of the window).
    """

    interval_s: float = 1.0
    clock: str = "simulated device time"
    window_sim_ms: float | None = None
    window_wall_s: float | None = None
    busy_percent: float | None = None
    output_tokens_per_s: float | None = None


class ServerInfo(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The serving process of a snapshot that does not come from this simulator (a stock llama-server).

    From ``GET /props``: ``build`` (``build_info``, e.g. "b6590-..."), ``model`` (the file name of
    ``model_path``), ``n_ctx`` (tokens per slot), ``total_slots``, ``chat_template`` (Jinja text).
    From ``GET /health``: ``health`` ok | loading | error, ``health_detail`` its message.
    From ``GET /metrics`` (``llamacpp:`` families; None when the server runs without ``--metrics``
    or its build does not report the family): cumulative counters since the server started
    (tokens, and seconds of the server's wall clock), the live gauges, KV use where reported.
    ``poll_wall_ms``: host wall ms this snapshot's reads took (measured by the client).
    """

    kind: str
    url: str
    build: str
    model: str
    n_ctx: int
    total_slots: int
    chat_template: str = ""
    health: str = "ok"
    health_detail: str = ""
    metrics_enabled: bool = False
    slots_enabled: bool = False
    prompt_tokens_total: int | None = None
    prompt_tokens_cached_total: int | None = None
    prompt_seconds_total: float | None = None
    tokens_predicted_total: int | None = None
    tokens_predicted_seconds_total: float | None = None
    n_decode_total: int | None = None
    n_tokens_max: int | None = None
    prompt_tokens_seconds: float | None = None
    predicted_tokens_seconds: float | None = None
    requests_processing: int | None = None
    requests_deferred: int | None = None
    n_busy_slots_per_decode: float | None = None
    kv_cache_usage_ratio: float | None = None
    kv_cache_tokens: int | None = None
    poll_wall_ms: float | None = None


class Percentiles(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One latency's recent samples: P50/P95/P99 and mean in simulated ms (None with no sample), ``n`` samples."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None
    mean: float | None = None
    n: int = 0


class RequestCounters(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Requests by outcome since start (counts); ``queued`` / ``running`` are the live gauges."""

    submitted: int = 0
    finished: int = 0
    failed: int = 0
    cancelled: int = 0
    queued: int = 0
    running: int = 0
    rejected: int = 0


class TokenCounts(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Tokens as llama.cpp counts them: ``prompt`` processed (the reused prefix excluded), ``cached`` the
    reused prefix, ``predicted`` generated (ended requests only)."""

    prompt: int = 0
    cached: int = 0
    predicted: int = 0


class LatencyTable(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Percentiles of each request latency (vLLM's definitions; simulated ms, see ``RequestsView.clock``)."""

    ttft: Percentiles = Percentiles()
    tpot: Percentiles = Percentiles()
    itl: Percentiles = Percentiles()
    e2e: Percentiles = Percentiles()
    queue: Percentiles = Percentiles()


class SLOView(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The engine's service-level objectives in simulated ms; None = not checked."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None


class GoodputView(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Finished requests meeting every SLO: count, share, and rates over ``span_s`` (simulated s from the first
    arrival to the last end, idle included); rates None before any span."""

    slo: SLOView = SLOView()
    good_requests: int = 0
    good_fraction: float | None = None
    span_s: float = 0.0
    requests_per_s: float | None = None
    tokens_per_s: float | None = None


class RequestsView(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The serving metrics summary (``MetricsRegistry.summary``): counters, tokens, latency percentiles, goodput.

    ``balanced``: submitted = finished + failed + cancelled + queued + running; ``latency_sampled_from``
    names which requests give each latency's samples; ``kv_cache_usage_ratio`` 0..1 (None: not reported);
    ``clock`` what the latencies' clock is (simulated device ms, with or without booked host work; or the
    console's wall clock as a client of a llama-server).
    """

    counters: RequestCounters = RequestCounters()
    balanced: bool = True
    tokens: TokenCounts = TokenCounts()
    latency_ms: LatencyTable = LatencyTable()
    latency_sampled_from: dict[str, str] = {}
    goodput: GoodputView = GoodputView()
    kv_cache_usage_ratio: float | None = 0.0
    clock: str = ""
    #: whose requests these are, when not every request of the server (a console observing a llama-server
    #: counts the requests it sent, measured as client); "" for the simulator's own metrics
    scope: str = ""


class Snapshot(_Frozen, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One read-only observation of the whole system.

    ``taken_unix_s``: host wall clock; ``sim_now_ms``: the simulated device clock (None: no simulated
    device, e.g. a llama-server). Sections typed ``X | None`` are None where the server does not report them.
    ``load``: busy % and output rate over the last interval (simulated time).
    ``requests`` is the serving metrics summary (``RequestsView``: counters, token counts, latency
    percentiles, goodput); ``history`` the recent per-request series (a map owned by the snapshot).
    """

    taken_unix_s: float
    sim_now_ms: float | None
    device: DeviceInfo | None
    jobs: JobCounts | None
    kv: KVInfo | None
    last_step: StepView | None
    last_prefill: StepView | None
    last_decode: StepView | None
    memory: MemoryView | None
    slots: tuple[SlotView, ...]
    requests: RequestsView
    stages: dict[str, StageTimes] | None
    history: dict[str, tuple[float | None, ...]]
    host: HostInfo | None
    findings: tuple[Finding, ...] | None
    load: LoadInfo = LoadInfo()
    #: recent batched decode steps, oldest first (empty with a batch-1 calbin)
    decode_batches: tuple[BatchStepView, ...] = ()
    #: the serving process when it is not this simulator (a stock llama-server); None for the simulator
    server: ServerInfo | None = None

    @property
    def source(self) -> str:
        """Who the snapshot describes: "calconsole" (the simulated device) or the server's kind."""
        return self.server.kind if self.server is not None else "calconsole"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready nested dicts and lists (NaN becomes None), the wire form of a snapshot."""
        out: dict[str, Any] = _no_nan(msgspec.to_builtins(self))
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Snapshot:
        """Read the wire form back; raises ``msgspec.ValidationError`` naming the bad field."""
        return msgspec.convert(data, cls)


def _no_nan(obj: Any) -> Any:
    if isinstance(obj, float):
        return None if math.isnan(obj) else obj
    if isinstance(obj, dict):
        return {k: _no_nan(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_no_nan(v) for v in obj]
    return obj


def convert(data: Any, typ: type[Any]) -> Any:
    """Build a snapshot section of type ``typ`` from plain data (dicts, lists, numpy scalars)."""
    return msgspec.convert(data, typ, from_attributes=True, strict=False)


_STRICT_DECODER = msgspec.json.Decoder(Snapshot)
_GENERIC_DECODER = msgspec.json.Decoder()
_SNAPSHOT_INFO: Any = None


def decode_snapshot_json(data: bytes | str, ignored: set[str] | None = None) -> Snapshot:
    """A snapshot from another process's JSON (``GET /snapshot``, ``/snapshot/stream``), tolerant of a newer
    server: fields this version does not know (a server upgraded before its consoles adds some) are left out,
    their paths (``device.numerics_starting``) added to ``ignored`` when given; every known field is checked
    as ``Snapshot.from_dict`` does. In-process snapshots stay strict (``msgspec.convert``), so a field this
    code base forgot to declare still fails its tests. Raises ``msgspec.DecodeError`` for JSON that is not
    one and ``msgspec.ValidationError`` for a known field of the wrong type or a missing required one."""
    try:
        return _STRICT_DECODER.decode(data)  # the fast path: a server of this version
    except msgspec.ValidationError as e:
        if "unknown field" not in str(e):
            raise
    global _SNAPSHOT_INFO
    if _SNAPSHOT_INFO is None:
        _SNAPSHOT_INFO = msgspec.inspect.type_info(Snapshot)
    pruned = _known_only(_GENERIC_DECODER.decode(data), _SNAPSHOT_INFO, "", ignored if ignored is not None else set())
    return msgspec.convert(pruned, Snapshot)


def _known_only(obj: Any, t: Any, path: str, ignored: set[str]) -> Any:
    """``obj`` (decoded JSON) without the struct fields ``t`` (``msgspec.inspect`` type info) does not
    declare, at every depth; values of other types as they are (``convert`` checks them)."""
    mi = msgspec.inspect
    if isinstance(t, mi.StructType) and isinstance(obj, dict):
        fields = {f.encode_name: f.type for f in t.fields}
        out = {}
        for k, v in obj.items():
            if k in fields:
                out[k] = _known_only(v, fields[k], f"{path}.{k}" if path else k, ignored)
            else:
                ignored.add(f"{path}.{k}" if path else k)
        return out
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)) and isinstance(obj, list):
        return [_known_only(v, t.item_type, f"{path}[]", ignored) for v in obj]
    if isinstance(t, mi.TupleType) and isinstance(obj, list):
        head = [_known_only(v, it, f"{path}[]", ignored) for v, it in zip(obj, t.item_types, strict=False)]
        return head + obj[len(t.item_types):]  # a wrong length is convert's to refuse
    if isinstance(t, mi.DictType) and isinstance(obj, dict):
        return {k: _known_only(v, t.value_type, f"{path}{{}}", ignored) for k, v in obj.items()}
    if isinstance(t, mi.UnionType) and isinstance(obj, dict):
        structs = [u for u in t.types if isinstance(u, mi.StructType)]
        if len(structs) == 1:  # Optional[Section]: the one struct it can be
            return _known_only(obj, structs[0], path, ignored)
    return obj
