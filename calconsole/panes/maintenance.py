"""Maintenance pane (guarded): exclusive mode, reset, memory clear, self-test, faults, registers.

Every action goes through the maintenance plane (which audits it) on a
worker thread; results come back to the UI thread with ``call_from_thread``.
Every action (key, button or palette) asks first: reset and clear memory for the typed device name
(``ConfirmModal``), every other one a yes / no question naming it (``AskModal``, Cancel focused); outside
exclusive mode every action except "Enter exclusive" is disabled:
the buttons are disabled, the keys are disabled (``check_action``) and the
action methods themselves return without calling the plane when there is
no lease. A cancelled question runs nothing and writes no audit line (the pane's log says
"cancelled at the confirmation").

Keys (focus inside the pane; F3 focuses it): x enter exclusive (asks first), l leave, L leave with force
(asks first; after a memory clear a plain leave is refused until the model is reloaded),
r reset, c clear device memory, o reload the model, t self-test, h health
check, p probe request, k clear KV, d dump, 1 (or f) / 2 / 3 / 4 inject a
CCU exception / KV exhaustion / D2D link error / slow chip, 0 disarm every
fault, i the register field (Enter reads, Enter in the value field writes),
v read the register, w write it, e read every register, a acknowledge the
faults that fired. Every key is on a button label too ("x Excl").

Acknowledge is the one action besides "Enter exclusive" that needs no lease
(it changes nothing on the device): a fault that fired keeps the device
status at ``fault`` until someone acknowledges it (audited) or resets.
"""

from __future__ import annotations

import getpass
from collections.abc import Callable
from typing import Any, TypedDict

from rich.text import Text
from textual import events, on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, Input, RichLog, Static

from sim_backend.planes import CalError, Snapshot
from sim_backend.planes.snapshot import FaultEvent

from ..widgets.confirm import AskModal, ConfirmModal
from ..widgets.inputs import HelpKeyInput
from ..widgets.render import set_subtitle, status_text
from ..widgets.wraplog import WrapLog
from .focus import HELP_BINDING
from .maintenance_planes import (
    DrainingMaintenancePlane,
    LeaselessMaintenancePlane,
    PaneMaintenancePlane,
    is_leaseless,
)
from .maintenance_text import audit_line, slot_filename_problem, summarize_result

#: buttons enabled only while this pane holds the lease
GUARDED = ("#m-leave", "#m-reset", "#m-clear", "#m-reload", "#m-selftest", "#m-health", "#m-probe", "#m-clearkv",
           "#m-dump", "#m-f-ccu", "#m-f-kv", "#m-f-link", "#m-f-slow", "#m-f-clear", "#m-reg-read", "#m-reg-write",
           "#m-reg-all")
#: key actions that need the lease
GUARDED_ACTIONS = {"leave", "leave_force", "reset", "clear", "reload", "self_test", "health", "probe", "clear_kv",
                   "dump", "fault_ccu", "fault_kv", "fault_link", "fault_slow", "clear_faults", "read_register",
                   "write_register", "dump_registers"}
#: button id -> (label, short label), each led by its key: the short one when the long does not fit
#: the button (a narrow pane); memory and KV clears stay told apart at any width ("c Mem…" / "k KV")
LABELS = {"m-enter": ("x Exclusive", "x Excl"), "m-leave": ("l Leave", "l Lv"), "m-reset": ("r Reset…", "r Rst…"),
          "m-clear": ("c Clear mem…", "c Mem…"), "m-reload": ("o Reload", "o Rld"),
          "m-selftest": ("t Self-test", "t Test"), "m-health": ("h Health", "h Hlth"), "m-probe": ("p Probe", "p Prb"),
          "m-clearkv": ("k Clear KV", "k KV"), "m-dump": ("d Dump", "d Dmp"),
          "m-f-ccu": ("1 CCU fault", "1 CCU"), "m-f-kv": ("2 KV fault", "2 KV"), "m-f-link": ("3 D2D fault", "3 D2D"),
          "m-f-slow": ("4 Slow chip", "4 Slw"), "m-f-clear": ("0 No faults", "0 Off"), "m-ack": ("a Ack", "a Ack"),
          "m-reg-read": ("v Read", "v Rd"), "m-reg-write": ("w Write", "w Wr"), "m-reg-all": ("e All", "e All")}
#: the palette's maintenance commands: (title, key, action)
PALETTE = (("enter exclusive mode…", "x", "enter"), ("leave exclusive mode", "l", "leave"),
           ("leave exclusive mode with force…", "L", "leave_force"),
           ("reset device…", "r", "reset"), ("clear device memory…", "c", "clear"), ("reload model", "o", "reload"),
           ("self-test (golden logits)", "t", "self_test"), ("health check", "h", "health"),
           ("probe request", "p", "probe"), ("clear KV cache", "k", "clear_kv"), ("dump trace + config", "d", "dump"),
           ("inject fault: CCU exception", "1", "fault_ccu"), ("inject fault: KV exhaustion", "2", "fault_kv"),
           ("inject fault: D2D link error", "3", "fault_link"), ("inject fault: slow chip1 x4", "4", "fault_slow"),
           ("disarm every fault", "0", "clear_faults"), ("read register (typed in the field)", "v", "read_register"),
           ("write register (field and value)", "w", "write_register"), ("read every register", "e", "dump_registers"),
           ("acknowledge fired faults", "a", "acknowledge"))
#: button -> the plane method it calls (a server without a lease, e.g. a llama-server, offers some only)
BUTTON_METHOD = {"m-enter": "enter_exclusive", "m-leave": "leave_exclusive", "m-reset": "reset",
                 "m-clear": "clear_device_memory", "m-reload": "reload_model", "m-selftest": "self_test",
                 "m-health": "health_check", "m-probe": "probe_request", "m-clearkv": "clear_kv", "m-dump": "dump",
                 "m-f-ccu": "inject_fault", "m-f-kv": "inject_fault", "m-f-link": "inject_fault",
                 "m-f-slow": "inject_fault", "m-f-clear": "clear_faults", "m-ack": "acknowledge_faults",
                 "m-reg-read": "read_register", "m-reg-write": "write_register", "m-reg-all": "dump_registers"}
#: key action -> the plane method it calls: a leaseless server's footer, help and palette list the keys of what
#: it offers only (the others still answer, refused by the plane with the reason: ``on_key``)
ACTION_METHOD = {"enter": "enter_exclusive", "leave": "leave_exclusive", "leave_force": "leave_exclusive",
                 "reset": "reset", "clear": "clear_device_memory", "reload": "reload_model", "self_test": "self_test",
                 "health": "health_check", "probe": "probe_request", "clear_kv": "clear_kv", "dump": "dump",
                 "fault_ccu": "inject_fault", "fault_kv": "inject_fault", "fault_link": "inject_fault",
                 "fault_slow": "inject_fault", "clear_faults": "clear_faults", "focus_register": "read_register",
                 "read_register": "read_register", "write_register": "write_register",
                 "dump_registers": "dump_registers", "acknowledge": "acknowledge_faults"}
#: a leaseless server's slot actions (the slot row's buttons; no key)
SLOT_METHODS = ("save_slot", "restore_slot", "erase_slot")
#: the help's note on a leaseless server (a llama-server): no exclusive mode, its own actions only
HELP_LEASELESS = ("{kind} has no exclusive mode: its actions run without a lease, each asked first (y confirms, "
                  "Enter, n or Esc cancels) and audited. Only the keys of what it offers are listed; another "
                  "maintenance key is refused by it, audited, with the reason.")
#: the hint a guarded key gives outside exclusive mode
NEED_EXCLUSIVE = "enter exclusive mode first (x)"
#: the yes / no question each action asks first (AskModal): plane action -> (button label, question, what it does);
#: the fault keys by their pane action (one plane action, inject_fault, for four questions)
ASK = {
    "save_slot": ("Save", "Save the slot's KV cache to this file?",
                  "llama-server writes the slot's prompt cache into its --slot-save-path under this name."),
    "restore_slot": ("Restore", "Restore the slot's KV cache from this file?",
                     "llama-server replaces the slot's prompt cache with the file's (from its --slot-save-path)."),
    "erase_slot": ("Erase", "Erase this slot's KV cache?",
                   "llama-server drops the slot's cached prompt: its next request prefills from scratch."),
    "leave_exclusive": ("Leave", "Leave exclusive mode and admit requests again?",
                        "Releases the lease: the device serves requests again; maintenance actions need x first."),
    "reload_model": ("Reload", "Reload the model onto the device?",
                     "Reconfigures the calbin and loads the weights again (the way back after a memory clear), "
                     "then runs a health check."),
    "self_test": ("Self-test", "Run the golden self-test on the device?",
                  "Runs the bundle's golden prompt on the device and compares its logits with the golden ones."),
    "health_check": ("Health", "Run a health check on the device?",
                     "Checks the status registers, job accounting and buffer pool, runs one decode probe job, "
                     "and logs the result."),
    "probe_request": ("Probe", "Send a probe request to the device?",
                      "Generates 4 tokens from the prompt 'hi' on the device and logs how long it took."),
    "clear_kv": ("Clear KV", "Clear the KV cache on the device?",
                 "Frees every cached KV token: the next requests compute their prompts again."),
    "dump": ("Dump", "Dump the trace and config to a file?",
             "Writes the device's step trace and configuration to a file; the log names it."),
    "fault_ccu": ("CCU fault", "Inject a CCU exception fault on the device?",
                  "The next job on the device fails with a CCU exception (0 disarms it)."),
    "fault_kv": ("KV fault", "Inject a KV exhaustion fault on the device?",
                 "The next KV apply fails with KVExhausted (0 disarms it)."),
    "fault_link": ("D2D fault", "Inject a D2D link error fault on the device?",
                   "The next job on the device fails with a D2D link error (0 disarms it)."),
    "fault_slow": ("Slow chip", "Inject a slow-chip fault on the device?",
                   "chip1 runs 4 times slower until the fault is disarmed (0)."),
    "clear_faults": ("No faults", "Disarm every injected fault?", "Every armed fault that has not fired is removed."),
    "read_register": ("Read", "Read the register on the device?", "Reads the register typed in the field."),
    "write_register": ("Write", "Write the register on the device?",
                       "Writes the value field into the register field's register."),
    "dump_registers": ("All registers", "Read every register on the device?", "Reads and logs every register."),
    "acknowledge_faults": ("Acknowledge", "Acknowledge the faults that fired?",
                           "The device status goes back from 'fault'; the faults stay in the audit log."),
}
#: the questions of a leaseless server (a llama-server) where its action differs from the device's (``ASK``);
#: ``{kind}``: the server's kind
ASK_LEASELESS = {
    "health_check": ("Health", "Ask {kind} for its health?",
                     "GET /health: ok, loading (HTTP 503) or an error; the log shows the answer and its wall time."),
    "clear_kv": ("Clear KV", "Clear the KV cache of every slot of {kind}?",
                 "Erases each slot's cached prompt (POST /slots/N?action=erase): the next requests prefill their "
                 "prompts from scratch."),
}
class FaultArgs(TypedDict, total=False):
    """``inject_fault``'s keyword arguments a fault key passes (slow_chip only)."""

    chip: int
    factor: float


FAULTS: dict[str, tuple[str, FaultArgs]] = {
    "fault_ccu": ("ccu_exception", {}), "fault_kv": ("kv_exhaustion", {}),
    "fault_link": ("link_error", {}), "fault_slow": ("slow_chip", {"chip": 1, "factor": 4.0})}

#: a maintenance action as the pane runs it: the plane call, returning a Lease, a Report or nothing
Action = Callable[[], object]


class MaintenancePane(Vertical):
    """Buttons for the maintenance plane; a log of every outcome."""

    # styles: calconsole/styles.tcss (.m-row grids, #m-mode, #m-log): one home for them

    BINDINGS = [
        HELP_BINDING,
        Binding("x", "enter", "exclusive"),
        Binding("l", "leave", "leave excl."),
        # after a memory clear a plain leave is refused until the model is reloaded; this one asks, then forces
        Binding("L", "leave_force", "leave (force)", show=False),
        Binding("r", "reset", "reset"),
        Binding("c", "clear", "clear mem"),
        Binding("o", "reload", "reload model"),
        Binding("t", "self_test", "self-test"),
        Binding("h", "health", "health"),
        Binding("p", "probe", "probe"),
        Binding("k", "clear_kv", "clear KV"),
        Binding("d", "dump", "dump"),
        Binding("1,f", "fault_ccu", "CCU fault"),
        Binding("2", "fault_kv", "KV fault"),
        Binding("3", "fault_link", "D2D fault"),
        Binding("4", "fault_slow", "slow chip"),
        Binding("0", "clear_faults", "no faults"),
        Binding("i", "focus_register", "register field"),
        Binding("v", "read_register", "read reg"),
        Binding("w", "write_register", "write reg"),
        Binding("e", "dump_registers", "all regs"),
        Binding("a", "acknowledge", "ack faults"),
    ]
    HELP_EXTRA = ("Every key but x (enter exclusive), a (acknowledge) and i needs exclusive mode: outside it a "
                  "key says 'enter exclusive mode first (x)'. Every action asks first (y confirms, Enter, n or Esc "
                  "cancels); reset and clear memory ask for the device name.")

    class StateChanged(Message):
        """An action of this pane started or ended (the device's mode, faults or memory may have changed): the
        app samples a snapshot at once, so the header says "exclusive" when the lease is granted, not at
        the next refresh."""

    def __init__(self, maintenance: PaneMaintenancePlane, device_name: str, **kw: Any) -> None:
        super().__init__(**kw)
        self._mode_line = ""
        self.maintenance = maintenance
        self.device_name = device_name
        self.lease = None
        # a server with no exclusive mode (a llama-server): its own actions run without a lease, the
        # others are shown as not offered (their keys still ask the plane, which says why: NotOffered)
        #: the plane as each side reads it beyond the contract: exactly one of the two is set
        self._leaseless_plane: LeaselessMaintenancePlane | None = None
        self._draining_plane: DrainingMaintenancePlane | None = None
        if is_leaseless(maintenance):
            self._leaseless_plane = maintenance
        else:
            self._draining_plane = maintenance
        self.leaseless = self._leaseless_plane is not None
        if self.leaseless:
            self.HELP_EXTRA = HELP_LEASELESS.format(kind=getattr(maintenance, "server_kind", "this server"))
        self._entering = False
        self._fired: list[FaultEvent] = []  # unacknowledged fired faults of the last snapshot
        try:
            self.holder = f"{getpass.getuser()}@console"
        except Exception:  # noqa: BLE001 - no passwd entry in some containers
            self.holder = "operator@console"

    def compose(self) -> ComposeResult:
        yield Static(id="m-mode")
        with Horizontal(classes="m-row"):
            yield Button(LABELS["m-enter"][0], id="m-enter", tooltip="enter exclusive mode (drains the device first)",
                         variant="warning", compact=True)
            yield Button(LABELS["m-leave"][0], id="m-leave", disabled=True,
                         tooltip="leave exclusive mode; requests admitted again", compact=True)
            yield Button(LABELS["m-reset"][0], id="m-reset", variant="error", disabled=True, compact=True)
            yield Button(LABELS["m-clear"][0], id="m-clear", variant="error", disabled=True, compact=True)
            yield Button(LABELS["m-reload"][0], id="m-reload", disabled=True, compact=True)
        with Horizontal(classes="m-row"):
            yield Button(LABELS["m-selftest"][0], id="m-selftest", disabled=True, compact=True)
            yield Button(LABELS["m-health"][0], id="m-health", disabled=True, compact=True)
            yield Button(LABELS["m-probe"][0], id="m-probe", disabled=True, compact=True)
            yield Button(LABELS["m-clearkv"][0], id="m-clearkv", disabled=True, compact=True)
            yield Button(LABELS["m-dump"][0], id="m-dump", disabled=True, compact=True)
        with Horizontal(classes="m-row", id="m-row-faults"):
            yield Button(LABELS["m-f-ccu"][0], id="m-f-ccu", disabled=True, compact=True,
                         tooltip="inject: CCU exception on the next job")
            yield Button(LABELS["m-f-kv"][0], id="m-f-kv", disabled=True, compact=True,
                         tooltip="inject: the next KV apply fails (KVExhausted)")
            yield Button(LABELS["m-f-link"][0], id="m-f-link", disabled=True, compact=True,
                         tooltip="inject: D2D link error on the next job")
            yield Button(LABELS["m-f-slow"][0], id="m-f-slow", disabled=True, compact=True,
                         tooltip="inject: chip1 runs 4x slower")
            yield Button(LABELS["m-f-clear"][0], id="m-f-clear", disabled=True, compact=True,
                         tooltip="disarm every injected fault")
            yield Button(LABELS["m-ack"][0], id="m-ack", disabled=True, compact=True,
                         tooltip="acknowledge the faults that fired (status back from 'fault'); no lease needed")
        with Horizontal(classes="m-row", id="m-row-reg"):
            yield HelpKeyInput(placeholder="register / 0xADDR", id="m-reg", compact=True)
            yield HelpKeyInput(placeholder="value", id="m-reg-value", compact=True)
            yield Button(LABELS["m-reg-read"][0], id="m-reg-read", disabled=True, compact=True)
            yield Button(LABELS["m-reg-write"][0], id="m-reg-write", disabled=True, compact=True)
            yield Button(LABELS["m-reg-all"][0], id="m-reg-all", disabled=True, compact=True)
        if self._offers("save_slot"):  # a llama-server's slot actions
            with Horizontal(classes="m-row", id="m-row-slots"):
                yield HelpKeyInput(placeholder="slot id", id="m-slot", compact=True, tooltip="the slot's id (0, 1 ...)")
                yield HelpKeyInput(placeholder="file name", id="m-slot-file", compact=True,
                                   tooltip="a plain file name in the server's --slot-save-path")
                yield Button("Save…", id="m-slot-save", compact=True, tooltip="save the slot's KV to the file")
                yield Button("Restore…", id="m-slot-restore", compact=True, tooltip="restore the slot's KV from it")
                yield Button("Erase…", id="m-slot-erase", compact=True, tooltip="erase the slot's KV")
        yield WrapLog(id="m-log", max_lines=500, min_width=20)  # re-wraps on resize (see chat pane)

    @on(Button.Pressed, "#m-slot-save, #m-slot-restore, #m-slot-erase")
    def _slot_action(self, event: Button.Pressed) -> None:
        """Save / restore / erase one slot of a llama-server: the slot id and (save, restore) the file name
        checked first (``slot_filename_problem``), then asked, then run through the audited plane."""
        action = {"m-slot-save": "save_slot", "m-slot-restore": "restore_slot", "m-slot-erase": "erase_slot"}[
            event.button.id or ""]
        raw = self.query_one("#m-slot", Input).value.strip()
        try:
            slot = int(raw)
        except ValueError:
            self._log(f"{action}: the slot id must be an integer (0, 1 ...), got {raw[:40]!r}", "bold red")
            return
        m = self._leaseless_plane
        if m is None:  # the slot row is drawn for a leaseless server only
            return
        if action == "erase_slot":
            self._ask(action, lambda: m.erase_slot(None, slot), question=f"Erase slot {slot}'s KV cache?")
            return
        name = self.query_one("#m-slot-file", Input).value
        problem = slot_filename_problem(name)
        if problem is not None:
            self._log(f"{action}: file name {name[:60]!r} refused: {problem}", "bold red")
            return
        fn = m.save_slot if action == "save_slot" else m.restore_slot
        verb = "Save slot {} to {}?" if action == "save_slot" else "Restore slot {} from {}?"
        self._ask(action, lambda: fn(None, slot, name), question=verb.format(slot, name))

    def on_mount(self) -> None:
        self._guarded_keys = {k.strip() for b in self.BINDINGS if isinstance(b, Binding)
                              and b.action in GUARDED_ACTIONS for k in b.key.split(",")}
        self._sync_buttons()
        self._log(audit_line(self.maintenance.audit.path), "dim")
        if self.leaseless:
            kind = getattr(self.maintenance, "server_kind", "this server")
            offered = [m for m in sorted(set(BUTTON_METHOD.values()) | set(SLOT_METHODS)) if self._offers(m)]
            self._log(f"{kind}: offers {', '.join(offered)} (no lease: it has no exclusive mode); every other "
                      f"action is not offered by {kind} (its key says why)", "yellow")

    def _sync_leaseless(self) -> None:
        """A server without a lease (llama-server): only the buttons of what it offers are drawn; a row with none
        (faults, registers) is not drawn at all. Their keys still answer, refused by the plane (audited) with
        the reason."""
        for bid, method in BUTTON_METHOD.items():
            b = self.query_one(f"#{bid}", Button)
            b.disabled = not self._offers(method)
            b.display = not b.disabled
        for row in self.query(".m-row"):
            row.display = any(b.display for b in row.query(Button))
        self.refresh_bindings()

    def _sync_buttons(self) -> None:
        if self.leaseless:
            self._sync_leaseless()
            return
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
        """The long labels in a row where they all fit, else the short ones where they all fit, else the keys
        alone (``fitted_label``): one row reads alike, and no label is cut (at 80x24 in the chat layout the
        buttons are 3-5 columns wide: "x Excl" read "x E…"). A key-only button's tooltip names its action, and
        the footer and the help (?) list every key with what it does."""
        for row in self.query(".m-row"):
            buttons = [b for b in row.query(Button) if (b.id or "") in LABELS]
            if not buttons or not all(b.size.width for b in buttons):
                continue
            tier = fitted_tier([(b.id or "", b.size.width) for b in buttons])
            for b in buttons:
                label = fitted_label(b.id or "", tier)
                if str(b.label) != label:
                    b.label = label
                if tier == 2 and not b.tooltip:
                    b.tooltip = LABELS[b.id or ""][0]

    def offers_action(self, action: str) -> bool:
        """Whether key action ``action`` is one the attached plane has: always on the simulator; on a leaseless
        server (a llama-server) only those whose plane method it offers (``ACTION_METHOD``)."""
        method = ACTION_METHOD.get(action)
        return not self.leaseless or method is None or self._offers(method)

    def _offers(self, method: str) -> bool:
        """Whether the attached plane is a leaseless server's that offers the plane method ``method``."""
        return self._leaseless_plane is not None and self._leaseless_plane.offers(method)

    def help_bindings(self) -> list[BindingType]:
        """The pane's key bindings the help lists: on a leaseless server those of what it offers only."""
        return [b for b in self.BINDINGS if not isinstance(b, Binding) or self.offers_action(b.action)]

    def on_key(self, event: events.Key) -> None:
        """A maintenance key outside exclusive mode says why nothing happens (the footer shows it
        disabled: check_action), instead of silence. On a leaseless server a key of an action it does not offer
        (not in the footer or the help: check_action) still asks the plane, which refuses it, audited, and says
        why. Typing into the register or slot inputs never gets here."""
        if self.leaseless:
            action = next((b.action for b in self.BINDINGS if isinstance(b, Binding)
                           and event.key in {k.strip() for k in b.key.split(",")}), None)
            if action is not None and not self.offers_action(action):
                event.stop()
                event.prevent_default()
                getattr(self, f"action_{action}")()
            return
        if self.lease is None and event.key in self._guarded_keys:
            event.stop()
            event.prevent_default()
            self.notify(NEED_EXCLUSIVE, severity="warning", timeout=4)
            self._log(f"key {event.key}: {NEED_EXCLUSIVE}", "yellow")

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Maintenance keys do nothing outside exclusive mode (shown disabled in the footer). On a leaseless
        server (no exclusive mode to be outside of) the keys of what it offers, and no others (``on_key``)."""
        if self.leaseless:
            return self.offers_action(action)
        if action in GUARDED_ACTIONS and self.lease is None:
            return None
        if action == "enter" and (self.lease is not None or self._entering):
            return None
        if action == "acknowledge" and not self._fired:
            return None
        return True

    def _log(self, text: str, style: str = "") -> None:
        self.query_one("#m-log", RichLog).write(Text(text, style=style))

    def update_snapshot(self, snap: Snapshot) -> None:
        d = snap.device
        if d is None:  # a llama-server: always serving, no device status; its own actions only
            server = snap.server
            line = Text.assemble("mode serving (no exclusive mode on ", snap.source,
                                 ") · health ", server.health if server is not None else "?")
            set_subtitle(self, "serving")
            if line.plain != self._mode_line:
                self._mode_line = line.plain
                self.query_one("#m-mode", Static).update(line)
            return
        mode = d.mode + (f" (lease: {d.lease_holder})" if d.lease_holder else "")
        set_subtitle(self, mode)
        style = {"serving": "green", "draining": "yellow", "exclusive": "bold red"}.get(d.mode, "")
        line = Text.assemble("mode ", (mode, style), " · device ", status_text(d, compact=True))
        if line.plain != self._mode_line:  # unchanged: no redraw, no relayout
            self._mode_line = line.plain
            self.query_one("#m-mode", Static).update(line)
        fired = list(d.faults_fired)
        if fired != self._fired:
            self._fired = fired
            self._sync_buttons()

    def _need_lease(self, what: str) -> bool:
        if self.leaseless:
            return True
        if self.lease is None:
            self._log(f"{what}: needs exclusive mode: {NEED_EXCLUSIVE}", "yellow")
            self.notify(f"{what}: {NEED_EXCLUSIVE}", severity="warning", timeout=4)
            return False
        return True

    # --- key actions (the buttons call the same methods) ------------------------------------------

    def action_enter(self) -> None:
        """x, the Exclusive button and the palette: asks first (``AskModal``, Cancel the default), then enters.
        A Tab onto the button and an Enter had entered exclusive mode, draining the device, unconfirmed."""
        if self._draining_plane is None:  # leaseless: the plane says why there is no exclusive mode (NotOffered)
            self._run("enter_exclusive", lambda: self.maintenance.enter_exclusive(self.holder))
            return
        if self.lease is not None or self._entering:
            return
        timeout = self._draining_plane.drain_timeout_s
        self.app.push_screen(
            AskModal("Enter exclusive mode", f"Stops admitting requests and drains the device: requests still "
                     f"running after {timeout:g} s are cancelled. Maintenance actions need it; l leaves it."),
            lambda ok: self._enter_confirmed(bool(ok)))

    def _enter_confirmed(self, ok: bool) -> None:
        if not ok:
            self._log("enter_exclusive: cancelled at the confirmation", "dim")
            return
        if self.lease is not None or self._entering or self._draining_plane is None:
            return
        self._entering = True
        timeout = self._draining_plane.drain_timeout_s
        self._log(f"entering exclusive mode: admission stopped, draining in-flight requests (up to {timeout:g} s)…",
                  "yellow")
        self.border_subtitle = f"draining (lease: {self.holder})"
        self._sync_buttons()
        self._run("enter_exclusive", lambda: self.maintenance.enter_exclusive(self.holder))

    def _ask(self, action: str, fn: Action, question: str | None = None, ask: str | None = None) -> None:
        """Every maintenance action but reset and clear memory (typed name) and entering exclusive mode / leaving
        with force (their own questions) asks first: ``AskModal`` with ``ASK[action]`` (button label, question,
        what it does), Cancel focused; ``fn`` runs (through the audited plane) only once confirmed and while the
        lease is still held (acknowledge needs none). ``question`` replaces the table's (a register read names the
        register); ``ask`` is the ``ASK`` key when it is not ``action`` (the four fault keys). A
        leaseless server's action it does not offer runs at once: the plane refuses it, audited, and says why
        (NotOffered), as before; nothing to confirm."""
        if self.leaseless and not self._offers(action):
            self._run(action, fn)
            return
        label, default_q, detail = ASK[ask or action]
        if self.leaseless and (ask or action) in ASK_LEASELESS:
            kind = getattr(self.maintenance, "server_kind", "this server")
            label, default_q, detail = (t.format(kind=kind) for t in ASK_LEASELESS[ask or action])
        self.app.push_screen(AskModal(label, detail, question or default_q),
                             lambda ok: self._asked(bool(ok), action, fn))

    def _asked(self, ok: bool, action: str, fn: Action) -> None:
        if not ok:
            self._log(f"{action}: cancelled at the confirmation", "dim")  # the pane's log only: nothing ran
            return
        if action == "acknowledge_faults" or self._need_lease(action.replace("_", " ")):
            self._run(action, fn)

    def action_leave(self) -> None:
        if not self._need_lease("leave exclusive"):
            return
        self._ask("leave_exclusive", lambda: self.maintenance.leave_exclusive(self.lease))

    def action_leave_force(self) -> None:
        """L: leave exclusive mode even where the plane refuses a plain leave (after a memory clear, before a
        reload: requests then fail with DeviceNotReady). Asks first (``AskModal``)."""
        if not self._need_lease("leave exclusive with force"):
            return
        self.app.push_screen(
            AskModal("Leave exclusive mode with force", "Admits requests again even though the device cannot "
                     "serve them (after a memory clear and before a reload, each fails with DeviceNotReady). "
                     "o (Reload) first is the usual way out."),
            lambda ok: self._leave_force_confirmed(bool(ok)))

    def _leave_force_confirmed(self, ok: bool) -> None:
        if not ok:
            self._log("leave_exclusive (force): cancelled at the confirmation", "dim")
            return
        if self._need_lease("leave exclusive with force"):
            lease = self.lease
            self._run("leave_exclusive", lambda: self.maintenance.leave_exclusive(lease, force=True))

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
            self._ask("self_test", lambda: self.maintenance.self_test(self.lease))

    def action_probe(self) -> None:
        if self._need_lease("probe request"):
            self._ask("probe_request", lambda: self.maintenance.probe_request(self.lease, "hi", max_tokens=4))

    def action_acknowledge(self) -> None:
        if self._fired:
            self._ask("acknowledge_faults", lambda: self.maintenance.acknowledge_faults(self.holder))

    def action_fault_ccu(self) -> None:
        self._inject("fault_ccu")

    def _confirmed(self, ok: bool | None, action: str, fn: Action) -> None:
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

    def action_reload(self) -> None:
        if self._need_lease("reload model"):
            self._ask("reload_model", lambda: self.maintenance.reload_model(self.lease))

    def action_health(self) -> None:
        if self._need_lease("health check"):
            self._ask("health_check", lambda: self.maintenance.health_check(self.lease))

    def action_clear_kv(self) -> None:
        if self._need_lease("clear KV"):
            self._ask("clear_kv", lambda: self.maintenance.clear_kv(self.lease))

    def action_dump(self) -> None:
        if self._need_lease("dump"):
            self._ask("dump", lambda: self.maintenance.dump(self.lease))

    def _inject(self, action: str) -> None:
        if not self._need_lease("inject fault"):
            return
        kind, kw = FAULTS[action]
        self._ask("inject_fault", lambda: self.maintenance.inject_fault(self.lease, kind, **kw), ask=action)

    def action_fault_kv(self) -> None:
        self._inject("fault_kv")

    def action_fault_link(self) -> None:
        self._inject("fault_link")

    def action_fault_slow(self) -> None:
        self._inject("fault_slow")

    def action_clear_faults(self) -> None:
        if self._need_lease("clear faults"):
            self._ask("clear_faults", lambda: self.maintenance.clear_faults(self.lease))

    def action_focus_register(self) -> None:
        self.query_one("#m-reg", Input).focus()

    def action_read_register(self) -> None:
        if self._need_lease("read register"):
            key = self.query_one("#m-reg", Input).value.strip()
            if not key:
                self._log("read register: type a register name or 0xADDR first (i focuses the field)", "yellow")
                self.query_one("#m-reg", Input).focus()
                return
            self._ask("read_register", lambda: self.maintenance.read_register(self.lease, key),
                      f"Read the register {key} on the device?")

    def action_write_register(self) -> None:
        if self._need_lease("write register"):
            key = self.query_one("#m-reg", Input).value.strip()
            value = self.query_one("#m-reg-value", Input).value.strip()
            if not key or not value:
                self._log("write register: type the register and the value first (i focuses the field)", "yellow")
                self.query_one("#m-reg" if not key else "#m-reg-value", Input).focus()
                return
            self._ask("write_register", lambda: self.maintenance.write_register(self.lease, key, value),
                      f"Write {value} to the register {key} on the device?")

    def action_dump_registers(self) -> None:
        if self._need_lease("read registers"):
            self._ask("dump_registers", lambda: self.maintenance.dump_registers(self.lease))

    @on(Input.Submitted, "#m-reg")
    def _reg_submitted(self) -> None:
        self.action_read_register()

    @on(Input.Submitted, "#m-reg-value")
    def _value_submitted(self) -> None:
        self.action_write_register()

    #: button id -> the action it runs (the keys run the same ones)
    BUTTON_ACTIONS = {"m-enter": "enter", "m-leave": "leave", "m-reset": "reset", "m-clear": "clear",
                      "m-reload": "reload", "m-selftest": "self_test", "m-health": "health", "m-probe": "probe",
                      "m-clearkv": "clear_kv", "m-dump": "dump", "m-f-ccu": "fault_ccu", "m-f-kv": "fault_kv",
                      "m-f-link": "fault_link", "m-f-slow": "fault_slow", "m-f-clear": "clear_faults",
                      "m-ack": "acknowledge", "m-reg-read": "read_register", "m-reg-write": "write_register",
                      "m-reg-all": "dump_registers"}

    @on(Button.Pressed)
    def _button(self, event: Button.Pressed) -> None:
        action = self.BUTTON_ACTIONS.get(event.button.id or "")
        if action is not None:
            event.stop()
            getattr(self, f"action_{action}")()

    # --- worker ------------------------------------------------------------------------

    def _run(self, action: str, fn: Action) -> None:
        self._worker(action, fn)
        self.post_message(self.StateChanged())  # entering: the snapshots show "draining" from now on

    @work(thread=True, group="maintenance", exclusive=False, exit_on_error=False)
    def _worker(self, action: str, fn: Action) -> None:
        try:
            result = fn()
        except CalError as e:  # the log line names the action once (a remote plane's error starts with it too)
            text = str(e)
            text = text[len(action) + 2:] if text.startswith(f"{action}: ") else text
            self.app.call_from_thread(self._done, action, False, f"{type(e).__name__}: {text}")
            return
        except Exception as e:  # noqa: BLE001 - audited by the plane; shown, never a crash of the console
            self.app.call_from_thread(self._done, action, False, f"internal error: {type(e).__name__}: {e}")
            return
        self.app.call_from_thread(self._done, action, True, result)

    def _done(self, action: str, ok: bool, result: Any) -> None:
        if action == "enter_exclusive":
            self._entering = False
            if ok:
                self.lease = result
                d = (self._draining_plane.last_drain if self._draining_plane is not None else None) or {}
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
            if action == "leave_exclusive" and "force" in str(result):  # the plane's "or leave with force"
                self._log("L leaves with force (it asks first); o reloads the model", "yellow")
        elif isinstance(result, dict) and result.get("ran") is False:  # could not run here: neither ok nor failed
            self._log(f"{action}: NOT RUN · {summarize_result(action, result)}", "yellow")
        else:
            good = not (isinstance(result, dict) and result.get("ok") is False)
            self._log(f"{action}: {'ok' if good else 'FAILED'} · {summarize_result(action, result)}",
                      "green" if good else "bold red")
            if action == "clear_device_memory" and good:
                self._log("inference is refused until the model is reloaded: press Reload (key o)", "yellow")
        self._sync_buttons()
        self.post_message(self.StateChanged())
        if action == "clear_device_memory" and ok:
            self.query_one("#m-reload", Button).focus()


def fitted_tier(widths: list[tuple[str, int]]) -> int:
    """Which labels a row of buttons shows, from ``[(button id, width in cells)]``: 0 the long ones when each
    fits its button, 1 the short ones when each of those fits, else 2, the keys alone."""
    for tier in (0, 1):
        if all(len(fitted_label(bid, tier)) <= width for bid, width in widths):
            return tier
    return 2


def fitted_label(button_id: str, tier: int) -> str:
    """A button's label at ``tier`` (``fitted_tier``): ``LABELS``' long or short one, or (2) its key alone."""
    long, short = LABELS[button_id]
    return (long, short, long.split(" ", 1)[0])[tier]
