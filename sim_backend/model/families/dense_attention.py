"""The dense pilot's attention as llama.cpp's CPU flash attention (``ggml_compute_forward_flash_attn_ext_f16``):
the one-query path with an F16 value accumulator (``attend_one``) and the 64 x 64 tiled path
(``attend_tiled``); see ``dense_kernels`` for the arithmetic emulated.

Its kernels are inlined into ``dense_kernels.dense_forward``, so this file is one of
``kernel_cache.KERNEL_SOURCES`` (an edit starts a fresh kernel cache).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from sim_backend.model.families.ggml_ops import expf, f16_round, fma32, v_expf
from sim_backend.model.kernel_cache import F32Array, I64Array, IntLike, kernel

F32 = np.float32
#: Queries (and keys) per tile of llama.cpp's tiled CPU flash attention (ggml-cpu common.h GGML_FA_TILE_Q /
#: GGML_FA_TILE_KV); steps with fewer queries take its one-query-at-a-time path.
FA_TILE = 64


@njit(cache=True, nogil=True, error_model="numpy", boundscheck=False, inline="always")
def _lane64(kt: F32Array, t: IntLike, q16: F32Array, a: int) -> np.float32:
    """Lane a of ggml_vec_dot_f16's 4 x 8 accumulators over a 64-element key (column t of kt (64, > t)), the 4
    vectors already added as its reduce does: (v0 + v2) + (v1 + v3), v_j = fma(k[32 + 8j + a], q[32 + 8j + a],
    k[8j + a] q[8j + a])."""
    v0 = fma32(kt[32 + a, t], q16[32 + a], kt[a, t] * q16[a])
    v1 = fma32(kt[40 + a, t], q16[40 + a], kt[8 + a, t] * q16[8 + a])
    v2 = fma32(kt[48 + a, t], q16[48 + a], kt[16 + a, t] * q16[16 + a])
    v3 = fma32(kt[56 + a, t], q16[56 + a], kt[24 + a, t] * q16[24 + a])
    return (v0 + v2) + (v1 + v3)


@kernel()
def _scores_f16(kt: F32Array, c0: IntLike, q16: F32Array, e: IntLike, D: IntLike, scale: np.float32,
                sc: F32Array) -> None:
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
def context_keys(kt: F32Array, ctx_cells: I64Array, e: IntLike, kg: F32Array) -> tuple[F32Array, IntLike]:
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
def attend_one(qrow: F32Array, kt: F32Array, vc: F32Array, ctx_cells: I64Array, e: IntLike, D: IntLike,
               scale: np.float32, q16: F32Array, acc: F32Array, sc: F32Array, msa: F32Array, kg: F32Array,
               out: F32Array) -> None:
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
def attend_tiled(q: F32Array, q0: int, R: int, kt: F32Array, vc: F32Array, ctx_cells: I64Array, ends: I64Array,
                 D: IntLike, scale: np.float32, kq: F32Array, Ms: F32Array, Ss: F32Array, vkq: F32Array,
                 ktile: F32Array, out: F32Array) -> None:
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
