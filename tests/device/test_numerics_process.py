"""The numerics worker process gives the in-process results and fails typed when it dies."""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape, NumericShape
from sim_backend.device.numerics_worker import NumericsProcess
from sim_backend.errors import DeviceError
from sim_backend.model.numerics import ShardedModel

SHAPE, NUM = ModelShape(), NumericShape()


def test_worker_matches_in_process_model_and_dies_typed():
    proc = NumericsProcess(SHAPE, NUM, 64, step_timeout_s=60)
    try:
        local = ShardedModel(SHAPE, NUM, n_cells=64)
        toks = np.array([151644, 872, 198, 9707, 11])
        pos = np.arange(5)
        a = proc.forward(toks, pos, pos, pos, pos)
        b = local.forward(toks, pos, pos, pos, pos)
        # only BF16 crosses the pipe: the worker's bits are the local model's logits converted once
        assert a.logits is None and a.logits_bf16.dtype == np.uint16
        assert np.array_equal(a.bf16(), b.bf16()) and a.experts_touched == b.experts_touched
        ctx = np.arange(6)
        a = proc.forward(np.array([11]), np.array([5]), np.array([5]), ctx, ctx)
        b = local.forward(np.array([11]), np.array([5]), np.array([5]), ctx, ctx)
        assert np.array_equal(a.bf16(), b.bf16())
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


def test_dead_worker_shows_as_fault_and_reset_recovers(tmp_path):
    from sim_backend.planes.system import build_system
    from sim_backend.serving.api import ChatRequest
    from sim_backend.serving.sampling import SamplingParams

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
        m = s.maintenance
        lease = m.enter_exclusive("test")
        rep = m.reset(lease)
        assert rep["ok"] and rep["health"]["ok"]
        m.leave_exclusive(lease)
        again = s.inference.generate(req, 60)
        assert again.status == "finished" and again.tokens == first.tokens
        assert s.observation.snapshot().to_dict()["device"]["status"] == "ok"
