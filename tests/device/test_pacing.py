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
