"""Controlled maintenance plane (FACTS F5 C4, F9): exclusive lease, reset,
device-memory clear. Reset, ClearAllDevMem and register access never reach
the inference plane; here they take a lease and refuse without one.

Every call, granted or refused, is appended to the audit log.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from .audit import AuditLog
from .device import SimulatedBoard
from .engine import Engine
from .errors import CalError, MaintenanceRefused

MAINTENANCE_REASON = "device in maintenance"


@dataclass(frozen=True)
class Lease:
    """Proof of exclusive mode. Only one exists at a time; actions check it is the current one."""

    id: str
    holder: str
    granted_unix_s: float


class MaintenancePlane:
    """Exclusive mode and guarded device actions.

    Args:
        drain_timeout_s: default bounded drain (host wall s) before in-flight
            requests are cancelled with the reason "device entering maintenance".
        reset_timeout_s: bound on a reset (host wall s).
    """

    def __init__(self, board: SimulatedBoard, engine: Engine, audit: AuditLog, *,
                 drain_timeout_s: float = 5.0, reset_timeout_s: float = 10.0) -> None:
        self._board = board
        self._engine = engine
        self.audit = audit
        self.drain_timeout_s = drain_timeout_s
        self.reset_timeout_s = reset_timeout_s
        self._lock = threading.RLock()
        self._lease: Lease | None = None
        self._mode = "serving"

    # --- state ---------------------------------------------------------------

    def mode(self) -> dict:
        """{"mode": serving | draining | exclusive, "lease_holder": str | None}."""
        with self._lock:
            return {"mode": self._mode, "lease_holder": self._lease.holder if self._lease else None}

    @property
    def lease(self) -> Lease | None:
        return self._lease

    def _check(self, action: str, lease: Lease | None) -> None:
        if lease is None:
            raise MaintenanceRefused(action, "exclusive mode required: enter exclusive mode first")
        if self._lease is None or lease.id != self._lease.id:
            raise MaintenanceRefused(action, "lease is not the current one (expired or released)")

    def _run(self, action: str, args: dict, lease: Lease | None, fn: Callable[[], Any], *,
             needs_lease: bool = True) -> Any:
        """Audit start, check the lease, run, audit the outcome (durably) and return/raise."""
        t0 = time.perf_counter()
        aid = self.audit.start(action, args)
        try:
            if needs_lease:
                with self._lock:
                    self._check(action, lease)
            result = fn()
        except MaintenanceRefused as e:
            self.audit.finish(aid, action, args, granted=False, ok=False, result=str(e),
                              duration_ms=(time.perf_counter() - t0) * 1e3)
            raise
        except CalError as e:
            self.audit.finish(aid, action, args, granted=True, ok=False, result=f"{type(e).__name__}: {e}",
                              duration_ms=(time.perf_counter() - t0) * 1e3)
            raise
        ok = not (isinstance(result, dict) and result.get("ok") is False)
        self.audit.finish(aid, action, args, granted=True, ok=ok, result=result,
                          duration_ms=(time.perf_counter() - t0) * 1e3)
        return result

    # --- exclusive mode --------------------------------------------------------

    def enter_exclusive(self, holder: str, drain_timeout_s: float | None = None) -> Lease:
        """Stop admission, drain in-flight requests for up to ``drain_timeout_s`` (then cancel them
        with a reason), and return the lease. Refused if a lease is already held."""
        timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        args = {"holder": holder, "drain_timeout_s": timeout}

        def go() -> Lease:
            with self._lock:
                if self._lease is not None or self._mode != "serving":
                    raise MaintenanceRefused("enter_exclusive", f"exclusive mode already held by {self._lease.holder if self._lease else 'another caller'}")
                self._mode = "draining"
            self._engine.pause_admission(MAINTENANCE_REASON)
            report = self._engine.drain(timeout, "device entering maintenance (exclusive mode)")
            with self._lock:
                self._lease = Lease(uuid.uuid4().hex, holder, time.time())
                self._mode = "exclusive"
                self.last_drain = report
                return self._lease

        lease = self._run("enter_exclusive", args, None, go, needs_lease=False)
        return lease

    last_drain: dict | None = None

    def leave_exclusive(self, lease: Lease | None) -> dict:
        """Release the lease and re-admit requests."""
        def go() -> dict:
            with self._lock:
                self._lease = None
                self._mode = "serving"
            self._engine.resume_admission()
            return {"ok": True}

        return self._run("leave_exclusive", {}, lease, go)

    # --- actions -------------------------------------------------------------------

    def reset(self, lease: Lease | None) -> dict:
        """Reset the device (bounded). In-flight handles get DeviceReset; KV cleared; calbin
        reconfigured; a health check runs after and is reported honestly ("ok": False on failure)."""
        def go() -> dict:
            rep = self._board.reset(timeout=self.reset_timeout_s)
            health = self.health_check()
            return {"ok": health["ok"], **rep, "health": health}

        return self._run("reset", {}, lease, go)

    def clear_device_memory(self, lease: Lease | None) -> dict:
        """ClearAllDevMem: zero DRAM/SRAM; inference refused until ``reload_model``."""
        def go() -> dict:
            self._board.clear_memory()
            return {"ok": True, "inference": "refused until the model is reloaded"}

        return self._run("clear_device_memory", {}, lease, go)

    def reload_model(self, lease: Lease | None) -> dict:
        """Reload weights and reconfigure the calbin after a memory clear."""
        def go() -> dict:
            wall = self._board.load_model()
            return {"ok": True, "wall_ms": wall * 1e3}

        return self._run("reload_model", {}, lease, go)

    def health_check(self) -> dict:
        """One decode-sized job through the device thread on a scratch sequence, bounded by a timeout.

        Returns {"ok", "detail", "sim_us", "wall_ms"}. Does not need the lease (read-only probe),
        but runs only when no request is in flight (the board is quiet in exclusive mode).
        """
        import numpy as np

        b = self._board
        t0 = time.perf_counter()
        seq = 63  # scratch sequence id, never a slot
        try:
            if b.memory_cleared:
                return {"ok": False, "detail": "device memory cleared", "sim_us": 0.0, "wall_ms": 0.0}
            cells = b.kv.apply(seq, 1, timeout=1.0, positions=[0])
            try:
                ctx, pos = b.kv.seq_cells(seq)
                job = b.submit("decode", seq, np.array([151644]), np.array([0]), np.asarray(cells), ctx, pos)
                res = job.wait(self.reset_timeout_s)
            finally:
                b.kv.free(seq)
            ok = res.logits_bf16 is None or bool(np.isfinite(
                (res.logits_bf16.astype(np.uint32) << 16).view(np.float32)).all())
            return {"ok": ok, "detail": "decode probe finished" + ("" if ok else " with non-finite logits"),
                    "sim_us": res.sim_us, "wall_ms": (time.perf_counter() - t0) * 1e3}
        except CalError as e:
            return {"ok": False, "detail": f"{type(e).__name__}: {e}", "sim_us": 0.0,
                    "wall_ms": (time.perf_counter() - t0) * 1e3}
