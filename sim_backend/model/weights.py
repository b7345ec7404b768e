"""The synthetic Qwen3-MoE weights at reduced width (``NumericShape``), drawn from the manifest's seed.

Deterministic: the same (shape, numeric shape) gives the same float32 arrays, so routing, KV writes
and logits are computed, not invented (the text is not meaningful).  Unsharded; the chips' shards
(:class:`~sim_backend.model.numerics.ChipShard`) slice them as facts.md F3 shards the real model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

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
