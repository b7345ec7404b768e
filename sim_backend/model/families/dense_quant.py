"""The dense pilot's quantised matrix products as llama.cpp's CPU computes them: activation rows
quantised to Q8_1 / Q8_0 blocks (``quantise_rows``), the GGUF's Q4_1 / Q8_0 weights split and repacked
for the products (``split_q4_1``, ``pack_q4_1``, ...), and the 8-output block dot products built as LLVM
IR (``_group_fn``, ``quant_matmul``, ``chained_matmul``); see ``dense_kernels`` for the arithmetic emulated.

Its kernels are inlined into ``dense_kernels.dense_forward``, so this file is one of
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

from sim_backend.model.families.ggml_ops import f16_round
from sim_backend.model.kernel_cache import F32Array, I8Array, IntLike, Lowering, U8Array, U16Array, kernel

F32 = np.float32
#: Weights per quantisation block (GGUF QK4_1 = QK8_0 = QK8_1 = 32).
QK = 32
#: float32 lanes of ggml's AVX2 vectors (GGML_F32_EPR); a block's dot product is summed in 8 lanes of 4.
LANES = 8


@kernel()
def quantise_rows(x: F32Array, q: I8Array, d: F32Array, s: F32Array) -> None:
    """Quantise every row of x (n, K) float32 to 8-bit blocks of 32 as llama.cpp's quantize_row_q8_1 / q8_0
    (AVX2) do: per block amax = max |x|, codes rint(x * (127 / amax)) (round half to even; 0 when amax is
    0), written to q (n, K) int8; d (n, nb) float32 the F16-rounded ``amax / 127``; s (n, nb) float32 the
    F16-rounded ``(amax / 127) * sum(codes)`` (Q8_1's sum; unused against Q8_0 weights)."""
    n, K = x.shape
    nb = K // QK
    for i in range(n):
        for b in range(nb):
            o = b * QK
            amax = np.float32(0.0)
            for j in range(QK):
                amax = max(amax, abs(x[i, o + j]))
            db = amax / np.float32(127.0)
            idb = np.float32(127.0) / amax if amax != np.float32(0.0) else np.float32(0.0)
            tot = np.float32(0.0)
            for j in range(QK):
                v = np.float32(np.rint(x[i, o + j] * idb))
                q[i, o + j] = np.int8(v)
                tot += v
            d[i, b] = f16_round(db)
            s[i, b] = f16_round(db * tot)


#: Outputs of a product computed together: one 8-float32 vector, each element one output (``pack_q4_1``).
GROUP = 8
#: Bytes of one group's codes per block: Q4_1 16 per lane (two nibbles a byte), Q8_0 32 per lane.
_Q4_BYTES, _Q8_BYTES = LANES * 16, LANES * 32

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F16, _F32 = ir.HalfType(), ir.FloatType()


def _vec(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def _splat(b: ir.IRBuilder, v: ir.Value, n: int) -> ir.Value:
    u = b.insert_element(ir.Constant(_vec(v.type, n), ir.Undefined), v, ir.Constant(_I32, 0))
    return b.shuffle_vector(u, ir.Constant(_vec(v.type, n), ir.Undefined), ir.Constant(_vec(_I32, n), [0] * n))


def _pair_sums(b: ir.IRBuilder, m: ir.Value, n: int) -> ir.Value:
    """<2n x iN> -> <n x iN>: element i = m[2i] + m[2i+1]."""
    und = ir.Constant(m.type, ir.Undefined)
    ev = b.shuffle_vector(m, und, ir.Constant(_vec(_I32, n), [2 * i for i in range(n)]))
    od = b.shuffle_vector(m, und, ir.Constant(_vec(_I32, n), [2 * i + 1 for i in range(n)]))
    return b.add(ev, od)


def _host_avx2() -> bool:
    """Whether numba compiles for this host (no ``NUMBA_CPU_NAME``) and it has AVX2: the products then use
    its byte and word multiply-add instructions, as ggml's AVX2 build does."""
    import llvmlite.binding as llb
    import numba.core.config

    if getattr(numba.core.config, "CPU_NAME", None):
        return False
    return bool(llb.get_host_cpu_features().get("avx2", False))


_AVX2 = _host_avx2()


def _lane_sums(b: ir.IRBuilder, a8: ir.Value, x8: ir.Value) -> ir.Value:
    """<32 x i8> a (unsigned), x (signed), element 4 r + j -> <8 x i32>: sum over j of a[4r + j] x[4r + j],
    exact. With AVX2 as ggml's ``mul_sum_us8_pairs_float`` before its conversion: ``vpmaddubsw`` (pairs to
    16 bits, saturating, which no sum here reaches: |a| <= 128, |x| <= 127), then ``vpmaddwd`` with ones;
    otherwise in 32-bit products."""
    if _AVX2:
        v32b, v16w = _vec(_I8, 32), _vec(_I16, 16)
        ub = cgutils.get_or_insert_function(b.module, ir.FunctionType(v16w, [v32b, v32b]), "llvm.x86.avx2.pmadd.ub.sw")
        wd = cgutils.get_or_insert_function(b.module, ir.FunctionType(_vec(_I32, 8), [v16w, v16w]),
                                            "llvm.x86.avx2.pmadd.wd")
        return b.call(wd, [b.call(ub, [a8, x8]), ir.Constant(v16w, [1] * 16)])
    w = _vec(_I32, 32)
    return _pair_sums(b, _pair_sums(b, b.mul(b.zext(a8, w), b.sext(x8, w)), 16), 8)


def _block_loop(b: ir.IRBuilder, nb: ir.Value, init: list[ir.Value],
                body: Callable[[ir.Value, list[ir.Value]], list[ir.Value]]) -> list[ir.Value]:
    """Emit ``for i in range(nb): vals = body(i, vals)`` at ``b`` (values carried in registers: phi nodes);
    returns the values after the loop, ``b`` placed after it."""
    fn = b.function
    entry = b.block
    loop = fn.append_basic_block("blocks")
    done = fn.append_basic_block("blocks_done")
    b.cbranch(b.icmp_signed(">", nb, ir.Constant(_I64, 0)), loop, done)
    b.position_at_end(loop)
    bi = b.phi(_I64)
    vals = [b.phi(v.type) for v in init]
    new = body(bi, vals)
    nxt = b.add(bi, ir.Constant(_I64, 1))
    end = b.block
    bi.add_incoming(ir.Constant(_I64, 0), entry)
    bi.add_incoming(nxt, end)
    for p, s, v in zip(vals, init, new, strict=True):
        p.add_incoming(s, entry)
        p.add_incoming(v, end)
    b.cbranch(b.icmp_signed("<", nxt, nb), loop, done)
    b.position_at_end(done)
    out = []
    for s, v in zip(init, new, strict=True):
        f = b.phi(v.type)
        f.add_incoming(s, entry)
        f.add_incoming(v, end)
        out.append(f)
    return out


def _group_fn(module: ir.Module, q4: bool) -> ir.Function:
    """The LLVM function of one group of 8 outputs x one token over a product's blocks, in explicit 8-wide
    vectors (element r = output r), so that ggml's 8 lanes stay in registers across the blocks:

    ``void f(i8* codes, half* dw, half* mw, i8* xq, float* xd, float* xs, i64 nb, float* state, i1 init)``

    state (72 floats, ``product_scratch``): lanes 0..7 (8 outputs each), then the minimums' sum, read at
    the start unless ``init`` (then zeros) and written at the end. Per block b: ``dd = dw * xd[b]`` (float32
    product); per lane l the exact integer sum of its 4 weights' products (codes x activation codes: pairs of
    8-bit products summed to 16 bits, pairs of those to 32, as ggml's AVX2 ``mul_sum_us8_pairs_float``;
    Q8_0 by its sign trick, |w| times x with w's sign) converted to float32, ``lane = fma(dd, sum, lane)``;
    then (Q4_1, a second pass over the blocks, its own chain) ``summ = fma(mw, xs[b], summ)``:
    ggml_vec_dot_q4_1_q8_1 / q8_0_q8_0's arithmetic for each output."""
    name = "calconsole_dot8_q4_1" if q4 else "calconsole_dot8_q8_0"
    got = module.globals.get(name)
    if got is not None:
        return got
    i8p, f16p, f32p = _I8.as_pointer(), _F16.as_pointer(), _F32.as_pointer()
    fnty = ir.FunctionType(ir.VoidType(), [i8p, f16p, f16p, i8p, f32p, f32p, _I64, f32p, ir.IntType(1)])
    fn = ir.Function(module, fnty, name=name)
    fn.linkage = "internal"
    codes, dw, mw, xq, xd, xs, nb, state, init = fn.args
    v8f, v8h, v32b = _vec(_F32, 8), _vec(_F16, 8), _vec(_I8, 32)
    fma = cgutils.get_or_insert_function(module, ir.FunctionType(v8f, [v8f, v8f, v8f]), "llvm.fma.v8f32")
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    sv = b.bitcast(state, v8f.as_pointer())
    zero = ir.Constant(v8f, [0.0] * 8)
    start = [b.select(init, zero, b.load(b.gep(sv, [ir.Constant(_I64, i)]), align=4)) for i in range(LANES + 1)]
    zero8 = ir.Constant(v32b, [0] * 32)

    def half8(p: ir.Value, bi: ir.Value) -> ir.Value:
        return b.fpext(b.load(b.bitcast(b.gep(p, [b.mul(bi, ir.Constant(_I64, GROUP))]), v8h.as_pointer()), align=2),
                       v8f)

    def lanes(bi: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
        dd = b.fmul(half8(dw, bi), _splat(b, b.load(b.gep(xd, [bi])), 8))
        xb = b.mul(bi, ir.Constant(_I64, QK))
        cb = b.mul(bi, ir.Constant(_I64, _Q4_BYTES if q4 else _Q8_BYTES))
        new = []
        for lane in range(LANES):
            xl = b.gep(xq, [b.add(xb, ir.Constant(_I64, 4 * lane))])
            x4 = b.bitcast(_splat(b, b.load(b.bitcast(xl, _I32.as_pointer()), align=1), 8), v32b)  # x[4l..4l+3] x 8
            if q4:
                cp = b.gep(codes, [b.add(cb, ir.Constant(_I64, 16 * lane))])
                cv = b.load(b.bitcast(cp, _vec(_I8, 16).as_pointer()), align=1)
                lo = b.and_(cv, ir.Constant(_vec(_I8, 16), [15] * 16))
                hi = b.lshr(cv, ir.Constant(_vec(_I8, 16), [4] * 16))
                a, x = b.shuffle_vector(lo, hi, ir.Constant(_vec(_I32, 32), list(range(32)))), x4
            else:
                cp = b.gep(codes, [b.add(cb, ir.Constant(_I64, 32 * lane))])
                cv = b.load(b.bitcast(cp, v32b.as_pointer()), align=1)
                neg = b.icmp_signed("<", cv, zero8)
                a, x = b.select(neg, b.sub(zero8, cv), cv), b.select(neg, b.sub(zero8, x4), x4)
            new.append(b.call(fma, [dd, b.sitofp(_lane_sums(b, a, x), v8f), accs[lane]]))
        return new

    fin = _block_loop(b, nb, start[:LANES], lanes)
    if q4:
        fin += _block_loop(b, nb, start[LANES:], lambda bi, s: [
            b.call(fma, [half8(mw, bi), _splat(b, b.load(b.gep(xs, [bi])), 8), s[0]])])
    else:
        fin.append(start[LANES])
    for i, f in enumerate(fin):
        b.store(f, b.gep(sv, [ir.Constant(_I64, i)]), align=4)
    b.ret_void()
    return fn


#: Packed codes of a product (``pack_q4_1``: uint8 nibble pairs; ``pack_q8_0``: int8).
CodeArray = U8Array | I8Array
#: How a kernel calls a ``_dot8`` intrinsic (see ``kernel_cache`` on typing intrinsics).
_Dot8 = Callable[[CodeArray, IntLike, U16Array, IntLike, U16Array, I8Array, IntLike, F32Array, F32Array, IntLike,
                  IntLike, F32Array, bool], None]


def _dot8(q4: bool) -> _Dot8:
    """The numba intrinsic calling ``_group_fn``: (codes, c_off, dw, d_off, mw, xw, x_off, xd, xs, xb_off, nb,
    state, init), offsets in elements of each array's data (C-contiguous runs from there)."""

    def typer(typingctx: TypingContext, codes: types.Type, c_off: types.Type, dw: types.Type, d_off: types.Type,
              mw: types.Type, xw: types.Type, x_off: types.Type, xd: types.Type, xs: types.Type,
              xb_off: types.Type, nb: types.Type, state: types.Type, init: types.Type) -> Lowering:
        i64 = types.int64
        sig = types.void(codes, i64, dw, i64, mw, xw, i64, xd, xs, i64, i64, state, types.boolean)

        def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                    args: Sequence[ir.Value]) -> ir.Value:
            fn = _group_fn(builder.module, q4)
            at = signature.args

            def ptr(i: int, off: int | None, ty: ir.Type) -> ir.Value:
                data = context.make_array(at[i])(context, builder, args[i]).data
                if off is not None:
                    data = builder.gep(data, [args[off]])
                return builder.bitcast(data, ty.as_pointer())

            builder.call(fn, [ptr(0, 1, _I8), ptr(2, 3, _F16), ptr(4, 3, _F16), ptr(5, 6, _I8),
                              ptr(7, 9, _F32), ptr(8, 9, _F32), args[10], ptr(11, None, _F32),
                              builder.trunc(args[12], ir.IntType(1)) if args[12].type != ir.IntType(1) else args[12]])
            return context.get_dummy_value()

        return sig, codegen

    return cast("_Dot8", intrinsic(typer))  # see kernel_cache


_dot8_q4_1 = _dot8(True)
_dot8_q8_0 = _dot8(False)


def pack_q4_1(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 matrix in llama.cpp's layout (``split_q4_1``: codes (N, K) uint8 0..15, d / m (N, K/32) float32
    F16 values) -> the products' layout: outputs in groups of 8 (N padded with zero weights to a multiple of
    8, G groups), per group and block the 8 lanes' codes as 16 bytes each (lane l's 32 codes in the order
    4 r + j, r the output in the group, j its weight 4 l + j of the block; code u in byte u's low nibble for
    u < 16, in byte u - 16's high nibble above, as ggml's ``bytes_from_nibbles_32`` unpacks): codes (G, K/32,
    128) uint8; d, m (G, K/32, 8) uint16, the bits of their F16 values (exact: GGUF stores them as F16; numba
    has no float16 arrays, the products read them as half floats)."""
    N, K = codes.shape
    nb = K // QK
    G = -(-N // GROUP)
    c = np.zeros((G * GROUP, K), np.uint8)
    c[:N] = codes
    u = c.reshape(G, GROUP, nb, LANES, 4).transpose(0, 2, 3, 1, 4).reshape(G, nb, LANES, 32)  # (G, nb, lane, 4r + j)
    byte = (u[..., :16] | (u[..., 16:] << 4)).reshape(G, nb, _Q4_BYTES)
    return (np.ascontiguousarray(byte), _pack_scales(d, G), _pack_scales(m, G))


def pack_q8_0(codes: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q8_0 matrix (``split_q8_0``: codes (N, K) int8, d (N, K/32) float32) -> the products' layout as
    ``pack_q4_1``, one byte a weight (byte 4 r + j of a lane's 32: output r, weight 4 l + j): codes (G, K/32,
    256) int8, d (G, K/32, 8) F16 bits (uint16) and zero minimums (unused)."""
    N, K = codes.shape
    nb = K // QK
    G = -(-N // GROUP)
    c = np.zeros((G * GROUP, K), np.int8)
    c[:N] = codes
    byte = c.reshape(G, GROUP, nb, LANES, 4).transpose(0, 2, 3, 1, 4)
    dp = _pack_scales(d, G)
    return np.ascontiguousarray(byte.reshape(G, nb, _Q8_BYTES)), dp, np.zeros_like(dp)


def _pack_scales(d: np.ndarray, G: int) -> np.ndarray:
    N, nb = d.shape
    p = np.zeros((G * GROUP, nb), np.float16)
    p[:N] = d.astype(np.float16)
    if not np.array_equal(p[:N].astype(F32), d):
        raise ValueError("block scales are not F16 values")
    return np.ascontiguousarray(p.reshape(G, GROUP, nb).transpose(0, 2, 1)).view(np.uint16)


#: Floats of the products' scratch: a group's 8 lanes and minimums' sum.
SCRATCH = (LANES + 1) * GROUP


def product_scratch() -> np.ndarray:
    """The products' scratch (SCRATCH,) float32."""
    return np.zeros(SCRATCH, dtype=F32)


@kernel()
def _finish8(state: F32Array, has_min: bool, out: F32Array, t: IntLike, r0: IntLike, add: bool) -> None:
    """out[t, r0 + r] (``add``: +=) for the group's outputs: its 8 lanes summed as ggml's hsum_float_8 (lanes
    4-7 + 0-3, then (0 + 2) + (1 + 3)), plus the Q4_1 minimums' sum last (``has_min``)."""
    for r in range(min(GROUP, out.shape[1] - r0)):
        s0 = state[4 * GROUP + r] + state[r]
        s1 = state[5 * GROUP + r] + state[GROUP + r]
        s2 = state[6 * GROUP + r] + state[2 * GROUP + r]
        s3 = state[7 * GROUP + r] + state[3 * GROUP + r]
        y = (s0 + s2) + (s1 + s3)
        if has_min:
            y = y + state[8 * GROUP + r]
        if add:
            out[t, r0 + r] += y
        else:
            out[t, r0 + r] = y


@kernel()
def quant_matmul(codes: CodeArray, dw: U16Array, mw: U16Array, has_min: bool, xq: I8Array, xd: F32Array,
                 xs: F32Array, state: F32Array, out: F32Array) -> None:
    """out (n, N) = x @ W for a quantised W as llama.cpp's vec_dot kernels compute each output: per group of
    8 outputs and token, the blocks' lanes in vector registers (``_group_fn``), then ``_finish8``.

    codes / dw / mw from ``pack_q4_1`` (``has_min``) or ``pack_q8_0``; xq (n, >=K) int8 activation codes,
    xd / xs (n, >=K/32) float32 from ``quantise_rows``; state ``product_scratch()``. The result does not
    depend on n."""
    n = xq.shape[0]
    G, nb = codes.shape[0], codes.shape[1]
    for g in range(G):
        co, do = g * codes.strides[0] // codes.itemsize, g * dw.strides[0] // dw.itemsize
        for t in range(n):
            xo, bo = t * xq.strides[0], t * xd.strides[0] // 4
            if has_min:
                _dot8_q4_1(codes, co, dw, do, mw, xq, xo, xd, xs, bo, nb, state, True)
            else:
                _dot8_q8_0(codes, co, dw, do, mw, xq, xo, xd, xs, bo, nb, state, True)
            _finish8(state, has_min, out, t, g * GROUP, False)


@kernel()
def chained_matmul(codes: tuple[U8Array, ...], dw: tuple[U16Array, ...], mw: tuple[U16Array, ...], li: IntLike,
                   xq: I8Array, xd: F32Array, xs: F32Array, state: F32Array, out: F32Array, add: bool) -> None:
    """out (n, N) (``add``: +=) = x @ W for a Q4_1 W whose input rows are split over the chips (the output and
    down projections), as ONE llama.cpp product over the whole row: the chips' blocks accumulated into the
    same lanes in chip order, then summed (``_finish8``) once.

    codes / dw / mw tuples over chips of ``pack_q4_1`` arrays stacked over layers, (L, G, K_c/32, 128) /
    (L, G, K_c/32, 8) (layer ``li`` used); xq (C, n, >=K_c) int8 each chip's activation codes, xd / xs
    (C, n, >=K_c/32) float32; state ``product_scratch()``."""
    C = xq.shape[0]
    n = xq.shape[1]
    G = codes[0].shape[1]
    for g in range(G):
        for t in range(n):
            for c in range(C):
                cc, dc, mc = codes[c], dw[c], mw[c]
                co = (li * cc.strides[0] + g * cc.strides[1]) // cc.itemsize
                do = (li * dc.strides[0] + g * dc.strides[1]) // dc.itemsize
                xo, bo = c * xq.strides[0] + t * xq.strides[1], (c * xd.strides[0] + t * xd.strides[1]) // 4
                _dot8_q4_1(cc, co, dc, do, mc, xq, xo, xd, xs, bo, cc.shape[2], state, c == 0)
            _finish8(state, True, out, t, g * GROUP, add)


def split_q4_1(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A GGUF Q4_1 tensor's raw blocks (rows x cols/32 blocks of 20 B: F16 d, F16 m, 16 B of nibbles, low
    nibbles the block's first 16 weights) -> codes (rows, cols) uint8 in 0..15, d and m (rows, cols/32)
    float32 (exact F16 values)."""
    nb = cols // QK
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, nb, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(F32)
    qs = b[..., 4:20]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(rows, cols)
    return np.ascontiguousarray(codes, dtype=np.uint8), np.ascontiguousarray(d), np.ascontiguousarray(m)


def split_q8_0(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """A GGUF Q8_0 tensor's raw blocks (34 B: F16 d, 32 int8 codes) -> codes (rows, cols) int8 and d
    (rows, cols/32) float32."""
    nb = cols // QK
    b = np.ascontiguousarray(raw).view(np.uint8).reshape(rows, nb, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    codes = b[..., 2:34].copy().view(np.int8).reshape(rows, cols)
    return np.ascontiguousarray(codes), np.ascontiguousarray(d)
