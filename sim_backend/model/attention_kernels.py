"""Compiled grouped-query attention (numba), family-neutral: one query over a KV head's cached keys
(decode, :func:`attend_decode`) and causal prefill over query blocks (:func:`attend_prefill_t`), with
their register-tiled scores and value sums.  Layouts, bounds and shapes: :mod:`sim_backend.model.kernels`.
"""

from __future__ import annotations

import numpy as np

from sim_backend.model.kernel_cache import FMA, SUM, F32Array, I64Array, IntLike, kernel, wide_vectors
from sim_backend.model.kernels import exp_f32, exp_in_range

#: Keys per chunk of the decode attention kernel: the G heads' scores of a chunk (8 x 512 float32, 16 KiB)
#: stay in L1 between their exp and p @ V; with the register-tiled ``_scores`` / ``_weighted_values`` the
#: cost per chunk is the loop starts (64 vector iterations a loop at 512), so bigger chunks run faster:
#: 192 heads at T = 4096, interleaved 7 times in one process (load ~11, the reference 2-core host), CPU ms
#: median 33.5 at 128, 30.7 at 256, 29.1 at 512, 28.5 at 2048 (within noise of 512 from 512 on).
ATT_CHUNK = 512


@kernel(FMA)
def exp_shift(row: F32Array, m: np.float32) -> None:
    """row[:] = exp(row - m) in place, float32 (``exp_f32``; m float32). The two halves of the row go
    through one loop as two independent chains: ``exp_f32`` is one long dependent chain of operations,
    and one chain per vector loop kept the core waiting on it (1.5-2.1 ns an element measured, 0.65-0.77
    with two chains and fused multiply-adds, same host). Compiled with ``FMA`` only (no ``reassoc``):
    the range reduction and the polynomial are evaluated in the order written, each multiply-add with
    one rounding instead of two (measured max error 0.97 ulp on [-87, 88], within ``exp_f32``'s 2)."""
    wide_vectors()
    n = row.shape[0]
    h = n // 2
    a = row[:h]
    b = row[h:2 * h]
    for t in range(h):
        ea = exp_f32(a[t] - m)
        eb = exp_f32(b[t] - m)
        a[t] = ea
        b[t] = eb
    if n % 2:
        row[n - 1] = exp_f32(row[n - 1] - m)


#: Query heads per pass of the decode scores (:func:`_scores`): each key is loaded once for this many heads'
#: multiply-adds (the G = 8 query heads of a KV head in Qwen3-30B-A3B), not once per head.
SCORE_HEADS = 8


@kernel(SUM)
def _scores(q: F32Array, src: F32Array, off: IntLike, m: IntLike, s: F32Array, s0: IntLike) -> None:
    """s[g, s0:s0+m] = q[g] . src[:, off:off+m] for one chunk of m keys, every query head g.

    q (G, D) float32; src (D, >= off+m) the keys transposed (this head's K cache, or a gathered chunk with
    off = 0); s (G, >= s0+m) C-contiguous (rows are sliced here, not by the caller: a sliced 2-D argument
    loses its known unit stride and with it the vector loads).

    Register tiling: ``SCORE_HEADS`` heads a pass, four key dimensions a pass. The loop over the chunk's
    keys loads each of the 4 key rows once (one vector load of 8 keys each) and does the 8 heads' 32
    multiply-adds from it, so a 2K-4K context is bound by multiply-adds and not by loads (the former
    head-by-head loop reloaded every key row once per head: 5 loads per 4 multiply-adds). Heads past a
    multiple of 8 go one at a time. Summation order of each score: per 4 dimensions a partial sum added
    to the running score (``SUM`` lets LLVM reassociate the 4 terms); any order of the D terms is within
    the same float32 bound (``kernels`` docstring)."""
    wide_vectors()
    G, D = q.shape
    g0 = 0
    while g0 + SCORE_HEADS <= G:
        r0, r1, r2, r3 = s[g0, s0:s0 + m], s[g0 + 1, s0:s0 + m], s[g0 + 2, s0:s0 + m], s[g0 + 3, s0:s0 + m]
        r4, r5, r6, r7 = s[g0 + 4, s0:s0 + m], s[g0 + 5, s0:s0 + m], s[g0 + 6, s0:s0 + m], s[g0 + 7, s0:s0 + m]
        d = 0
        while d + 4 <= D:
            k0, k1 = src[d, off:off + m], src[d + 1, off:off + m]
            k2, k3 = src[d + 2, off:off + m], src[d + 3, off:off + m]
            a0, a1, a2, a3 = q[g0, d], q[g0, d + 1], q[g0, d + 2], q[g0, d + 3]
            b0, b1, b2, b3 = q[g0 + 1, d], q[g0 + 1, d + 1], q[g0 + 1, d + 2], q[g0 + 1, d + 3]
            c0, c1, c2, c3 = q[g0 + 2, d], q[g0 + 2, d + 1], q[g0 + 2, d + 2], q[g0 + 2, d + 3]
            e0, e1, e2, e3 = q[g0 + 3, d], q[g0 + 3, d + 1], q[g0 + 3, d + 2], q[g0 + 3, d + 3]
            f0, f1, f2, f3 = q[g0 + 4, d], q[g0 + 4, d + 1], q[g0 + 4, d + 2], q[g0 + 4, d + 3]
            h0, h1, h2, h3 = q[g0 + 5, d], q[g0 + 5, d + 1], q[g0 + 5, d + 2], q[g0 + 5, d + 3]
            i0, i1, i2, i3 = q[g0 + 6, d], q[g0 + 6, d + 1], q[g0 + 6, d + 2], q[g0 + 6, d + 3]
            j0, j1, j2, j3 = q[g0 + 7, d], q[g0 + 7, d + 1], q[g0 + 7, d + 2], q[g0 + 7, d + 3]
            if d == 0:  # the first 4 dimensions set the scores (no zeroing pass: 5 % of the kernel at 4K)
                for t in range(m):
                    x0, x1, x2, x3 = k0[t], k1[t], k2[t], k3[t]
                    r0[t] = a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
                    r1[t] = b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
                    r2[t] = c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
                    r3[t] = e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3
                    r4[t] = f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3
                    r5[t] = h0 * x0 + h1 * x1 + h2 * x2 + h3 * x3
                    r6[t] = i0 * x0 + i1 * x1 + i2 * x2 + i3 * x3
                    r7[t] = j0 * x0 + j1 * x1 + j2 * x2 + j3 * x3
                d += 4
                continue
            for t in range(m):
                x0, x1, x2, x3 = k0[t], k1[t], k2[t], k3[t]
                r0[t] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
                r1[t] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
                r2[t] += c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
                r3[t] += e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3
                r4[t] += f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3
                r5[t] += h0 * x0 + h1 * x1 + h2 * x2 + h3 * x3
                r6[t] += i0 * x0 + i1 * x1 + i2 * x2 + i3 * x3
                r7[t] += j0 * x0 + j1 * x1 + j2 * x2 + j3 * x3
            d += 4
        while d < D:
            kd = src[d, off:off + m]
            for g in range(g0, g0 + SCORE_HEADS):
                qd = q[g, d]
                sg = s[g, s0:s0 + m]
                if d == 0:  # D < 4: no tiled pass set the scores
                    for t in range(m):
                        sg[t] = qd * kd[t]
                else:
                    for t in range(m):
                        sg[t] += qd * kd[t]
            d += 1
        g0 += SCORE_HEADS
    for g in range(g0, G):
        sg = s[g, s0:s0 + m]
        for t in range(m):
            sg[t] = 0.0
        for d in range(D):
            qd = q[g, d]
            kd = src[d, off:off + m]
            for t in range(m):
                sg[t] += qd * kd[t]


@kernel(SUM)
def _weighted_values(p: F32Array, p0: IntLike, m: IntLike, src: F32Array, off: IntLike, acc: F32Array,
                     den: F32Array) -> None:
    """acc[g, d] += p[g, p0:p0+m] . src[d, off:off+m] and den[g] += sum(p[g, p0:p0+m]) for one chunk of m
    keys: p (G, >= p0+m) the unnormalised probabilities; src (D, >= off+m) the values transposed (this
    head's V cache, or a gathered chunk with off = 0); acc (G, D), den (G,) float32.

    Register tiling: 4 heads x 2 value dimensions a pass, 8 running sums in vector lanes over the keys,
    so each loaded value serves 4 heads and each loaded probability 2 dimensions (6 loads per 8
    multiply-adds; one head and dimension at a time was 2 loads per multiply-add). Each acc[g, d] gets
    one sum of the chunk's m products (in vector lanes, ``SUM``) added to it, as before."""
    wide_vectors()
    G = p.shape[0]
    D = acc.shape[1]
    for g in range(G):
        pg = p[g, p0:p0 + m]
        tot = np.float32(0.0)
        for t in range(m):
            tot += pg[t]
        den[g] += tot
    g0 = 0
    while g0 + 4 <= G:
        p0r, p1r, p2r, p3r = p[g0, p0:p0 + m], p[g0 + 1, p0:p0 + m], p[g0 + 2, p0:p0 + m], p[g0 + 3, p0:p0 + m]
        d = 0
        while d + 2 <= D:
            v0, v1 = src[d, off:off + m], src[d + 1, off:off + m]
            a00 = np.float32(0.0)
            a01 = np.float32(0.0)
            a10 = np.float32(0.0)
            a11 = np.float32(0.0)
            a20 = np.float32(0.0)
            a21 = np.float32(0.0)
            a30 = np.float32(0.0)
            a31 = np.float32(0.0)
            for t in range(m):
                x0, x1 = v0[t], v1[t]
                y0, y1, y2, y3 = p0r[t], p1r[t], p2r[t], p3r[t]
                a00 += y0 * x0
                a01 += y0 * x1
                a10 += y1 * x0
                a11 += y1 * x1
                a20 += y2 * x0
                a21 += y2 * x1
                a30 += y3 * x0
                a31 += y3 * x1
            acc[g0, d] += a00
            acc[g0, d + 1] += a01
            acc[g0 + 1, d] += a10
            acc[g0 + 1, d + 1] += a11
            acc[g0 + 2, d] += a20
            acc[g0 + 2, d + 1] += a21
            acc[g0 + 3, d] += a30
            acc[g0 + 3, d + 1] += a31
            d += 2
        while d < D:
            vd = src[d, off:off + m]
            for g in range(g0, g0 + 4):
                pg = p[g, p0:p0 + m]
                x = np.float32(0.0)
                for t in range(m):
                    x += pg[t] * vd[t]
                acc[g, d] += x
            d += 1
        g0 += 4
    for g in range(g0, G):
        pg = p[g, p0:p0 + m]
        for d in range(D):
            vd = src[d, off:off + m]
            x = np.float32(0.0)
            for t in range(m):
                x += pg[t] * vd[t]
            acc[g, d] += x


@kernel()
def attend_decode(q: F32Array, k_t: F32Array, v_t: F32Array, start: IntLike, idx: I64Array, T: IntLike, no_max: bool,
                  scores: F32Array, out: F32Array) -> None:
    """One query's grouped attention over T cached keys of one KV head.

    q (G, D) float32, already scaled by 1/sqrt(D); k_t, v_t (D, cells) this head's transposed K and V
    caches; the keys are cells ``start .. start+T`` if ``start >= 0`` (one contiguous run, read in
    place) else ``idx[:T]`` (int64 cells, gathered a chunk at a time). ``no_max``: the caller proved
    |score| small enough (``layer_ops.SCORE_BOUND``) that exp needs no max shift. scores (G, >= T)
    float32 scratch. Writes softmax(q k^T) v to out (G, D). Sums run in vector lanes (``SUM``).

    With ``no_max`` one pass over the keys, ``ATT_CHUNK`` at a time: the chunk's scores (all G heads
    from each key load, ``_scores``), their exp (``exp_in_range``: the scores are proven within the
    bound) and their share of p @ V (``_weighted_values``) while the chunk's keys, values and scores are
    in L1; K and V are each read once. Without it (a damaged norm weight) two passes: every score and the
    row maxima first, then exp (``exp_shift``, clamped) and p @ V chunk by chunk.
    """
    wide_vectors()
    G, D = q.shape
    contiguous = start >= 0
    kg = np.empty((D, ATT_CHUNK + ATT_CHUNK // 2 if not contiguous else 0), dtype=np.float32)
    vg = np.empty((D, ATT_CHUNK + ATT_CHUNK // 2 if not contiguous else 0), dtype=np.float32)
    acc = np.zeros((G, D), dtype=np.float32)
    den = np.zeros(G, dtype=np.float32)
    # an int64, not the literal 0: a literal argument makes numba compile a second copy of each callee
    # (measured on a first start: _scores, _weighted_values and _gather twice, ~5 s of CPU)
    zero = np.int64(0)
    if no_max:
        t0: IntLike = zero
        while t0 < T:
            # a short tail joins the last chunk (<= 1.5 chunks): a chunk costs ~70 loop starts of its own
            m = T - t0 if T - t0 <= ATT_CHUNK + ATT_CHUNK // 2 else ATT_CHUNK
            if contiguous:
                _scores(q, k_t, start + t0, m, scores, zero)
            else:
                _gather(k_t, idx, t0, m, kg)
                _scores(q, kg, zero, m, scores, zero)
            for g in range(G):
                exp_in_range(scores[g, :m])
            if contiguous:
                _weighted_values(scores, zero, m, v_t, start + t0, acc, den)
            else:
                _gather(v_t, idx, t0, m, vg)
                _weighted_values(scores, zero, m, vg, zero, acc, den)
            t0 += m
    else:
        for t0 in range(0, T, ATT_CHUNK):
            m = min(ATT_CHUNK, T - t0)
            if contiguous:
                _scores(q, k_t, start + t0, m, scores, t0)
            else:
                _gather(k_t, idx, t0, m, kg)
                _scores(q, kg, zero, m, scores, t0)
        for g in range(G):
            sg = scores[g, :T]
            mx = np.float32(-np.inf)
            for t in range(T):
                mx = max(mx, sg[t])
            exp_shift(sg, mx)
        for t0 in range(0, T, ATT_CHUNK):
            m = min(ATT_CHUNK, T - t0)
            if contiguous:
                _weighted_values(scores, t0, m, v_t, start + t0, acc, den)
            else:
                _gather(v_t, idx, t0, m, vg)
                _weighted_values(scores, t0, m, vg, zero, acc, den)
    for g in range(G):
        inv = np.float32(1.0) / den[g]
        for d in range(D):
            out[g, d] = acc[g, d] * inv


@kernel()
def _gather(x_t: F32Array, idx: I64Array, t0: IntLike, m: IntLike, out: F32Array) -> None:
    """out[:, :m] = x_t[:, idx[t0:t0+m]]: a chunk of keys (or values) of scattered cells, (D, cells) -> (D, m)."""
    wide_vectors()
    for d in range(x_t.shape[0]):
        row = x_t[d]
        o = out[d]
        for t in range(m):
            o[t] = row[idx[t0 + t]]


#: Queries per block of :func:`attend_prefill_t`: a block's G x 16 score columns go through one BLAS product
#: with the keys it can see (16 measured as fast as 8-64 at 512 tokens).
PREFILL_QUERY_BLOCK = 16


@kernel()
def attend_prefill_t(qt: F32Array, q0: IntLike, G: IntLike, scale: np.float32, ks: F32Array, vs: F32Array,
                     ends: I64Array, k_pos: I64Array, q_pos: I64Array, masked: bool, no_max: bool, out: F32Array,
                     o0: IntLike) -> None:
    """Causal grouped attention of n queries of one KV head over T keys, the queries given as feature rows.

    qt (>= q0 + G D, n) float32: query head g's dimension d of every query is row q0 + g D + d (a chip's
    q|k|v projection computed transposed, ``compiled._prefill_attention_chip``), multiplied by ``scale``
    (float32; 1/sqrt(D), or 1 for queries already scaled) as they are read; ks, vs (T, D) the sequence's
    keys and values in position order (gathered, C-contiguous); query i sees keys [0, ends[i]) (int64, from
    the sorted key positions), and if ``masked`` (keys not sorted by position) only those with
    k_pos[t] <= q_pos[i]. ``no_max`` as in :func:`attend_decode`. Writes query i's head g to out[i, o0 + g D:
    o0 + (g + 1) D] (out (n, >= o0 + G D) float32: the chip's attention output row, before ``wo``).

    Per block of ``PREFILL_QUERY_BLOCK`` queries: the scores transposed, a row per key and a column per
    (query, head): one BLAS product (keys the block sees x D) @ (D x m G). That shape ran about twice as
    fast as the scores a row per query (OpenBLAS, D = 16: 14.6 vs 27.8 us for 512 keys x 128 columns); the
    exp then runs along a key's row over the columns of the queries that see it (``exp_in_range`` when
    ``no_max`` and unmasked; else ``exp_f32`` of the score less its column's max, or less 0 with
    ``no_max``), the columns of queries that must not see the key set to 0 (what exp(-inf) gives); each
    column's sum is added over the keys in order, and one more BLAS product with V (the scores' transpose as
    its left operand) and a division by the sums finish the block. Reading the queries as rows saves a
    (n, G, D) copy of them, strided, that cost 0.25 ms of a chip's 2.8 ms layer at 512 tokens.
    """
    wide_vectors()
    n = ends.shape[0]
    D = ks.shape[1]
    mx = np.empty(PREFILL_QUERY_BLOCK * G, dtype=np.float32)
    den = np.empty(PREFILL_QUERY_BLOCK * G, dtype=np.float32)
    for s0 in range(0, n, PREFILL_QUERY_BLOCK):
        s1 = min(n, s0 + PREFILL_QUERY_BLOCK)
        m = s1 - s0
        R = m * G
        e_end = 0
        ordered = True  # the block's ends non-decreasing: a key's visible columns are one run at the end
        for i in range(s0, s1):
            e_end = max(e_end, ends[i])
            if i > s0 and ends[i] < ends[i - 1]:
                ordered = False
        # the block's queries as a (D, m G) operand, column i G + g: query s0 + i's head g (2 K floats)
        qb = np.empty((D, R), dtype=np.float32)
        for g in range(G):
            for d in range(D):
                src = qt[q0 + g * D + d]
                dst = qb[d]
                for i in range(m):
                    dst[i * G + g] = src[s0 + i] * scale
        S = np.dot(ks[:e_end], qb)  # (e_end, R): a row per key
        if no_max and ordered and not masked:  # every visible score proven within the bound: no max shift
            i0 = 0
            for t in range(e_end):
                while i0 < m and ends[s0 + i0] <= t:
                    i0 += 1
                row = S[t]
                for j in range(i0 * G):
                    row[j] = 0.0
                exp_in_range(row[i0 * G:R])
        else:
            for t in range(e_end):  # keys a query must not see: -inf
                row = S[t]
                for i in range(m):
                    if t >= ends[s0 + i] or (masked and k_pos[t] > q_pos[s0 + i]):
                        for g in range(G):
                            row[i * G + g] = -np.inf
            for j in range(R):
                mx[j] = np.float32(0.0) if no_max else np.float32(-np.inf)
            if not no_max:
                for t in range(e_end):
                    row = S[t]
                    for j in range(R):
                        mx[j] = max(mx[j], row[j])
            for t in range(e_end):
                row = S[t]
                for j in range(R):
                    row[j] = exp_f32(row[j] - mx[j])
        for j in range(R):
            den[j] = 0.0
        for t in range(e_end):
            row = S[t]
            for j in range(R):
                den[j] += row[j]
        pv = np.dot(S.T, vs[:e_end])  # (R, D)
        for i in range(m):
            for g in range(G):
                r = i * G + g
                inv = np.float32(1.0) / den[r]
                orow = out[s0 + i]
                for d in range(D):
                    orow[o0 + g * D + d] = pv[r, d] * inv
