"""Behaviour every implementation of the three planes must show (``sim_backend.planes.contracts``).

Written against the Protocols only: nothing here reaches below the planes. ``IMPLEMENTATIONS``
maps a name to a factory that yields a ``(inference, observation, maintenance)`` triple; the
in-process simulator is the first. The HTTP client planes (attach issue) add their factory here
and must pass the same tests unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sim_backend.planes import (
    ChatRequest,
    DoneEvent,
    ExceedContextSizeError,
    InferencePlane,
    InvalidRequestError,
    Lease,
    MaintenancePlane,
    MaintenanceRefused,
    ObservationPlane,
    Pacing,
    PacingMode,
    RequestStream,
    SamplingParams,
    Snapshot,
    TokenEvent,
    UnavailableError,
    build_system,
)

Planes = tuple[InferencePlane, ObservationPlane, MaintenancePlane]


@contextmanager
def in_process(tmp_path: Path) -> Iterator[Planes]:
    system = build_system(pacing=Pacing(PacingMode.FAST), numerics=False, n_slots=2,
                          audit_path=tmp_path / "audit.jsonl", drain_timeout_s=0.3, reset_timeout_s=5.0)
    try:
        assert system.maintenance is not None
        yield system.inference, system.observation, system.maintenance
    finally:
        system.close()


@contextmanager
def remote(tmp_path: Path) -> Iterator[Planes]:
    """The same system behind the serving face on 127.0.0.1:0, reached through the HTTP client planes."""
    from calconsole.remote import connect
    from calconsole.server.face import ServeConfig, ServingFace
    from calconsole.server.keys import KeyRing
    from calconsole.server.run import ServerThread

    system = build_system(pacing=Pacing(PacingMode.FAST), numerics=False, n_slots=2,
                          audit_path=tmp_path / "audit.jsonl", drain_timeout_s=0.3, reset_timeout_s=5.0)
    api, admin = "contract-api-key-0123", "contract-admin-key-4567"
    cfg = ServeConfig(host="127.0.0.1", port=0, api_keys=KeyRing([("api-1", api)], "api"),
                      admin_keys=KeyRing([("admin-1", admin)], "admin"))
    assert system.maintenance is not None
    face = ServingFace(system.inference, system.observation, system.maintenance, cfg, audit=system.maintenance.audit)
    thread = ServerThread(face).start()
    client = None
    try:
        client = connect(thread.url, api_key=api, admin_key=admin)
        assert client.maintenance is not None
        yield client.inference, client.observation, client.maintenance
    finally:
        if client is not None:
            client.close()
        thread.stop()
        system.close()


IMPLEMENTATIONS: dict[str, Callable[[Path], Any]] = {"in-process": in_process, "remote": remote}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def planes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Planes]:
    with IMPLEMENTATIONS[request.param](tmp_path) as p:
        yield p


def req(prompt: str = "hello there", n: int = 6, seed: int = 1) -> ChatRequest:
    return ChatRequest.from_prompt(prompt, max_tokens=n, sampling=SamplingParams(seed=seed))


# --- the types ---------------------------------------------------------------------------------


def test_implementations_satisfy_the_protocols(planes: Planes) -> None:
    inf, obs, mnt = planes
    assert isinstance(inf, InferencePlane) and isinstance(obs, ObservationPlane)
    assert isinstance(mnt, MaintenancePlane)
    assert inf.n_ctx == 40960 and inf.step_timeout_s > 0


# --- inference ---------------------------------------------------------------------------------


def test_stream_yields_pieces_then_one_done_event(planes: Planes) -> None:
    inf, _, _ = planes
    h = inf.submit(req(n=6))
    assert isinstance(h, RequestStream)
    events = list(h.stream(timeout=inf.step_timeout_s))
    assert isinstance(events[-1], DoneEvent) and all(isinstance(e, TokenEvent) for e in events[:-1])
    res = h.result(1.0)
    assert res.status == "finished" and h.done
    assert "".join(e.text for e in events[:-1]) == res.text
    assert res.timings.predicted_n == len(res.tokens) <= 6
    assert res.timings.prompt_n == inf.count_prompt_tokens(req(n=6))


def test_same_seed_same_tokens(planes: Planes) -> None:
    inf, _, _ = planes
    a = inf.generate(req(seed=7), timeout=60)
    b = inf.generate(req(seed=7), timeout=60)
    assert a.tokens == b.tokens and a.status == b.status == "finished"


def test_cancel_ends_a_running_request_and_frees_its_kv(planes: Planes) -> None:
    inf, obs, _ = planes
    before = obs.snapshot().kv.used_tokens
    h = inf.submit(req("tell me a long story", n=4000))
    ev = h.next_event(30.0)
    assert isinstance(ev, TokenEvent)
    h.cancel("test")
    res = h.result(30.0)
    assert res.status == "cancelled" and h.cancelled
    deadline = time.monotonic() + 10
    while obs.snapshot().slots[0].state != "idle" and time.monotonic() < deadline:
        time.sleep(0.01)
    snap = obs.snapshot()
    assert snap.requests["counters"]["cancelled"] == 1
    # only the slot's cached prefix may stay (prompt reuse), never the cancelled reply
    assert snap.kv.used_tokens - before <= res.timings.prompt_n


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(max_tokens=-3), dict(sampling=SamplingParams(temperature=-1.0)),
])
def test_invalid_requests_are_refused_before_anything_is_allocated(planes: Planes, bad: dict[str, Any]) -> None:
    inf, obs, _ = planes
    before = obs.snapshot()
    with pytest.raises(InvalidRequestError):
        r = dataclasses.replace(req(), **bad)
        inf.submit(r)
    after = obs.snapshot()
    assert after.kv.used_tokens == before.kv.used_tokens and after.jobs.submitted == before.jobs.submitted
    assert after.requests["counters"]["submitted"] == before.requests["counters"]["submitted"]


def test_a_prompt_longer_than_the_context_is_refused(planes: Planes) -> None:
    inf, _, _ = planes
    with pytest.raises(ExceedContextSizeError) as ei:
        inf.submit(req("word " * 41_000))
    assert ei.value.n_ctx == inf.n_ctx and ei.value.n_prompt_tokens > inf.n_ctx


# --- observation -------------------------------------------------------------------------------


def test_snapshot_is_typed_immutable_and_round_trips_as_json(planes: Planes) -> None:
    inf, obs, _ = planes
    inf.generate(req(), timeout=60)
    snap = obs.snapshot()
    assert isinstance(snap, Snapshot) and len(snap.device.chiplets) == 2
    with pytest.raises(AttributeError):
        snap.device.status = "ok"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        snap.kv.used_tokens = 0  # type: ignore[misc]
    wire = json.loads(json.dumps(snap.to_dict()))
    assert Snapshot.from_dict(wire) == snap
    assert snap.last_step.kind in ("prefill", "decode") and len(snap.last_step.layers) == 48
    with pytest.raises(msgspec.ValidationError, match="device"):
        Snapshot.from_dict({**wire, "device": {"name": 1}})


def test_observing_changes_nothing(planes: Planes) -> None:
    inf, obs, _ = planes
    inf.generate(req(), timeout=60)
    a = obs.snapshot()
    for _ in range(5):
        obs.snapshot()
        obs.metrics_text()
    b = obs.snapshot()
    assert (a.jobs, a.kv, a.slots, a.sim_now_ms) == (b.jobs, b.kv, b.slots, b.sim_now_ms)
    assert a.requests["counters"] == b.requests["counters"]


def test_counters_follow_the_work(planes: Planes) -> None:
    inf, obs, _ = planes
    a = obs.snapshot()
    res = inf.generate(req(n=5), timeout=60)
    b = obs.snapshot()
    assert b.requests["counters"]["finished"] == a.requests["counters"]["finished"] + 1
    assert b.jobs.finished - a.jobs.finished == res.timings.predicted_n  # one prefill + n-1 decodes
    assert b.sim_now_ms > a.sim_now_ms
    text = obs.metrics_text()
    assert "llamacpp:requests_processing" in text or "llamacpp:" in text
    assert "llamacpp:prompt_tokens_total" in text


# --- maintenance -------------------------------------------------------------------------------


def test_every_guarded_action_is_refused_without_the_lease_and_audited(planes: Planes) -> None:
    _, _, mnt = planes
    n0 = len(mnt.audit.entries())
    actions: list[Callable[[], Any]] = [
        lambda: mnt.reset(None), lambda: mnt.clear_device_memory(None), lambda: mnt.reload_model(None),
        lambda: mnt.clear_kv(None), lambda: mnt.self_test(None), lambda: mnt.read_register(None, "CHIP0_SCRATCH"),
        lambda: mnt.write_register(None, "CHIP0_SCRATCH", 1), lambda: mnt.inject_fault(None, "ccu_exception"),
        lambda: mnt.probe_request(None), lambda: mnt.leave_exclusive(None),
    ]
    for act in actions:
        with pytest.raises(MaintenanceRefused):
            act()
    entries = mnt.audit.entries()[n0:]
    assert len(entries) == len(actions) and all(e["status"] == "refused" for e in entries)


def test_exclusive_mode_stops_admission_and_a_stale_lease_is_refused(planes: Planes) -> None:
    inf, obs, mnt = planes
    lease = mnt.enter_exclusive("contract-test")
    assert isinstance(lease, Lease) and mnt.lease == lease
    assert mnt.mode()["mode"] == "exclusive" and obs.snapshot().device.mode == "exclusive"
    with pytest.raises(UnavailableError):
        inf.submit(req())
    assert mnt.write_register(lease, "CHIP1_SCRATCH", 7)["ok"]
    assert mnt.read_register(lease, "CHIP1_SCRATCH")["value"] == 7
    mnt.leave_exclusive(lease)
    assert obs.snapshot().device.mode == "serving" and mnt.lease is None
    with pytest.raises(MaintenanceRefused):
        mnt.reset(lease)
    assert inf.generate(req(), timeout=60).status == "finished"
    statuses = [(e["action"], e["status"]) for e in mnt.audit.entries()]
    assert ("enter_exclusive", "granted") in statuses and statuses[-1] == ("reset", "refused")


def test_reset_reports_a_health_check(planes: Planes) -> None:
    _, obs, mnt = planes
    lease = mnt.enter_exclusive("contract-test")
    rep = mnt.reset(lease)
    assert rep["ok"] and rep["health"]["ok"]
    assert obs.snapshot().jobs.resets == 1
    mnt.leave_exclusive(lease)


def test_load_figures_come_from_simulated_busy_time(planes: Planes) -> None:
    # busy % and output rate: simulated device time over the interval between two samples
    inf, obs, _ = planes
    a = obs.snapshot()
    assert a.load.busy_percent is None or 0 <= a.load.busy_percent <= 100
    inf.generate(req(n=6), timeout=60)
    b = obs.snapshot()
    assert b.load.window_sim_ms is not None and b.load.window_sim_ms > 0
    assert b.load.busy_percent is not None and 0 < b.load.busy_percent <= 100
    assert b.load.output_tokens_per_s is not None and b.load.output_tokens_per_s > 0
    for before, after in zip(a.device.chiplets, b.device.chiplets, strict=True):
        assert after.busy_us > before.busy_us  # both chiplets run their shard of every step
        assert after.busy_percent is not None and 0 < after.busy_percent <= 100
    assert Snapshot.from_dict(json.loads(json.dumps(b.to_dict()))) == b
