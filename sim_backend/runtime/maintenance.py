"""The maintenance door of the runtime: register access, reset, memory clear, KV clear, dumps and
golden I/O, each behind an explicit lease the maintenance plane checks (facts.md F5 C4, F9)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sim_backend.device.board import ResetReport, SimulatedBoard
from sim_backend.device.faults import FiredFault
from sim_backend.errors import MaintenanceRefused
from sim_backend.runtime.calbin import OutputBuf
from sim_backend.runtime.calrt import CALRT_VERSION
from sim_backend.runtime.monitor import DeviceMonitor
from sim_backend.runtime.session import RuntimeSession, scratch_sequence

# --- maintenance-only runtime functions ------------------------------------------------


def require_lease(action: str, lease: Any) -> None:
    """Default lease check: refuse without a lease. The maintenance plane passes its own check."""
    if lease is None:
        raise MaintenanceRefused(action, "exclusive mode required: enter exclusive mode first")


class MaintenanceRuntime:
    """CalRT functions that must not be in the inference API (facts.md F5 C1/C4, F9).

    Every method takes the maintenance ``lease`` and calls
    ``lease_check(action, lease)`` first, which raises MaintenanceRefused
    (the maintenance plane passes its own ``_check``, so a stale lease is
    refused too). Auditing is the caller's job (``InProcessMaintenance._run``).

    Args:
        board: the simulated board.
        lease_check: callable(action: str, lease) -> None, raising MaintenanceRefused.
        memory_plan: optional ``memory.MemoryPlan`` for per-chip memory reads.
    """

    def __init__(self, board: SimulatedBoard, lease_check: Callable[[str, Any], None] = require_lease,
                 memory_plan: Any = None) -> None:
        self._board = board
        #: callable(action, lease) raising MaintenanceRefused, fixed at construction (the maintenance plane's)
        self._lease_check = lease_check
        #: the KV sequence of the maintenance jobs (probe, self-test, health check); never a serving slot's
        self.scratch_seq = scratch_sequence(board.kv.n_seq_max)
        self._memory_plan = memory_plan
        #: read-only status (no lease): what the maintenance plane shows and checks
        self.monitor = DeviceMonitor(board)
        self._session: RuntimeSession | None = None

    def read_register(self, lease: Any, key: str | int) -> int:
        """Any register of the map, by name or address (KeyError-like MaintenanceRefused if unknown)."""
        self._lease_check("read_register", lease)
        try:
            return self._board.registers.read(key)
        except KeyError as e:
            raise MaintenanceRefused("read_register", str(e)) from None

    def write_register(self, lease: Any, key: str | int, value: int) -> None:
        """Write a register the map marks writable; MaintenanceRefused otherwise."""
        self._lease_check("write_register", lease)
        try:
            self._board.registers.write(key, value)
        except (KeyError, PermissionError, ValueError) as e:
            raise MaintenanceRefused("write_register", str(e)) from None

    def dump_registers(self, lease: Any) -> dict[str, int]:
        self._lease_check("dump_registers", lease)
        return self._board.registers.dump()

    def config_metadata(self, lease: Any) -> dict[str, Any]:
        """Config metadata: bundle identity, sub-models with I/O specs and CSRs, findings, registers."""
        self._lease_check("config_metadata", lease)
        b = self._board.bundle
        return {
            "bundle": b.name, "path": str(b.path), "calrt_version": b.calrt_version,
            "runtime_version": CALRT_VERSION,
            "firmware_commit": f"{self._board.registers.read('CALCORERT_COMMIT'):07x}",
            "context": b.context, "max_batch_size": b.max_batch_size, "chips": b.shape.n_chips,
            "submodels": {n: {"smodel_type": s.smodel_type, "effective_type": s.effective_type, "csr": list(s.csr),
                              "inputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in s.inputs],
                              "outputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)}
                                          for t in s.outputs]}
                          for n, s in b.submodels.items()},
            "findings": [{"severity": f.severity, "code": f.code, "file": f.file, "field": f.field,
                          "message": f.message, "action": f.action} for f in b.findings],
            "registers": self._board.registers.dump(),
        }

    def clear_kv(self, lease: Any) -> None:
        """Clear the whole KV cache (every sequence)."""
        self._lease_check("clear_kv", lease)
        self._board.kv.clear()

    # --- device state ---------------------------------------------------------------

    def reset(self, lease: Any, timeout: float) -> ResetReport:
        """Reset the device: every pending/running job ends with DeviceReset, registers, KV and faults
        back to power-on, the calbin reconfigured. {"failed_jobs", "calbin", "resets", "wall_ms"}.
        Raises DeviceError if the device thread does not come back within ``timeout`` host s."""
        self._lease_check("reset", lease)
        rep = self._board.reset(timeout=timeout)
        self._session = None  # a fresh buffer pool: nothing from before the reset can hold one
        return rep

    def clear_memory(self, lease: Any) -> None:
        """ClearAllDevMem: weights and KV zeroed on both chips; jobs refused until ``load_model``."""
        self._lease_check("clear_device_memory", lease)
        self._board.clear_memory()

    def load_model(self, lease: Any) -> float:
        """Load the weights again (after ClearAllDevMem); returns host wall seconds taken."""
        self._lease_check("reload_model", lease)
        return self._board.load_model()

    def free_seq(self, lease: Any, seq_id: int) -> None:
        """Free every KV cell of ``seq_id`` (the maintenance scratch sequence)."""
        self._lease_check("free_seq", lease)
        self._board.kv.free(seq_id)

    # --- faults ---------------------------------------------------------------------------

    def arm_fault(self, lease: Any, kind: str, *, chip: int = 1, factor: float = 4.0, count: int = 1) -> list[str]:
        """Arm ``kind`` (ccu_exception | kv_exhaustion | link_error: the next ``count`` jobs/applies;
        slow_chip: ``chip`` runs ``factor`` x slower until cleared or reset). Returns the armed list.
        Arguments are the caller's to validate (MaintenancePlane.inject_fault)."""
        self._lease_check("inject_fault", lease)
        f = self._board.faults
        if kind == "slow_chip":
            with f._lock:
                f.slow_chip[int(chip)] = float(factor)
        else:
            f.arm({"ccu_exception": "ccu_next", "kv_exhaustion": "kv_exhaust_next",
                   "link_error": "link_error_next"}[kind], count)
        return f.active()

    def disarm_faults(self, lease: Any) -> list[str]:
        """Disarm every injected fault; returns what was armed or in effect."""
        self._lease_check("clear_faults", lease)
        f = self._board.faults
        before = f.active()
        with f._lock:
            f.ccu_next = f.link_error_next = f.kv_exhaust_next = 0
            f.slow_chip.clear()
        return before

    def acknowledge_faults(self) -> list[FiredFault]:
        """Mark the faults that fired as seen (no lease: the device is not changed); returns them."""
        return self._board.faults.acknowledge()

    # --- scratch jobs -------------------------------------------------------------------

    def scratch_submit(self, lease: Any, kind: str, seq_id: int, tokens: Any, p0: int) -> OutputBuf:
        """Submit one prefill/decode job of ``seq_id`` (the scratch sequence) through the runtime's
        checked path (InputBuf checks, CSR, sub-model by exact name) after applying KV for positions
        ``p0..p0+n-1``. Returns the OutputBuf at once (``wait(timeout)`` gives the StepResult); raises
        the runtime's typed errors (KVExhausted, SubmitError, DeviceNotReady, ...)."""
        self._lease_check("scratch_submit", lease)
        if self._session is None:
            self._session = RuntimeSession(self._board, parallel=False)
        s = self._session
        toks = np.asarray(tokens, dtype=np.int64)
        positions = np.arange(p0, p0 + toks.shape[0], dtype=np.int64)
        cells = s.kv.apply(seq_id, int(toks.shape[0]), timeout=1.0, positions=positions)
        return s.step(kind, seq_id, toks, positions, np.asarray(cells))
