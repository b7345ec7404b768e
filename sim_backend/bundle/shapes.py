"""Model shapes: the full Qwen3-30B-A3B (priced by the cost model) and the
reduced width the numerics run at.

Both come from the calbin manifest (``sim_backend/bundles/*/calbin.yaml``);
the defaults here are facts.md F2 so headless code and tests can build them
without a bundle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    """Architecture of Qwen3-30B-A3B at full size (facts.md F2).

    All sizes are element counts; ``n_ctx`` is tokens (calbin context, 40960,
    not the tokenizer's 131072). ``n_chips`` is the number of chiplets the
    graph is tensor-parallel over (facts.md F1/F3).
    """

    n_layers: int = 48
    hidden: int = 2048
    n_q_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int = 128
    n_experts: int = 128
    n_experts_active: int = 8
    expert_ffn: int = 768
    vocab: int = 151936
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    n_ctx: int = 40960
    max_batch: int = 1
    n_chips: int = 2

    @property
    def q_heads_per_chip(self) -> int:
        return self.n_q_heads // self.n_chips

    @property
    def kv_heads_per_chip(self) -> int:
        return self.n_kv_heads // self.n_chips

    @property
    def kv_bytes_per_token_per_chip(self) -> int:
        """BF16 K+V bytes one token occupies on one chip: layers x kv_heads/chip x 2 x head_dim x 2 B.

        48 x 2 x 2 x 128 x 2 = 49,152 B; x 40960 tokens = 1.875 GiB per chip (facts.md F4).
        """
        return self.n_layers * self.kv_heads_per_chip * 2 * self.head_dim * 2

    @property
    def logits_bytes_per_token(self) -> int:
        """BF16 logits D2H per token: vocab x 2 B = 303,872 B (facts.md F1/F4)."""
        return self.vocab * 2

    def with_layers(self, n_layers: int) -> ModelShape:
        return replace(self, n_layers=n_layers)


@dataclass(frozen=True)
class NumericShape:
    """Reduced widths the in-process numerics run at (stated in the manifest).

    Keeps the full layer count, head counts (32 Q : 4 KV), expert count
    (128, top-8) and vocabulary (151936); shrinks hidden, head_dim and the
    expert intermediate so one decode step runs in milliseconds on a CPU.
    """

    hidden: int = 64
    head_dim: int = 16
    expert_ffn: int = 16
    seed: int = 1234
