"""Compiled numerics kernels (numba), family-neutral: the per-layer work of a decoder layer.

Each kernel is the math of one step of a transformer layer on float32 arrays, written as plain
loops that numba compiles to machine code (``cache=True``: compiled once per machine and kept on
disk; ``nogil=True``: two threads can run kernels at once, one per chiplet). Nothing here knows the
model family: RMSNorm, matrix-vector products (float32 and BF16 weights), per-head RMSNorm with
rotate-half RoPE, grouped-query attention (decode and causal prefill), SwiGLU, a softmax top-k
router. A family's step (``sim_backend.model.compiled`` for Qwen3-MoE) is composed of them inside
one compiled function, so a decode step is one call instead of thousands of numpy calls.

The numpy code in ``layer_ops.py`` and ``numerics.py`` is the reference these kernels are tested against
(``tests/model/test_kernels.py``). Results differ from it only by summation order and by
``exp_f32`` (a polynomial exp within 2 ulp): each dot product of length n is summed in a
different order than BLAS does it, which moves a float32 result by at most ~n * 2**-24 of the sum
of |terms|; over 48 layers this gives logit drifts of order 1e-5 (measured in the tests and by
``python -m sim_backend.model.golden --check``), the same size as the drift between BLAS builds
that the golden bound already covers (``golden.F32_DRIFT_ATOL``). That bound holds for ANY order of
the n additions (|error| <= (n - 1) * 2**-24 * sum|terms| to first order, whatever tree the sums form), so
the register tiling of the decode attention (``_scores``: a score as four 4-term partial sums, added in
turn; ``_weighted_values``: per chunk of keys a sum in vector lanes, chunk sums added in turn) changes no
bound: it is one more order of the same terms. ``exp_in_range`` is ``exp_f32``'s own code without the
clamps, so the same bits on its range.

Layouts (C-contiguous float32 unless said):
- a layer's K and V caches are stored transposed, (kv_heads, D, cells), written in place a cell at a
  time (never rebuilt per call): a decode step's scores ``q . k_t`` and its ``p . v_t`` then read each
  key (value) dimension as one contiguous run over the context, vectorised over keys.
- BF16 weights are ``uint16`` bit patterns (the top half of a float32, ``bf16.py``), widened
  exactly by a 16-bit shift as they are read.

No reshapes: no kernel (here or in ``compiled.py``) reshapes an array or assigns one array to a slice
of another (``a[:, :] = b``). numba compiles the error path of each, and its message formatting (string
joins, integer and repr formatting) took 6.4 s of the 44.5 s of CPU of a first start from an empty cache
(numba's compile events, load ~7, the reference 2-core host); element loops and small copies do the
same work without it.

Shapes in the docstrings: H = hidden, D = head_dim, T = context keys, G = query heads per KV head.

Where the parts live: the decorator, the on-disk cache and the vector-width intrinsics in
:mod:`sim_backend.model.kernel_cache`, the attention kernels (``attend_decode``, ``attend_prefill_t``) in
:mod:`sim_backend.model.attention_kernels`; this module holds the rest (exp, norms, products, router).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.base import BaseContext as TargetContext
from numba.core.typing.context import BaseContext as TypingContext
from numba.core.typing.templates import Signature
from numba.extending import intrinsic

from sim_backend.model.kernel_cache import (
    FMA,
    F32Array,
    I64Array,
    IntLike,
    Lowering,
    U16Array,
    kernel,
    wide_legal,
    wide_vectors,
)

__all__ = [
    "bf16_blocks", "bf16_matvec", "bf16_value", "exp_f32", "exp_in_range", "head_norm_rope", "matvec", "matvec_add",
    "rms_norm", "silu_mul", "softmax_top_k",
]


def _bits_to_f32_typing(typingctx: TypingContext, bits: types.Type) -> Lowering:
    """Reinterpret an int32's bits as a float32 (no conversion): inlines to one bitcast."""
    sig = types.float32(types.int32)

    def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                args: Sequence[ir.Value]) -> ir.Value:
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


_bits_to_f32 = cast("Callable[[np.int32], np.float32]", intrinsic(_bits_to_f32_typing))  # see kernel_cache


def _bf16_value_typing(typingctx: TypingContext, b: types.Type) -> Lowering:
    """BF16 bit pattern (uint16 scalar) -> its float32 value, exactly (as ``bf16.bf16_to_f32``): zero-extend,
    shift left 16, reinterpret; three LLVM instructions in 32-bit lanes, so a loop over it vectorises (a
    numba-level ``np.int32(b) << 16`` widens to int64 first and halves the lanes)."""
    sig = types.float32(types.uint16)

    def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                args: Sequence[ir.Value]) -> ir.Value:
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return sig, codegen


bf16_value = cast("Callable[[np.uint16], np.float32]", intrinsic(_bf16_value_typing))  # see kernel_cache


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # Cody-Waite split of ln 2: n * _LN2_HI is exact for |n| < 2**13
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_HI = np.float32(88.72283)  # ln(largest float32)
_EXP_LO = np.float32(-86.9)  # n >= -125 above it, so 2**(n-1) is a normal float32


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _exp_core(x: np.float32) -> np.float32:
    """exp of a float32 scalar x in [_EXP_LO, _EXP_HI], without the clamps: the body of ``exp_f32``."""
    n: np.float32 = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    # 2**(n-1) * 2: n reaches 128 just below the overflow, whose 2**n alone is not a float32
    return p * _bits_to_f32(np.int32(n + np.float32(126.0)) << 23) * np.float32(2.0)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def exp_f32(x: np.float32) -> np.float32:
    """exp of a float32 scalar, float32, within 2 ulp of the true value on [-87.3, 88.4] (Cephes'
    expf: Cody-Waite reduction to |r| <= ln2/2, degree-6 polynomial, 2**n from its exponent bits);
    +inf above, 0.0 below (where the true value is subnormal or 0), NaN for NaN. Branch-free
    besides the clamps, so loops over it vectorise (libm's expf would be one call per element)."""
    y = _exp_core(min(max(x, _EXP_LO), _EXP_HI))
    if x > _EXP_HI:
        y = np.float32(np.inf)
    if x < _EXP_LO:
        y = np.float32(0.0)
    if x != x:
        y = x
    return y


@kernel(FMA)
def exp_in_range(row: F32Array) -> None:
    """row[:] = exp(row) in place, float32, for a row known to lie in [-86.9, 88.7] (e.g. scores proven
    within ``layer_ops.SCORE_BOUND``): ``exp_f32`` without its clamps and edge selects, so the same bits
    for every such input (the same code, ``_exp_core``, compiled with the same flags as ``exp_shift``),
    in 5 fewer vector operations an element (decode attention at 4K: 12.2 -> 7.9 ms CPU for its 6.3 M
    exps, load ~7). Outside the range the result is meaningless (no clamp): never call it there."""
    wide_vectors()
    for t in range(row.shape[0]):
        row[t] = _exp_core(row[t])


@kernel()
def rms_norm(x: F32Array, w: F32Array, eps: np.float32, out: F32Array) -> None:
    """out = x / sqrt(mean(x^2) + eps) * w; x, w, out (H,) float32 (out may be x). eps float32."""
    wide_legal()
    n = x.shape[0]
    ss = np.float32(0.0)
    for i in range(n):
        ss += x[i] * x[i]
    inv = np.float32(1.0) / np.sqrt(ss * np.float32(1.0 / n) + eps)
    for i in range(n):
        out[i] = x[i] * inv * w[i]


@kernel()
def matvec(x: F32Array, w: F32Array, out: F32Array) -> None:
    """out = x @ w; x (K,), w (K, N) C-contiguous, out (N,) float32 (overwritten)."""
    wide_legal()
    out[:] = 0.0
    matvec_add(x, w, out)


@kernel(FMA)
def matvec_add(x: F32Array, w: F32Array, out: F32Array) -> None:
    """out += x @ w; x (K,), w (K, N) C-contiguous, out (N,) float32. Row by row (axpy), so the
    inner loop runs over N contiguous weights and vectorises without reordering any sum."""
    wide_legal()
    K, N = w.shape
    for k in range(K):
        xk = x[k]
        row = w[k]
        for j in range(N):
            out[j] += xk * row[j]


#: Output columns per block of the BF16 weight layout (:func:`bf16_blocks`): a block's float32
#: accumulators (4 KiB) stay in L1 while its K x 1024 weights stream past once, in memory order.
BF16_BLOCK = 1024


def bf16_blocks(w_bits: U16Array, block: int = BF16_BLOCK) -> U16Array:
    """(K, N) uint16 BF16 weights -> (ceil(N / block), K, block) uint16, zero-padded past N: each
    block of output columns is one contiguous run, so :func:`bf16_matvec` reads the weights as one
    sequential stream (K strided row streams defeat the prefetcher). Same bytes, one copy."""
    K, N = w_bits.shape
    nb = -(-N // block)
    out = np.zeros((nb, K, block), dtype=np.uint16)
    full = N // block
    out[:full] = w_bits[:, :full * block].reshape(K, full, block).transpose(1, 0, 2)
    if full < nb:
        out[full, :, :N - full * block] = w_bits[:, full * block:]
    return out


@kernel(FMA)
def bf16_matvec(x: F32Array, w_blocks: U16Array, bias: F32Array, out: F32Array) -> None:
    """out = x @ w + bias with BF16 weights: x (K,) float32; w_blocks (nb, K, B) uint16 BF16 bit
    patterns in :func:`bf16_blocks`' layout; bias, out (N,) float32 (N <= nb * B). Half the bytes of
    float32 weights; each weight is widened exactly (a 16-bit shift); a column's K products are
    summed in row order."""
    wide_vectors()
    nb, K, B = w_blocks.shape
    N = out.shape[0]
    acc = np.empty(B, dtype=np.float32)
    for bi in range(nb):
        j0 = bi * B
        m = min(B, N - j0)
        acc[:] = 0.0
        blk = w_blocks[bi]
        for k in range(K):
            xk = x[k]
            row = blk[k]
            for j in range(B):
                acc[j] += xk * bf16_value(row[j])
        o = out[j0:j0 + m]
        b = bias[j0:j0 + m]
        for j in range(m):
            o[j] = acc[j] + b[j]


@kernel()
def head_norm_rope(qk: F32Array, w: F32Array, cos: F32Array, sin: F32Array, eps: np.float32) -> None:
    """Per-head RMSNorm then rotate-half (NeoX) RoPE, in place. qk (heads, D) float32; w (heads, D)
    norm weights; cos/sin (D/2,) float32 for this token's position; eps float32."""
    wide_legal()
    nh, D = qk.shape
    half = D // 2
    inv_d = np.float32(1.0 / D)
    for h in range(nh):
        ss = np.float32(0.0)
        for d in range(D):
            ss += qk[h, d] * qk[h, d]
        inv = np.float32(1.0) / np.sqrt(ss * inv_d + eps)
        for d in range(half):
            a = qk[h, d] * inv * w[h, d]
            b = qk[h, d + half] * inv * w[h, d + half]
            qk[h, d] = a * cos[d] - b * sin[d]
            qk[h, d + half] = b * cos[d] + a * sin[d]


@kernel()
def silu_mul(g: F32Array, u: F32Array, scale: np.float32, out: F32Array) -> None:
    """out = silu(g) * u * scale (SwiGLU's activation), elementwise over (F,) float32; scale float32."""
    wide_legal()
    for j in range(g.shape[0]):
        out[j] = g[j] / (np.float32(1.0) + exp_f32(-g[j])) * u[j] * scale


@kernel()
def softmax_top_k(logits: F32Array, k: IntLike, ids: I64Array, w: F32Array) -> None:
    """Router: softmax over E logits, the k most probable (descending, ties to the lower id), their
    probabilities renormalised to sum 1. logits (E,) float32 (overwritten with the probabilities);
    ids (k,) int64 and w (k,) float32 outputs."""
    wide_legal()
    E = logits.shape[0]
    m = logits[0]
    for e in range(E):
        m = max(m, logits[e])
    # the exps in a loop of their own (vector lanes), then their sum in id order (the same order, so the
    # same bits, as summing inside the exp loop, which kept that loop scalar)
    for e in range(E):
        logits[e] = exp_f32(logits[e] - m)
    tot = np.float32(0.0)
    for e in range(E):
        tot += logits[e]
    inv = np.float32(1.0) / tot
    for e in range(E):
        logits[e] *= inv
    # selection in one pass over the ids: ids/w hold the best so far, descending; a probability enters only
    # if strictly above the k-th (so of equal ones the lower id, seen first, stays ahead), after every kept
    # one >= it. The same ids and order as k scans of E picking the largest left, lowest id first (strict >),
    # in one scan: most ids are refused by one compare (a prefill of 512 tokens spent 53 ms CPU in the
    # router's k x E compares, idle 2-core host). Unfilled places keep id -1 and weight -1 (probabilities
    # that are NaN never enter, as before).
    for j in range(k):
        ids[j] = -1
        w[j] = np.float32(-1.0)
    if k > 0:
        for e in range(E):
            pe = logits[e]
            if pe > w[k - 1]:
                j = k - 1
                while j > 0 and w[j - 1] < pe:
                    w[j] = w[j - 1]
                    ids[j] = ids[j - 1]
                    j -= 1
                w[j] = pe
                ids[j] = e
    tot = np.float32(0.0)
    for j in range(k):
        tot += w[j]
    for j in range(k):
        w[j] /= tot
