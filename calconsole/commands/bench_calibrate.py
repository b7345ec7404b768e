"""``calconsole bench calibrate``: the simulator against the measured figures of FACTS F7.

Cost-model cases come from :func:`sim_backend.tools.calibration.run_calibration`
(simulated device time, plus the fitted host allowance in the E2E case only);
engine cases from :func:`sim_backend.tools.calibration.run_engine_cases` (the real
serving engine, timing-only, whose host work is measured and lands on the
simulated clock).  Exit code 0 if every case is ok, 1 otherwise.
"""

from __future__ import annotations

import argparse

from .common import fail, print_json


def register(bsub) -> None:
    p = bsub.add_parser(
        "calibrate", help="simulated vs the real device's measurements, with the error of each case",
        description="Run the calibration cases (measurements of the real device): 27-token prefill tok/s, "
                    "246-token decode tok/s and the "
                    "4.41 s end-to-end request (each within ±3%), decode tok/s inside the historical bands "
                    "by context, and the two trends. Cost-model cases price steps directly (simulated device "
                    "time; the E2E case adds the fitted host allowance). Engine cases run the serving engine "
                    "timing-only with a 27-token prompt and max_tokens=246; their host work is measured. "
                    "Exit code 1 if any case is not ok.")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list: name, measured, simulated, unit, error_pct or band, ok")
    p.add_argument("--no-engine", action="store_true", help="skip the engine-level cases")
    p.add_argument("--timing", action="store_true",
                   help="also print the host cost of one price_step call (host wall us; a benchmark figure)")
    p.add_argument("--hardware", metavar="YAML", default=None,
                   help="hardware/cost-model YAML (default: the shipped calculet_npu.yaml)")
    p.set_defaults(func=run)


def _fmt(v: float, unit: str) -> str:
    return f"{v:.3f}" if unit == "s" else f"{v:.2f}"


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError
    from sim_backend.tools.calibration import (
        CostModel,
        price_step_cost_us,
        run_calibration,
        run_engine_cases,
    )

    try:
        cm = CostModel.load(args.hardware)
        cases = run_calibration(cm)
        if not args.no_engine:
            from sim_backend.planes import build_system

            with build_system(numerics=False, maintenance=False, n_slots=1, hardware=args.hardware) as system:
                cases += run_engine_cases(system)
    except (CalError, ValueError, RuntimeError) as e:
        return fail(str(e))
    timing = price_step_cost_us(cm) if args.timing else None
    ok = all(c["ok"] for c in cases)
    if args.json:
        if timing is not None:
            cases = cases + [{"name": "price_step_host_us_per_call", "measured": None, "simulated": None,
                              "unit": "us (host wall)", "host_us_per_call": timing, "ok": True}]
        print_json(cases)
        return 0 if ok else 1

    from rich.console import Console
    from rich.table import Table

    t = Table(title="Calibration: simulator vs measurements of the real device; "
                    "simulated time, engine rows include measured host work")
    t.add_column("case", no_wrap=True)
    t.add_column("path", no_wrap=True)
    for col in ("real device", "simulated"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("unit", no_wrap=True)
    t.add_column("error / band", justify="right", no_wrap=True)
    t.add_column("ok", justify="center", no_wrap=True)
    trends = []
    for c in cases:
        sim = c["simulated"]
        mark = "[green]ok[/green]" if c["ok"] else "[red]FAIL[/red]"
        path = "engine" if c.get("engine") else "cost model"
        if isinstance(sim, list):
            trends.append((c, mark))
        elif "band" in c:
            lo, hi = c["band"]
            t.add_row(c["name"], path, "-", _fmt(sim, c["unit"]), c["unit"],
                      f"[{lo:g}, {hi:g}]", mark)
        else:
            t.add_row(c["name"], path, _fmt(c["measured"], c["unit"]), _fmt(sim, c["unit"]), c["unit"],
                      f"{c['error_pct']:+.2f}%", mark)
    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 110))
    con.print(t)
    for c, mark in trends:
        pts = ", ".join(f"{a}: {b:.1f}" for a, b in c["simulated"])
        con.print(f"{c['name']} [{mark}] ({c['unit']}, simulated): {pts}")
    eng = next((c for c in cases if c.get("engine")), None)
    if eng is not None:
        con.print(f"engine request: {eng['prompt_n']} prompt tokens, {eng['predicted_n']} generated, "
                  f"timing-only; simulated device {eng['device_ms']:.1f} ms + measured host "
                  f"{eng['host_ms']:.1f} ms; ran in {eng['wall_s']:.2f} s of host wall time")
    if timing is not None:
        con.print(f"price_step host cost: decode {timing['decode']:.0f} us/call, "
                  f"27-token prefill {timing['prefill']:.0f} us/call (host wall time)")
    con.print("all cases ok" if ok else "[red]some cases are not ok[/red]")
    return 0 if ok else 1
