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

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim_backend.bundle.shapes import ModelShape, NumericShape
from sim_backend.model.bf16 import f32_to_bf16
from sim_backend.model.kv_cells import CellKV, cell_index, cells_of, lazy_zeros
from sim_backend.model.layer_ops import (
    SCORE_BOUND,
    apply_rope,
    apply_rope_full,
    causal_attention,
    head_rms_norm,
    moe_ffn,
    moe_prefill,
    prefill_attention,
    rms_norm,
    rope_full_tables,
    rope_tables,
    route,
    route_one,
)
from sim_backend.model.weights import ModelWeights, make_weights

F32 = np.float32
_ONE = F32(1.0)


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
            from sim_backend.model.kernel_sync import split_possible

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
        ctx_index = cell_index(ctx_cells)
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
            kc = cells_of(kcache[:, li], ctx_index).reshape(C * kvh, T, D)  # (C*kvh, T, D): every KV head
            vc = cells_of(vcache[:, li], ctx_index).reshape(C * kvh, T, D)
            qh_ = q.reshape(C, n, kvh, group, D).transpose(0, 2, 1, 3, 4).reshape(C * kvh, n, group, D)
            o = prefill_attention(qh_, kc, vc, positions, ctx_positions, no_max=no_max[li])  # (C*kvh, n, group, D)
            o = o.reshape(C, kvh, n, group, D).transpose(0, 2, 1, 3, 4).reshape(C, n, qh * D)
            x = x + np.matmul(o, st["wo"]).sum(axis=0)  # all-reduce (sum) over chips
            h = rms_norm(x, lw.post_norm, shape.rms_eps)
            ids, w = route(h, lw.router, shape.n_experts_active)
            used = np.unique(ids)
            touched.append(int(used.size))
            x = x + moe_prefill(h, ids, w, used, st["gue"], st["down"]).sum(axis=0)  # reduce partial sums
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
        out: np.ndarray = last @ self.lm_head
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
        skip: list[bool] = (bound <= F32(SCORE_BOUND)).tolist()
        return skip

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
        idx = cell_index(ctx_cells)
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
            K = cells_of(kcache[:, li], idx)  # (C, kvh, T, D); a view when cells are contiguous
            V = cells_of(vcache[:, li], idx)
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
            e, w = route_one(h, lw.router, k_act)
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
