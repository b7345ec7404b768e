"""ggml's scalar building blocks for the dense pilot's kernels (``dense_kernels``): float32 bit casts, fused
multiply-add (``llvm.fma``), the C library's ``expf`` / ``cosf`` / ``sinf`` / ``powf``, F16 rounding by the
CPU's conversion, and ggml's AVX2 exp polynomial (``v_expf``, ggml-cpu ``vec.h``).

Every kernel that calls these compiles them into its own machine code, so this file is one of
``kernel_cache.KERNEL_SOURCES`` (an edit starts a fresh kernel cache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.base import BaseContext as TargetContext
from numba.core.typing.context import BaseContext as TypingContext
from numba.core.typing.templates import Signature
from numba.extending import intrinsic

from sim_backend.model.kernel_cache import Lowering, kernel
from sim_backend.model.kernels import _bits_to_f32

F32 = np.float32


def _f32_bits_typing(typingctx: TypingContext, x: types.Type) -> Lowering:
    """Reinterpret a float32's bits as an int32 (no conversion)."""
    sig = types.int32(types.float32)

    def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                args: Sequence[ir.Value]) -> ir.Value:
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


_f32_bits = cast("Callable[[np.float32], np.int32]", intrinsic(_f32_bits_typing))  # see kernel_cache


def _fma32_typing(typingctx: TypingContext, a: types.Type, b: types.Type, c: types.Type) -> Lowering:
    """``a * b + c`` with one rounding (float32; ``llvm.fma``, one instruction on FMA hardware)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                args: Sequence[ir.Value]) -> ir.Value:
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return sig, codegen


fma32 = cast("Callable[[np.float32, np.float32, np.float32], np.float32]", intrinsic(_fma32_typing))


def _libm_lowering(name: str, nargs: int) -> Lowering:
    """The signature and codegen of a call of the C library's float32 function ``name`` of ``nargs``
    float32 arguments."""
    sig = types.float32(*([types.float32] * nargs))

    def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                args: Sequence[ir.Value]) -> ir.Value:
        fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()] * nargs)
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)

    return sig, codegen


def _libm1(name: str) -> Callable[[np.float32], np.float32]:
    """A call of the C library's one-argument float32 function ``name`` (``expf``, ...), as ggml calls it."""

    def one(typingctx: TypingContext, x: types.Type) -> Lowering:
        return _libm_lowering(name, 1)

    return cast("Callable[[np.float32], np.float32]", intrinsic(one))  # see kernel_cache


def _libm2(name: str) -> Callable[[np.float32, np.float32], np.float32]:
    """``_libm1`` for a two-argument function (``powf``)."""

    def two(typingctx: TypingContext, x: types.Type, y: types.Type) -> Lowering:
        return _libm_lowering(name, 2)

    return cast("Callable[[np.float32, np.float32], np.float32]", intrinsic(two))


#: libm's float32 exp, cos, sin and pow (ggml's expf in its flash attention, cosf / sinf / powf in RoPE).
expf = _libm1("expf")
cosf = _libm1("cosf")
sinf = _libm1("sinf")
powf = _libm2("powf")


def _f16_round_typing(typingctx: TypingContext, x: types.Type) -> Lowering:
    """float32 -> the nearest IEEE half value (round half to even, +-inf past 65504), as float32: the CPU's
    own conversion (``fptrunc`` to half and back; F16C on x86-64), as ggml's ``GGML_CPU_FP32_TO_FP16``."""
    sig = types.float32(types.float32)

    def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                args: Sequence[ir.Value]) -> ir.Value:
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


f16_round = cast("Callable[[np.float32], np.float32]", intrinsic(_f16_round_typing))  # see kernel_cache


def _hexf(s: str) -> np.float32:
    return np.float32(float.fromhex(s))


# ggml_v_expf's constants (ggml-cpu vec.h, AVX2 + FMA), exactly as its hexadecimal float literals.
_VX_SHIFT = _hexf("0x1.8p23")
_VX_LOG2E = _hexf("0x1.715476p+0")
_VX_LN2_HI = _hexf("0x1.62e4p-1")
_VX_LN2_LO = _hexf("0x1.7f7d1cp-20")
_VX_C4 = _hexf("0x1.0e4020p-7")
_VX_C3 = _hexf("0x1.573e2ep-5")
_VX_C2 = _hexf("0x1.555e66p-3")
_VX_C1 = _hexf("0x1.fffdb6p-2")
_VX_C0 = _hexf("0x1.ffffecp-1")


@kernel()
def v_expf(x: np.float32) -> np.float32:
    """exp of a float32 as ggml's AVX2 + FMA ``ggml_v_expf`` computes one lane (ARM's optimized-routines
    polynomial: max error 1.45 + 0.5 ulp; beyond |n| > 126 its slow path, lane by lane as its blend does;
    0 for -inf). Integer steps wrap at 32 bits as the vector instructions do."""
    z = fma32(x, _VX_LOG2E, _VX_SHIFT)
    n = z - _VX_SHIFT
    b = fma32(-n, _VX_LN2_LO, fma32(-n, _VX_LN2_HI, x))
    e = np.int64(_f32_bits(z)) << 23
    k = _bits_to_f32(np.int32(e + np.int64(0x3F800000)))
    u = b * b
    j = fma32(fma32(fma32(_VX_C4, b, _VX_C3), u, fma32(_VX_C2, b, _VX_C1)), u, _VX_C0 * b)
    an = abs(n)
    if not an > np.float32(126.0):
        return fma32(j, k, k)
    g = np.int64(0x82000000) if n <= np.float32(0.0) else np.int64(0)
    s1 = _bits_to_f32(np.int32(g + np.int64(0x7F000000)))
    s2 = _bits_to_f32(np.int32(e - g))
    if an > np.float32(192.0):
        return s1 * s1
    return fma32(s2, j, s2) * s1
