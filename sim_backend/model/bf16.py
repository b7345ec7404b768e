"""BF16 <-> FP32: the one home of the bit shift.

BF16 is the top 16 bits of an IEEE float32, so widening is a 16-bit left
shift and narrowing is round-to-nearest-even on the dropped half. The
device's logits come back as BF16 (facts.md F1: 151936 x 2 B = 303,872 B per
token); the host widens them to FP32 to sample.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SHIFT", "bf16_to_f32", "f32_to_bf16"]

#: Bits between a BF16 pattern and the FP32 it is the top half of.
SHIFT = 16
_SHIFT32 = np.uint32(SHIFT)


def bf16_to_f32(u16: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """BF16 bit patterns -> FP32 values.

    Args:
        u16: ``uint16`` array of BF16 bits, any shape (a decode step's logits are
            shape (151936,), 303,872 B; facts.md F1/F4).
        out: optional ``float32`` array of the same shape to write into
            (e.g. a preallocated landing buffer); must not alias ``u16``.

    Returns:
        ``float32`` array (``out`` if given). Exact: a 16-bit left shift,
        with no temporaries beyond ``out``.

    Raises:
        TypeError: ``u16`` is not ``uint16``. ValueError: ``out`` has the wrong dtype or shape.
    """
    u16 = np.asarray(u16)
    if u16.dtype != np.uint16:
        raise TypeError(f"bf16_to_f32 expects uint16 bit patterns, got {u16.dtype}")
    if out is None:
        out = np.empty(u16.shape, dtype=np.float32)
    elif out.dtype != np.float32 or out.shape != u16.shape:
        raise ValueError(f"out must be float32 with shape {u16.shape}, got {out.dtype} {out.shape}")
    # dtype=uint32 makes the ufunc widen in small buffered chunks, not a full copy.
    np.left_shift(u16, SHIFT, out=out.view(np.uint32), dtype=np.uint32)
    return out


def f32_to_bf16(f32: np.ndarray) -> np.ndarray:
    """FP32 values -> BF16 bit patterns (``uint16``, same shape as ``f32``).

    Round to nearest, ties to even (what the device's BF16 casts do); values
    past the BF16 range round to +-inf; NaN stays NaN (quiet bit forced so a
    payload in the low bits cannot truncate to inf). Anything array-like is
    taken as float32 first.
    """
    f = np.ascontiguousarray(f32, dtype=np.float32)
    bits = f.view(np.uint32)
    # one uint32 scratch, updated in place: bits + 0x7FFF + (bit 16 of bits), then >> 16
    t = np.right_shift(bits, _SHIFT32)
    t &= np.uint32(1)
    t += np.uint32(0x7FFF)
    t += bits
    t >>= _SHIFT32
    rounded = t.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        rounded[nan] = ((bits[nan] >> _SHIFT32) | np.uint32(0x0040)).astype(np.uint16)
    return rounded
