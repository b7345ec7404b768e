"""The numerics worker process gives the in-process results and fails typed when it dies."""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.config import ModelShape, NumericShape
from sim_backend.errors import DeviceError
from sim_backend.numerics import ShardedModel
from sim_backend.numerics_process import NumericsProcess

SHAPE, NUM = ModelShape(), NumericShape()


def test_worker_matches_in_process_model_and_dies_typed():
    proc = NumericsProcess(SHAPE, NUM, 64, step_timeout_s=60)
    try:
        local = ShardedModel(SHAPE, NUM, n_cells=64)
        toks = np.array([151644, 872, 198, 9707, 11])
        pos = np.arange(5)
        a = proc.forward(toks, pos, pos, pos, pos)
        b = local.forward(toks, pos, pos, pos, pos)
        assert np.array_equal(a.logits, b.logits) and a.experts_touched == b.experts_touched
        ctx = np.arange(6)
        a = proc.forward(np.array([11]), np.array([5]), np.array([5]), ctx, ctx)
        b = local.forward(np.array([11]), np.array([5]), np.array([5]), ctx, ctx)
        assert np.array_equal(a.logits, b.logits)
        proc.clear_kv()
        proc._proc.kill()
        proc._proc.join(5)
        with pytest.raises(DeviceError):
            proc.forward(np.array([11]), np.array([6]), np.array([6]), ctx, ctx)
    finally:
        proc.close()
