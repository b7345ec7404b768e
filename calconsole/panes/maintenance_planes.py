"""The maintenance planes as the maintenance pane reads them beyond the contract (``MaintenancePlane``):
the device's plane (in-process or remote), which drains before exclusive mode, and a leaseless server's
(a llama-server), which offers some actions and has slot actions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from sim_backend.planes import Lease, MaintenancePlane, Report

if TYPE_CHECKING:  # annotations only: no runtime dependency on typing_extensions
    from typing_extensions import TypeIs


class DrainingMaintenancePlane(MaintenancePlane, Protocol):
    """What the pane reads of the device's maintenance plane (in-process or remote) beyond the contract: the
    default bounded drain of ``enter_exclusive`` (``drain_timeout_s``, host wall s) and the last drain's
    report (``last_drain``: {"drained", "cancelled", "wall_ms", "sim_ms"}, None before the first)."""

    @property
    def drain_timeout_s(self) -> float: ...

    @property
    def last_drain(self) -> Mapping[str, Any] | None: ...


class LeaselessMaintenancePlane(MaintenancePlane, Protocol):
    """What the pane reads of a leaseless server's maintenance plane (``needs_lease`` False, a llama-server)
    beyond the contract: which plane methods it offers, and its slot actions."""

    @property
    def needs_lease(self) -> bool: ...

    def offers(self, action: str) -> bool:
        """Whether a leaseless server offers the plane method ``action``."""
        ...

    def erase_slot(self, lease: Lease | None, slot: int) -> Report: ...

    def save_slot(self, lease: Lease | None, slot: int, filename: str) -> Report: ...

    def restore_slot(self, lease: Lease | None, slot: int, filename: str) -> Report: ...


#: the maintenance planes the pane is handed: the device's (which drains) or a leaseless server's
PaneMaintenancePlane = DrainingMaintenancePlane | LeaselessMaintenancePlane


def is_leaseless(plane: PaneMaintenancePlane) -> TypeIs[LeaselessMaintenancePlane]:
    """Whether ``plane`` is a leaseless server's (it says ``needs_lease`` False); else it is the device's."""
    return not getattr(plane, "needs_lease", True)
