"""``/maintenance/...``: the guarded maintenance plane over HTTP (only when an admin key is configured).

Every route needs the admin key (``Authorization: Bearer``); the API key never opens one (the
face refuses an admin key equal to an API key at start-up). Actions on the device take the lease
id that ``POST /maintenance/exclusive`` returned; reset and clear-memory also take the device's
name (``"device"``), the HTTP form of the console's typed confirmation.

Audit: the plane audits every call it receives, granted or refused, and each record carries
``origin`` {remote address, key label, via http} (never the key). Refusals decided here, before
the plane is called (wrong admin key, missing / unknown / expired lease, wrong device name), are
audited by the face as ``granted: false`` events, written in a worker thread; refusals of callers
without a valid admin key are summarised per address and interval (``refusals``). Granted lease
renewals are not audited (one every few seconds would bury the log); refused ones are.

Status of a refusal: 400 ``invalid_request_error`` for a bad argument (a body that does not parse, a
field of the wrong type, ``MaintenanceArgumentError`` from the plane: an unknown fault kind, a count
or chip out of range, no such register); 403 ``permission_error`` when the device's state or the
lease does not allow the action now (no exclusive mode, a lease that is not the current one,
another holder, a lease taken with another admin key, a read-only register); 401 for a wrong admin key.

Routes (POST with a JSON body unless GET):
    GET  /maintenance/status                      mode, holder, lease expiry, faults, memory state
    GET  /maintenance/audit?limit=N               the last N audit entries (default 100), read from the end of
                                                  the log; ``more``: older entries exist
    POST /maintenance/exclusive  {holder, drain_timeout_s?}  -> {lease_id, ttl_s, expires_in_s, drain}
    POST /maintenance/lease/renew {lease_id}
    POST /maintenance/leave      {lease_id, force?}
    POST /maintenance/reset      {lease_id, device}
    POST /maintenance/clear-memory {lease_id, device}
    POST /maintenance/reload | clear-kv | self-test | health-check | dump | registers  {lease_id}
    POST /maintenance/registers/read  {lease_id, key}
    POST /maintenance/registers/write {lease_id, key, value}
    POST /maintenance/faults/inject   {lease_id, kind, chip?, factor?, count?}
    POST /maintenance/faults/clear    {lease_id}
    POST /maintenance/faults/acknowledge {holder}
    POST /maintenance/probe      {lease_id, prompt?, max_tokens?}
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from sim_backend.planes import CalError, Lease, MaintenanceArgumentError, MaintenanceRefused, audit_origin

from . import wire
from .context import ServingFace, device_of, remote_of
from .leases import HeldLease
from .wire import HTTPError

log = logging.getLogger("calconsole.serve")
MAX_AUDIT_ENTRIES = 10_000


def _json(obj: Any, status: int = 200) -> Response:
    return Response(json.dumps(obj, default=str), status_code=status, media_type="application/json")


def maintenance_routes(face: ServingFace) -> list[tuple[str, Callable[[Request], Awaitable[Response]], list[str]]]:
    """(path, handler, methods) of every maintenance route, bound to ``face``."""
    m = face.maintenance
    assert m is not None and face.leases is not None
    leases = face.leases

    def origin(request: Request) -> dict[str, Any]:
        return {"remote": remote_of(request), "key": getattr(request.state, "key_label", "?"), "via": "http"}

    def by_key(request: Request, holder: str) -> str:
        """Who holds or acknowledges, as the server knows it: the admin key's label first (the name the caller
        gives is its own claim: every remote console said root@console), then that claim."""
        label = getattr(request.state, "key_label", None)
        return holder.strip() if label in (None, "?", "open") else f"{label} ({holder.strip()})"

    async def plane(request: Request, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        o = origin(request)

        def run() -> Any:
            with audit_origin(o):
                return fn(*args, **kw)

        try:
            return await face.call(run)
        except MaintenanceArgumentError as e:  # the caller's argument: llama-server's 400
            err = HTTPError(400, "invalid_request_error", str(e))
        except MaintenanceRefused as e:  # the device's state or the lease: not allowed now
            err = HTTPError(403, "permission_error", str(e))
        except CalError as e:
            err = wire.from_cal_error(e)
        err.audited = True  # the plane audits every call it receives
        raise err

    def refuse(request: Request, action: str, reason: str, status: int = 403,
               type_: str = "permission_error") -> HTTPError:
        err = HTTPError(status, type_, reason)
        err.audit_action = action  # written by the face's route wrapper, in a worker thread
        return err

    def audited(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        """``handler``, auditing any refusal not yet audited (a malformed body, a field of the wrong type)."""
        async def h(request: Request) -> Response:
            try:
                return await handler(request)
            except HTTPError as e:
                if not e.audited and e.audit_action is None:
                    e.audit_action = request.url.path
                raise

        return h

    async def body_of(request: Request) -> dict[str, Any]:
        return await face.read_json(request)

    def held_lease(request: Request, body: dict[str, Any], action: str) -> HeldLease:
        lid = body.get("lease_id")
        if lid is None:
            raise refuse(request, action, "lease_id is required: enter exclusive mode first")
        h = leases.find(lid)
        if h is None:
            raise refuse(request, action, "lease is not the current one (expired, released or unknown)")
        holder_key(request, h, action)
        return h

    def holder_key(request: Request, h: HeldLease, action: str) -> None:
        """403 unless the caller's admin key is the one that took the lease: a lease id alone is not enough."""
        mine = getattr(request.state, "key_label", "?")
        if mine != h.key_label:
            raise refuse(request, action, f"the lease of {h.lease.holder} was taken with admin key '{h.key_label}'; "
                                          f"only that key may use, renew or leave it")

    async def confirm_device(request: Request, body: dict[str, Any], action: str) -> None:
        snap = await face.call(face.observation.snapshot)
        name = device_of(snap).name
        if body.get("device") != name:
            raise refuse(request, action, f"confirmation failed: 'device' must be the device name '{name}'",
                         status=400, type_="invalid_request_error")

    # --- routes ---------------------------------------------------------------------------

    async def status(request: Request) -> Response:
        st = dict(await face.call(m.status))
        st["drain_timeout_s"] = getattr(m, "drain_timeout_s", None)  # the default drain of enter_exclusive
        h = leases.held
        st["http_lease"] = ({"holder": h.lease.holder, "ttl_s": h.ttl_s, "expires_in_s": round(h.remaining_s(), 3),
                             "key": h.key_label, "remote": h.remote} if h else None)
        return _json(st)

    async def audit(request: Request) -> Response:
        raw = request.query_params.get("limit", "100")
        if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= MAX_AUDIT_ENTRIES:  # '²'.isdigit()
            raise wire.bad_request(f"'limit' must be an integer in [1, {MAX_AUDIT_ENTRIES}], got {raw!r}")
        # read from the end: the cost is that of the entries asked for, not of the log (audit.AuditLog.tail)
        tail = getattr(m.audit, "tail", None)
        if tail is not None:
            entries, more = await face.call(tail, int(raw))
        else:
            every = await face.call(m.audit.entries)
            entries, more = every[-int(raw):], len(every) > int(raw)
        return _json({"path": str(m.audit.path), "entries": entries, "more": more})

    async def enter(request: Request) -> Response:
        body = await body_of(request)
        holder = body.get("holder")
        if not isinstance(holder, str) or not holder.strip():
            raise refuse(request, "enter_exclusive", "'holder' (who takes the device) is required",
                         status=400, type_="invalid_request_error")
        drain = body.get("drain_timeout_s")
        if drain is not None and (isinstance(drain, bool) or not isinstance(drain, (int, float))):
            raise wire.bad_request("'drain_timeout_s' must be a number of seconds")
        lease: Lease = await plane(request, m.enter_exclusive, by_key(request, holder), drain)
        h = leases.grant(lease, getattr(request.state, "key_label", "?"), remote_of(request))
        return _json({**h.to_dict(), "drain": getattr(m, "last_drain", None)})

    async def renew(request: Request) -> Response:
        body = await body_of(request)
        current = leases.find(body.get("lease_id"))
        if current is not None:
            holder_key(request, current, "renew_lease")
        h = leases.renew(body.get("lease_id"))
        if h is None:
            raise refuse(request, "renew_lease", "lease is not the current one (expired, released or unknown)")
        return _json(h.to_dict())

    async def leave(request: Request) -> Response:
        body = await body_of(request)
        h = held_lease(request, body, "leave_exclusive")
        force = wire.flag(body, "force", False)
        rep = await plane(request, m.leave_exclusive, h.lease, force=force)
        leases.release(h.lease.id)
        return _json(rep)

    def simple(action: str, fn: Callable[[Lease], Any], *, confirm: bool = False) -> Callable[..., Any]:
        async def handler(request: Request) -> Response:
            body = await body_of(request)
            h = held_lease(request, body, action)
            if confirm:
                await confirm_device(request, body, action)
            return _json(await plane(request, fn, h.lease))

        return handler

    async def read_register(request: Request) -> Response:
        body = await body_of(request)
        h = held_lease(request, body, "read_register")
        return _json(await plane(request, m.read_register, h.lease, body.get("key")))

    async def write_register(request: Request) -> Response:
        body = await body_of(request)
        h = held_lease(request, body, "write_register")
        return _json(await plane(request, m.write_register, h.lease, body.get("key"), body.get("value")))

    async def inject(request: Request) -> Response:
        body = await body_of(request)
        h = held_lease(request, body, "inject_fault")
        kind = body.get("kind")
        if not isinstance(kind, str):
            raise wire.bad_request("'kind' must be one of ccu_exception, kv_exhaustion, link_error, slow_chip")
        kw: dict[str, Any] = {}
        for name in ("chip", "factor", "count"):
            if name in body:
                kw[name] = body[name]
        return _json(await plane(request, m.inject_fault, h.lease, kind, **kw))

    async def acknowledge(request: Request) -> Response:
        body = await body_of(request)
        holder = body.get("holder")
        if not isinstance(holder, str) or not holder.strip():
            raise wire.bad_request("'holder' (who acknowledges) is required")
        return _json(await plane(request, m.acknowledge_faults, by_key(request, holder)))

    async def probe(request: Request) -> Response:
        body = await body_of(request)
        h = held_lease(request, body, "probe_request")
        prompt = body.get("prompt", "hi")
        n = body.get("max_tokens", 8)
        if not isinstance(prompt, str) or isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 256:
            raise wire.bad_request("'prompt' must be a string and 'max_tokens' an integer in [1, 256]")
        return _json(await plane(request, m.probe_request, h.lease, prompt, n))

    return [(path, audited(handler), methods) for path, handler, methods in [
        ("/maintenance/status", status, ["GET"]),
        ("/maintenance/audit", audit, ["GET"]),
        ("/maintenance/exclusive", enter, ["POST"]),
        ("/maintenance/lease/renew", renew, ["POST"]),
        ("/maintenance/leave", leave, ["POST"]),
        ("/maintenance/reset", simple("reset", m.reset, confirm=True), ["POST"]),
        ("/maintenance/clear-memory", simple("clear_device_memory", m.clear_device_memory, confirm=True), ["POST"]),
        ("/maintenance/reload", simple("reload_model", m.reload_model), ["POST"]),
        ("/maintenance/clear-kv", simple("clear_kv", m.clear_kv), ["POST"]),
        ("/maintenance/self-test", simple("self_test", m.self_test), ["POST"]),
        ("/maintenance/health-check", simple("health_check", m.health_check), ["POST"]),
        ("/maintenance/dump", simple("dump", lambda lease: m.dump(lease)), ["POST"]),
        ("/maintenance/registers", simple("dump_registers", m.dump_registers), ["POST"]),
        ("/maintenance/registers/read", read_register, ["POST"]),
        ("/maintenance/registers/write", write_register, ["POST"]),
        ("/maintenance/faults/inject", inject, ["POST"]),
        ("/maintenance/faults/clear", simple("clear_faults", m.clear_faults), ["POST"]),
        ("/maintenance/faults/acknowledge", acknowledge, ["POST"]),
        ("/maintenance/probe", probe, ["POST"]),
    ]]


def reap_expired(face: ServingFace) -> HeldLease | None:
    """Leave exclusive mode for a lease whose holder stopped renewing it (blocking; call in a thread).

    Audited twice: a ``lease_expired`` event, then the plane's own forced ``leave_exclusive``.
    """
    m = face.maintenance
    if m is None or face.leases is None:
        return None
    h = face.leases.take_expired()
    if h is None:
        return None
    o = {"remote": h.remote, "key": h.key_label, "via": "http", "reason": "lease expired"}
    with audit_origin(o):
        if face.audit is not None:
            face.audit.event("lease_expired", {"holder": h.lease.holder, "ttl_s": h.ttl_s}, granted=True, ok=True,
                             result="holder stopped renewing; leaving exclusive mode", duration_ms=0.0)
        try:
            m.leave_exclusive(h.lease, force=True)
        except CalError as e:  # already left (e.g. by the console in the same process)
            log.info("expired lease of %s: leave refused: %s", h.lease.holder, e)
    log.warning("maintenance lease of %s expired after %.0f s without renewal; device back to serving",
                h.lease.holder, h.ttl_s)
    return h


async def reaper(face: ServingFace, period_s: float = 0.5) -> None:
    """Background task: reap expired leases every ``period_s`` host seconds until cancelled."""
    import anyio

    while True:
        await anyio.sleep(period_s)
        if face.leases is not None and face.leases.held is not None:
            await face.call(reap_expired, face)
        if face.audit is not None and face.refusals.pending():  # summaries of refusal windows that ended
            await face.call(face.refusals.flush, face.audit)
