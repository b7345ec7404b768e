"""``calconsole model [--json]``: the calbin bundle — sub-models, op counts, memory plan, findings.

Read-only: loads the bundle (``sim_backend.bundle.load_bundle``), generates
each sub-model's op graph from the model shape (FACTS F3), builds the
per-chip memory plan (FACTS F4) and lists the manifest findings.  No device
is started.  Every memory figure is in bytes (JSON) or GiB / MiB (text,
GiB = 2**30 B, MiB = 2**20 B).
"""

from __future__ import annotations

import argparse

from .common import fail, print_json

GiB = 2**30
MiB = 2**20


def register(sub, common) -> None:
    p = sub.add_parser(
        "model", help="print the bundle: sub-models, op counts, memory plan, manifest findings",
        description="Print the calbin bundle: sub-models (declared and effective type, I/O), op counts by "
                    "category and per chip (generated from the model shape, as the real bundle's profile counts them), "
                    "the per-chip memory plan and the manifest findings. Nothing runs on the device.")
    p.add_argument("--bundle", metavar="DIR", default=None,
                   help="calbin bundle directory (default: the built-in Qwen3-30B-A3B simulator bundle)")
    p.add_argument("--hardware", metavar="YAML", default=None,
                   help="hardware YAML for the memory plan (default: the shipped calculet_npu.yaml)")
    p.add_argument("--json", action="store_true",
                   help="print JSON: submodels.<name>.{op_count, per_chip_op_count, ops_by_category}, "
                        "memory.per_chip (bytes), findings")
    p.set_defaults(func=run)


def model_info(bundle_dir=None, hardware=None) -> dict:
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
    from sim_backend.bundle import load_bundle
    from sim_backend.costmodel import HardwareSpec
    from sim_backend.memory import MemoryPlan
    from sim_backend.opgraph import build_graph

    bundle = load_bundle(bundle_dir)
    hw = HardwareSpec.load(hardware)
    shape = bundle.shape
    subs = {}
    for name, sm in bundle.submodels.items():
        kind = "prefill" if sm.effective_type == "llm_prefill" else "decode"
        g = build_graph(shape, kind)
        per_chip_cat = [{} for _ in range(shape.n_chips)]
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
    per_chip = []
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
            "logits_bytes_per_token": plan.logits_bytes_per_token,
            "address_union_bytes": dict(plan.address_union_bytes),
        },
        "findings": [{"severity": f.severity, "code": f.code, "file": f.file, "field": f.field,
                      "message": f.message, "action": f.action} for f in bundle.findings],
    }


def _size(b: int) -> str:
    return f"{b / GiB:.3f} GiB" if b >= GiB // 4 else f"{b / MiB:.3f} MiB"


def run(args: argparse.Namespace) -> int:
    from sim_backend.errors import CalError

    try:
        info = model_info(args.bundle, args.hardware)
    except (CalError, ValueError) as e:
        return fail(str(e))
    if args.json:
        print_json(info)
        return 0

    from rich.console import Console
    from rich.table import Table

    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 110))
    b = info["bundle"]
    con.print(f"[b]{b['name']}[/b] ({b['path']}) device {b['device']}, CalRT {b['calrt_version']}, "
              f"context {b['context']} tokens, batch {b['max_batch_size']}")
    names = list(info["submodels"])
    t = Table(title="Op counts by category (generated from the model shape, counted as in the real bundle's profile)")
    t.add_column("category", no_wrap=True)
    for n in names:
        t.add_column(n, justify="right")
    cats = list(next(iter(info["submodels"].values()))["ops_by_category"]) if names else []
    for cat in cats:
        t.add_row(cat, *(str(info["submodels"][n]["ops_by_category"][cat]) for n in names))
    t.add_row("[b]total[/b]", *(f"[b]{info['submodels'][n]['op_count']}[/b]" for n in names))
    t.add_row("per-chip profile (chip0 / chip1)",
              *(" / ".join(map(str, info["submodels"][n]["per_chip_op_count"])) for n in names))
    t.add_row("declared / effective type",
              *(f"{info['submodels'][n]['smodel_type']} / {info['submodels'][n]['effective_type']}" for n in names))
    con.print(t)
    m = Table(title="Memory plan per chip (used / reserved / physical, as the real bundle plans it)")
    m.add_column("region", no_wrap=True)
    m.add_column("kind")
    chips = info["memory"]["per_chip"]
    for p in chips:
        m.add_column(f"chip{p['chip']}", justify="right", no_wrap=True)
    for rname, r0 in chips[0]["regions"].items():
        m.add_row(rname, r0["kind"], *(
            f"{_size(p['regions'][rname]['used_bytes'])} / {_size(p['regions'][rname]['reserved_bytes'])} / "
            f"{_size(p['regions'][rname]['physical_bytes'])}" for p in chips))
    m.add_row("DRAM reservation", "dram", *(_size(p["dram_reserved_bytes"]) for p in chips))
    m.add_row("SRAM reservation", "sram", *(_size(p["sram_reserved_bytes"]) for p in chips))
    m.add_row("parameter files", "file", *(_size(p["param_file_bytes"]) for p in chips))
    con.print(m)
    mem = info["memory"]
    con.print(f"KV {mem['kv_bytes_per_token_per_chip']:,} B per token per chip "
              f"(x {mem['kv_context_tokens']} = {_size(mem['kv_bytes_per_token_per_chip'] * mem['kv_context_tokens'])}); "
              f"logits {mem['logits_bytes_per_token']:,} B per token to the host")
    con.print("[b]Findings[/b]" if info["findings"] else "no findings")
    for f in info["findings"]:
        con.print(f"  [yellow]{f['severity']}[/yellow] {f['code']} {f['field']}: {f['message']} -> {f['action']}")
    return 0
