"""``calconsole bench calibrate``: the simulator against the measured figures of facts.md F7.

Cost-model cases come from :func:`sim_backend.tools.calibration.run_calibration`
(simulated device time, plus the fitted host allowance in the E2E case only);
engine cases from :func:`sim_backend.tools.calibration.run_engine_cases` (the real
serving engine in both modes; host work on the simulated clock is the fitted
allowance per token by default, ``--host-time measured`` books this machine's
measured host work instead).  Exit code 0 if every case is ok, 1 otherwise.
"""

from __future__ import annotations

import argparse

from .common import fail, print_json


def register(bsub) -> None:
    p = bsub.add_parser(
        "calibrate", help="simulated vs the real device's measurements, with the held-out error of each case",
        description="Run the calibration cases (measurements of the real device): 27-token prefill tok/s, "
                    "246-token decode tok/s and the "
                    "4.41 s end-to-end request (each within ±3%), decode tok/s inside the historical bands "
                    "by context, and the two trends, in both modes (timing-only: experts priced by the "
                    "expectation; numeric: by the router's choices). Each fitted case also gets its "
                    "held-out (leave-one-out) error: the parameters are refitted without it and it is "
                    "predicted. Cost-model cases price steps directly (simulated device time; the E2E case "
                    "adds the fitted host allowance). Engine cases run the serving engine with a 27-token "
                    "prompt and max_tokens=246; the host work they book on the simulated clock is the "
                    "fitted allowance per token (--host-time modeled, the console's default) or this "
                    "machine's measured host work (--host-time measured; depends on this host's speed). "
                    "Exit code 1 if any case is not ok and its miss is not one the report explains.")
    p.add_argument("--json", action="store_true",
                   help="print JSON: {cases: [name, mode, role, measured, simulated, unit, error_pct or band, "
                        "loo_simulated, loo_error_pct, ok, explained], summary: {mode: RMS figures}}")
    p.add_argument("--no-engine", action="store_true", help="skip the engine-level cases")
    p.add_argument("--host-time", choices=("modeled", "measured"), default="modeled",
                   help="host work the engine cases book on the simulated clock: the fitted allowance per "
                        "token (default) or this machine's measured work")
    p.add_argument("--no-loo", action="store_true", help="skip the leave-one-out validation (it refits 18 times)")
    p.add_argument("--timing-only", action="store_true",
                   help="timing-only mode only (no numerics run: the numeric mode needs the router's choices)")
    p.add_argument("--timing", action="store_true",
                   help="also print the host cost of one price_step call (host wall us; a benchmark figure)")
    p.add_argument("--hardware", metavar="YAML", default=None,
                   help="hardware/cost-model YAML (default: the shipped calculet_npu.yaml)")
    p.set_defaults(func=run)


def _fmt(v: float, unit: str) -> str:
    return f"{v:.3f}" if unit == "s" else f"{v:.2f}"


def _cases(args: argparse.Namespace):
    from sim_backend.compose import build_system
    from sim_backend.tools.calibration import (
        CostModel,
        leave_one_out,
        router_touched_27,
        run_calibration,
        run_engine_cases,
    )

    cm = CostModel.load(args.hardware)
    modes = ("timing-only",) if args.timing_only else ("timing-only", "numeric")
    cases: list[dict] = []
    for mode in modes:
        touched = router_touched_27() if mode == "numeric" else None
        loo = None if args.no_loo else leave_one_out(cm, touched_27=touched)
        cases += run_calibration(cm, mode=mode, touched_27=touched, loo=loo)
    if not args.no_engine:
        for mode in modes:
            with build_system(numerics=mode == "numeric", maintenance=False, n_slots=1,
                              hardware=args.hardware, host_time=args.host_time) as system:
                cases += run_engine_cases(system)
    return cm, cases


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError
    from sim_backend.tools.calibration import case_passes, price_step_cost_us, summarise

    try:
        cm, cases = _cases(args)
    except (CalError, ValueError, RuntimeError) as e:
        return fail(str(e))
    timing = price_step_cost_us(cm) if args.timing else None
    ok = all(case_passes(c) for c in cases)
    summary = summarise(cases)
    if args.json:
        doc: dict = {"time_unit": "simulated time (engine rows add the host work booked on the simulated "
                                  f"clock: {args.host_time if not args.no_engine else 'none'})",
                     "cases": cases, "summary": summary}
        if timing is not None:
            doc["price_step_host_us_per_call"] = timing
        print_json(doc)
        return 0 if ok else 1

    from rich.console import Console
    from rich.table import Table

    t = Table(title="Calibration: simulator vs measurements of the real device; "
                    f"simulated time, engine rows include host work ({args.host_time})")
    t.add_column("case", no_wrap=True)
    t.add_column("mode", no_wrap=True)
    t.add_column("path", no_wrap=True)
    t.add_column("role", no_wrap=True)
    for col in ("real device", "simulated"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("unit", no_wrap=True)
    t.add_column("error / band", justify="right", no_wrap=True)
    t.add_column("held-out", justify="right", no_wrap=True)
    t.add_column("ok", justify="center", no_wrap=True)
    trends = []
    notes = []
    for c in cases:
        sim = c["simulated"]
        mark = ("[green]ok[/green]" if c["ok"] else
                "[yellow]miss*[/yellow]" if c.get("explained") else "[red]FAIL[/red]")
        if c.get("explained"):
            notes.append(f"* {c['name']} ({c['mode']}): {c['explained']}")
        if c.get("loo_in_band") is False:
            why = c.get("loo_explained") or "not explained"
            notes.append(f"held-out miss {c['name']} ({c['mode']}): {c['loo_band_miss_pct']:+.1f}% beyond its band; "
                         f"{why}")
        path = "engine" if c.get("engine") else "cost model"
        loo = f"{c['loo_error_pct']:+.1f}%" if "loo_error_pct" in c else "-"
        if isinstance(sim, list):
            trends.append((c, mark))
        elif "band" in c:
            lo, hi = c["band"]
            t.add_row(c["name"], c["mode"], path, c["role"], "-", _fmt(sim, c["unit"]), c["unit"],
                      f"[{lo:g}, {hi:g}]", loo, mark)
        else:
            t.add_row(c["name"], c["mode"], path, c["role"], _fmt(c["measured"], c["unit"]), _fmt(sim, c["unit"]),
                      c["unit"], f"{c['error_pct']:+.2f}%", loo, mark)
    con = Console()
    if not con.is_terminal:
        con = Console(width=max(con.width, 150))
    con.print(t)
    for c, mark in trends:
        pts = ", ".join(f"{a}: {b:.1f}" for a, b in c["simulated"])
        con.print(f"{c['name']} ({c['mode']}) [{mark}] ({c['unit']}, simulated): {pts}")
    for n in notes:
        con.print(n)
    for mode, sm in summary.items():
        if sm["loo_rms_pct"] is None:
            continue
        con.print(f"{mode}: held-out (leave-one-out) RMS {sm['loo_rms_pct']:.1f}% over the 9 fitted cases "
                  f"(bands {sm['loo_rms_bands_pct']:.1f}% vs their centres, {sm['loo_bands_in_band']} inside "
                  f"their band; points {sm['loo_rms_points_pct']:.1f}%); in-sample {sm['in_sample_rms_pct']:.1f}%")
    if any(sm["loo_rms_pct"] is not None for sm in summary.values()):
        con.print("the 27-token prefill is the only prefill point: held out, fp16_compute_eff falls back to the "
                  "middle of its range, so its held-out error measures that range, not the model")
    for eng in (c for c in cases if c.get("engine") and c["name"] == "engine_e2e_27_prompt_246_decode"):
        con.print(f"engine request ({eng['mode']}): {eng['prompt_n']} prompt tokens, {eng['predicted_n']} generated; "
                  f"simulated device {eng['device_ms']:.1f} ms + host booked {eng['host_booked_ms']:.1f} ms "
                  f"({eng['host_time']}; fitted allowance {eng['fitted_host_ms_per_token']:.3f} ms per token); "
                  f"measured host work on this machine {eng['host_ms']:.1f} ms ({eng['host_ms_per_token']:.3f} ms "
                  f"per token{', not booked' if eng['host_time'] == 'modeled' else ''}); ran in "
                  f"{eng['wall_s']:.2f} s of host wall time")
    if timing is not None:
        con.print(f"price_step host cost: decode {timing['decode']:.0f} us/call, "
                  f"27-token prefill {timing['prefill']:.0f} us/call (host wall time)")
    con.print("all cases ok (or an explained miss)" if ok else "[red]some cases are not ok[/red]")
    return 0 if ok else 1
