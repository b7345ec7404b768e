"""The maintenance door of the runtime: register access, reset, memory clear, KV clear, dumps and
golden I/O, each behind an explicit lease the maintenance plane checks (FACTS F5 C4, F9)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sim_backend.device.board import SimulatedBoard
from sim_backend.runtime.calrt import CALRT_VERSION
from sim_backend.errors import MaintenanceRefused

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
        if res.logits_bf16 is None:
            raise MaintenanceRefused("golden_check", "the device returned no logits (timing-only)")
        rep = compare(golden, res.logits_bf16, b.bundle.golden_max_abs_error)
        if rep["max_abs_error"] is None:
            raise MaintenanceRefused("golden_check", rep["detail"])
        return {**rep, "n_tokens": n, "sim_us": res.sim_us}
