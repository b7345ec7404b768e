"""``calconsole drill``: a scripted maintenance window against a fresh in-process simulator, or
(``--connect URL`` with the admin key) against a running server's live device over HTTP.

Steps, in order (each checked against what it should do):

 1. ``reset`` without the lease                  -> refused (MaintenanceRefused)
 2. ``submit_request`` (long reply)              -> admitted, first tokens stream
 3. ``enter_exclusive`` while it streams         -> lease granted after the bounded drain;
                                                    the streaming request ends cancelled with a reason
 4. ``submit_request`` while exclusive           -> refused: unavailable_error "device in maintenance"
 5. ``reset``                                    -> granted; health check passes
 6. ``self_test``                                -> golden self-test passes
 7. ``inject_fault`` ccu_exception               -> armed (visible in device.faults)
 8. ``probe_request``                            -> fails with CCUException (typed)
 9. ``probe_request``                            -> succeeds (the fault fired once)
10. ``clear_device_memory``                      -> granted
11. ``probe_request``                            -> fails with DeviceNotReady (inference refused)
12. ``reload_model``                             -> granted; health check passes
13. ``leave_exclusive``                          -> granted; admission resumes
14. ``submit_request``                           -> finishes

Requests during the window (8, 9, 11) are maintenance-plane probe requests:
the engine refuses all requests while exclusive, so the window's test
requests run through the device on the scratch sequence (see
``sim_backend.planes.maintenance``). Every maintenance call is audited by the plane;
the drill also appends one ``drill:<action>`` record per step.

``sim_ms``: simulated device ms the step took on the board clock;
``wall_ms``: host wall ms. Exit code 0 iff every step behaved as described.
"""

from __future__ import annotations

import argparse
import getpass
import time
from collections.abc import Callable
from typing import Any, TypedDict

from sim_backend.planes import CalError, Lease, Report

from .common import (
    AnySystem,
    Subparsers,
    add_common_options,
    add_connect_options,
    build_from_args,
    connect_from_args,
    fail,
    print_json,
)

#: one step's outcome: (granted: True / False refused / None not a plane call, ok: behaved as described, detail)
Outcome = tuple[bool | None, bool, str]


class DrillStep(TypedDict):
    """One step of the drill as it is printed and returned (``--json``)."""

    step: int  #: 1-based
    action: str  #: the maintenance plane method (or "submit_request")
    granted: bool | None  #: None: the step raised before the plane answered
    ok: bool  #: behaved as described (a refusal that should happen is ok)
    detail: str
    sim_ms: float  #: simulated device ms the step took
    wall_ms: float  #: host wall ms the step took


def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("drill", help="run a scripted maintenance window and check every step",
                       description=__doc__.replace("``", "").split("\n\n")[0]
                       + " Prints each step; exit code 1 if any step did "
                         "not behave as described. sim_ms is simulated device time, wall_ms host time.")
    add_common_options(p, default_pacing="fast")
    add_connect_options(p)
    p.add_argument("--json", action="store_true", help="print the steps as JSON")
    p.add_argument("--drain-timeout", type=float, default=0.3, metavar="S",
                   help="bounded drain when entering exclusive mode, host wall seconds (default 0.3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.drain_timeout <= 60:
        return fail(f"--drain-timeout must be in [0, 60] s, got {args.drain_timeout}")
    system: AnySystem
    if args.connect:
        try:
            system = connect_from_args(args, admin=True)
        except (CalError, ValueError) as e:
            return fail(str(e))
        if getattr(system, "kind", None) == "llama-server":
            system.close()
            return fail(f"the drill rehearses a device maintenance window (exclusive mode, faults, reset, self-test); "
                        f"{args.connect} is a llama-server, which offers none of them (its own actions: slot erase "
                        "and save/restore, in the console's maintenance pane)")
        if not (system.props.get("device") or {}).get("numerics", True):
            system.close()
            return fail(f"the drill needs the numerics (its golden self-test compares logits); {args.connect} "
                        "serves a timing-only device")
    else:
        if args.timing_only:
            return fail("the drill needs the numerics (its golden self-test compares logits); drop --timing-only")
        try:
            system = build_from_args(args, maintenance=True, drain_timeout_s=args.drain_timeout)
        except (CalError, ValueError) as e:
            return fail(str(e))
    with system:
        steps = run_drill(system, drain_timeout_s=args.drain_timeout)
    ok = all(s["ok"] for s in steps)
    if args.json:
        print_json(steps)
    else:
        url = getattr(system, "url", None)
        where = f"{url} · " if url else "fresh in-process device · "
        assert system.maintenance is not None  # run_drill refused a system without one
        _print_table(steps, where + str(system.maintenance.audit.path), ok)
    return 0 if ok else 1


def _holder() -> str:
    try:
        return f"{getpass.getuser()}@drill"
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return "operator@drill"


def run_drill(system: Any, *, drain_timeout_s: float = 0.3, stream_max_tokens: int = 4000) -> list[DrillStep]:
    """Run the scripted window on ``system`` (needs a maintenance plane); returns the steps.

    Each step: {"step", "action", "granted", "ok", "detail", "sim_ms", "wall_ms"} where ``ok``
    means "behaved as described" (a refusal that should happen is ok). Never raises for a
    step's outcome; every wait is bounded.
    """
    from sim_backend.planes import (
        ChatRequest,
        DoneEvent,
        MaintenanceRefused,
        RequestError,
        TokenEvent,
    )

    m = system.maintenance
    if m is None:
        raise ValueError("the drill needs the maintenance plane (built without --observe-only)")
    steps: list[DrillStep] = []
    state: dict[str, Any] = {"lease": None, "stream": None}

    def step(action: str, fn: Callable[[], Outcome]) -> None:
        t0, s0 = time.perf_counter(), _sim_now_us(system)
        try:
            granted, ok, detail = fn()
        except CalError as e:
            granted, ok, detail = None, False, f"unexpected {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - a drill reports, it does not crash
            granted, ok, detail = None, False, f"internal error {type(e).__name__}: {e}"
        rec: DrillStep = {"step": len(steps) + 1, "action": action, "granted": granted, "ok": bool(ok),
                          "detail": detail, "sim_ms": round((_sim_now_us(system) - s0) / 1e3, 3),
                          "wall_ms": round((time.perf_counter() - t0) * 1e3, 3)}
        steps.append(rec)
        if not hasattr(m.audit, "event"):
            return  # over HTTP the server audits each maintenance call; drill steps are not sent
        try:
            m.audit.event(f"drill:{action}", {"step": rec["step"]}, granted=bool(granted), ok=rec["ok"],
                          result=detail, duration_ms=rec["wall_ms"], sim_ms=rec["sim_ms"])
        except OSError:
            pass  # the plane's own records already failed loudly if the log is unwritable

    def reset_without_lease() -> Outcome:
        try:
            m.reset(None)
        except MaintenanceRefused as e:
            return False, True, f"refused as expected: {e.reason}"
        return True, False, "reset was granted without a lease"

    def start_stream() -> Outcome:
        h = system.inference.submit(ChatRequest.from_prompt("Tell me a long story about the sea.",
                                                            max_tokens=stream_max_tokens))
        state["stream"] = h
        deadline = time.perf_counter() + 60.0
        while time.perf_counter() < deadline:
            ev = h.next_event(0.5)
            if isinstance(ev, TokenEvent):
                return True, True, (f"request {h.id} streaming (prompt {h.prompt_n} tokens, "
                                    f"max_tokens {stream_max_tokens})")
            if isinstance(ev, DoneEvent):
                return True, False, f"request {h.id} ended before exclusive mode: {ev.result.status}"
        return True, False, f"request {h.id}: no token within 60 s"

    def enter() -> Outcome:
        lease = m.enter_exclusive(_holder(), drain_timeout_s=drain_timeout_s)
        state["lease"] = lease
        h = state["stream"]
        drain = m.last_drain or {}
        if h is None:
            return True, False, "no streaming request to cancel"
        try:
            res = h.result(30.0)
        except TimeoutError:
            return True, False, f"request {h.id} did not end after the drain"
        reason = (res.error or {}).get("message", "")
        ok = res.status == "cancelled" and "maintenance" in reason
        return True, ok, (f"lease to {lease.holder}; drain {drain.get('wall_ms', 0):.0f} wall ms / "
                          f"{drain.get('sim_ms', 0):.1f} sim ms; request {h.id} {res.status} after "
                          f"{res.timings.predicted_n} tokens: {reason}")

    def submit_refused() -> Outcome:
        try:
            h = system.inference.submit(ChatRequest.from_prompt("hi", max_tokens=4))
        except RequestError as e:
            ok = e.error_type == "unavailable_error" and "maintenance" in str(e)
            return False, ok, f"refused: {e.error_type}: {e}"
        h.cancel("drill: should have been refused")
        return True, False, "request admitted during exclusive mode"

    def lease_call(fn: Callable[[Lease | None], Report], check: Callable[[Report], tuple[bool, str]]
                   ) -> Callable[[], Outcome]:
        def go() -> Outcome:
            try:
                r = fn(state["lease"])
            except MaintenanceRefused as e:
                return False, False, f"refused: {e.reason}"
            ok, detail = check(r)
            return True, ok, detail
        return go

    def health_detail(r: Report) -> tuple[bool, str]:
        h = r.get("health", {})
        return bool(r.get("ok")), f"health {h.get('detail')} ({h.get('sim_us', 0) / 1e3:.1f} sim ms probe job)"

    def probe_expect(error_type: str | None
                     ) -> tuple[Callable[[Lease | None], Report], Callable[[Report], tuple[bool, str]]]:
        def check(r: Report) -> tuple[bool, str]:
            if error_type is None:
                return r["status"] == "finished", (f"finished: {r['n_tokens']} tokens in {r['sim_ms']:.1f} sim ms"
                                                   if r["status"] == "finished" else f"failed: {r['error']}")
            err = r.get("error") or {}
            return (r["status"] == "failed" and err.get("type") == error_type,
                    f"{r['status']}: {err.get('type')}: {err.get('message')}" if err
                    else "finished (expected a failure)")
        return lambda L: m.probe_request(L, "hi", max_tokens=4), check

    def final_request() -> Outcome:
        try:
            res = system.inference.generate(ChatRequest.from_prompt("hi again", max_tokens=8), timeout=120.0)
        except RequestError as e:
            return False, False, f"refused: {e.error_type}: {e}"
        return True, res.status == "finished", (f"{res.status}: {res.timings.predicted_n} tokens, "
                                                f"E2E {res.timings.e2e_ms:.1f} sim ms")

    step("reset", reset_without_lease)
    step("submit_request", start_stream)
    step("enter_exclusive", enter)
    step("submit_request", submit_refused)
    step("reset", lease_call(m.reset, health_detail))
    # a self-test that cannot run on this device (timing-only) is not a failed step: it says why
    step("self_test", lease_call(m.self_test, lambda r: (bool(r["ok"]) or r.get("ran") is False, r.get("detail", ""))))
    step("inject_fault", lease_call(lambda L: m.inject_fault(L, "ccu_exception"),
                                    lambda r: ("ccu_exception x1" in r["armed"], f"armed: {', '.join(r['armed'])}")))
    step("probe_request", lease_call(*probe_expect("CCUException")))
    step("probe_request", lease_call(*probe_expect(None)))
    step("clear_device_memory", lease_call(m.clear_device_memory,
                                           lambda r: (bool(r["ok"]), f"{r['inference']}; next: {r['next']}")))
    step("probe_request", lease_call(*probe_expect("DeviceNotReady")))
    step("reload_model", lease_call(m.reload_model, health_detail))
    step("leave_exclusive", lease_call(m.leave_exclusive, lambda r: (bool(r["ok"]), "requests admitted again")))
    if steps[-1]["ok"]:
        state["lease"] = None
    step("submit_request", final_request)
    # never leave the device exclusive behind a failed drill
    if state["lease"] is not None and m.lease is not None:
        try:
            m.leave_exclusive(state["lease"], force=True)
        except CalError:
            pass
    h = state["stream"]
    if h is not None and not h.done:
        h.cancel("drill finished")
    return steps


def _print_table(steps: list[DrillStep], audit_path: str, ok: bool) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    t = Table(title="maintenance drill (sim ms = simulated device time; wall ms = host time)", title_justify="left",
              expand=True)
    t.add_column("#", justify="right")
    t.add_column("action", no_wrap=True)
    t.add_column("granted", no_wrap=True)
    t.add_column("ok", no_wrap=True)
    t.add_column("detail", overflow="fold", ratio=1)
    t.add_column("sim ms", justify="right", no_wrap=True)
    t.add_column("wall ms", justify="right", no_wrap=True)
    for s in steps:
        g = {True: "granted", False: "refused", None: "-"}[s["granted"]]
        t.add_row(str(s["step"]), s["action"], g, Text("ok" if s["ok"] else "NOT AS EXPECTED",
                                                      style="green" if s["ok"] else "bold red"),
                  Text(s["detail"]), f"{s['sim_ms']:.1f}", f"{s['wall_ms']:.1f}")
    c = Console()
    c.print(t)
    c.print(f"audit log: {audit_path}")
    c.print(Text("drill passed" if ok else "drill FAILED: see the steps marked NOT AS EXPECTED",
                 style="bold green" if ok else "bold red"))


def _sim_now_us(system: Any) -> float:
    """The device's simulated clock (µs), read through the observation plane."""
    return float(system.observation.snapshot().sim_now_ms) * 1e3
