"""The device as an observer sees it: read-only status, counters, KV occupancy, last steps.

``DeviceMonitor`` is what the observation plane (and the maintenance plane, for status) reads
instead of the board: it has no method that changes the device, and what it returns are copies
or immutable records. Times: ``now_us`` simulated device µs; ``achieved_speed`` simulated / wall.
"""

from __future__ import annotations

from typing import Any

from sim_backend.bundle.manifest import Bundle
from sim_backend.bundle.shapes import ModelShape
from sim_backend.device.board import ChipletStatus, JobCounters, SimulatedBoard, StepResult
from sim_backend.device.clock import Pacing
from sim_backend.device.kv import KVCounters, KVOccupancy
from sim_backend.device.registers import REGISTER_MAP, RegisterDef


class DeviceMonitor:
    """Read-only view of a ``SimulatedBoard``."""

    def __init__(self, board: SimulatedBoard) -> None:
        self._board = board

    @property
    def bundle(self) -> Bundle:
        return self._board.bundle

    @property
    def shape(self) -> ModelShape:
        return self._board.shape

    @property
    def now_us(self) -> float:
        """Simulated device time now (µs)."""
        return self._board.clock.now_us

    @property
    def pacing(self) -> Pacing:
        return self._board.pacing

    @property
    def numerics(self) -> bool:
        """True when the device computes logits (False: timing-only)."""
        return bool(self._board.numerics)

    @property
    def numerics_starting(self) -> bool:
        """True while the numerics worker is still starting (requests run timing-only until it is ready)."""
        return bool(getattr(self._board, "numerics_starting", False))

    @property
    def numerics_broken(self) -> bool:
        """True after the numerics worker died or timed out (reset or reload restarts it)."""
        return bool(self._board.numerics_broken)

    @property
    def memory_cleared(self) -> bool:
        """True after ClearAllDevMem until the model is reloaded."""
        return bool(self._board.memory_cleared)

    def achieved_speed(self) -> float | None:
        """Simulated seconds per wall second over the last paced run (None before one)."""
        return self._board.achieved_speed()

    @property
    def busy_us(self) -> float:
        """Simulated µs the board spent executing steps since power-on (per chip: ``chiplets()[c].busy_us``)."""
        return self._board.busy_us

    def counters(self) -> JobCounters:
        return self._board.counters()

    def accounting_problems(self) -> list[str]:
        """Why the job counters do not balance (empty when they do)."""
        return self._board.accounting_problems()

    def chiplets(self) -> list[ChipletStatus]:
        return self._board.chiplets()

    def last_steps(self) -> dict[str, StepResult]:
        """The last finished step of each kind ("prefill", "decode"), a copy of the map."""
        return dict(self._board.last_steps)

    def kv_occupancy(self) -> KVOccupancy:
        return self._board.kv.occupancy()

    def kv_counters(self) -> KVCounters:
        return self._board.kv.counters()

    def read_register(self, key: str | int) -> int:
        """Read a status register (reads have no side effects on this device)."""
        return self._board.registers.read(key)

    def register_map(self) -> tuple[RegisterDef, ...]:
        """Every mapped register (name, address, writable, description)."""
        return tuple(REGISTER_MAP)

    def resolve_register(self, key: str | int) -> RegisterDef:
        """The register named (or at the address) ``key``; KeyError if none."""
        return self._board.registers.resolve(key)

    def faults(self) -> dict[str, Any]:
        """{"active", "armed", "in_effect": list[str], "fired": [{"fault", "detail"}] not yet acknowledged}."""
        f = self._board.faults
        return {"active": f.active(), "armed": f.armed(), "in_effect": f.in_effect(), "fired": f.unacknowledged()}
