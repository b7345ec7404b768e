"""Observation pane sections (fold, reorder, focus; kept in the settings file), the batch occupancy of a
batch-N variant bundle, and which SLO each panel names."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console
from textual.widgets import Static

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.panes.observation import SECTION_WIDGET, ObservationPane
from calconsole.settings import SECTIONS, Settings, SettingsError, load_settings, save_sections, settings_path
from calconsole.widgets import render
from calconsole.widgets.help import HelpScreen
from sim_backend.bundle.manifest import DEFAULT_BUNDLE_DIR
from sim_backend.planes import ChatRequest, SamplingParams
from tests.console.pilot_helpers import typed, wait_for

B8 = DEFAULT_BUNDLE_DIR.parent / "qwen3-30b-a3b-b8"
SCRIPTED = json.loads((Path(__file__).parent / "data" / "scripted_snapshot.json").read_text())


def plain(renderable, width: int = 160) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def shown(pane: ObservationPane, name: str) -> str:
    return plain(pane.query_one(SECTION_WIDGET[name], Static).content)


def displayed(pane: ObservationPane) -> list[str]:
    """The sections on screen, top to bottom (widget order and display)."""
    ids = {w: n for n, w in SECTION_WIDGET.items()}
    return [ids[f"#{w.id}"] for w in pane.children if f"#{w.id}" in ids and w.display]


@pytest.fixture
def system(make_system):
    return make_system(numerics=False, drain_timeout_s=0.5)


async def test_fold_move_focus_by_key_are_saved_and_restored_at_start(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(ObservationPane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        await pilot.press("f1")
        assert displayed(pane)[:4] == ["device", "thresholds", "graphs", "requests"]  # batch 1: no batches
        assert "batches" not in pane.listed()
        # ] selects the next section (batches skipped), z folds it: gone from the pane, ▸name in the bar
        await pilot.press("right_square_bracket", "right_square_bracket", "right_square_bracket")
        assert pane.selected == "requests"
        await pilot.press("z")
        await pilot.pause()
        assert "requests" not in displayed(pane) and "▸requests" in plain(pane.query_one("#obs-sections").content)
        # { moves the selected section up past the graphs (folded or not, it keeps its place in the order)
        await pilot.press("left_square_bracket", "left_curly_bracket")  # graphs up, above thresholds
        await pilot.pause()
        assert displayed(pane)[:3] == ["device", "graphs", "thresholds"]
        await pilot.press("right_curly_bracket", "right_curly_bracket")  # down past thresholds, then requests
        assert pane.order[:5] == ["device", "thresholds", "batches", "requests", "graphs"]
        await pilot.press("left_curly_bracket")  # and back above requests (batches, not on this bundle, not counted)
        assert pane.order[:5] == ["device", "thresholds", "batches", "graphs", "requests"]
        assert displayed(pane)[:3] == ["device", "thresholds", "graphs"]
        # f: the selected section alone; ] shows the next one alone; f (or Esc) every section again
        await pilot.press("f")
        await pilot.pause()
        assert displayed(pane) == ["graphs"] and pane.has_class("-focus-graphs")
        await pilot.press("right_square_bracket")
        await pilot.pause()
        assert displayed(pane) == ["requests"]  # focus shows it whether folded or not
        assert "TTFT" in shown(pane, "requests")  # rendered at once, not blank until a later refresh
        saved = yaml.safe_load(settings_path().read_text())["sections"]
        assert saved["focus"] == "requests" and saved["folded"] == ["requests"]
        assert saved["order"] == list(pane.order)
        await pilot.press("escape")
        await pilot.pause()
        assert "requests" not in displayed(pane) and len(displayed(pane)) == len(SECTIONS) - 2
    # a new console from the settings file: the same arrangement
    restored = load_settings()
    assert restored.section_order == tuple(saved["order"]) and restored.sections_folded == ("requests",)
    app2 = CalConsoleApp(system, load_layout("operator"), settings=restored)
    async with app2.run_test(size=(160, 48)) as pilot:
        pane = app2.query_one(ObservationPane)
        assert await wait_for(pilot, lambda: app2.last_snapshot is not None)
        await pilot.pause()
        assert pane.order == list(saved["order"]) and "requests" not in displayed(pane)
        assert displayed(pane)[:3] == ["device", "thresholds", "graphs"]
        await pilot.press("f1", "Z")  # unfold all
        await pilot.pause()
        assert "requests" in displayed(pane)
    assert load_settings().sections_folded == ()


async def test_palette_folds_focuses_moves_and_resets_sections(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(ObservationPane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        cmds = {c.title: c for c in app.get_system_commands(app.screen)}
        for name in pane.listed():
            for what in ("fold", "focus (shown alone)", "move up", "move down"):
                assert f"Section {name}: {what}" in cmds, (name, what)
        cmds["Section memory: fold"].callback()
        cmds["Section host: move up"].callback()
        await pilot.pause()
        assert "memory" not in displayed(pane)
        assert pane.order.index("jobs") < pane.order.index("host") < pane.order.index("memory")
        cmds = {c.title: c for c in app.get_system_commands(app.screen)}
        assert "Section memory: unfold" in cmds  # the palette says what the command will do
        cmds["Section per-layer: focus (shown alone)"].callback()
        await pilot.pause()
        assert displayed(pane) == ["per-layer"]
        cmds["Sections: show every section (leave focus)"].callback()
        cmds["Sections: default arrangement"].callback()
        await pilot.pause()
        assert pane.order == list(SECTIONS) and not pane.folded and pane.focused_section is None
        # "save settings" writes the arrangement too (with the rest)
        cmds["Section kv: fold"].callback()
        cmds["Save settings"].callback()
        assert load_settings().sections_folded == ("kv",)


async def test_compact_keeps_its_sections_whatever_is_folded_and_focus_works_there(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(80, 24)) as pilot:
        pane = app.query_one(ObservationPane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        assert pane.compact
        await pilot.press("f1", "z")  # fold the device table: compact still shows it
        await pilot.pause()
        assert displayed(pane) == ["device", "thresholds", "graphs"]
        assert not pane.query_one("#obs-sections").display  # no bar in compact, but a notification
        await pilot.press("right_square_bracket")
        await pilot.pause()
        assert any("section thresholds selected" in n.message for n in app._notifications)
        for _ in range(3):
            await pilot.press("right_square_bracket")
        assert pane.selected == "per-layer"
        await pilot.press("f")  # at 80x24 the per-layer view alone, full height
        await pilot.pause()
        assert displayed(pane) == ["per-layer"] and pane.query_one("#obs-sections").display
        await pilot.press("f")
        await pilot.pause()
        assert displayed(pane) == ["device", "thresholds", "graphs"]


async def test_help_lists_the_section_keys(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        await pilot.press("f1", "question_mark")
        assert await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        text = plain(app.screen.content, 200)
        for needle in ("previous section", "fold", "move section up", "move section down", "focus section",
                       "unfold every section", "show every section (leave focus)", "saved in the settings file"):
            assert needle in text, needle


@pytest.mark.parametrize(("text", "key"), [
    ("sections: {order: [device, nope]}\n", "sections.order"),
    ("sections: {order: [device, device]}\n", "sections.order"),
    ("sections: {folded: memory}\n", "sections.folded"),
    ("sections: {focus: everything}\n", "sections.focus"),
    ("sections: {hidden: [kv]}\n", "sections.hidden"),
    ("sections: [kv]\n", "sections"),
])
def test_bad_sections_settings_name_the_file_and_the_key(tmp_path, text, key):
    cfg = tmp_path / "config.yaml"
    cfg.write_text(text)
    with pytest.raises(SettingsError) as ei:
        load_settings(cfg, environ={})
    assert ei.value.key == key and str(cfg) in str(ei.value)


def test_a_partial_order_gets_the_other_sections_appended_and_saving_keeps_the_other_keys(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("theme: nord\nsections: {order: [host, device], folded: [kv], focus: null}\n")
    s = load_settings(cfg, environ={})
    assert s.section_order[:2] == ("host", "device") and sorted(s.section_order) == sorted(SECTIONS)
    save_sections(s.replace(sections_folded=("memory",), section_focus="graphs"))
    again = load_settings(cfg, environ={})
    assert again.theme == "nord" and again.sections_folded == ("memory",) and again.section_focus == "graphs"
    cfg.write_text("a: [\n")  # unreadable since start-up: not overwritten
    with pytest.raises(SettingsError):
        save_sections(s)
    assert cfg.read_text() == "a: [\n"


# --- batch occupancy on a batch-N variant --------------------------------------------------------------


async def test_b8_bundle_shows_batch_occupancy_and_slots_of_two_chats_decoding_together(make_system):
    system = make_system(bundle_dir=B8, numerics=False, maintenance=False)
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(ObservationPane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        await pilot.pause()
        assert "batches" in pane.listed() and "batches" in displayed(pane)
        # the device holds the second decode step both chats ride in until the screen has been read: the
        # newest rows then show them decoding together however the host schedules the two admissions (on a
        # loaded host the second chat joined late and the newest six rows were the first one's alone)
        held, release, execute, together = threading.Event(), threading.Event(), system.board._execute, [0]

        def execute_held(job: Any, gen: int) -> None:
            if job.kind == "decode" and len(job.batch) == 2:
                together[0] += 1
                if together[0] == 2:
                    held.set()
                    release.wait(60)
            execute(job, gen)

        system.board._execute = execute_held
        try:
            hs = [system.inference.submit(ChatRequest(messages=({"role": "user", "content": f"chat {i}"},),
                                                      max_tokens=12, sampling=SamplingParams.greedy(seed=1)))
                  for i in range(2)]
            assert held.wait(60), "the two chats never rode in one decode step twice"
            assert await wait_for(pilot, lambda: " 2/8 " in shown(pane, "batches"))
            text = shown(pane, "batches")
        finally:
            release.set()
        for h in hs:
            h.result(60)
        assert "C3 variant: batch-8 decode calbin" in text and "not the product" in text
        assert "max 2/8" in text
        rows = [line for line in text.splitlines() if " 2/8 " in line]
        assert rows and all("■■··" in line for line in rows)  # slots 0 and 1 rode, 2 and 3 did not
        ids = {h.id for h in hs}
        assert any(set(map(int, line.split("■■··")[1].replace(",", " ").split())) == ids for line in rows)
        assert "C3 decode batch 8" in shown(pane, "device")
        pane.show_kind = "last_decode"
        pane._refresh_layers()
        snap = app.last_snapshot
        assert snap.last_decode.batch_seq_ids
        layers = shown(pane, "per-layer")
        assert "batched decode step" in layers and "/8 rows" in layers and "batched decode:" in layers


async def test_production_bundle_says_decode_batch_1_and_nothing_more(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(160, 48)) as pilot:
        pane = app.query_one(ObservationPane)
        assert await wait_for(pilot, lambda: app.last_snapshot is not None)
        await pilot.pause()
        device = shown(pane, "device")
        assert "decode batch 1" in device and "C3" not in device and "what-if" not in device
        assert "batches" not in displayed(pane) and "batches" not in plain(pane.query_one("#obs-sections").content)


# --- which SLO ---------------------------------------------------------------------------------------


def test_header_and_requests_panel_name_the_same_slo_when_the_console_built_the_engine():
    s = Settings()
    snap = copy.deepcopy(SCRIPTED)
    snap["requests"]["goodput"]["slo"] = {"ttft_ms": s.slo_ttft_ms, "tpot_ms": s.slo_tpot_ms, "e2el_ms": None}
    header = render.header_line(typed(snap), s).plain
    req = plain(render.requests_panel(typed(snap), s), 200)
    assert "console SLO 50" in header
    assert "goodput against the console SLO (TTFT <= 2000, TPOT <= 50 ms sim" in req and "no SLO" not in req
    # an engine without an SLO (attached to a server started without one): said, and the header's SLO named
    snap["requests"]["goodput"]["slo"] = {"ttft_ms": None, "tpot_ms": None, "e2el_ms": None}
    req = plain(render.requests_panel(typed(snap), s), 200)
    assert "the engine checks no SLO" in req and "header colours: console SLO TTFT 2000 / TPOT 50 ms" in req
    # a different engine SLO: both named, each as what it is
    snap["requests"]["goodput"]["slo"] = {"ttft_ms": 500.0, "tpot_ms": 30.0, "e2el_ms": None}
    req = plain(render.requests_panel(typed(snap), s), 200)
    assert "engine's SLO (TTFT <= 500, TPOT <= 30 ms sim)" in req and "console SLO TTFT 2000 / TPOT 50" in req


def test_the_console_gives_its_slo_to_the_engine(monkeypatch):
    """``calconsole`` (in-process) builds the engine with the settings' SLO, so goodput checks that one."""
    import calconsole.commands.common as common
    from calconsole import cli

    seen = {}

    def fake_build(args, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(common, "build_from_args", fake_build)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    args = cli.build_parser().parse_args(["--layout", "operator"])
    assert cli.run_console(args, Settings().replace(slo_tpot_ms=42.0)) == 2
    assert seen["slo"].tpot_ms == 42.0 and seen["slo"].ttft_ms == 2000.0
