"""A CalRT-0.7.6-like runtime over the simulated board (FACTS F1, F5).

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
status code left unread (FACTS F6).

Ping/pong (FACTS F5 C1): with ``VirtualDevice.enable_parallel_mode(True)``,
``Calbin.submit_job(..., task_type="ping"|"pong")`` lets two jobs be in
flight, one per task type. A submit to a task type that is still busy is
REFUSED at once with ``SubmitError`` (it does not wait): the caller already
holds the busy ``OutputBuf`` and must ``wait()`` it first, so a hidden wait
inside submit would only hide the serialisation. With parallel mode off, one
job at a time.

What is NOT here (FACTS F5 C4, F9): register reads/writes, reset,
ClearAllDevMem, trace/config-metadata dumps, golden I/O and per-chip memory
reads. Those live in ``MaintenanceRuntime``, whose every method takes an
explicit lease checked by the maintenance plane. Nothing public reachable
from ``VirtualDevice``, ``Calbin``, ``SubModel``, ``InputBuf``,
``OutputBuf``, ``KVView`` or ``RuntimeSession`` leads to them (tested).

Times: ``StepResult`` fields are simulated device microseconds; timeouts
are host wall seconds.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sim_backend.bundle.manifest import Bundle, SubModelSpec, load_bundle
from sim_backend.device.board import ChipletStatus, Job, JobCounters, SimulatedBoard, StepResult
from sim_backend.errors import CalError, DeviceError, DeviceNotReady, MaintenanceRefused, SubmitError, WaitTimeout
from sim_backend.device.kv import KVCacheManager

CALRT_VERSION = "0.7.6"
DEVICE_KINDS = ("PCIE",)
TASK_TYPES = ("ping", "pong")


def calrt_version() -> str:
    """The runtime library version (FACTS F1: CalRT 0.7.6)."""
    return CALRT_VERSION


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
        self._busy: dict[str, OutputBuf] = {}

    def version(self) -> str:
        """CalcoreRT firmware commit, read from the fixed CALCORERT_COMMIT register (FACTS F1), 7 hex digits."""
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
        """EnableParallelMode(bool) (FACTS F5 C1): allow a ping and a pong job in flight together.

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
        """Device job counters (FACTS F5 C1): pending / running / finished / failed; ``.left`` = pending + running."""
        return self._board.counters()

    def busy_task_types(self) -> tuple[str, ...]:
        """Task types whose last job has not ended yet."""
        with self._lock:
            return tuple(sorted(self._busy_locked()))

    def _busy_locked(self) -> dict[str, "OutputBuf"]:
        # drop task types whose job has ended (done or failed): they are free again
        for t in [t for t, ob in self._busy.items() if not ob._claimed and (ob._job is None or ob._job.done)]:
            del self._busy[t]
        return self._busy

    def _claim(self, task_type: str, out: "OutputBuf") -> str:
        """Reserve a task type for ``out``'s next job; returns the type used. SubmitError if busy."""
        with self._lock:
            busy = self._busy_locked()
            if not self._parallel:
                if busy:
                    t, ob = next(iter(busy.items()))
                    raise SubmitError(f"a job is in flight ({t}, job {ob._job.id}); parallel mode is off: "
                                      "wait() it first or enable_parallel_mode(True)")
                task_type = "ping" if task_type == "auto" else task_type
            elif task_type == "auto":
                free = [t for t in TASK_TYPES if t not in busy]
                if not free:
                    raise SubmitError("both task types (ping, pong) are busy: wait() one of them first")
                task_type = free[0]
            elif task_type in busy:
                raise SubmitError(f"task type {task_type} is busy with job {busy[task_type]._job.id}: "
                                  "wait() it first")
            busy[task_type] = out
            out._claimed = True  # busy from now, before the job exists
            return task_type

    def _unclaim(self, task_type: str, out: "OutputBuf") -> None:
        with self._lock:
            out._claimed = False
            if self._busy.get(task_type) is out:
                del self._busy[task_type]


# --- KV view (inference-plane subset of the KV manager) ------------------------------


class KVView:
    """The KV manager's inference-plane operations (FACTS F5 C0/C1).

    apply / can_allocate / free / remove_tokens_at_end and the llama.cpp
    ``seq_*`` operations; NOT ``clear`` (whole-cache clear is a maintenance
    action, ``MaintenanceRuntime.clear_kv``).
    """

    _OPS = ("apply", "can_allocate", "free", "remove_tokens_at_end", "seq_rm", "seq_cp", "seq_keep", "seq_add",
            "seq_div", "seq_pos_min", "seq_pos_max", "seq_cells", "occupancy", "counters", "save_seq_state",
            "load_seq_state")

    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv

    def __getattr__(self, name: str) -> Any:
        if name in KVView._OPS:
            return getattr(self._kv, name)
        raise AttributeError(f"KVView has no operation {name!r}")

    def __dir__(self) -> list[str]:
        return sorted(KVView._OPS)


# --- calbin, sub-models, buffers ---------------------------------------------------


@dataclass(frozen=True)
class SubModel:
    """A configured sub-model: exact ``name``, its declared ``smodel_type``, the manifest spec."""

    name: str
    smodel_type: str
    spec: SubModelSpec

    @property
    def max_tokens(self) -> int:
        """cur_seq_len upper bound: the input_ids shape's sequence dim (prefill 40960, decode 1)."""
        return int(self.spec.input("input_ids").shape[-1])


class Calbin:
    """A calbin bound to a device. Build with ``Calbin.create(device, bundle)``, then ``configure()``."""

    def __init__(self, device: VirtualDevice, bundle: Bundle) -> None:
        self.device = device
        self.bundle = bundle
        self.configured = False
        self.kv = KVView(device._board.kv)

    @classmethod
    def create(cls, device: VirtualDevice, bundle: Bundle | str | Path | None = None) -> "Calbin":
        """CreateCalbin: ``bundle`` is a loaded Bundle, a bundle directory, or None (the board's own).

        Raises ManifestError (bad directory) or DeviceError if the calbin is
        not the model loaded on the device (different shape or numerics).
        """
        board = device._board
        if bundle is None:
            bundle = board.bundle
        elif not isinstance(bundle, Bundle):
            bundle = load_bundle(bundle)
        if bundle.shape != board.shape or bundle.numeric != board.bundle.numeric:
            raise DeviceError(f"calbin {bundle.name} ({bundle.path}) does not match the model loaded on the "
                              f"device ({board.bundle.name}): shape or numerics differ")
        return cls(device, bundle)

    def configure(self) -> None:
        """configure(): check the runtime version and that device memory holds the model.

        Raises DeviceError on a CalRT version mismatch, DeviceNotReady if memory was cleared.
        """
        if self.bundle.calrt_version != CALRT_VERSION:
            raise DeviceError(f"calbin built for CalRT {self.bundle.calrt_version}, runtime is {CALRT_VERSION}")
        if self.device._board.memory_cleared:
            raise DeviceNotReady("device memory cleared: the maintenance plane must reload the model first")
        self.configured = True

    @property
    def context(self) -> int:
        """Context in tokens from the calbin (40960), never the tokenizer's 131072 (FACTS F1)."""
        return self.bundle.context

    def get_submodel(self, name: str, smodel_type: str) -> SubModel:
        """Sub-model by EXACT name and EXACT type (FACTS F6: production matched substrings).

        ``smodel_type`` must equal the declared type, or the corrected type
        where the loader reported a known mislabel (``prefill`` declared
        ``llm_decode``: both "llm_decode" and "llm_prefill" are accepted for it,
        since the loader confirmed it by its input shape).

        Raises DeviceNotReady before configure(), KeyError-like
        ``SubModelNotFound`` otherwise.
        """
        if not self.configured:
            raise DeviceNotReady("calbin not configured: call configure() first")
        sm = self.bundle.submodels.get(name)
        if sm is None:
            raise SubModelNotFound(f"no sub-model named exactly {name!r} (have: {', '.join(self.bundle.submodels)})")
        accepted = {sm.smodel_type, sm.effective_type}
        if smodel_type not in accepted:
            raise SubModelNotFound(f"sub-model {name!r} has type {sm.smodel_type!r}"
                                   + (f" (corrected: {sm.effective_type!r})" if sm.effective_type != sm.smodel_type else "")
                                   + f", not {smodel_type!r}")
        return SubModel(name, sm.smodel_type, sm)

    # --- submission ---------------------------------------------------------------

    def infer(self, submodel: SubModel, inbuf: "InputBuf", outbuf: "OutputBuf") -> "OutputBuf":
        """Non-blocking infer(): submit one whole-graph step with an automatic task type.

        Returns ``outbuf`` (state pending). Raises SubmitError (bad buffers,
        CSR, busy task types), DeviceNotReady.
        """
        return self.submit_job(submodel, inbuf, outbuf, task_type="auto")

    def submit_job(self, submodel: SubModel, inbuf: "InputBuf", outbuf: "OutputBuf", *,
                   task_type: str = "auto", numeric: bool = True) -> "OutputBuf":
        """SubmitJob / infer_with_fixed_task_type (FACTS F5 C1). ``task_type``: "ping" | "pong" | "auto".

        Refuses at once (SubmitError) if that task type is busy, or any job
        is in flight with parallel mode off; see the module docstring.
        """
        return self._submit(submodel, inbuf, outbuf, task_type=task_type, numeric=numeric, ctx=None)

    def _submit(self, submodel: SubModel, inbuf: "InputBuf", outbuf: "OutputBuf", *, task_type: str,
                numeric: bool, ctx: tuple[np.ndarray, np.ndarray] | None) -> "OutputBuf":
        """``submit_job``; ``ctx``: the sequence's ``kv.seq_cells`` if the caller has just read them."""
        if task_type not in TASK_TYPES + ("auto",):
            raise SubmitError(f"task_type must be ping, pong or auto, got {task_type!r}")
        if not self.configured:
            raise DeviceNotReady("calbin not configured: call configure() first")
        if not isinstance(submodel, SubModel) or self.bundle.submodels.get(submodel.name) is not submodel.spec:
            raise SubmitError(f"{submodel!r} is not a sub-model of this calbin")
        if submodel.name not in ("prefill", "decode"):
            raise SubmitError(f"sub-model {submodel.name!r} cannot be run by this runtime (prefill/decode only)")
        if inbuf._calbin is not self or outbuf._calbin is not self:
            raise SubmitError("buffers belong to another calbin")
        if outbuf._job is not None and not outbuf._job.done:
            raise SubmitError(f"output buffer still in use by job {outbuf._job.id} ({outbuf.state})")
        inbuf._check_ready(submodel)
        used = self.device._claim(task_type, outbuf)
        board = self.device._board
        n = inbuf.cur_seq_len
        try:
            ctx_cells, ctx_pos = board.kv.seq_cells(inbuf.seq_id) if ctx is None else ctx
            if ctx_cells.shape[0] != inbuf.past_kv_cur_seq_len + n:
                raise SubmitError(f"CSR past_kv_cur_seq_len={inbuf.past_kv_cur_seq_len} + cur_seq_len={n} != "
                                  f"{ctx_cells.shape[0]} KV cells held by sequence {inbuf.seq_id}")
            if not np.isin(inbuf.cells_view, ctx_cells).all():
                raise SubmitError(f"input cells are not cells of sequence {inbuf.seq_id} (kv apply first)")
            job = board.submit(submodel.name, inbuf.seq_id, inbuf.tokens_view, inbuf.positions_view,
                               inbuf.cells_view, ctx_cells, ctx_pos, task_type=used, numeric=numeric)
        except CalError:
            self.device._unclaim(used, outbuf)
            raise
        except (ValueError, TypeError, IndexError) as e:  # anything unexpected is still a typed failure
            self.device._unclaim(used, outbuf)
            raise SubmitError(f"submit failed: {e}") from e
        outbuf._bind(job, used, inbuf)
        return outbuf


class SubModelNotFound(KeyError, CalError):
    """No sub-model with that exact name and type (a KeyError, so ``except KeyError`` works too)."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "sub-model not found"


class InputBuf:
    """Host input buffer of one in-flight request: tokens, positions, KV cells, CSR values.

    Preallocated once for the prefill graph's [1, context] input (MapBuf +
    SliceTensor: ``write`` copies into it, no per-call allocation). Class
    counter ``InputBuf.constructed`` counts constructions (buffer-pool test).
    """

    constructed = 0

    def __init__(self, calbin: Calbin) -> None:
        InputBuf.constructed += 1
        self._calbin = calbin
        cap = calbin.context
        self.capacity = cap
        self._tokens = np.zeros(cap, dtype=np.int64)
        self._positions = np.zeros(cap, dtype=np.int64)
        self._cells = np.zeros(cap, dtype=np.int64)
        self.seq_id = -1
        self._n = 0
        self.past_kv_cur_seq_len: int | None = None
        self.cur_seq_len: int | None = None

    def write(self, seq_id: int, tokens: Any, positions: Any, cells: Any) -> None:
        """H2D staging: copy ``tokens`` / ``positions`` / ``cells`` (equal lengths, 1..context) into the buffer.

        Clears the CSR values (set them again with ``set_csr``). SubmitError on bad input.
        """
        t = np.asarray(tokens).reshape(-1)
        p = np.asarray(positions).reshape(-1)
        c = np.asarray(cells).reshape(-1)
        n = t.shape[0]
        if not (p.shape[0] == n and c.shape[0] == n):
            raise SubmitError(f"tokens ({n}), positions ({p.shape[0]}) and cells ({c.shape[0]}) differ in length")
        if not 1 <= n <= self.capacity:
            raise SubmitError(f"input length {n} outside 1..{self.capacity} (calbin context)")
        for name, a in (("tokens", t), ("positions", p), ("cells", c)):
            if not np.issubdtype(a.dtype, np.integer):
                raise SubmitError(f"{name} must be integers, got {a.dtype}")
        vocab = self._calbin.bundle.shape.vocab
        if t.min() < 0 or t.max() >= vocab:
            raise SubmitError(f"token ids must be in [0, {vocab}), got [{t.min()}, {t.max()}]")
        if p.min() < 0 or c.min() < 0:
            raise SubmitError("positions and cells must be >= 0")
        self._tokens[:n] = t
        self._positions[:n] = p
        self._cells[:n] = c
        self._n = n
        self.seq_id = int(seq_id)
        self.past_kv_cur_seq_len = self.cur_seq_len = None

    def set_csr(self, *, past_kv_cur_seq_len: int, cur_seq_len: int) -> None:
        """Set the CSR ``past_kv_cur_seq_len[0]`` and ``cur_seq_len[0]`` (tokens) for the next submit.

        Raises SubmitError: non-integers, negative, cur_seq_len < 1, past +
        cur > context (40960), or cur_seq_len != the written input length.
        """
        for name, v in (("past_kv_cur_seq_len", past_kv_cur_seq_len), ("cur_seq_len", cur_seq_len)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise SubmitError(f"CSR {name} must be an integer, got {v!r}")
            if v < 0:
                raise SubmitError(f"CSR {name} must be >= 0, got {v}")
        ctx = self._calbin.context
        if cur_seq_len < 1:
            raise SubmitError(f"CSR cur_seq_len must be >= 1, got {cur_seq_len}")
        if past_kv_cur_seq_len + cur_seq_len > ctx:
            raise SubmitError(f"CSR past_kv_cur_seq_len {past_kv_cur_seq_len} + cur_seq_len {cur_seq_len} "
                              f"exceeds the calbin context {ctx}")
        if cur_seq_len != self._n:
            raise SubmitError(f"CSR cur_seq_len {cur_seq_len} != input length {self._n}")
        self.past_kv_cur_seq_len = int(past_kv_cur_seq_len)
        self.cur_seq_len = int(cur_seq_len)

    def _check_ready(self, sm: SubModel) -> None:
        if self._n == 0:
            raise SubmitError("input buffer is empty: write() first")
        if self.cur_seq_len is None or self.past_kv_cur_seq_len is None:
            raise SubmitError("CSR not set since the last write(): set_csr() first")
        if self.cur_seq_len > sm.max_tokens:
            raise SubmitError(f"{sm.name} takes at most {sm.max_tokens} tokens (cur_seq_len), got {self.cur_seq_len}")

    @property
    def n_tokens(self) -> int:
        return self._n

    @property
    def tokens_view(self) -> np.ndarray:
        return self._tokens[: self._n]

    @property
    def positions_view(self) -> np.ndarray:
        return self._positions[: self._n]

    @property
    def cells_view(self) -> np.ndarray:
        return self._cells[: self._n]


class OutputBuf:
    """Host output buffer of one in-flight request; the job handle of CalRT.

    ``state``: "idle" (never submitted) | pending | running | done |
    ccu_exception | failed. ``logits_bf16`` is the finished step's (vocab,)
    uint16 BF16 logits (FACTS F1: 303,872 B per token D2H), handed over
    without a copy; None before a result or in timing-only mode.
    Class counter ``OutputBuf.constructed`` counts constructions.
    """

    constructed = 0

    def __init__(self, calbin: Calbin) -> None:
        OutputBuf.constructed += 1
        self._calbin = calbin
        self._job: Job | None = None
        self._task_type: str | None = None
        self._on_end: Callable[[], None] | None = None
        self._claimed = False
        self._discarded = False
        self.result: StepResult | None = None

    def _bind(self, job: Job, task_type: str, inbuf: InputBuf) -> None:
        self._job = job
        self._task_type = task_type
        self.result = None
        self._claimed = False  # the job now says whether the task type is busy

    @property
    def state(self) -> str:
        """OutputBuf state (FACTS F5 C1): idle | pending | running | done | ccu_exception | failed."""
        return "idle" if self._job is None else self._job.state.value

    @property
    def task_type(self) -> str | None:
        return self._task_type

    @property
    def logits_bf16(self) -> np.ndarray | None:
        """The last ``wait()`` result's BF16 logits, uint16 (vocab,); None before one or in timing-only mode.

        The device's D2H array itself (no copy into a second host buffer: nothing reads one).
        """
        return None if self.result is None else self.result.logits_bf16

    @property
    def job_id(self) -> int | None:
        return None if self._job is None else self._job.id

    def wait(self, timeout: float) -> StepResult:
        """Wait(): block at most ``timeout`` host seconds.

        Returns the StepResult (its logits are also ``logits_bf16``), or
        raises WaitTimeout (job keeps running; wait again), CCUException,
        DeviceReset, LinkError, DeviceNotReady or DeviceError. SubmitError if
        nothing was submitted.
        """
        job = self._job
        if job is None:
            raise SubmitError("wait() on an output buffer with no job")
        if not isinstance(timeout, (int, float)) or not timeout >= 0 or timeout == float("inf"):
            raise SubmitError(f"wait timeout must be finite seconds >= 0, got {timeout!r}")
        try:
            res = job.wait(timeout)
        except WaitTimeout:
            raise
        except DeviceError:
            self._end()
            raise
        self.result = res
        self._end()
        return res

    def discard(self) -> None:
        """Give up on this buffer's job (e.g. after a WaitTimeout the caller will not retry).

        Its buffers go back to the pool as soon as the job ends (at once if it
        has); the result, if any, is dropped. Idempotent.
        """
        self._discarded = True
        if self._job is None or self._job.done:
            self._end()

    def _end(self) -> None:
        self._discarded = False
        if self._task_type is not None:
            self._calbin.device._unclaim(self._task_type, self)
        cb, self._on_end = self._on_end, None
        if cb is not None:
            cb()


# --- buffer pool -------------------------------------------------------------------


class BufferPair:
    """One request's InputBuf + OutputBuf, owned by the pool."""

    def __init__(self, calbin: Calbin, index: int) -> None:
        self.index = index
        self.inp = InputBuf(calbin)
        self.out = OutputBuf(calbin)


class BufferPool:
    """Fixed set of buffer pairs built once (FACTS F6 P1: production rebuilt them on every call).

    Args:
        calbin: the configured calbin.
        size: pairs (one per job that may be in flight; 2 for ping/pong).
    """

    def __init__(self, calbin: Calbin, size: int = 2) -> None:
        if not 1 <= size <= 16:
            raise ValueError(f"pool size must be in 1..16, got {size}")
        self.size = size
        self._pairs = [BufferPair(calbin, i) for i in range(size)]
        self._free = list(self._pairs)
        self._cond = threading.Condition()
        self.constructed = 2 * size  # InputBuf + OutputBuf built, ever

    def acquire(self, timeout: float = 0.0) -> BufferPair:
        """Take a free pair, waiting at most ``timeout`` host seconds. SubmitError if none frees up."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            for p in self._pairs:  # reclaim discarded pairs whose job has ended since
                if p.out._discarded and p.out._job is not None and p.out._job.done:
                    p.out._end()
            with self._cond:
                if self._free:
                    return self._free.pop()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SubmitError(f"all {self.size} buffer pairs in use")
                # a discarded job's end notifies nobody: look again every 10 ms (bounded by the deadline)
                self._cond.wait(min(left, 0.01))

    def release(self, pair: BufferPair) -> None:
        """Return a pair. SubmitError if its job is still in flight or it is not this pool's."""
        if pair not in self._pairs:
            raise SubmitError("buffer pair does not belong to this pool")
        if pair.out._job is not None and not pair.out._job.done:
            raise SubmitError(f"buffer pair {pair.index} still in use by job {pair.out._job.id}")
        with self._cond:
            if pair not in self._free:
                self._free.append(pair)
                self._cond.notify()

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def wait_all_free(self, timeout: float) -> int:
        """Wait up to ``timeout`` host seconds for every pair to be back; returns the free count then.

        Reclaims discarded pairs whose job has ended, like ``acquire``. Never raises.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            for p in self._pairs:
                if p.out._discarded and p.out._job is not None and p.out._job.done:
                    p.out._end()
            with self._cond:
                left = deadline - time.monotonic()
                if len(self._free) == self.size or left <= 0:
                    return len(self._free)
                # release() notifies; a discarded job's end does not: look again every 10 ms
                self._cond.wait(min(left, 0.01))


# --- the whole submission path, as the engine would use it -----------------------------


class RuntimeSession:
    """The FACTS F1 submission path, bound once: device + configured calbin + sub-models + pool.

    ``step()`` does, per job: take a pooled buffer pair, write input, set the
    CSR, submit with a fixed task type, and returns the OutputBuf; the pair
    goes back to the pool when its ``wait()`` ends (result or error).

    Args:
        board: the simulated board.
        parallel: enable parallel mode (ping/pong); pool size 2, else 1.
    """

    def __init__(self, board: SimulatedBoard, *, parallel: bool = False, bundle: Bundle | None = None) -> None:
        self.device = VirtualDevice(board, "PCIE")
        self.device.enable_parallel_mode(parallel)
        self.calbin = Calbin.create(self.device, bundle)
        self.calbin.configure()
        self.submodels = {"prefill": self.calbin.get_submodel("prefill", "llm_prefill"),
                          "decode": self.calbin.get_submodel("decode", "llm_decode")}
        self.pool = BufferPool(self.calbin, 2 if parallel else 1)
        self.kv = self.calbin.kv
        self._rr = 0

    def step(self, kind: str, seq_id: int, tokens: Any, positions: Any, cells: Any, *,
             task_type: str = "auto", acquire_timeout: float = 0.0, numeric: bool = True) -> OutputBuf:
        """Submit one prefill/decode step of ``seq_id`` whose new ``cells`` were applied in the KV.

        past_kv_cur_seq_len is the sequence's other cells. Raises SubmitError,
        DeviceNotReady, or the errors of ``Calbin.submit_job``; on error the
        buffer pair is back in the pool.
        """
        if kind not in self.submodels:
            raise SubmitError(f"unknown step kind {kind!r} (prefill or decode)")
        pair = self.pool.acquire(acquire_timeout)
        try:
            pair.inp.write(seq_id, tokens, positions, cells)
            n = pair.inp.n_tokens
            ctx = self.kv.seq_cells(seq_id)  # read once: the CSR here, the attention context in the submit
            pair.inp.set_csr(past_kv_cur_seq_len=ctx[0].shape[0] - n, cur_seq_len=n)
            out = self.calbin._submit(self.submodels[kind], pair.inp, pair.out, task_type=task_type,
                                      numeric=numeric, ctx=ctx)
        except BaseException:
            self.pool.release(pair)
            raise
        out._on_end = lambda: self.pool.release(pair)
        return out

    def job_counters(self) -> JobCounters:
        return self.device.job_counters()


# --- maintenance-only runtime functions ------------------------------------------------


def require_lease(action: str, lease: Any) -> None:
    """Default lease check: refuse without a lease. The maintenance plane passes its own check."""
    if lease is None:
        raise MaintenanceRefused(action, "exclusive mode required: enter exclusive mode first")


class MaintenanceRuntime:
    """CalRT functions that must not be in the inference API (FACTS F5 C1/C4, F9).

    Every method takes the maintenance ``lease`` and calls
    ``lease_check(action, lease)`` first, which raises MaintenanceRefused
    (the maintenance plane passes its own ``_check``, so a stale lease is
    refused too). Auditing is the caller's job (``MaintenancePlane._run``).

    Args:
        board: the simulated board.
        lease_check: callable(action: str, lease) -> None, raising MaintenanceRefused.
        memory_plan: optional ``memory.MemoryPlan`` for per-chip memory reads.
    """

    def __init__(self, board: SimulatedBoard, lease_check: Callable[[str, Any], None] = require_lease,
                 memory_plan: Any = None) -> None:
        self._board = board
        self._check = lease_check
        self._memory_plan = memory_plan

    def read_register(self, lease: Any, key: str | int) -> int:
        """Any register of the map, by name or address (KeyError-like MaintenanceRefused if unknown)."""
        self._check("read_register", lease)
        try:
            return self._board.registers.read(key)
        except KeyError as e:
            raise MaintenanceRefused("read_register", str(e)) from None

    def write_register(self, lease: Any, key: str | int, value: int) -> None:
        """Write a register the map marks writable; MaintenanceRefused otherwise."""
        self._check("write_register", lease)
        try:
            self._board.registers.write(key, value)
        except (KeyError, PermissionError, ValueError) as e:
            raise MaintenanceRefused("write_register", str(e)) from None

    def dump_registers(self, lease: Any) -> dict[str, int]:
        self._check("dump_registers", lease)
        return self._board.registers.dump()

    def chip_memory(self, lease: Any, chip: int) -> dict:
        """Per-chip memory: the plan's regions (bytes) with KV in use now, and the chip's status."""
        self._check("chip_memory", lease)
        b = self._board
        if not 0 <= chip < b.shape.n_chips:
            raise MaintenanceRefused("chip_memory", f"no chip {chip} (device has {b.shape.n_chips})")
        occ = b.kv.occupancy()
        out: dict = {"chip": chip, "kv_used_tokens": occ.used_cells,
                     "kv_used_bytes": occ.used_cells * b.shape.kv_bytes_per_token_per_chip,
                     "kv_capacity_bytes": occ.bytes_capacity_per_chip, "memory_cleared": b.memory_cleared}
        if self._memory_plan is not None:
            plan = self._memory_plan.with_kv_used(min(occ.used_cells, self._memory_plan.shape.n_ctx))
            out["regions"] = [{"name": r.name, "kind": r.kind, "used_bytes": r.used_bytes,
                               "reserved_bytes": r.reserved_bytes} for r in plan.chips[chip]]
        return out

    def config_metadata(self, lease: Any) -> dict:
        """Config metadata: bundle identity, sub-models with I/O specs and CSRs, findings, registers."""
        self._check("config_metadata", lease)
        b = self._board.bundle
        return {
            "bundle": b.name, "path": str(b.path), "calrt_version": b.calrt_version,
            "runtime_version": CALRT_VERSION, "firmware_commit": f"{self._board.registers.read('CALCORERT_COMMIT'):07x}",
            "context": b.context, "max_batch_size": b.max_batch_size, "chips": b.shape.n_chips,
            "submodels": {n: {"smodel_type": s.smodel_type, "effective_type": s.effective_type, "csr": list(s.csr),
                              "inputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in s.inputs],
                              "outputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in s.outputs]}
                          for n, s in b.submodels.items()},
            "findings": [{"severity": f.severity, "code": f.code, "file": f.file, "field": f.field,
                          "message": f.message, "action": f.action} for f in b.findings],
            "registers": self._board.registers.dump(),
        }

    def dump_trace(self, lease: Any, path: str | Path) -> dict:
        """Write config metadata + a Chrome trace of the last prefill/decode steps to ``path`` (JSON).

        Returns {"path", "steps", "bytes"}.
        """
        self._check("dump_trace", lease)
        from sim_backend.model.trace import chrome_trace

        steps = sorted(self._board.last_steps.values(), key=lambda r: r.job_id)
        trace = chrome_trace([(f"{r.kind} job {r.job_id}", r.cost, r.sim_start_us) for r in steps])
        meta = self.config_metadata(lease)
        doc = {"metadata": meta, **trace}
        text = json.dumps(doc, default=str)
        p = Path(path)
        p.write_text(text, encoding="utf-8")
        return {"path": str(p), "steps": len(steps), "bytes": len(text.encode())}

    def clear_kv(self, lease: Any) -> None:
        """Clear the whole KV cache (every sequence)."""
        self._check("clear_kv", lease)
        self._board.kv.clear()

    def golden_check(self, lease: Any, golden_file: str | Path | None = None, *, seq_id: int = 62,
                     timeout: float = 60.0) -> dict:
        """Golden self-test: run the golden input as one prefill on a scratch sequence, compare logits.

        Golden file (npz): ``input_ids`` (1-D int token ids) and ``logits``
        (last-token logits, float32, or uint16 BF16 bits). Defaults to the
        bundle's golden file. Returns {"ok", "max_abs_error", "tolerance",
        "n_tokens", "sim_us"}; raises MaintenanceRefused if there is no
        golden file, and the device's typed errors if the job fails.
        """
        self._check("golden_check", lease)
        b = self._board
        gf = Path(golden_file) if golden_file is not None else b.bundle.golden_file
        if gf is None or not Path(gf).exists():
            raise MaintenanceRefused("golden_check", "no golden file in this bundle")
        if not b.numerics:
            raise MaintenanceRefused("golden_check", "device runs timing-only (no logits to compare)")
        from sim_backend.model.golden import GoldenFileError, compare, load_golden

        try:
            golden = load_golden(gf)
        except GoldenFileError as e:
            raise MaintenanceRefused("golden_check", str(e)) from None
        ids = golden.input_ids
        n = ids.shape[0]
        cells = b.kv.apply(seq_id, n, timeout=1.0, positions=list(range(n)))
        try:
            ctx, pos = b.kv.seq_cells(seq_id)
            job = b.submit("prefill", seq_id, ids, np.arange(n, dtype=np.int64), np.asarray(cells), ctx, pos)
            res = job.wait(timeout)
        finally:
            b.kv.free(seq_id)
        rep = compare(golden, res.logits_bf16, b.bundle.golden_max_abs_error)
        if rep["max_abs_error"] is None:
            raise MaintenanceRefused("golden_check", rep["detail"])
        return {**rep, "n_tokens": n, "sim_us": res.sim_us}
