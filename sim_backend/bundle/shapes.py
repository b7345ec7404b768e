"""Model shapes: the full model (priced by the cost model) and the width the numerics run at.

Both come from the calbin manifest (``sim_backend/bundles/*/calbin.yaml``);
the defaults here are Qwen3-30B-A3B's (facts.md F2) so headless code and tests can build them
without a bundle. ``ModelShape.family`` names the model family (``qwen3_moe`` or
``llama_dense``): the op graph, cost model, memory plan and numerics are derived from it and the
sizes, never from Qwen constants for another family.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

#: Model families the simulator runs (``ModelShape.family``).
QWEN3_MOE = "qwen3_moe"
LLAMA_DENSE = "llama_dense"
FAMILIES = (QWEN3_MOE, LLAMA_DENSE)

#: The logits dtypes a calbin may return over D2H, with their bytes per logit. ``bf16`` is what the
#: production calbin returns (facts.md F1); ``f32`` only a C3 variant declares (a calbin the vendor
#: would have to compile: the dense pilot, whose greedy ties BF16 rounding would break).
LOGITS_DTYPE_BYTES = {"bf16": 2, "f32": 4}


def split_over_chips(n: int, n_chips: int) -> tuple[int, ...]:
    """Tensor-parallel shares of ``n`` units (heads, columns) over ``n_chips``: as even as possible,
    the first chips taking one more when ``n`` does not divide (3 KV heads over 2 chips -> (2, 1)).
    Raises ValueError when a chip would get none."""
    if n_chips < 1 or n < n_chips:
        raise ValueError(f"cannot split {n} over {n_chips} chips (every chip needs at least one)")
    base, extra = divmod(n, n_chips)
    return tuple(base + (1 if c < extra else 0) for c in range(n_chips))


@dataclass(frozen=True)
class ModelShape:
    """Architecture of the model at full size; the defaults are Qwen3-30B-A3B (facts.md F2).

    All sizes are element counts; ``n_ctx`` is tokens (calbin context, 40960,
    not the tokenizer's 131072). ``n_chips`` is the number of chiplets the
    graph is tensor-parallel over (facts.md F1/F3).

    ``family``: ``qwen3_moe`` (the expert fields apply, ``ffn`` is 0) or ``llama_dense``
    (one SwiGLU MLP of ``ffn`` columns per layer, no experts: ``n_experts``,
    ``n_experts_active`` and ``expert_ffn`` are 0; ``tied_embeddings`` when the LM head is
    the embedding table). Heads split over the chips by KV group (:meth:`kv_heads_split`):
    unevenly when the KV heads do not divide (the pilot's 3 over 2 chips: 2 and 1).
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
    family: str = QWEN3_MOE
    ffn: int = 0
    tied_embeddings: bool = False
    #: dense family only: bytes per weight the bundle's matrices and its embedding (tied LM head) are
    #: priced at (the weight file's own formats); 0 for Qwen3-MoE, whose per-role figures are the
    #: hardware YAML's ``quantisation``
    proj_bytes_per_weight: float = 0.0
    embed_bytes_per_weight: float = 0.0
    #: dtype of the logits the calbin returns (a key of ``LOGITS_DTYPE_BYTES``): the manifest's
    #: ``outputs: logits`` dtype; ``bf16`` for the production calbin, ``f32`` only in a C3 variant
    logits_dtype: str = "bf16"

    def __post_init__(self) -> None:
        if self.logits_dtype not in LOGITS_DTYPE_BYTES:
            raise ValueError(f"logits_dtype must be one of {', '.join(LOGITS_DTYPE_BYTES)}, got {self.logits_dtype!r}")

    @property
    def is_moe(self) -> bool:
        """True for the Qwen3-MoE family (router and experts in every layer)."""
        return self.family == QWEN3_MOE

    def kv_heads_split(self) -> tuple[int, ...]:
        """KV heads held by each chip (Qwen3: (2, 2); 3 KV heads: (2, 1))."""
        return split_over_chips(self.n_kv_heads, self.n_chips)

    def q_heads_split(self) -> tuple[int, ...]:
        """Q heads held by each chip: each chip's KV heads times the GQA group (3 KV of 9 Q: (6, 3))."""
        group = self.n_q_heads // self.n_kv_heads
        return tuple(k * group for k in self.kv_heads_split())

    @property
    def q_heads_per_chip(self) -> int:
        """Q heads of the busiest chip (chip0; all chips when the heads divide evenly)."""
        return max(self.q_heads_split())

    @property
    def kv_heads_per_chip(self) -> int:
        """KV heads of the busiest chip (chip0); the KV plan reserves this much on every chip."""
        return max(self.kv_heads_split())

    @property
    def kv_bytes_per_token_per_chip(self) -> int:
        """BF16 K+V bytes one token occupies on one chip: layers x kv_heads/chip x 2 x head_dim x 2 B.

        48 x 2 x 2 x 128 x 2 = 49,152 B; x 40960 tokens = 1.875 GiB per chip (facts.md F4).
        """
        return self.n_layers * self.kv_heads_per_chip * 2 * self.head_dim * 2

    @property
    def logits_itemsize(self) -> int:
        """Bytes of one logit as the calbin returns it (``logits_dtype``: BF16 2, F32 4)."""
        return LOGITS_DTYPE_BYTES[self.logits_dtype]

    @property
    def logits_bytes_per_token(self) -> int:
        """Logits D2H per token: vocab x the bytes of ``logits_dtype``. BF16: 151936 x 2 B = 303,872 B
        (facts.md F1/F4); the pilot's F32 (a C3 variant): 49,152 x 4 B = 196,608 B."""
        return self.vocab * self.logits_itemsize

    def with_layers(self, n_layers: int) -> ModelShape:
        return replace(self, n_layers=n_layers)


@dataclass(frozen=True)
class NumericShape:
    """Reduced widths the in-process numerics run at (stated in the manifest).

    Keeps the full layer count, head counts (32 Q : 4 KV), expert count
    (128, top-8) and vocabulary (151936); shrinks hidden, head_dim and the
    expert intermediate so one decode step runs in milliseconds on a CPU.
    A ``llama_dense`` bundle with real weights runs at full width (``hidden`` and ``head_dim``
    are the model's, ``expert_ffn`` 0) from ``weights_file`` (a GGUF, ``weights == "gguf"``).
    """

    hidden: int = 64
    head_dim: int = 16
    expert_ffn: int = 16
    seed: int = 1234
    #: "synthetic" (drawn from ``seed``) or "gguf" (real weights read from ``weights_file``)
    weights: str = "synthetic"
    weights_file: str = ""
