"""``calconsole model [--json]``: the calbin bundle — sub-models, op counts, memory plan, findings.

Read-only: loads the bundle (``sim_backend.bundle.manifest.load_bundle``), generates
each sub-model's op graph from the model shape (facts.md F3), builds the
per-chip memory plan (facts.md F4) and lists the manifest findings.  No device
is started.  Every memory figure is in bytes (JSON) or GiB / MiB (text,
GiB = 2**30 B, MiB = 2**20 B).
"""

from __future__ import annotations

import argparse

from sim_backend.tools.model_report import model_info

from .common import Subparsers, fail, print_json

GiB = 2**30
MiB = 2**20


def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "model", help="print the bundle: sub-models, op counts, memory plan, manifest findings",
        description="Print the calbin bundle: sub-models (declared and effective type, I/O), op counts by "
                    "category and per chip (generated from the model shape, as the real bundle's profile counts them), "
                    "the per-chip memory plan and the manifest findings. Nothing runs on the device.")
    p.add_argument("--bundle", metavar="NAME|DIR", default=None,
                   help="calbin bundle: an installed bundle's name or a directory (default: the built-in "
                        "Qwen3-30B-A3B simulator bundle)")
    p.add_argument("--hardware", metavar="YAML", default=None,
                   help="hardware YAML for the memory plan (default: the shipped calculet_npu.yaml)")
    p.add_argument("--json", action="store_true",
                   help="print JSON: submodels.<name>.{op_count, per_chip_op_count, ops_by_category}, "
                        "memory.per_chip (bytes), findings")
    p.set_defaults(func=run)


def _size(b: int) -> str:
    return f"{b / GiB:.3f} GiB" if b >= GiB // 4 else f"{b / MiB:.3f} MiB"


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError

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
              f"(x {mem['kv_context_tokens']} = "
              f"{_size(mem['kv_bytes_per_token_per_chip'] * mem['kv_context_tokens'])}); "
              f"logits {mem['logits_bytes_per_token']:,} B per token to the host "
              f"({str(mem.get('logits_dtype', 'bf16')).upper()})")
    con.print("[b]Findings[/b]" if info["findings"] else "no findings")
    for f in info["findings"]:
        con.print(f"  [yellow]{f['severity']}[/yellow] {f['code']} {f['field']}: {f['message']} -> {f['action']}")
    return 0
