"""SimulatedBoard.reset() racing job submission never loses a job.

A reset may land anywhere around a submit: before its job reaches the queue,
between the device thread taking it off the queue and marking it running,
while it runs, or while the device thread paces it. Under every interleaving
each job ends (done, or DeviceReset if it was pending/running at a reset),
the job counters balance, and every buffer pair goes back to its pool.

The stress test is bounded by iterations (resets), never by wall time, and
asserts no timings.
"""

from __future__ import annotations

import queue
import random
import sys
import threading
import time

import numpy as np
import pytest

from sim_backend.device.board import SimulatedBoard
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.device.jobs import Job, JobState
from sim_backend.errors import DeviceNotReady, DeviceReset, KVExhausted, SubmitError, WaitTimeout
from sim_backend.model.costmodel import CostModel
from sim_backend.planes import ChatRequest
from sim_backend.runtime.session import RuntimeSession

RESETS = 150  # iterations of the reset thread; submitters run until it is done
SWITCH_S = 1e-5  # host s between forced GIL switches (default 5e-3)
END_WAIT = 10.0  # host s: generous bound for a job that must have ended already


def balanced(c) -> bool:
    return c.submitted == c.finished + c.failed + c.pending + c.running


def _direct(board, seq, stop, jobs, errors):
    """Hammer board.submit directly (no buffers): many jobs queued at once, waited for at the end."""
    tok = np.array([151644], dtype=np.int64)
    while not stop.is_set():
        try:
            board.kv.free(seq)
            cells = board.kv.apply(seq, 1, timeout=0.0, positions=[0])
            ctx, pos = board.kv.seq_cells(seq)
            jobs.append(board.submit("decode", seq, tok, np.array([0]), np.asarray(cells), ctx, pos))
        except (KVExhausted, SubmitError, DeviceNotReady):
            pass  # a reset cleared the KV between apply and submit, or is under way: try again
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            return


def _session(rt, seq, stop, jobs, errors):
    """The engine's path: pooled buffer pair, step(), wait() (result or DeviceReset), pair back to the pool."""
    while not stop.is_set():
        try:
            rt.kv.free(seq)
            cells = rt.kv.apply(seq, 1, timeout=0.0, positions=[0])
            out = rt.step("decode", seq, [151644], [0], cells)
        except (KVExhausted, SubmitError, DeviceNotReady):
            continue  # KV cleared / reset under way / pool exhausted (the pool is checked at the end)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            return
        jobs.append(out._job)
        try:
            out.wait(END_WAIT)
        except DeviceReset:
            pass
        except WaitTimeout:
            out.discard()  # a lost job: the pool is checked at the end
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            return


@pytest.mark.parametrize("pacing", [Pacing(PacingMode.FAST), Pacing(PacingMode.REALTIME, speed=1000.0)],
                         ids=["fast", "realtime"])
def test_reset_racing_submit_loses_no_job(bundle, pacing):
    board = SimulatedBoard(bundle, CostModel.load(None), numerics=False, pacing=pacing, kv_cells=256)
    sessions = [RuntimeSession(board) for _ in range(2)]
    stop = threading.Event()
    jobs: list = []
    errors: list = []
    threads = [threading.Thread(target=_direct, args=(board, 10 + i, stop, jobs, errors)) for i in range(2)]
    threads += [threading.Thread(target=_session, args=(rt, 20 + i, stop, jobs, errors))
                for i, rt in enumerate(sessions)]
    old_switch = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_S)  # switch threads often: many more interleavings per reset
    try:
        for t in threads:
            t.start()
        failed_by_resets = unbalanced_reads = 0
        rng = random.Random(9)
        for _ in range(RESETS):
            # let submitters in (a reset refuses submits while under way), then land at a random offset
            seen = board.counters().submitted
            give_up = time.monotonic() + 1.0
            while board.counters().submitted == seen and time.monotonic() < give_up:
                time.sleep(1e-4)
            for _ in range(rng.randrange(4)):
                time.sleep(0)
            failed_by_resets += board.reset(timeout=END_WAIT)["failed_jobs"]
            if not balanced(board.counters()):  # one consistent read: must balance at every moment
                unbalanced_reads += 1
        stop.set()
        for t in threads:
            t.join(END_WAIT + 5)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        lost = []
        deadline = time.monotonic() + END_WAIT  # one shared bound for all the waits
        for j in jobs:
            try:
                j.wait(max(0.0, deadline - time.monotonic()))
            except DeviceReset:
                pass
            except WaitTimeout:
                lost.append(j.id)
        assert lost == [], f"{len(lost)} of {len(jobs)} jobs never ended; {board.counters()}"
        states = {j.state for j in jobs}
        assert states <= {JobState.DONE, JobState.FAILED}
        assert all(isinstance(j.error, DeviceReset) for j in jobs if j.state is JobState.FAILED)
        c = board.counters()
        assert balanced(c) and unbalanced_reads == 0, (c, unbalanced_reads)
        assert (c.pending, c.running) == (0, 0), c
        assert board.accounting_problems() == []
        assert c.submitted == len(jobs) and c.resets == RESETS
        assert c.failed == sum(j.state is JobState.FAILED for j in jobs) == failed_by_resets
        assert c.finished == sum(j.state is JobState.DONE for j in jobs)
        assert c.failed > 0 and c.finished > 0  # the race was really exercised
        for rt in sessions:
            rt.pool.release(rt.pool.acquire(0))  # acquire reclaims a discarded pair whose job has ended
            assert rt.pool.free_count == rt.pool.size
            assert rt.device.busy_task_types() == ()
    finally:
        sys.setswitchinterval(old_switch)
        stop.set()
        board.close()


# --- the interleavings one at a time -------------------------------------------------------------


class HoldingQueue(queue.Queue):
    """The device queue, but the device thread stops right after taking a job off it (until ``go``)."""

    def __init__(self) -> None:
        super().__init__()
        self.taken = threading.Event()
        self.go = threading.Event()

    def get(self, block=True, timeout=None):
        item = super().get(block, timeout)
        if item is not None:
            self.taken.set()
            assert self.go.wait(END_WAIT)
        return item


def _decode(board, seq):
    cells = board.kv.apply(seq, 1, timeout=0.0, positions=[0])
    ctx, pos = board.kv.seq_cells(seq)
    return board.submit("decode", seq, np.array([151644]), np.array([0]), np.asarray(cells), ctx, pos)


def test_reset_between_dequeue_and_start_fails_the_job(bundle):
    # the device thread has taken the job off the queue but not yet marked it running: the old
    # reset saw it neither queued nor running, and the device thread then dropped it silently
    board = SimulatedBoard(bundle, CostModel.load(None), numerics=False, kv_cells=64)
    try:
        q = HoldingQueue()
        board._queue = q  # the device thread picks it up at its next poll of the queue
        job = _decode(board, 1)
        assert q.taken.wait(END_WAIT)
        rep = board.reset(timeout=END_WAIT)
        assert rep["failed_jobs"] == 1
        with pytest.raises(DeviceReset):
            job.wait(0)  # ended by the reset itself, not by a later timeout
        q.go.set()
        after = _decode(board, 2)
        assert after.wait(END_WAIT).job_id == after.id  # the device thread goes on serving
        c = board.counters()
        assert (c.submitted, c.failed, c.finished, c.pending, c.running) == (2, 1, 1, 0, 0)
        assert board.accounting_problems() == []
    finally:
        board.close()


def test_submit_while_a_reset_is_under_way_is_refused(bundle):
    board = SimulatedBoard(bundle, CostModel.load(None), numerics=False, kv_cells=64)
    inside, release = threading.Event(), threading.Event()
    power_on = board.registers.power_on

    def slow_power_on():
        inside.set()
        assert release.wait(END_WAIT)
        power_on()

    board.registers.power_on = slow_power_on
    try:
        t = threading.Thread(target=board.reset, kwargs={"timeout": END_WAIT})
        t.start()
        assert inside.wait(END_WAIT)
        cells = board.kv.apply(1, 1, timeout=0.0, positions=[0])
        ctx, pos = board.kv.seq_cells(1)
        with pytest.raises(DeviceNotReady, match="resetting"):
            board.submit("decode", 1, np.array([1]), np.array([0]), np.asarray(cells), ctx, pos)
        assert board.counters().submitted == 0  # refused before anything was counted
        release.set()
        t.join(END_WAIT)
        assert not t.is_alive()
        board.kv.free(1)
        job = _decode(board, 1)  # after the reset the device takes work again
        assert job.wait(END_WAIT).n_tokens == 1
        assert board.accounting_problems() == []
    finally:
        release.set()
        board.close()


def test_submit_with_kv_cleared_under_it_is_a_submit_error(bundle):
    # a reset cleared the KV between apply and submit: the context no longer holds the new token
    board = SimulatedBoard(bundle, CostModel.load(None), numerics=False, kv_cells=64)
    try:
        cells = board.kv.apply(1, 1, timeout=0.0, positions=[0])
        board.reset(timeout=END_WAIT)
        ctx, pos = board.kv.seq_cells(1)
        with pytest.raises(SubmitError, match="must hold the 1 new token"):
            board.submit("decode", 1, np.array([1]), np.array([0]), np.asarray(cells), ctx, pos)
        assert board.counters().submitted == 0
    finally:
        board.close()


def test_submit_after_close_is_refused(bundle):
    board = SimulatedBoard(bundle, CostModel.load(None), numerics=False, kv_cells=64)
    cells = board.kv.apply(1, 1, timeout=0.0, positions=[0])
    ctx, pos = board.kv.seq_cells(1)
    board.close()
    with pytest.raises(SubmitError, match="closed"):
        board.submit("decode", 1, np.array([1]), np.array([0]), np.asarray(cells), ctx, pos)


# --- the maintenance plane's health check really checks ------------------------------------------


@pytest.fixture
def system(make_system):
    return make_system(numerics=False, drain_timeout_s=0.3, reset_timeout_s=5.0)


def _checks(rep):
    return {c["check"]: c for c in rep["health"]["checks"]}


def test_health_after_reset_checks_accounting_and_buffers(system):
    m = system.maintenance
    assert system.inference.generate(ChatRequest.from_prompt("hi", max_tokens=3), timeout=30).status == "finished"
    lease = m.enter_exclusive("alice")
    rep = m.reset(lease)
    checks = _checks(rep)
    assert rep["ok"] and all(checks[k]["ok"] for k in ("job accounting", "no job in flight", "buffer pool full"))
    assert checks["buffer pool full"]["detail"] == "1 of 1 buffer pairs free"
    m.leave_exclusive(lease)


def test_health_fails_when_a_job_was_lost_by_the_counters(system):
    m, b = system.maintenance, system.board
    lease = m.enter_exclusive("alice")
    with b._lock:
        b._submitted += 1  # what the old race left behind: a job counted as submitted and never accounted
    rep = m.reset(lease)
    assert rep["ok"] is False and "job counters do not balance" in rep["health"]["detail"]
    assert m.audit.entries()[-1]["status"] == "failed"
    m.leave_exclusive(lease)


def test_health_fails_when_a_job_from_before_the_reset_never_ended(system):
    m, b = system.maintenance, system.board
    lease = m.enter_exclusive("alice")
    job = _decode(b, 5)
    job.wait(END_WAIT)
    m.reset(lease)
    ghost = Job(10**9, "decode", 5, job.tokens, job.positions, job.new_cells, job.ctx_cells, job.ctx_positions,
                0, 0.0, "ping")  # a job the old reset neither failed nor ran
    with b._lock:
        b._submitted += 1
        b._pending += 1
        b._live[ghost.id] = ghost  # generation 0: from before the reset
    rep = m.health_check(lease)
    assert rep["ok"] is False
    assert "never ended" in rep["detail"] and "no job in flight" in rep["detail"]
    m.leave_exclusive(lease, force=True)


def test_health_fails_when_the_buffer_pool_stays_exhausted(system):
    m = system.maintenance
    lease = m.enter_exclusive("alice")
    held = system.engine.rt.pool.acquire(0)  # a pair whose job would never end keeps it out of the pool
    try:
        rep = m.reset(lease)
        assert rep["ok"] is False and "buffer pool full: 0 of 1 buffer pairs free" in rep["health"]["detail"]
    finally:
        system.engine.rt.pool.release(held)
    assert m.health_check(lease)["ok"]
    m.leave_exclusive(lease)
