"""The calbin and its sub-models, found by exact name and type, and the job buffers (InputBuf / OutputBuf)
with the CSR checks of the real SDK (facts.md F1, F6). Times: simulated µs in results, host s in timeouts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim_backend.bundle.manifest import Bundle, SubModelSpec, load_bundle
from sim_backend.device.board import BatchJobRow, Job, StepResult
from sim_backend.errors import CalError, DeviceError, DeviceNotReady, SubmitError, WaitTimeout
from sim_backend.runtime.calrt import CALRT_VERSION, TASK_TYPES, VirtualDevice
from sim_backend.runtime.views import KVView

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

    @property
    def batch(self) -> int:
        """Sequences per submission: the input_ids shape's batch dim (1 today; N in a C3 variant's decode)."""
        return int(self.spec.input("input_ids").shape[0])


class Calbin:
    """A calbin bound to a device. Build with ``Calbin.create(device, bundle)``, then ``configure()``."""

    def __init__(self, device: VirtualDevice, bundle: Bundle) -> None:
        self.device = device
        self.bundle = bundle
        self.configured = False
        self.kv = KVView(device._board.kv)

    @classmethod
    def create(cls, device: VirtualDevice, bundle: Bundle | str | Path | None = None) -> Calbin:
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
        """Context in tokens from the calbin (40960), never the tokenizer's 131072 (facts.md F1)."""
        return self.bundle.context

    def get_submodel(self, name: str, smodel_type: str) -> SubModel:
        """Sub-model by EXACT name and EXACT type (facts.md F6: production matched substrings).

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
                                   + (f" (corrected: {sm.effective_type!r})"
                                      if sm.effective_type != sm.smodel_type else "")
                                   + f", not {smodel_type!r}")
        return SubModel(name, sm.smodel_type, sm)

    # --- submission ---------------------------------------------------------------

    def infer(self, submodel: SubModel, inbuf: InputBuf, outbuf: OutputBuf) -> OutputBuf:
        """Non-blocking infer(): submit one whole-graph step with an automatic task type.

        Returns ``outbuf`` (state pending). Raises SubmitError (bad buffers,
        CSR, busy task types), DeviceNotReady.
        """
        return self.submit_job(submodel, inbuf, outbuf, task_type="auto")

    def submit_job(self, submodel: SubModel, inbuf: InputBuf, outbuf: OutputBuf, *,
                   task_type: str = "auto", numeric: bool = True) -> OutputBuf:
        """SubmitJob / infer_with_fixed_task_type (facts.md F5 C1). ``task_type``: "ping" | "pong" | "auto".

        Refuses at once (SubmitError) if that task type is busy, or any job
        is in flight with parallel mode off; see the module docstring.
        """
        return self._submit(submodel, inbuf, outbuf, task_type=task_type, numeric=numeric, ctx=None)

    def _submit(self, submodel: SubModel, inbuf: InputBuf, outbuf: OutputBuf, *, task_type: str,
                numeric: bool, ctx: tuple[np.ndarray, np.ndarray] | None) -> OutputBuf:
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
        n, past = inbuf.cur_seq_len, inbuf.past_kv_cur_seq_len
        assert n is not None and past is not None  # _check_ready: the CSR is set
        try:
            ctx_cells, ctx_pos = board.kv.seq_cells(inbuf.seq_id) if ctx is None else ctx
            if ctx_cells.shape[0] != past + n:
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


    def _submit_batch(self, submodel: SubModel, rows: list[BatchJobRow], outbuf: OutputBuf, *,
                      task_type: str) -> OutputBuf:
        """Submit one batched decode step (C3 variant: the decode sub-model declares batch N > 1).

        ``rows``: per sequence its token, position, new cell and context (``kv.seq_cells``), with
        the CSR pair ``past_kv_cur_seq_len[i] = len(ctx) - 1``, ``cur_seq_len[i] = 1``. Raises
        SubmitError (batch-1 sub-model, too many rows, cells not the sequence's, busy task
        type), DeviceNotReady.
        """
        if task_type not in TASK_TYPES + ("auto",):
            raise SubmitError(f"task_type must be ping, pong or auto, got {task_type!r}")
        if not self.configured:
            raise DeviceNotReady("calbin not configured: call configure() first")
        if submodel.name != "decode" or self.bundle.submodels.get("decode") is not submodel.spec:
            raise SubmitError("only this calbin's decode sub-model runs batched")
        cap = submodel.batch
        if cap < 2:
            raise SubmitError(f"decode sub-model {submodel.name!r} is batch 1 (input_ids "
                              f"{list(submodel.spec.input('input_ids').shape)}): one sequence per job")
        if not 1 <= len(rows) <= cap:
            raise SubmitError(f"decode sub-model takes 1..{cap} sequences per job, got {len(rows)}")
        if outbuf._calbin is not self:
            raise SubmitError("buffers belong to another calbin")
        if outbuf._job is not None and not outbuf._job.done:
            raise SubmitError(f"output buffer still in use by job {outbuf._job.id} ({outbuf.state})")
        for r in rows:
            if not np.isin(r.new_cells, r.ctx_cells).all():
                raise SubmitError(f"input cells are not cells of sequence {r.seq_id} (kv apply first)")
            if r.past_len + 1 > self.context:
                raise SubmitError(f"CSR past_kv_cur_seq_len {r.past_len} + cur_seq_len 1 exceeds the calbin "
                                  f"context {self.context}")
        used = self.device._claim(task_type, outbuf)
        try:
            job = self.device._board.submit_batch(rows, task_type=used)
        except CalError:
            self.device._unclaim(used, outbuf)
            raise
        except (ValueError, TypeError, IndexError) as e:
            self.device._unclaim(used, outbuf)
            raise SubmitError(f"submit failed: {e}") from e
        outbuf._job, outbuf._task_type, outbuf.result, outbuf._claimed = job, used, None, False
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
    ccu_exception | failed. ``logits`` is the finished step's (vocab,) D2H
    logits, handed over without a copy: uint16 BF16 bits (facts.md F1: 303,872 B
    per token) or float32 where a C3 calbin declares F32 logits; None before a
    result or in timing-only mode.
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
        """OutputBuf state (facts.md F5 C1): idle | pending | running | done | ccu_exception | failed."""
        return "idle" if self._job is None else self._job.state.value

    @property
    def task_type(self) -> str | None:
        return self._task_type

    @property
    def logits(self) -> np.ndarray | None:
        """The last ``wait()`` result's logits (vocab,): uint16 BF16 bits, or float32 for an F32 calbin
        (``logits.to_f32`` widens either); None before one or in timing-only mode.

        The device's D2H array itself (no copy into a second host buffer: nothing reads one).
        """
        return None if self.result is None else self.result.logits

    @property
    def job_id(self) -> int | None:
        return None if self._job is None else self._job.id

    def wait(self, timeout: float) -> StepResult:
        """Wait(): block at most ``timeout`` host seconds.

        Returns the StepResult (its logits are also ``logits``), or
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
