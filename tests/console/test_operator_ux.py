"""Operator experience: ? help, the palette's commands, every maintenance key, thresholds, settings,
and the observation pane's picture for a scripted device state (snapshot tests at 160x48 and 80x24)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from rich.console import Console
from textual.app import App
from textual.command import CommandPalette
from textual.widgets import OptionList

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.panes.maintenance import PALETTE, MaintenancePane
from calconsole.panes.observation import ObservationPane
from calconsole.settings import Settings, SettingsError, load_settings, save_settings
from calconsole.widgets import history as history_mod
from calconsole.widgets import render
from calconsole.widgets.help import HelpScreen
from sim_backend.planes.snapshot import Snapshot
from tests.console.pilot_helpers import confirm_ask, has, log_lines, typed, typed_step, wait_for


@pytest.fixture
def fast_system(make_system):
    return make_system(drain_timeout_s=0.5)


CSS = Path(__file__).resolve().parents[2] / "calconsole" / "styles.tcss"
SCRIPTED = json.loads((Path(__file__).parent / "data" / "scripted_snapshot.json").read_text())


def plain(renderable, width: int = 200) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def spans_of(text, word: str) -> set[str]:
    """Styles of the spans covering ``word`` in a rich Text."""
    start = text.plain.index(word)
    return {str(s.style) for s in text.spans if s.start <= start < s.end}


# --- ? help ---------------------------------------------------------------------------------------


async def test_question_mark_lists_the_focused_panes_keys_global_keys_figures_and_thresholds(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        await pilot.press("question_mark")
        assert await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = plain(app.screen.content)
        for needle in ("Maintenance (guarded): keys", "clear KV", "D2D fault", "slow chip", "read reg", "health",
                       "global keys", "command palette", "simulated device time", "measured host time",
                       "kv_percent", "tpot_slo_ratio", "pacing_ratio", "enter exclusive mode first (x)"):
            assert needle in text, needle
        await pilot.press("escape")
        assert await wait_for(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("f1")
        await pilot.press("question_mark")
        assert await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = plain(app.screen.content)
        assert "Observation (read-only): keys" in text and "heatmap" in text and "history 1/5/15 min" in text


async def test_question_mark_on_the_empty_chat_input_opens_the_help_and_types_in_a_filled_one(fast_system):
    # the chat input has focus at start: "?" went into it as text, and the help was reachable only after F1/F3
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        inp = app.query_one("#chat-input")
        assert await wait_for(pilot, lambda: app.focused is inp)
        await pilot.press("question_mark")
        assert await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        assert inp.value == ""
        text = plain(app.screen.content)
        for word in ("calbin", "C0 / C1 / C2 / C3", "S8 V-cache", "facts.md F1..F10", "job / device step",
                     "fault xN", "pacing A/S", "timing-only"):
            assert word in text, word
        assert re.search(r"enter\s+send the message", text), text[:400]  # the input's own key, listed too
        await pilot.press("question_mark")  # ? closes it again
        assert await wait_for(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("w", "h", "y", "question_mark")
        assert await wait_for(pilot, lambda: inp.value == "why?")
        assert not isinstance(app.screen, HelpScreen)
        # the footer names the help key whatever has focus
        assert any(b.binding.action in ("help", "app.help") and b.binding.show for b in app.active_bindings.values())


# --- the palette ------------------------------------------------------------------------------------


async def test_palette_offers_every_console_command_and_they_work(fast_system, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        cmds = {c.title: c for c in app.get_system_commands(app.screen)}
        for title, _, _ in PALETTE:
            assert f"Maintenance: {title}" in cmds, title
        for t in ("Export snapshot to a file", "Save settings", "Compact mode: toggle", "History window: 1 min",
                  "History window: 15 min", "Refresh rate: 4 Hz", "Layout: chat (default at next start)",
                  "Theme: nord", "Help: keys, figures and thresholds"):
            assert t in cmds, t
        cmds["Refresh rate: 4 Hz"].callback()
        assert app.refresh_hz == 4.0
        obs = app.query_one(ObservationPane)
        cmds["History window: 15 min"].callback()
        assert obs.window_s == 900
        was = obs.compact
        cmds["Compact mode: toggle"].callback()
        assert obs.compact is not was
        cmds["Theme: nord"].callback()
        assert app.theme == "nord"
        # through the palette itself, as an operator types it
        await pilot.press("ctrl+p")
        assert await wait_for(pilot, lambda: isinstance(app.screen, CommandPalette))
        await pilot.press(*"Export snapshot")

        def highlighted() -> str:
            lists = app.screen.query(OptionList)
            ol = lists.first() if lists else None
            if ol is None or ol.highlighted is None or not ol.option_count:
                return ""
            return str(ol.get_option_at_index(ol.highlighted).prompt)

        assert await wait_for(pilot, lambda: "Export snapshot" in highlighted())
        await pilot.press("enter")
        assert await wait_for(pilot, lambda: list(tmp_path.glob("calconsole-snapshot-*.json")))
        wire = json.loads(next(tmp_path.glob("calconsole-snapshot-*.json")).read_text())
        assert Snapshot.from_dict(wire).device.name == "calculet0"
        cmds["Save settings"].callback()
        saved = load_settings()
        assert saved.theme == "nord" and saved.history_window_s == 900 and saved.refresh_hz == 4.0
        # a guarded maintenance command outside exclusive mode says so
        cmds["Maintenance: clear KV cache"].callback()
        await pilot.pause()
        assert any("enter exclusive mode first (x)" in n.message for n in app._notifications)


# --- every maintenance action on a key ----------------------------------------------------------------


async def test_every_maintenance_key_runs_its_audited_action(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    audit = fast_system.maintenance.audit
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(MaintenancePane)
        await pilot.press("f3")
        await pilot.pause()
        # outside exclusive mode: each guarded key says so (notification), nothing reaches the plane
        before = len(audit.entries())
        notified: list[str] = []
        notify = pane.notify
        pane.notify = lambda message, **kw: (notified.append(message), notify(message, **kw))[1]
        keys = ("h", "k", "d", "1", "2", "3", "4", "0", "v", "w", "e", "t", "p", "o", "l")
        for key in keys:
            await pilot.press(key)
        # the pane's log keeps one line per key (a notification lasts 4 s: under load the first ones
        # expired before the last key was pressed, and counting them saw 6 of 15)
        said = [f"key {k}: enter exclusive mode first (x)" for k in keys]
        assert await wait_for(pilot, lambda: [ln.strip() for ln in log_lines(app, "#m-log")
                                              if ln.strip() in said] == said)
        assert notified == ["enter exclusive mode first (x)"] * 15
        pane.notify = notify
        assert len(audit.entries()) == before
        await pilot.press("x")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: pane.lease is not None)
        expected = [("h", "health_check"), ("k", "clear_kv"), ("d", "dump"), ("1", "inject_fault"),
                    ("2", "inject_fault"), ("3", "inject_fault"), ("4", "inject_fault"), ("0", "clear_faults"),
                    ("e", "dump_registers"), ("f", "inject_fault"), ("0", "clear_faults")]
        for key, action in expected:
            n = len(audit.entries())
            await pilot.press(key)
            await confirm_ask(pilot)  # every action asks first
            assert await wait_for(pilot, lambda n=n: len(audit.entries()) > n), key
            assert audit.entries()[-1]["action"] == action, (key, audit.entries()[-1])
            assert await wait_for(pilot, lambda: not any(w.is_running for w in pane.workers))
        # registers: i focuses the field, Enter reads; Enter in the value field writes
        await pilot.press("i")
        await pilot.press(*"D2D_LINK_ERR", "enter")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "read_register: ok · D2D_LINK_ERR"))
        pane.query_one("#m-reg").value = "CHIP0_SCRATCH"
        pane.query_one("#m-reg-value").focus()
        await pilot.press(*"0x2a", "enter")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: audit.entries()[-1]["action"] == "write_register")
        pane.query_one("#m-log").focus()
        await pilot.press("v")
        await confirm_ask(pilot)
        assert await wait_for(pilot, lambda: has(app, "#m-log", "CHIP0_SCRATCH"))
        # reset asks for the device name first
        await pilot.press("r")
        assert await wait_for(pilot, lambda: type(app.screen).__name__ == "ConfirmModal")


# --- thresholds ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("used", "style"), [(20000, "green"), (34000, "bold yellow"), (40000, "bold red")])
def test_kv_occupancy_turns_warning_then_critical(used, style):
    snap = copy.deepcopy(SCRIPTED)
    snap["kv"]["used_tokens"] = used
    line = render.header_line(typed(snap), Settings())
    pct = f"{100 * used / 40960:.1f}%"
    assert style in spans_of(line, pct)


def test_tpot_queue_failures_and_pacing_are_coloured_by_their_thresholds():
    snap = copy.deepcopy(SCRIPTED)  # TPOT P95 47 ms, SLO 50: 0.94 x SLO (warn); 2 queued (warn); achieved 0.62
    s = Settings()
    line = render.header_line(typed(snap), s)
    assert "bold yellow" in spans_of(line, "47.0 ms")
    assert "bold red" in spans_of(render.header_line(typed(snap), s.replace(slo_tpot_ms=40.0)), "47.0 ms")
    assert "green" in spans_of(render.header_line(typed(snap), s.replace(slo_tpot_ms=100.0)), "47.0 ms")
    assert "bold yellow" in spans_of(line, "0.62/1 sim s per wall s") and "host behind real time" in line.plain
    snap["requests"]["counters"]["queued"] = 0
    assert "green" in spans_of(render.header_line(typed(snap), s), "queue 0") or \
        "green" in {str(sp.style) for sp in render.header_line(typed(snap), s).spans}
    snap["requests"]["counters"]["failed"] = 6
    assert "bold red" in spans_of(render.header_line(typed(snap), s), "6 req")


def test_configured_thresholds_change_the_colour(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("thresholds:\n  kv_percent: {warn: 50, crit: 60}\n")
    s = load_settings(cfg, environ={})
    snap = copy.deepcopy(SCRIPTED)
    snap["kv"]["used_tokens"] = 22528  # 55 %
    assert "bold yellow" in spans_of(render.header_line(typed(snap), s), "55.0%")
    s2 = load_settings(cfg, environ={"CALCONSOLE_THRESHOLD_KV_PERCENT": "10,20"})
    assert "bold red" in spans_of(render.header_line(typed(snap), s2), "55.0%")


# --- settings --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "key"), [
    ("refresh_hz: 50\n", "refresh_hz"),
    ("history_window_s: 120\n", "history_window_s"),
    ("thresholds:\n  kv_percent: {warn: 90, crit: 80}\n", "thresholds.kv_percent"),
    ("thresholds:\n  nope: {warn: 1, crit: 2}\n", "thresholds.nope"),
    ("thresholds:\n  kv_percent: {warn: x, crit: 2}\n", "thresholds.kv_percent.warn"),
    ("slo: {tpot_ms: -1}\n", "slo.tpot_ms"),
    ("compact: sometimes\n", "compact"),
    ("colour: red\n", "colour"),
    ("[1, 2]\n", "(file)"),
    ("a: [\n", "(file)"),
])
def test_bad_settings_name_the_file_and_the_key(tmp_path, text, key):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    with pytest.raises(SettingsError) as ei:
        load_settings(cfg, environ={})
    assert ei.value.key == key and str(cfg) in str(ei.value)


def test_environment_overrides_the_file_and_names_the_variable(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("theme: nord\nhistory_window_s: 60\n")
    s = load_settings(cfg, environ={"CALCONSOLE_THEME": "gruvbox", "CALCONSOLE_SLO_TPOT_MS": "30"})
    assert (s.theme, s.history_window_s, s.slo_tpot_ms) == ("gruvbox", 60, 30.0)
    with pytest.raises(SettingsError, match="CALCONSOLE_REFRESH: key 'refresh_hz'"):
        load_settings(cfg, environ={"CALCONSOLE_REFRESH": "fast"})
    assert load_settings(tmp_path / "missing.yaml", environ={}) == Settings(path=tmp_path / "missing.yaml")


def test_settings_round_trip_through_the_file(tmp_path):
    s = Settings(path=tmp_path / "sub" / "c.yaml").replace(theme="nord", refresh_hz=1.0, compact="on")
    path = save_settings(s)
    assert load_settings(path, environ={}) == s


def test_cli_refuses_a_bad_settings_file_with_one_line_and_code_2(tmp_path, monkeypatch, capsys):
    from calconsole.cli import main

    cfg = tmp_path / "config.yaml"
    cfg.write_text("refresh_hz: 0\n")
    monkeypatch.setenv("CALCONSOLE_CONFIG", str(cfg))
    assert main([]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(cfg) in err and "refresh_hz" in err


def test_help_names_the_settings_file_and_variables(tmp_path, monkeypatch, capsys):
    from calconsole.cli import main

    monkeypatch.setenv("CALCONSOLE_CONFIG", str(tmp_path / "my.yaml"))
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert str(tmp_path / "my.yaml") in out and "CALCONSOLE_THRESHOLD_<NAME>" in out
    from calconsole.settings import Settings, to_data

    flat = " ".join(out.split())
    for key in to_data(Settings()):  # every key the file holds is named (sections was missing)
        assert key in flat, key
    assert "sections {order: [...], folded: [...], focus: NAME|null}" in flat


# --- the device table, heatmap ----------------------------------------------------------------------


def test_chip_health_is_ok_again_once_the_fired_fault_is_acknowledged():
    import copy

    snap = copy.deepcopy(SCRIPTED)
    snap["device"]["faults_fired"] = []  # acknowledged: the exception count stays, the alarm does not
    snap["device"]["status"] = "degraded"
    rows = plain(render.device_table(typed(snap))).splitlines()
    assert rows[2].startswith(" chip0") and "ccu 1" not in rows[2] and " ok " in rows[2]


def test_device_table_has_the_board_and_one_row_per_chip_with_busy_and_memory():
    text = plain(render.device_table(typed(SCRIPTED)))
    rows = text.splitlines()
    assert rows[0].split()[:5] == ["dev", "health", "state", "busy", "steps"]
    assert rows[1].startswith("calculet0") and " 97%" in rows[1]
    assert rows[2].startswith(" chip0") and "ccu 1" in rows[2] and " 25%" in rows[2]
    assert rows[3].startswith(" chip1") and "slow x4" in rows[3] and " 97%" in rows[3]
    assert "fired ccu_exception (last chip0, job 41" in text and "slow_chip1" in text
    # the operator layout's observation pane at 80x24: 42 columns less borders and padding
    compact = plain(render.device_table(typed(SCRIPTED), compact=True), width=38)
    table = compact.split("faults")[0]
    assert all(len(line) <= 38 for line in table.splitlines()) and "…" not in table


def test_heatmap_puts_the_slow_chip_on_one_scale_with_a_legend():
    step = SCRIPTED["last_decode"]
    text = render.layers_heatmap(typed_step(step), "chip", 120)
    assert "chip0" in text.plain and "chip1" in text.plain and "scale 0" in text.plain
    chip1_top = max(layer["chip_us"][1] for layer in step["layers"])
    chip0_top = max(layer["chip_us"][0] for layer in step["layers"])
    assert chip1_top > 3 * chip0_top  # the probe ran with chip1 4x slow
    assert f"max {chip1_top:.0f} µs" in text.plain
    cats = render.layers_heatmap(typed_step(step), "category", 120).plain
    assert "moe" in cats


# --- the picture ------------------------------------------------------------------------------------


class ObservationHost(App):
    """The observation pane alone, fed one scripted snapshot with a scripted 5-minute history."""

    CSS_PATH = str(CSS)

    def __init__(self, compact: bool) -> None:
        super().__init__()
        self.compact = compact

    def compose(self):
        yield ObservationPane(Settings(), id="observation", classes="pane")

    def on_mount(self) -> None:
        pane = self.query_one(ObservationPane)
        pane.border_title = "Observation (read-only)"
        hist = pane.history
        for i in range(300):  # 5 min at 1 Hz: a ramp of load, KV filling up, a queue building
            snap = copy.deepcopy(SCRIPTED) if i == 0 else snap  # noqa: F821 - assigned on the first pass
            snap["kv"]["used_tokens"] = int(39200 * i / 299)
            snap["load"] = dict(SCRIPTED["load"], busy_percent=min(97.4, i / 2.0),
                                output_tokens_per_s=31.5 * min(1.0, i / 150))
            snap["requests"]["counters"]["queued"] = i // 100
            hist.record(typed(snap), now=1000.0 + i)
        pane.set_compact(self.compact)
        pane.update_snapshot(typed(SCRIPTED))


@pytest.fixture
def frozen_clock(monkeypatch):
    class Clock:
        @staticmethod
        def monotonic() -> float:
            return 1299.0

    monkeypatch.setattr(history_mod, "time", Clock)
    import calconsole.panes.observation as obs_mod

    monkeypatch.setattr(obs_mod, "time", Clock)


def test_observation_pane_at_160x48_scripted_state(snap_compare, frozen_clock):
    # fault fired on chip0, chip1 slow x4, KV near full, 2 queued, pacing behind, 5 min of history
    assert snap_compare(ObservationHost(compact=False), terminal_size=(160, 48))


def test_observation_pane_at_80x24_compact(snap_compare, frozen_clock):
    assert snap_compare(ObservationHost(compact=True), terminal_size=(80, 24))
