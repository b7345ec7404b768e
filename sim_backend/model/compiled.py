"""Qwen3-MoE steps composed of the compiled kernels (``kernels.py``): the fast path of ``ShardedModel``.

A decode step is ONE compiled call (all 48 layers, both chiplets, the LM head): the numpy path
spends about two thirds of its 15 ms in ~4,900 calls' dispatch. A prefill is a short Python loop
over layers whose work runs per chip on two threads (the kernels release the GIL): each chip's
projections (BLAS products inside the kernel), attention and output-projection share, its half of
the router's rows, and its expert partial sums; only the norms and the all-reduces stay in numpy.

The math is ``ShardedModel``'s numpy path, chip for chip (facts.md F3: tensor parallel, attention
output and expert partial sums reduced over the chips, LM-head halves gathered); only summation
order and the exp differ (see ``kernels``). ``MoeWeights`` holds the weights in the layouts the
kernels read; the KV cache (K transposed) is the model's own, shared with the numpy path.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sim_backend.model.kernels import (
    attend_decode,
    attend_prefill,
    bf16_matvec,
    head_norm_rope,
    kernel,
    matvec,
    matvec_add,
    rms_norm,
    silu_mul,
    softmax_top_k,
)

F32 = np.float32


@dataclass
class MoeWeights:
    """All layers' weights stacked for the kernels (float32 unless said; L layers, C chips).

    in_norm/post_norm (L, H); wqkv (L, C, H, (qh + 2 kvh) D) each chip's fused q|k|v columns;
    qk_norm (L, C, qh + kvh, D); wo (L, C, qh D, H); router (L, H, E); gue (L, E, H, 2 C F)
    every chip's gate then every chip's up columns; down (L, C, E, F, H) (F = one chip's
    intermediate columns); final_norm (H,); lm_bits uint16 BF16 bits of the gathered LM head (both
    chips' halves side by side, (H, V)) in ``kernels.bf16_blocks`` layout; lm_bias (V,).
    """

    in_norm: np.ndarray
    post_norm: np.ndarray
    wqkv: np.ndarray
    qk_norm: np.ndarray
    wo: np.ndarray
    router: np.ndarray
    gue: np.ndarray
    down: np.ndarray
    final_norm: np.ndarray
    lm_bits: np.ndarray
    lm_bias: np.ndarray


@kernel()
def _decode_step(x, cos, sin, cell, start, idx, T, no_max, eps, scale, qh, kvh, k_act,
                 in_norm, post_norm, wqkv, qk_norm, wo, router, gue, down, final_norm, lm_bits, lm_bias,
                 k_t, v_t, logits):
    """One decode token through every layer and the LM head; returns nothing, writes ``logits``.

    x (H,) the token's embedding (float32, overwritten: the residual stream); cos/sin (D/2,);
    cell: the KV cell written; keys: cells start..start+T (start >= 0) or idx[:T]; no_max (L,) bool;
    k_t, v_t (C, L, kvh, D, cells) the transposed K/V caches, written at ``cell``; logits (V,) out.
    """
    L, C, H, cols = wqkv.shape
    D = qk_norm.shape[3]
    G = qh // kvh
    E = router.shape[2]
    F = down.shape[3]
    qkc = (qh + kvh) * D
    h = np.empty(H, dtype=np.float32)
    qkv = np.empty((C, cols), dtype=np.float32)
    qk = np.empty((qh + kvh, D), dtype=np.float32)  # one chip's q and k heads (copied: no reshapes, see ``kernels``)
    q = np.empty((G, D), dtype=np.float32)
    og = np.empty((G, D), dtype=np.float32)
    o = np.empty((C, qh * D), dtype=np.float32)
    y = np.empty((C, H), dtype=np.float32)
    scores = np.empty((G, T), dtype=np.float32)
    probs = np.empty(E, dtype=np.float32)
    ids = np.empty(k_act, dtype=np.int64)
    wt = np.empty(k_act, dtype=np.float32)
    gu = np.empty(2 * C * F, dtype=np.float32)
    act = np.empty(F, dtype=np.float32)
    for li in range(L):
        rms_norm(x, in_norm[li], eps, h)
        for c in range(C):
            matvec(h, wqkv[li, c], qkv[c])
            for j in range(qh + kvh):
                for d in range(D):
                    qk[j, d] = qkv[c, j * D + d]
            head_norm_rope(qk, qk_norm[li, c], cos, sin, eps)
            for hk in range(kvh):
                for d in range(D):
                    k_t[c, li, hk, d, cell] = qk[qh + hk, d]
                    v_t[c, li, hk, d, cell] = qkv[c, qkc + hk * D + d]
            for hk in range(kvh):
                for g in range(G):
                    for d in range(D):
                        q[g, d] = qk[hk * G + g, d] * scale
                attend_decode(q, k_t[c, li, hk], v_t[c, li, hk], start, idx, T, no_max[li], scores, og)
                for g in range(G):
                    for d in range(D):
                        o[c, (hk * G + g) * D + d] = og[g, d]
            matvec(o[c], wo[li, c], y[c])
        for i in range(H):  # all-reduce: the chips' partial sums, then the residual
            acc = y[0, i]
            for c in range(1, C):
                acc += y[c, i]
            x[i] += acc
        rms_norm(x, post_norm[li], eps, h)
        matvec(h, router[li], probs)
        softmax_top_k(probs, k_act, ids, wt)
        y[:, :] = 0.0
        for j in range(k_act):
            e = ids[j]
            matvec(h, gue[li, e], gu)
            for c in range(C):
                silu_mul(gu[c * F:(c + 1) * F], gu[(C + c) * F:(C + c + 1) * F], wt[j], act)
                matvec_add(act, down[li, c, e], y[c])
        for i in range(H):
            acc = y[0, i]
            for c in range(1, C):
                acc += y[c, i]
            x[i] += acc
    rms_norm(x, final_norm, eps, h)
    bf16_matvec(h, lm_bits, lm_bias, logits)


@kernel()
def _prefill_attention_chip(h, wqkv, wo, qk_norm, cos, sin, eps, scale, qh, kvh, new_cells, ctx_cells, ends, k_pos,
                            q_pos, masked, no_max, k_t, v_t, out):
    """One chip's attention of a prefill for one layer: its q|k|v projection (one BLAS product), per-head
    RMSNorm + RoPE of q and k, the K/V writes at ``new_cells``, causal attention of every KV head over the
    sequence's cells, and its share of the output projection (one BLAS product): the chip's partial sum
    before the all-reduce.

    h (n, H) the normed rows (replicated on both chips); wqkv (H, (qh + 2 kvh) D) and wo (qh D, H) this
    chip's shards; qk_norm (qh + kvh, D); cos/sin (n, D/2); ctx_cells (T,) the sequence's cells in position
    order (new ones included), ends (n,) keys each query sees; k_t, v_t (kvh, D, cells) this chip's layer
    of the transposed caches; out (n, H) written.
    """
    qkv = np.dot(h, wqkv)
    n = qkv.shape[0]
    D = qk_norm.shape[1]
    G = qh // kvh
    qkc = (qh + kvh) * D
    T = ctx_cells.shape[0]
    q = np.empty((n, G, D), dtype=np.float32)
    k_s = np.empty((T, D), dtype=np.float32)  # gathered in position order, a row per key (BLAS operands)
    v_s = np.empty((T, D), dtype=np.float32)
    o = np.empty((n, G, D), dtype=np.float32)
    att = np.empty((n, qh * D), dtype=np.float32)
    qk = np.empty((qh + kvh, D), dtype=np.float32)
    for i in range(n):
        for j in range(qh + kvh):  # copied to (heads, D) and the q heads back (no reshapes, see ``kernels``)
            for d in range(D):
                qk[j, d] = qkv[i, j * D + d]
        head_norm_rope(qk, qk_norm, cos[i], sin[i], eps)
        for j in range(qh):
            for d in range(D):
                qkv[i, j * D + d] = qk[j, d]
        c = new_cells[i]
        for hk in range(kvh):
            for d in range(D):
                k_t[hk, d, c] = qk[qh + hk, d]
                v_t[hk, d, c] = qkv[i, qkc + hk * D + d]
    for hk in range(kvh):
        for d in range(D):
            kr, vr = k_t[hk, d], v_t[hk, d]
            for t in range(T):
                c = ctx_cells[t]
                k_s[t, d] = kr[c]
                v_s[t, d] = vr[c]
        for i in range(n):
            for g in range(G):
                for d in range(D):
                    q[i, g, d] = qkv[i, (hk * G + g) * D + d] * scale
        attend_prefill(q, k_s, v_s, ends, k_pos, q_pos, masked, no_max, o)
        for i in range(n):
            for g in range(G):
                for d in range(D):
                    att[i, (hk * G + g) * D + d] = o[i, g, d]
    r = np.dot(att, wo)
    for i in range(n):  # element loops, not ``out[:, :] = r`` (no reshapes, see ``kernels``)
        for j in range(r.shape[1]):
            out[i, j] = r[i, j]


@kernel()
def _prefill_experts_chip(h, ids, w, gue, down, chip, out):
    """One chip's SwiGLU expert partial sums for a prefill, one layer.

    h (n, H) the post-attention normed rows; ids/w (n, k) routing; gue (E, H, 2 C F) every chip's gate
    then up columns; down (E, F, H) this chip's rows; out (n, H) written: sum_j w_j down(silu(g) u).
    Tokens are grouped by expert (a counting sort), and each expert's rows go through two BLAS products:
    (m x H) @ (H x 2 C F) (both chips' columns: one contiguous operand; this chip's are picked) and the
    chip's (m x F) @ (F x H), added into the tokens' rows.
    """
    n, k = ids.shape
    H = h.shape[1]
    E, F = down.shape[0], down.shape[1]
    C = gue.shape[2] // (2 * F)
    g0, u0 = chip * F, (C + chip) * F
    counts = np.zeros(E + 1, dtype=np.int64)
    for i in range(n):
        for j in range(k):
            counts[ids[i, j] + 1] += 1
    for e in range(E):
        counts[e + 1] += counts[e]
    fill = counts[:E].copy()
    tok = np.empty(n * k, dtype=np.int64)
    wgt = np.empty(n * k, dtype=np.float32)
    for i in range(n):
        for j in range(k):
            e = ids[i, j]
            tok[fill[e]] = i
            wgt[fill[e]] = w[i, j]
            fill[e] += 1
    out[:, :] = 0.0
    for e in range(E):
        a, b = counts[e], counts[e + 1]
        m = b - a
        if m == 0:
            continue
        x = np.empty((m, H), dtype=np.float32)
        for r in range(m):
            src = h[tok[a + r]]
            for c in range(H):  # not ``x[r] = src`` (no reshapes, see ``kernels``)
                x[r, c] = src[c]
        gu = np.dot(x, gue[e])  # (m, 2 C F)
        act = np.empty((m, F), dtype=np.float32)
        for r in range(m):
            silu_mul(gu[r, g0:g0 + F], gu[r, u0:u0 + F], wgt[a + r], act[r])
        y = np.dot(act, down[e])  # (m, H)
        for r in range(m):
            row = out[tok[a + r]]
            yr = y[r]
            for c in range(H):
                row[c] += yr[c]


class CompiledMoe:
    """The compiled Qwen3-MoE step over a ``MoeWeights`` and the model's KV cache.

    ``k_t`` and ``v_t`` (C, L, kvh, D, cells) are the transposed K/V caches, float32 arrays the
    caller owns (``ShardedModel`` points them at its cache). One extra thread runs chip 1's
    prefill work beside the caller's chip 0 (kernels release the GIL).
    """

    def __init__(self, weights: MoeWeights, *, qh: int, kvh: int, k_act: int, eps: float) -> None:
        self.w = weights
        self.qh, self.kvh, self.k_act = qh, kvh, k_act
        self.eps = F32(eps)
        D = weights.qk_norm.shape[3]
        self.scale = F32(1.0 / np.sqrt(D))
        self._pool: ThreadPoolExecutor | None = None

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="calconsole-chip1")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def decode(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cell: int, ctx_cells: np.ndarray,
               no_max: np.ndarray, k_t: np.ndarray, v_t: np.ndarray) -> np.ndarray:
        """One decode token: x (H,) float32 embedding (consumed), cos/sin (D/2,) float32 of its position,
        ``cell`` its KV cell, ctx_cells (T,) int64 every cell it attends to in position order
        (its own included); no_max (L,) bool. Returns logits (V,) float32."""
        T = int(ctx_cells.shape[0])
        contiguous = T > 0 and int(ctx_cells[-1]) - int(ctx_cells[0]) == T - 1 and (
            T < 3 or bool(np.all(np.diff(ctx_cells) == 1)))
        start = int(ctx_cells[0]) if contiguous else -1
        w = self.w
        logits = np.empty(w.lm_bias.shape[0], dtype=F32)
        _decode_step(x, cos, sin, int(cell), start, ctx_cells, T, no_max, self.eps, self.scale,
                     self.qh, self.kvh, self.k_act, w.in_norm, w.post_norm, w.wqkv, w.qk_norm, w.wo, w.router,
                     w.gue, w.down, w.final_norm, w.lm_bits, w.lm_bias, k_t, v_t, logits)
        return logits

    def prefill(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                new_cells: np.ndarray, ctx_cells: np.ndarray, ctx_positions: np.ndarray, no_max: np.ndarray,
                k_t: np.ndarray, v_t: np.ndarray) -> tuple[np.ndarray, list[int]]:
        """A prefill of n tokens: x (n, H) float32 embeddings, positions/new_cells (n,) int64, cos/sin
        (n, D/2) float32, ctx_cells/ctx_positions (T,) int64 the sequence's cells sorted by position
        (the new ones included). Returns (last token's logits (V,) float32, distinct experts per layer).

        Per layer, on each chip's own thread (chip 1 on the pool's, chip 0 on the caller's): its q|k|v
        projection, attention and share of the output projection; its half of the router's rows; its
        expert partial sums. The norms and the reductions over chips run here, between them.
        """
        w = self.w
        L, C = w.wqkv.shape[:2]
        H = w.in_norm.shape[1]
        n = x.shape[0]
        T = ctx_cells.shape[0]
        eps, k_act = self.eps, self.k_act
        qpos = positions.astype(np.int64, copy=False)
        kpos = ctx_positions.astype(np.int64, copy=False)
        masked = not (T < 2 or bool(np.all(kpos[1:] >= kpos[:-1])))
        ends = np.full(n, T, dtype=np.int64) if masked else np.searchsorted(kpos, qpos, side="right").astype(np.int64)
        cells_new = new_cells.astype(np.int64, copy=False)
        cells_ctx = ctx_cells.astype(np.int64, copy=False)
        y = np.empty((C, n, H), dtype=F32)
        inv_h = F32(1.0 / H)
        pool = self._threads() if C > 1 else None
        touched: list[int] = []

        def norm(z: np.ndarray, wn: np.ndarray) -> np.ndarray:
            ms = np.einsum("ij,ij->i", z, z)[:, None]
            ms *= inv_h
            ms += eps
            return z * (F32(1.0) / np.sqrt(ms)) * wn

        def on_chips(fn, *args_of_chip) -> None:
            fut = pool.submit(fn, *args_of_chip[1]) if pool is not None else None
            fn(*args_of_chip[0])
            for c in range(2, C):
                fn(*args_of_chip[c])
            if fut is not None:
                fut.result()

        # the router is replicated on every chip; the host splits its rows over the chip threads
        bounds = [n * c // C for c in range(C + 1)]
        for li in range(L):
            h = norm(x, w.in_norm[li])
            on_chips(_prefill_attention_chip, *[
                (h, w.wqkv[li, c], w.wo[li, c], w.qk_norm[li, c], cos, sin, eps, self.scale, self.qh, self.kvh,
                 cells_new, cells_ctx, ends, kpos, qpos, masked, bool(no_max[li]), k_t[c, li], v_t[c, li], y[c])
                for c in range(C)])
            x = x + y.sum(axis=0)  # all-reduce (sum) over chips
            h = norm(x, w.post_norm[li])
            ids = np.empty((n, k_act), dtype=np.int64)
            wt = np.empty((n, k_act), dtype=F32)
            on_chips(_route_rows, *[(h[bounds[c]:bounds[c + 1]], w.router[li], k_act, ids[bounds[c]:bounds[c + 1]],
                                     wt[bounds[c]:bounds[c + 1]]) for c in range(C)])
            touched.append(int(np.unique(ids).size))
            on_chips(_prefill_experts_chip, *[(h, ids, wt, w.gue[li], w.down[li, c], c, y[c]) for c in range(C)])
            x = x + y.sum(axis=0)  # reduce the chips' partial sums
        last = norm(x[-1:], w.final_norm)[0]
        logits = np.empty(w.lm_bias.shape[0], dtype=F32)
        bf16_matvec(last, w.lm_bits, w.lm_bias, logits)
        return logits, touched


@kernel()
def _route_rows(h, router, k, ids, w):
    """The router of every row: logits = h @ router (one BLAS product), then ``softmax_top_k`` per row.
    h (n, H), router (H, E) float32; ids (n, k) int64 and w (n, k) float32 written. n may be 0."""
    if h.shape[0] == 0:
        return
    logits = np.dot(h, router)
    for i in range(logits.shape[0]):
        softmax_top_k(logits[i], k, ids[i], w[i])
