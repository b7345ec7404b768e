"""Qwen3-MoE steps composed of the compiled kernels (``kernels.py``): the fast path of ``ShardedModel``.

A decode step is ONE compiled call (all 48 layers, both chiplets, the LM head): the numpy path
spends about two thirds of its 15 ms in ~4,900 calls' dispatch. From ``DECODE_SPLIT_MIN_CONTEXT`` keys
it is two compiled calls on two threads instead, one per chiplet's attention, handing over each layer
through two POSIX semaphores inside the compiled code (``_decode_layers`` / ``_decode_split_other``;
the semaphores' kernels in :mod:`sim_backend.model.kernel_sync`):
the attention over a long context is most of the step and the two chips' shares are independent until
the all-reduce. Both forms run the same per-chip kernels in the same order: the same bits.
A prefill is likewise one compiled call per thread (``_prefill_layers``): chip 0's work on the calling
thread and chip 1's on the pool's (each chip's projections as BLAS products inside the kernel, attention
and output-projection share, its half of the router's rows, its expert partial sums), the threads meeting
through the same semaphores three times a layer; each thread computes the norms and all-reduces itself
(the same bits), so no Python runs between layers (it cost ~30 of 250 ms at 512 tokens: numpy norms and
144 pool hand-offs).

The math is ``ShardedModel``'s numpy path, chip for chip (facts.md F3: tensor parallel, attention
output and expert partial sums reduced over the chips, LM-head halves gathered); only summation
order and the exp differ (see ``kernels``). ``MoeWeights`` holds the weights in the layouts the
kernels read; the KV cache (K transposed) is the model's own, shared with the numpy path.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim_backend.model.attention_kernels import attend_decode, attend_prefill_t
from sim_backend.model.kernel_cache import (
    BoolArray,
    F32Array,
    I64Array,
    IntLike,
    U16Array,
    kernel,
    wide_legal,
)
from sim_backend.model.kernel_sync import SPLIT_WAIT_S, c_library, sem_post, sem_wait_s, split_possible
from sim_backend.model.kernels import bf16_matvec, head_norm_rope, matvec, matvec_add, rms_norm, silu_mul, softmax_top_k

F32 = np.float32

#: Context keys from which a decode step runs each layer's attention on two threads (``CompiledMoe.decode``).
#: Measured in-process on the idle 2-core host, ms a step one thread -> two: 128 3.0 -> 2.5, 256 3.4-3.8 ->
#: 3.1-3.2, 512 5.7-6.1 -> 3.9-4.1: below 512 the split saves 10-15 % of a short step for a second busy core
#: (it spins at each hand-off), which a console sharing 2 cores with its UI does not want.
DECODE_SPLIT_MIN_CONTEXT = 512

#: Bound on waiting for another split step of the same model to end (host wall s): a step takes well under
#: a second on an idle host; the engine's step bound (300 s) is the most a caller would wait anyway.
SPLIT_LOCK_WAIT_S = 300


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
def _decode_attn_chip(li: IntLike, c: IntLike, h: F32Array, cos: F32Array, sin: F32Array, cell: IntLike, start: IntLike,
                      idx: I64Array, T: IntLike, no_max_l: bool, eps: np.float32, scale: np.float32, qh: IntLike,
                      kvh: IntLike, wqkv: F32Array, qk_norm: F32Array, wo: F32Array, k_t: F32Array, v_t: F32Array,
                      qkv: F32Array, qk: F32Array, q: F32Array, og: F32Array, o: F32Array, scores: F32Array,
                      y: F32Array) -> None:
    """Chip ``c``'s attention of one decode token in layer ``li``: its q|k|v columns, per-head RMSNorm + RoPE,
    the K/V write at ``cell``, attention of each of its KV heads over the context, and its share of the
    output projection, written to y[c] (H,) (the partial sum before the all-reduce).

    h (H,) the normed residual (read only); scratch rows qkv[c] (cols,), o[c] (qh D,) and y[c] are this chip's
    own; qk (qh + kvh, D), q, og (G, D) and scores (G, >= T) are scratch owned by the calling thread (one set per
    thread when the chips run on two threads, ``CompiledMoe.decode``). Arguments otherwise as ``_decode_layers``.
    """
    wide_legal()
    D = qk_norm.shape[3]
    G = qh // kvh
    qkc = (qh + kvh) * D
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
        attend_decode(q, k_t[c, li, hk], v_t[c, li, hk], start, idx, T, no_max_l, scores, og)
        for g in range(G):
            for d in range(D):
                o[c, (hk * G + g) * D + d] = og[g, d]
    matvec(o[c], wo[li, c], y[c])


@kernel()
def _decode_between(li: IntLike, x: F32Array, h: F32Array, y: F32Array, eps: np.float32, k_act: IntLike,
                    in_norm: F32Array, post_norm: F32Array, router: F32Array, gue: F32Array, down: F32Array,
                    final_norm: F32Array, lm_bits: U16Array, lm_bias: F32Array, probs: F32Array, ids: I64Array,
                    wt: F32Array, gu: F32Array, act: F32Array, logits: F32Array) -> None:
    """The serial part of a decode step between two layers' attention: for li > 0 the all-reduce of layer
    li - 1's attention partial sums y (C, H) into the residual x (H,), its post-attention norm, router, top-k and
    the experts of every chip (partial sums reduced into x in chip order); then, for li < L, layer li's input
    norm into h (H,), or for li == L the final norm and the LM head into logits (V,). Scratch: probs (E,),
    ids (k,) int64, wt (k,), gu (2 C F,), act (F,) float32."""
    wide_legal()
    L = in_norm.shape[0]
    C, H = y.shape
    F = down.shape[3]
    if li > 0:
        p = li - 1
        for i in range(H):  # all-reduce: the chips' partial sums, then the residual
            acc = y[0, i]
            for c in range(1, C):
                acc += y[c, i]
            x[i] += acc
        rms_norm(x, post_norm[p], eps, h)
        matvec(h, router[p], probs)
        softmax_top_k(probs, k_act, ids, wt)
        for c in range(C):
            for i in range(H):
                y[c, i] = 0.0
        for j in range(k_act):
            e = ids[j]
            matvec(h, gue[p, e], gu)
            for c in range(C):
                silu_mul(gu[c * F:(c + 1) * F], gu[(C + c) * F:(C + c + 1) * F], wt[j], act)
                matvec_add(act, down[p, c, e], y[c])
        for i in range(H):
            acc = y[0, i]
            for c in range(1, C):
                acc += y[c, i]
            x[i] += acc
    if li < L:
        rms_norm(x, in_norm[li], eps, h)
    else:
        rms_norm(x, final_norm, eps, h)
        bf16_matvec(h, lm_bits, lm_bias, logits)


@kernel()
def _decode_layers(x: F32Array, cos: F32Array, sin: F32Array, cell: IntLike, start: IntLike, idx: I64Array, T: IntLike,
                   no_max: BoolArray, eps: np.float32, scale: np.float32, qh: IntLike, kvh: IntLike, k_act: IntLike,
                   in_norm: F32Array, post_norm: F32Array, wqkv: F32Array, qk_norm: F32Array, wo: F32Array,
                   router: F32Array, gue: F32Array, down: F32Array, final_norm: F32Array, lm_bits: U16Array,
                   lm_bias: F32Array, k_t: F32Array, v_t: F32Array, logits: F32Array, h: F32Array, qkv: F32Array,
                   o: F32Array, y: F32Array, qk: F32Array, q: F32Array, og: F32Array, scores: F32Array, split: bool,
                   go: IntLike, done: IntLike, ts: I64Array, state: I64Array) -> bool:
    """One decode token through every layer and the LM head; writes ``logits`` (V,).

    x (H,) the token's embedding (float32, overwritten: the residual stream); cos/sin (D/2,); cell: the KV
    cell written; keys: cells start..start+T (start >= 0) or idx[:T]; no_max (L,) bool; k_t, v_t (C, L, kvh,
    D, cells) the transposed K/V caches, written at ``cell``. h (H,), qkv (C, cols), o (C, qh D), y (C, H) the
    step's rows (each chip writes its own); qk (qh + kvh, D), q, og (G, D), scores (G, >= T) this thread's
    scratch. Per layer the serial part (``_decode_between``), then the chips' attention (``_decode_attn_chip``).

    ``split`` False: every chip here, one thread (go, done, ts, state unused). True: the calling thread's share
    of a split step (``CompiledMoe.decode``): a post of ``go`` (the other thread, ``_decode_split_other``, runs
    the other chips' attention), chip 0's attention here, then a wait on ``done``; go, done the semaphores'
    addresses (int64); ts int64 (2,) scratch; state int64 (1,), set to 1 when a wait ran past ``SPLIT_WAIT_S``
    or by a thread that failed (each thread then stops at its next wait). Both forms run the same kernels in
    the same order per chip: the same bits. Returns False when a split step gave up, else True.
    """
    wide_legal()
    L = wqkv.shape[0]
    C = wqkv.shape[1]
    E = router.shape[2]
    F = down.shape[3]
    probs = np.empty(E, dtype=np.float32)
    ids = np.empty(k_act, dtype=np.int64)
    wt = np.empty(k_act, dtype=np.float32)
    gu = np.empty(2 * C * F, dtype=np.float32)
    act = np.empty(F, dtype=np.float32)
    here = 1 if split else C  # chips whose attention runs on this thread
    for li in range(L + 1):
        _decode_between(li, x, h, y, eps, k_act, in_norm, post_norm, router, gue, down, final_norm, lm_bits,
                        lm_bias, probs, ids, wt, gu, act, logits)
        if li == L:
            break
        if split:
            sem_post(go)
        for c in range(here):
            _decode_attn_chip(li, c, h, cos, sin, cell, start, idx, T, no_max[li], eps, scale, qh, kvh, wqkv,
                              qk_norm, wo, k_t, v_t, qkv, qk, q, og, o, scores, y)
        if split and (not sem_wait_s(done, ts, SPLIT_WAIT_S) or state[0] != 0):  # timed out, or the other failed
            state[0] = 1
            return False
    return True


@kernel()
def _decode_split_other(cos: F32Array, sin: F32Array, cell: IntLike, start: IntLike, idx: I64Array, T: IntLike,
                        no_max: BoolArray, eps: np.float32, scale: np.float32, qh: IntLike, kvh: IntLike,
                        wqkv: F32Array, qk_norm: F32Array, wo: F32Array, k_t: F32Array, v_t: F32Array, h: F32Array,
                        qkv: F32Array, o: F32Array, y: F32Array, qk: F32Array, q: F32Array, og: F32Array,
                        scores: F32Array, go: IntLike, done: IntLike, ts: I64Array, state: I64Array) -> bool:
    """The other thread's share of a split decode step: per layer, a wait on ``go``, the attention of chips
    1..C-1 (``_decode_attn_chip``), a post of ``done``. Arguments as ``_decode_layers``'s (qk, q, og,
    scores: this thread's own scratch). Returns False when a wait ran past ``SPLIT_WAIT_S`` or the calling
    thread gave up (``state``)."""
    wide_legal()
    L = wqkv.shape[0]
    C = wqkv.shape[1]
    for li in range(L):
        if not sem_wait_s(go, ts, SPLIT_WAIT_S) or state[0] != 0:
            state[0] = 1
            return False
        for c in range(1, C):
            _decode_attn_chip(li, c, h, cos, sin, cell, start, idx, T, no_max[li], eps, scale, qh, kvh, wqkv,
                              qk_norm, wo, k_t, v_t, qkv, qk, q, og, o, scores, y)
        sem_post(done)
    return True


@kernel()
def _prefill_attention_chip(h: F32Array, wqkv: F32Array, wo: F32Array, qk_norm: F32Array, cos_t: F32Array,
                            sin_t: F32Array, eps: np.float32, scale: np.float32, qh: IntLike, kvh: IntLike,
                            new_cells: I64Array, ctx_cells: I64Array, ends: I64Array, k_pos: I64Array, q_pos: I64Array,
                            masked: bool, no_max: bool, k_t: F32Array, v_t: F32Array, out: F32Array) -> None:
    """One chip's attention of a prefill for one layer: its q|k|v projection (one BLAS product), per-head
    RMSNorm + RoPE of q and k, the K/V writes at ``new_cells``, causal attention of every KV head over the
    sequence's cells, and its share of the output projection (one BLAS product): the chip's partial sum
    before the all-reduce.

    h (n, H) the normed rows (replicated on both chips); wqkv (H, (qh + 2 kvh) D) and wo (qh D, H) this
    chip's shards; qk_norm (qh + kvh, D); cos_t/sin_t (D/2, n) the RoPE tables transposed; ctx_cells (T,)
    the sequence's cells in position order (new ones included), ends (n,) keys each query sees; k_t, v_t
    (kvh, D, cells) this chip's layer of the transposed caches; out (n, H) written.

    The projection is computed transposed, (cols, n): a feature's values of every token are one contiguous
    row, so the norm and RoPE run vectorised over the tokens (a token at a time, with heads of D = 16, they
    were 0.23 of 0.9 ms a layer outside the attention at 512 tokens), and a key's dimension is written to
    the transposed cache as one run over the new cells. Each value goes through the operations of
    ``kernels.head_norm_rope`` in the same order (the sum of squares in d order, no fused multiply-add).
    """
    wide_legal()
    qkv = np.dot(wqkv.T, h.T)  # (cols, n)
    n = h.shape[0]
    D = qk_norm.shape[1]
    half = D // 2
    G = qh // kvh
    nh = qh + kvh
    qkc = nh * D
    T = ctx_cells.shape[0]
    inv_d = np.float32(1.0 / D)
    ss = np.empty(n, dtype=np.float32)
    inv = np.empty(n, dtype=np.float32)
    for j in range(nh):
        for i in range(n):
            ss[i] = 0.0
        for d in range(D):
            r = qkv[j * D + d]
            for i in range(n):
                ss[i] += r[i] * r[i]
        for i in range(n):
            inv[i] = np.float32(1.0) / np.sqrt(ss[i] * inv_d + eps)
        for d in range(half):
            ra, rb = qkv[j * D + d], qkv[j * D + d + half]
            wa, wb = qk_norm[j, d], qk_norm[j, d + half]
            c, s = cos_t[d], sin_t[d]
            for i in range(n):
                a = ra[i] * inv[i] * wa
                b = rb[i] * inv[i] * wb
                ra[i] = a * c[i] - b * s[i]
                rb[i] = b * c[i] + a * s[i]
    for hk in range(kvh):
        for d in range(D):
            kr, vr = qkv[(qh + hk) * D + d], qkv[qkc + hk * D + d]
            kc, vc = k_t[hk, d], v_t[hk, d]
            for i in range(n):
                kc[new_cells[i]] = kr[i]
                vc[new_cells[i]] = vr[i]
    k_s = np.empty((T, D), dtype=np.float32)  # gathered in position order, a row per key (BLAS operands)
    v_s = np.empty((T, D), dtype=np.float32)
    att = np.empty((n, qh * D), dtype=np.float32)
    for hk in range(kvh):
        for d in range(D):
            kr, vr = k_t[hk, d], v_t[hk, d]
            for t in range(T):
                c = ctx_cells[t]
                k_s[t, d] = kr[c]
                v_s[t, d] = vr[c]
        # the KV head's G query heads are rows hk G D .. (hk + 1) G D of the projection; its output columns
        # the same range of ``att``
        attend_prefill_t(qkv, hk * G * D, G, scale, k_s, v_s, ends, k_pos, q_pos, masked, no_max, att, hk * G * D)
    np.dot(att, wo, out)


@kernel()
def _prefill_experts_chip(h: F32Array, ids: I64Array, w: F32Array, gue: F32Array, down: F32Array, chip: IntLike,
                          out: F32Array) -> None:
    """One chip's SwiGLU expert partial sums for a prefill, one layer.

    h (n, H) the post-attention normed rows; ids/w (n, k) routing; gue (E, H, 2 C F) every chip's gate
    then up columns; down (E, F, H) this chip's rows; out (n, H) written: sum_j w_j down(silu(g) u).
    Tokens are grouped by expert (a counting sort), and each expert's rows go through two BLAS products:
    (m x H) @ (H x 2 C F) (both chips' columns: one contiguous operand; this chip's are picked) and the
    chip's (m x F) @ (F x H), added into the tokens' rows.
    """
    wide_legal()
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


@kernel()
def _rows_rms_norm(x: F32Array, w: F32Array, eps: np.float32, out: F32Array) -> None:
    """out[i] = rms_norm(x[i]) * w for every row: x, out (n, H) float32 (out may be x), w (H,), eps float32."""
    wide_legal()
    for i in range(x.shape[0]):
        rms_norm(x[i], w, eps, out[i])


@kernel()
def _add_chips(x: F32Array, y: F32Array) -> None:
    """The all-reduce into the residual: x (n, H) += sum over chips of y (C, n, H), the chips' partial sums
    added in chip order first (as numpy's ``x + y.sum(axis=0)``), float32."""
    wide_legal()
    C, n, H = y.shape
    for i in range(n):
        for j in range(H):
            acc = y[0, i, j]
            for c in range(1, C):
                acc += y[c, i, j]
            x[i, j] += acc


@kernel()
def _meet(part: IntLike, go: IntLike, done: IntLike, ts: I64Array, state: I64Array) -> bool:
    """A rendezvous of a split prefill's two threads (``_prefill_layers``): part 0 posts ``go`` and waits on
    ``done``, part 1 the other way round, so neither passes until both arrived. Each wait is bounded
    (``sem_wait_s``, ``SPLIT_WAIT_S``). False (and state[0] = 1) when a wait ran past the bound or the
    other thread failed (it set ``state`` and posted), else True."""
    wide_legal()
    if part == 0:
        sem_post(go)
        ok = sem_wait_s(done, ts, SPLIT_WAIT_S)
    else:
        sem_post(done)
        ok = sem_wait_s(go, ts, SPLIT_WAIT_S)
    if not ok or state[0] != 0:
        state[0] = 1
        return False
    return True


@kernel()
def _prefill_layers(part: IntLike, parts: IntLike, x: F32Array, h: F32Array, ya: F32Array, ye: F32Array, ids: I64Array,
                    wt: F32Array, touched: I64Array, cos_t: F32Array, sin_t: F32Array, new_cells: I64Array,
                    ctx_cells: I64Array, ends: I64Array, k_pos: I64Array, q_pos: I64Array, masked: bool,
                    no_max: BoolArray, eps: np.float32, scale: np.float32, qh: IntLike, kvh: IntLike, k_act: IntLike,
                    in_norm: F32Array, post_norm: F32Array, wqkv: F32Array, qk_norm: F32Array, wo: F32Array,
                    router: F32Array, gue: F32Array, down: F32Array, k_t: F32Array, v_t: F32Array, go: IntLike,
                    done: IntLike, ts: I64Array, state: I64Array) -> bool:
    """A prefill of n tokens through every layer: one thread's share (``part`` of ``parts``, 1 or 2).

    x (n, H) float32 the embeddings, overwritten with the residual stream (each thread its own copy: both
    compute the norms and all-reduces, the same bits, rather than wait for one another twice more); h (n, H)
    this thread's normed rows. Shared by the threads: ya, ye (C, n, H) the chips' attention and expert
    partial sums (two arrays, so a chip's next write never meets the other thread's read of the last);
    ids (n, k) int64 / wt (n, k) float32 the routing; touched (L,) int64, distinct experts per layer
    (written by part 0). Chip c's work runs on part c % parts: its attention (``_prefill_attention_chip``),
    the router over its rows n c / C .. n (c + 1) / C (``_route_rows``), its experts
    (``_prefill_experts_chip``). Other arguments as ``CompiledMoe.prefill`` / ``_decode_layers``.

    With two parts the threads meet (``_meet``) three times a layer: after the attention, after the routing,
    after the experts. The calls per chip and per row range are the same in both forms: the same bits.
    Returns False when a meeting failed (a wait past ``SPLIT_WAIT_S``, or the other thread failed), else True.
    """
    wide_legal()
    L, C = wqkv.shape[0], wqkv.shape[1]
    n = x.shape[0]
    E = router.shape[2]
    seen = np.zeros(E, dtype=np.bool_)
    for li in range(L):
        _rows_rms_norm(x, in_norm[li], eps, h)
        for c in range(part, C, parts):
            _prefill_attention_chip(h, wqkv[li, c], wo[li, c], qk_norm[li, c], cos_t, sin_t, eps, scale, qh, kvh,
                                    new_cells, ctx_cells, ends, k_pos, q_pos, masked, no_max[li], k_t[c, li],
                                    v_t[c, li], ya[c])
        if parts > 1 and not _meet(part, go, done, ts, state):
            return False
        _add_chips(x, ya)
        _rows_rms_norm(x, post_norm[li], eps, h)
        for c in range(part, C, parts):
            r0, r1 = n * c // C, n * (c + 1) // C
            _route_rows(h[r0:r1], router[li], k_act, ids[r0:r1], wt[r0:r1])
        if parts > 1 and not _meet(part, go, done, ts, state):
            return False
        if part == 0:
            seen[:] = False
            count = 0
            for i in range(n):
                for j in range(k_act):
                    e = ids[i, j]
                    if not seen[e]:
                        seen[e] = True
                        count += 1
            touched[li] = count
        for c in range(part, C, parts):
            _prefill_experts_chip(h, ids, wt, gue[li], down[li, c], c, ye[c])
        if parts > 1 and not _meet(part, go, done, ts, state):
            return False
        _add_chips(x, ye)
    return True


class CompiledMoe:
    """The compiled Qwen3-MoE step over a ``MoeWeights`` and the model's KV cache.

    ``k_t`` and ``v_t`` (C, L, kvh, D, cells) are the transposed K/V caches, float32 arrays the
    caller owns (``ShardedModel`` points them at its cache). One extra thread runs chip 1's
    prefill work, and a long context's decode attention, beside the caller's chip 0 (kernels release
    the GIL).
    """

    def __init__(self, weights: MoeWeights, *, qh: int, kvh: int, k_act: int, eps: float) -> None:
        self.w = weights
        self.qh, self.kvh, self.k_act = qh, kvh, k_act
        self.eps = F32(eps)
        D = weights.qk_norm.shape[3]
        self.scale = F32(1.0 / np.sqrt(D))
        self._pool: ThreadPoolExecutor | None = None
        self._sem_buf: np.ndarray | None = None
        self._split_lock = threading.Lock()

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="calconsole-chip1")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def decode(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray, cell: int, ctx_cells: np.ndarray,
               no_max: np.ndarray, k_t: np.ndarray, v_t: np.ndarray, *, split: bool | None = None) -> np.ndarray:
        """One decode token: x (H,) float32 embedding (consumed), cos/sin (D/2,) float32 of its position,
        ``cell`` its KV cell, ctx_cells (T,) int64 every cell it attends to in position order
        (its own included); no_max (L,) bool. Returns logits (V,) float32.

        ``split``: run each layer's attention with chip 0 on the calling thread and the other chips on the
        pool's thread, or every chip on this thread (``_decode_layers``: one compiled call either way). Both
        run the same kernels in the same order per chip, so the logits are the same bits. None (default):
        split when the context has at least ``DECODE_SPLIT_MIN_CONTEXT`` keys and this process may run on
        two CPUs (``split_possible``). Raises RuntimeError if a split step's thread waited past
        ``SPLIT_WAIT_S`` for the other; a thread that fails stops the other at its next wait (this call
        re-raises the failure), so neither waits out the bound.
        """
        T = int(ctx_cells.shape[0])
        contiguous = T > 0 and int(ctx_cells[-1]) - int(ctx_cells[0]) == T - 1 and (
            T < 3 or bool(np.all(np.diff(ctx_cells) == 1)))
        start = int(ctx_cells[0]) if contiguous else -1
        w = self.w
        L, C, H, cols = w.wqkv.shape
        D = w.qk_norm.shape[3]
        qh, kvh = self.qh, self.kvh
        G = qh // kvh
        if split is None:
            split = T >= DECODE_SPLIT_MIN_CONTEXT and split_possible()
        split = bool(split) and C > 1
        logits = np.empty(w.lm_bias.shape[0], dtype=F32)
        # the step's rows (each chip writes its own), then each thread's scratch: qk, q, og, scores (float32)
        # and a timespec (int64)
        h, qkv, o = np.empty(H, dtype=F32), np.empty((C, cols), dtype=F32), np.empty((C, qh * D), dtype=F32)
        y = np.zeros((C, H), dtype=F32)
        sc = [(np.empty((qh + kvh, D), dtype=F32), np.empty((G, D), dtype=F32), np.empty((G, D), dtype=F32),
               np.empty((G, T), dtype=F32)) for _ in range(2 if split else 1)]
        ts = [np.zeros(2, dtype=np.int64) for _ in sc]
        state = np.zeros(1, dtype=np.int64)
        cell = int(cell)

        def mine(go: int, done: int) -> bool:
            return bool(_decode_layers(x, cos, sin, cell, start, ctx_cells, T, no_max, self.eps, self.scale, qh,
                                       kvh, self.k_act, w.in_norm, w.post_norm, w.wqkv, w.qk_norm, w.wo, w.router,
                                       w.gue, w.down, w.final_norm, w.lm_bits, w.lm_bias, k_t, v_t, logits, h,
                                       qkv, o, y, *sc[0], split, go, done, ts[0], state))

        if not split:
            mine(0, 0)
            return logits
        go, done = self._semaphores()

        def other() -> bool:
            return bool(_decode_split_other(
                cos, sin, cell, start, ctx_cells, T, no_max, self.eps, self.scale, qh, kvh, w.wqkv, w.qk_norm,
                w.wo, k_t, v_t, h, qkv, o, y, *sc[1], go, done, ts[1], state))

        self._two_threads(lambda: mine(go, done), other, go, done, state, "decode step")
        return logits

    def _two_threads(self, mine: Callable[[], bool], other: Callable[[], bool], go: int, done: int,
                     state: np.ndarray, what: str) -> None:
        """Run ``mine`` here and ``other`` on the pool's thread: the two halves of a split step, which hand over
        through the semaphores ``go`` (``other`` waits on it) and ``done`` (``mine`` waits on it). Each returns
        False when a wait ran past ``SPLIT_WAIT_S`` or the other half gave up (``state``). A half that fails
        (raises) or gives up sets ``state`` and posts the semaphore the other half waits on, so the other stops
        at its next wait at once; the failure is re-raised here. Raises RuntimeError naming ``what`` if a half
        gave up; never waits without bound (every wait of either half is bounded). Split steps of one model run
        one at a time (``_split_lock``, waited for at most ``SPLIT_LOCK_WAIT_S``; RuntimeError past it), so
        callers on several threads are safe."""
        libc = c_library()
        # one split step at a time: they share the semaphores and the pool's one thread (two at once paired
        # each caller's chip 0 with the wrong chip 1: a hang, then a crash)
        if not self._split_lock.acquire(timeout=SPLIT_LOCK_WAIT_S):
            raise RuntimeError(f"{what}: another split step of this model ran over {SPLIT_LOCK_WAIT_S} s")
        try:
            for addr in (go, done):
                if libc.sem_init(ctypes.c_void_p(addr), 0, 0) != 0:
                    raise OSError(ctypes.get_errno(), "sem_init failed")
            self._run_two(mine, other, go, done, state, what, libc)
        finally:
            self._split_lock.release()

    def _run_two(self, mine: Callable[[], bool], other: Callable[[], bool], go: int, done: int,
                 state: np.ndarray, what: str, libc: Any) -> None:
        """``_two_threads``'s run, under its lock."""

        def guarded() -> bool:
            try:
                return other()
            except BaseException:
                state[0] = 1  # this thread failed: the calling thread stops at its next wait, at once
                libc.sem_post(ctypes.c_void_p(done))
                raise

        fut = self._threads().submit(guarded)
        ok = False
        try:
            ok = mine()
        finally:
            if not ok:  # this thread failed or gave up: the other one stops at its next wait, at once
                state[0] = 1
                libc.sem_post(ctypes.c_void_p(go))
            other_ok = fut.result()  # bounded: the other thread's every wait is bounded by SPLIT_WAIT_S
        if not (ok and other_ok):
            raise RuntimeError(f"{what}: a chip thread waited over {SPLIT_WAIT_S} s for the other "
                               "(host starved or stopped); the step's logits are not valid")

    def _semaphores(self) -> tuple[int, int]:
        """Addresses of this model's two process-private POSIX semaphores (``go``, ``done``), allocated once;
        ``_two_threads`` sets them to 0 for each split step, under ``_split_lock``."""
        if self._sem_buf is None:
            self._sem_buf = np.zeros((2, 64), dtype=np.uint8)  # sem_t is 32 bytes on x86-64 glibc; 64 for any
        a = int(self._sem_buf.ctypes.data)
        return a, a + 64

    def prefill(self, x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
                new_cells: np.ndarray, ctx_cells: np.ndarray, ctx_positions: np.ndarray, no_max: np.ndarray,
                k_t: np.ndarray, v_t: np.ndarray, *, split: bool | None = None) -> tuple[np.ndarray, list[int]]:
        """A prefill of n tokens: x (n, H) float32 embeddings, positions/new_cells (n,) int64, cos/sin
        (n, D/2) float32, ctx_cells/ctx_positions (T,) int64 the sequence's cells sorted by position
        (the new ones included). Returns (last token's logits (V,) float32, distinct experts per layer).

        One compiled call per thread for all layers (``_prefill_layers``): per layer each chip's q|k|v
        projection, attention and share of the output projection, its share of the router's rows and its
        expert partial sums; the norms and all-reduces between them. ``split``: chip 1's work on the pool's
        thread beside chip 0's on the calling thread, the two meeting through two POSIX semaphores inside
        the compiled code three times a layer; or every chip on this thread. The same calls per chip in the
        same order, so the same bits either way. None (default): split when there are two chips or more and
        this process may run on two CPUs (``split_possible``). Raises RuntimeError if a thread waited past
        ``SPLIT_WAIT_S`` for the other; a thread that fails stops the other at its next meeting.
        """
        w = self.w
        L, C = w.wqkv.shape[:2]
        H = w.in_norm.shape[1]
        n = x.shape[0]
        T = ctx_cells.shape[0]
        qpos = positions.astype(np.int64, copy=False)
        kpos = ctx_positions.astype(np.int64, copy=False)
        masked = not (T < 2 or bool(np.all(kpos[1:] >= kpos[:-1])))
        ends = np.full(n, T, dtype=np.int64) if masked else np.searchsorted(kpos, qpos, side="right").astype(np.int64)
        cells_new = np.ascontiguousarray(new_cells, dtype=np.int64)
        cells_ctx = np.ascontiguousarray(ctx_cells, dtype=np.int64)
        if split is None:
            split = split_possible()
        parts = 2 if split and C > 1 else 1
        xs = [np.array(x, dtype=F32, order="C") for _ in range(parts)]  # each thread's residual stream
        hs = [np.empty((n, H), dtype=F32) for _ in range(parts)]
        ya, ye = np.zeros((C, n, H), dtype=F32), np.zeros((C, n, H), dtype=F32)
        ids = np.zeros((n, self.k_act), dtype=np.int64)
        wt = np.zeros((n, self.k_act), dtype=F32)
        touched = np.zeros(L, dtype=np.int64)
        ts = [np.zeros(2, dtype=np.int64) for _ in range(parts)]
        state = np.zeros(1, dtype=np.int64)
        go, done = self._semaphores() if parts > 1 else (0, 0)
        cos_t, sin_t = np.ascontiguousarray(cos.T, dtype=F32), np.ascontiguousarray(sin.T, dtype=F32)

        def run(part: int) -> bool:
            return bool(_prefill_layers(
                part, parts, xs[part], hs[part], ya, ye, ids, wt, touched, cos_t, sin_t, cells_new, cells_ctx, ends,
                kpos, qpos, masked, no_max, self.eps, self.scale, self.qh, self.kvh, self.k_act, w.in_norm, w.post_norm,
                w.wqkv, w.qk_norm, w.wo, w.router, w.gue, w.down, k_t, v_t, go, done, ts[part], state))

        if parts == 1:
            run(0)
        else:
            self._two_threads(lambda: run(0), lambda: run(1), go, done, state, "prefill")
        last = np.empty(H, dtype=F32)
        rms_norm(xs[0][n - 1], w.final_norm, self.eps, last)
        logits = np.empty(w.lm_bias.shape[0], dtype=F32)
        bf16_matvec(last, w.lm_bits, w.lm_bias, logits)
        return logits, [int(t) for t in touched]


@kernel()
def _route_rows(h: F32Array, router: F32Array, k: IntLike, ids: I64Array, w: F32Array) -> None:
    """The router of every row: logits = h @ router (one BLAS product), then ``softmax_top_k`` per row.
    h (n, H), router (H, E) float32; ids (n, k) int64 and w (n, k) float32 written. n may be 0."""
    wide_legal()
    if h.shape[0] == 0:
        return
    logits = np.dot(h, router)
    for i in range(logits.shape[0]):
        softmax_top_k(logits[i], k, ids[i], w[i])
