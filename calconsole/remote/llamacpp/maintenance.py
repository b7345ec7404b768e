"""``MaintenancePlane`` of a stock llama-server: only the server's own actions, audited here.

llama-server has slot actions (``POST /slots/{id}?action=erase|save|restore``; save and restore only
when it was started with ``--slot-save-path``) and ``GET /health``. So:

- ``clear_kv`` erases every slot's KV (``action=erase`` per slot); ``erase_slot(i)`` one slot;
- ``save_slot(i, filename)`` / ``restore_slot(i, filename)``: the server's save and restore (a server
  started without a slot save path answers 501 ``not_supported_error``: raised as ``NotOffered`` with
  its message);
- ``health_check``: ``GET /health``;
- exclusive mode, reset, memory clear, model reload, dump, self-test, registers, faults and the
  probe request do not exist on a llama-server: each raises ``NotOffered`` (a ``MaintenanceRefused``)
  naming what is missing. Nothing is faked.

There is no lease on a llama-server (it has no exclusive mode): the offered actions take ``lease``
None; any other value is refused. Every call, offered or not, granted or refused, is appended to a
LOCAL audit log (``AuditLog``; the server keeps none) with ``origin`` {"server": URL, "kind":
"llama-server", "via": "http"}. ``mode()`` is always "serving".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sim_backend.planes import (
    AuditLog,
    CalError,
    Lease,
    MaintenanceArgumentError,
    MaintenanceRefused,
    NotOffered,
    audit_origin,
)

from ..connection import Connection, ServerUnreachable, error_body

KIND = "llama-server"
#: contract methods a llama-server cannot serve, and what it lacks
MISSING = {
    "enter_exclusive": "it has no exclusive mode (no admission stop, drain or lease)",
    "leave_exclusive": "it has no exclusive mode",
    "reset": "it has no device reset (restart the server process instead)",
    "clear_device_memory": "it cannot clear device memory while it runs",
    "reload_model": "it cannot reload its model (restart the server with the model)",
    "dump": "it has no trace or register dump",
    "self_test": "it has no golden self-test",
    "read_register": "it exposes no device registers",
    "write_register": "it exposes no device registers",
    "dump_registers": "it exposes no device registers",
    "inject_fault": "it has no fault injection",
    "clear_faults": "it has no fault injection",
    "acknowledge_faults": "it reports no device faults",
    "probe_request": "it has no exclusive-mode probe (send an ordinary request instead)",
}
OFFERED = ("clear_kv", "erase_slot", "save_slot", "restore_slot", "health_check")
SLOT_ACTION_S = 60.0


class LlamaMaintenancePlane:
    """The maintenance plane of a llama-server at ``conn.url`` (see the module doc). Thread-safe.

    ``audit_path``: the local audit log (None: the user state dir's default). ``n_slots``: the
    server's ``total_slots``. Errors: ``NotOffered`` for an action the server lacks;
    ``MaintenanceArgumentError`` for a bad slot or file name; ``MaintenanceRefused`` for a lease given
    (there is none) or the server's refusal; ``ServerUnreachable`` when it does not answer.
    """

    needs_lease = False
    server_kind = KIND

    def __init__(self, conn: Connection, n_slots: int, audit_path: str | Path | None = None) -> None:
        self._conn = conn
        self._n_slots = n_slots
        self._audit = AuditLog(audit_path)
        self._since = time.time()
        self._origin = {"server": conn.url, "kind": KIND, "via": "http"}

    @property
    def audit(self) -> AuditLog:
        return self._audit

    @property
    def lease(self) -> Lease | None:
        """Always None: a llama-server has no exclusive mode."""
        return None

    def offers(self, action: str) -> bool:
        """Whether ``action`` (a contract method name) is one this server has."""
        return action in OFFERED

    def mode(self) -> Mapping[str, Any]:
        return {"mode": "serving", "lease_holder": None, "since_unix_s": self._since, "exclusive_offered": False}

    def status(self) -> Mapping[str, Any]:
        """Mode, the offered and the missing actions, the local audit log (read-only, not audited)."""
        return {**self.mode(), "server": KIND, "url": self._conn.url, "offered": list(OFFERED),
                "not_offered": dict(MISSING), "audit_log": str(self._audit.path), "faults": [], "memory": None}

    def close(self) -> None:
        """Nothing held (no lease to release)."""

    # --- auditing -----------------------------------------------------------------------------

    def _audited(self, action: str, args: dict[str, Any], fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        t0 = time.perf_counter()
        with audit_origin(self._origin):
            aid = self._audit.start(action, args)
            try:
                result = fn()
            except MaintenanceRefused as e:
                self._audit.finish(aid, action, args, granted=False, ok=False, result={"error": e.reason},
                                   duration_ms=(time.perf_counter() - t0) * 1e3,
                                   not_offered=isinstance(e, NotOffered))
                raise
            except CalError as e:
                self._audit.finish(aid, action, args, granted=True, ok=False, result={"error": str(e)},
                                   duration_ms=(time.perf_counter() - t0) * 1e3)
                raise
            self._audit.finish(aid, action, args, granted=True, ok=bool(result.get("ok")), result=result,
                               duration_ms=(time.perf_counter() - t0) * 1e3)
        return result

    def _not_offered(self, action: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        def refuse() -> dict[str, Any]:
            raise NotOffered(action, KIND, MISSING[action])
        return self._audited(action, args or {}, refuse)

    def _no_lease(self, action: str, lease: Lease | None) -> None:
        if lease is not None:
            raise MaintenanceRefused(action, "a llama-server has no exclusive mode, so no lease exists; "
                                             "call with lease None")

    def _slot_index(self, action: str, slot: Any) -> int:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self._n_slots:
            raise MaintenanceArgumentError(action, f"slot must be an int in 0..{self._n_slots - 1}, got {slot!r}")
        return slot

    def _slot_action(self, action: str, slot: int, what: str, filename: str | None = None) -> dict[str, Any]:
        body = {"filename": filename} if filename is not None else None
        resp = self._conn.call("POST", f"/slots/{slot}", params={"action": what}, json_body=body,
                               read_timeout_s=SLOT_ACTION_S)
        if resp.status_code == 501:
            raise NotOffered(action, KIND, str(error_body(resp).get("message")))
        if resp.status_code >= 300:
            err = error_body(resp)
            if resp.status_code == 400:
                raise MaintenanceArgumentError(action, str(err.get("message")))
            raise MaintenanceRefused(action, f"HTTP {resp.status_code} {err.get('type')}: {err.get('message')}")
        out = resp.json()
        return {"ok": True, "slot": slot, "server": out if isinstance(out, dict) else {"answer": out}}

    # --- offered ---------------------------------------------------------------------------------

    def clear_kv(self, lease: Lease | None) -> dict[str, Any]:
        """Erase every slot's KV (``POST /slots/{i}?action=erase``); returns the cells each slot freed."""
        def run() -> dict[str, Any]:
            self._no_lease("clear_kv", lease)
            slots = [self._slot_action("clear_kv", i, "erase") for i in range(self._n_slots)]
            erased = [int(s["server"].get("n_erased", 0)) for s in slots]
            return {"ok": True, "detail": f"erased {sum(erased)} KV cells in {len(slots)} slots", "n_erased": erased,
                    "freed_tokens": sum(erased)}
        return self._audited("clear_kv", {}, run)

    def erase_slot(self, lease: Lease | None, slot: int) -> dict[str, Any]:
        """Erase one slot's KV (``action=erase``)."""
        def run() -> dict[str, Any]:
            self._no_lease("erase_slot", lease)
            return self._slot_action("erase_slot", self._slot_index("erase_slot", slot), "erase")
        return self._audited("erase_slot", {"slot": slot}, run)

    def save_slot(self, lease: Lease | None, slot: int, filename: str) -> dict[str, Any]:
        """Save a slot's KV to ``filename`` in the server's slot save path (``action=save``)."""
        def run() -> dict[str, Any]:
            self._no_lease("save_slot", lease)
            return self._slot_action("save_slot", self._slot_index("save_slot", slot), "save",
                                     self._filename("save_slot", filename))
        return self._audited("save_slot", {"slot": slot, "filename": filename}, run)

    def restore_slot(self, lease: Lease | None, slot: int, filename: str) -> dict[str, Any]:
        """Restore a slot's KV from ``filename`` in the server's slot save path (``action=restore``)."""
        def run() -> dict[str, Any]:
            self._no_lease("restore_slot", lease)
            return self._slot_action("restore_slot", self._slot_index("restore_slot", slot), "restore",
                                     self._filename("restore_slot", filename))
        return self._audited("restore_slot", {"slot": slot, "filename": filename}, run)

    @staticmethod
    def _filename(action: str, filename: Any) -> str:
        # llama-server refuses path separators itself; refusing here says why before any request
        if not isinstance(filename, str) or not filename or "/" in filename or "\\" in filename or ".." in filename:
            raise MaintenanceArgumentError(action, f"filename must be a plain file name, got {filename!r}")
        return filename

    def health_check(self, lease: Lease | None) -> dict[str, Any]:
        """``GET /health``: ok, loading (503) or error."""
        def run() -> dict[str, Any]:
            self._no_lease("health_check", lease)
            t0 = time.perf_counter()
            try:
                resp = self._conn.call("GET", "/health", read_timeout_s=10.0)
            except ServerUnreachable as e:
                return {"ok": False, "detail": str(e), "wall_ms": (time.perf_counter() - t0) * 1e3}
            wall_ms = (time.perf_counter() - t0) * 1e3
            if resp.status_code == 200:
                return {"ok": True, "detail": "llama-server /health: ok", "wall_ms": wall_ms}
            return {"ok": False, "detail": f"llama-server /health: HTTP {resp.status_code}: "
                                           f"{error_body(resp).get('message')}", "wall_ms": wall_ms}
        return self._audited("health_check", {}, run)

    # --- not offered by a llama-server ------------------------------------------------------------

    def enter_exclusive(self, holder: str, drain_timeout_s: float | None = None) -> Lease:
        self._not_offered("enter_exclusive", {"holder": holder})
        raise AssertionError("unreachable")  # pragma: no cover - _not_offered always raises

    def leave_exclusive(self, lease: Lease | None, *, force: bool = False) -> dict[str, Any]:
        return self._not_offered("leave_exclusive")

    def reset(self, lease: Lease | None) -> dict[str, Any]:
        return self._not_offered("reset")

    def clear_device_memory(self, lease: Lease | None) -> dict[str, Any]:
        return self._not_offered("clear_device_memory")

    def reload_model(self, lease: Lease | None) -> dict[str, Any]:
        return self._not_offered("reload_model")

    def dump(self, lease: Lease | None, path: str | Path | None = None) -> dict[str, Any]:
        return self._not_offered("dump")

    def self_test(self, lease: Lease | None) -> dict[str, Any]:
        return self._not_offered("self_test")

    def read_register(self, lease: Lease | None, key: str | int) -> dict[str, Any]:
        return self._not_offered("read_register", {"key": key})

    def write_register(self, lease: Lease | None, key: str | int, value: int | str) -> dict[str, Any]:
        return self._not_offered("write_register", {"key": key})

    def dump_registers(self, lease: Lease | None) -> dict[str, Any]:
        return self._not_offered("dump_registers")

    def inject_fault(self, lease: Lease | None, kind: str, *, chip: int = 1, factor: float = 4.0,
                     count: int = 1) -> dict[str, Any]:
        return self._not_offered("inject_fault", {"kind": kind})

    def clear_faults(self, lease: Lease | None) -> dict[str, Any]:
        return self._not_offered("clear_faults")

    def acknowledge_faults(self, holder: str) -> dict[str, Any]:
        return self._not_offered("acknowledge_faults", {"holder": holder})

    def probe_request(self, lease: Lease | None, prompt: str = "hi", max_tokens: int = 8) -> dict[str, Any]:
        return self._not_offered("probe_request")


__all__ = ["KIND", "MISSING", "OFFERED", "LlamaMaintenancePlane"]
