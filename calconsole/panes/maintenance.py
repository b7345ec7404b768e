"""Maintenance pane (guarded): exclusive mode, reset, memory clear, self-test, faults, registers.

Every action goes through the maintenance plane (which audits it) on a
worker thread; results come back to the UI thread with ``call_from_thread``.
Outside exclusive mode every action except "Enter exclusive" is disabled:
the buttons are disabled, the keys are disabled (``check_action``) and the
action methods themselves return without calling the plane when there is
no lease. Reset and Clear device memory open a ``ConfirmModal`` where the
operator types the device name; Cancel is focused by default.

Keys (focus inside the pane; F3 focuses it): x enter exclusive, l leave,
r reset, c clear device memory, o reload the model, t self-test, p probe
request, f inject a CCU exception, a acknowledge the faults that fired.

Acknowledge is the one action besides "Enter exclusive" that needs no lease
(it changes nothing on the device): a fault that fired keeps the device
status at ``fault`` until someone acknowledges it (audited) or resets.
"""

from __future__ import annotations

import getpass
import json

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Input, RichLog, Static

from sim_backend.planes import CalError

from ..widgets.confirm import ConfirmModal
from ..widgets.render import set_subtitle, status_text
from ..widgets.wraplog import WrapLog

#: buttons enabled only while this pane holds the lease
GUARDED = ("#m-leave", "#m-reset", "#m-clear", "#m-reload", "#m-selftest", "#m-health", "#m-probe", "#m-clearkv",
           "#m-dump", "#m-f-ccu", "#m-f-kv", "#m-f-link", "#m-f-slow", "#m-f-clear", "#m-reg-read", "#m-reg-write",
           "#m-reg-all")
#: key actions that need the lease
GUARDED_ACTIONS = {"leave", "reset", "clear", "reload", "self_test", "probe", "fault_ccu"}
#: button id -> (label, short label): the short one when the long does not fit the button (a narrow pane);
#: memory and KV clears stay told apart at any width ("Clr m…" / "Clr KV" at 6 cells)
LABELS = {"m-enter": ("Exclusive", "Excl."), "m-leave": ("Leave", "Leave"), "m-reset": ("Reset…", "Reset…"),
          "m-clear": ("Clear mem…", "Clr mem…"), "m-reload": ("Reload", "Reload"),
          "m-selftest": ("Self-test", "Test"), "m-health": ("Health", "Health"), "m-probe": ("Probe", "Probe"),
          "m-clearkv": ("Clear KV", "Clr KV"), "m-dump": ("Dump", "Dump"),
          "m-f-ccu": ("CCU fault", "CCU"), "m-f-kv": ("KV fault", "KV"), "m-f-link": ("D2D fault", "D2D"),
          "m-f-slow": ("Slow chip", "Slow"), "m-f-clear": ("No faults", "No flt"), "m-ack": ("Ack", "Ack"),
          "m-reg-read": ("Read", "Read"), "m-reg-write": ("Write", "Write"), "m-reg-all": ("All", "All")}
#: the hint a guarded key gives outside exclusive mode
NEED_EXCLUSIVE = "enter exclusive mode first (x)"
FAULT_BUTTONS = {"m-f-ccu": ("ccu_exception", {}), "m-f-kv": ("kv_exhaustion", {}),
                 "m-f-link": ("link_error", {}), "m-f-slow": ("slow_chip", {"chip": 1, "factor": 4.0})}


class MaintenancePane(Vertical):
    """Buttons for the maintenance plane; a log of every outcome."""

    # styles: calconsole/styles.tcss (.m-row grids, #m-mode, #m-log): one home for them

    BINDINGS = [
        Binding("x", "enter", "exclusive"),
        Binding("l", "leave", "leave excl."),
        Binding("r", "reset", "reset"),
        Binding("c", "clear", "clear mem"),
        Binding("o", "reload", "reload model"),
        Binding("t", "self_test", "self-test"),
        Binding("p", "probe", "probe"),
        Binding("f", "fault_ccu", "CCU fault"),
        Binding("a", "acknowledge", "ack faults"),
    ]

    def __init__(self, maintenance, device_name: str, **kw) -> None:
        super().__init__(**kw)
        self._mode_line = ""
        self.maintenance = maintenance
        self.device_name = device_name
        self.lease = None
        self._entering = False
        self._fired: list = []  # unacknowledged fired faults of the last snapshot
        try:
            self.holder = f"{getpass.getuser()}@console"
        except Exception:  # noqa: BLE001 - no passwd entry in some containers
            self.holder = "operator@console"

    def compose(self) -> ComposeResult:
        yield Static(id="m-mode")
        with Horizontal(classes="m-row"):
            yield Button("Exclusive", id="m-enter", tooltip="enter exclusive mode (drains the device first)",
                         variant="warning", compact=True)
            yield Button("Leave", id="m-leave", disabled=True,
                         tooltip="leave exclusive mode; requests admitted again", compact=True)
            yield Button("Reset…", id="m-reset", variant="error", disabled=True, compact=True)
            yield Button("Clear mem…", id="m-clear", variant="error", disabled=True, compact=True)
            yield Button("Reload", id="m-reload", disabled=True, compact=True)
        with Horizontal(classes="m-row"):
            yield Button("Self-test", id="m-selftest", disabled=True, compact=True)
            yield Button("Health", id="m-health", disabled=True, compact=True)
            yield Button("Probe", id="m-probe", disabled=True, compact=True)
            yield Button("Clear KV", id="m-clearkv", disabled=True, compact=True)
            yield Button("Dump", id="m-dump", disabled=True, compact=True)
        with Horizontal(classes="m-row", id="m-row-faults"):
            yield Button("CCU fault", id="m-f-ccu", disabled=True, compact=True,
                         tooltip="inject: CCU exception on the next job")
            yield Button("KV fault", id="m-f-kv", disabled=True, compact=True,
                         tooltip="inject: the next KV apply fails (KVExhausted)")
            yield Button("D2D fault", id="m-f-link", disabled=True, compact=True,
                         tooltip="inject: D2D link error on the next job")
            yield Button("Slow chip", id="m-f-slow", disabled=True, compact=True,
                         tooltip="inject: chip1 runs 4x slower")
            yield Button("No faults", id="m-f-clear", disabled=True, compact=True,
                         tooltip="disarm every injected fault")
            yield Button("Ack", id="m-ack", disabled=True, compact=True,
                         tooltip="acknowledge the faults that fired (status back from 'fault'); no lease needed")
        with Horizontal(classes="m-row", id="m-row-reg"):
            yield Input(placeholder="register / 0xADDR", id="m-reg", compact=True)
            yield Input(placeholder="value", id="m-reg-value", compact=True)
            yield Button("Read", id="m-reg-read", disabled=True, compact=True)
            yield Button("Write", id="m-reg-write", disabled=True, compact=True)
            yield Button("All", id="m-reg-all", disabled=True, compact=True)
        yield WrapLog(id="m-log", max_lines=500, min_width=20)  # re-wraps on resize (see chat pane)

    def on_mount(self) -> None:
        self._guarded_keys = {b.key for b in self.BINDINGS
                              if isinstance(b, Binding) and b.action in GUARDED_ACTIONS}
        self._sync_buttons()
        self._log(f"audit log: {self.maintenance.audit.path}", "dim")

    def _sync_buttons(self) -> None:
        had_focus = self.app.focused is not None and self in self.app.focused.ancestors_with_self
        held = self.lease is not None
        self.query_one("#m-enter", Button).disabled = held or self._entering
        self.query_one("#m-ack", Button).disabled = not self._fired
        for sel in GUARDED:
            self.query_one(sel, Button).disabled = not held
        # a disabled button loses focus: keep it in this pane so its keys keep working
        if had_focus and (self.app.focused is None or self not in self.app.focused.ancestors_with_self
                          or self.app.focused.disabled):
            enabled = [w for w in self.query("Button") if not w.disabled]
            (enabled[0] if enabled else self.query_one("#m-log")).focus()
        self.refresh_bindings()

    def on_resize(self) -> None:
        self.call_after_refresh(self._fit_labels)  # the buttons have their new widths after layout

    def _fit_labels(self) -> None:
        """The long labels in a row where they all fit, else the short ones (a short one that still
        does not fit is cut with …): one row reads alike."""
        for row in self.query(".m-row"):
            buttons = [b for b in row.query(Button) if (b.id or "") in LABELS]
            if not buttons or not all(b.size.width for b in buttons):
                continue
            fits = all(len(LABELS[b.id or ""][0]) <= b.size.width for b in buttons)
            for b in buttons:
                label = LABELS[b.id or ""][0 if fits else 1]
                if str(b.label) != label:
                    b.label = label

    def on_key(self, event: events.Key) -> None:
        """A maintenance key outside exclusive mode says why nothing happens (the footer shows it
        disabled: check_action), instead of silence. Typing into the register inputs never gets here."""
        if self.lease is None and event.key in self._guarded_keys:
            event.stop()
            event.prevent_default()
            self.notify(NEED_EXCLUSIVE, severity="warning", timeout=4)
            self._log(f"key {event.key}: {NEED_EXCLUSIVE}", "yellow")

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Maintenance keys do nothing outside exclusive mode (shown disabled in the footer)."""
        if action in GUARDED_ACTIONS and self.lease is None:
            return None
        if action == "enter" and (self.lease is not None or self._entering):
            return None
        if action == "acknowledge" and not self._fired:
            return None
        return True

    def _log(self, text: str, style: str = "") -> None:
        self.query_one("#m-log", RichLog).write(Text(text, style=style))

    def update_snapshot(self, snap: dict) -> None:
        d = snap["device"]
        mode = d["mode"] + (f" (lease: {d['lease_holder']})" if d.get("lease_holder") else "")
        set_subtitle(self, mode)
        style = {"serving": "green", "draining": "yellow", "exclusive": "bold red"}.get(d["mode"], "")
        line = Text.assemble("mode ", (mode, style), " · device ", status_text(d, compact=True))
        if line.plain != self._mode_line:  # unchanged: no redraw, no relayout
            self._mode_line = line.plain
            self.query_one("#m-mode", Static).update(line)
        fired = list(d.get("faults_fired") or ())
        if fired != self._fired:
            self._fired = fired
            self._sync_buttons()

    def _need_lease(self, what: str) -> bool:
        if self.lease is None:
            self._log(f"{what}: needs exclusive mode: {NEED_EXCLUSIVE}", "yellow")
            return False
        return True

    # --- key actions (the buttons call the same methods) ------------------------------------------

    def action_enter(self) -> None:
        if self.lease is not None or self._entering:
            return
        self._entering = True
        timeout = self.maintenance.drain_timeout_s
        self._log(f"entering exclusive mode: admission stopped, draining in-flight requests (up to {timeout:g} s)…",
                  "yellow")
        self.border_subtitle = f"draining (lease: {self.holder})"
        self._sync_buttons()
        self._run("enter_exclusive", lambda: self.maintenance.enter_exclusive(self.holder))

    def action_leave(self) -> None:
        if not self._need_lease("leave exclusive"):
            return
        self._run("leave_exclusive", lambda: self.maintenance.leave_exclusive(self.lease))

    def action_reset(self) -> None:
        if not self._need_lease("reset"):
            return
        self.app.push_screen(
            ConfirmModal("Reset device", "Fails every in-flight job with DeviceReset, returns the chiplets to power-on "
                         "state, clears KV, reconfigures the calbin, then runs a health check.", self.device_name),
            lambda ok: self._confirmed(ok, "reset", lambda: self.maintenance.reset(self.lease)))

    def action_clear(self) -> None:
        if not self._need_lease("clear device memory"):
            return
        self.app.push_screen(
            ConfirmModal("Clear device memory", "ClearAllDevMem zeroes DRAM and SRAM (weights and KV); inference is "
                         "refused until the model is reloaded.", self.device_name),
            lambda ok: self._confirmed(ok, "clear_device_memory",
                                       lambda: self.maintenance.clear_device_memory(self.lease)))

    def action_self_test(self) -> None:
        if self._need_lease("self-test"):
            self._run("self_test", lambda: self.maintenance.self_test(self.lease))

    def action_probe(self) -> None:
        if self._need_lease("probe request"):
            self._run("probe_request", lambda: self.maintenance.probe_request(self.lease, "hi", max_tokens=4))

    def action_acknowledge(self) -> None:
        if self._fired:
            self._run("acknowledge_faults", lambda: self.maintenance.acknowledge_faults(self.holder))

    @on(Button.Pressed, "#m-ack")
    def _b_ack(self) -> None:
        self.action_acknowledge()

    def action_fault_ccu(self) -> None:
        if self._need_lease("inject fault"):
            self._run("inject_fault", lambda: self.maintenance.inject_fault(self.lease, "ccu_exception"))

    def _confirmed(self, ok: bool | None, action: str, fn) -> None:
        if ok is None:
            self._log(f"{action}: cancelled at the confirmation: the typed name does not match the device "
                      f"name {self.device_name!r}", "yellow")
            return
        if not ok:
            self._log(f"{action}: cancelled at the confirmation", "dim")
            return
        if self._need_lease(action):
            self._run(action, fn)

    # --- buttons ---------------------------------------------------------------------

    @on(Button.Pressed, "#m-enter")
    def _b_enter(self) -> None:
        self.action_enter()

    @on(Button.Pressed, "#m-leave")
    def _b_leave(self) -> None:
        self.action_leave()

    @on(Button.Pressed, "#m-reset")
    def _b_reset(self) -> None:
        self.action_reset()

    @on(Button.Pressed, "#m-clear")
    def _b_clear(self) -> None:
        self.action_clear()

    def action_reload(self) -> None:
        if self._need_lease("reload model"):
            self._run("reload_model", lambda: self.maintenance.reload_model(self.lease))

    @on(Button.Pressed, "#m-reload")
    def _b_reload(self) -> None:
        self.action_reload()

    @on(Button.Pressed, "#m-selftest")
    def _b_selftest(self) -> None:
        self.action_self_test()

    @on(Button.Pressed, "#m-health")
    def _b_health(self) -> None:
        if self._need_lease("health check"):
            self._run("health_check", lambda: self.maintenance.health_check(self.lease))

    @on(Button.Pressed, "#m-probe")
    def _b_probe(self) -> None:
        self.action_probe()

    @on(Button.Pressed, "#m-clearkv")
    def _b_clearkv(self) -> None:
        if self._need_lease("clear KV"):
            self._run("clear_kv", lambda: self.maintenance.clear_kv(self.lease))

    @on(Button.Pressed, "#m-dump")
    def _b_dump(self) -> None:
        if self._need_lease("dump"):
            self._run("dump", lambda: self.maintenance.dump(self.lease))

    @on(Button.Pressed, "#m-f-ccu, #m-f-kv, #m-f-link, #m-f-slow")
    def _b_fault(self, event: Button.Pressed) -> None:
        if not self._need_lease("inject fault"):
            return
        bid = event.button.id
        assert bid is not None  # the handler's selector matches buttons by id
        kind, kw = FAULT_BUTTONS[bid]
        self._run("inject_fault", lambda: self.maintenance.inject_fault(self.lease, kind, **kw))

    @on(Button.Pressed, "#m-f-clear")
    def _b_fault_clear(self) -> None:
        if self._need_lease("clear faults"):
            self._run("clear_faults", lambda: self.maintenance.clear_faults(self.lease))

    @on(Button.Pressed, "#m-reg-read")
    def _b_reg_read(self) -> None:
        if self._need_lease("read register"):
            key = self.query_one("#m-reg", Input).value.strip()
            self._run("read_register", lambda: self.maintenance.read_register(self.lease, key))

    @on(Button.Pressed, "#m-reg-write")
    def _b_reg_write(self) -> None:
        if self._need_lease("write register"):
            key = self.query_one("#m-reg", Input).value.strip()
            value = self.query_one("#m-reg-value", Input).value.strip()
            self._run("write_register", lambda: self.maintenance.write_register(self.lease, key, value))

    @on(Button.Pressed, "#m-reg-all")
    def _b_reg_all(self) -> None:
        if self._need_lease("read registers"):
            self._run("dump_registers", lambda: self.maintenance.dump_registers(self.lease))

    # --- worker ------------------------------------------------------------------------

    def _run(self, action: str, fn) -> None:
        self._worker(action, fn)

    @work(thread=True, group="maintenance", exclusive=False, exit_on_error=False)
    def _worker(self, action: str, fn) -> None:
        try:
            result = fn()
        except CalError as e:
            self.app.call_from_thread(self._done, action, False, f"{type(e).__name__}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - audited by the plane; shown, never a crash of the console
            self.app.call_from_thread(self._done, action, False, f"internal error: {type(e).__name__}: {e}")
            return
        self.app.call_from_thread(self._done, action, True, result)

    def _done(self, action: str, ok: bool, result) -> None:
        if action == "enter_exclusive":
            self._entering = False
            if ok:
                self.lease = result
                d = self.maintenance.last_drain or {}
                self._log(f"exclusive mode granted to {result.holder}; drain: {d.get('drained', 0)} finished, "
                          f"{d.get('cancelled', 0)} cancelled in {d.get('wall_ms', 0):.0f} wall ms "
                          f"({d.get('sim_ms', 0):.1f} sim ms)", "bold red")
            else:
                self._log(f"enter_exclusive: {result}", "bold red")
        elif action == "leave_exclusive" and ok:
            self.lease = None
            self._log("left exclusive mode; requests admitted again"
                      + (f" (faults still armed: {', '.join(result['faults_armed'])})"
                         if result.get("faults_armed") else ""),
                      "green")
        elif not ok:
            self._log(f"{action}: refused/failed: {result}", "bold red")
        else:
            good = not (isinstance(result, dict) and result.get("ok") is False)
            self._log(f"{action}: {'ok' if good else 'FAILED'} · {summarize_result(action, result)}",
                      "green" if good else "bold red")
            if action == "clear_device_memory" and good:
                self._log("inference is refused until the model is reloaded: press Reload (key o)", "yellow")
        self._sync_buttons()
        if action == "clear_device_memory" and ok:
            self.query_one("#m-reload", Button).focus()


def summarize_result(action: str, r) -> str:
    """One log line for an action's result dict (units: sim = simulated device, wall = host)."""
    if not isinstance(r, dict):
        return str(r)
    if action in ("reset", "reload_model", "health_check"):
        h = r.get("health", r)
        extra = f"failed jobs {r['failed_jobs']}, calbin {r['calbin']}, resets {r['resets']}; " if "calbin" in r else ""
        return (f"{extra}health {'ok' if h.get('ok') else 'FAILED'}: {h.get('detail')} "
                f"({h.get('sim_us', 0) / 1e3:.1f} sim ms, {h.get('wall_ms', 0):.0f} wall ms)")
    if action == "self_test":
        if r.get("top1_match") is None:  # nothing was compared (no inference ran, or no logits)
            return str(r.get("detail"))
        return (f"{r.get('detail')} · top-1 {'match' if r.get('top1_match') else 'differs'} · "
                f"{r.get('sim_ms', 0):.1f} sim ms")
    if action == "acknowledge_faults":
        acked = r.get("acknowledged", [])
        return ("acknowledged: " + "; ".join(f"{a['fault']} ({a['detail']})" for a in acked)) if acked \
            else "nothing to acknowledge"
    if action == "probe_request":
        if r.get("status") == "finished":
            return f"request finished: {r['n_tokens']} tokens in {r['sim_ms']:.1f} sim ms"
        e = r.get("error") or {}
        return f"request failed: {e.get('type')}: {e.get('message')}"
    if action in ("inject_fault", "clear_faults"):
        return f"armed: {', '.join(r.get('armed', [])) or 'none'}" if "armed" in r else \
            f"disarmed: {', '.join(r.get('disarmed', [])) or 'none'}"
    if action == "read_register":
        return f"{r['name']} ({r['address']}) = {r['value']} ({r['hex']}){' writable' if r['writable'] else ''}"
    if action == "write_register":
        return f"{r['name']}: {r['old']} -> {r['new']}"
    if action == "dump_registers":
        return " ".join(f"{k}={v:#x}" for k, v in r["registers"].items())
    if action == "dump":
        return f"wrote {r['path']} ({r['bytes']} bytes, {r['steps']} steps)"
    if action == "clear_kv":
        return f"freed {r['freed_tokens']} KV tokens"
    if action == "clear_device_memory":
        return "DRAM and SRAM zeroed; inference refused until the model is reloaded (Reload, key o)"
    return json.dumps(r, default=str)
