"""Maintenance pane (guarded): exclusive mode, reset, device-memory clear.

Every action goes through the maintenance plane (which audits it) on a
worker thread. Destructive actions are disabled outside exclusive mode and
open a confirmation modal whose default is Cancel.
"""

from __future__ import annotations

import getpass
import json

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, RichLog, Static

from sim_backend.errors import CalError

from ..widgets.confirm import ConfirmModal

GUARDED = ("#m-reset", "#m-clear", "#m-reload")


class MaintenancePane(Vertical):
    """Buttons for the maintenance plane; a log of every outcome."""

    def __init__(self, maintenance, device_name: str, **kw) -> None:
        super().__init__(**kw)
        self.maintenance = maintenance
        self.device_name = device_name
        self.lease = None
        try:
            self.holder = f"{getpass.getuser()}@console"
        except Exception:  # noqa: BLE001
            self.holder = "operator@console"

    def compose(self) -> ComposeResult:
        yield Static(id="m-mode")
        with Horizontal(classes="m-row"):
            yield Button("Enter exclusive", id="m-enter", variant="warning")
            yield Button("Leave exclusive", id="m-leave", disabled=True)
        with Horizontal(classes="m-row"):
            yield Button("Reset device", id="m-reset", variant="error", disabled=True)
            yield Button("Clear device memory", id="m-clear", variant="error", disabled=True)
            yield Button("Reload model", id="m-reload", disabled=True)
        yield RichLog(id="m-log", max_lines=500, wrap=True, markup=False)

    def on_mount(self) -> None:
        self._sync_buttons()

    def _sync_buttons(self) -> None:
        held = self.lease is not None
        self.query_one("#m-enter", Button).disabled = held
        self.query_one("#m-leave", Button).disabled = not held
        for sel in GUARDED:
            self.query_one(sel, Button).disabled = not held

    def _log(self, text: str, style: str = "") -> None:
        self.query_one("#m-log", RichLog).write(Text(text, style=style))

    def update_snapshot(self, snap: dict) -> None:
        d = snap["device"]
        mode = d["mode"] + (f" (lease: {d['lease_holder']})" if d.get("lease_holder") else "")
        self.border_subtitle = mode
        self.query_one("#m-mode", Static).update(
            Text.assemble("mode ", (mode, "bold red" if d["mode"] != "serving" else "green"),
                          f" · device {d['status']} · audit log {self.maintenance.audit.path}"))

    # --- actions (each on a worker thread; results back on the UI thread) -----------

    @on(Button.Pressed, "#m-enter")
    def enter(self) -> None:
        self._log("entering exclusive mode: admission stopped, draining…", "yellow")
        self.query_one("#m-enter", Button).disabled = True
        self._run("enter_exclusive", lambda: self.maintenance.enter_exclusive(self.holder))

    @on(Button.Pressed, "#m-leave")
    def leave(self) -> None:
        self._run("leave_exclusive", lambda: self.maintenance.leave_exclusive(self.lease))

    @on(Button.Pressed, "#m-reset")
    def reset(self) -> None:
        if self.lease is None:
            return
        self.app.push_screen(ConfirmModal("Reset device", "Fails in-flight jobs, clears KV, reconfigures the calbin, "
                                          "then runs a health check.", self.device_name),
                             lambda ok: ok and self._run("reset", lambda: self.maintenance.reset(self.lease)))

    @on(Button.Pressed, "#m-clear")
    def clear(self) -> None:
        if self.lease is None:
            return
        self.app.push_screen(ConfirmModal("Clear device memory", "ClearAllDevMem zeroes DRAM and SRAM; inference is "
                                          "refused until the model is reloaded.", self.device_name),
                             lambda ok: ok and self._run("clear_device_memory",
                                                         lambda: self.maintenance.clear_device_memory(self.lease)))

    @on(Button.Pressed, "#m-reload")
    def reload(self) -> None:
        if self.lease is None:
            return
        self._run("reload_model", lambda: self.maintenance.reload_model(self.lease))

    def _run(self, action: str, fn) -> None:
        self._worker(action, fn)

    @work(thread=True, group="maintenance", exclusive=False, exit_on_error=False)
    def _worker(self, action: str, fn) -> None:
        try:
            result = fn()
        except CalError as e:
            self.app.call_from_thread(self._done, action, False, f"{type(e).__name__}: {e}")
            return
        self.app.call_from_thread(self._done, action, True, result)

    def _done(self, action: str, ok: bool, result) -> None:
        if action == "enter_exclusive" and ok:
            self.lease = result
            drain = self.maintenance.last_drain or {}
            self._log(f"exclusive mode granted to {result.holder}; drain: {json.dumps(drain, default=str)}", "bold red")
        elif action == "leave_exclusive" and ok:
            self.lease = None
            self._log("left exclusive mode; requests admitted again", "green")
        elif not ok:
            self._log(f"{action}: {result}", "bold red")
        else:
            good = not (isinstance(result, dict) and result.get("ok") is False)
            self._log(f"{action}: {'ok' if good else 'FAILED'} {json.dumps(result, default=str)}",
                      "green" if good else "bold red")
        self._sync_buttons()
