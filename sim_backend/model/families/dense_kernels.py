"""Compiled (numba) numerics of the dense pilot on its GGUF's quantised weights, as llama.cpp's CPU computes them.

The pilot's GGUF stores its projections as Q4_1 (blocks of 32 weights: 4-bit codes ``q`` in 0..15, an F16
scale ``d`` and an F16 minimum ``m``; weight = d q + m) and its tied embedding / LM head as Q8_0 (int8
codes, an F16 scale). llama.cpp's CPU backend never dequantises them for a matrix product: it quantises
the activation row entering each product to 8-bit blocks of 32 (Q8_1 for Q4_1 weights: codes
``round(x * 127 / amax)``, scale ``amax / 127`` and the scaled code sum, both stored as F16; Q8_0 for
Q8_0 weights) and sums integer dot products per block (``ggml_vec_dot_q4_1_q8_1``:
``d_w d_x sum(q_w q_x) + m_w s_x``; ``ggml_vec_dot_q8_0_q8_0``: ``d_w d_x sum(q_w q_x)``). Its K/V cache
is F16. This module does the same arithmetic, so that the pilot's replies follow llama.cpp's on the same
file, and reads 1 byte a weight (the codes) instead of 4 (float32 dequantised): the decode step streams
~134 MB instead of ~540 MB.

What is emulated exactly: the activation quantisation (round half to even, as the AVX2 kernels' rounding
mode; codes in -127..127), the F16 rounding of the activation block scales and sums, the integer block sums
(exact in any order), F16 rounding of K and V as they are written to the cache, RMSNorm with its sum of
squares in float64 (ggml's ``ggml_float``), the RoPE angles as ggml builds them (``pos * theta_scale^i`` by
repeated float32 multiplication). What is not: the order of float32 additions over blocks and SIMD lanes,
the exp implementation (``kernels.exp_f32``, within 2 ulp), and the F16 accumulation of llama.cpp's
single-query flash-attention path (here attention is float32 on the F16 K/V, as its tiled path computes
it). These differ from llama.cpp by float32 rounding only, but a quantised model is chaotic at that
scale: a rounding difference that flips one activation code moves log-probabilities by ~0.1 nats
(measured: scaling the embeddings by 1 + 3e-7 moved the top-5 log-probabilities of the first reply token
by 0.10-0.20 nats with quantised activations, 0.001-0.003 without). That, not a modelling error, bounds the
agreement with llama.cpp (tests/real/test_pilot_vs_llamacpp.py).

Determinism: every float operation runs in the order written (no ``fastmath``: no reassociation, no
fused multiply-add), integer sums are exact, so a step's logits are the same bits on any x86-64 host
whatever its BLAS (no BLAS is used here). Shapes: H hidden, D head dim, F MLP width, K a product's input
length, N its outputs, nb = K / 32 blocks.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from sim_backend.model.kernels import _bits_to_f32, exp_f32, kernel

F32 = np.float32
#: Weights per quantisation block (GGUF QK4_1 = QK8_0 = QK8_1 = 32).
QK = 32


@intrinsic
def _f32_bits(typingctx, x):
    """Reinterpret a float32's bits as an int32 (no conversion)."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@kernel()
def f16_round(x):
    """float32 -> the nearest IEEE half value (round half to even), returned as float32. Magnitudes at or
    above 65520 give +-inf (half's overflow), below 2**-14 round to half's subnormal grid of 2**-24."""
    a = abs(x)
    if a >= np.float32(65520.0):
        return np.float32(np.inf) if x > 0 else np.float32(-np.inf)
    if a < np.float32(6.103515625e-05):
        return np.float32(np.rint(x * np.float32(16777216.0)) * np.float32(5.9604644775390625e-08))
    u = _f32_bits(x)
    u = (u + np.int32(0xFFF) + ((u >> 13) & np.int32(1))) & np.int32(-8192)
    return _bits_to_f32(u)


@kernel()
def quantise_rows(x, q, d, s):
    """Quantise every row of x (n, K) float32 to 8-bit blocks of 32 as llama.cpp's quantize_row_q8_1 / q8_0
    (AVX2) do: per block amax = max |x|, codes rint(x * (127 / amax)) (round half to even; 0 when amax is
    0), written to q (n, K) as float32 (small integers, so the products and block sums below are exact in
    float32 in any order); d (n, nb) float32 the F16-rounded ``amax / 127``; s (n, nb) float32 the
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
                q[i, o + j] = v
                tot += v
            d[i, b] = f16_round(db)
            s[i, b] = f16_round(db * tot)


#: Tokens whose products share one pass over a weight block (the block's codes stay in L1 meanwhile).
TOKEN_GROUP = 8


@kernel()
def quant_matmul(codes_t, dw_t, mw_t, xq, xd, xs, tot, out):
    """out (n, N) = x @ W for a quantised W, as llama.cpp's vec_dot kernels sum it per output and token:
    ``sum over blocks b of (dw[b] xd[b]) * sum_j(q_w q_x) + mw[b] xs[b]`` (the minimums' sum added last).

    codes_t (K, N) the weight codes transposed (uint8 0..15 for Q4_1, int8 for Q8_0), dw_t / mw_t (K/32, N)
    float32 block scales / minimums (mw_t zeros for Q8_0); xq (n, K) float32 activation codes and
    xd / xs (n, K/32) their block scales / sums (``quantise_rows``); tot (TOKEN_GROUP, N) float32 scratch.
    The integer block sums are exact (float32 holds them: |sum| <= 32 * 127 * 127 < 2**24); the block
    terms are added in block order, so the result does not depend on n or on the grouping of tokens.
    """
    n = xq.shape[0]
    K, N = codes_t.shape
    nb = K // QK
    mins = np.empty((TOKEN_GROUP, N), dtype=np.float32)
    for t0 in range(0, n, TOKEN_GROUP):
        g = min(TOKEN_GROUP, n - t0)
        for t in range(g):
            for r in range(N):
                out[t0 + t, r] = 0.0
                mins[t, r] = 0.0
        for b in range(nb):
            for t in range(g):
                for r in range(N):
                    tot[t, r] = 0.0
            for j in range(QK):
                k = b * QK + j
                row = codes_t[k]
                for t in range(g):
                    xk = xq[t0 + t, k]
                    tt = tot[t]
                    for r in range(N):
                        tt[r] += np.float32(row[r]) * xk
            dr = dw_t[b]
            mr = mw_t[b]
            for t in range(g):
                db = xd[t0 + t, b]
                sb = xs[t0 + t, b]
                ot = out[t0 + t]
                mt = mins[t]
                tt = tot[t]
                for r in range(N):
                    ot[r] += (dr[r] * db) * tt[r]
                    mt[r] += mr[r] * sb
        for t in range(g):
            for r in range(N):
                out[t0 + t, r] += mins[t, r]


@kernel()
def _rms_norm64(x, w, eps, out):
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
def _rope_pairs(v, nh, D, cos, sin):
    """Adjacent-pair RoPE in place (llama.cpp's "normal" mode) on the first nh heads of v (>= nh D,) float32,
    head-major: pair i of a head = (v[2i], v[2i+1]) rotated by the angle whose cos/sin (D/2,) are given."""
    for h in range(nh):
        o = h * D
        for i in range(D // 2):
            a = v[o + 2 * i]
            b = v[o + 2 * i + 1]
            v[o + 2 * i] = a * cos[i] - b * sin[i]
            v[o + 2 * i + 1] = a * sin[i] + b * cos[i]


@kernel()
def _add_chip_sum(part, n, H, x):
    """x[:n, :H] += the chips' partial products summed in chip order (part: float32 (C, >=n, >=H)): the
    cross-chip reduce after the output projection and after the MLP's down projection."""
    C = part.shape[0]
    for i in range(n):
        for j in range(H):
            y = part[0, i, j]
            for c in range(1, C):
                y += part[c, i, j]
            x[i, j] += y


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
    KV heads hkv[c], MLP columns fc[c], first vocabulary id vocab0[c]; its shards' codes (transposed: inputs
    x outputs), scales and minimums (blocks x outputs) stacked over layers: qkv (L, H, (hq+2hkv) D) Q4_1
    (q, k, v outputs); wo (L, hq D, H) Q4_1 (its input rows); gu (L, H, 2 fc) Q4_1 (gate then up); dn
    (L, fc, H) Q4_1 (its input rows); lm (H, Vc) Q8_0 its vocabulary (lm_m zeros); k_cache / v_cache
    (L, hkv, cells, D) float32 holding F16 values. norms (L, 2, H) float32 (attention, MLP), final_norm (H,).
    Writes the last token's logits (V,) float32.

    Tensor parallel as the device: every chip computes its heads' attention and partial output sums over
    its own input rows, and the partials are reduced (chip 0 + chip 1 + ...) before the residual add; the
    same for the MLP's down projection; the LM head's halves are gathered. Attention is float32 on the
    F16 K/V (scores scaled by 1/sqrt(D) after the dot product, max-shifted exp, normalised at the end).
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
    widest = max(max(max_rows, 2 * max_f), H)
    tot = np.empty((TOKEN_GROUP, max(widest, lm_c[0].shape[1])), dtype=np.float32)
    h = np.empty((n, H), dtype=np.float32)
    hq8 = np.empty((n, H), dtype=np.float32)
    hd = np.empty((n, nbh), dtype=np.float32)
    hs = np.empty((n, nbh), dtype=np.float32)
    proj = np.empty((n, max_rows), dtype=np.float32)
    o = np.empty((n, max_o), dtype=np.float32)
    oq = np.empty((n, max_o), dtype=np.float32)
    od = np.empty((n, max_o // QK), dtype=np.float32)
    osum = np.empty((n, max_o // QK), dtype=np.float32)
    gu = np.empty((n, 2 * max_f), dtype=np.float32)
    act = np.empty((n, max_f), dtype=np.float32)
    aq = np.empty((n, max_f), dtype=np.float32)
    ad = np.empty((n, max_f // QK), dtype=np.float32)
    asum = np.empty((n, max_f // QK), dtype=np.float32)
    part = np.empty((C, n, H), dtype=np.float32)
    T = ctx_cells.shape[0]
    sc = np.empty(T, dtype=np.float32)
    acc = np.empty(D, dtype=np.float32)
    for li in range(L):
        for i in range(n):
            _rms_norm64(x[i], norms[li, 0], eps, h[i])
        quantise_rows(h, hq8, hd, hs)
        for c in range(C):
            rows = (hq[c] + 2 * hkv[c]) * D
            pc = proj[:, :rows]
            quant_matmul(qkv_c[c][li], qkv_d[c][li], qkv_m[c][li], hq8, hd, hs, tot, pc)
            kc = k_cache[c]
            vc = v_cache[c]
            for i in range(n):
                _rope_pairs(proj[i], hq[c] + hkv[c], D, cos[i], sin[i])
                cell = new_cells[i]
                for hk in range(hkv[c]):
                    for d in range(D):
                        kc[li, hk, cell, d] = f16_round(proj[i, (hq[c] + hk) * D + d])
                        vc[li, hk, cell, d] = f16_round(proj[i, (hq[c] + hkv[c] + hk) * D + d])
            G = hq[c] // hkv[c]
            w = hq[c] * D
            for i in range(n):
                e = ends[i]
                for hk in range(hkv[c]):
                    for g in range(G):
                        qo = (hk * G + g) * D
                        mx = np.float32(-np.inf)
                        for t in range(e):
                            cell = ctx_cells[t]
                            s = np.float32(0.0)
                            for d in range(D):
                                s += proj[i, qo + d] * kc[li, hk, cell, d]
                            s = s * scale
                            sc[t] = s
                            mx = max(mx, s)
                        ssum = np.float32(0.0)
                        for d in range(D):
                            acc[d] = 0.0
                        for t in range(e):
                            p = exp_f32(sc[t] - mx)
                            ssum += p
                            cell = ctx_cells[t]
                            for d in range(D):
                                acc[d] += p * vc[li, hk, cell, d]
                        inv = np.float32(1.0) / ssum
                        for d in range(D):
                            o[i, qo + d] = acc[d] * inv
            quantise_rows(o[:, :w], oq[:, :w], od[:, :w // QK], osum[:, :w // QK])
            quant_matmul(wo_c[c][li], wo_d[c][li], wo_m[c][li], oq[:, :w], od[:, :w // QK], osum[:, :w // QK],
                         tot, part[c])
        _add_chip_sum(part, n, H, x)
        for i in range(n):
            _rms_norm64(x[i], norms[li, 1], eps, h[i])
        quantise_rows(h, hq8, hd, hs)
        for c in range(C):
            f = fc[c]
            quant_matmul(gu_c[c][li], gu_d[c][li], gu_m[c][li], hq8, hd, hs, tot, gu[:, :2 * f])
            for i in range(n):
                for j in range(f):
                    gv = gu[i, j]
                    act[i, j] = gv / (np.float32(1.0) + exp_f32(-gv)) * gu[i, f + j]
            quantise_rows(act[:, :f], aq[:, :f], ad[:, :f // QK], asum[:, :f // QK])
            quant_matmul(dn_c[c][li], dn_d[c][li], dn_m[c][li], aq[:, :f], ad[:, :f // QK], asum[:, :f // QK],
                         tot, part[c])
        _add_chip_sum(part, n, H, x)
    _rms_norm64(x[n - 1], final_norm, eps, h[0])
    quantise_rows(h[:1], hq8[:1], hd[:1], hs[:1])
    for c in range(C):
        v = lm_c[c].shape[1]
        out = np.empty((1, v), dtype=np.float32)
        quant_matmul(lm_c[c], lm_d[c], lm_m[c], hq8[:1], hd[:1], hs[:1], tot, out)
        for r in range(v):
            logits[vocab0[c] + r] = out[0, r]


def rope_tables(positions: np.ndarray, D: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin (n, D/2) float32 of adjacent-pair RoPE at ``positions`` (n,), as ggml builds them: the angle of
    pair i is ``float32(pos)`` times ``theta_scale`` i times over (``theta_scale = theta ** (-2 / D)`` in
    float32), then cos/sin of that float32 angle (evaluated in float64 and rounded)."""
    ts = np.float32(np.float32(theta) ** np.float32(-2.0 / D))
    n = positions.shape[0]
    ang = np.empty((n, D // 2), dtype=np.float32)
    cur = positions.astype(np.float32)
    for i in range(D // 2):
        ang[:, i] = cur
        cur = (cur * ts).astype(np.float32)
    a64 = ang.astype(np.float64)
    return np.cos(a64).astype(np.float32), np.sin(a64).astype(np.float32)


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
