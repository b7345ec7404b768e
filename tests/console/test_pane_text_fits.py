"""The panes' text fits and reads right on the screen a person sees (App.run_test + Pilot):
chat room and scrolling, readable sampling fields and their reset, wrapped user turns,
honest metrics for a cancelled reply, the per-layer table, maintenance hints and labels."""

from __future__ import annotations

import re

import pytest
from textual.widgets import Button

from calconsole.app import CalConsoleApp
from calconsole.layout import load_layout
from calconsole.panes.chat import PARAMS, PLACEHOLDERS, SYNTHETIC_BANNERS, figures_line, metrics_line, param_defaults
from calconsole.panes.maintenance import LABELS, MaintenancePane, fitted_label, fitted_tier
from calconsole.settings import Settings
from calconsole.widgets import render
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.planes import SamplingParams
from tests.console.pilot_helpers import chat_text, log_text, typed_step, wait_for


@pytest.fixture
def system(make_system):
    return make_system(pacing=Pacing(PacingMode.REALTIME, speed=1.0), drain_timeout_s=0.5)


@pytest.fixture
def fast_system(make_system):
    return make_system(drain_timeout_s=0.5)


def screen_text(app) -> str:
    """The whole screen as one line of text, rows joined (what capture-pane shows)."""
    strips = app.screen._compositor.render_strips()
    return re.sub(r"\s+", " ", " ".join(strip.text for strip in strips))


def visible_log_text(app, sel: str = "#chat-log") -> str:
    """The log lines inside its viewport right now (not those scrolled away)."""
    log = app.screen_stack[0].query_one(sel)
    top = round(log.scroll_y)
    shown = log.lines[top: top + log.scrollable_content_region.height]
    return re.sub(r"\s+", " ", " ".join(s.text for s in shown))


async def show_maintenance(pilot) -> None:
    """One pane at a time (below the layout's breakpoint, or forced): F3 shows the maintenance pane, as a person
    does; with the columns it is on screen already."""
    app = pilot.app
    if app.single:
        await pilot.press("f3")
        pane = app.query_one("#maintenance")
        assert await wait_for(pilot, lambda: pane.size.width > 0 and app._focused_pane() is pane)


async def send(pilot, text: str) -> None:
    app = pilot.app
    app.query_one("#chat-input").focus()
    await pilot.pause()
    await pilot.press(*text, "enter")


# --- 1. the transcript gets the room; PageUp / PageDown scroll it -------------------------------


@pytest.mark.parametrize(("size", "min_lines"), [((120, 36), 15), ((80, 24), 5)])
async def test_operator_chat_transcript_has_room_and_a_one_line_banner(fast_system, size, min_lines):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=size) as pilot:
        assert await wait_for(pilot, lambda: app.query_one("#chat-log").region.height >= min_lines)
        notice = app.query_one("#chat-notice")
        # one line, the longest form of the banner that fits, never cut to "…" (80x24 read "…is not…")
        assert notice.region.height == 1 and "synthetic weights" in screen_text(app)
        assert str(notice.render()) in SYNTHETIC_BANNERS and "…" not in str(notice.render())
        assert len(str(notice.render())) <= notice.region.width
        log = app.query_one("#chat-log")
        assert log.region.height >= min_lines, log.region
        assert app.query_one("#chat-params").collapsed
        assert "sampling parameters" in screen_text(app)  # the toggle is on screen at 80x24 too
        # the footer names the scroll keys (once the chat input has focus: bounded wait, the machine may be busy)
        assert await wait_for(pilot, lambda: "pgup/pgdn scroll" in screen_text(app)), screen_text(app)


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (160, 48)])
async def test_the_chat_input_placeholder_is_whole(fast_system, size):
    # at 80x24 it read "... Ctrl+L new chat · Ctrl+S", at 100x30 "... Ctrl+S sampling · PgUp/PgDn", cut
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=size) as pilot:
        inp = app.query_one("#chat-input")
        assert await wait_for(pilot, lambda: 0 < len(inp.placeholder) < inp.content_size.width)
        assert inp.placeholder in PLACEHOLDERS and inp.placeholder.startswith("Type a message, Enter to send")
        assert inp.placeholder in screen_text(app)  # drawn whole
        longer = PLACEHOLDERS[:PLACEHOLDERS.index(inp.placeholder)]
        assert all(len(p) >= inp.content_size.width for p in longer)  # the longest that fits


async def test_pageup_pagedown_scroll_the_transcript_from_the_input(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(120, 36)) as pilot:
        log = app.query_one("#chat-log")
        for i in range(60):
            log.write(f"line {i}")
        assert await wait_for(pilot, lambda: not log.pending and log.max_scroll_y > 0)
        log.scroll_end(animate=False)
        await pilot.pause()
        app.query_one("#chat-input").focus()
        assert "line 59" in visible_log_text(app)
        await pilot.press("pageup", "pageup")
        await pilot.pause()
        assert "line 59" not in visible_log_text(app) and app.focused.id == "chat-input"
        await pilot.press("pagedown", "pagedown", "pagedown")
        await pilot.pause()
        assert "line 59" in visible_log_text(app)


# --- 2. sampling fields readable at 120x36; reset to SamplingParams() defaults -------------------


def test_parameter_defaults_come_from_sampling_params():
    sp = SamplingParams()
    d = param_defaults()
    names = {pid: name for pid, _, _, name in PARAMS}
    engine_fields = set(SamplingParams.__struct_fields__)
    for pid, name in names.items():
        if name in engine_fields:
            v = getattr(sp, name)
            assert d[pid] == ("" if v is None else str(v)), name


async def test_sampling_fields_readable_at_120x36_and_reset_restores_defaults(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("f2", "shift+tab", "enter")  # onto the toggle, open it (as the trial did)
        assert await wait_for(pilot, lambda: not app.query_one("#chat-params").collapsed)
        screen = app.screen.region
        text = screen_text(app)
        for pid, label, _, _ in PARAMS:
            inp = app.query_one(f"#{pid}")
            assert screen.contains_region(inp.region), (pid, inp.region)  # every row on screen
            assert inp.content_region.width > max(len(inp.value), 4), (pid, inp.content_region)
            assert f"{label} {inp.value or 'none'}" in text, label  # label, then its whole value
        assert app.query_one("#chat-log").region.height >= 5  # the transcript keeps room
        app.query_one("#p-temperature").value = "0.2"
        app.query_one("#p-top-k").value = "5"
        app.query_one("#p-stop").value = "END"
        await pilot.press("ctrl+l")  # new chat keeps the parameters
        assert app.query_one("#p-top-k").value == "5"
        app.query_one("#p-reset").focus()
        await pilot.press("enter")
        await pilot.pause()
        assert {pid: app.query_one(f"#{pid}").value for pid, *_ in PARAMS} == param_defaults()
        assert app.query_one("#p-temperature").value == str(SamplingParams().temperature)


# --- 3. the user's turn wraps; 4. a cancelled reply's metrics say what is defined ---------------


async def test_long_user_turn_wraps_and_stays_visible_while_the_reply_streams(system):
    app = CalConsoleApp(system, load_layout("operator"))
    msg = "Hello, what is the status of the device? And what about the second chiplet?"
    async with app.run_test(size=(120, 36)) as pilot:
        app.query_one("#p-max-tokens").value = "400"
        await send(pilot, msg)
        chat = app.query_one("#chat")
        assert await wait_for(pilot, lambda: chat.handle is not None and chat._stream_text)
        # whole, while the stream box takes rows under the log
        assert await wait_for(pilot, lambda: msg in visible_log_text(app))
        assert app.query_one("#chat-stream").display
        await pilot.press("escape")
        assert await wait_for(pilot, lambda: chat.handle is None)
        text = chat_text(app)
        assert f"you {msg}" in text
        assert "[cancelled:" in text and "cancelled after" in text
        assert "TPOT/E2E are for finished replies only" in text
        assert "TTFT " in text and "E2E " not in text.replace("TPOT/E2E", "") and "stop none" not in text
        assert not app.query_one("#chat-stream").display


def test_metrics_line_for_finished_cancelled_and_failed_replies():
    from sim_backend.planes import Timings

    base = dict.fromkeys(Timings.__struct_fields__)

    class R:
        def __init__(self, status, n, ttft):
            t = dict(base, prompt_n=10, cache_n=2, predicted_n=n, ttft_ms=ttft, tpot_ms=12.0, e2e_ms=99.0,
                     numerics=True)
            self.timings = Timings(**t)
            self.status, self.stop_type, self.seed = status, "limit" if status == "finished" else "none", 7

    done = metrics_line(R("finished", 5, 30.0), 1.0)
    assert "TPOT 12.0 ms" in done and "E2E 99.0 ms" in done and "stop limit" in done
    cancelled = metrics_line(R("cancelled", 3, 30.0), 1.0)
    assert "cancelled after 3 tok · TTFT 30.0 ms" in cancelled
    assert "12.0" not in cancelled and "99.0" not in cancelled and "stop none" not in cancelled
    failed = metrics_line(R("failed", 0, None), 1.0)
    assert "failed after 0 tok · no token came" in failed and "TTFT" not in failed
    # the one line under a reply: the issue's own example, ms with three significant figures
    r = R("finished", 128, 127.2)
    r.timings = Timings(**dict(base, prompt_n=10, cache_n=0, predicted_n=128, ttft_ms=127.2, tpot_ms=17.08,
                              e2e_ms=2294.6, numerics=True))
    assert figures_line(r) == "  TTFT 127 ms · TPOT 17.1 ms · 128 tok · limit"
    assert figures_line(R("cancelled", 3, 30.0)) == "  cancelled after 3 tok · TTFT 30.0 ms"
    assert figures_line(R("failed", 0, None)) == "  failed after 0 tok · no token came"
    r.timings = Timings(**dict(base, prompt_n=10, cache_n=0, predicted_n=4, ttft_ms=9.0, tpot_ms=2.0,
                              e2e_ms=15.0, numerics=False))
    assert figures_line(r).endswith("· 4 tok · limit · timing-only")


# --- 5. the per-layer table -------------------------------------------------------------------


async def test_per_layer_table_shows_the_last_step_after_a_cancel(system):
    app = CalConsoleApp(system, load_layout("operator"))
    async with app.run_test(size=(120, 36)) as pilot:
        layers = app.query_one("#obs-layers")

        def shown() -> list[str]:
            return [strip.text for strip in layers.render_lines(layers.region.reset_offset)]

        assert await wait_for(pilot, lambda: any("no step yet" in ln for ln in shown()))
        app.query_one("#p-max-tokens").value = "2000"
        await send(pilot, "go on please")
        chat = app.query_one("#chat")
        assert await wait_for(pilot, lambda: chat.handle is not None and len(chat._stream_text) > 20)
        await pilot.press("escape")
        assert await wait_for(pilot, lambda: chat.handle is None)
        layers.scroll_visible(animate=False)

        def row_on_screen() -> bool:
            lines = shown()
            return any(re.match(r"\s*0-47\s+[\d.]+\s+[\d.]+\s+uniform\s+moe_dense_group", ln) for ln in lines)

        assert await wait_for(pilot, row_on_screen, timeout_s=10)


def test_slowest_category_fits_the_observation_pane_at_120_columns():
    def layer(i, us):
        return {"layer": i, "chip_us": (us, us), "category_us": {}, "slowest_category": "moe_dense_group"}

    step = {"kind": "prefill", "n_tokens": 14, "past_len": 0, "sim_us": 91e3, "h2d_us": 15.0, "infer_us": 91e3,
            "d2h_us": 40.0, "compute_wall_ms": 120.5, "layers": tuple(layer(i, 1000.0 + 10 * i) for i in range(48))}
    inner = 120 * 11 // 21 - 4  # the operator layout's observation column, borders and padding off
    from rich.console import Console

    console = Console(width=inner, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(render.layers_panel(typed_step(step)))
    text = console.export_text()
    assert "slowest category" in text
    assert text.count("moe_dense_group") == 48


# --- 6. maintenance: a hint outside exclusive mode, labels that tell memory and KV apart ----------


async def test_guarded_key_outside_exclusive_mode_says_enter_exclusive_first(fast_system):
    app = CalConsoleApp(fast_system, load_layout("operator"))
    async with app.run_test(size=(120, 36)) as pilot:
        await pilot.press("f3")
        await pilot.pause()
        for key in ("r", "c", "f"):
            await pilot.press(key)
        # the log keeps a line per key (live notifications expire after 4 s: under load some were gone)
        assert await wait_for(pilot, lambda: all(f"key {k}: enter exclusive mode first (x)" in log_text(app, "#m-log")
                                                 for k in ("r", "c", "f")))
        assert len(app.screen_stack) == 1  # no confirmation opened
        assert app.query_one("#maintenance").lease is None


# at 80x24 "auto" shows one pane at a time (F3: the maintenance pane at full width); "columns" (the palette's
# "Panes: side by side") keeps the narrow column the labels must still fit
@pytest.mark.parametrize(("size", "panes"), [((120, 36), "auto"), ((80, 24), "auto"), ((80, 24), "columns")])
async def test_maintenance_buttons_tell_memory_and_kv_apart(fast_system, size, panes):
    app = CalConsoleApp(fast_system, load_layout("operator"), settings=Settings(panes=panes))
    async with app.run_test(size=size) as pilot:
        await show_maintenance(pilot)

        def shown(sel: str) -> str:
            b = app.query_one(sel)
            return "".join(s.text for s in b.render_lines(b.region.reset_offset)).strip()

        keys = {"m-clear": "c ", "m-clearkv": "k ", "m-enter": "x ", "m-f-ccu": "1 ", "m-f-clear": "0 ", "m-ack": "a "}

        def settled() -> bool:
            """The labels are fitted to the laid-out widths (the pane does it after each layout): a row's
            long labels where they all fit, else its short ones. Wait for that, not for a time."""
            for row in app.query("#maintenance .m-row"):
                buttons = [b for b in row.query(Button) if b.id in LABELS]
                if not all(b.size.width for b in buttons):
                    return False
                which = fitted_tier([(b.id, b.size.width) for b in buttons])
                if any(str(b.label) != fitted_label(b.id, which) for b in buttons):
                    return False
            return True

        assert await wait_for(pilot, settled), {bid: shown(f"#{bid}") for bid in keys}
        mem, kv = shown("#m-clear"), shown("#m-clearkv")
        assert mem != kv and "mem" in mem.lower() or mem.startswith("Clr m"), (mem, kv)
        assert "KV" in kv, kv
        for b in app.query("#maintenance Button"):
            assert b.region.width > 0 and app.screen.region.contains_region(b.region), b.id
        # every label is distinct and leads with its key ("c Mem…", "k KV"): readable at any width
        labels = {b.id: shown(f"#{b.id}") for b in app.query("#maintenance Button")}
        assert len(set(labels.values())) == len(labels), labels
        for bid, key in keys.items():
            assert labels[bid].startswith(key), labels


@pytest.mark.parametrize("layout,size,panes", [("chat", (80, 24), "auto"), ("chat", (80, 24), "columns"),
                                               ("operator", (80, 24), "auto"), ("operator", (80, 24), "columns"),
                                               ("operator", (160, 48), "auto")])
async def test_no_maintenance_button_label_is_cut(fast_system, layout, size, panes):
    # at 80x24 in the chat layout's columns the buttons are 3-5 cells wide: "x Excl" read "x E…", "1 CCU" read
    # "1 …"; a row whose short labels do not all fit shows the keys alone (the footer and the help say what they
    # do). At 80x24 "auto" shows one pane at a time: F3 shows the maintenance pane, at full width
    app = CalConsoleApp(fast_system, load_layout(layout), settings=Settings(panes=panes))
    async with app.run_test(size=size) as pilot:
        await show_maintenance(pilot)

        def shown(b) -> str:
            return "".join(s.text for s in b.render_lines(b.region.reset_offset)).strip()

        def settled() -> bool:
            rows = [[b for b in row.query(Button) if b.id in LABELS] for row in app.query("#maintenance .m-row")]
            return all(all(b.size.width for b in r) and all(
                str(b.label) == fitted_label(b.id, fitted_tier([(c.id, c.size.width) for c in r])) for b in r)
                for r in rows)

        assert await wait_for(pilot, settled)
        buttons = list(app.query("#maintenance Button"))
        labels = {b.id: shown(b) for b in buttons}
        for b in buttons:
            assert labels[b.id] == str(b.label), (b.id, labels[b.id], str(b.label), b.size.width)  # whole
            assert labels[b.id].split(" ", 1)[0] == LABELS[b.id][0].split(" ", 1)[0], labels  # leads with its key
        assert len(set(labels.values())) == len(labels), labels
        if size == (160, 48):
            assert labels["m-enter"] == "x Exclusive" and labels["m-clear"] == "c Clear mem…", labels


def test_maintenance_styles_have_one_home():
    assert ".m-row" not in (MaintenancePane.DEFAULT_CSS or "")
    assert "#m-log" not in (MaintenancePane.DEFAULT_CSS or "")
