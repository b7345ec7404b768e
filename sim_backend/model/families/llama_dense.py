"""Dense Llama-family numerics at full width with real weights, sharded over two chiplets (the pilot).

Per layer: RMSNorm, Q/K/V projections, RoPE on Q and K, grouped-query causal attention, output
projection, RMSNorm, SwiGLU MLP (``down(silu(gate x) * up x)``); then the final RMSNorm and a tied
LM head (the embedding table). Weights come from a GGUF (``gguf_file``) and stay in its quantised
formats (Q4_1 projections, Q8_0 embedding / LM head): :class:`DenseShardedModel` computes on them as
llama.cpp's CPU backend does (activations quantised to 8-bit blocks per product, integer block dot
products, F16 K/V), in one compiled call a step (``dense_kernels.dense_forward``: the arithmetic, what
is emulated and why the agreement with llama.cpp is bounded by the quantised model's own chaos).
Activations and logits are float32 (the device returns the logits as BF16, facts.md F1).

RoPE: the GGUF converter permutes the Q and K rows of a Llama checkpoint so that llama.cpp's
"normal" RoPE (rotating adjacent pairs ``(x[2i], x[2i+1])`` by ``pos * theta^(-2i/D)``) gives the
model's rotation; these weights are read as stored, so the same adjacent-pair rotation is applied.

Sharding (tensor parallel, as the Qwen3 family's): chip c holds its KV heads (``ModelShape.kv_heads_split``:
3 over 2 chips -> 2 and 1) with their Q heads, the matching input columns of the output projection, half
of the MLP's gate/up rows and down input columns, and half of the LM head's vocabulary (every split on a
32-weight block boundary, so each chip's activation blocks are the whole vector's). The attention output
and MLP down partial sums are reduced (summed) over the chips; LM-head halves are gathered; the
embedding runs on chip0. :class:`DenseReference` is the unquantised float32 model (weights dequantised,
float32 activations and K/V) on one device, for tests: the exact model the quantised one approximates.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sim_backend.bundle.shapes import ModelShape, NumericShape, split_over_chips
from sim_backend.model.families.dense_kernels import dense_forward, rope_tables
from sim_backend.model.families.dense_quant import QK, pack_q4_1, pack_q8_0, split_q4_1, split_q8_0
from sim_backend.model.families.gguf_file import GGUFFile, MappedTensors, open_gguf
from sim_backend.model.kv_cells import CellKV, lazy_zeros
from sim_backend.model.numerics import StepNumerics

F32 = np.float32
_ONE = F32(1.0)
#: The projections of a layer, by GGUF tensor name (``blk.<i>.<name>.weight``).
_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class QuantMatrix:
    """One GGUF matrix in llama.cpp's layout (rows = outputs, columns = inputs), kept quantised.

    ``kind`` "Q4_1" or "Q8_0"; ``codes`` (rows, cols) uint8 0..15 (Q4_1) or int8 (Q8_0); ``d`` and, for
    Q4_1, ``m`` (rows, cols/32) float32 block scales and minimums (exact F16 values)."""

    def __init__(self, kind: str, codes: np.ndarray, d: np.ndarray, m: np.ndarray | None) -> None:
        self.kind, self.codes, self.d, self.m = kind, codes, d, m

    @classmethod
    def read(cls, f: GGUFFile | MappedTensors, name: str) -> QuantMatrix:
        """Tensor ``name`` of ``f`` (Q4_1 or Q8_0; ValueError for another format)."""
        kind = f.tensor_type(name)
        raw, rows, cols = f.raw(name)
        if cols % QK:
            raise ValueError(f"{name}: {cols} columns are not whole blocks of {QK}")
        if kind == "Q4_1":
            return cls(kind, *split_q4_1(raw, rows, cols))
        if kind == "Q8_0":
            codes, d = split_q8_0(raw, rows, cols)
            return cls(kind, codes, d, None)
        raise ValueError(f"{name} is {kind}; the dense kernels take Q4_1 projections and a Q8_0 embedding")

    def dequantised(self) -> NDArray[np.float32]:
        """The float32 matrix (rows, cols): ``d q + m`` per block, as llama.cpp's dequantisation gives it."""
        r, c = self.codes.shape
        w: NDArray[np.float32] = self.codes.reshape(r, c // QK, QK).astype(F32) * self.d[..., None]
        if self.m is not None:
            w += self.m[..., None]
        return w.reshape(r, c)

    def rows(self, sl: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, d, m) of rows ``sl`` (m zeros for Q8_0), contiguous copies."""
        m = self.m if self.m is not None else np.zeros_like(self.d)
        return tuple(np.ascontiguousarray(a[sl]) for a in (self.codes, self.d, m))  # type: ignore[return-value]

    def cols(self, sl: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(codes, d, m) of input columns ``sl`` (block-aligned), contiguous copies."""
        if sl.start % QK or sl.stop % QK:
            raise ValueError(f"column split {sl} is not on a {QK}-weight block boundary")
        b = slice(sl.start // QK, sl.stop // QK)
        m = self.m if self.m is not None else np.zeros_like(self.d)
        return (np.ascontiguousarray(self.codes[:, sl]), np.ascontiguousarray(self.d[:, b]),
                np.ascontiguousarray(m[:, b]))


class DenseWeights:
    """Full (unsharded) weights of a dense model as the GGUF stores them.

    ``embed`` the (V, H) Q8_0 token embedding (also the LM head when tied, else ``output``); per layer
    ``layers[i]`` a dict of :class:`QuantMatrix` by GGUF name (``attn_q`` (Hq D, H), ``attn_k``/``attn_v``
    (Hkv D, H), ``attn_output`` (H, Hq D), ``ffn_gate``/``ffn_up`` (F, H), ``ffn_down`` (H, F)) plus
    ``attn_norm``/``ffn_norm`` (H,) float32; ``final_norm`` (H,). ``f`` a parsed GGUF (its shape checked
    here) or the mapped tensors of one parsed and checked elsewhere. Raises ManifestError / ValueError.
    """

    def __init__(self, f: GGUFFile | MappedTensors, shape: ModelShape) -> None:
        if isinstance(f, GGUFFile):
            f.check_shape(shape)
        self.embed = QuantMatrix.read(f, "token_embd.weight")
        if self.embed.codes.shape != (shape.vocab, shape.hidden):
            raise ValueError(f"token_embd.weight is {self.embed.codes.shape}, expected {(shape.vocab, shape.hidden)}")
        self.output = self.embed if shape.tied_embeddings else QuantMatrix.read(f, "output.weight")
        if self.output.kind != "Q8_0":
            raise ValueError(f"the LM head is {self.output.kind}; the dense kernels take Q8_0")
        self.layers: list[dict[str, QuantMatrix | np.ndarray]] = []
        for i in range(shape.n_layers):
            p = f"blk.{i}."
            lw: dict[str, QuantMatrix | np.ndarray] = {k: QuantMatrix.read(f, p + k + ".weight") for k in _PROJ}
            for k in _PROJ:
                kind = lw[k].kind  # type: ignore[union-attr]
                if kind != "Q4_1":
                    raise ValueError(f"{p}{k}.weight is {kind}; the dense kernels take Q4_1 projections")
            lw["attn_norm"] = f.tensor(p + "attn_norm.weight")
            lw["ffn_norm"] = f.tensor(p + "ffn_norm.weight")
            self.layers.append(lw)
        self.final_norm = f.tensor("output_norm.weight")

    def matrix(self, li: int, name: str) -> QuantMatrix:
        m = self.layers[li][name]
        assert isinstance(m, QuantMatrix)
        return m

    def norm(self, li: int, name: str) -> np.ndarray:
        v = self.layers[li][name]
        assert isinstance(v, np.ndarray)
        return v


def load_dense_weights(shape: ModelShape, num: NumericShape,
                       table: tuple[tuple[str, str, int, int, int, int], ...] | None = None) -> DenseWeights:
    """Read ``num.weights_file`` for ``shape`` (quantised blocks split into codes and scales: host wall
    seconds). ``table``: its tensor table from a process that parsed and checked it
    (``GGUFFile.tensor_table``): the file is then mapped, not parsed again. Raises ManifestError / ValueError."""
    src = MappedTensors(num.weights_file, table) if table is not None else open_gguf(num.weights_file)
    return DenseWeights(src, shape)


def rope_pairs(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Adjacent-pair RoPE (llama.cpp's "normal" mode) on x (n, heads, D) at positions (n,); float32,
    angles as ``dense_kernels.rope_tables`` builds them."""
    c, s = rope_tables(positions, x.shape[-1], theta)
    c, s = c[:, None, :], s[:, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def rms_norm(x: NDArray[np.float32], w: NDArray[np.float32], eps: float) -> NDArray[np.float32]:
    """RMSNorm over the last axis, float32: ``x / sqrt(mean(x^2) + eps) * w``."""
    ms = np.einsum("...i,...i->...", x, x)[..., None] * F32(1.0 / x.shape[-1])
    out: NDArray[np.float32] = x * (_ONE / np.sqrt(ms + F32(eps))) * w
    return out


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


def _stack(parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-layer Q4_1 (codes, d, m) in llama layout (outputs x inputs) -> packed for the products
    (``dense_quant.pack_q4_1``) and stacked over layers: (L, G, K/32, 128) uint8, (L, G, K/32, 8) uint16
    F16 bits twice, C-contiguous."""
    packed = [pack_q4_1(*p) for p in parts]
    return tuple(np.ascontiguousarray(np.stack([p[i] for p in packed])) for i in range(3))  # type: ignore[return-value]


class DenseChip:
    """One chiplet's shard of a dense model and its KV cache, in the kernels' layout.

    Stacked over layers (L), packed for the products (``dense_quant.pack_q4_1``: groups of 8 outputs,
    codes (L, G, K/32, 128) uint8, scales and minimums (L, G, K/32, 8) uint16 F16 bits), for a matrix of K inputs
    and N outputs: ``qkv`` (codes, d, m) of its Q then K then V outputs (K = H, N = (hq + 2 hkv) D); ``wo``
    its input rows of the output projection (K = hq D, N = H); ``gu`` its gate then up outputs (K = H,
    N = 2 fc); ``down`` its input rows of the down projection (K = fc, N = H); ``norms`` (L, 2, H) float32
    (replicated). ``lm_head`` / ``lm_d`` / ``lm_m`` its vocabulary's Q8_0 rows packed (``pack_q8_0``: (G,
    H/32, 256) int8 codes, (G, H/32, 8) F16 bits of scales and zeros), ``lm_bias`` (Vc,) zeros;
    chip0 also the embedding ``embed`` (V, H) int8 codes and ``embed_d``. KV: ``k_cache`` (L, hkv, D, cells)
    (the keys transposed: a decode step's scores run over the keys in vector lanes) and ``v_cache`` (L, hkv,
    cells, D), float32 holding F16 values. ``layers`` is empty (no per-layer dicts).
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
        L = shape.n_layers

        def cat(*parts: tuple[np.ndarray, np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return tuple(np.concatenate([p[i] for p in parts]) for i in range(3))  # type: ignore[return-value]

        self.qkv = _stack([cat(w.matrix(li, "attn_q").rows(qs), w.matrix(li, "attn_k").rows(ks),
                               w.matrix(li, "attn_v").rows(ks)) for li in range(L)])
        self.wo = _stack([w.matrix(li, "attn_output").cols(qs) for li in range(L)])
        self.gu = _stack([cat(w.matrix(li, "ffn_gate").rows(fs), w.matrix(li, "ffn_up").rows(fs)) for li in range(L)])
        self.down = _stack([w.matrix(li, "ffn_down").cols(fs) for li in range(L)])
        self.norms = np.stack([np.stack([w.norm(li, "attn_norm"), w.norm(li, "ffn_norm")])
                               for li in range(L)]).astype(F32)
        self.layers: list[dict[str, np.ndarray]] = []
        a, b = self.vocab_range
        lm_codes, lm_d, _ = w.output.rows(slice(a, b))
        self.lm_head, self.lm_d, self.lm_m = pack_q8_0(lm_codes, lm_d)
        self.lm_bias = np.zeros(b - a, dtype=F32)
        self.final_norm = w.final_norm.astype(F32)
        self.embed = np.ascontiguousarray(w.embed.codes) if chip == 0 else None
        self.embed_d = np.ascontiguousarray(w.embed.d) if chip == 0 else None
        self.k_cache = lazy_zeros((L, self.hkv, D, n_cells))
        self.v_cache = lazy_zeros((L, self.hkv, n_cells, D))


class DenseShardedModel(CellKV):
    """A dense model as the device runs it: :class:`DenseChip` s with reduce/gather between them.

    ``forward`` is one prefill or decode step of one sequence (batch 1): K/V written at ``new_cells``,
    attention over ``ctx_cells`` (the sequence's cells, sorted by position, including the new ones).
    Same interface as ``numerics.ShardedModel``; ``experts_touched`` is empty (no experts). One compiled
    call a step (``dense_kernels.dense_forward``, numba; compiled on the first start after install).
    """

    def __init__(self, shape: ModelShape, num: NumericShape, n_cells: int,
                 weights: DenseWeights | None = None,
                 table: tuple[tuple[str, str, int, int, int, int], ...] | None = None) -> None:
        if shape.is_moe:
            raise ValueError(f"DenseShardedModel runs a dense family, got {shape.family}")
        self.shape, self.num, self.n_cells = shape, num, n_cells
        w = weights if weights is not None else load_dense_weights(shape, num, table)
        self.chips = [DenseChip(c, shape, w, n_cells) for c in range(shape.n_chips)]

    def _kv_arrays(self) -> list[tuple[np.ndarray, int]]:
        # per chip K (L, hkv, D, cells), V (L, hkv, cells, D)
        return [kv for c in self.chips for kv in ((c.k_cache, 3), (c.v_cache, 2))]

    def clear_kv(self) -> None:
        """Zero every chip's KV cache (fresh zero pages; nothing is written)."""
        for c in self.chips:
            c.k_cache = lazy_zeros(c.k_cache.shape)
            c.v_cache = lazy_zeros(c.v_cache.shape)

    def lm_head_changed(self) -> None:
        """Nothing to re-derive: the kernels read the chips' ``lm_head`` codes in place."""

    def warm_up(self, progress: Callable[[int, int, str], None] | None = None) -> float:
        """Compile (or load from numba's disk cache) the step kernel: a 2-token prefill and one decode on
        cells 0..2, then zero the KV. ``progress(1, 1, stage)`` is called once when the kernels start
        compiling, and only then (numba's ``numba:compile`` event, as ``numerics.ShardedModel.warm_up``):
        a start that loads them from the disk cache says nothing. Returns host wall seconds."""
        import time

        from numba.core import event

        t0 = time.perf_counter()
        say = progress or (lambda _i, _n, _s: None)
        told = [False]
        lock = threading.Lock()

        class Compiling(event.Listener):
            def on_start(self, ev: Any) -> None:
                with lock:
                    if told[0]:
                        return
                    told[0] = True
                say(1, 1, "dense step (quantised projections, attention, LM head)")

            def on_end(self, ev: Any) -> None:
                pass

        two = np.arange(2, dtype=np.int64)
        three = np.arange(3, dtype=np.int64)
        with event.install_listener("numba:compile", Compiling()):
            self.forward(two, two, two.copy(), two.copy(), two.copy())
            self.forward(three[2:], three[2:], three[2:], three, three.copy())
        self.clear_kv()
        return time.perf_counter() - t0

    def forward(self, tokens: np.ndarray, positions: np.ndarray, new_cells: np.ndarray,
                ctx_cells: np.ndarray, ctx_positions: np.ndarray) -> StepNumerics:
        """Run one step. tokens/positions/new_cells (n,) int; ctx_cells/ctx_positions (T,) int, sorted by
        position. Returns the last token's logits (vocab,) float32. Raises ValueError for ids outside the
        vocabulary or a chip without its embedding."""
        shape, chips = self.shape, self.chips
        c0 = chips[0]
        if c0.embed is None or c0.embed_d is None:
            raise ValueError("chip0 holds no embedding table")
        tok = np.asarray(tokens, dtype=np.int64)
        if tok.size == 0 or int(tok.min()) < 0 or int(tok.max()) >= shape.vocab:
            raise ValueError(f"token ids must be in [0, {shape.vocab})")
        H, D = shape.hidden, shape.head_dim
        # embedding on chip0: the Q8_0 rows dequantised (d q), broadcast to the chips (embed_sync)
        x = (c0.embed[tok].reshape(-1, H // QK, QK).astype(F32) * c0.embed_d[tok][..., None]).reshape(-1, H)
        pos = np.asarray(positions, dtype=np.int64)
        cos, sin = rope_tables(pos, D, shape.rope_theta)
        kpos = np.asarray(ctx_positions, dtype=np.int64)
        if kpos.size > 1 and bool(np.any(kpos[1:] < kpos[:-1])):
            order = np.argsort(kpos, kind="stable")
            kpos, cells = kpos[order], np.asarray(ctx_cells, dtype=np.int64)[order]
        else:
            cells = np.asarray(ctx_cells, dtype=np.int64)
        ends = np.searchsorted(kpos, pos, side="right").astype(np.int64)
        logits = np.empty(shape.vocab, dtype=F32)
        dense_forward(
            np.ascontiguousarray(x, dtype=F32), cos, sin, np.asarray(new_cells, dtype=np.int64),
            np.ascontiguousarray(cells), ends, F32(shape.rms_eps), D,
            np.array([c.hq for c in chips], dtype=np.int64), np.array([c.hkv for c in chips], dtype=np.int64),
            np.array([c.fc for c in chips], dtype=np.int64),
            np.array([c.vocab_range[0] for c in chips], dtype=np.int64),
            c0.norms, c0.final_norm,
            tuple(c.qkv[0] for c in chips), tuple(c.qkv[1] for c in chips), tuple(c.qkv[2] for c in chips),
            tuple(c.wo[0] for c in chips), tuple(c.wo[1] for c in chips), tuple(c.wo[2] for c in chips),
            tuple(c.gu[0] for c in chips), tuple(c.gu[1] for c in chips), tuple(c.gu[2] for c in chips),
            tuple(c.down[0] for c in chips), tuple(c.down[1] for c in chips), tuple(c.down[2] for c in chips),
            tuple(c.lm_head for c in chips), tuple(c.lm_d for c in chips), tuple(c.lm_m for c in chips),
            tuple(c.k_cache for c in chips), tuple(c.v_cache for c in chips), logits)
        for c in chips:
            a, b = c.vocab_range
            logits[a:b] += c.lm_bias
        return StepNumerics(logits=logits, experts_touched=[])


class DenseReference:
    """The unquantised model on one device: weights dequantised to float32, float32 activations and K/V
    (no block quantisation of the activations, no F16 K/V), its own contiguous KV; for tests."""

    def __init__(self, shape: ModelShape, weights: DenseWeights) -> None:
        self.shape = shape
        self.embed = weights.embed.dequantised()
        self.lm_head = weights.output.dequantised().T
        self.layers = [{k: (weights.matrix(li, k).dequantised().T if k in _PROJ else weights.norm(li, k))
                        for k in (*_PROJ, "attn_norm", "ffn_norm")} for li in range(shape.n_layers)]
        self.final_norm = weights.final_norm
        D, Hkv = shape.head_dim, shape.n_kv_heads
        self.k = [np.zeros((0, Hkv, D), F32) for _ in range(shape.n_layers)]
        self.v = [np.zeros((0, Hkv, D), F32) for _ in range(shape.n_layers)]
        self.pos = np.zeros(0, dtype=np.int64)

    def forward(self, tokens: np.ndarray, positions: np.ndarray) -> NDArray[np.float32]:
        """Append ``tokens`` at ``positions``; return the last token's logits (vocab,) float32."""
        s = self.shape
        D, n = s.head_dim, tokens.shape[0]
        x = self.embed[tokens].astype(F32)
        self.pos = np.concatenate([self.pos, positions.astype(np.int64)])
        for li, lw in enumerate(self.layers):
            h = rms_norm(x, lw["attn_norm"], s.rms_eps)
            q = rope_pairs((h @ lw["attn_q"]).reshape(n, s.n_q_heads, D), positions, s.rope_theta)
            k = rope_pairs((h @ lw["attn_k"]).reshape(n, s.n_kv_heads, D), positions, s.rope_theta)
            self.k[li] = np.concatenate([self.k[li], k])
            self.v[li] = np.concatenate([self.v[li], (h @ lw["attn_v"]).reshape(n, s.n_kv_heads, D)])
            o = attention(q, self.k[li], self.v[li], positions, self.pos).reshape(n, -1)
            x = x + o @ lw["attn_output"]
            h = rms_norm(x, lw["ffn_norm"], s.rms_eps)
            g = h @ lw["ffn_gate"]
            x = x + ((g / (_ONE + np.exp(-g))) * (h @ lw["ffn_up"])) @ lw["ffn_down"]
        last = rms_norm(x[-1], self.final_norm, s.rms_eps)
        return (last @ self.lm_head).astype(F32)
