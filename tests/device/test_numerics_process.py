"""The numerics worker process gives the in-process results and fails typed when it dies."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape, NumericShape
from sim_backend.device.numerics_worker import WORKER_NICE, NumericsProcess
from sim_backend.errors import DeviceError
from sim_backend.model.costmodel import CostModel
from sim_backend.model.numerics import ShardedModel
from sim_backend.planes.types import NUMERICS_DOWN, NUMERICS_NOT_READY
from tests.waits import wait_until

SHAPE, NUM = ModelShape(), NumericShape()


def _same_cost(a, b) -> None:
    """Two StepCosts are the same pricing: every number equal (same code, same machine), graph and flags too."""
    for f in ("kind", "n_tokens", "past_len", "h2d_us", "infer_us", "d2h_us", "total_us", "global_us",
              "categories", "chip_scale", "outside_ops", "submit_us", "experts_expected"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("op_us", "op_start_us", "layer_chip_us", "layer_chip_category_us", "outside_chip_us",
              "outside_chip_category_us", "chip_busy_us", "experts_priced"):
        x, y = getattr(a, f), getattr(b, f)
        assert np.array_equal(x, y, equal_nan=True) and x.dtype == y.dtype, f
        assert not x.flags.writeable, f
    assert dict(a.dram_bytes) == dict(b.dram_bytes) and a.graph is b.graph


def test_worker_matches_in_process_model_and_dies_typed():
    # a what-if cost model (a fitted value changed) must reach the worker as it is, not as shipped
    cost = CostModel.load().with_fitted(per_op_overhead_us=0.5)
    proc = NumericsProcess(SHAPE, NUM, 64, step_timeout_s=60, cost_model=cost)
    try:
        local = ShardedModel(SHAPE, NUM, n_cells=64)
        toks = np.array([151644, 872, 198, 9707, 11])
        pos = np.arange(5)
        a = proc.forward(toks, pos, pos, pos, pos)
        b = local.forward(toks, pos, pos, pos, pos)
        # the worker runs below this process's priority (a busy host slows the simulation, not the keys)
        if hasattr(os, "nice"):
            assert proc.nice == min(19, os.nice(0) + WORKER_NICE)
        if hasattr(os, "sched_getscheduler") and hasattr(os, "SCHED_BATCH"):  # never preempts the UI on waking
            assert os.sched_getscheduler(proc._proc.pid) == os.SCHED_BATCH
        assert proc.cpu_seconds() > 0
        # only BF16 crosses the pipe: the worker's bits are the local model's logits converted once
        assert a.logits is None and a.logits_bf16.dtype == np.uint16
        assert np.array_equal(a.bf16(), b.bf16()) and a.experts_touched == b.experts_touched
        ctx = np.arange(6)
        a = proc.forward(np.array([11]), np.array([5]), np.array([5]), ctx, ctx)
        b = local.forward(np.array([11]), np.array([5]), np.array([5]), ctx, ctx)
        assert np.array_equal(a.bf16(), b.bf16())
        # priced in the worker: the StepCost this process would have computed, a slow chip included
        ctx = np.arange(7)
        a, cost_a = proc.forward_priced(np.array([13]), np.array([6]), np.array([6]), ctx, ctx,
                                        kind="decode", past_len=6, chip_scale=[1.0, 1.5])
        b = local.forward(np.array([13]), np.array([6]), np.array([6]), ctx, ctx)
        assert np.array_equal(a.bf16(), b.bf16()) and a.experts_touched == b.experts_touched
        _same_cost(cost_a, cost.price_step(SHAPE, "decode", 1, 6, experts_touched=b.experts_touched,
                                           chip_scale=[1.0, 1.5]))
        assert cost_a.infer_us != CostModel.load().price_step(SHAPE, "decode", 1, 6, chip_scale=[1.0, 1.5]).infer_us
        with pytest.raises(DeviceError, match="chip_scale"):  # a pricing error comes back typed
            proc.forward_priced(np.array([13]), np.array([7]), np.array([7]), np.arange(8), np.arange(8),
                                kind="decode", past_len=7, chip_scale=[0.5, 1.0])
        # the KV cache by cell through the pipe (a slot's saved state): the worker's rows are the local model's
        assert proc.kv_layout() == local.kv_layout()
        rows = proc.kv_take(ctx)
        assert all(np.array_equal(a, b) for a, b in zip(rows, local.kv_take(ctx), strict=True))
        proc.kv_put(ctx + 20, rows)
        assert all(np.array_equal(a, b) for a, b in zip(proc.kv_take(ctx + 20), rows, strict=True))
        proc.clear_kv()
        proc._proc.kill()
        proc._proc.join(5)
        with pytest.raises(DeviceError):
            proc.forward(np.array([11]), np.array([6]), np.array([6]), ctx, ctx)
    finally:
        proc.close()


def test_a_timed_out_worker_is_never_reused():
    """After a timeout the pipe may hold a late answer: the worker is marked broken and refuses calls."""
    import os
    import signal

    proc = NumericsProcess(SHAPE, NUM, 64, step_timeout_s=1.0)
    try:
        ctx = np.arange(1)
        os.kill(proc._proc.pid, signal.SIGSTOP)
        with pytest.raises(DeviceError):
            proc.forward(np.array([300]), np.array([0]), np.array([0]), ctx, ctx)
        assert proc.broken
        os.kill(proc._proc.pid, signal.SIGCONT)
        with pytest.raises(DeviceError, match="unusable"):
            proc.forward(np.array([100]), np.array([0]), np.array([0]), ctx, ctx)
    finally:
        proc.close()


def test_closing_a_worker_with_a_call_in_flight_does_not_wait_for_the_call():
    """A forward in flight on a hung worker (SIGSTOP: a stuck host) held the call lock until its own timeout
    (the engine's 300 s by default), and close() waited for it. Now close() waits 0.5 s for the lock, then
    ends the worker: the forward ends at once with a typed error (the connection is gone)."""
    import os
    import signal
    import threading

    proc = NumericsProcess(SHAPE, NUM, 16, step_timeout_s=600.0)
    ctx = np.arange(1)
    errors: list[BaseException] = []
    os.kill(proc._proc.pid, signal.SIGSTOP)

    def forward() -> None:
        try:
            proc.forward(np.array([1]), np.array([0]), np.array([0]), ctx, ctx)
        except DeviceError as e:
            errors.append(e)

    th = threading.Thread(target=forward, daemon=True)
    th.start()
    assert wait_until(proc._lock.locked, timeout=30)  # the forward holds the call lock, waiting for its answer
    proc.close()  # SIGTERM stays pending on a stopped process; the SIGKILL after it ends it
    th.join(120)  # far below the forward's own 600 s bound
    assert not th.is_alive() and len(errors) == 1 and proc.broken
    assert wait_until(lambda: not proc._proc.is_alive(), timeout=60, step=0.05)


def test_dead_worker_shows_as_fault_and_reset_recovers(tmp_path):
    from sim_backend.compose import build_system
    from sim_backend.planes import ChatRequest, SamplingParams

    with build_system(numerics_process=True, audit_path=tmp_path / "a.jsonl", drain_timeout_s=0.5) as s:
        req = ChatRequest.from_prompt("hi", max_tokens=4, sampling=SamplingParams(temperature=0.0))
        first = s.inference.generate(req, 60)
        assert first.status == "finished"
        s.board.model._proc.kill()
        s.board.model._proc.join(5)
        bad = s.inference.generate(req, 60)
        assert bad.status == "failed" and "numerics process" in bad.error["message"]
        snap = s.observation.snapshot().to_dict()
        assert snap["device"]["status"].startswith("fault") and snap["device"]["chiplets"][0]["state"] == "fault"
        assert snap["device"]["numerics_broken"] is True and snap["device"]["numerics_starting"] is False
        m = s.maintenance
        lease = m.enter_exclusive("test")
        rep = m.reset(lease)
        assert rep["ok"] and rep["health"]["ok"]
        m.leave_exclusive(lease)
        again = s.inference.generate(req, 60)
        assert again.status == "finished" and again.tokens == first.tokens
        assert s.observation.snapshot().to_dict()["device"]["status"] == "ok"
        assert s.observation.snapshot().device.numerics_broken is False


def test_a_worker_that_fails_its_start_says_so_in_replies_and_on_the_device_line(tmp_path):
    """Killed during its background start: every request then runs timing-only until a reset or reload, and
    the reply and the device line say the worker is down (not "still compiling", not "numerics up to N")."""
    from calconsole.widgets.render import numerics_text
    from sim_backend.compose import build_system
    from sim_backend.planes import ChatRequest, SamplingParams

    req = ChatRequest.from_prompt("hi", max_tokens=3, sampling=SamplingParams(temperature=0.0))
    with build_system(numerics_process=True, numerics_background_start=True, n_slots=1,
                      audit_path=tmp_path / "a.jsonl") as s:
        assert not s.board.numerics_ready  # importing numpy and numba in the spawned worker: seconds
        s.board.model._proc.kill()
        assert wait_until(lambda: s.board.numerics_broken, timeout=60)
        d = s.observation.snapshot().device
        assert d.numerics_broken and not d.numerics_starting
        assert numerics_text(d) == "numerics worker down: requests fail or run timing-only until a reset or reload"
        res = s.inference.generate(req, 60)
        assert res.status == "finished" and res.timings.numerics is False
        assert res.timings.timing_only_reason == NUMERICS_DOWN


def test_board_with_worker_prices_there_and_matches_in_process_board(monkeypatch):
    """The console's board (numerics and pricing in the worker) gives the in-process board's tokens and
    StepCosts exactly, a slow chip included; this process never prices a numeric step."""
    from sim_backend.compose import build_system
    from sim_backend.planes import ChatRequest, SamplingParams

    req = ChatRequest.from_prompt("price me", max_tokens=5, sampling=SamplingParams(temperature=0.0))
    runs = {}
    for worker in (False, True):
        steps: list = []
        with build_system(numerics_process=worker, maintenance=False, n_slots=1) as s:
            s.board.faults.slow_chip[1] = 1.25
            s.board.add_listener(steps.append)
            calls: list = []
            if worker:
                assert s.board.model.prices_steps

                def count(*a, _price=s.board.cost_model.price_step, _calls=calls, **k):
                    _calls.append(a)
                    return _price(*a, **k)

                monkeypatch.setattr(s.board.cost_model, "price_step", count)
            res = s.inference.generate(req, 60)
            if worker:
                assert calls == []  # every step of this request was numeric: priced in the worker
        assert res.status == "finished"
        runs[worker] = (res.tokens, steps)
    assert runs[True][0] == runs[False][0]
    assert [r.kind for r in runs[True][1]] == [r.kind for r in runs[False][1]]
    for a, b in zip(runs[True][1], runs[False][1], strict=True):
        assert a.sim_us == b.sim_us  # (start/end include measured host time, booked on the clock)
        _same_cost_values(a.cost, b.cost)


def _same_cost_values(a, b) -> None:
    # the boards have separate CostModel instances: their graphs are equal, not the same object
    for f in ("kind", "n_tokens", "past_len", "h2d_us", "infer_us", "d2h_us", "total_us", "global_us", "chip_scale"):
        assert getattr(a, f) == getattr(b, f), f
    for f in ("op_us", "op_start_us", "layer_chip_us", "layer_chip_category_us"):
        assert np.array_equal(getattr(a, f), getattr(b, f), equal_nan=True), f
    assert a.graph is not None and len(a.graph.ops) == len(b.graph.ops)


def test_an_f32_calbin_worker_returns_the_float32_logits():
    """A shape whose calbin returns F32 logits (a C3 variant): the shared buffer carries float32, the
    in-process model's own values (no BF16 rounding), and the D2H is priced at vocab x 4 B."""
    shape = dataclasses.replace(SHAPE, logits_dtype="f32")
    cost = CostModel.load()
    proc = NumericsProcess(shape, NUM, 16, step_timeout_s=60, cost_model=cost)
    try:
        local = ShardedModel(shape, NUM, n_cells=16)
        toks = np.array([151644, 872, 198])
        pos = np.arange(3)
        a, c = proc.forward_priced(toks, pos, pos, pos, pos, kind="prefill", past_len=0, chip_scale=None)
        b = local.forward(toks, pos, pos, pos, pos)
        assert a.logits_bf16 is None and a.logits.dtype == np.float32 and a.logits.shape == (SHAPE.vocab,)
        assert np.array_equal(a.device_logits("f32"), b.logits)
        hw = cost.hw.hardware
        assert c.d2h_us == pytest.approx(hw["pcie_latency_us"] + SHAPE.vocab * 4 / (hw["pcie_gbps"] * 1e3))
    finally:
        proc.close()


def test_background_start_serves_timing_only_until_the_worker_is_ready(tmp_path):
    """The console does not wait for the worker (a first start compiles its kernels for minutes on a busy
    host): requests admitted before it answers run timing-only, later ones run the numerics."""
    from sim_backend.compose import build_system
    from sim_backend.planes import ChatRequest, SamplingParams

    req = ChatRequest.from_prompt("hi", max_tokens=3, sampling=SamplingParams(temperature=0.0))
    with build_system(numerics_process=True, numerics_background_start=True, n_slots=1,
                      audit_path=tmp_path / "a.jsonl") as s:
        # the spawned worker imports numpy and numba and builds its weights (seconds): not ready yet
        assert not s.board.numerics_ready and not s.board.numerics_broken
        assert s.observation.snapshot().device.numerics_starting  # the console says so meanwhile
        early = s.inference.generate(req, 120)
        assert early.status == "finished"
        assert s.observation.snapshot().slots[0].numeric is False  # ran timing-only, and says why
        assert early.timings.timing_only_reason == NUMERICS_NOT_READY
        assert wait_until(lambda: s.board.numerics_ready, timeout=300, step=0.1)
        assert not s.observation.snapshot().device.numerics_starting
        later = s.inference.generate(req, 120)
        assert later.status == "finished" and s.observation.snapshot().slots[0].numeric is True
        assert s.board.model.nice is not None


def test_closing_a_worker_during_its_background_start_returns_at_once():
    proc = NumericsProcess(SHAPE, NUM, 16, wait=False)
    assert not proc.ready
    proc.close()  # bounded (SIGTERM, then SIGKILL after 2 s), whatever the start is doing
    assert proc.broken
    # a niced process on a busy host can take a while to finish dying even after SIGKILL: wait for the state
    assert wait_until(lambda: not proc._proc.is_alive(), timeout=60, step=0.05)
    with pytest.raises(DeviceError, match="unusable"):
        proc.forward(np.array([1]), np.array([0]), np.array([0]), np.array([0]), np.array([0]))


def test_closing_the_system_with_a_step_hung_in_the_worker_is_bounded(tmp_path):
    """A step in flight on a hung worker (SIGSTOP): closing the system waited out the step's own bound (300 s by
    default) in the engine's join. Now the engine gets a grace, then the device is closed under the step: the
    request gets its result and the close returns well before the step's bound."""
    import os
    import signal
    import threading

    from sim_backend.compose import build_system
    from sim_backend.planes import ChatRequest, SamplingParams

    s = build_system(numerics_process=True, audit_path=tmp_path / "a.jsonl", n_slots=1)
    os.kill(s.board.model._proc.pid, signal.SIGSTOP)
    h = s.inference.submit(ChatRequest.from_prompt("hi", max_tokens=4, sampling=SamplingParams(temperature=0.0)))
    assert wait_until(lambda: s.board.model._lock.locked(), timeout=60)  # the prefill is in the stopped worker
    closer = threading.Thread(target=s.close, daemon=True)
    closer.start()
    closer.join(120)  # grace 5 s + the worker's end (~5 s); far below the step's 300 s bound
    assert not closer.is_alive()
    res = h.result(10)
    assert res.status in ("cancelled", "failed")


def test_worker_cpu_is_read_finer_than_clock_ticks():
    # psutil's user + system of another process counts 10 ms ticks: a 2-step bench run read 0.0 ms of worker
    # CPU. schedstat counts ns: a little work shows, and a process that is not there reads as unknown
    import subprocess
    import sys

    from sim_backend.device.numerics_worker import _schedstat_ns

    if not sys.platform.startswith("linux"):
        pytest.skip("schedstat is Linux's")
    # a child that works a little on each line it reads and answers: read while it waits, as the bench reads
    # the worker's between steps
    child = subprocess.Popen([sys.executable, "-c", "import sys\nfor line in sys.stdin:\n"
                              "    sum(i * i for i in range(20_000)); print('done', flush=True)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"  # started and waiting again
        a = _schedstat_ns(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        b = _schedstat_ns(child.pid)
        assert a is not None and b is not None and b > a, (a, b)
    finally:
        child.kill()
        child.wait(10)
    assert _schedstat_ns(None) is None and _schedstat_ns(2**22 + 12345) is None
