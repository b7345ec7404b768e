"""The planes' public surface: the only part of ``sim_backend`` that clients (the console, the
headless commands, the HTTP serving face) import.

- contracts: ``InferencePlane``, ``ObservationPlane``, ``MaintenancePlane``, ``RequestStream``,
  ``Lease`` (``sim_backend.planes.contracts``);
- snapshot types: ``Snapshot`` and its sections (``sim_backend.planes.snapshot``);
- request/result types: ``ChatRequest``, ``SamplingParams``, ``TokenEvent``, ``DoneEvent``,
  ``RequestResult`` and its ``Timings`` (remote clients rebuild results from the wire),
  ``validate_request``; ``SLO`` for goodput;
- errors: the typed errors every plane raises (``sim_backend.errors``);
- a factory: ``build_system`` (the in-process simulator, with ``Pacing`` / ``PacingMode``);
- ``MetricsRegistry``: the request-metrics aggregate (TTFT / TPOT / ITL / E2E with vLLM's definitions),
  for a client plane that measures requests itself (the llama-server planes);
- the audit log reader: ``AuditLog``, ``summarize``; ``pseudo_filesystem`` (is a path on /proc, /sys, /dev?).

Heavy members (the factory, which starts the simulator) load on first use, so importing this
package for its types stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sim_backend.device.clock import Pacing, PacingMode
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
from sim_backend.planes.contracts import (
    AuditReader,
    InferencePlane,
    Lease,
    MaintenancePlane,
    ObservationPlane,
    Report,
    RequestStream,
)
from sim_backend.planes.snapshot import Snapshot
from sim_backend.serving.api import (
    ChatRequest,
    DoneEvent,
    EventStream,
    RequestResult,
    SamplingParams,
    Timings,
    TokenEvent,
    validate_request,
)
from sim_backend.serving.metrics import SLO

if TYPE_CHECKING:
    from sim_backend.planes.audit import AuditLog, AuditLogError, audit_origin, pseudo_filesystem, summarize
    from sim_backend.planes.system import System, build_system
    from sim_backend.serving.metrics import MetricsRegistry

_LAZY = {"build_system": "sim_backend.planes.system", "System": "sim_backend.planes.system",
         "AuditLog": "sim_backend.planes.audit", "AuditLogError": "sim_backend.planes.audit",
         "summarize": "sim_backend.planes.audit", "pseudo_filesystem": "sim_backend.planes.audit",
         "audit_origin": "sim_backend.planes.audit", "MetricsRegistry": "sim_backend.serving.metrics"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'sim_backend.planes' has no attribute {name!r}")


__all__ = ["AuditLog", "AuditLogError", "AuditReader", "CalError", "audit_origin",
           "ChatRequest", "DeviceError", "DoneEvent", "EventStream",
           "ExceedContextSizeError", "InferencePlane", "InvalidRequestError", "KVExhausted", "Lease",
           "MaintenanceArgumentError", "MaintenancePlane", "MaintenanceRefused", "MetricsRegistry",
           "ManifestError", "NotOffered",
           "ObservationPlane",
           "Pacing", "PacingMode",
           "Report", "RequestCancelled", "RequestError", "RequestResult", "RequestStream", "SLO", "SamplingParams",
           "Snapshot", "System", "Timings", "TokenEvent", "UnavailableError", "build_system", "pseudo_filesystem",
           "summarize",
           "validate_request"]
