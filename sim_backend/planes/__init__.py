"""The planes' public surface: the only part of ``sim_backend`` that clients (the console, the
HTTP serving face, the remote planes) import for their types.

- contracts: ``InferencePlane``, ``ObservationPlane``, ``MaintenancePlane``, ``RequestStream``,
  ``Lease``, ``AuditReader``, ``Report`` (``sim_backend.planes.contracts``);
- value types: ``ChatRequest`` (its ``Grammar``), ``SamplingParams``, ``TokenEvent``, ``ProgressEvent``, ``DoneEvent``
  (one of them a ``StreamEvent``), ``RequestResult``
  and its ``Timings`` and ``TokenProbs``, ``StageTimes``, ``SLO``, ``validate_request`` (``sim_backend.planes.types``);
  ``EventStream``, the consuming side of a request stream (``sim_backend.planes.eventstream``);
- snapshot types: ``Snapshot`` and its sections (``sim_backend.planes.snapshot``);
- errors: the typed errors every plane raises (``sim_backend.errors``);
- ``MetricsRegistry``: the request-metrics aggregate (TTFT / TPOT / ITL / E2E with vLLM's definitions),
  for a client plane that measures requests itself (the llama-server planes)
  (``sim_backend.planes.metrics``);
- the audit log reader: ``AuditLog``, ``summarize``, ``audit_origin``; ``pseudo_filesystem``.

Nothing here loads the simulator (import-linter: the remote planes import no serving, runtime,
device or model module, not even indirectly). The in-process simulator is built by the
composition root, ``sim_backend.compose.build_system``, which the commands import explicitly.
"""

from __future__ import annotations

from sim_backend.errors import (
    CalError,
    DeviceError,
    ExceedContextSizeError,
    InvalidRequestError,
    KVExhausted,
    MaintenanceArgumentError,
    MaintenanceRefused,
    ManifestError,
    NotOffered,
    RequestCancelled,
    RequestError,
    UnavailableError,
)
from sim_backend.planes.audit import AuditLog, AuditLogError, audit_origin, pseudo_filesystem, summarize
from sim_backend.planes.contracts import (
    AuditReader,
    InferencePlane,
    Lease,
    MaintenancePlane,
    ObservationPlane,
    Report,
    RequestStream,
    SlotActions,
)
from sim_backend.planes.eventstream import EventStream
from sim_backend.planes.metrics import MetricsRegistry
from sim_backend.planes.snapshot import Health, Snapshot
from sim_backend.planes.types import (
    SLO,
    ChatRequest,
    DoneEvent,
    Grammar,
    ProgressEvent,
    RequestResult,
    SamplingParams,
    StageTimes,
    StreamEvent,
    Timings,
    TokenEvent,
    TokenLogprob,
    TokenProbs,
    seed_or_random,
    validate_request,
)

__all__ = ["SLO", "AuditLog", "AuditLogError", "AuditReader", "CalError", "ChatRequest", "DeviceError", "DoneEvent",
           "EventStream", "ExceedContextSizeError", "Grammar", "Health", "InferencePlane", "InvalidRequestError",
           "KVExhausted",
           "Lease",
           "MaintenanceArgumentError", "MaintenancePlane", "MaintenanceRefused", "ManifestError", "MetricsRegistry",
           "NotOffered", "ObservationPlane", "ProgressEvent",
           "Report", "RequestCancelled", "RequestError", "RequestResult", "RequestStream", "SamplingParams",
           "SlotActions", "Snapshot", "StageTimes", "StreamEvent", "Timings", "TokenEvent", "TokenLogprob",
           "TokenProbs", "UnavailableError",
           "audit_origin", "pseudo_filesystem",
           "seed_or_random", "summarize", "validate_request"]
