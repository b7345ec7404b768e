"""Real-time pacing never runs ahead of the simulated clock (a lower bound on wall time only:
a loaded machine can make a run slower, never faster, so this cannot flake)."""

from __future__ import annotations

import time

from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.planes import ChatRequest, SamplingParams


def test_no_burst_after_a_short_pause():
    with build_system(pacing=Pacing(PacingMode.REALTIME, speed=2.0), maintenance=False) as s:
        req = ChatRequest.from_prompt("hi there", max_tokens=20, sampling=SamplingParams(temperature=0.0))
        s.inference.generate(req, 60)
        time.sleep(0.3)  # idle: must not become credit for the next request
        t0 = time.perf_counter()
        r = s.inference.generate(req, 60)
        wall = time.perf_counter() - t0
        assert wall >= 0.9 * r.timings.e2e_ms / 1e3 / 2.0


def test_a_host_more_than_a_second_behind_still_reports_its_achieved_speed(monkeypatch):
    # the host takes 50 ms of wall time for each 1 ms simulated step at speed 1: past 1 s behind the pacing
    # re-anchors at every step, and achieved_speed became None (the "host behind" flag went off exactly then)
    import collections

    import sim_backend.device.board as board_mod

    now = [1000.0]

    class FakeTime:
        @staticmethod
        def perf_counter() -> float:
            return now[0]

    monkeypatch.setattr(board_mod, "time", FakeTime)
    b = board_mod.SimulatedBoard.__new__(board_mod.SimulatedBoard)
    b.pacing = Pacing(PacingMode.REALTIME, speed=1.0)
    b._pace_log = collections.deque(maxlen=256)
    sim_us = 0.0
    speeds = []
    for _ in range(60):
        wall0 = now[0]
        now[0] += 0.050  # the host's compute
        b._pacing_deadline(wall0, sim_us, sim_us + 1000.0)
        sim_us += 1000.0
        b._pace_log.append((now[0], sim_us, b._pace_epoch))
        speeds.append(b.achieved_speed())
    behind_s = (now[0] - 1000.0) - sim_us / 1e6
    assert behind_s > 2.0
    # every reading once there are enough points: 1 ms sim per 50 ms wall
    assert all(v is not None and abs(v - 0.02) < 1e-6 for v in speeds[10:])
