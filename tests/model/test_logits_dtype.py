"""The logits as they cross D2H (``model.logits``): BF16 bits or float32, one array whose dtype says which."""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.bundle.shapes import LOGITS_DTYPE_BYTES
from sim_backend.model import logits as L
from sim_backend.model.bf16 import f32_to_bf16
from sim_backend.model.numerics import StepNumerics


def test_host_dtypes_have_the_priced_item_sizes():
    assert set(L.NUMPY_DTYPES) == set(LOGITS_DTYPE_BYTES)
    for name, size in LOGITS_DTYPE_BYTES.items():
        assert L.NUMPY_DTYPES[name].itemsize == size and L.empty_landing(5, name).nbytes == 5 * size


def test_round_trip_and_dtype_of():
    x = np.array([1.0, -2.5, 8.0 + 2.0**-10, -np.inf], dtype=np.float32)
    bits = L.to_d2h(x, "bf16")
    assert bits.dtype == np.uint16 and L.dtype_of(bits) == "bf16" and np.array_equal(bits, f32_to_bf16(x))
    assert L.to_f32(bits)[2] == 8.0  # BF16 rounds the small difference away
    f = L.to_d2h(x, "f32")
    assert L.dtype_of(f) == "f32" and L.to_f32(f) is f and f[2] == np.float32(8.0 + 2.0**-10)
    out = np.empty(4, np.float32)
    assert L.to_f32(f, out=out) is out and np.array_equal(out, x)
    assert L.neg_inf("bf16") == np.uint16(0xFF80) and L.to_f32(np.array([L.neg_inf("bf16")]))[0] == -np.inf
    assert L.neg_inf("f32") == -np.inf
    with pytest.raises(TypeError, match="uint16 BF16 bits or float32"):
        L.dtype_of(np.zeros(3, np.float16))
    with pytest.raises(ValueError, match="unknown logits dtype"):
        L.to_d2h(x, "fp8")


def test_step_numerics_device_logits():
    x = np.array([1.0, 3.140625, 1.0 + 2.0**-8], dtype=np.float32)
    out = StepNumerics(logits=x, experts_touched=[])
    assert out.device_logits("bf16") is out.bf16() and np.array_equal(out.device_logits("f32"), x)
    only_bits = StepNumerics(logits=None, experts_touched=[], logits_bf16=f32_to_bf16(x))
    with pytest.raises(ValueError, match="only BF16 bits"):
        only_bits.device_logits("f32")
    with pytest.raises(ValueError, match="unknown logits dtype"):
        out.device_logits("f16")
