"""``MaintenancePlane`` over HTTP: ``/maintenance/...`` with the admin key, and a lease kept alive.

Every call is sent, granted or not, so the server audits it (with this client's address and key
label): an action without a lease is refused by the server, not here. Refusals (403, a wrong
admin key, a bad argument) raise ``MaintenanceRefused``; a device failure ``DeviceError``.

The lease: ``enter_exclusive`` returns a ``Lease`` (``lease_id``, ``holder``, ``granted_unix_s``
from the server) and starts a renewal thread that posts ``/maintenance/lease/renew`` every third
of the lease's ``ttl_s``. While the server cannot be reached it retries every second; if no
renewal succeeded for ``ttl_s`` (the server has let the lease lapse by then) or the server refuses
one, the lease is *lost*: ``lease`` becomes None, ``lease_lost`` says why and when, and the
``on_lease_lost`` callbacks run (from the renewal thread).

``reset`` and ``clear_device_memory`` send the device's name as the server's confirmation: the
caller has confirmed already (the console's typed name). ``dump`` writes on the server, beside
its audit log (a ``path`` cannot be chosen over HTTP).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sim_backend.planes import Lease, MaintenanceRefused

from .connection import Connection, ServerUnreachable

AUDIT_LIMIT = 10_000  # the server's most per call
#: a reset and its health check are bounded by the plane (2 x reset_timeout_s); a self-test waits for its job
#: up to the server's step bound (``step_timeout_s``, 120 s by default), and then answers: a little more than that
ACTION_READ_S = 150.0


class RemoteAudit:
    """``AuditReader`` of the server's audit log (``GET /maintenance/audit``); ``path`` is on the server."""

    def __init__(self, conn: Connection, path: str | None = None) -> None:
        self._conn = conn
        self._path = Path(path) if path else None

    @property
    def path(self) -> Path:
        if self._path is None:
            self.entries(limit=1)
        assert self._path is not None
        return self._path

    def entries(self, limit: int = AUDIT_LIMIT) -> list[dict[str, Any]]:
        """The last ``limit`` entries (every entry of a log up to 10,000 entries), oldest first."""
        out = self._conn.json("GET", "/maintenance/audit", admin=True, action="audit", params={"limit": limit})
        self._path = Path(str(out["path"]))
        return list(out["entries"])


class RemoteMaintenancePlane:
    """Exclusive mode and guarded actions of a running server. Thread-safe.

    Args:
        conn: the connection (with an admin key).
        device_name: the device's name, sent as the confirmation of reset / clear memory.
        status: ``GET /maintenance/status`` already read (else read here: MaintenanceRefused if the
            key is refused or the server has no maintenance routes).
    """

    def __init__(self, conn: Connection, device_name: str, status: Mapping[str, Any] | None = None) -> None:
        self._conn = conn
        self.device_name = device_name
        st = status if status is not None else self.status()
        self.drain_timeout_s = float(st.get("drain_timeout_s") or 5.0)
        self.audit = RemoteAudit(conn, st.get("audit_log"))
        self.last_drain: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._lease: Lease | None = None
        self._lost: dict[str, Any] | None = None
        self._renewer: _Renewer | None = None
        self._lost_callbacks: list[Callable[[Lease, str], None]] = []

    # --- state --------------------------------------------------------------------------

    @property
    def lease(self) -> Lease | None:
        """The lease this client holds (None if it holds none, or it was lost). Another client's lease
        is not visible as a ``Lease``: ``mode()["lease_holder"]`` names its holder."""
        return self._lease

    @property
    def lease_lost(self) -> dict[str, Any] | None:
        """{"holder", "reason", "at_unix_s"} of the last lease this client lost, or None."""
        return self._lost

    def on_lease_lost(self, fn: Callable[[Lease, str], None]) -> None:
        """Call ``fn(lease, reason)`` (from the renewal thread) when a held lease is lost."""
        self._lost_callbacks.append(fn)

    def status(self) -> dict[str, Any]:
        """The server's maintenance status: mode, holder, faults, memory state, audit path, ``http_lease``."""
        return dict(self._conn.json("GET", "/maintenance/status", admin=True, action="status"))

    def mode(self) -> dict[str, Any]:
        st = self.status()
        return {k: st.get(k) for k in ("mode", "lease_holder", "since_unix_s", "health_failed")}

    # --- exclusive mode -----------------------------------------------------------------

    def enter_exclusive(self, holder: str, drain_timeout_s: float | None = None) -> Lease:
        """Drain (bounded by the server's plane) and take the lease; starts renewing it."""
        drain = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        body: dict[str, Any] = {"holder": holder}
        if drain_timeout_s is not None:
            body["drain_timeout_s"] = drain_timeout_s
        out = self._conn.json("POST", "/maintenance/exclusive", admin=True, action="enter_exclusive", json_body=body,
                              read_timeout_s=(drain if isinstance(drain, (int, float)) else 0) + ACTION_READ_S)
        lease = Lease(str(out["lease_id"]), str(out["holder"]), float(out["granted_unix_s"]))
        with self._lock:
            self.last_drain = out.get("drain")
            self._lease, self._lost = lease, None
            self._start_renewer(lease, float(out.get("ttl_s", 30.0)))
        return lease

    def _start_renewer(self, lease: Lease, ttl_s: float) -> None:
        self._renewer = _Renewer(self, lease, ttl_s)
        self._renewer.start()

    def _stop_renewer(self) -> _Renewer | None:
        r = self._renewer
        self._renewer = None
        if r is not None:
            r.stop()
        return r

    def _lapse(self, lease: Lease, reason: str) -> None:
        with self._lock:
            if self._lease is None or self._lease.id != lease.id:
                return
            self._lease = None
            self._lost = {"holder": lease.holder, "reason": reason, "at_unix_s": time.time()}
            self._renewer = None
        for fn in list(self._lost_callbacks):
            try:
                fn(lease, reason)
            except Exception:  # noqa: BLE001, S110 - a listener's bug must not stop the report
                pass

    def leave_exclusive(self, lease: Lease | None, *, force: bool = False) -> dict[str, Any]:
        """Leave exclusive mode. Renewal stops first (a renewal after the release would be refused and
        audited); if the server refuses the leave, renewal resumes."""
        ours = lease is not None and self._lease is not None and lease.id == self._lease.id
        stopped = self._stop_renewer() if ours else None
        try:
            rep = self._post("leave_exclusive", "/maintenance/leave", lease, force=bool(force))
        except BaseException:
            if stopped is not None and self._lease is not None:
                self._start_renewer(self._lease, stopped.ttl_s)
            raise
        if ours:
            with self._lock:
                self._lease = None
        return rep

    # --- actions ------------------------------------------------------------------------

    def _post(self, action: str, path: str, lease: Lease | None, **fields: Any) -> dict[str, Any]:
        body = {"lease_id": lease.id if isinstance(lease, Lease) else None, **fields}
        return dict(self._conn.json("POST", path, admin=True, action=action, json_body=body,
                                    read_timeout_s=ACTION_READ_S))

    def reset(self, lease: Lease | None) -> dict[str, Any]:
        return self._post("reset", "/maintenance/reset", lease, device=self.device_name)

    def clear_device_memory(self, lease: Lease | None) -> dict[str, Any]:
        return self._post("clear_device_memory", "/maintenance/clear-memory", lease, device=self.device_name)

    def reload_model(self, lease: Lease | None) -> dict[str, Any]:
        return self._post("reload_model", "/maintenance/reload", lease)

    def clear_kv(self, lease: Lease | None) -> dict[str, Any]:
        return self._post("clear_kv", "/maintenance/clear-kv", lease)

    def dump(self, lease: Lease | None, path: str | Path | None = None) -> dict[str, Any]:
        if path is not None:
            raise MaintenanceRefused("dump", "over HTTP the dump is written on the server, beside its audit log; "
                                             "a path cannot be chosen")
        return self._post("dump", "/maintenance/dump", lease)

    def self_test(self, lease: Lease | None) -> dict[str, Any]:
        return self._post("self_test", "/maintenance/self-test", lease)

    def health_check(self, lease: Lease | None) -> dict[str, Any]:
        return self._post("health_check", "/maintenance/health-check", lease)

    def read_register(self, lease: Lease | None, key: str | int) -> dict[str, Any]:
        return self._post("read_register", "/maintenance/registers/read", lease, key=key)

    def write_register(self, lease: Lease | None, key: str | int, value: int | str) -> dict[str, Any]:
        return self._post("write_register", "/maintenance/registers/write", lease, key=key, value=value)

    def dump_registers(self, lease: Lease | None) -> dict[str, Any]:
        return self._post("dump_registers", "/maintenance/registers", lease)

    def inject_fault(self, lease: Lease | None, kind: str, *, chip: int = 1, factor: float = 4.0,
                     count: int = 1) -> dict[str, Any]:
        return self._post("inject_fault", "/maintenance/faults/inject", lease, kind=kind, chip=chip, factor=factor,
                          count=count)

    def clear_faults(self, lease: Lease | None) -> dict[str, Any]:
        return self._post("clear_faults", "/maintenance/faults/clear", lease)

    def acknowledge_faults(self, holder: str) -> dict[str, Any]:
        return dict(self._conn.json("POST", "/maintenance/faults/acknowledge", admin=True,
                                    action="acknowledge_faults", json_body={"holder": holder}))

    def probe_request(self, lease: Lease | None, prompt: str = "hi", max_tokens: int = 8) -> dict[str, Any]:
        return self._post("probe_request", "/maintenance/probe", lease, prompt=prompt, max_tokens=max_tokens)

    def close(self, *, release: bool = True) -> None:
        """Stop renewing; with ``release``, leave exclusive mode first if this client holds the lease
        (so a closed console does not keep the device for a whole ttl). Bounded; never raises."""
        lease = self._lease
        if release and lease is not None:
            try:
                self.leave_exclusive(lease, force=True)
            except Exception:  # noqa: BLE001, S110 - the server lets the lease lapse anyway
                pass
        self._stop_renewer()


class _Renewer:
    """Renews one lease every ``ttl_s / 3`` (every second while the server is unreachable)."""

    RETRY_S = 1.0

    def __init__(self, plane: RemoteMaintenancePlane, lease: Lease, ttl_s: float) -> None:
        self.plane = plane
        self.lease = lease
        self.ttl_s = ttl_s
        self.period_s = max(0.2, ttl_s / 3.0)
        self._stop = threading.Event()
        self._busy = threading.Lock()  # held while a renewal is on the wire; stop() waits for it
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="calconsole-lease-renew", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No renewal is sent after this returns (it waits for one on the wire, bounded by its timeout)."""
        self._stop.set()
        with self._busy:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(self.period_s + 10.0)

    def _run(self) -> None:
        conn = self.plane._conn
        wait = self.period_s
        while not self._stop.wait(wait):
            lost = None
            with self._busy:
                if self._stop.is_set():
                    return
                try:
                    resp = conn.call("POST", "/maintenance/lease/renew", admin=True,
                                     json_body={"lease_id": self.lease.id},
                                     read_timeout_s=max(1.0, min(5.0, self.period_s)))
                except ServerUnreachable as e:
                    resp = None
                    if time.monotonic() - self._last_ok >= self.ttl_s:
                        lost = f"not renewed for {self.ttl_s:g} s (the lease's ttl): {e}"
            if resp is not None and resp.status_code == 200:
                self._last_ok = time.monotonic()
                wait = self.period_s
                continue
            if resp is None and lost is None:
                wait = self.RETRY_S
                continue
            if lost is None:
                assert resp is not None
                try:
                    msg = str(resp.json()["error"]["message"])
                except Exception:  # noqa: BLE001 - any body: the refusal is what counts
                    msg = f"HTTP {resp.status_code}"
                lost = f"the server refused to renew the lease: {msg}"
            # outside the busy lock: a callback may stop this renewer
            self.plane._lapse(self.lease, lost)
            return
