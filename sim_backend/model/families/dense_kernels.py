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

Where the parts live: ggml's scalar building blocks (``fma32``, libm, F16 rounding, ``v_expf``) in
``ggml_ops``, the quantisation and the block products in ``dense_quant``, flash attention in
``dense_attention``; this module holds the per-row operations and the step (``dense_forward``).
"""

from __future__ import annotations

import numpy as np

from sim_backend.model.families.dense_attention import FA_TILE, attend_one, attend_tiled
from sim_backend.model.families.dense_quant import (
    QK,
    SCRATCH,
    chained_matmul,
    quant_matmul,
    quantise_rows,
)
from sim_backend.model.families.ggml_ops import cosf, f16_round, fma32, powf, sinf, v_expf
from sim_backend.model.kernel_cache import F32Array, I8Array, I64Array, IntLike, U8Array, U16Array, kernel

F32 = np.float32


@kernel()
def swiglu(gu: F32Array, f: IntLike, act: F32Array) -> None:
    """act[:, :f] = silu(gate) * up as ggml_vec_swiglu_f32 (AVX2): ``gate / (1 + v_expf(0 - gate)) * up``;
    gu (n, >=2f) float32 its gate (columns :f) then up (f:2f) outputs."""
    for i in range(gu.shape[0]):
        for j in range(f):
            gv = gu[i, j]
            act[i, j] = gv / (np.float32(1.0) + v_expf(np.float32(0.0) - gv)) * gu[i, f + j]


@kernel()
def rms_norm_row(x: F32Array, w: F32Array, eps: np.float32, out: F32Array) -> None:
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
def rope_rotate(v: F32Array, nh: IntLike, D: IntLike, cos: F32Array, sin: F32Array) -> None:
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


@kernel()
def dense_forward(x: F32Array, cos: F32Array, sin: F32Array, new_cells: I64Array, ctx_cells: I64Array,
                  ends: I64Array, eps: np.float32, D: int,
                  hq: I64Array, hkv: I64Array, fc: I64Array, vocab0: I64Array,
                  norms: F32Array, final_norm: F32Array,
                  qkv_c: tuple[U8Array, ...], qkv_d: tuple[U16Array, ...], qkv_m: tuple[U16Array, ...],
                  wo_c: tuple[U8Array, ...], wo_d: tuple[U16Array, ...], wo_m: tuple[U16Array, ...],
                  gu_c: tuple[U8Array, ...], gu_d: tuple[U16Array, ...], gu_m: tuple[U16Array, ...],
                  dn_c: tuple[U8Array, ...], dn_d: tuple[U16Array, ...], dn_m: tuple[U16Array, ...],
                  lm_c: tuple[I8Array, ...], lm_d: tuple[U16Array, ...], lm_m: tuple[U16Array, ...],
                  k_cache: tuple[F32Array, ...], v_cache: tuple[F32Array, ...], logits: F32Array) -> None:
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
def _rope_angles(positions: I64Array, half: IntLike, ts: np.float32, cos: F32Array, sin: F32Array) -> None:
    for i in range(positions.shape[0]):
        a = np.float32(positions[i])
        for k in range(half):
            cos[i, k] = cosf(a)
            sin[i, k] = sinf(a)
            a = a * ts


@kernel()
def _powf(x: np.float32, y: np.float32) -> np.float32:
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
