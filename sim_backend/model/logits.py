"""The logits as they cross the D2H link: BF16 bits or float32, as the calbin declares.

The production calbin returns BF16 logits (facts.md F1: 151936 x 2 B = 303,872 B per token); a C3
variant may declare float32 (``ModelShape.logits_dtype`` ``f32``: the dense pilot, 49,152 x 4 B =
196,608 B), so that the host samples the numerics' own float32 values. On the host a step's logits
are one numpy array whose dtype says which: ``uint16`` BF16 bit patterns or ``float32`` values.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim_backend.model.bf16 import bf16_to_f32, f32_to_bf16

__all__ = ["NUMPY_DTYPES", "dtype_of", "empty_landing", "neg_inf", "to_d2h", "to_f32"]

#: numpy dtype of each logits dtype on the host: BF16 as its bit patterns
#: (the keys and item sizes are ``shapes.LOGITS_DTYPE_BYTES``'s, which prices the D2H)
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {"bf16": np.dtype(np.uint16), "f32": np.dtype(np.float32)}


def dtype_of(logits: np.ndarray) -> str:
    """``bf16`` for uint16 BF16 bits, ``f32`` for float32. TypeError for any other array dtype."""
    dt = np.asarray(logits).dtype
    for name, npd in NUMPY_DTYPES.items():
        if dt == npd:
            return name
    raise TypeError(f"logits must be uint16 BF16 bits or float32, got {dt}")


def to_d2h(logits_f32: np.ndarray, dtype: str) -> np.ndarray:
    """float32 logits (any shape) -> what the device returns in ``dtype``: BF16 bits (uint16, rounded to
    nearest even) or the float32 values themselves (the same array when it is already contiguous
    float32). ValueError for an unknown dtype."""
    if dtype == "bf16":
        return f32_to_bf16(logits_f32)
    if dtype == "f32":
        return np.ascontiguousarray(logits_f32, dtype=np.float32)
    raise ValueError(f"unknown logits dtype {dtype!r} (known: {', '.join(NUMPY_DTYPES)})")


def to_f32(logits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """D2H logits (uint16 BF16 bits or float32, any shape) -> float32 values.

    BF16 widens exactly (``bf16.bf16_to_f32``); float32 is returned as is, or copied into ``out``
    (float32, same shape) when given. TypeError for another dtype.
    """
    if dtype_of(logits) == "bf16":
        return bf16_to_f32(logits, out=out)
    if out is None:
        return np.asarray(logits)
    if out.dtype != np.float32 or out.shape != logits.shape:
        raise ValueError(f"out must be float32 with shape {logits.shape}, got {out.dtype} {out.shape}")
    np.copyto(out, logits)
    return out


def neg_inf(dtype: str) -> np.generic:
    """-inf in ``dtype``'s host representation (BF16: the bit pattern 0xFF80)."""
    return np.uint16(0xFF80) if dtype == "bf16" else np.float32(-np.inf)


def empty_landing(vocab: int, dtype: str) -> np.ndarray:
    """An uninitialised (vocab,) host array of ``dtype`` (uint16 for BF16, float32 for F32)."""
    return np.empty(vocab, dtype=NUMPY_DTYPES[dtype])
