"""The device table keeps its columns in exclusive mode, a late fault gets its rows, the category heatmap
and bench realtime say what they show, and the start notes reach the console."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from rich.console import Console
from rich.text import Text
from textual.app import App
from textual.widgets import Static

from calconsole.panes.observation import ObservationPane
from calconsole.settings import Settings
from calconsole.widgets import render
from tests.console.pilot_helpers import typed, typed_step, wait_for

CSS = Path(__file__).resolve().parents[2] / "calconsole" / "styles.tcss"
SCRIPTED = json.loads((Path(__file__).parent / "data" / "scripted_snapshot.json").read_text())


def plain(renderable, width: int) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def _quiet(snap: dict) -> dict:
    """The scripted snapshot with no fault: a one-line faults row."""
    s = copy.deepcopy(SCRIPTED)
    d = s["device"]
    d.update(faults_fired=[], faults_in_effect=[], faults_armed=[], d2d_link_errors=0, status="ok", mode="serving",
             lease_holder=None)
    for c in d["chiplets"]:
        c.update(slow_factor=1.0, ccu_exceptions=0, state="ready")
    return s


def test_exclusive_mode_leaves_the_device_table_its_columns():
    # the board's state cell said "exclusive (lease: root@console)": at the 160x48 layout's pane width
    # (79 columns inside) it took the width of busy and jobs, shown as "…", and cut dev and health
    snap = _quiet(SCRIPTED)
    snap["device"].update(mode="exclusive", lease_holder="root@console")
    table = plain(render.device_table(typed(snap)), width=79).split("faults")[0]
    assert "…" not in table
    rows = table.splitlines()
    assert rows[0].split()[:5] == ["dev", "health", "state", "busy", "steps"]
    assert rows[1].split()[:3] == ["calculet0", "ok", "exclusive"]


class OnePane(App):
    CSS_PATH = str(CSS)

    def compose(self):
        yield ObservationPane(Settings(), id="observation", classes="pane")


async def test_a_fault_that_fires_later_gets_the_rows_its_line_needs():
    # the device section was re-laid out only when its chip count changed: a faults line that grew to
    # three rows (a link error's detail) kept the one row it had, cut, until something else moved
    quiet = _quiet(SCRIPTED)
    fired = copy.deepcopy(quiet)
    fired["device"].update(status="fault", d2d_link_errors=1, faults_fired=[
        {"fault": "link_error", "detail": "chip0->chip1 embedding broadcast, job 129 (prefill)"}])
    app = OnePane()
    async with app.run_test(size=(81, 48)) as pilot:
        pane = app.query_one(ObservationPane)
        pane.update_snapshot(typed(quiet))
        dev = app.query_one("#obs-device", Static)
        assert await wait_for(pilot, lambda: dev.size.height > 0)
        before = dev.size.height
        pane.update_snapshot(typed(fired))
        need = len(plain(render.device_table(typed(fired)), width=dev.content_region.width).rstrip("\n").splitlines())
        assert need > before
        assert await wait_for(pilot, lambda: dev.size.height >= need)


def test_bench_realtime_says_when_no_measured_length_keeps_real_time():
    # "numeric prompt limit ...: 0 tokens" beside "prefill 128 tok: 1.00": the RTF was 0.998
    from calconsole.bench.realtime import limit_line

    rep = {"worker": {"prefill_rtf": {"128": 0.998, "256": 0.58}}, "numeric_limit_tokens": 0}
    line = limit_line(rep, ["worker"])
    assert "0 tokens" not in line and "none of the measured" in line and "128 tokens fell behind (RTF 0.998" in line
    rep = {"worker": {"prefill_rtf": {"128": 1.2, "256": 0.58}}, "numeric_limit_tokens": 128}
    assert limit_line(rep, ["worker"]).endswith(": 128 tokens; 256 tokens fell behind (RTF 0.580 < 1)")
    rep = {"in_process": {"prefill_rtf": {"8": 3.0}}, "numeric_limit_tokens": 8}
    assert limit_line(rep, ["in_process"]).endswith(": 8 tokens")


def test_category_heatmap_says_its_cells_sum_both_chips():
    # "moe_dense_group max 5705 µs ... µs sim per layer" beside a layer of ~3035 µs per chip
    step = SCRIPTED["last_decode"]
    cats = render.layers_heatmap(typed_step(step), "category", 120).plain
    moe = max(sum(lay["category_us"]["moe_dense_group"]) for lay in step["layers"])
    assert f"max {moe:.0f} µs" in cats and "both chips summed" in cats
    assert "both chips summed" not in render.layers_heatmap(typed_step(step), "chip", 120).plain


async def test_start_notes_are_shown_in_the_console(make_system):
    # "--connect URL --host-time modeled": the note went to stderr, hidden by the full-screen console
    from calconsole.app import CalConsoleApp
    from calconsole.layout import load_layout

    app = CalConsoleApp(make_system(numerics=False), load_layout("operator"),
                        start_notes=("--host-time modeled: with --connect the simulator options are the server's, "
                                     "not applied here",))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.pause()
        assert any("not applied here" in n.message for n in app._notifications)
        await pilot.press("ctrl+q")


def test_the_console_passes_the_ignored_options_note(monkeypatch):
    import calconsole.cli as cli

    seen = {}

    class FakeApp:
        def __init__(self, system, layout, **kw):
            seen.update(kw)

        def run(self):
            return None

    class FakeSystem:
        maintenance = None
        kind = "calconsole"  # what --connect found at the URL (remote planes say it)

        def close(self):
            seen["closed"] = True

    monkeypatch.setattr("calconsole.app.CalConsoleApp", FakeApp)
    monkeypatch.setattr("calconsole.commands.common.connect_from_args", lambda args, admin: FakeSystem())
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True, raising=False)
    assert cli.main(["--connect", "http://127.0.0.1:9", "--host-time", "measured"]) == 0
    assert seen["closed"] and any("--host-time measured" in n for n in seen["start_notes"])


def test_the_device_tables_counted_width_is_richs_measure_at_every_level():
    # the width is counted from the cells (Rich's measure cost ~2 ms a level, up to seven levels twice a
    # second on the UI thread): the count must be what Rich measures, or a level that does not fit is drawn
    from calconsole.widgets.render import device as dev

    faulty = copy.deepcopy(SCRIPTED)
    faulty["device"]["chiplets"][1].update(slow_factor=2.5, ccu_exceptions=3, state="fault")
    exclusive = _quiet(SCRIPTED)
    exclusive["device"].update(mode="exclusive", lease_holder="root@console")
    for snap in (SCRIPTED, _quiet(SCRIPTED), faulty, exclusive):
        for level in range(len(dev.DEVICE_LEVELS)):
            table = dev._device_rows(typed(snap), level)
            # the counted path, not its fallback to Rich's measure
            assert all(isinstance(cell, (str, Text)) for col in table.columns for cell in col._cells)
            assert dev._table_width(table) == dev._rich_width(table), level
