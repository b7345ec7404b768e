"""The load sampler behind ``Snapshot.load`` and ``ChipletInfo.busy_percent`` (simulated time)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sim_backend.planes import inprocess
from sim_backend.planes.inprocess import _LoadSampler
from tests.waits import wait_until


def test_first_sample_has_no_figures() -> None:
    load, chips = _LoadSampler().sample(0.0, 0.0, (0.0, 0.0), 0)
    assert load == {"interval_s": 1.0} and chips == [None, None]


def test_busy_share_and_rate_over_the_simulated_window(monkeypatch: pytest.MonkeyPatch) -> None:
    t = [100.0]
    monkeypatch.setattr(inprocess.time, "monotonic", lambda: t[0])
    s = _LoadSampler(interval_s=1.0)
    s.sample(0.0, 0.0, (0.0, 0.0), 0)
    t[0] += 1.0
    # 1 s simulated: board busy 0.5 s, chip0 0.4 s, chip1 0.25 s; 20 tokens generated
    load, chips = s.sample(1e6, 5e5, (4e5, 2.5e5), 20)
    assert load["window_sim_ms"] == 1000.0 and load["busy_percent"] == 50.0
    assert load["output_tokens_per_s"] == 20.0 and chips == [40.0, 25.0]


def test_a_clock_standing_still_means_nothing_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    t = [0.0]
    monkeypatch.setattr(inprocess.time, "monotonic", lambda: t[0])
    s = _LoadSampler(interval_s=1.0)
    s.sample(5e6, 4e6, (4e6, 4e6), 100)
    t[0] += 2.0
    load, chips = s.sample(5e6, 4e6, (4e6, 4e6), 100)  # idle: the simulated clock did not move
    assert load["busy_percent"] == 0.0 and load["output_tokens_per_s"] == 0.0 and chips == [0.0, 0.0]


def test_the_reference_is_the_newest_sample_old_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    t = [0.0]
    monkeypatch.setattr(inprocess.time, "monotonic", lambda: t[0])
    s = _LoadSampler(interval_s=1.0)
    for i in range(5):  # a sample every 0.5 s, 0.5 s simulated each, fully busy
        s.sample(i * 5e5, i * 5e5, (i * 5e5,), 0)
        t[0] += 0.5
    load, _ = s.sample(5 * 5e5, 5 * 5e5, (5 * 5e5,), 0)
    assert load["window_wall_s"] == 1.0 and load["window_sim_ms"] == 1000.0 and load["busy_percent"] == 100.0


def test_the_output_rate_adds_up_to_the_token_counters_when_a_request_ends_mid_snapshot() -> None:
    # the rate's tokens were the metrics' count (read first) plus the slots' (read after): a request ending
    # between the two reads was in neither for one sample, so the next sample's rate rose by all its tokens
    # (a 20-token chat ending read as 78 tok/s on a device making 58). Both are now read in one hold of the
    # engine lock (``Engine.observe``), so the end cannot fall between them; forced here: it falls right after
    # that read, while the snapshot is still being built
    from sim_backend.compose import build_system
    from sim_backend.device.clock import Pacing, PacingMode
    from sim_backend.planes import ChatRequest, SamplingParams

    with build_system(pacing=Pacing(PacingMode.REALTIME, speed=1.0), numerics=False, maintenance=False) as s:
        s.observation._load.interval_s = 0.0  # every sample is compared with the previous one
        # the device holds the request's third decode step until the race below: a few tokens in and still
        # running however long this thread waits for a time slice (24 realtime tokens last ~0.4 s: a test
        # thread starved that long saw the request end before its first look)
        held, release, execute, decodes = threading.Event(), threading.Event(), s.board._execute, [0]

        def execute_held(job: Any, gen: int) -> None:
            if job.kind == "decode":
                decodes[0] += 1
                if decodes[0] == 3:
                    held.set()
                    release.wait(60)
            execute(job, gen)

        s.board._execute = execute_held  # type: ignore[method-assign]
        h = s.inference.submit(ChatRequest.from_prompt("count the tokens", max_tokens=24,
                                                       sampling=SamplingParams(seed=3)))
        try:
            assert held.wait(60), "the request's third decode step never started"
            snaps: list[Any] = []

            def tokens_in() -> bool:  # the steps before the held one have delivered their tokens
                snaps.append(s.observation.snapshot())
                return any(sl.predicted_n for sl in snaps[-1].slots)

            assert wait_until(tokens_in, timeout=60)
            first = snaps[-1]
            assert not h.done, "the request ended before it was seen running"
            before = first.requests.tokens.predicted + sum(sl.predicted_n or 0 for sl in first.slots)
            orig = s.engine.observe

            def observe_then_end(read_kv: Any) -> Any:  # the snapshot's engine view is read, then the request ends
                out = orig(read_kv)
                release.set()
                h.result(60)
                return out

            s.engine.observe = observe_then_end  # type: ignore[method-assign]
            try:
                race = s.observation.snapshot()
            finally:
                s.engine.observe = orig  # type: ignore[method-assign]
        finally:
            release.set()
        s.inference.generate(ChatRequest.from_prompt("more", max_tokens=4, sampling=SamplingParams(seed=4)), 60)
        last = s.observation.snapshot()
        total = last.requests.tokens.predicted
        counted = sum((snap.load.output_tokens_per_s or 0.0) * (snap.load.window_sim_ms or 0.0) / 1e3
                      for snap in (race, last))
        assert counted == pytest.approx(total - before, abs=1e-6)
