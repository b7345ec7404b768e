"""Controlled maintenance plane (facts.md F5 C4, F9): exclusive lease and guarded device actions.

Reset, ClearAllDevMem, registers and fault injection never reach the
inference plane; here they take a lease and refuse without one
(``MaintenanceRefused`` saying why). Every call, granted or refused, is
appended to the audit log (a ``started`` record before it runs, a
``finished`` record, flushed and fsync'd, before it returns).

Exclusive mode (``enter_exclusive``):
  1. mode -> ``draining``; new requests are refused at once with
     ``UnavailableError`` ("device in maintenance", llama.cpp ``unavailable_error``);
  2. in-flight requests get ``drain_timeout_s`` host wall seconds to finish;
     the rest are cancelled with the reason "device entering maintenance: not
     finished within the N s drain" (cancels land within one device step);
  3. mode -> ``exclusive`` and a ``Lease`` is returned. One lease at a time.
  ``leave_exclusive`` releases it and re-admits requests.

Actions (each needs the current lease): ``reset``, ``clear_device_memory``,
``reload_model``, ``clear_kv``, ``dump`` (config metadata + Chrome trace
JSON), ``self_test`` (golden input vs golden output), ``health_check``,
``read_register`` / ``write_register`` / ``dump_registers``,
``inject_fault`` / ``clear_faults`` and ``probe_request``. ``acknowledge_faults``
needs no lease (it changes nothing on the device) and is audited like the rest:
a fault that fired shows as the device status ``fault`` until acknowledged or reset.

Probe requests: while exclusive, the engine refuses every request, so a
rehearsal cannot see an injected fault through the chat path. ``probe_request``
is the window's own test request: it tokenises a prompt with the chat
template and runs it through the same device path as the engine (KV apply ->
prefill job -> Wait -> greedy decode jobs) on the runtime's scratch sequence (the last KV sequence, never a slot),
outside the engine's queue, so no client can slip in during the window. A
fault hits it exactly as it would hit a served request, and it reports the
typed error. Faults left armed when leaving exclusive mode stay armed, so a
rehearsal can also watch them hit live traffic; a reset disarms them.

Units: ``*_wall_ms`` / ``duration_ms`` are host wall milliseconds;
``sim_ms`` / ``sim_us`` are simulated device time on the board clock.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np

from sim_backend.errors import (
    CalError,
    DeviceError,
    KVExhausted,
    MaintenanceArgumentError,
    MaintenanceRefused,
    WaitTimeout,
)
from sim_backend.model.logits import to_f32
from sim_backend.model.vocab import EOS_IDS, IM_START
from sim_backend.planes.audit import AuditLog, AuditLogError
from sim_backend.planes.contracts import Lease, Report
from sim_backend.planes.types import ChatRequest
from sim_backend.runtime.maintenance import MaintenanceRuntime
from sim_backend.serving.engine import Engine

_T = TypeVar("_T")

MAINTENANCE_REASON = "device in maintenance"
FAULT_KINDS = ("ccu_exception", "kv_exhaustion", "link_error", "slow_chip")
#: other names accepted for a kind: "d2d_link_error", the name snapshots of earlier versions showed for an
#: armed / fired link error (``faults_armed`` "d2d_link_error x1"); the snapshot now says "link_error"
FAULT_ALIASES = {"d2d_link_error": "link_error"}


class InProcessMaintenance:
    """Exclusive mode and guarded device actions.

    Args:
        open_runtime: builds the maintenance runtime (the only door to the device) around the lease
            check it is given, this plane's, so a stale lease is refused by the runtime too:
            ``lambda check: MaintenanceRuntime(board, check, memory_plan=plan)``.
        engine: the serving engine.
        audit: the audit log every call is appended to.
        drain_timeout_s: default bounded drain (host wall s) before in-flight
            requests are cancelled with a reason.
        reset_timeout_s: bound on a reset and on each health-check / probe job wait (host wall s). The golden
            self-test's job waits the engine's bound on one device step instead (``self_test_wait_s``).
        memory_plan: ``memory.MemoryPlan`` for dumps (optional).
        dump_dir: default directory of ``dump`` files (default: next to the audit log).
    """

    def __init__(self, open_runtime: Callable[[Callable[[str, Any], None]], MaintenanceRuntime], engine: Engine,
                 audit: AuditLog, *,
                 drain_timeout_s: float = 5.0, reset_timeout_s: float = 10.0, memory_plan: Any = None,
                 dump_dir: str | Path | None = None) -> None:
        self._rt = open_runtime(self._check)
        self._mon = self._rt.monitor
        self._engine = engine
        self.audit = audit
        self.drain_timeout_s = drain_timeout_s
        self.reset_timeout_s = reset_timeout_s
        self.memory_plan = memory_plan
        self.dump_dir = Path(dump_dir) if dump_dir is not None else self.audit.path.parent / "dumps"
        self._lock = threading.RLock()
        self._op_lock = threading.Lock()  # one guarded action at a time
        self._op_name = ""
        self._lease: Lease | None = None
        self._mode = "serving"
        self._pending_holder: str | None = None
        self._since = time.time()
        self.last_drain: dict[str, Any] | None = None
        self._health_failed: str | None = None

    # --- state ---------------------------------------------------------------

    def mode(self) -> Report:
        """{"mode": serving | draining | exclusive, "lease_holder": str | None, "since_unix_s",
        "health_failed": what the last health check found wrong, or None (it passed, or none ran)}.

        While draining, ``lease_holder`` is the caller waiting for the lease.
        """
        with self._lock:
            holder = self._lease.holder if self._lease else (self._pending_holder if self._mode == "draining" else None)
            return {"mode": self._mode, "lease_holder": holder, "since_unix_s": self._since,
                    "health_failed": self._health_failed}

    @property
    def lease(self) -> Lease | None:
        return self._lease

    def _check(self, action: str, lease: Lease | None) -> None:
        if lease is None:
            raise MaintenanceRefused(action, "exclusive mode required: enter exclusive mode first")
        if not isinstance(lease, Lease) or self._lease is None or lease.id != self._lease.id:
            raise MaintenanceRefused(action, "lease is not the current one (expired or released)")

    def _run(self, action: str, args: dict[str, Any], lease: Lease | None, fn: Callable[[], _T], *,
             needs_lease: bool = True, describe: Callable[[Any], Any] | None = None) -> _T:
        """Audit start, check the lease, run, audit the outcome (durably) and return/raise.

        Refusals (MaintenanceRefused) are audited ``granted: false``; typed device
        errors ``granted: true, ok: false``; any other exception is audited as an
        internal error and re-raised. Only a process crash leaves a ``started``
        record without its ``finished`` one.
        """
        t0 = time.perf_counter()
        sim0 = self._mon.now_us
        args = {k: _brief(v) for k, v in args.items()}  # the log keeps arguments bounded and JSON
        aid = self.audit.start(action, args)

        def done(**kw: Any) -> None:
            if isinstance(kw.get("result"), str) and len(kw["result"]) > 4 * MAX_AUDIT_ARG_CHARS:
                kw["result"] = kw["result"][:4 * MAX_AUDIT_ARG_CHARS] + f"... ({len(kw['result'])} characters)"
            self.audit.finish(aid, action, args, duration_ms=(time.perf_counter() - t0) * 1e3,
                              sim_ms=(self._mon.now_us - sim0) / 1e3, **kw)

        locked = False
        try:
            if needs_lease:
                with self._lock:
                    self._check(action, lease)
                if not self._op_lock.acquire(timeout=0.0):
                    raise MaintenanceRefused(action, f"another maintenance action ({self._op_name}) is running")
                locked = True
                self._op_name = action
            result = fn()
        except MaintenanceRefused as e:
            done(granted=False, ok=False, result=str(e))
            raise
        except CalError as e:
            done(granted=True, ok=False, result=f"{type(e).__name__}: {e}")
            raise
        except Exception as e:
            done(granted=True, ok=False, result=f"internal error: {type(e).__name__}: {e}", error=True)
            raise
        finally:
            if locked:
                self._op_name = ""
                self._op_lock.release()
        ok = not (isinstance(result, dict) and result.get("ok") is False)
        try:
            done(granted=True, ok=ok, result=describe(result) if describe else result)
        except Exception as e:
            # an outcome that cannot be audited: undo what can be undone (a lease nobody received
            # would strand the device in exclusive mode), then say so with a typed error
            if action == "enter_exclusive" and isinstance(result, Lease):
                with self._lock:
                    self._lease = None
                    self._mode, self._since = "serving", time.time()
                self._engine.gate.resume()
            raise AuditLogError(self.audit.path, f"{action} done but its outcome could not be audited: "
                                                 f"{type(e).__name__}: {e}") from None
        return result

    # --- exclusive mode --------------------------------------------------------

    def enter_exclusive(self, holder: str, drain_timeout_s: float | None = None) -> Lease:
        """Stop admission, drain in-flight requests for up to ``drain_timeout_s`` host wall seconds
        (then cancel the rest with a reason), and return the lease.

        Refused if a lease is held or another caller is draining. The drain report is in
        ``last_drain``: {"drained", "cancelled", "wall_ms", "sim_ms"}.
        """
        timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        args = {"holder": holder, "drain_timeout_s": timeout}

        def go() -> Lease:
            if not isinstance(timeout, (int, float)) or not 0 <= timeout <= 600:
                raise MaintenanceArgumentError(
                    "enter_exclusive", f"drain_timeout_s must be in [0, 600] s, got {timeout!r}")
            _check_holder(holder, "enter_exclusive")
            with self._lock:
                if self._lease is not None or self._mode != "serving":
                    who = self._lease.holder if self._lease else self._pending_holder
                    raise MaintenanceRefused("enter_exclusive", f"device already {self._mode} (lease: {who})")
                self._mode, self._pending_holder, self._since = "draining", holder, time.time()
            try:
                self._engine.gate.pause(MAINTENANCE_REASON)
                report = self._engine.gate.drain(
                    timeout, f"device entering maintenance: not finished within the {timeout:g} s drain")
            except BaseException:
                with self._lock:
                    self._mode, self._pending_holder, self._since = "serving", None, time.time()
                self._engine.gate.resume()
                raise
            with self._lock:
                self._lease = Lease(uuid.uuid4().hex, holder, time.time())
                self._mode, self._pending_holder, self._since = "exclusive", None, time.time()
                self.last_drain = report
                return self._lease

        return self._run("enter_exclusive", args, None, go, needs_lease=False,
                         describe=lambda lease: {**lease.to_dict(), "drain": self.last_drain})

    def leave_exclusive(self, lease: Lease | None, *, force: bool = False) -> Report:
        """Release the lease and re-admit requests.

        Refused while device memory is cleared (every request would fail with
        DeviceNotReady) unless ``force``: reload the model first.
        """
        def go() -> Report:
            if self._mon.memory_cleared and not force:
                raise MaintenanceRefused("leave_exclusive", "device memory is cleared: reload the model first "
                                         "(or leave with force; requests then fail with DeviceNotReady)")
            with self._lock:
                self._lease = None
                self._mode, self._since = "serving", time.time()
            self._engine.gate.resume()
            return {"ok": True, "admitting": True, "faults_armed": self._mon.faults()["active"]}

        return self._run("leave_exclusive", {"force": force}, lease, go)

    # --- device actions --------------------------------------------------------------

    def reset(self, lease: Lease | None) -> Report:
        """Reset the device, then run a health check. Bounded: stopping the device takes at most
        ``reset_timeout_s`` and the health check's job wait at most another ``reset_timeout_s``
        (host wall s); a simulated reset itself takes ~2-5 wall ms and no simulated time.

        Every pending/running job's ``wait()`` raises DeviceReset at once; chiplets return to
        power-on state (registers, KV arrays zeroed, faults disarmed); KV metadata cleared; the
        reset counter moves; the calbin is reconfigured. Returns {"ok" (= health ok),
        "failed_jobs", "calbin", "resets", "reset_wall_ms", "health"}; a health failure is
        ``"ok": False``. Raises DeviceError if the device does not come back in time.
        """
        def go() -> Report:
            rep = self._rt.reset(lease, self.reset_timeout_s)
            health = self._health()
            return {"ok": health["ok"], "failed_jobs": rep["failed_jobs"], "calbin": rep["calbin"],
                    "resets": rep["resets"], "reset_wall_ms": rep["wall_ms"], "health": health}

        return self._run("reset", {"timeout_s": self.reset_timeout_s}, lease, go)

    def clear_device_memory(self, lease: Lease | None) -> Report:
        """ClearAllDevMem: zero weights and KV on both chips. Inference is refused (DeviceNotReady)
        until ``reload_model``, which the result offers ("next": "reload_model")."""
        def go() -> Report:
            self._rt.clear_memory(lease)
            return {"ok": True, "memory_cleared": True, "inference": "refused until the model is reloaded",
                    "next": "reload_model"}

        return self._run("clear_device_memory", {}, lease, go)

    def reload_model(self, lease: Lease | None) -> Report:
        """Reload weights, reconfigure the calbin, then health-check. {"ok", "load_wall_ms", "health"}."""
        def go() -> Report:
            wall = self._rt.load_model(lease)
            health = self._health()
            return {"ok": health["ok"], "load_wall_ms": wall * 1e3, "health": health}

        return self._run("reload_model", {}, lease, go)

    def clear_kv(self, lease: Lease | None) -> Report:
        """Clear the whole KV cache (every sequence). {"ok", "freed_tokens"}."""
        def go() -> Report:
            used = self._mon.kv_occupancy().used_cells
            self._rt.clear_kv(lease)
            return {"ok": True, "freed_tokens": used}

        return self._run("clear_kv", {}, lease, go)

    def dump(self, lease: Lease | None, path: str | Path | None = None) -> Report:
        """Write trace and config metadata to one JSON file (default ``dump_dir``/<device>-<time>.json).

        Contents: ``metadata`` (bundle manifest info, sub-models, findings, registers), ``registers``
        (name -> {address, value, writable}), ``memory_plan`` (per chip, bytes), ``recent_steps``
        (the last prefill/decode StepCosts, simulated µs) and ``stage_history`` (last 64 steps'
        stage times: device stages simulated ms, host stages measured ms), plus ``traceEvents``
        so the file opens directly in Perfetto / chrome://tracing. {"ok", "path", "bytes", "steps"}.
        """
        default = path is None
        if path is None:
            stamp = time.strftime("%Y%m%dT%H%M%S")
            path = self.dump_dir / f"{self._mon.bundle.device_name}-dump-{stamp}-{uuid.uuid4().hex[:4]}.json"

        def go() -> Report:
            from sim_backend.model.trace import chrome_trace

            p = self._dump_target(path, default)

            mon = self._mon
            steps = sorted(mon.last_steps().values(), key=lambda r: r.job_id)
            trace = chrome_trace([(f"{r.kind} job {r.job_id}", r.cost, r.sim_start_us) for r in steps])
            regs = self._rt.dump_registers(lease)
            doc = {
                "format": "calconsole-dump/1",
                "taken": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "sim_now_ms": mon.now_us / 1e3,
                "metadata": self._rt.config_metadata(lease),
                "registers": {r.name: {"address": f"0x{r.address:04X}", "value": regs[r.name],
                                       "hex": f"0x{regs[r.name]:08X}", "writable": r.writable}
                              for r in mon.register_map()},
                "memory_plan": self.memory_plan.to_dict() if self.memory_plan is not None else None,
                "job_counters": mon.counters().__dict__,
                "faults_armed": mon.faults()["active"],
                "recent_steps": [{"kind": r.kind, "job_id": r.job_id, "seq_id": r.seq_id, "n_tokens": r.n_tokens,
                                  "past_len": r.past_len, "sim_us": r.sim_us, "sim_start_us": r.sim_start_us,
                                  "h2d_us": r.cost.h2d_us, "infer_us": r.cost.infer_us, "d2h_us": r.cost.d2h_us,
                                  "layer_chip_us": np.asarray(r.cost.layer_chip_us).tolist(),
                                  "compute_wall_ms": r.compute_wall_ms} for r in steps],
                "stage_history": [msgspec.structs.asdict(s) for s in list(self._engine.stage_history)[-64:]],
                "units": "sim_us / *_us: simulated device µs; *_wall_ms: host wall ms",
                **trace,
            }
            text = json.dumps(doc, default=str)
            try:
                # "x": never overwrite (an existing file, or the audit log itself); a FIFO or device
                # path was refused above, so this cannot block
                with open(p, "x", encoding="utf-8") as f:
                    f.write(text)
            except OSError as e:
                raise MaintenanceRefused("dump", f"cannot write {p}: {e.strerror or e}") from None
            return {"ok": True, "path": str(p), "bytes": len(text.encode()), "steps": len(steps)}

        return self._run("dump", {"path": str(path)}, lease, go)

    def _dump_target(self, path: Any, default: bool) -> Path:
        """The dump file to create: a new regular file, never the audit log, in an existing directory
        (only the default dump directory is created). MaintenanceRefused says why not."""
        if not isinstance(path, (str, Path)) or str(path).strip() == "" or "\0" in str(path):
            raise MaintenanceArgumentError("dump", f"path must be a file name, got {path!r}")
        p = Path(path).expanduser()
        if default:
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise MaintenanceRefused("dump", f"cannot create {p.parent}: {e.strerror or e}") from None
        try:
            parent = p.parent.resolve(strict=True)
        except (OSError, RuntimeError):
            raise MaintenanceRefused("dump", f"directory {p.parent} does not exist") from None
        if not parent.is_dir():
            raise MaintenanceRefused("dump", f"{p.parent} is not a directory")
        target = parent / p.name
        try:
            audit = self.audit.path.resolve()
        except (OSError, RuntimeError):
            audit = self.audit.path
        if target == audit or (target.exists() and audit.exists() and os.path.samefile(target, audit)):
            raise MaintenanceRefused("dump", "refusing to write over the audit log")
        if target.exists() or target.is_symlink():
            raise MaintenanceRefused("dump", f"{target} exists: dumps never overwrite a file")
        return target

    @property
    def self_test_wait_s(self) -> float:
        """Host wall seconds the golden self-test waits for its prefill job to reach a final state: the
        engine's bound on one device step (``Engine.step_timeout_s``, 120 s by default: the wait any
        serving step of the same work gets; a loaded host slows both alike), never less than
        ``reset_timeout_s``."""
        return max(float(self.reset_timeout_s), float(getattr(self._engine, "step_timeout_s", 0.0)))

    def self_test(self, lease: Lease | None) -> Report:
        """Golden self-test: the bundle's golden input as one prefill on the scratch sequence,
        the device's D2H logits (BF16, or F32 where the calbin declares them) vs the golden output;
        pass per ``golden.compare`` (the bundle's ``golden.max_abs_error``). {"ok", "max_abs_error",
        "tolerance", "top1_match", "dtype", "sim_ms", "wall_ms", "detail"}. The job is waited for until it
        ends, at most ``self_test_wait_s``; past that the report fails with ``error`` {"type": "WaitTimeout",
        "message"} and a detail naming the bound. A missing golden file or a device error is a failure.
        Where it cannot run (a timing-only device computes no logits; cleared memory holds no weights) it is
        not a failure: {"ok": None, "ran": False, "detail": "not run: <why>"}, audited as ``not run``."""
        return self._run("self_test", {}, lease, self._self_test)

    def health_check(self, lease: Lease | None) -> Report:
        """Status registers, job accounting, buffer pool, one decode probe job (bounded).
        {"ok", "checks", "detail", "sim_us", "wall_ms"}."""
        return self._run("health_check", {}, lease, self._health)

    def read_register(self, lease: Lease | None, key: str | int) -> Report:
        """Read any mapped register by name or address ("0x1000" or int). Unknown -> MaintenanceRefused."""
        def go() -> Report:
            k = _reg_key(key, "read_register")
            d = self._resolve(k, "read_register")
            v = self._rt.read_register(lease, d.name)
            return {"ok": True, "name": d.name, "address": f"0x{d.address:04X}", "value": v, "hex": f"0x{v:08X}",
                    "writable": d.writable, "description": d.description}

        return self._run("read_register", {"key": key}, lease, go)

    def write_register(self, lease: Lease | None, key: str | int, value: int | str) -> Report:
        """Write a register the map marks writable. Read-only, unknown or out-of-range -> MaintenanceRefused."""
        def go() -> Report:
            d = self._resolve(_reg_key(key, "write_register"), "write_register")
            if not d.writable:
                raise MaintenanceRefused("write_register", f"register {d.name} is read-only")
            v = _reg_value(value)
            old = self._rt.read_register(lease, d.name)
            self._rt.write_register(lease, d.name, v)
            return {"ok": True, "name": d.name, "old": old, "new": v, "hex": f"0x{v:08X}"}

        return self._run("write_register", {"key": key, "value": value}, lease, go)

    def dump_registers(self, lease: Lease | None) -> Report:
        """All registers: {"ok", "registers": {name: value}}."""
        return self._run("dump_registers", {}, lease, lambda: {"ok": True, "registers": self._rt.dump_registers(lease)})

    def inject_fault(self, lease: Lease | None, kind: str, *, chip: int = 1, factor: float = 4.0,
                     count: int = 1) -> Report:
        """Arm a fault (visible at once in the snapshot's ``device.faults``).

        kind: ``ccu_exception`` (the next ``count`` jobs raise CCUException),
        ``kv_exhaustion`` (the next ``count`` KV applies raise KVExhausted),
        ``link_error`` (also ``d2d_link_error``, its earlier name in the snapshot: the next ``count`` jobs
        raise LinkError, D2D_LINK_ERR counts them; the job stops at its first chiplet transfer,
        the embedding broadcast, and costs the device time up to it: H2D, submit, chip0's
        embedding and the failed transfer, ~0.3 ms simulated, see ``SimulatedBoard._book_link_error``),
        ``slow_chip`` (chip ``chip`` runs ``factor`` x slower until cleared or reset: its own ops
        in its own per-layer column; steps sync every layer, so the other chip waits and the whole
        step slows). {"ok", "armed"}.
        """
        kind = FAULT_ALIASES.get(kind, kind) if isinstance(kind, str) else kind
        args = {"kind": kind, "count": count} | ({"chip": chip, "factor": factor} if kind == "slow_chip" else {})

        def go() -> Report:
            if kind not in FAULT_KINDS:
                raise MaintenanceArgumentError(
                    "inject_fault", f"unknown fault {kind!r}; one of {', '.join(FAULT_KINDS)}")
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 1000:
                raise MaintenanceArgumentError("inject_fault", f"count must be 1..1000, got {count!r}")
            if kind == "slow_chip":
                if isinstance(chip, bool) or isinstance(factor, bool):
                    raise MaintenanceArgumentError("inject_fault", "chip and factor must be numbers, not true/false")
                n_chips = self._mon.shape.n_chips
                if chip not in range(n_chips):
                    raise MaintenanceArgumentError("inject_fault", f"no chip {chip!r} (device has {n_chips})")
                if not (isinstance(factor, (int, float)) and 1.0 <= factor <= 1000.0):
                    raise MaintenanceArgumentError("inject_fault", f"slow factor must be in [1, 1000], got {factor!r}")
            armed = self._rt.arm_fault(lease, kind, chip=chip, factor=float(factor), count=count)
            return {"ok": True, "armed": armed}

        return self._run("inject_fault", args, lease, go)

    def clear_faults(self, lease: Lease | None) -> Report:
        """Disarm every injected fault. {"ok", "disarmed"}."""
        def go() -> Report:
            return {"ok": True, "disarmed": self._rt.disarm_faults(lease)}

        return self._run("clear_faults", {}, lease, go)

    def acknowledge_faults(self, holder: str) -> Report:
        """Acknowledge every fault that fired: the snapshot's ``device.faults_fired`` empties and the
        status no longer reads ``fault`` (armed faults stay armed). Needs no lease: it changes nothing
        on the device, it records that ``holder`` saw the faults (audited with their list).
        {"ok", "acknowledged": [{"fault", "detail"}]}. Refused for an empty ``holder``.
        """
        def go() -> Report:
            _check_holder(holder, "acknowledge_faults")
            return {"ok": True, "acknowledged": self._rt.acknowledge_faults()}

        return self._run("acknowledge_faults", {"holder": holder}, None, go, needs_lease=False)

    def probe_request(self, lease: Lease | None, prompt: str = "hi", max_tokens: int = 8) -> Report:
        """A test request through the device while exclusive (see module docstring).

        Greedy decoding; ends at EOS or ``max_tokens``. {"ok", "status": finished | failed,
        "text", "n_tokens", "prompt_n", "error" (typed: {"type", "message"}), "sim_ms", "wall_ms"}.
        """
        def go() -> Report:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 1 <= max_tokens <= 256:
                raise MaintenanceArgumentError("probe_request", f"max_tokens must be 1..256, got {max_tokens!r}")
            if not isinstance(prompt, str) or not 0 < len(prompt) <= MAX_PROBE_PROMPT_CHARS:
                raise MaintenanceArgumentError("probe_request", f"prompt must be text of 1..{MAX_PROBE_PROMPT_CHARS} "
                                                          "characters")
            return self._probe(prompt, max_tokens)

        return self._run("probe_request", {"prompt": prompt, "max_tokens": max_tokens}, lease, go)

    def status(self) -> Report:
        """Mode, armed faults, memory state (read-only; not audited)."""
        f = self._mon.faults()
        return {**self.mode(), "faults": f["active"], "faults_fired": f["fired"],
                "memory_cleared": self._mon.memory_cleared,
                "audit_log": str(self.audit.path)}

    # --- internals ------------------------------------------------------------------

    def _resolve(self, key: str | int, action: str) -> Any:
        try:
            return self._mon.resolve_register(key)
        except KeyError as e:
            # the message itself, not str(KeyError), which quotes it (and strip() would eat its closing quote)
            raise MaintenanceArgumentError(action, str(e.args[0]) if e.args else "no such register") from None

    def _job_timed(self, kind: str, tokens: list[int], p0: int, wait_s: float | None = None) -> tuple[Any, float]:
        """Apply KV on the scratch sequence, submit one job, wait for it to end (at most ``wait_s`` host
        wall s, default ``reset_timeout_s``; then WaitTimeout, and the job's buffers come back when it ends).

        Returns (StepResult, host ms of the KV apply and submit, measured like the engine's framework stage).
        """
        ht = self._engine.host_timer
        h0 = ht.now()
        out = self._rt.scratch_submit(self._lease, kind, self._rt.scratch_seq, tokens, p0)
        host_ms = (ht.now() - h0) / 1e3
        try:
            return out.wait(self.reset_timeout_s if wait_s is None else wait_s), host_ms
        except DeviceError:
            out.discard()  # a job that outlives its wait gives its buffer pair back when it ends
            raise

    def _job(self, kind: str, tokens: list[int], p0: int, source: str, wait_s: float | None = None) -> Any:
        """``_job_timed``, and the step shown in the observation's stage table as ``source``. Returns the StepResult."""
        res, host_ms = self._job_timed(kind, tokens, p0, wait_s)
        self._engine.record_stages(res, source=source, framework_ms=host_ms)
        return res

    def _health(self) -> Report:
        """Health check after reset/reload: status registers, job accounting (counters balance, nothing
        in flight, no job from before the reset left unended), the engine's buffer pool full (bounded
        wait, at most 1 s), then one decode job on the scratch sequence."""
        mon = self._mon
        t0 = time.perf_counter()
        checks: list[dict[str, Any]] = []

        def check(name: str, ok: bool, detail: str = "") -> bool:
            checks.append({"check": name, "ok": bool(ok), "detail": detail})
            return ok

        check("memory loaded", not mon.memory_cleared, "device memory cleared" if mon.memory_cleared else "")
        check("calbin configured", bool(mon.read_register("BOARD_STATUS") & 0x2))
        for ch in mon.chiplets():
            check(f"chip{ch.index} ready", ch.state == "ready", ch.state)
        # after a reset every job must have ended and been counted, and every buffer pair be back:
        # a job lost by the bookkeeping would hang its request and hold its pair forever
        problems = mon.accounting_problems()
        c = mon.counters()
        check("job accounting", not problems, "; ".join(problems) or
              f"submitted {c.submitted} = finished {c.finished} + failed {c.failed} + in flight {c.left}")
        check("no job in flight", c.left == 0, f"pending {c.pending}, running {c.running}")
        free, size = self._engine.buffer_pool_state(timeout=min(1.0, self.reset_timeout_s))
        check("buffer pool full", free == size, f"{free} of {size} buffer pairs free")
        sim_us = 0.0
        if all(c["ok"] for c in checks):
            self._rt.free_seq(self._lease, self._rt.scratch_seq)
            try:
                # a control token the model knows: Qwen3's <|im_start|>, another tokenizer's BOS
                probe_id = IM_START if self._engine.rt.vocab > IM_START else max(0, int(getattr(
                    self._engine.tokenizer, "bos_id", 0)))
                res = self._job("decode", [probe_id], 0, "health check")
                sim_us = res.sim_us
                ok = res.logits is None or bool(np.isfinite(to_f32(res.logits)).all())
                check("decode probe job", ok, f"{res.sim_us / 1e3:.2f} sim ms" + ("" if ok else ", non-finite logits"))
            except (DeviceError, KVExhausted, CalError) as e:
                check("decode probe job", False, f"{type(e).__name__}: {e}")
            finally:
                self._rt.free_seq(self._lease, self._rt.scratch_seq)
        ok = all(c["ok"] for c in checks)
        failed = [f"{c['check']}: {c['detail']}" for c in checks if not c["ok"]]
        with self._lock:  # the device reads as faulty until a health check passes again
            self._health_failed = None if ok else "; ".join(failed)
        return {"ok": ok, "detail": "healthy" if ok else "; ".join(failed), "checks": checks, "sim_us": sim_us,
                "wall_ms": (time.perf_counter() - t0) * 1e3}

    def _self_test(self) -> Report:
        from sim_backend.model.golden import GoldenFileError, compare, load_golden

        b = self._mon
        t0 = time.perf_counter()
        tol = b.bundle.golden_max_abs_error
        base = {"tolerance": tol, "max_abs_error": None}

        def fail(detail: str) -> Report:
            return {"ok": False, **base, "detail": detail, "sim_ms": 0.0, "wall_ms": (time.perf_counter() - t0) * 1e3}

        def not_run(why: str) -> Report:
            return {"ok": None, "ran": False, **base, "detail": f"not run: {why}", "sim_ms": 0.0,
                    "wall_ms": (time.perf_counter() - t0) * 1e3}

        if b.bundle.golden_file is None:
            return fail("no golden file in the bundle (run: python -m sim_backend.model.golden --write)")
        if not b.numerics:
            return not_run("the device runs timing-only, which computes no logits to compare with the golden "
                           "output (serve without --timing-only to self-test)")
        if b.memory_cleared:
            return not_run("device memory is cleared (no weights to infer with); reload the model first")
        try:
            golden = load_golden(b.bundle.golden_file, b.bundle.logits_dtype)
        except (GoldenFileError, OSError, ValueError) as e:
            return fail(f"golden file unreadable: {e}")
        self._rt.free_seq(self._lease, self._rt.scratch_seq)
        wait_s = self.self_test_wait_s
        n = int(golden.input_ids.size)
        try:
            res = self._job("prefill", golden.input_ids.tolist(), 0, "self-test", wait_s=wait_s)
        except WaitTimeout as e:
            rep = fail(f"the golden prefill ({n} tokens) did not end within {wait_s:g} s host wall (the engine's "
                       f"bound on one device step); the device is still computing it, on a host too loaded or a "
                       f"chip too slow: WaitTimeout: {e}")
            rep["error"] = {"type": type(e).__name__, "message": str(e), "wait_s": wait_s}
            return rep
        except CalError as e:
            return fail(f"{type(e).__name__}: {e}")
        finally:
            self._rt.free_seq(self._lease, self._rt.scratch_seq)
        rep = compare(golden, res.logits, tol)
        rep.update(golden=golden.path.name, n_tokens=int(golden.input_ids.size), sim_ms=res.sim_us / 1e3,
                   wall_ms=(time.perf_counter() - t0) * 1e3,
                   detail=_self_test_detail(rep))
        return rep

    def _probe(self, prompt: str, max_tokens: int) -> Report:
        b, e = self._mon, self._engine
        eos = frozenset(getattr(e.tokenizer, "eos_ids", EOS_IDS))
        t0 = time.perf_counter()
        sim0 = b.now_us
        ids = e.tokenize_prompt(ChatRequest.from_prompt(prompt, max_tokens=max_tokens))
        limit = e.numerics_max_prompt
        if b.numerics and len(ids) > limit:
            # exact attention is O(n^2) in Python: a longer probe would outlast every wait
            raise MaintenanceArgumentError("probe_request", f"prompt is {len(ids)} tokens; a probe runs exact numerics "
                                                      f"and takes at most {limit}")
        out: list[int] = []
        self._rt.free_seq(self._lease, self._rt.scratch_seq)
        status, error = "finished", None
        try:
            res, host_ms = self._job_timed("prefill", ids, 0)
            while True:
                s0 = e.host_timer.now()
                if res.logits is None:
                    tok = 0  # timing-only device: no logits
                else:
                    tok = int(np.argmax(to_f32(res.logits)))
                e.record_stages(res, source="probe", framework_ms=host_ms, sampling_ms=(e.host_timer.now() - s0) / 1e3)
                out.append(tok)
                if tok in eos or len(out) >= max_tokens:
                    break
                res, host_ms = self._job_timed("decode", [tok], len(ids) + len(out) - 1)
        except CalError as err:
            status = "failed"
            error = {"type": type(err).__name__, "message": str(err),
                     **({"code": err.code} if hasattr(err, "code") else {})}
        finally:
            self._rt.free_seq(self._lease, self._rt.scratch_seq)
        text = e.tokenizer.decode([t for t in out if t not in eos]) if b.numerics else ""
        return {"ok": status == "finished", "status": status, "text": text, "n_tokens": len(out), "prompt_n": len(ids),
                "error": error, "sim_ms": (b.now_us - sim0) / 1e3, "wall_ms": (time.perf_counter() - t0) * 1e3}


def _reg_key(key: Any, action: str) -> str | int:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str):
        k = key.strip()
        if k.lower().startswith("0x"):
            try:
                return int(k, 16)
            except ValueError:
                pass
        return k.upper()
    raise MaintenanceArgumentError(action, f"register key must be a name or an address, got {key!r}")


def _self_test_detail(rep: dict[str, Any]) -> str:
    """One line for a golden comparison (``golden.compare``'s report): verdict, error, rule, top-1."""
    if rep.get("max_abs_error") is None:
        return "FAIL: " + str(rep.get("detail", "no comparison"))
    top1 = f"top-1 {rep['argmax_device']}" + (" agrees" if rep["top1_match"] else f" != golden {rep['argmax_golden']}")
    return (("pass" if rep["ok"] else "FAIL") + f": max abs error {rep['max_abs_error']:.4g}, "
            f"{rep['n_mismatched']} {rep.get('dtype', 'bf16')} logits over the bound "
            f"({'1 BF16 step + ' if rep.get('dtype', 'bf16') == 'bf16' else ''}{rep['tolerance']:g}), {top1}")


#: Longest holder name accepted (characters); it is shown in the header and the audit log.
MAX_HOLDER_CHARS = 64


def _check_holder(holder: Any, action: str) -> None:
    """A holder is a short printable name (no newlines or terminal escapes): it is shown and audited."""
    if not isinstance(holder, str) or not holder.strip():
        raise MaintenanceArgumentError(action, "holder must be a non-empty name")
    if len(holder) > MAX_HOLDER_CHARS or not holder.isprintable():
        raise MaintenanceArgumentError(action, f"holder must be at most {MAX_HOLDER_CHARS} printable characters "
                                         "(no control characters)")


#: Longest probe prompt accepted (characters); the token limit is the engine's numerics limit.
MAX_PROBE_PROMPT_CHARS = 16_384
#: Longest argument text written to the audit log (characters); longer ones are cut with a marker.
MAX_AUDIT_ARG_CHARS = 256


def _brief(v: Any) -> Any:
    """An argument as the audit log keeps it: strings over MAX_AUDIT_ARG_CHARS cut with their length."""
    if isinstance(v, str) and len(v) > MAX_AUDIT_ARG_CHARS:
        return v[:MAX_AUDIT_ARG_CHARS] + f"... ({len(v)} characters)"
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)  # NaN / inf are not JSON
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return _brief(repr(v))


_REG_VALUE = re.compile(r"(0[xX][0-9a-fA-F]{1,8}|[0-9]{1,10})")


def _reg_value(value: Any) -> int:
    """A register value: an int, or ASCII decimal / 0x-hex text, in 0..2**32-1 (registers are 32-bit)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MaintenanceArgumentError(
            "write_register", f"value must be an integer or decimal/0x-hex text, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not _REG_VALUE.fullmatch(text):
            raise MaintenanceArgumentError("write_register", "value must be an integer in decimal or 0x-hex digits, "
                                                       f"got {_brief(value)!r}")
        value = int(text, 0) if text[:2].lower() == "0x" else int(text, 10)
    if not 0 <= value <= 0xFFFFFFFF:
        raise MaintenanceArgumentError("write_register", f"value must fit in 32 bits (0..0xFFFFFFFF), got {value}")
    return int(value)
