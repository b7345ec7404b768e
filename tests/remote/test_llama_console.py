"""The console and the headless commands attached to a REAL llama-server (xllamacpp + SmolLM2, the session fixture).

Every wait is bounded (``wait_for``); the server is shared by the session, so the tests read deltas
and the slots' states, never absolute counters.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console
from textual.widgets import Static

from calconsole.app import CalConsoleApp
from calconsole.cli import main
from calconsole.layout import load_layout
from calconsole.remote import NotAServer, connect
from tests.console.pilot_helpers import chat_text, confirm_ask, log_text, wait_for

MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def topbar(app: CalConsoleApp) -> str:
    return str(app.query_one("#topbar", Static).render())


def shown(app: CalConsoleApp, sel: str) -> str:
    """A section's text as drawn (rich renders its content at the console's width)."""
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(app.screen_stack[0].query_one(sel, Static).content)
    return console.export_text()


def slots_idle(url: str) -> bool:
    return not any(s["is_processing"] for s in httpx.get(url + "/slots", timeout=5).json())


@contextlib.contextmanager
def busy_slot(url: str) -> Iterator[None]:
    """Hold one slot of the real server processing: a streamed /completion that ignores EOS (up to 2,000
    tokens, ~40 s at one thread) read in a thread until the block ends; closing the stream makes
    llama-server cancel the task. Yields once the first token has arrived (the slot is processing)."""
    started, stop = threading.Event(), threading.Event()
    body = {"prompt": "Once upon a time", "n_predict": 2000, "ignore_eos": True, "stream": True}

    def run() -> None:
        with httpx.stream("POST", url + "/completion", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    started.set()
                if stop.is_set():
                    break
        started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert started.wait(60), "the real server never started streaming"
        yield
    finally:
        stop.set()
        t.join(60)


async def test_the_console_names_the_server_fills_slots_while_streaming_and_shows_a_readable_reply(
        llama_server: Any, tmp_path: Path) -> None:
    system = connect(llama_server.url, audit_path=tmp_path / "audit.jsonl")
    try:
        app = CalConsoleApp(system, load_layout("operator"), refresh_hz=4)
        async with app.run_test(size=(170, 50)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            bar = topbar(app)
            assert "calconsole llama-server b" in bar and f"model {MODEL}" in bar
            assert f"attached to {llama_server.url}" in bar
            # the device-only sections say they are not reported, never show zeros
            assert await wait_for(pilot, lambda: "not reported by llama-server" in shown(app, "#obs-kv"))
            assert "not reported by llama-server" in shown(app, "#obs-jobs")
            assert "not reported by llama-server" in shown(app, "#obs-device")
            # the slots section shows a slot processing while a request runs: a streamed request that
            # ignores EOS holds one slot busy until this test closes it (the chat reply below may end at
            # EOS after a few tokens, faster than a 4 Hz poll of /slots)
            with busy_slot(llama_server.url):
                assert await wait_for(pilot, lambda: any(s.state == "processing"
                                                         for s in app.last_snapshot.slots), timeout_s=30)
                assert await wait_for(pilot, lambda: "processing" in shown(app, "#obs-slots"))
            assert await wait_for(pilot, lambda: slots_idle(llama_server.url), timeout_s=30)
            app.query_one("#p-max-tokens").value = "96"
            app.query_one("#p-temperature").value = "0"
            await pilot.click("#chat-input")
            await pilot.press(*"Write one sentence about the sea.")
            await pilot.press("enter")
            assert await wait_for(pilot, lambda: app.query_one("#chat").handle is None, timeout_s=60)
            # the log renders a reply in slices: wait for its figures line to be drawn
            chat = app.query_one("#chat")
            assert await wait_for(pilot, lambda: " tok · " in log_text(app, "#chat-log") and chat.full_figures)
            assert "wall ms" in str(chat.border_title)  # the one-line figures are wall ms, said once
            log = chat_text(app)
            reply = log.split("model ", 1)[1].split(" TTFT ", 1)[0]
            assert "\ufffd" not in log
            assert re.search(r"[A-Za-z]+( [A-Za-z]+){2,}", reply), reply  # words of ASCII letters and spaces
            # the server's timings as wall ms, and the latencies measured here as client
            assert "(server wall)" in log and "(client wall)" in log
            assert await wait_for(pilot, lambda: app.last_snapshot.requests.counters.finished == 1)
            assert await wait_for(pilot, lambda: "client wall ms" in shown(app, "#obs-requests"))
    finally:
        system.close()


async def test_cancel_in_the_chat_pane_frees_the_slot(llama_server: Any, tmp_path: Path) -> None:
    system = connect(llama_server.url, audit_path=tmp_path / "audit.jsonl")
    try:
        app = CalConsoleApp(system, load_layout("operator"), refresh_hz=4)
        async with app.run_test(size=(170, 50)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            # greedy: a long story on every run (a sampled reply could end at EOS before Esc lands)
            app.query_one("#p-max-tokens").value = "1500"
            app.query_one("#p-temperature").value = "0"
            await pilot.click("#chat-input")
            await pilot.press(*"Tell me a very long story about a lighthouse")
            await pilot.press("enter")
            chat = app.query_one("#chat")
            assert await wait_for(pilot, lambda: chat.handle is not None and chat._stream_text, timeout_s=30)
            assert not slots_idle(llama_server.url)
            await pilot.press("escape")
            assert await wait_for(pilot, lambda: chat.handle is None, timeout_s=20)
            assert await wait_for(pilot, lambda: "[cancelled" in log_text(app, "#chat-log"))
            assert await wait_for(pilot, lambda: slots_idle(llama_server.url), timeout_s=20)
            assert await wait_for(pilot, lambda: app.last_snapshot.requests.counters.cancelled == 1)
    finally:
        system.close()


async def test_a_maintenance_action_llama_server_lacks_is_refused_with_the_reason(llama_server: Any,
                                                                                  tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    system = connect(llama_server.url, audit_path=audit)
    try:
        app = CalConsoleApp(system, load_layout("operator"))
        async with app.run_test(size=(170, 50)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            pane = app.query_one("#maintenance")
            assert app.query_one("#m-reset").disabled and not app.query_one("#m-health").disabled
            # only what llama-server offers is drawn: no reset, CCU / D2D fault or register action
            for sel in ("#m-reset", "#m-enter", "#m-f-ccu", "#m-f-link", "#m-reg-read"):
                assert not app.query_one(sel).display, sel
            assert not app.query_one("#m-row-faults").display and not app.query_one("#m-row-reg").display
            assert app.query_one("#m-health").display and app.query_one("#m-clearkv").display
            await pilot.press("f3")
            assert await wait_for(pilot, lambda: app._focused_pane() is pane)
            # the footer, the help and the palette name its keys only (80x24 read "x exclusive  l leave excl.
            # r reset  c clear mem"); the others still answer, refused (below)
            footer = {b.binding.description for b in app.active_bindings.values() if b.enabled and b.binding.show}
            assert {"health", "clear KV"} <= footer and not footer & {"exclusive", "reset", "clear mem", "CCU fault"}
            assert [b.description for b in pane.help_bindings() if b.action != "app.help"] == ["health", "clear KV"]
            palette = [c.title for c in app.get_system_commands(app.screen)]
            assert "Maintenance: health check" in palette and "Maintenance: clear KV cache" in palette
            assert not [t for t in palette if t.startswith("Maintenance: ") and t not in
                        ("Maintenance: health check", "Maintenance: clear KV cache")], palette
            obs = app.query_one("#observation")  # no per-layer steps on a llama-server: no t / h keys
            assert not obs.check_action("toggle_step", ()) and not obs.check_action("toggle_heat", ())
            assert not [t for t in palette if t.startswith("Per-layer")], palette
            await pilot.press("x")
            assert await wait_for(pilot, lambda: "not offered by llama-server: it has no exclusive mode"
                                  in log_text(app, "#m-log"))
            assert pane.lease is None
            # this fixture runs without --slot-save-path: llama-server refuses even slot erase, and says so
            await pilot.press("k")
            await confirm_ask(pilot)
            assert await wait_for(pilot, lambda: "--slot-save-path" in log_text(app, "#m-log"))
        records = [json.loads(line) for line in audit.read_text().splitlines()]
        done = [r for r in records if r["phase"] == "finished"]
        assert [r["action"] for r in done] == ["enter_exclusive", "clear_kv"]
        assert all(not r["granted"] and r["origin"] == {"server": llama_server.url, "kind": "llama-server",
                                                        "via": "http"} for r in done)
    finally:
        system.close()


def test_slot_actions_of_a_server_with_a_slot_save_path(llama_server_slot_save: Any, tmp_path: Path) -> None:
    url = llama_server_slot_save.url
    with connect(url, audit_path=tmp_path / "audit.jsonl") as system:
        from sim_backend.planes import ChatRequest, MaintenanceArgumentError

        system.inference.generate(ChatRequest.from_prompt("hi", max_tokens=2), timeout=60)
        mnt = system.maintenance
        saved = mnt.save_slot(None, 0, "slot0.bin")
        assert saved["ok"] and saved["server"]["filename"] == "slot0.bin"
        assert mnt.restore_slot(None, 0, "slot0.bin")["ok"]
        assert mnt.clear_kv(None)["ok"]
        with pytest.raises(MaintenanceArgumentError, match="plain file name"):
            mnt.save_slot(None, 0, "../escape.bin")
        with pytest.raises(MaintenanceArgumentError, match="slot must be"):
            mnt.erase_slot(None, 7)
        statuses = [(e["action"], e["status"]) for e in mnt.audit.entries()]
        assert statuses == [("save_slot", "granted"), ("restore_slot", "granted"), ("clear_kv", "granted"),
                            ("save_slot", "refused"), ("erase_slot", "refused")]


def test_snapshot_watch_of_a_llama_server_prints_three_json_lines(llama_server: Any, capsys: Any) -> None:
    assert main(["snapshot", "--connect", llama_server.url, "--watch", "--interval", "0.25", "--count", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    snaps = [json.loads(line) for line in lines]
    assert all(s["server"]["kind"] == "llama-server" and s["device"] is None and s["kv"] is None for s in snaps)
    assert all(len(s["slots"]) == 2 and s["server"]["health"] == "ok" for s in snaps)
    assert snaps[0]["taken_unix_s"] < snaps[1]["taken_unix_s"] < snaps[2]["taken_unix_s"]


def test_headless_commands_on_a_llama_server(llama_server: Any, capsys: Any, tmp_path: Path) -> None:
    url = llama_server.url
    assert main(["snapshot", "--connect", url]) == 0
    out = capsys.readouterr().out
    assert "llama-server" in out and "not reported by llama-server" in out
    assert main(["metrics", "--connect", url]) == 0
    assert "llamacpp:tokens_predicted_total" in capsys.readouterr().out
    assert main(["chat", "--connect", url, "--max-tokens", "4", "--temperature", "0", "Say hi"]) == 0
    err = capsys.readouterr().err
    assert "measured here as client" in err and "its wall clock" in err
    log = str(tmp_path / "audit.jsonl")
    with connect(url, audit_path=log) as system:
        with pytest.raises(Exception, match="not offered by llama-server"):
            system.maintenance.reset(None)
    assert main(["audit", "--connect", url, "--audit-log", log, "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert [(e["action"], e["status"]) for e in entries] == [("reset", "refused")]
    assert main(["drill", "--connect", url]) == 2
    assert "is a llama-server, which offers none of them" in capsys.readouterr().err


class _NotLlama(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        body = b'{"hello": "world"}'
        self.send_response(200 if self.path == "/props" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _NotLlama)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(5)


def test_a_url_that_is_neither_kind_is_a_clear_error_at_start_up(other_server: str, capsys: Any) -> None:
    with pytest.raises(NotAServer, match="neither a calconsole server nor a llama-server"):
        connect(other_server)
    assert main(["snapshot", "--connect", other_server]) == 2
    err = capsys.readouterr().err
    assert "neither a calconsole server nor a llama-server" in err and "Traceback" not in err


async def test_a_stopped_llama_server_shows_disconnected_and_the_console_recovers(tmp_path: Path) -> None:
    from tests.real.llama_server import start_llama_server

    first = start_llama_server(n_parallel=1, n_ctx=512)
    again = None
    system = connect(first.url, audit_path=tmp_path / "audit.jsonl")
    try:
        app = CalConsoleApp(system, load_layout("operator"), refresh_hz=4)
        async with app.run_test(size=(170, 50)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            first.stop()
            assert await wait_for(pilot, lambda: "DISCONNECTED since" in topbar(app), timeout_s=20)
            assert app.last_snapshot is not None  # the last snapshot stays on screen
            again = start_llama_server(n_parallel=1, n_ctx=512, port=first.port)
            assert await wait_for(pilot, lambda: "DISCONNECTED" not in topbar(app), timeout_s=30)
            assert system.connected and "llama-server b" in topbar(app)
    finally:
        system.close()
        first.stop()
        if again is not None:
            again.stop()


def test_a_stop_word_is_reported_as_llama_cpp_reports_it(llama_server: Any, tmp_path: Path) -> None:
    from sim_backend.planes import ChatRequest, SamplingParams

    with connect(llama_server.url, audit_path=tmp_path / "audit.jsonl") as system:
        req = ChatRequest.from_prompt("Name three colors.", max_tokens=20, sampling=SamplingParams(temperature=0.0))
        free = system.inference.generate(req, timeout=60)
        assert free.status == "finished" and free.stop_type in ("eos", "limit")
        words = free.text.split()
        assert len(words) >= 2, free.text
        stopped = system.inference.generate(ChatRequest.from_prompt("Name three colors.", max_tokens=20,
                                                                    sampling=SamplingParams(temperature=0.0),
                                                                    stop=(words[1],)), timeout=60)
        assert (stopped.stop_type, stopped.stopping_word) == ("word", words[1])
        assert words[1] not in stopped.text


def test_bench_poll_prints_the_cost_of_observing_a_llama_server(llama_server: Any, capsys: Any) -> None:
    assert main(["bench", "poll", "--connect", llama_server.url, "--count", "3", "--console", "0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["server"] == "llama-server" and out["snapshots"] == 3
    assert 0 < out["wall_ms_p50"] <= out["wall_ms_max"] and out["cpu_ms_per_snapshot"] > 0
    assert main(["bench", "poll"]) == 2 and "give --connect URL" in capsys.readouterr().err
    assert main(["bench", "poll", "--connect", llama_server.url, "--count", "0"]) == 2


def test_a_json_schema_constrained_chat_on_the_real_server_parses(llama_server: Any, tmp_path: Path) -> None:
    """The llama-server planes send a request's grammar in llama-server's own fields (``json_schema`` on a
    chat, ``grammar`` GBNF on a raw /completion prompt) and the real server constrains its reply by them:
    greedy SmolLM2 on its own would answer in prose."""
    from sim_backend.planes import ChatRequest, Grammar, SamplingParams

    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
    greedy = SamplingParams(temperature=0.0)
    with connect(llama_server.url, audit_path=tmp_path / "audit.jsonl") as system:
        req = ChatRequest.from_prompt("Describe a sailor in one sentence.", max_tokens=48, sampling=greedy,
                                      grammar=Grammar("json_schema", json.dumps(schema)))
        res = system.inference.generate(req, timeout=120)
        assert res.status == "finished" and res.stop_type == "eos", (res.stop_type, res.text)
        obj = json.loads(res.text)
        assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and len(obj["name"]) <= 12
        assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120, obj
        plain = system.inference.generate(ChatRequest.from_prompt("Describe a sailor in one sentence.",
                                                                  max_tokens=16, sampling=greedy), timeout=120)
        with pytest.raises(ValueError):
            json.loads(plain.text)  # without the schema the same prompt is prose: the field did the work
        ids = tuple(system.inference.tokenize("Is the sea salty? Answer:"))
        raw = system.inference.generate(ChatRequest(messages=(), prompt_tokens=ids, max_tokens=8, sampling=greedy,
                                                    grammar=Grammar("gbnf", 'root ::= " yes" | " no"')),
                                        timeout=120)
        assert raw.status == "finished" and raw.text in (" yes", " no"), raw.text


#: a llama-server's /metrics after one 32-token prompt and 8 generated tokens (llama.cpp 2026.10, as served)
LLAMACPP_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 32
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 8
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 39
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
"""


def test_every_llamacpp_family_the_server_sends_is_read() -> None:
    """``n_tokens_max`` is a counter without the ``_total`` suffix: prometheus_client's parser renames its
    sample ``..._total``; it is read all the same (it was None in every llama-server snapshot)."""
    from calconsole.remote.llamacpp import parse_metrics

    got = parse_metrics(LLAMACPP_METRICS)
    assert got == {"prompt_tokens_total": 32, "tokens_predicted_total": 8, "n_tokens_max": 39,
                   "requests_processing": 0}


def test_an_idle_slot_keeps_its_last_task_as_llama_server_reports_it() -> None:
    from calconsole.remote.llamacpp import slot_view

    never = slot_view({"id": 0, "n_ctx": 8192, "is_processing": False})
    assert (never.state, never.request_id, never.last_request_id, never.prompt_n, never.params) == \
        ("idle", None, None, None, {})
    ran = slot_view({"id": 1, "n_ctx": 8192, "is_processing": False, "id_task": 7, "n_prompt_tokens": 39,
                     "n_prompt_tokens_processed": 0, "n_prompt_tokens_cache": 0,
                     "params": {"temperature": 0.0, "n_predict": 8, "stream": True},
                     "next_token": [{"has_next_token": False, "n_decoded": 0}]})
    assert (ran.state, ran.request_id, ran.last_request_id) == ("idle", None, 7)
    assert (ran.prompt_n, ran.max_tokens, ran.params) == (39, 8, {"temperature": 0.0, "n_predict": 8})
    busy = slot_view({"id": 1, "is_processing": True, "id_task": 9, "params": {"n_predict": 4}})
    assert (busy.state, busy.request_id, busy.last_request_id, busy.max_tokens) == ("processing", 9, 9, 4)


@pytest.mark.parametrize("size", [(80, 24), (100, 30), (160, 48)])
async def test_the_header_drops_whole_figures_at_every_size(llama_server: Any, tmp_path: Path, size) -> None:
    # at 80x24 it ended "model SmolLM2-135M-Instruct.Q4_1.gguf ·", cut
    system = connect(llama_server.url, audit_path=tmp_path / "audit.jsonl")
    try:
        app = CalConsoleApp(system, load_layout("operator"))
        async with app.run_test(size=size) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None and "health" in topbar(app))
            top = topbar(app)
            assert len(top) < size[0] and not top.rstrip().endswith("·"), top
            parts = top.removeprefix("calconsole ").split(" · ")
            assert parts[0].startswith("llama-server ") and parts[1].startswith("health "), top
            if app.single:  # the status header over one pane: KV, queue and running requests kept
                heads = [p.split()[0] for p in parts]
                assert "KV" in heads and "queue" in heads and "run -" in parts, top
            else:
                assert f"model {MODEL}" in parts, top  # room for it: whole
    finally:
        system.close()


@pytest.mark.parametrize("panes", ["single", "columns"])
async def test_at_80x24_no_heading_of_the_server_table_is_cut(llama_server: Any, tmp_path: Path, panes) -> None:
    # the row form read "slo… lla… mod… hea… n_c…" in a 36-column pane; stacked rows keep every heading whole
    from calconsole.settings import Settings

    system = connect(llama_server.url, audit_path=tmp_path / "audit.jsonl")
    try:
        app = CalConsoleApp(system, load_layout("operator"), settings=Settings(panes=panes))
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("f1")
            dev = app.query_one("#obs-device", Static)

            def lines() -> list[str]:
                return [strip.text for strip in dev.render_lines(dev.region.reset_offset)]

            assert await wait_for(pilot, lambda: app.last_snapshot is not None and dev.size.height > 0
                                  and any("health" in ln for ln in lines()))
            await pilot.pause()
            text = "\n".join(lines())
            assert "…" not in text, text
            for heading in ("llama-server", "model", "health", "slots busy", "n_ctx/slot", "busy %"):
                assert heading in text, (heading, text)
            assert "SmolLM2" in text
    finally:
        system.close()


async def _slot_button(pilot, app, slot: str, name: str | None, button: str) -> None:
    app.query_one("#m-slot").value = slot
    if name is not None:
        app.query_one("#m-slot-file").value = name
    app.query_one(button).press()
    await pilot.pause()


async def test_the_pane_saves_restores_and_erases_a_slot(llama_server_slot_save: Any, tmp_path: Path) -> None:
    from calconsole.widgets.confirm import AskModal

    audit = tmp_path / "audit.jsonl"
    system = connect(llama_server_slot_save.url, audit_path=audit)
    try:
        from sim_backend.planes import ChatRequest

        system.inference.generate(ChatRequest.from_prompt("hi", max_tokens=2), timeout=60)  # a slot with KV
        app = CalConsoleApp(system, load_layout("operator"))
        async with app.run_test(size=(160, 48)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            assert app.query_one("#m-row-slots").display and app.query_one("#m-slot-save").size.width > 0
            # checked as llama-server checks it, before any request (nothing to confirm, nothing audited)
            for bad in ("../escape.bin", "a:b", " lead", "trail.", ".."):
                await _slot_button(pilot, app, "0", bad, "#m-slot-save")
                assert not isinstance(app.screen, AskModal)
                assert await wait_for(pilot, lambda bad=bad: f"{bad!r} refused" in log_text(app, "#m-log")), bad
            await _slot_button(pilot, app, "x", "ok.bin", "#m-slot-save")
            assert await wait_for(pilot, lambda: "the slot id must be an integer" in log_text(app, "#m-log"))
            for button in ("#m-slot-save", "#m-slot-restore", "#m-slot-erase"):
                await _slot_button(pilot, app, "0", "slot0.bin", button)
                await confirm_ask(pilot)
            assert await wait_for(pilot, lambda: sum(f"{a}: ok" in log_text(app, "#m-log")
                                                     for a in ("save_slot", "restore_slot", "erase_slot")) == 3), \
                log_text(app, "#m-log")
        done = [json.loads(line) for line in audit.read_text().splitlines()]
        done = [r for r in done if r["phase"] == "finished"]
        assert [(r["action"], r["granted"]) for r in done] == [("save_slot", True), ("restore_slot", True),
                                                               ("erase_slot", True)]
    finally:
        system.close()


async def test_without_a_slot_save_path_the_pane_shows_llama_servers_refusal(llama_server: Any,
                                                                            tmp_path: Path) -> None:
    system = connect(llama_server.url, audit_path=tmp_path / "audit.jsonl")
    try:
        app = CalConsoleApp(system, load_layout("operator"))
        async with app.run_test(size=(160, 48)) as pilot:
            assert await wait_for(pilot, lambda: app.last_snapshot is not None)
            await _slot_button(pilot, app, "0", "slot0.bin", "#m-slot-save")
            await confirm_ask(pilot)
            assert await wait_for(pilot, lambda: "--slot-save-path" in log_text(app, "#m-log")), log_text(app, "#m-log")
    finally:
        system.close()


def test_slot_file_names_are_checked_as_llama_server_checks_them() -> None:
    from calconsole.panes.maintenance_text import slot_filename_problem

    assert slot_filename_problem("slot0.bin") is None and slot_filename_problem("ünï code.bin") is None
    for bad in ("", "a/b", "a\\b", "a:b", "a*b", "a?b", 'a"b', "a<b", "a>b", "a|b", "a\x01b", "a\x7fb", " a", "a ",
                "a.", ".", "..", "a\u2215b", "x" * 256):
        assert slot_filename_problem(bad) is not None, repr(bad)
