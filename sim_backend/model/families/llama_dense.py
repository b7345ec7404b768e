"""Dense Llama-family numerics at full width with real weights, sharded over two chiplets (the pilot).

Per layer: RMSNorm, Q/K/V projections, RoPE on Q and K, grouped-query causal attention, output
projection, RMSNorm, SwiGLU MLP (``down(silu(gate x) * up x)``); then the final RMSNorm and a tied
LM head (the embedding table). Weights come from a GGUF (``gguf_file``), dequantised to float32
at load; all arithmetic is float32 numpy (single-threaded BLAS, as the board sets it).

Activations, K/V and logits are float32 (the device returns them as BF16, facts.md F1). Quantising the
activations entering each matmul to 8-bit blocks of 32, as llama.cpp's kernels for Q4_1 / Q8_0 do,
was tried and rejected: it brought teacher-forced agreement with llama.cpp from 114 to 117 of 121
tokens, but made the logits chaotic in the last bit of a sum (a code flips by one step, and in the
blocks of the residual stream's outlier channels one step is large): the golden output moved by
0.53-0.64 logits between OpenBLAS kernels, against 5e-5 in float32, so no self-test bound could hold
across machines. tests/real/test_pilot_vs_llamacpp.py states the agreement that is asserted.

RoPE: the GGUF converter permutes the Q and K rows of a Llama checkpoint so that llama.cpp's
"normal" RoPE (rotating adjacent pairs ``(x[2i], x[2i+1])`` by ``pos * theta^(-2i/D)``) gives the
model's rotation; these weights are read as stored, so the same adjacent-pair rotation is applied.

Sharding (tensor parallel, as the Qwen3 family's): chip c holds its KV heads (``ModelShape.kv_heads_split``:
3 over 2 chips -> 2 and 1) with their Q heads, the matching rows of the output projection, half of
the MLP's gate/up columns and down rows, and half of the LM head's vocabulary. The attention
output and MLP down partial sums are reduced (summed) over the chips; LM-head halves are gathered;
the embedding runs on chip0. :class:`DenseReference` is the same math on one device, for tests.
"""

from __future__ import annotations

import numpy as np

from sim_backend.bundle.shapes import ModelShape, NumericShape, split_over_chips
from sim_backend.model.families.gguf_file import GGUFFile, open_gguf
from sim_backend.model.numerics import CellKV, StepNumerics, lazy_zeros

F32 = np.float32
_ONE = F32(1.0)


class DenseWeights:
    """Full (unsharded) float32 weights of a dense model, as ``x @ W`` matrices (in, out).

    ``embed`` (V, H); per layer dicts ``attn_norm`` (H,), ``wq`` (H, Hq*D), ``wk``/``wv`` (H, Hkv*D),
    ``wo`` (Hq*D, H), ``ffn_norm`` (H,), ``gate``/``up`` (H, F), ``down`` (F, H); ``final_norm`` (H,);
    ``lm_head`` (H, V) (the embedding transposed when tied).
    """

    def __init__(self, f: GGUFFile, shape: ModelShape) -> None:
        f.check_shape(shape)
        self.embed = f.tensor("token_embd.weight")
        if self.embed.shape != (shape.vocab, shape.hidden):
            raise ValueError(f"token_embd.weight is {self.embed.shape}, expected {(shape.vocab, shape.hidden)}")
        self.layers: list[dict[str, np.ndarray]] = []
        for i in range(shape.n_layers):
            p = f"blk.{i}."
            self.layers.append({
                "attn_norm": f.tensor(p + "attn_norm.weight"),
                "wq": f.tensor(p + "attn_q.weight").T,
                "wk": f.tensor(p + "attn_k.weight").T,
                "wv": f.tensor(p + "attn_v.weight").T,
                "wo": f.tensor(p + "attn_output.weight").T,
                "ffn_norm": f.tensor(p + "ffn_norm.weight"),
                "gate": f.tensor(p + "ffn_gate.weight").T,
                "up": f.tensor(p + "ffn_up.weight").T,
                "down": f.tensor(p + "ffn_down.weight").T,
            })
        self.final_norm = f.tensor("output_norm.weight")
        self.lm_head = (self.embed if shape.tied_embeddings else f.tensor("output.weight")).T


def load_dense_weights(shape: ModelShape, num: NumericShape) -> DenseWeights:
    """Read and dequantise ``num.weights_file`` for ``shape``. Raises ManifestError / ValueError."""
    return DenseWeights(open_gguf(num.weights_file), shape)


def rope_pairs(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Adjacent-pair RoPE (llama.cpp's "normal" mode) on x (n, heads, D) at positions (n,); float32.

    Pair i = (x[..., 2i], x[..., 2i+1]) rotated by ``positions * theta^(-2i/D)`` (angles in float64,
    then float32 cos/sin)."""
    D = x.shape[-1]
    inv = theta ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = positions.astype(np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang).astype(F32)[:, None, :], np.sin(ang).astype(F32)[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis, float32: ``x / sqrt(mean(x^2) + eps) * w``."""
    ms = np.einsum("...i,...i->...", x, x)[..., None] * F32(1.0 / x.shape[-1])
    return x * (_ONE / np.sqrt(ms + F32(eps))) * w


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, k_pos: np.ndarray) -> np.ndarray:
    """Grouped-query causal attention, float32.

    q (n, Hq, D); k/v (T, Hkv, D), Hq a multiple of Hkv; q_pos (n,), k_pos (T,). A query sees keys at
    positions <= its own. Returns (n, Hq, D). Queries go in blocks of 64 so a long prefill never
    holds a (heads, n, T) score tensor at once.
    """
    n, Hq, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    scale = F32(1.0 / np.sqrt(D))
    kt = np.ascontiguousarray(k.transpose(1, 2, 0))          # (Hkv, D, T)
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))          # (Hkv, T, D)
    out = np.empty_like(q)
    for s in range(0, n, 64):
        e = min(n, s + 64)
        m = e - s
        qb = (q[s:e] * scale).reshape(m, Hkv, g, D).transpose(1, 0, 2, 3).reshape(Hkv, m * g, D)
        sc = np.matmul(qb, kt).reshape(Hkv, m, g, -1)          # (Hkv, m, g, T)
        masked = k_pos[None, :] > q_pos[s:e, None]             # (m, T)
        if masked.any():
            sc = np.where(masked[None, :, None, :], F32(-np.inf), sc)
        sc -= sc.max(axis=-1, keepdims=True)
        np.exp(sc, out=sc)
        sc /= sc.sum(axis=-1, keepdims=True)
        o = np.matmul(sc.reshape(Hkv, m * g, -1), vh)         # (Hkv, m*g, D)
        out[s:e] = o.reshape(Hkv, m, g, D).transpose(1, 0, 2, 3).reshape(m, Hq, D)
    return out


class DenseChip:
    """One chiplet's shard of a dense model and its KV cache.

    ``layers``: dicts ``wqkv`` (H, (hq + 2 hkv) D), ``wo`` (hq D, H), ``gu`` (H, 2 Fc) (gate then up
    columns), ``down`` (Fc, H), ``norms`` (2, H); ``lm_head`` (H, Vc), ``lm_bias`` (Vc,) zeros,
    ``embed`` (V, H) on chip0 only. KV: ``k_cache``/``v_cache`` float32 (L, hkv, cells, D).
    """

    def __init__(self, chip: int, shape: ModelShape, w: DenseWeights, n_cells: int) -> None:
        D, C = shape.head_dim, shape.n_chips
        kv_split = shape.kv_heads_split()
        q_split = shape.q_heads_split()
        f_split = split_over_chips(shape.ffn, C)
        v_split = split_over_chips(shape.vocab, C)
        k0, q0, f0, v0 = (sum(s[:chip]) for s in (kv_split, q_split, f_split, v_split))
        self.chip, self.hkv, self.hq, self.fc = chip, kv_split[chip], q_split[chip], f_split[chip]
        qs, ks = slice(q0 * D, (q0 + self.hq) * D), slice(k0 * D, (k0 + self.hkv) * D)
        fs = slice(f0, f0 + self.fc)
        self.vocab_range = (v0, v0 + v_split[chip])
        self.layers = []
        for lw in w.layers:
            self.layers.append({
                "wqkv": np.ascontiguousarray(np.concatenate([lw["wq"][:, qs], lw["wk"][:, ks], lw["wv"][:, ks]], 1)),
                "wo": np.ascontiguousarray(lw["wo"][qs]),
                "gu": np.ascontiguousarray(np.concatenate([lw["gate"][:, fs], lw["up"][:, fs]], 1)),
                "down": np.ascontiguousarray(lw["down"][fs]),
                "norms": np.stack([lw["attn_norm"], lw["ffn_norm"]]),
            })
        a, b = self.vocab_range
        self.lm_head = np.ascontiguousarray(w.lm_head[:, a:b])
        self.lm_bias = np.zeros(b - a, dtype=F32)
        self.final_norm = w.final_norm.copy()
        self.embed = w.embed.copy() if chip == 0 else None
        self.k_cache = lazy_zeros((shape.n_layers, self.hkv, n_cells, D))
        self.v_cache = lazy_zeros((shape.n_layers, self.hkv, n_cells, D))


class DenseShardedModel(CellKV):
    """A dense model as the device runs it: :class:`DenseChip` s with reduce/gather between them.

    ``forward`` is one prefill or decode step of one sequence (batch 1): K/V written at ``new_cells``,
    attention over ``ctx_cells`` (the sequence's cells, sorted by position, including the new ones).
    Same interface as ``numerics.ShardedModel``; ``experts_touched`` is empty (no experts).
    """

    def __init__(self, shape: ModelShape, num: NumericShape, n_cells: int,
                 weights: DenseWeights | None = None) -> None:
        if shape.is_moe:
            raise ValueError(f"DenseShardedModel runs a dense family, got {shape.family}")
        self.shape, self.num, self.n_cells = shape, num, n_cells
        w = weights if weights is not None else load_dense_weights(shape, num)
        self.chips = [DenseChip(c, shape, w, n_cells) for c in range(shape.n_chips)]

    def _kv_arrays(self) -> list[tuple[np.ndarray, int]]:
        return [(a, 2) for c in self.chips for a in (c.k_cache, c.v_cache)]  # (L, hkv, cells, D) per chip

    def clear_kv(self) -> None:
        """Zero every chip's KV cache (fresh zero pages; nothing is written)."""
        for c in self.chips:
            c.k_cache = lazy_zeros(c.k_cache.shape)
            c.v_cache = lazy_zeros(c.v_cache.shape)

    def forward(self, tokens: np.ndarray, positions: np.ndarray, new_cells: np.ndarray,
                ctx_cells: np.ndarray, ctx_positions: np.ndarray) -> StepNumerics:
        """Run one step. tokens/positions/new_cells (n,) int; ctx_cells/ctx_positions (T,) int.
        Returns the last token's logits (vocab,) float32."""
        shape = self.shape
        D, eps, n = shape.head_dim, shape.rms_eps, int(tokens.shape[0])
        embed = self.chips[0].embed
        if embed is None:
            raise ValueError("chip0 holds no embedding table")
        x = embed[tokens].astype(F32)                             # chip0, broadcast (embed_sync)
        contiguous = ctx_cells.size > 0 and int(ctx_cells[-1]) - int(ctx_cells[0]) == ctx_cells.size - 1 \
            and bool(np.all(np.diff(ctx_cells) == 1))
        idx = slice(int(ctx_cells[0]), int(ctx_cells[-1]) + 1) if contiguous else ctx_cells
        for li in range(shape.n_layers):
            h = None
            partial = None
            for c in self.chips:
                lw = c.layers[li]
                if h is None:
                    h = rms_norm(x, lw["norms"][0], eps)           # replicated on every chip
                qkv = h @ lw["wqkv"]                             # (n, (hq + 2 hkv) D)
                q = qkv[:, : c.hq * D].reshape(n, c.hq, D)
                k = qkv[:, c.hq * D:(c.hq + c.hkv) * D].reshape(n, c.hkv, D)
                v = qkv[:, (c.hq + c.hkv) * D:].reshape(n, c.hkv, D)
                q = rope_pairs(q, positions, shape.rope_theta)
                k = rope_pairs(k, positions, shape.rope_theta)
                c.k_cache[li][:, new_cells] = k.transpose(1, 0, 2)  # KV scatter
                c.v_cache[li][:, new_cells] = v.transpose(1, 0, 2)
                K = c.k_cache[li][:, idx].transpose(1, 0, 2)        # (T, hkv, D)
                V = c.v_cache[li][:, idx].transpose(1, 0, 2)
                o = attention(q, K, V, positions, ctx_positions).reshape(n, c.hq * D)
                y = o @ lw["wo"]
                partial = y if partial is None else partial + y    # all-reduce over chips
            assert partial is not None
            x = x + partial
            h = None
            partial = None
            for c in self.chips:
                lw = c.layers[li]
                if h is None:
                    h = rms_norm(x, lw["norms"][1], eps)
                gu = h @ lw["gu"]                                  # (n, 2 Fc)
                g, u = gu[:, : c.fc], gu[:, c.fc:]
                a = g / (_ONE + np.exp(-g))
                a *= u
                y = a @ lw["down"]
                partial = y if partial is None else partial + y    # reduce the partial sums
            assert partial is not None
            x = x + partial
        last = rms_norm(x[-1], self.chips[0].final_norm, eps)
        logits = np.concatenate([last @ c.lm_head + c.lm_bias for c in self.chips])  # gather the halves
        return StepNumerics(logits=logits.astype(F32, copy=False), experts_touched=[])


class DenseReference:
    """The same dense model on one device (no sharding) with its own contiguous KV, for tests."""

    def __init__(self, shape: ModelShape, weights: DenseWeights) -> None:
        self.shape, self.w = shape, weights
        D, Hkv = shape.head_dim, shape.n_kv_heads
        self.k = [np.zeros((0, Hkv, D), F32) for _ in range(shape.n_layers)]
        self.v = [np.zeros((0, Hkv, D), F32) for _ in range(shape.n_layers)]
        self.pos = np.zeros(0, dtype=np.int64)

    def forward(self, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Append ``tokens`` at ``positions``; return the last token's logits (vocab,) float32."""
        s, w = self.shape, self.w
        D, n = s.head_dim, tokens.shape[0]
        x = w.embed[tokens].astype(F32)
        self.pos = np.concatenate([self.pos, positions.astype(np.int64)])
        for li, lw in enumerate(w.layers):
            h = rms_norm(x, lw["attn_norm"], s.rms_eps)
            q = rope_pairs((h @ lw["wq"]).reshape(n, s.n_q_heads, D), positions, s.rope_theta)
            k = rope_pairs((h @ lw["wk"]).reshape(n, s.n_kv_heads, D), positions, s.rope_theta)
            self.k[li] = np.concatenate([self.k[li], k])
            self.v[li] = np.concatenate([self.v[li], (h @ lw["wv"]).reshape(n, s.n_kv_heads, D)])
            o = attention(q, self.k[li], self.v[li], positions, self.pos).reshape(n, -1)
            x = x + o @ lw["wo"]
            h = rms_norm(x, lw["ffn_norm"], s.rms_eps)
            g = h @ lw["gate"]
            x = x + ((g / (_ONE + np.exp(-g))) * (h @ lw["up"])) @ lw["down"]
        last = rms_norm(x[-1], w.final_norm, s.rms_eps)
        return (last @ w.lm_head).astype(F32)
