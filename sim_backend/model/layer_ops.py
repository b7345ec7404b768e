"""The numpy reference of each stage of a Qwen3-MoE layer, float32: RMSNorm (and per-head q/k
RMSNorm), RoPE, causal GQA attention (decode, and prefill in query blocks), the router's top-k and the
SwiGLU experts (per token, and prefill's grouped form).

These are the reference the compiled kernels (:mod:`sim_backend.model.kernels`) are tested against;
:class:`~sim_backend.model.numerics.ShardedModel` and ``ReferenceModel`` call them per stage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import NDArray

F32 = np.float32
#: float32 arrays (shapes in each docstring) and index arrays (expert ids, positions, gathers: any integer dtype).
F32Array = NDArray[np.float32]
IntArray = NDArray[np.integer[Any]]

_ONE = F32(1.0)
_RMS_CONSTS: dict[tuple[int, float], tuple[np.float32, np.float32]] = {}


def rms_norm(x: F32Array, w: F32Array, eps: float) -> F32Array:
    """RMSNorm over the last axis; x (..., n) float32, w (n,) (or broadcastable to x)."""
    # einsum avoids np.mean's Python-level overhead: this runs ~10^4 times a step; the float32
    # constants are made once (same operations and bits as building them per call)
    n = x.shape[-1]
    c = _RMS_CONSTS.get((n, eps))
    if c is None:
        c = _RMS_CONSTS[(n, eps)] = (F32(1.0 / n), F32(eps))
    ms: F32Array = np.einsum("...i,...i->...", x, x)[..., None] * c[0]
    out: F32Array = x * (_ONE / np.sqrt(ms + c[1])) * w
    return out


def head_rms_norm(qk: F32Array, w: F32Array, d_n: np.float32, c_eps: np.float32) -> F32Array:
    """Per-head RMSNorm over the last axis, the hot paths' form: ``qk`` (..., D) float32, ``w``
    broadcastable to it, ``d_n`` = float32(1/D), ``c_eps`` = float32(eps). Returns a new array
    (same operations and bits as :func:`rms_norm`'s in-line form, in place on the mean-square)."""
    ms: F32Array = np.einsum("...i,...i->...", qk, qk)
    ms *= d_n
    ms += c_eps
    np.sqrt(ms, out=ms)
    out = qk * np.divide(_ONE, ms, out=ms)[..., None]
    out *= w
    return out


def rope_tables(positions: IntArray, head_dim: int, theta: float) -> tuple[F32Array, F32Array]:
    """cos/sin tables (n, head_dim/2) for NeoX-style (rotate-half) RoPE, float32."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def rope_full_tables(cos: F32Array, sin: F32Array) -> tuple[F32Array, F32Array, IntArray]:
    """From ``rope_tables``' cos/sin (n, D/2): (cos|cos, -sin|sin) as (n, 1, D) and the rotate-half
    index (D,), for :func:`apply_rope_full`."""
    half = cos.shape[-1]
    return (np.concatenate([cos, cos], axis=-1)[:, None, :], np.concatenate([-sin, sin], axis=-1)[:, None, :],
            np.r_[half:2 * half, 0:half])


def apply_rope(x: F32Array, cos: F32Array, sin: F32Array) -> F32Array:
    """Rotate-half RoPE on x (n, heads, D) with cos/sin (n, D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def apply_rope_full(x: F32Array, cos_full: F32Array, sin_signed: F32Array, rot: IntArray) -> F32Array:
    """``apply_rope`` in four numpy calls, same bits: x*[c, c] + x[..., rot]*[-s, s] (a - b*s equals
    a + b*(-s) exactly in IEEE arithmetic). x (..., n, heads, D); tables from :func:`rope_full_tables`."""
    out = x * cos_full
    t = np.take(x, rot, axis=-1)  # np.take's result is C-ordered; x[..., rot]'s is not (slow products)
    t *= sin_signed
    out += t
    return out


def route(h: F32Array, router: F32Array, top_k: int) -> tuple[IntArray, F32Array]:
    """Router: softmax over experts, top-k, renormalised top-k weights.

    h (n, H) float32 -> (expert ids (n, k) int64, weights (n, k) float32 summing to 1).
    Experts are ordered by probability, ties broken by lower expert id, so routing is
    deterministic (the order of a stable descending sort).
    """
    logits = h @ router
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits, out=logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    E = probs.shape[-1]
    if top_k >= E:
        ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    else:
        # top-k by partition, then the k sorted (descending, lower id first): same ids as a full stable
        # sort unless the k-th probability ties one left out; then the stable sort decides
        cand = np.argpartition(probs, E - top_k, axis=-1)[:, E - top_k:]
        cand.sort(axis=-1)  # ascending ids, so the stable sort below breaks ties by lower id
        vals = np.take_along_axis(probs, cand, axis=-1)
        ids = np.take_along_axis(cand, np.argsort(-vals, axis=-1, kind="stable"), axis=-1)
        kth = np.take_along_axis(probs, ids[:, -1:], axis=-1)
        if np.count_nonzero(probs >= kth) != top_k * probs.shape[0]:
            ids = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    w: F32Array = np.take_along_axis(probs, ids, axis=-1)
    w = w / w.sum(axis=-1, keepdims=True)
    return ids, w.astype(F32, copy=False)


def route_one(h: F32Array, router: F32Array, top_k: int) -> tuple[IntArray, F32Array]:
    """``route`` for one token, h (H,) -> (ids (k,) int64, weights (k,) float32): same ids and bits,
    in 1-D so each step costs fewer numpy calls (decode runs it 48 times a token)."""
    probs = h @ router
    probs -= probs.max()
    np.exp(probs, out=probs)
    probs /= probs.sum()
    E = probs.shape[0]
    cand = np.argpartition(probs, E - top_k)[E - top_k:]
    cand.sort()
    vals = probs[cand]
    ids = cand[np.argsort(-vals, kind="stable")]
    if np.count_nonzero(probs >= probs[ids[-1]]) != top_k:  # a tie at the k-th place: full stable sort
        ids = np.argsort(-probs, kind="stable")[:top_k]
    w = probs[ids]
    w /= w.sum()
    return ids, w


def causal_attention(q: F32Array, k: F32Array, v: F32Array, q_pos: IntArray,
                     k_pos: IntArray, group: int, chunk: int = 256) -> F32Array:
    """Grouped-query causal attention.

    q (n, Hq, D), k/v (T, Hkv, D) with Hq = Hkv * group; q_pos (n,), k_pos (T,)
    token positions. A query attends to keys with position <= its own.
    Returns (n, Hq, D) float32. Queries are processed in chunks so a long
    prefill never materialises an (n, T) matrix per head all at once.
    """
    n, Hq, D = q.shape
    Hkv = k.shape[1]
    scale = F32(1.0 / np.sqrt(D))
    if n == 1 and (k_pos.size == 0 or k_pos.max() <= q_pos[0]):
        # decode: one query sees every cached key; no mask, no chunking
        qg = q[0].reshape(Hkv, group, D) * scale
        scores: F32Array = np.matmul(qg, k.transpose(1, 2, 0))  # (Hkv, group, T)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        one: F32Array = np.matmul(scores, v.transpose(1, 0, 2))
        return one.reshape(1, Hq, D)
    out = np.empty_like(q)
    kt = np.ascontiguousarray(k.transpose(1, 2, 0))  # (Hkv, D, T)
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))  # (Hkv, T, D)
    sorted_keys = k_pos.size < 2 or bool(np.all(k_pos[1:] >= k_pos[:-1]))
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        # keys are sorted by position: a chunk never needs keys past its last query (halves prefill work)
        t_end = int(np.searchsorted(k_pos, q_pos[s:e].max(), side="right")) if sorted_keys else k_pos.size
        qc = q[s:e].reshape(e - s, Hkv, group, D).transpose(1, 0, 2, 3).reshape(Hkv, (e - s) * group, D)
        scores = np.matmul(qc, kt[:, :, :t_end]) * scale  # (Hkv, m*group, T')
        if not (e - s == 1 and t_end and k_pos[:t_end].max() <= q_pos[s]):
            bias = np.where(k_pos[None, :t_end] > q_pos[s:e, None], F32(-np.inf), F32(0))  # (m, T')
            scores = scores.reshape(Hkv, e - s, group, -1)
            scores += bias[None, :, None, :]
            scores = scores.reshape(Hkv, (e - s) * group, -1)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        o = np.matmul(scores, vh[:, :t_end])  # (Hkv, m*group, D)
        out[s:e] = o.reshape(Hkv, e - s, group, D).transpose(1, 0, 2, 3).reshape(e - s, Hq, D)
    return out


def moe_ffn(x: F32Array, ids: IntArray, w: F32Array, gate: F32Array, up: F32Array,
            down: F32Array) -> F32Array:
    """SwiGLU experts weighted by routing: sum_k w_k * down_e(silu(gate_e x) * up_e x).

    x (n, H); ids/w (n, k); gate/up (E, H, F'), down (E, F', H) where F' may be
    one chip's half of the intermediate columns (then the result is that
    chip's partial sum). Returns (n, H) float32.
    """
    n, H = x.shape
    out = np.zeros((n, down.shape[-1]), dtype=F32)
    if n == 1:
        e = ids[0]
        g = np.matmul(x[0], gate[e])  # (k, F')
        u = np.matmul(x[0], up[e])
        a = (g / (F32(1.0) + np.exp(-g))) * u * w[0][:, None]
        out[0] = np.matmul(a[:, None, :], down[e]).sum(axis=0)[0]
        return out
    flat_e = ids.reshape(-1)
    flat_t = np.repeat(np.arange(n), ids.shape[1])
    flat_w = w.reshape(-1)
    order = np.argsort(flat_e, kind="stable")
    flat_e, flat_t, flat_w = flat_e[order], flat_t[order], flat_w[order]
    bounds = np.flatnonzero(np.diff(flat_e)) + 1
    for grp_t, grp_w, e in zip(np.split(flat_t, bounds), np.split(flat_w, bounds),
                               flat_e[np.r_[0, bounds]], strict=True):
        xe = x[grp_t]
        g = xe @ gate[e]
        u = xe @ up[e]
        a = (g / (1.0 + np.exp(-g))) * u
        out[grp_t] += (a @ down[e]) * grp_w[:, None]  # a token picks an expert at most once: no repeats
    return out


#: Largest proven bound on |attention score| for which the softmax skips its max: exp() of the raw
#: scores stays within [e^-30, e^30], so a row's sum over any context (<= 40960 keys, facts.md F2) and the
#: (sum x V) products stay normal and finite.
SCORE_BOUND = 30.0

#: Queries per block of the prefill attention (32 measured fastest of 32/64/128/256 at 512 and 1024
#: tokens): the masked (future) keys a block computes and
#: discards are at most half a block per query, and a block's scores stay cache-sized.
PREFILL_BLOCK = 32


def prefill_attention(q: F32Array, k: F32Array, v: F32Array, q_pos: IntArray, k_pos: IntArray,
                       block: int = PREFILL_BLOCK, no_max: bool = False) -> F32Array:
    """Causal attention of a prefill, every KV head in one call per block of queries.

    q (G, n, group, D) float32 (G KV heads, ``group`` query heads each), k/v (G, T, D);
    q_pos (n,), k_pos (T,) token positions: a query attends to keys with position <= its own.
    Returns (G, n, group, D) float32. With keys sorted by position (the engine's order), a block
    only computes keys up to its last query, and only the keys past its first query are masked;
    so the masked upper triangle is skipped but for the diagonal blocks. The softmax's
    normalisation is applied to the (m, D) output, not to the (m, T) probabilities.

    ``no_max``: the caller proved every score within ``SCORE_BOUND`` (``ShardedModel._score_bounds``);
    then see :func:`prefill_attention_no_max` (same result to float rounding, about half the passes).
    """
    if no_max:
        return prefill_attention_no_max(q, k, v, q_pos, k_pos)
    G, n, group, D = q.shape
    T = k.shape[1]
    qs = q * F32(1.0 / np.sqrt(D))  # on q, not the scores: exact when D is a power of 4 (16: scale 1/4)
    kt = np.ascontiguousarray(k.transpose(0, 2, 1))  # (G, D, T)
    out = np.empty((G, n, group, D), dtype=F32)
    sorted_keys = T < 2 or bool(np.all(k_pos[1:] >= k_pos[:-1]))
    for s in range(0, n, block):
        e = min(n, s + block)
        qp = q_pos[s:e]
        if sorted_keys:
            t_end = int(np.searchsorted(k_pos, qp.max(), side="right"))
            t_vis = int(np.searchsorted(k_pos, qp.min(), side="right"))  # keys every query of the block sees
        else:
            t_end, t_vis = T, 0
        m = e - s
        sc = np.matmul(qs[:, s:e].reshape(G, m * group, D), kt[:, :, :t_end])  # (G, m*group, t_end)
        if t_vis < t_end:
            bias = np.where(k_pos[None, t_vis:t_end] > qp[:, None], F32(-np.inf), F32(0))  # (m, t_end - t_vis)
            sc.reshape(G, m, group, t_end)[..., t_vis:] += bias[None, :, None, :]
        sc -= sc.max(axis=-1, keepdims=True)
        np.exp(sc, out=sc)
        tot = sc.sum(axis=-1, keepdims=True)
        o = np.matmul(sc, v[:, :t_end])  # (G, m*group, D)
        o /= tot
        out[:, s:e] = o.reshape(G, m, group, D)
    return out


#: Queries per block of :func:`prefill_attention_no_max`: 8 measured fastest of 4/8/16/32 at 128-512
#: tokens (CPU ms a layer at 256: 2.57 / 2.16 / 2.57 / 3.36); a block's scores stay within the L2 cache.
PREFILL_BLOCK_NO_MAX = 8


def prefill_attention_no_max(q: F32Array, k: F32Array, v: F32Array, q_pos: IntArray,
                              k_pos: IntArray, block: int = PREFILL_BLOCK_NO_MAX) -> F32Array:
    """``prefill_attention`` for scores proven within ``SCORE_BOUND``: softmax without its max.

    Shapes as ``prefill_attention``. Per block: scores (one matmul), exp in place, masked keys of the
    diagonal part zeroed (exp(-inf) is exactly 0, so the same as a -inf bias), then one matmul with
    [V | 1] gives both the weighted sum and the softmax's denominator (no separate sum pass).
    """
    G, n, group, D = q.shape
    T = k.shape[1]
    qs = q * F32(1.0 / np.sqrt(D))  # on q, not the scores: exact when D is a power of 4 (16: scale 1/4)
    kt = np.ascontiguousarray(k.transpose(0, 2, 1))  # (G, D, T)
    va = np.empty((G, T, D + 1), dtype=F32)  # [V | 1]
    va[..., :D] = v
    va[..., D] = _ONE
    oa: F32Array = np.empty((G, n * group, D + 1), dtype=F32)  # sum(p v) | sum(p), normalised once at the end
    qf = qs.reshape(G, n * group, D)
    if T < 2 or bool(np.all(k_pos[1:] >= k_pos[:-1])):
        ends = np.searchsorted(k_pos, q_pos, side="right").tolist()  # keys query i sees: [0, ends[i])
        sorted_keys = True
    else:
        sorted_keys = False
    # the usual prefill: the last n keys are the queries, one position apart. Then every full block's
    # masked keys are the same strict upper triangle of its (block, block - 1) diagonal part, zeroed
    # through precomputed flat indices (a strided multiply per block costs twice as much)
    P = T - n
    tri_rows = tri_cols = None
    if (sorted_keys and n > 1 and P >= 0 and block > 1 and int(q_pos[-1]) - int(q_pos[0]) == n - 1
            and np.array_equal(k_pos[P:], q_pos) and (P == 0 or k_pos[P - 1] < q_pos[0])):
        i, j = np.nonzero(np.arange(block - 1)[None, :] >= np.arange(block)[:, None])  # key j masked for query i
        rows = (np.arange(G)[:, None, None] * (block * group) + i[None, :, None] * group
                + np.arange(group)[None, None, :])
        tri_rows = rows.reshape(-1)
        tri_cols = np.broadcast_to(j[None, :, None], rows.shape).reshape(-1)
    for s in range(0, n, block):
        e = min(n, s + block)
        m = e - s
        if sorted_keys:
            # keys up to the block's last query; only those past its first query need the mask
            t_end, t_vis = max(ends[s:e]), min(ends[s:e])
        else:
            t_end, t_vis = T, 0
        sc = np.matmul(qf[:, s * group:e * group], kt[:, :, :t_end])  # (G, m*group, t_end)
        np.exp(sc, out=sc)
        if t_vis < t_end:
            if tri_rows is not None and m == block:
                flat = tri_rows * t_end
                flat += tri_cols
                flat += t_vis
                sc.reshape(-1)[flat] = 0
            else:
                keep = k_pos[None, t_vis:t_end] <= q_pos[s:e, None]  # (m, t_end - t_vis)
                sc.reshape(G, m, group, t_end)[..., t_vis:] *= keep[None, :, None, :]
        np.matmul(sc, va[:, :t_end], out=oa[:, s * group:e * group])
    return (oa[..., :D] / oa[..., D:]).reshape(G, n, group, D)


def moe_prefill(h: F32Array, ids: IntArray, w: F32Array, used: IntArray, gue: F32Array,
                 down: F32Array) -> F32Array:
    """Both chips' SwiGLU expert partial sums for a prefill, every expert in one batched matmul.

    h (n, H) float32; ids/w (n, k) routing; used (U,) the distinct experts in ``ids`` (sorted);
    gue (E, H, 2*C*F') every chip's gate then every chip's up columns of each expert side by side,
    down (C, E, F', H) (F' = one chip's intermediate columns). Returns (C, n, H) float32: chip c's
    partial sum. Each expert's tokens are a zero-padded row group of one (U, M, H) batch: one batched
    matmul gives gate and up of both chips, one more each chip's down-projection; the routing weight
    scales the F'-wide activations (not the H-wide outputs), and a token's k contributions are summed
    in one reduction.
    """
    n, k = ids.shape
    H = h.shape[1]
    C, E, F = down.shape[:3]
    N = n * k
    flat_e = ids.reshape(-1)
    order = np.argsort(flat_e, kind="stable")  # assignments grouped by expert, tokens ascending
    e_sorted = flat_e[order]
    counts = np.bincount(flat_e, minlength=E)
    M = int(counts.max())
    U = used.size
    uidx = np.zeros(E, dtype=np.int64)
    uidx[used] = np.arange(U)
    row = uidx[e_sorted] * M + (np.arange(N) - (np.cumsum(counts) - counts)[e_sorted])
    X = np.zeros((U * M, H), dtype=F32)
    X[row] = h[order // k]
    Wt = np.zeros((U * M, 1), dtype=F32)
    Wt[row, 0] = w.reshape(-1)[order]
    if U < E:
        gue, down = gue[used], np.take(down, used, axis=1)
    r = np.matmul(X.reshape(U, M, H), gue).reshape(U * M, 2, C * F)  # gate | up, both chips
    g, u = r[:, 0], r[:, 1]
    a = g / (_ONE + np.exp(-g))
    a *= u
    a *= Wt
    y: F32Array = np.matmul(a.reshape(U, M, C, F).transpose(2, 0, 1, 3), down).reshape(C, U * M, H)  # (C, U*M, H)
    row_of = np.empty(N, dtype=np.int64)
    row_of[order] = row  # assignment (token, j) -> its padded row
    # (C, k, n, H) then a sum over k: contiguous (n, H) blocks added, cheaper than reducing a middle axis
    out: F32Array = np.take(y, row_of.reshape(n, k).T, axis=1).sum(axis=1)
    return out
