"""Polling real boards: calconsole (in-process, served), a real llama-server, a dead address, a gated one."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx

from calconsole.fleet.config import BoardSpec, FleetConfig
from calconsole.fleet.poller import FleetMonitor
from calconsole.fleet.sample import BoardSample, assess, rank
from calconsole.settings import Settings
from tests.fleet.conftest import API_KEY, dead_url


def fleet(*boards: tuple[str, str], refresh_hz: float = 4.0, timeout_s: float = 10.0) -> FleetConfig:
    return FleetConfig(tuple(BoardSpec(n, u) for n, u in boards), refresh_hz=refresh_hz, timeout_s=timeout_s)


def test_one_poll_of_each_kind_worst_first(make_server: Any, llama_server: Any) -> None:
    served = make_server()
    cfg = fleet(("sim", served.url), ("llama", llama_server.url), ("dead", dead_url()))
    samples = asyncio.run(FleetMonitor(cfg).poll_all_once())
    by = {s.name: s for s in samples}
    assert [s.name for s in rank(samples)][0] == "dead"
    dead = by["dead"]
    assert dead.state == "unreachable" and dead.level == "crit" and dead.last_seen_unix_s is None
    assert "ConnectError" in dead.error
    sim = by["sim"]
    assert (sim.state, sim.kind, sim.health, sim.mode) == ("up", "calconsole", "ok", "serving")
    assert sim.kv_percent == 0.0 and sim.queue == 0 and sim.running == 0 and sim.n_slots == 4
    assert sim.rate_clock == "sim" and sim.latency_clock == "sim"
    assert sim.faults_armed == () and sim.faults_fired == 0 and sim.level == "ok"
    llama = by["llama"]
    assert (llama.state, llama.kind, llama.health) == ("up", "llama-server", "ok")
    assert llama.model == "SmolLM2-135M-Instruct.Q4_1.gguf" and llama.build == llama_server.props["build_info"]
    assert llama.n_slots == 2 and llama.running is not None and llama.running >= 0
    # what a llama-server does not report is absent, not zero
    assert llama.kv_percent is None and llama.ttft_p95_ms is None and llama.latency_clock is None
    assert llama.faults_armed is None and llama.lease_holder is None


def test_llama_server_rate_is_its_counter_over_wall_time(llama_server: Any) -> None:
    async def go() -> tuple[BoardSample, BoardSample]:
        mon = FleetMonitor(fleet(("llama", llama_server.url)))
        try:
            first = (await mon.poll_all_once())[0]
            async with httpx.AsyncClient(timeout=120) as c:
                r = await c.post(llama_server.url + "/completion",
                                 json={"prompt": "Once upon a time", "n_predict": 4, "temperature": 0})
                assert r.status_code == 200, r.text
            return first, (await mon.poll_all_once())[0]
        finally:
            await mon.stop()

    first, second = asyncio.run(go())
    assert second.rate_clock == "wall" and second.output_tok_s is not None and second.output_tok_s > 0
    assert first.output_tok_s is None or first.rate_clock == "wall"


def test_a_board_that_does_not_answer_never_delays_the_others(make_server: Any, gated_board: Any) -> None:
    served = make_server()
    slow = gated_board(served.url)
    polls: dict[str, int] = {"fast": 0, "slow": 0}

    async def go() -> dict[str, BoardSample]:
        mon = FleetMonitor(fleet(("fast", served.url), ("slow", slow.url), refresh_hz=10.0, timeout_s=30.0))
        mon.on_change = lambda s: polls.__setitem__(s.name, polls[s.name] + 1)
        mon.start()
        try:
            # the slow board holds its first answer; the fast one is polled again and again meanwhile
            for _ in range(600):
                if polls["fast"] >= 5 and slow.requests >= 1:
                    break
                await asyncio.sleep(0.05)
            held = dict(mon.samples)
            assert polls["slow"] == 0 and held["slow"].state == "connecting", held["slow"]
            slow.gate.set()
            for _ in range(600):
                if polls["slow"] >= 1:
                    break
                await asyncio.sleep(0.05)
            return dict(mon.samples)
        finally:
            await mon.stop()

    after = asyncio.run(go())
    assert polls["fast"] >= 5
    assert after["slow"].state == "up" and after["slow"].kind == "calconsole"
    # the held answer shows in that poll's round trip; the fast board's samples come on its stream: they
    # have a gap between samples (about the interval) and no round trip, never shown as one
    assert after["slow"].via == "poll" and after["slow"].poll_ms is not None
    assert after["fast"].via == "stream" and after["fast"].poll_ms is None
    assert after["fast"].sample_gap_s is not None and 0 < after["fast"].sample_gap_s
    assert after["slow"].poll_ms > 1e3 * after["fast"].sample_gap_s  # held for at least 5 fast samples


def test_a_board_that_wants_a_key_is_refused_until_given_one(make_server: Any, tmp_path: Path) -> None:
    served = make_server(api_key=API_KEY)
    key = tmp_path / "api.key"
    key.write_text(API_KEY + "\n")
    os.chmod(key, 0o600)
    cfg = FleetConfig((BoardSpec("nokey", served.url), BoardSpec("withkey", served.url, api_key_file=str(key))))
    by = {s.name: s for s in asyncio.run(FleetMonitor(cfg).poll_all_once())}
    assert by["nokey"].state == "refused" and "API key" in by["nokey"].error and by["nokey"].level == "crit"
    assert by["withkey"].state == "up" and by["withkey"].kind == "calconsole"


def test_a_url_that_is_neither_kind_is_an_error() -> None:
    # a plain HTTP server that answers 404 to everything
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a: Any) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        s = asyncio.run(FleetMonitor(fleet(("web", f"http://127.0.0.1:{srv.server_address[1]}"))).poll_all_once())[0]
    finally:
        srv.shutdown()
        srv.server_close()
    assert s.state == "error" and "neither calconsole" in s.error and s.level == "crit"


def test_levels_follow_the_console_thresholds() -> None:
    st = Settings()
    ok = {"health": "ok", "mode": "serving", "kv_percent": 10.0, "queue": 0, "failed": 0}
    assert assess(ok, st) == ("ok", ())
    level, why = assess({**ok, "kv_percent": 96.0}, st)
    assert level == "crit" and why == ("KV 96 %",)
    level, why = assess({**ok, "mode": "exclusive", "queue": 1}, st)
    assert level == "warn" and "mode exclusive" in why and "queue 1" in why
    level, why = assess({**ok, "ttft_p95_ms": 1900.0, "slo": {"ttft_ms": 2000.0}}, st)
    assert level == "warn" and why == ("TTFT P95 0.95x SLO",)
    level, _ = assess({**ok, "faults_fired": 1}, st)
    assert level == "crit"
    samples = [BoardSample(name="b", url="u", state="up", level="ok"),
               BoardSample(name="a", url="u", state="up", level="warn"),
               BoardSample(name="c", url="u", state="unreachable", level="crit"),
               BoardSample(name="d", url="u", state="up", level="crit")]
    assert [s.name for s in rank(samples)] == ["c", "d", "a", "b"]


def test_a_board_that_stops_answering_keeps_what_was_known(make_server: Any) -> None:
    served = make_server()

    async def go() -> tuple[BoardSample, BoardSample]:
        mon = FleetMonitor(fleet(("b", served.url)))
        try:
            up = (await mon.poll_all_once())[0]
            served.thread.stop()  # the board's server goes away
            return up, (await mon.poll_all_once())[0]
        finally:
            await mon.stop()

    up, down = asyncio.run(go())
    assert up.state == "up" and down.state == "unreachable" and down.level == "crit"
    assert down.kind == "calconsole" and down.model == up.model  # still known: what it was
    assert down.last_seen_unix_s == up.last_seen_unix_s  # when it last answered
    assert down.kv_percent is None  # no figure is carried over as if current
