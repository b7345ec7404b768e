"""The bundle described for ``calconsole model``: sub-models, op counts (facts.md F3), per-chip
memory plan (facts.md F4, bytes) and manifest findings. Nothing runs on a device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim_backend.bundle.manifest import load_bundle
from sim_backend.device.memory import MemoryPlan
from sim_backend.model.hwspec import HardwareSpec
from sim_backend.model.opgraph import build_graph


def model_info(bundle_dir: str | Path | None = None, hardware: str | Path | None = None) -> dict[str, Any]:
    """The JSON document of ``calconsole model --json`` (sizes in bytes).

    Keys: ``bundle``, ``shape``, ``submodels.<name>`` (``smodel_type``,
    ``effective_type``, ``graph`` kind, ``op_count``, ``per_chip_op_count``
    [chip0, chip1] = per-chip profile rows, ``ops_by_category``,
    ``ops_by_category_per_chip``, ``inputs``, ``outputs``, ``csr``,
    ``dynamic_d2d``), ``memory`` (``per_chip``: per chip its regions with
    used / reserved / physical bytes and DRAM / SRAM reservation totals;
    ``totals``; KV and logits bytes per token) and ``findings``.
    Raises ManifestError on a bad bundle or hardware YAML.
    """
    bundle = load_bundle(bundle_dir)
    hw = HardwareSpec.load(hardware)
    shape = bundle.shape
    subs = {}
    for name, sm in bundle.submodels.items():
        kind = "prefill" if sm.effective_type == "llm_prefill" else "decode"
        g = build_graph(shape, kind)
        per_chip_cat: list[dict[str, int]] = [{} for _ in range(shape.n_chips)]
        for op in g.ops:
            for c in op.profile_chips:
                per_chip_cat[c][op.category] = per_chip_cat[c].get(op.category, 0) + 1
        subs[name] = {
            "smodel_type": sm.smodel_type, "effective_type": sm.effective_type, "graph": kind,
            "op_count": g.count(), "per_chip_op_count": g.per_chip_profile_count(),
            "ops_by_category": g.counts_by_category(),
            "ops_by_category_per_chip": per_chip_cat,
            "inputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in sm.inputs],
            "outputs": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape)} for t in sm.outputs],
            "csr": list(sm.csr), "dynamic_d2d": sm.dynamic_d2d,
        }
    plan = MemoryPlan.for_bundle(shape, hw)
    per_chip: list[dict[str, Any]] = []
    for c, regs in enumerate(plan.chips):
        per_chip.append({
            "chip": c,
            "regions": {r.name: {"kind": r.kind, "used_bytes": r.used_bytes, "reserved_bytes": r.reserved_bytes,
                                 "physical_bytes": r.physical_bytes} for r in regs},
            "dram_reserved_bytes": plan.reserved_bytes(c, "dram"),
            "sram_reserved_bytes": plan.reserved_bytes(c, "sram"),
            "dram_physical_bytes": next(r.physical_bytes for r in regs if r.kind == "dram"),
            "sram_physical_bytes": next(r.physical_bytes for r in regs if r.kind == "sram"),
            "param_file_bytes": plan.param_file_bytes[c],
            "param_estimate_bytes": plan.param_estimate_bytes[c],
        })
    totals = {
        "parameters_bytes": sum(p["regions"]["parameters"]["reserved_bytes"] for p in per_chip),
        "param_window_bytes": sum(p["regions"]["param_window"]["reserved_bytes"] for p in per_chip),
        "kv_cache_bytes": sum(p["regions"]["kv_cache"]["reserved_bytes"] for p in per_chip),
        "dram_reserved_bytes": sum(p["dram_reserved_bytes"] for p in per_chip),
        "sram_reserved_bytes": sum(p["sram_reserved_bytes"] for p in per_chip),
        "param_file_bytes": sum(plan.param_file_bytes),
    }
    return {
        "bundle": {"name": bundle.name, "path": str(bundle.path), "device": bundle.device_name,
                   "calrt_version": bundle.calrt_version, "firmware_commit": bundle.firmware_commit,
                   "context": bundle.context, "max_batch_size": bundle.max_batch_size,
                   "tokenizer_max_length": bundle.tokenizer_max_length,
                   "device_memory_required_bytes": bundle.device_memory_required_bytes},
        "shape": {k: getattr(shape, k) for k in shape.__dataclass_fields__},
        "submodels": subs,
        "memory": {
            "unit": "bytes", "per_chip": per_chip, "totals": totals,
            "kv_bytes_per_token_per_chip": plan.kv_bytes_per_token,
            "kv_context_tokens": shape.n_ctx,
            "logits_bytes_per_token": plan.logits_bytes_per_token, "logits_dtype": shape.logits_dtype,
            "address_union_bytes": dict(plan.address_union_bytes),
        },
        "findings": [{"severity": f.severity, "code": f.code, "file": f.file, "field": f.field,
                      "message": f.message, "action": f.action} for f in bundle.findings],
    }


