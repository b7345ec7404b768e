"""Behaviour every implementation of the three planes must show (``sim_backend.planes.contracts``).

Written against the Protocols only: nothing here reaches below the planes. ``IMPLEMENTATIONS``
maps a name to a factory that yields a ``(inference, observation, maintenance)`` triple: the
in-process simulator, the same simulator behind ``calconsole serve`` reached over HTTP, and a real
llama-server (xllamacpp, SmolLM2) reached through the llama-server planes. Where the contract does not
apply to a llama-server (it has no device, no exclusive mode, no registers), the test expects what that
kind must do instead: the section absent (None), or the typed ``NotOffered`` refusal, audited. No skips.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sim_backend.compose import Pacing, PacingMode, build_system
from sim_backend.planes import (
    ChatRequest,
    DoneEvent,
    ExceedContextSizeError,
    Health,
    InferencePlane,
    InvalidRequestError,
    Lease,
    MaintenancePlane,
    MaintenanceRefused,
    NotOffered,
    ObservationPlane,
    RequestStream,
    SamplingParams,
    Snapshot,
    TokenEvent,
    UnavailableError,
)
from tests.waits import wait_until

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


@contextmanager
def llama_server(tmp_path: Path, real: Any) -> Iterator[Planes]:
    """A real llama-server (started with a slot save path) through the llama-server planes."""
    from calconsole.remote import connect

    system = connect(real.url, audit_path=tmp_path / "audit.jsonl")
    try:
        assert system.kind == LLAMA
        yield system.inference, system.observation, system.maintenance
    finally:
        system.close()


LLAMA = "llama-server"
IMPLEMENTATIONS: dict[str, Callable[..., Any]] = {"in-process": in_process, "remote": remote, LLAMA: llama_server}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def planes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Planes]:
    if request.param == LLAMA:
        ctx = llama_server(tmp_path, request.getfixturevalue("llama_server_slot_save"))
    else:
        ctx = IMPLEMENTATIONS[request.param](tmp_path)
    with ctx as p:
        yield p


def kind(planes: Planes) -> str:
    """"llama-server" for the llama-server planes, else "calconsole" (the simulator, here or over HTTP)."""
    return str(getattr(planes[2], "server_kind", "calconsole"))


def first_snapshot(obs: ObservationPlane, cond: Callable[[Snapshot], bool], timeout_s: float = 20.0) -> Snapshot:
    """The first snapshot for which ``cond`` holds (polled every 20 ms host, bounded), else the last one taken."""
    snaps: list[Snapshot] = []

    def taken_and_holds() -> bool:
        snaps.append(obs.snapshot())
        return cond(snaps[-1])

    wait_until(taken_and_holds, timeout=timeout_s)
    return snaps[-1]


def wait_idle(obs: ObservationPlane, timeout_s: float = 20.0) -> Snapshot:
    """The first snapshot with every slot idle (bounded wait)."""
    return first_snapshot(obs, lambda snap: all(s.state == "idle" for s in snap.slots), timeout_s)


def req(prompt: str = "hello there", n: int = 6, seed: int = 1) -> ChatRequest:
    return ChatRequest.from_prompt(prompt, max_tokens=n, sampling=SamplingParams(seed=seed))


# --- the types ---------------------------------------------------------------------------------


def test_implementations_satisfy_the_protocols(planes: Planes) -> None:
    inf, obs, mnt = planes
    assert isinstance(inf, InferencePlane) and isinstance(obs, ObservationPlane)
    assert isinstance(mnt, MaintenancePlane)
    assert inf.step_timeout_s > 0
    if kind(planes) == LLAMA:  # the server's context per slot (its n_ctx split over its 2 slots)
        assert inf.n_ctx == 2048
    else:
        assert inf.n_ctx == 40960


def test_health_is_the_state_a_health_probe_needs(planes: Planes) -> None:
    _, obs, _ = planes
    h = obs.health()
    assert isinstance(h, Health) and (h.status, h.mode, h.detail) == ("ok", "serving", "")
    snap = obs.snapshot()
    if snap.device is not None:  # the simulator (here or over HTTP): the snapshot's words
        assert (h.status, h.mode) == (snap.device.status, snap.device.mode)
    else:
        assert snap.server is not None and snap.server.health == h.status


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
    assert 1 <= res.timings.predicted_n <= 6
    if kind(planes) != LLAMA:  # the chat stream of a llama-server carries text, not token ids
        assert res.timings.predicted_n == len(res.tokens)
    # llama.cpp's prompt_n excludes the reused prefix (cache_n): together they are the whole prompt
    assert res.timings.prompt_n + res.timings.cache_n == inf.count_prompt_tokens(req(n=6))


def test_same_seed_same_tokens(planes: Planes) -> None:
    inf, _, _ = planes
    a = inf.generate(req(seed=7), timeout=60)
    b = inf.generate(req(seed=7), timeout=60)
    assert a.tokens == b.tokens and a.status == b.status == "finished"
    assert a.text == b.text and a.text  # the llama-server chat stream: the text is what it carries


def test_cancel_ends_a_running_request_and_frees_its_kv(planes: Planes) -> None:
    inf, obs, _ = planes
    first = obs.snapshot()
    h = inf.submit(req("tell me a long story", n=1500))
    ev = h.next_event(60.0)
    assert isinstance(ev, TokenEvent)
    h.cancel("test")
    res = h.result(30.0)
    assert res.status == "cancelled" and h.cancelled
    # the first snapshot with the cancel counted and the slot idle (a llama-server's planes count the cancel
    # client-side, before its slot is seen idle). The simulator's snapshot is one instant of the engine, which
    # frees the KV, idles the slot and counts the cancel under one lock, so this one already shows the KV
    # freed (when the KV was read apart from the counters, CI once saw 19 tokens here = prompt 17 + 2 generated)
    snap = first_snapshot(obs, lambda snap: snap.requests.counters.cancelled == 1 and
                          all(s.state == "idle" for s in snap.slots))
    assert snap.requests.counters.cancelled == 1 and all(s.state == "idle" for s in snap.slots)
    if kind(planes) == LLAMA:  # no KV view: the slot is free and the server stopped generating
        assert snap.kv is None and snap.server is not None and snap.server.requests_processing == 0
        assert snap.server.tokens_predicted_total is not None and first.server is not None
        assert first.server.tokens_predicted_total is not None
        assert snap.server.tokens_predicted_total - first.server.tokens_predicted_total < 1500
        return
    assert snap.kv is not None and first.kv is not None
    # only the slot's cached prefix may stay (prompt reuse), never the cancelled reply
    assert snap.kv.used_tokens - first.kv.used_tokens <= res.timings.prompt_n


@pytest.mark.parametrize("bad", [
    dict(max_tokens=0), dict(max_tokens=-3), dict(sampling=SamplingParams(temperature=-1.0)),
])
def test_invalid_requests_are_refused_before_anything_is_allocated(planes: Planes, bad: dict[str, Any]) -> None:
    inf, obs, _ = planes
    before = obs.snapshot()
    with pytest.raises(InvalidRequestError):
        r = msgspec.structs.replace(req(), **bad)
        inf.submit(r)
    after = obs.snapshot()
    assert after.requests.counters.submitted == before.requests.counters.submitted
    if kind(planes) == LLAMA:  # nothing reached the server: its counters did not move
        assert after.server is not None and before.server is not None
        assert after.server.prompt_tokens_total == before.server.prompt_tokens_total
        assert after.server.n_decode_total == before.server.n_decode_total
        return
    assert after.kv is not None and before.kv is not None and after.jobs is not None and before.jobs is not None
    assert after.kv.used_tokens == before.kv.used_tokens and after.jobs.submitted == before.jobs.submitted


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
    assert isinstance(snap, Snapshot)
    wire = json.loads(json.dumps(snap.to_dict()))
    assert Snapshot.from_dict(wire) == snap
    if kind(planes) == LLAMA:
        # what the server reports is filled; what only the simulator has is absent (None), never zero
        assert snap.server is not None and snap.server.kind == LLAMA and snap.server.health == "ok"
        assert snap.server.total_slots == len(snap.slots) == 2 and snap.server.build
        assert (snap.device, snap.jobs, snap.kv, snap.last_step, snap.memory, snap.stages, snap.host,
                snap.findings, snap.sim_now_ms) == (None,) * 9
        with pytest.raises(AttributeError):
            snap.server.health = "error"  # type: ignore[misc]
        with pytest.raises(msgspec.ValidationError, match="server"):
            Snapshot.from_dict({**wire, "server": {**wire["server"], "n_ctx": "many"}})
        return
    assert snap.device is not None and snap.kv is not None and snap.last_step is not None
    assert len(snap.device.chiplets) == 2 and snap.server is None
    with pytest.raises(AttributeError):
        snap.device.status = "ok"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        snap.kv.used_tokens = 0  # type: ignore[misc]
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
    assert a.requests.counters == b.requests.counters
    if kind(planes) == LLAMA:  # GETs only: the server's counters stand still
        assert a.server is not None and b.server is not None
        assert (a.server.n_decode_total, a.server.tokens_predicted_total, a.server.prompt_tokens_total) == (
            b.server.n_decode_total, b.server.tokens_predicted_total, b.server.prompt_tokens_total)


def test_counters_follow_the_work(planes: Planes) -> None:
    inf, obs, _ = planes
    a = obs.snapshot()
    res = inf.generate(req(n=5), timeout=60)
    b = obs.snapshot()
    assert b.requests.counters.finished == a.requests.counters.finished + 1
    if kind(planes) == LLAMA:  # the server's own counters (llamacpp: families)
        assert a.server is not None and b.server is not None
        assert a.server.tokens_predicted_total is not None and b.server.tokens_predicted_total is not None
        assert b.server.tokens_predicted_total - a.server.tokens_predicted_total == res.timings.predicted_n
        assert a.server.n_decode_total is not None and b.server.n_decode_total is not None
        assert b.server.n_decode_total > a.server.n_decode_total
    else:
        assert a.jobs is not None and b.jobs is not None and a.sim_now_ms is not None and b.sim_now_ms is not None
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
    if kind(planes) == LLAMA:
        # a llama-server has no lease to lack: every action it does not have is NotOffered (audited as
        # refused); its own action (clear_kv: erase every slot) needs no lease and is granted
        assert mnt.clear_kv(None)["ok"]
        actions.remove(actions[3])
        for act in actions:
            with pytest.raises(NotOffered, match="not offered by llama-server"):
                act()
        entries = mnt.audit.entries()[n0:]
        assert [e["status"] for e in entries] == ["granted"] + ["refused"] * len(actions)
        assert all(e["origin"]["kind"] == LLAMA for e in mnt.audit.read()[-2:])
        return
    for act in actions:
        with pytest.raises(MaintenanceRefused):
            act()
    entries = mnt.audit.entries()[n0:]
    assert len(entries) == len(actions) and all(e["status"] == "refused" for e in entries)


def test_exclusive_mode_stops_admission_and_a_stale_lease_is_refused(planes: Planes) -> None:
    inf, obs, mnt = planes
    if kind(planes) == LLAMA:  # no exclusive mode: refused as not offered, audited; serving goes on
        with pytest.raises(NotOffered, match="no exclusive mode"):
            mnt.enter_exclusive("contract-test")
        assert mnt.lease is None and mnt.mode()["mode"] == "serving"
        assert inf.generate(req(), timeout=60).status == "finished"
        assert (mnt.audit.entries()[-1]["action"], mnt.audit.entries()[-1]["status"]) == ("enter_exclusive",
                                                                                          "refused")
        return
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
    if kind(planes) == LLAMA:  # no device reset on a llama-server; its health check is /health
        with pytest.raises(NotOffered, match="no device reset"):
            mnt.reset(None)
        assert mnt.health_check(None)["ok"]
        return
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
    assert kind(planes) == LLAMA or (b.load.window_sim_ms is not None and b.load.window_sim_ms > 0)
    assert b.load.busy_percent is not None and 0 < b.load.busy_percent <= 100
    assert b.load.output_tokens_per_s is not None and b.load.output_tokens_per_s > 0
    if kind(planes) == LLAMA:  # from the server's counters over the wall window: no chiplets
        assert b.load.clock == "llama-server wall time" and b.load.window_sim_ms is None
        assert b.load.window_wall_s is not None and b.load.window_wall_s > 0
        assert Snapshot.from_dict(json.loads(json.dumps(b.to_dict()))) == b
        return
    assert b.load.clock == "simulated device time"
    assert a.device is not None and b.device is not None
    for before, after in zip(a.device.chiplets, b.device.chiplets, strict=True):
        assert after.busy_us > before.busy_us  # both chiplets run their shard of every step
        assert after.busy_percent is not None and 0 < after.busy_percent <= 100
    assert Snapshot.from_dict(json.loads(json.dumps(b.to_dict()))) == b
