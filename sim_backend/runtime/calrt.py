"""A CalRT-0.7.6-like runtime over the simulated board (facts.md F1, F5).

The inference plane's view of the device, shaped like the real SDK:

    dev = VirtualDevice(board, "PCIE")            # one PCIe device (0.7.6: one physical device)
    dev.version(), calrt_version()                # CalcoreRT commit (register) + "0.7.6"
    cb = Calbin.create(dev, bundle); cb.configure()
    sm = cb.get_submodel("decode", "llm_decode")  # EXACT name and type, never a substring
    inp, out = InputBuf(cb), OutputBuf(cb)        # or a BufferPool: built once, reused
    inp.write(seq_id, tokens, positions, cells); inp.set_csr(past_kv_cur_seq_len=p, cur_seq_len=n)
    cb.infer(sm, inp, out)                        # non-blocking submit
    res = out.wait(timeout_s)                     # StepResult or a typed error

Every call's outcome is checked; a failure is one of the typed errors of
``sim_backend.errors`` (``SubmitError``, ``WaitTimeout``, ``CCUException``,
``DeviceReset``, ``LinkError``, ``DeviceNotReady``, ``KVExhausted``), never a
status code left unread (facts.md F6).

Ping/pong (facts.md F5 C1): with ``VirtualDevice.enable_parallel_mode(True)``,
``Calbin.submit_job(..., task_type="ping"|"pong")`` lets two jobs be in
flight, one per task type. A submit to a task type that is still busy is
REFUSED at once with ``SubmitError`` (it does not wait): the caller already
holds the busy ``OutputBuf`` and must ``wait()`` it first, so a hidden wait
inside submit would only hide the serialisation. With parallel mode off, one
job at a time.

What is NOT here (facts.md F5 C4, F9): register reads/writes, reset,
ClearAllDevMem, trace/config-metadata dumps, golden I/O and per-chip memory
reads. Those live in ``MaintenanceRuntime``, whose every method takes an
explicit lease checked by the maintenance plane. Nothing public reachable
from ``VirtualDevice``, ``Calbin``, ``SubModel``, ``InputBuf``,
``OutputBuf``, ``KVView`` or ``RuntimeSession`` leads to them (tested).

Times: ``StepResult`` fields are simulated device microseconds; timeouts
are host wall seconds.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

from sim_backend.device.board import ChipletStatus, Job, JobCounters, SimulatedBoard
from sim_backend.errors import DeviceError, SubmitError

CALRT_VERSION = "0.7.6"
DEVICE_KINDS = ("PCIE",)
TASK_TYPES = ("ping", "pong")


def calrt_version() -> str:
    """The runtime library version (facts.md F1: CalRT 0.7.6)."""
    return CALRT_VERSION


class _ClaimHolder(Protocol):
    """What the device's task-type claims read and write of the output buffer holding one
    (``calbin.OutputBuf``, which imports this module: the device names only this shape of it)."""

    _claimed: bool  # reserved for a job not submitted yet: busy even with no job
    _job: Job | None

    @property
    def job_id(self) -> int | None: ...


# --- device --------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceStatus:
    """``VirtualDevice.status()``.

    state: "ready" (calbin configured, memory loaded) | "not_configured" |
    "memory_cleared" | "fault" (a chiplet reports a fault).
    """

    kind: str
    index: int
    state: str
    configured: bool
    memory_cleared: bool
    parallel_mode: bool
    chiplets: tuple[ChipletStatus, ...]


class VirtualDevice:
    """One PCIe virtual device over the simulated board.

    Args:
        board: the SimulatedBoard (kept private: nothing public leads to its
            registers, reset or memory clear).
        kind: only "PCIE" (CalRT 0.7.6: "temporary only support one physical device").
        index: device index; only 0 exists.

    Raises:
        DeviceError: unknown kind or index.
    """

    def __init__(self, board: SimulatedBoard, kind: str = "PCIE", index: int = 0) -> None:
        if kind not in DEVICE_KINDS:
            raise DeviceError(f"device kind {kind!r} not supported (CalRT {CALRT_VERSION}: {', '.join(DEVICE_KINDS)})")
        if index != 0:
            raise DeviceError(f"no device {index}: CalRT {CALRT_VERSION} supports one physical device (index 0)")
        self._board = board
        self.kind = kind
        self.index = index
        self._parallel = False
        self._lock = threading.Lock()
        # task type -> OutputBuf of the job last submitted with it (busy until that job ends)
        self._busy: dict[str, _ClaimHolder] = {}

    def version(self) -> str:
        """CalcoreRT firmware commit, read from the fixed CALCORERT_COMMIT register (facts.md F1), 7 hex digits."""
        return f"{self._board.registers.read('CALCORERT_COMMIT'):07x}"

    def status(self) -> DeviceStatus:
        """Device state now (one consistent read of the board's status registers)."""
        b = self._board
        configured = bool(b.registers.read("BOARD_STATUS") & 0x2)
        chips = tuple(b.chiplets())
        if b.memory_cleared:
            state = "memory_cleared"
        elif any(c.state == "fault" for c in chips):
            state = "fault"
        elif not configured:
            state = "not_configured"
        else:
            state = "ready"
        return DeviceStatus(self.kind, self.index, state, configured, b.memory_cleared, self._parallel, chips)

    def enable_parallel_mode(self, enable: bool) -> None:
        """EnableParallelMode(bool) (facts.md F5 C1): allow a ping and a pong job in flight together.

        Raises SubmitError if switched off while two jobs are in flight.
        """
        if not isinstance(enable, bool):
            raise SubmitError(f"enable_parallel_mode takes a bool, got {enable!r}")
        with self._lock:
            if not enable and len(self._busy_locked()) > 1:
                raise SubmitError("cannot leave parallel mode with two jobs in flight; wait them first")
            self._parallel = enable

    @property
    def parallel_mode(self) -> bool:
        return self._parallel

    def job_counters(self) -> JobCounters:
        """Device job counters (facts.md F5 C1): pending / running / finished / failed; ``.left`` = pending+running."""
        return self._board.counters()

    def busy_task_types(self) -> tuple[str, ...]:
        """Task types whose last job has not ended yet."""
        with self._lock:
            return tuple(sorted(self._busy_locked()))

    def _busy_locked(self) -> dict[str, _ClaimHolder]:
        # drop task types whose job has ended (done or failed): they are free again
        for t in [t for t, ob in self._busy.items() if not ob._claimed and (ob._job is None or ob._job.done)]:
            del self._busy[t]
        return self._busy

    def _claim(self, task_type: str, out: _ClaimHolder) -> str:
        """Reserve a task type for ``out``'s next job; returns the type used. SubmitError if busy."""
        with self._lock:
            busy = self._busy_locked()
            if not self._parallel:
                if busy:
                    t, ob = next(iter(busy.items()))
                    raise SubmitError(f"a job is in flight ({t}, job {ob.job_id}); parallel mode is off: "
                                      "wait() it first or enable_parallel_mode(True)")
                task_type = "ping" if task_type == "auto" else task_type
            elif task_type == "auto":
                free = [t for t in TASK_TYPES if t not in busy]
                if not free:
                    raise SubmitError("both task types (ping, pong) are busy: wait() one of them first")
                task_type = free[0]
            elif task_type in busy:
                raise SubmitError(f"task type {task_type} is busy with job {busy[task_type].job_id}: "
                                  "wait() it first")
            busy[task_type] = out
            out._claimed = True  # busy from now, before the job exists
            return task_type

    def _unclaim(self, task_type: str, out: _ClaimHolder) -> None:
        with self._lock:
            out._claimed = False
            if self._busy.get(task_type) is out:
                del self._busy[task_type]
