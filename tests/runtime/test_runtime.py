"""CalRT-like runtime (sim_backend.runtime.calrt): exact sub-models, CSR checks, non-blocking infer,
ping/pong, buffer pool, typed errors, and the maintenance-only surface.

Jobs are held "running" by a gate on the cost model (deterministic, no timed assertions).
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from sim_backend.device.board import SimulatedBoard
from sim_backend.errors import (
    CalError,
    CCUException,
    DeviceError,
    DeviceNotReady,
    MaintenanceRefused,
    SubmitError,
    WaitTimeout,
)
from sim_backend.model.costmodel import CostModel
from sim_backend.runtime.buffers import BufferPool
from sim_backend.runtime.calbin import Calbin, InputBuf, OutputBuf, SubModelNotFound
from sim_backend.runtime.calrt import VirtualDevice, calrt_version
from sim_backend.runtime.maintenance import MaintenanceRuntime
from sim_backend.runtime.session import RuntimeSession

WAIT = 30.0  # host seconds: generous bound for a wait that must succeed


class Gate:
    """Wraps the cost model so each job blocks on the device thread until ``open()``."""

    def __init__(self, cost) -> None:
        self._cost = cost
        self.event = threading.Event()
        self.event.set()

    def close(self) -> None:
        self.event.clear()

    def open(self) -> None:
        self.event.set()

    def price_step(self, *a, **kw):
        assert self.event.wait(WAIT), "gate never opened"
        return self._cost.price_step(*a, **kw)

    def __getattr__(self, name):
        return getattr(self._cost, name)


@pytest.fixture()
def board(bundle):
    gate = Gate(CostModel.load(None))
    b = SimulatedBoard(bundle, gate, numerics=False, kv_cells=1024)
    b.gate = gate
    yield b
    gate.open()
    b.close()


def _session(board, parallel=False):
    return RuntimeSession(board, parallel=parallel)


def _prefill(s: RuntimeSession, seq: int, n: int = 4, **kw):
    cells = s.kv.apply(seq, n, timeout=0.5)
    return s.step("prefill", seq, np.arange(1, n + 1), np.arange(n), cells, **kw)


# --- device, version, calbin ------------------------------------------------------------


def test_version_and_status(board):
    assert calrt_version() == "0.7.6"
    dev = VirtualDevice(board, "PCIE")
    assert dev.version() == f"{board.registers.read('CALCORERT_COMMIT'):07x}" == "3f9c2ab"
    st = dev.status()
    assert st.state == "ready" and st.configured and len(st.chiplets) == 2 and st.kind == "PCIE"
    with pytest.raises(DeviceError):
        VirtualDevice(board, "USB")
    with pytest.raises(DeviceError):
        VirtualDevice(board, "PCIE", index=1)
    board.clear_memory()
    assert dev.status().state == "memory_cleared"
    cb = Calbin.create(dev)
    with pytest.raises(DeviceNotReady):
        cb.configure()


def test_submodel_lookup_is_exact(board, bundle):
    dev = VirtualDevice(board)
    cb = Calbin.create(dev, bundle)
    with pytest.raises(DeviceNotReady):
        cb.get_submodel("decode", "llm_decode")  # before configure()
    cb.configure()
    assert cb.get_submodel("decode", "llm_decode").name == "decode"
    # the shipped prefill is declared llm_decode (known defect): both the declared and corrected type match it
    assert cb.get_submodel("prefill", "llm_decode").name == "prefill"
    assert cb.get_submodel("prefill", "llm_prefill").spec.input("input_ids").shape == (1, 40960)
    for name, typ in [("prefil", "llm_prefill"), ("pre", "llm_prefill"), ("Prefill", "llm_prefill"),
                      ("prefill ", "llm_prefill"), ("decode", "llm_prefill"), ("decode", "decode"), ("", "llm_decode")]:
        with pytest.raises(SubModelNotFound) as ei:
            cb.get_submodel(name, typ)
        assert isinstance(ei.value, KeyError) and isinstance(ei.value, CalError)


def test_calbin_must_match_device(board, bundle):
    dev = VirtualDevice(board)
    other = dataclasses.replace(bundle, numeric=dataclasses.replace(bundle.numeric, seed=99))
    with pytest.raises(DeviceError):
        Calbin.create(dev, other)
    cb = Calbin.create(dev, dataclasses.replace(bundle, calrt_version="0.7.5"))
    with pytest.raises(DeviceError, match="0.7.5"):
        cb.configure()


# --- CSR and buffers ----------------------------------------------------------------------


def test_csr_setters_are_validated(board):
    s = _session(board)
    inp = InputBuf(s.calbin)
    inp.write(0, [1, 2, 3], [0, 1, 2], [0, 1, 2])
    for bad in [dict(past_kv_cur_seq_len=-1, cur_seq_len=3), dict(past_kv_cur_seq_len=0, cur_seq_len=-3),
                dict(past_kv_cur_seq_len=0, cur_seq_len=0), dict(past_kv_cur_seq_len=40958, cur_seq_len=3),
                dict(past_kv_cur_seq_len=0, cur_seq_len=2), dict(past_kv_cur_seq_len=0, cur_seq_len=4),
                dict(past_kv_cur_seq_len=True, cur_seq_len=3), dict(past_kv_cur_seq_len=0.0, cur_seq_len=3)]:
        with pytest.raises(SubmitError):
            inp.set_csr(**bad)
    inp.set_csr(past_kv_cur_seq_len=40957, cur_seq_len=3)  # exactly the context: allowed
    with pytest.raises(SubmitError):
        inp.write(0, [1, 2], [0, 1], [0])  # lengths differ
    with pytest.raises(SubmitError):
        inp.write(0, [151936], [0], [0])  # token id outside the vocab
    with pytest.raises(SubmitError):
        inp.write(0, [], [], [])


def test_submit_checks_buffers_and_kv(board):
    s = _session(board)
    dec = s.submodels["decode"]
    inp, out = InputBuf(s.calbin), OutputBuf(s.calbin)
    cells = s.kv.apply(0, 2, timeout=0.1)
    inp.write(0, [5, 6], [0, 1], cells)
    with pytest.raises(SubmitError, match="CSR not set"):
        s.calbin.infer(dec, inp, out)
    inp.set_csr(past_kv_cur_seq_len=0, cur_seq_len=2)
    with pytest.raises(SubmitError, match="at most 1"):
        s.calbin.infer(dec, inp, out)  # decode is [1, 1]
    pre = s.submodels["prefill"]
    inp.set_csr(past_kv_cur_seq_len=3, cur_seq_len=2)
    with pytest.raises(SubmitError, match="KV cells"):
        s.calbin.infer(pre, inp, out)  # past_kv disagrees with the KV the sequence holds
    inp.write(0, [5, 6], [0, 1], [900, 901])
    inp.set_csr(past_kv_cur_seq_len=0, cur_seq_len=2)
    with pytest.raises(SubmitError, match="not cells of sequence"):
        s.calbin.infer(pre, inp, out)
    with pytest.raises(SubmitError):
        out.wait(1.0)  # nothing submitted
    assert out.state == "idle"
    assert board.counters().submitted == 0  # nothing reached the device
    inp.write(0, [5, 6], [0, 1], cells)
    inp.set_csr(past_kv_cur_seq_len=0, cur_seq_len=2)
    assert s.calbin.infer(pre, inp, out) is out
    res = out.wait(WAIT)
    assert res.kind == "prefill" and res.n_tokens == 2 and out.state == "done"


def test_infer_is_non_blocking_and_wait_is_bounded(board):
    s = _session(board)
    board.gate.close()
    out = _prefill(s, 0)
    assert out.state in ("pending", "running")  # returned before the device finished
    with pytest.raises(WaitTimeout):
        out.wait(0.05)
    c = s.job_counters()
    assert c.left == 1 and c.finished == 0
    board.gate.open()
    res = out.wait(WAIT)
    assert out.state == "done" and res.sim_us > 0
    c = s.job_counters()
    assert (c.pending, c.running, c.finished, c.left) == (0, 0, 1, 0)


def test_ccu_exception_is_typed_and_device_keeps_serving(board):
    s = _session(board)
    board.faults.ccu_next = 1
    out = _prefill(s, 0)
    with pytest.raises(CCUException):
        out.wait(WAIT)
    assert out.state == "ccu_exception"
    assert s.pool.free_count == s.pool.size  # the pair went back to the pool on the error
    s.kv.free(0)
    assert _prefill(s, 0).wait(WAIT).kind == "prefill"
    c = s.job_counters()
    assert c.failed == 1 and c.finished == 1 and c.ccu_exceptions == 1


# --- ping / pong --------------------------------------------------------------------------


def test_serial_mode_allows_one_job_in_flight(board):
    s = _session(board, parallel=False)
    cb = s.calbin
    board.gate.close()
    a = _prefill(s, 0)
    inp, out = InputBuf(cb), OutputBuf(cb)
    cells = s.kv.apply(1, 2, timeout=0.1)
    inp.write(1, [1, 2], [0, 1], cells)
    inp.set_csr(past_kv_cur_seq_len=0, cur_seq_len=2)
    with pytest.raises(SubmitError, match="parallel mode is off"):
        cb.infer(s.submodels["prefill"], inp, out)
    board.gate.open()
    a.wait(WAIT)
    cb.infer(s.submodels["prefill"], inp, out).wait(WAIT)


def test_ping_pong_two_in_flight_third_refused(board):
    s = _session(board, parallel=True)
    cb = s.calbin
    board.gate.close()
    a = _prefill(s, 0, task_type="ping")
    b = _prefill(s, 1, task_type="pong")
    assert (a.task_type, b.task_type) == ("ping", "pong")
    assert s.device.busy_task_types() == ("ping", "pong")
    inp, out = InputBuf(cb), OutputBuf(cb)
    cells = s.kv.apply(2, 1, timeout=0.1)
    inp.write(2, [7], [0], cells)
    inp.set_csr(past_kv_cur_seq_len=0, cur_seq_len=1)
    for tt in ("ping", "pong", "auto"):
        with pytest.raises(SubmitError, match="busy"):
            cb.submit_job(s.submodels["decode"], inp, out, task_type=tt)
    with pytest.raises(SubmitError):
        s.device.enable_parallel_mode(False)  # two jobs in flight
    with pytest.raises(SubmitError):
        s.pool.acquire(0.0)  # both pooled pairs are in flight
    board.gate.open()
    a.wait(WAIT)
    got = cb.submit_job(s.submodels["decode"], inp, out, task_type="ping")  # ping is free again
    b.wait(WAIT)
    got.wait(WAIT)
    with pytest.raises(SubmitError):
        cb.submit_job(s.submodels["decode"], inp, out, task_type="pingpong")
    assert s.device.busy_task_types() == ()
    s.device.enable_parallel_mode(False)


# --- buffer pool --------------------------------------------------------------------------


def test_buffer_pool_reuses_buffers(board):
    in0, out0 = InputBuf.constructed, OutputBuf.constructed
    s = _session(board, parallel=True)
    n_requests, n_steps = 5, 4
    for r in range(n_requests):
        seq = r % 3
        s.kv.free(seq)
        pending = []
        for k in range(n_steps):
            cells = s.kv.apply(seq, 1, timeout=0.5)
            kind = "prefill" if k == 0 else "decode"
            pending.append(s.step(kind, seq, [100 + k], [k], cells))
            pending.pop(0).wait(WAIT)
        for o in pending:
            o.wait(WAIT)
    assert InputBuf.constructed - in0 <= s.pool.size
    assert OutputBuf.constructed - out0 <= s.pool.size
    assert s.pool.free_count == s.pool.size
    assert s.job_counters().finished == n_requests * n_steps


def test_pool_release_refuses_busy_pair(board):
    s = _session(board)
    pool = BufferPool(s.calbin, 1)
    pair = pool.acquire()
    with pytest.raises(SubmitError):
        pool.acquire(0.0)
    board.gate.close()
    cells = s.kv.apply(0, 1, timeout=0.1)
    pair.inp.write(0, [1], [0], cells)
    pair.inp.set_csr(past_kv_cur_seq_len=0, cur_seq_len=1)
    s.calbin.infer(s.submodels["decode"], pair.inp, pair.out)
    with pytest.raises(SubmitError, match="still in use"):
        pool.release(pair)
    board.gate.open()
    pair.out.wait(WAIT)
    pool.release(pair)
    assert pool.free_count == 1


# --- the inference plane cannot reach maintenance functions -------------------------------

FORBIDDEN = {"registers", "reset", "clear_memory", "clear", "load_model", "faults", "read_register",
             "write_register", "dump_registers", "clear_kv", "config_metadata", "arm_fault", "disarm_faults",
             "scratch_submit", "free_seq", "close"}


def _public_paths(obj, depth=6, path="", seen=None):
    """Every public attribute path from ``obj`` into sim_backend objects (and containers)."""
    seen = set() if seen is None else seen
    if depth == 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    mod = type(obj).__module__ or ""
    if isinstance(obj, (dict,)):
        children = [(f"[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple)):
        children = [(f"[{i}]", v) for i, v in enumerate(obj)]
    elif mod.startswith("sim_backend"):
        children = []
        for name in dir(obj):
            if name.startswith("_"):
                continue
            yield f"{path}.{name}", name
            try:
                children.append((f".{name}", getattr(obj, name)))
            except Exception:  # noqa: BLE001 - a property may refuse; it is still listed
                pass
    else:
        return
    for suffix, child in children:
        if callable(child) and not isinstance(child, (dict, list, tuple)):
            continue
        yield from _public_paths(child, depth - 1, path + suffix, seen)


def test_inference_surfaces_have_no_path_to_maintenance(board):
    from sim_backend.compose import build_system

    # the walker does find such paths where they exist (positive control)
    assert {"registers", "reset", "clear_memory"} <= {a for _, a in _public_paths(board, path="board")}
    s = _session(board, parallel=True)
    out = _prefill(s, 0)
    out.wait(WAIT)
    for root, name in [(s, "RuntimeSession"), (s.device, "VirtualDevice"), (s.calbin, "Calbin"), (out, "OutputBuf")]:
        bad = [p for p, attr in _public_paths(root, path=name) if attr in FORBIDDEN]
        assert not bad, bad
    with build_system(numerics=False, maintenance=False) as system:
        bad = [p for p, attr in _public_paths(system.inference, path="InferencePlane") if attr in FORBIDDEN]
        assert not bad, bad
        assert not hasattr(system.inference, "registers") and not hasattr(system.inference, "reset")


# --- maintenance-only runtime functions -----------------------------------------------------


def test_maintenance_runtime_needs_a_lease(board, tmp_path):
    mr = MaintenanceRuntime(board)
    calls = [lambda L: mr.read_register(L, "CALCORERT_COMMIT"), lambda L: mr.write_register(L, "CHIP0_SCRATCH", 1),
             lambda L: mr.dump_registers(L), lambda L: mr.config_metadata(L), lambda L: mr.clear_kv(L),
             lambda L: mr.reset(L, 5.0), lambda L: mr.clear_memory(L), lambda L: mr.load_model(L),
             lambda L: mr.free_seq(L, mr.scratch_seq), lambda L: mr.arm_fault(L, "ccu_exception"),
             lambda L: mr.disarm_faults(L),
             lambda L: mr.scratch_submit(L, "decode", mr.scratch_seq, [1], 0)]
    for call in calls:
        with pytest.raises(MaintenanceRefused):
            call(None)
    lease = object()
    assert mr.read_register(lease, "CALCORERT_COMMIT") == 0x03F9C2AB
    mr.write_register(lease, "CHIP0_SCRATCH", 7)
    assert mr.read_register(lease, 0x1010) == 7
    with pytest.raises(MaintenanceRefused, match="read-only"):
        mr.write_register(lease, "BOARD_ID", 1)
    with pytest.raises(MaintenanceRefused):
        mr.read_register(lease, "NO_SUCH_REG")
    meta = mr.config_metadata(lease)
    assert meta["submodels"]["prefill"]["effective_type"] == "llm_prefill" and meta["context"] == 40960
    s = _session(board)
    _prefill(s, 0).wait(WAIT)
    assert board.kv.used_cells > 0
    mr.clear_kv(lease)
    assert board.kv.used_cells == 0
    # a custom check (the maintenance plane's) refuses a stale lease
    def check(action, lease):
        if lease != "current":
            raise MaintenanceRefused(action, "lease is not the current one")
    strict = MaintenanceRuntime(board, check)
    with pytest.raises(MaintenanceRefused):
        strict.dump_registers("old")
    assert strict.dump_registers("current")["BOARD_ID"] == 0xCA1C0002


def test_scratch_jobs_go_through_the_checked_runtime_path(bundle):
    """The maintenance runtime's scratch jobs use the same InputBuf/CSR checks as the engine's."""
    b = SimulatedBoard(bundle, CostModel.load(None), numerics=True, kv_cells=256)
    try:
        mr = MaintenanceRuntime(b)
        out = mr.scratch_submit("lease", "prefill", mr.scratch_seq, [9707, 11, 1879, 0], 0)
        res = out.wait(WAIT)
        # the D2H array is handed over as is: the OutputBuf shows the result's bits, no second copy
        assert res.logits.dtype == np.uint16 and res.logits.shape == (bundle.shape.vocab,)
        assert out.logits is res.logits and res.n_tokens == 4
        with pytest.raises(SubmitError):
            mr.scratch_submit("lease", "nosuch", mr.scratch_seq, [1], 4)
        with pytest.raises(CalError):
            mr.scratch_submit("lease", "decode", mr.scratch_seq, [bundle.shape.vocab + 5], 4)  # token id out of range
        mr.free_seq("lease", mr.scratch_seq)
        assert b.kv.used_cells == 0
    finally:
        b.close()

def test_discarded_buffer_returns_to_the_pool_when_its_job_ends(board):
    s = _session(board)  # pool of 1
    board.gate.close()
    out = _prefill(s, 0)
    with pytest.raises(WaitTimeout):
        out.wait(0.01)
    out.discard()  # the caller gives up (the engine ends that request failed)
    with pytest.raises(SubmitError):
        s.pool.acquire(0.0)  # still running: not reusable yet
    board.gate.open()
    pair = s.pool.acquire(WAIT)  # reclaimed once the job ended
    s.pool.release(pair)
    s.kv.free(0)
    assert _prefill(s, 0).wait(WAIT).kind == "prefill"


def test_output_buffer_logits_none_before_a_result_and_in_timing_only_mode(board):
    s = _session(board)
    board.gate.close()
    out = _prefill(s, 0)
    assert out.logits is None  # still running: no result yet
    board.gate.open()
    res = out.wait(WAIT)
    assert res.logits is None and out.logits is None  # timing-only board: no logits exist


def test_a_leftover_one_token_prefill_chunk_runs_the_decode_submodel():
    """facts.md F1: the sub-model is picked by n_tokens > 1, so a 27-token prompt cut into a
    26-token chunk and a 1-token chunk runs prefill(26) then the DECODE sub-model for the last
    token (priced as a decode step), and its first token comes from that step."""
    from sim_backend.bundle.shapes import ModelShape
    from sim_backend.compose import build_system
    from sim_backend.model.costmodel import CostModel
    from sim_backend.model.trace import StepRecorder
    from sim_backend.planes import ChatRequest
    from sim_backend.serving.hosttime import ScriptedHostTimer
    from sim_backend.tools.calibration import ENGINE_PROMPT

    with build_system(numerics=False, maintenance=False, n_slots=1, host_timer=ScriptedHostTimer(0.0),
                      host_time="measured", prefill_chunk=26) as system:
        rec = StepRecorder()
        system.board.add_listener(rec)
        res = system.inference.generate(ChatRequest.from_prompt(ENGINE_PROMPT, max_tokens=2), timeout=30)
        steps = rec.wait_for(3)
    assert res.status == "finished" and res.timings.prompt_n == 27 and res.timings.predicted_n == 2
    assert [(s.kind, s.n_tokens, s.past_len) for s in steps] == [("prefill", 26, 0), ("decode", 1, 26),
                                                                   ("decode", 1, 27)]
    cm = CostModel.load()
    assert steps[1].cost.total_us == cm.price_step(ModelShape(), "decode", 1, 26).total_us
    # the engine still counts the 1-token chunk as prompt processing (prompt_ms covers both steps)
    assert res.timings.prompt_ms * 1e3 == pytest.approx(steps[0].sim_us + steps[1].sim_us, rel=1e-9)
