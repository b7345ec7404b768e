"""The CalRT-0.7.6-like runtime over the simulated board (facts.md F1, F5): two doors.

- inference: ``RuntimeSession`` (session.py) over ``VirtualDevice`` (calrt.py), ``Calbin`` /
  ``SubModel`` / ``InputBuf`` / ``OutputBuf`` (calbin.py) and a ``BufferPool`` (buffers.py), with
  the ``KVView`` / ``ClockView`` it hands upward (views.py);
- maintenance: ``MaintenanceRuntime`` (maintenance.py), every method behind an explicit lease.
  Loaded only when asked for, so an observe-only process never imports the maintenance door.
"""

from typing import TYPE_CHECKING, Any

from sim_backend.device.kv_common import _BACKOFF_MAX_S as KV_BACKOFF_MAX_S
from sim_backend.device.kv_common import _BACKOFF_START_S as KV_BACKOFF_START_S
from sim_backend.runtime.buffers import BufferPair, BufferPool
from sim_backend.runtime.calbin import Calbin, InputBuf, OutputBuf, SubModel, SubModelNotFound
from sim_backend.runtime.calrt import (
    CALRT_VERSION,
    DEVICE_KINDS,
    TASK_TYPES,
    DeviceStatus,
    VirtualDevice,
    calrt_version,
)
from sim_backend.runtime.session import RuntimeSession
from sim_backend.runtime.views import ClockView, KVView

if TYPE_CHECKING:
    from sim_backend.runtime.maintenance import MaintenanceRuntime, require_lease


def __getattr__(name: str) -> Any:
    if name in ("MaintenanceRuntime", "require_lease"):
        from sim_backend.runtime import maintenance

        return getattr(maintenance, name)
    raise AttributeError(f"module 'sim_backend.runtime' has no attribute {name!r}")


__all__ = [
    "BufferPair",
    "BufferPool",
    "CALRT_VERSION",
    "Calbin",
    "ClockView",
    "DEVICE_KINDS",
    "DeviceStatus",
    "InputBuf",
    "KVView",
    "KV_BACKOFF_MAX_S",
    "KV_BACKOFF_START_S",
    "MaintenanceRuntime",
    "OutputBuf",
    "RuntimeSession",
    "SubModel",
    "SubModelNotFound",
    "TASK_TYPES",
    "VirtualDevice",
    "calrt_version",
    "require_lease",
]
