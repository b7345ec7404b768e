"""Qwen3-MoE numerics at reduced width, sharded over two chiplets.

Every step runs all 48 layers for real: RMSNorm, per-head q/k RMSNorm,
RoPE (theta 1e6), GQA 32:4 attention, router softmax over 128 experts with
top-8 and renormalised top-k weights, SwiGLU experts, final norm and the LM
head over the full 151936 vocabulary (facts.md F2). Widths are reduced
(``NumericShape``: hidden, head_dim, expert intermediate) and weights are
deterministic synthetic ones drawn from a seed, so routing, KV writes and
logits are computed, not invented, but the text is not meaningful.

Sharding follows facts.md F3 (tensor parallel, no pipeline/expert parallel):
chip c holds Q heads [16c, 16c+16), KV heads [2c, 2c+2), half of every
expert's intermediate columns and half of the vocabulary of the LM head.
Partial attention-output and expert-down results are reduced (summed)
across chips; LM-head halves are gathered. The embedding runs on chip0.

``ReferenceModel`` is the same math on one device, used by tests to prove
the sharded result equals it within float tolerance.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim_backend.bundle.shapes import ModelShape, NumericShape
from sim_backend.model.bf16 import bf16_to_f32, f32_to_bf16
from sim_backend.model.vocab import N_TOKENS

F32 = np.float32
# Real vocabulary ends at 151668 (</think>); ids above are padding rows of the
# 151936-wide LM head. Trained Qwen3 gives them very low logits; our
# synthetic weights get an explicit bias so they are (practically) never drawn.
FIRST_PADDING_ID = N_TOKENS
PADDING_LOGIT_BIAS = -30.0


@dataclass
class LayerWeights:
    """Full (unsharded) weights of one decoder layer, float32.

    Shapes (H = hidden, D = head_dim, Hq/Hkv = head counts, E = experts,
    F = expert intermediate): wq (H, Hq*D), wk/wv (H, Hkv*D), wo (Hq*D, H),
    q_norm/k_norm (D,), in_norm/post_norm (H,), router (H, E),
    gate/up (E, H, F), down (E, F, H).
    """

    in_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    wo: np.ndarray
    post_norm: np.ndarray
    router: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass
class ModelWeights:
    """All synthetic weights: embed (V, H), layers, final_norm (H,), lm_head (H, V), lm_bias (V,)."""

    embed: np.ndarray
    layers: list[LayerWeights]
    final_norm: np.ndarray
    lm_head: np.ndarray
    lm_bias: np.ndarray


@functools.lru_cache(maxsize=2)
def make_weights(shape: ModelShape, num: NumericShape) -> ModelWeights:
    """Draw deterministic synthetic weights for ``shape`` at ``num`` widths.

    Same (shape, num) -> bit-identical weights. Scales keep activations O(1)
    through 48 layers so logits stay finite and routing is non-degenerate.
    Cached: the arrays are shared and must be treated as read-only (chip
    shards hold their own copies, which ClearAllDevMem zeroes).
    """
    rng = np.random.default_rng(np.random.PCG64(num.seed))
    H, D, F = num.hidden, num.head_dim, num.expert_ffn
    Hq, Hkv, E, V = shape.n_q_heads, shape.n_kv_heads, shape.n_experts, shape.vocab

    def normal(*dims: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=F32) * F32(scale)).astype(F32, copy=False)

    def norm_weight(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=F32)).astype(F32)

    layers = []
    for _ in range(shape.n_layers):
        layers.append(
            LayerWeights(
                in_norm=norm_weight(H),
                wq=normal(H, Hq * D, scale=1 / np.sqrt(H)),
                wk=normal(H, Hkv * D, scale=1 / np.sqrt(H)),
                wv=normal(H, Hkv * D, scale=1 / np.sqrt(H)),
                q_norm=norm_weight(D),
                k_norm=norm_weight(D),
                wo=normal(Hq * D, H, scale=0.15 / np.sqrt(Hq * D)),
                post_norm=norm_weight(H),
                router=normal(H, E, scale=2.0 / np.sqrt(H)),
                gate=normal(E, H, F, scale=1 / np.sqrt(H)),
                up=normal(E, H, F, scale=1 / np.sqrt(H)),
                down=normal(E, F, H, scale=0.15 / np.sqrt(F)),
            )
        )
    embed = normal(V, H, scale=1.0)
    final_norm = norm_weight(H)
    # the LM head is BF16, as the real model's weights are: float32 values that are exactly BF16, so the
    # compiled path reads half the bytes (uint16 bits, widened exactly) and computes the same products
    lm_head = bf16_to_f32(f32_to_bf16(normal(H, V, scale=3.0 / np.sqrt(H))))
    lm_bias = np.zeros(V, dtype=F32)
    lm_bias[FIRST_PADDING_ID:] = PADDING_LOGIT_BIAS
    return ModelWeights(embed, layers, final_norm, lm_head, lm_bias)


def lazy_zeros(shape: tuple[int, ...], dtype=F32) -> np.ndarray:
    """Zero array whose memory is committed page by page as it is written.

    The KV cache is (chips, layers, kv_heads, cells, head_dim): a short
    sequence writes the first cells of every (chip, layer, head) row. With
    transparent huge pages each such write commits a 2 MiB page, ~770 MiB for
    a 5-token prompt; an anonymous mapping advised MADV_NOHUGEPAGE commits 4 KiB.
    """
    import mmap

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


#: Which implementation ``ShardedModel`` runs: ``compiled`` (the numba kernels, default) or ``numpy``
#: (the reference). The environment variable sets the default for a process (benchmarks, tests).
KERNELS_ENV = "CALCONSOLE_KERNELS"
KERNELS = ("compiled", "numpy")


def kernels_choice(kernels: str | None = None) -> str:
    """``kernels`` if given, else ``$CALCONSOLE_KERNELS``, else ``compiled``. Raises ValueError for another name."""
    import os

    k = kernels or os.environ.get(KERNELS_ENV) or "compiled"
    if k not in KERNELS:
        raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {k!r}")
    return k


_ONE = F32(1.0)
_RMS_CONSTS: dict[tuple[int, float], tuple[np.float32, np.float32]] = {}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis; x (..., n) float32, w (n,) (or broadcastable to x)."""
    # einsum avoids np.mean's Python-level overhead: this runs ~10^4 times a step; the float32
    # constants are made once (same operations and bits as building them per call)
    n = x.shape[-1]
    c = _RMS_CONSTS.get((n, eps))
    if c is None:
        c = _RMS_CONSTS[(n, eps)] = (F32(1.0 / n), F32(eps))
    ms = np.einsum("...i,...i->...", x, x)[..., None] * c[0]
    return x * (_ONE / np.sqrt(ms + c[1])) * w


def head_rms_norm(qk: np.ndarray, w: np.ndarray, d_n: np.float32, c_eps: np.float32) -> np.ndarray:
    """Per-head RMSNorm over the last axis, the hot paths' form: ``qk`` (..., D) float32, ``w``
    broadcastable to it, ``d_n`` = float32(1/D), ``c_eps`` = float32(eps). Returns a new array
    (same operations and bits as :func:`rms_norm`'s in-line form, in place on the mean-square)."""
    ms = np.einsum("...i,...i->...", qk, qk)
    ms *= d_n
    ms += c_eps
    np.sqrt(ms, out=ms)
    out = qk * np.divide(_ONE, ms, out=ms)[..., None]
    out *= w
    return out


def rope_tables(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables (n, head_dim/2) for NeoX-style (rotate-half) RoPE, float32."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang).astype(F32), np.sin(ang).astype(F32)


def rope_full_tables(cos: np.ndarray, sin: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """From ``rope_tables``' cos/sin (n, D/2): (cos|cos, -sin|sin) as (n, 1, D) and the rotate-half
    index (D,), for :func:`apply_rope_full`."""
    half = cos.shape[-1]
    return (np.concatenate([cos, cos], axis=-1)[:, None, :], np.concatenate([-sin, sin], axis=-1)[:, None, :],
            np.r_[half:2 * half, 0:half])


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE on x (n, heads, D) with cos/sin (n, D/2)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def apply_rope_full(x: np.ndarray, cos_full: np.ndarray, sin_signed: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """``apply_rope`` in four numpy calls, same bits: x*[c, c] + x[..., rot]*[-s, s] (a - b*s equals
    a + b*(-s) exactly in IEEE arithmetic). x (..., n, heads, D); tables from :func:`rope_full_tables`."""
    out = x * cos_full
    t = np.take(x, rot, axis=-1)  # np.take's result is C-ordered; x[..., rot]'s is not (slow products)
    t *= sin_signed
    out += t
    return out


def route(h: np.ndarray, router: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
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
    w = np.take_along_axis(probs, ids, axis=-1)
    w = w / w.sum(axis=-1, keepdims=True)
    return ids, w.astype(F32, copy=False)


def _route1(h: np.ndarray, router: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
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


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                     k_pos: np.ndarray, group: int, chunk: int = 256) -> np.ndarray:
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
        scores = np.matmul(qg, k.transpose(1, 2, 0))  # (Hkv, group, T)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        return np.matmul(scores, v.transpose(1, 0, 2)).reshape(1, Hq, D)
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


def moe_ffn(x: np.ndarray, ids: np.ndarray, w: np.ndarray, gate: np.ndarray, up: np.ndarray,
            down: np.ndarray) -> np.ndarray:
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


def _prefill_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray,
                       block: int = PREFILL_BLOCK, no_max: bool = False) -> np.ndarray:
    """Causal attention of a prefill, every KV head in one call per block of queries.

    q (G, n, group, D) float32 (G KV heads, ``group`` query heads each), k/v (G, T, D);
    q_pos (n,), k_pos (T,) token positions: a query attends to keys with position <= its own.
    Returns (G, n, group, D) float32. With keys sorted by position (the engine's order), a block
    only computes keys up to its last query, and only the keys past its first query are masked;
    so the masked upper triangle is skipped but for the diagonal blocks. The softmax's
    normalisation is applied to the (m, D) output, not to the (m, T) probabilities.

    ``no_max``: the caller proved every score within ``SCORE_BOUND`` (``ShardedModel._score_bounds``);
    then see :func:`_prefill_attention_no_max` (same result to float rounding, about half the passes).
    """
    if no_max:
        return _prefill_attention_no_max(q, k, v, q_pos, k_pos)
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


#: Queries per block of :func:`_prefill_attention_no_max`: 8 measured fastest of 4/8/16/32 at 128-512
#: tokens (CPU ms a layer at 256: 2.57 / 2.16 / 2.57 / 3.36); a block's scores stay within the L2 cache.
PREFILL_BLOCK_NO_MAX = 8


def _prefill_attention_no_max(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray,
                              k_pos: np.ndarray, block: int = PREFILL_BLOCK_NO_MAX) -> np.ndarray:
    """``_prefill_attention`` for scores proven within ``SCORE_BOUND``: softmax without its max.

    Shapes as ``_prefill_attention``. Per block: scores (one matmul), exp in place, masked keys of the
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
    oa = np.empty((G, n * group, D + 1), dtype=F32)  # sum(p v) | sum(p), normalised once at the end
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


def _moe_prefill(h: np.ndarray, ids: np.ndarray, w: np.ndarray, used: np.ndarray, gue: np.ndarray,
                 down: np.ndarray) -> np.ndarray:
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
    y = np.matmul(a.reshape(U, M, C, F).transpose(2, 0, 1, 3), down).reshape(C, U * M, H)  # (C, U*M, H)
    row_of = np.empty(N, dtype=np.int64)
    row_of[order] = row  # assignment (token, j) -> its padded row
    # (C, k, n, H) then a sum over k: contiguous (n, H) blocks added, cheaper than reducing a middle axis
    return np.take(y, row_of.reshape(n, k).T, axis=1).sum(axis=1)


@dataclass
class StepNumerics:
    """What one step's numerics produced.

    logits: (vocab,) float32 for the LAST token of the step (llama.cpp only
    needs the last position's logits), or None when only the BF16 bits were
    kept (the numerics worker process sends those, half the bytes);
    experts_touched: per layer, the number of distinct experts the router
    chose across the step's tokens (list of n_layers ints) — the cost model
    prices expert weights by these. logits_bf16: (vocab,) uint16 BF16 bits,
    made from ``logits`` once, on first :meth:`bf16`.
    """

    logits: np.ndarray | None
    experts_touched: list[int]
    logits_bf16: np.ndarray | None = None

    def device_logits(self, dtype: str) -> np.ndarray:
        """The last token's logits as the device returns them (D2H) in ``dtype`` (``ModelShape.logits_dtype``):
        ``bf16`` -> :meth:`bf16` (uint16 (vocab,)); ``f32`` -> ``logits`` (float32 (vocab,)).
        Raises ValueError if they were not kept in that form, or for an unknown dtype."""
        if dtype == "bf16":
            return self.bf16()
        if dtype == "f32":
            if self.logits is None:
                raise ValueError("StepNumerics has no float32 logits (only BF16 bits were kept)")
            return np.ascontiguousarray(self.logits, dtype=np.float32)
        raise ValueError(f"unknown logits dtype {dtype!r}")

    def bf16(self) -> np.ndarray:
        """The last token's logits as BF16 bits, uint16 (vocab,): what the device returns (D2H).

        Converted from ``logits`` once and kept. Raises ValueError if neither is set.
        """
        if self.logits_bf16 is None:
            if self.logits is None:
                raise ValueError("StepNumerics has no logits")
            self.logits_bf16 = f32_to_bf16(self.logits)
        return self.logits_bf16


class ChipShard:
    """One chiplet's slice of the weights and its KV cache arrays.

    KV arrays: k_cache / v_cache float32 (n_layers, kv_heads_per_chip, n_cells, head_dim),
    indexed by KV cell (the KV manager hands out cells). np.zeros is lazy,
    so untouched cells cost no resident memory.
    """

    def __init__(self, chip: int, shape: ModelShape, num: NumericShape, w: ModelWeights,
                 n_cells: int) -> None:
        self.chip = chip
        D, F = num.head_dim, num.expert_ffn
        qh, kvh = shape.q_heads_per_chip, shape.kv_heads_per_chip
        q0, q1 = chip * qh * D, (chip + 1) * qh * D
        k0, k1 = chip * kvh * D, (chip + 1) * kvh * D
        f0, f1 = chip * F // shape.n_chips, (chip + 1) * F // shape.n_chips
        v_half = shape.vocab // shape.n_chips
        self.vocab_range = (chip * v_half, (chip + 1) * v_half)
        self.layers = []
        for lw in w.layers:
            self.layers.append(
                dict(
                    # fused QKV projection: one matmul per layer on each chip
                    wqkv=np.ascontiguousarray(
                        np.concatenate([lw.wq[:, q0:q1], lw.wk[:, k0:k1], lw.wv[:, k0:k1]], axis=1)),
                    wo=np.ascontiguousarray(lw.wo[q0:q1]),
                    qk_norm=np.concatenate([np.tile(lw.q_norm, (qh, 1)), np.tile(lw.k_norm, (kvh, 1))]),
                    gate=np.ascontiguousarray(lw.gate[:, :, f0:f1]),
                    up=np.ascontiguousarray(lw.up[:, :, f0:f1]),
                    down=np.ascontiguousarray(lw.down[:, f0:f1, :]),
                )
            )
        a, b = self.vocab_range
        self.lm_head = np.ascontiguousarray(w.lm_head[:, a:b])
        self.lm_bias = w.lm_bias[a:b].copy()
        self.embed = w.embed.copy() if chip == 0 else None
        # placeholders: ShardedModel points these at its chip-stacked cache
        self.k_cache = np.zeros((shape.n_layers, kvh, 0, D), dtype=F32)
        self.v_cache = self.k_cache
        self.kv_cells = n_cells



def _cell_index(cells: np.ndarray) -> slice | np.ndarray:
    """Index for a sequence's cells: a slice (view, no copy) when they are one
    contiguous run — the common case of one sequence allocated in order."""
    if cells.size and cells[-1] - cells[0] == cells.size - 1 and (cells.size < 3 or np.all(np.diff(cells) == 1)):
        return slice(int(cells[0]), int(cells[-1]) + 1)
    return cells


def _cells(cache: np.ndarray, index: slice | np.ndarray) -> np.ndarray:
    """A layer's cache (C, kvh, cells, D) at a sequence's cells: a view for a slice, else a C-ordered
    gather (``np.take``; fancy indexing on a middle axis returns a strided layout that slows the matmuls)."""
    return cache[:, :, index] if isinstance(index, slice) else np.take(cache, index, axis=2)


class CellKV:
    """Read and write a model's KV cache by cell (``device.kv_state.KVValueStore``): what a slot's saved
    state holds besides its positions. Subclasses list their arrays in ``_kv_arrays`` (array, cell axis)."""

    def _kv_arrays(self) -> list[tuple[np.ndarray, int]]:
        raise NotImplementedError

    def kv_layout(self) -> list[tuple[tuple[int, ...], str, int]]:
        """(shape, dtype string, cell axis) of each KV array (float32; the cell axis spans every KV cell)."""
        return [(tuple(a.shape), a.dtype.str, axis) for a, axis in self._kv_arrays()]

    def kv_take(self, cells: np.ndarray) -> list[np.ndarray]:
        """Each KV array's rows at ``cells`` (copies, in ``cells`` order)."""
        return [np.take(a, np.asarray(cells, dtype=np.int64), axis=axis) for a, axis in self._kv_arrays()]

    def kv_put(self, cells: np.ndarray, rows: Sequence[np.ndarray]) -> None:
        """Write ``rows`` (as ``kv_take`` gives them) at ``cells``; ValueError for rows of another shape."""
        arrays = self._kv_arrays()
        if len(rows) != len(arrays):
            raise ValueError(f"{len(rows)} row arrays for {len(arrays)} KV arrays")
        idx_cells = np.asarray(cells, dtype=np.int64)
        for (a, axis), r in zip(arrays, rows, strict=True):
            idx: list[Any] = [slice(None)] * a.ndim
            idx[axis] = idx_cells
            a[tuple(idx)] = r


class ShardedModel(CellKV):
    """The model as the device runs it: two ``ChipShard`` s with reduce/gather between them.

    ``forward`` is one prefill or decode step for one sequence (batch 1,
    facts.md F2): it writes K/V at ``new_cells`` and attends over ``ctx_cells``
    (all of the sequence's cells including the new ones, sorted by position).
    """

    def __init__(self, shape: ModelShape, num: NumericShape, n_cells: int,
                 weights: ModelWeights | None = None, kernels: str | None = None) -> None:
        self.kernels = kernels_choice(kernels)
        if shape.n_q_heads % shape.n_kv_heads or shape.n_kv_heads % shape.n_chips:
            raise ValueError("heads must split evenly over KV groups and chips")
        if num.expert_ffn % shape.n_chips or num.head_dim % 2:
            raise ValueError("expert_ffn must split over chips and head_dim must be even")
        self.shape, self.num = shape, num
        self.weights = weights if weights is not None else make_weights(shape, num)
        self.chips = [ChipShard(c, shape, num, self.weights, n_cells) for c in range(shape.n_chips)]
        # Stack the chips' shards along a leading chip axis and make each chip's
        # arrays views into the stack: the decode path then runs both chips in
        # one numpy call per op (same math, half the interpreter overhead),
        # while each chip's slice is still exactly its own shard.
        self.stacked: list[dict[str, np.ndarray]] = []
        qh, kvh = shape.q_heads_per_chip, shape.kv_heads_per_chip
        qk_all = np.empty((shape.n_layers, shape.n_chips, qh + kvh, num.head_dim), dtype=F32)
        self._qk_norm_all = qk_all
        for li in range(shape.n_layers):
            st = {}
            for key in ("wqkv", "wo", "down"):
                st[key] = np.stack([c.layers[li][key] for c in self.chips])
                for ci, c in enumerate(self.chips):
                    c.layers[li][key] = st[key][ci]
            # q/k norm weights of every layer in one (L, C, heads, D) array: one call a step bounds
            # the attention scores of all layers (``_score_bounds``)
            st["qk_norm"] = qk_all[li]
            qk_all[li] = np.stack([c.layers[li]["qk_norm"] for c in self.chips])
            for ci, c in enumerate(self.chips):
                c.layers[li]["qk_norm"] = qk_all[li, ci]
            # every chip's gate and up columns of an expert side by side, (E, H, 2, C, F/C): one gather and one
            # matmul give all four products; each chip's gate/up is a view into it
            gue = np.stack([np.stack([c.layers[li][key] for c in self.chips], axis=2) for key in ("gate", "up")],
                           axis=2)
            for ci, c in enumerate(self.chips):
                c.layers[li]["gate"] = gue[:, :, 0, ci]
                c.layers[li]["up"] = gue[:, :, 1, ci]
            st["gue"] = gue.reshape(gue.shape[0], gue.shape[1], -1)  # (E, H, 2*C*F/C), a view
            st["qk_norm_b"] = st["qk_norm"][:, None]  # (C, 1, heads, D): broadcasts over a prefill's tokens
            self.stacked.append(st)
        # LM head halves side by side (H, V): one BLAS matvec gives the gathered logits, column for
        # column the bits of each chip's own product; each chip's half is a column view of it
        self.lm_head = np.concatenate([c.lm_head for c in self.chips], axis=1)
        self.lm_bias = np.concatenate([c.lm_bias for c in self.chips])
        for c in self.chips:
            a, b = c.vocab_range
            c.lm_head, c.lm_bias = self.lm_head[:, a:b], self.lm_bias[a:b]
        self._stack_layers()
        self._compiled: Any = None
        if self.kernels == "compiled":
            from sim_backend.model.compiled import CompiledMoe  # numba loads only when the kernels are used

            self._compiled = CompiledMoe(self._moe_weights(), qh=qh, kvh=kvh, k_act=shape.n_experts_active,
                                         eps=shape.rms_eps)
        kv_shape = (shape.n_chips, shape.n_layers, shape.kv_heads_per_chip, n_cells, num.head_dim)
        self._kv_shape = kv_shape
        self.clear_kv()

    def _stack_layers(self) -> None:
        """Every layer's chip-stacked weights in one all-layers array per kind, the per-layer entries of
        ``stacked`` (and so each chip's shard) views into them: the compiled step reads the same memory."""
        L = self.shape.n_layers
        self._all: dict[str, np.ndarray] = {}
        for key in ("wqkv", "wo", "down"):
            big = np.stack([st[key] for st in self.stacked])  # (L, C, ...)
            self._all[key] = big
            for li, st in enumerate(self.stacked):
                st[key] = big[li]
                for ci, c in enumerate(self.chips):
                    c.layers[li][key] = big[li, ci]
        # gate|up of every chip side by side, (L, E, H, 2, C, F/C); per layer st["gue"] is (E, H, 2*C*F/C)
        g5 = np.stack([np.stack([c.layers[li][key] for c in self.chips], axis=2)
                       for li in range(L) for key in ("gate", "up")])
        E, H, C, Fc = g5.shape[1], g5.shape[2], g5.shape[3], g5.shape[4]
        gue = np.ascontiguousarray(g5.reshape(L, 2, E, H, C, Fc).transpose(0, 2, 3, 1, 4, 5))
        self._all["gue"] = gue.reshape(L, E, H, 2 * C * Fc)
        for li, st in enumerate(self.stacked):
            st["gue"] = self._all["gue"][li]
            for ci, c in enumerate(self.chips):
                c.layers[li]["gate"] = gue[li, :, :, 0, ci]
                c.layers[li]["up"] = gue[li, :, :, 1, ci]

    def _moe_weights(self) -> Any:
        """The compiled step's weights (``compiled.MoeWeights``): views of this model's arrays, plus the
        LM head as BF16 bits (exact: its values are BF16, ``make_weights``)."""
        from sim_backend.model.compiled import MoeWeights
        from sim_backend.model.kernels import bf16_blocks

        w = self.weights
        return MoeWeights(
            in_norm=np.stack([lw.in_norm for lw in w.layers]), post_norm=np.stack([lw.post_norm for lw in w.layers]),
            wqkv=self._all["wqkv"], qk_norm=self._qk_norm_all, wo=self._all["wo"],
            router=np.stack([lw.router for lw in w.layers]), gue=self._all["gue"], down=self._all["down"],
            final_norm=np.ascontiguousarray(w.final_norm, dtype=F32), lm_bits=bf16_blocks(f32_to_bf16(self.lm_head)),
            lm_bias=self.lm_bias)

    def lm_head_changed(self) -> None:
        """Re-derive the compiled path's BF16 LM head (``kernels.bf16_blocks``) from ``lm_head`` after the
        float32 array (or a chip's column view of it) was written in place, e.g. a corrupted region for a
        self-test; values are rounded to BF16, as the device holds them. ~0.1 s; no-op for numpy kernels."""
        if self._compiled is not None:
            from sim_backend.model.kernels import bf16_blocks

            self._compiled.w.lm_bits = bf16_blocks(f32_to_bf16(self.lm_head))

    def _kv_arrays(self) -> list[tuple[np.ndarray, int]]:
        return [(self.k_cache_t, 4), (self.v_cache_t, 4)]  # (C, L, kv_heads, D, cells)

    def clear_kv(self) -> None:
        """Zero every chip's KV cache by mapping fresh zero pages (no page is written).

        K and V are stored transposed, (C, L, kv_heads, D, cells) (``k_cache_t``, ``v_cache_t``): a decode
        step reads each key (and value) dimension over the context as one contiguous run, vectorised over
        keys. ``k_cache`` / ``v_cache`` are the (C, L, kv_heads, cells, D) views of them, as each chip's are.
        """
        C, L, kvh, cells, D = self._kv_shape
        self.k_cache_t = lazy_zeros((C, L, kvh, D, cells))
        self.v_cache_t = lazy_zeros((C, L, kvh, D, cells))
        self.k_cache = self.k_cache_t.transpose(0, 1, 2, 4, 3)
        self.v_cache = self.v_cache_t.transpose(0, 1, 2, 4, 3)
        for ci, c in enumerate(self.chips):
            c.k_cache, c.v_cache = self.k_cache[ci], self.v_cache[ci]

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None) -> float:
        """Compile (or load from numba's on-disk cache) the kernels of both step kinds, then zero the KV.

        Runs a 2-token prefill and one decode on cells 0..2 of this model, and one decode on two threads (the
        split step of long contexts, where this host can run it). ``progress(i, n, stage)`` is
        called when stage i of n starts compiling, once per stage and only then: numba announces each
        compilation (its ``numba:compile`` event), and a kernel loaded from the disk cache is not one, so
        a start that loads the cache says nothing however long the load takes on a busy host (a wall-time
        guess said "compiling" on every start there). The call may come from the chip thread. A first
        start after install compiles (about 30 s of CPU on the reference 2-core host); later starts load
        the cache (about 1 s of CPU, numba's import included). Returns host wall seconds. Nothing to do
        for the numpy kernels.
        """
        import threading
        import time

        from numba.core import event

        t0 = time.perf_counter()
        if self._compiled is None:
            return 0.0
        stages = ("decode step", "prefill (attention, experts, router, LM head)",
                  "decode step on two threads (long contexts)")
        say = progress or (lambda _i, _n, _s: None)
        lock = threading.Lock()
        current = [0]
        told: set[int] = set()

        class Compiling(event.Listener):
            def on_start(self, ev: Any) -> None:
                with lock:
                    i = current[0]
                    if i in told:
                        return
                    told.add(i)
                say(i, len(stages), stages[i - 1])

            def on_end(self, ev: Any) -> None:
                pass

        one, ctx = np.array([1], dtype=np.int64), np.arange(2, dtype=np.int64)
        two = np.arange(2, dtype=np.int64)
        with event.install_listener("numba:compile", Compiling()):
            current[0] = 1
            self.forward(one, one, one, ctx, ctx.copy())
            current[0] = 2
            self.forward(two, two, two.copy(), two.copy(), two.copy())
            from sim_backend.model.compiled import split_possible

            if split_possible():  # the split kernels, used from DECODE_SPLIT_MIN_CONTEXT keys on
                current[0] = 3
                cos, sin = rope_tables(np.array([2]), self.num.head_dim, self.shape.rope_theta)
                embed = self.chips[0].embed
                assert embed is not None
                self._compiled.decode(embed[1].astype(F32), cos[0], sin[0], 2, np.arange(3, dtype=np.int64),
                                      np.array(self._score_bounds(), dtype=np.bool_), self.k_cache_t,
                                      self.v_cache_t, split=True)
        self.clear_kv()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the compiled path's chip thread (idempotent)."""
        if self._compiled is not None:
            self._compiled.close()

    def forward(self, tokens: np.ndarray, positions: np.ndarray, new_cells: np.ndarray,
                ctx_cells: np.ndarray, ctx_positions: np.ndarray) -> StepNumerics:
        """Run one step. tokens/positions/new_cells: (n,) int; ctx_cells/ctx_positions: (T,) int.

        Returns logits of the last token (vocab,) float32 and experts touched per layer.
        """
        shape, num = self.shape, self.num
        D = num.head_dim
        qh, kvh = shape.q_heads_per_chip, shape.kv_heads_per_chip
        group = shape.n_q_heads // shape.n_kv_heads
        n = tokens.shape[0]
        if self._compiled is not None:
            return self._forward_compiled(tokens, positions, new_cells, ctx_cells, ctx_positions)
        if n == 1 and (ctx_positions.size == 0 or ctx_positions.max() <= positions[0]):
            return self._decode(int(tokens[0]), int(positions[0]), int(new_cells[0]), ctx_cells)
        C = shape.n_chips
        # embedding on chip0, broadcast to chip1 (sync D2D)
        embed = self.chips[0].embed
        assert embed is not None  # chip0 holds the embedding
        x = embed[tokens].astype(F32)
        cos_f, sin_s, rot = rope_full_tables(*rope_tables(positions, D, shape.rope_theta))
        # tables spelled out over the heads (n, qh + kvh, D): the products then run over contiguous
        # rows instead of broadcasting a 16-wide row per (token, head)
        cos_b = np.ascontiguousarray(np.broadcast_to(cos_f, (n, qh + kvh, D)))
        sin_b = np.ascontiguousarray(np.broadcast_to(sin_s, (n, qh + kvh, D)))
        d_n, c_eps = F32(1.0 / D), F32(shape.rms_eps)
        touched: list[int] = []
        ctx_index = _cell_index(ctx_cells)
        kcache, vcache = self.k_cache, self.v_cache
        no_max = self._score_bounds()
        # both chips run each op in one call along the leading chip axis (as in _decode); chip c's
        # slice is exactly its own shard's math, and the all-reduces are sums over that axis
        for li, lw in enumerate(self.weights.layers):
            st = self.stacked[li]
            h = rms_norm(x, lw.in_norm, shape.rms_eps)  # replicated on both chips
            # h copied per chip, not broadcast: a broadcast operand sends matmul to numpy's non-BLAS loop
            qkv = np.matmul(np.stack((h,) * C), st["wqkv"])  # (C, n, cols)
            # q and k heads share one per-head RMSNorm + RoPE call (weights stacked)
            qk = qkv[:, :, : (qh + kvh) * D].reshape(C, n, qh + kvh, D)
            # per-head RMSNorm then RoPE, in place on one (C, n, heads, D) array
            qk = head_rms_norm(qk, st["qk_norm_b"], d_n, c_eps)
            t = np.take(qk, rot, axis=-1)  # C-ordered (x[..., rot] is not, and the product then runs 5x slower)
            t *= sin_b
            qk *= cos_b
            qk += t
            q, k = qk[:, :, :qh], qk[:, :, qh:]
            v = qkv[:, :, (qh + kvh) * D:].reshape(C, n, kvh, D)
            # KV scatter: write this step's K/V into each chip's cache cells
            kcache[:, li][:, :, new_cells] = k.transpose(0, 2, 1, 3)
            vcache[:, li][:, :, new_cells] = v.transpose(0, 2, 1, 3)
            T = ctx_cells.shape[0]
            kc = _cells(kcache[:, li], ctx_index).reshape(C * kvh, T, D)  # (C*kvh, T, D): every KV head
            vc = _cells(vcache[:, li], ctx_index).reshape(C * kvh, T, D)
            qh_ = q.reshape(C, n, kvh, group, D).transpose(0, 2, 1, 3, 4).reshape(C * kvh, n, group, D)
            o = _prefill_attention(qh_, kc, vc, positions, ctx_positions, no_max=no_max[li])  # (C*kvh, n, group, D)
            o = o.reshape(C, kvh, n, group, D).transpose(0, 2, 1, 3, 4).reshape(C, n, qh * D)
            x = x + np.matmul(o, st["wo"]).sum(axis=0)  # all-reduce (sum) over chips
            h = rms_norm(x, lw.post_norm, shape.rms_eps)
            ids, w = route(h, lw.router, shape.n_experts_active)
            used = np.unique(ids)
            touched.append(int(used.size))
            x = x + _moe_prefill(h, ids, w, used, st["gue"], st["down"]).sum(axis=0)  # reduce partial sums
        last = rms_norm(x[-1:], self.weights.final_norm, shape.rms_eps)[0]
        return StepNumerics(logits=self._lm_head(last), experts_touched=touched)

    def _forward_compiled(self, tokens: np.ndarray, positions: np.ndarray, new_cells: np.ndarray,
                          ctx_cells: np.ndarray, ctx_positions: np.ndarray) -> StepNumerics:
        """``forward`` through the compiled kernels (``compiled.CompiledMoe``): same inputs, same outputs."""
        shape = self.shape
        embed = self.chips[0].embed
        assert embed is not None  # chip0 holds the embedding
        cos, sin = rope_tables(np.asarray(positions), self.num.head_dim, shape.rope_theta)
        no_max = np.array(self._score_bounds(), dtype=np.bool_)
        ctx = np.ascontiguousarray(ctx_cells, dtype=np.int64)
        n = tokens.shape[0]
        if n == 1 and (ctx_positions.size == 0 or ctx_positions.max() <= positions[0]):
            x = embed[int(tokens[0])].astype(F32)
            logits = self._compiled.decode(x, cos[0], sin[0], int(new_cells[0]), ctx, no_max, self.k_cache_t,
                                           self.v_cache_t)
            return StepNumerics(logits=logits, experts_touched=[shape.n_experts_active] * shape.n_layers)
        x = embed[tokens].astype(F32)
        logits, touched = self._compiled.prefill(
            x, np.asarray(positions, dtype=np.int64), cos, sin, np.asarray(new_cells, dtype=np.int64), ctx,
            np.asarray(ctx_positions, dtype=np.int64), no_max, self.k_cache_t, self.v_cache_t)
        return StepNumerics(logits=logits, experts_touched=touched)

    def _lm_head(self, last: np.ndarray) -> np.ndarray:
        """LM head of the last token, last (H,) -> logits (V,) float32: each chip its half of the vocabulary,
        gathered (one matvec over the side-by-side halves, bias added in place; no concatenate).

        A 1-D vector times a chip-stacked (C, H, V/C) array would be numpy's non-BLAS loop, 2x slower."""
        out = last @ self.lm_head
        out += self.lm_bias
        return out

    def _score_bounds(self) -> list[bool]:
        """Per layer, whether every attention score is provably small enough to skip the softmax's max.

        q and k are RMS-normed per head before RoPE (a rotation), so |q| <= sqrt(D) * max|q_norm| and
        likewise k; by Cauchy-Schwarz |q.k| / sqrt(D) <= sqrt(D) * max|q_norm| * max|k_norm|. Within
        ``SCORE_BOUND`` exp() of a raw score and a row's sum stay normal and finite, and
        softmax(s) = exp(s) / sum(exp(s)) is the same number (the max shift cancels) without the max and
        subtract passes. Read from the live weights each step (a damaged norm weight is seen).
        Returns n_layers bools (True: skip the max).
        """
        a = np.abs(self._qk_norm_all)  # (L, C, qh + kvh, D)
        qh = self.shape.q_heads_per_chip
        bound = a[:, :, :qh].max(axis=(1, 2, 3)) * a[:, :, qh:].max(axis=(1, 2, 3))
        bound *= F32(np.sqrt(self.num.head_dim))
        return (bound <= F32(SCORE_BOUND)).tolist()

    def _decode(self, token: int, position: int, cell: int, ctx_cells: np.ndarray) -> StepNumerics:
        """Decode step (one token) with both chips in one call per op along the chip axis.

        Per chip c the math is the prefill path's (summation order may differ in the last bits);
        the all-reduces are the explicit sums over the chip axis and the LM-head gather is the
        side-by-side halves. The softmax skips its max where ``_score_bounds`` proves it safe and
        normalises the (heads, D) output instead of the (heads, T) probabilities.
        """
        shape, num = self.shape, self.num
        C, D, H = shape.n_chips, num.head_dim, num.hidden
        qh, kvh = shape.q_heads_per_chip, shape.kv_heads_per_chip
        group = shape.n_q_heads // shape.n_kv_heads
        k_act = shape.n_experts_active
        F = num.expert_ffn // C
        qk_cols = (qh + kvh) * D
        scale = F32(1.0 / np.sqrt(D))
        embed = self.chips[0].embed
        assert embed is not None  # chip0 holds the embedding
        x = embed[token].astype(F32)  # (H,) on chip0, broadcast
        rope = rope_full_tables(*rope_tables(np.array([position]), D, shape.rope_theta))
        cos_f, sin_s, rot = rope[0][0], rope[1][0], rope[2]  # (1, D): broadcast over (C, heads, D)
        idx = _cell_index(ctx_cells)
        kcache, vcache = self.k_cache, self.v_cache
        c_n, c_eps = F32(1.0 / H), F32(shape.rms_eps)
        d_n = F32(1.0 / D)
        no_max = self._score_bounds()
        for li, lw in enumerate(self.weights.layers):
            st = self.stacked[li]
            # RMSNorm of one vector: a dot product and scalar arithmetic
            h = x * (_ONE / np.sqrt(np.dot(x, x) * c_n + c_eps)) * lw.in_norm
            qkv = np.matmul(h, st["wqkv"])  # (C, cols): a vector times the chip stack
            qk = qkv[:, :qk_cols].reshape(C, qh + kvh, D)
            qk = head_rms_norm(qk, st["qk_norm"], d_n, c_eps)
            qk = apply_rope_full(qk, cos_f, sin_s, rot)
            kcache[:, li, :, cell] = qk[:, qh:]
            vcache[:, li, :, cell] = qkv[:, qk_cols:].reshape(C, kvh, D)
            K = _cells(kcache[:, li], idx)  # (C, kvh, T, D); a view when cells are contiguous
            V = _cells(vcache[:, li], idx)
            qg = qk[:, :qh].reshape(C, kvh, group, D)
            qg *= scale
            sc = np.matmul(qg, K.transpose(0, 1, 3, 2))  # (C, kvh, group, T)
            if not no_max[li]:
                sc -= sc.max(axis=-1, keepdims=True)
            np.exp(sc, out=sc)
            o = np.matmul(sc, V)  # (C, kvh, group, D)
            o /= np.add.reduce(sc, axis=-1, keepdims=True)
            x = x + np.matmul(o.reshape(C, 1, qh * D), st["wo"]).sum(axis=(0, 1))  # all-reduce over chips
            h = x * (_ONE / np.sqrt(np.dot(x, x) * c_n + c_eps)) * lw.post_norm
            e, w = _route1(h, lw.router, k_act)
            r = np.matmul(h, st["gue"][e]).reshape(k_act, 2, C, F)  # gate and up of both chips in one matmul
            g = r[:, 0]
            a = g / (_ONE + np.exp(-g))
            a *= r[:, 1]
            a *= w[:, None, None]
            # each chip: its k experts' columns as one (k*F) inner product, then the reduce over chips
            dn = np.take(st["down"], e, axis=1).reshape(C, k_act * F, H)
            y = np.matmul(a.transpose(1, 0, 2).reshape(C, 1, k_act * F), dn)
            x = x + y.sum(axis=(0, 1))
        last = x * (_ONE / np.sqrt(np.dot(x, x) * c_n + c_eps)) * self.weights.final_norm
        return StepNumerics(logits=self._lm_head(last), experts_touched=[k_act] * shape.n_layers)


class ReferenceModel:
    """Single-device reference of the same model (no sharding), for tests.

    Keeps its own contiguous KV per position: k/v lists per layer of (T, Hkv, D).
    """

    def __init__(self, shape: ModelShape, num: NumericShape, weights: ModelWeights) -> None:
        self.shape, self.num, self.w = shape, num, weights
        self.k: list[np.ndarray] = [np.zeros((0, shape.n_kv_heads, num.head_dim), F32) for _ in range(shape.n_layers)]
        self.v: list[np.ndarray] = [np.zeros((0, shape.n_kv_heads, num.head_dim), F32) for _ in range(shape.n_layers)]
        self.pos = np.zeros(0, dtype=np.int64)

    def forward(self, tokens: np.ndarray, positions: np.ndarray) -> StepNumerics:
        """Append ``tokens`` at ``positions``; return last-token logits and experts touched."""
        shape, num = self.shape, self.num
        D, n = num.head_dim, tokens.shape[0]
        group = shape.n_q_heads // shape.n_kv_heads
        x = self.w.embed[tokens].astype(F32)
        cos, sin = rope_tables(positions, D, shape.rope_theta)
        self.pos = np.concatenate([self.pos, positions.astype(np.int64)])
        touched = []
        for li, lw in enumerate(self.w.layers):
            h = rms_norm(x, lw.in_norm, shape.rms_eps)
            q = (h @ lw.wq).reshape(n, shape.n_q_heads, D)
            k = (h @ lw.wk).reshape(n, shape.n_kv_heads, D)
            v = (h @ lw.wv).reshape(n, shape.n_kv_heads, D)
            q = apply_rope(rms_norm(q, lw.q_norm, shape.rms_eps), cos, sin)
            k = apply_rope(rms_norm(k, lw.k_norm, shape.rms_eps), cos, sin)
            self.k[li] = np.concatenate([self.k[li], k])
            self.v[li] = np.concatenate([self.v[li], v])
            o = causal_attention(q, self.k[li], self.v[li], positions, self.pos, group)
            x = x + o.reshape(n, -1) @ lw.wo
            h = rms_norm(x, lw.post_norm, shape.rms_eps)
            ids, w = route(h, lw.router, shape.n_experts_active)
            touched.append(int(np.unique(ids).size))
            x = x + moe_ffn(h, ids, w, lw.gate, lw.up, lw.down)
        last = rms_norm(x[-1:], self.w.final_norm, shape.rms_eps)[0]
        return StepNumerics(logits=(last @ self.w.lm_head + self.w.lm_bias).astype(F32), experts_touched=touched)
