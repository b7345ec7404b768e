"""A snapshot of the simulator is one instant of the engine: the KV occupancy, the slots and the request
counters are read under one hold of the engine lock, under which the engine frees a cancelled request's KV,
idles its slot and counts it (read apart, a snapshot could count a request as ended with its KV still held)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sim_backend.compose import build_system
from sim_backend.planes import ChatRequest, SamplingParams


def test_the_kv_and_the_request_counters_are_read_in_one_hold_of_the_engine_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with build_system(numerics=False, n_slots=1, audit_path=tmp_path / "a.jsonl") as s:
        res = s.inference.generate(ChatRequest.from_prompt("hello", max_tokens=3,
                                                           sampling=SamplingParams(seed=1)), 60)
        assert res.status == "finished"
        seen: list[tuple[str, bool]] = []
        mon, metrics, lock = s.observation._mon, s.engine.metrics, s.engine._lock
        kv_read, summary = mon.kv_occupancy, metrics.summary

        def read_kv() -> Any:
            seen.append(("kv", lock.locked()))
            return kv_read()

        def read_summary() -> Any:
            seen.append(("requests", lock.locked()))
            return summary()

        monkeypatch.setattr(mon, "kv_occupancy", read_kv)
        monkeypatch.setattr(metrics, "summary", read_summary)
        snap = s.observation.snapshot()
        assert seen == [("kv", True), ("requests", True)]
        assert snap.requests.counters.finished == 1 and snap.kv is not None
        # the engine's own view gives the same instant to any reader
        view = s.engine.observe(lambda: lock.locked())
        assert view.kv is True and len(view.slots) == 1 and view.tokens_generated == res.timings.predicted_n
