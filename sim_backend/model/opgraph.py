"""Operator graphs of the prefill and decode sub-models (facts.md F3, report §5–§6).

The graphs are *generated* from :class:`~sim_backend.bundle.shapes.ModelShape`: a
fixed per-layer op sequence repeated ``n_layers`` times, plus a few ops
outside the layers.  For the full 48-layer Qwen3-30B-A3B the counts equal
facts.md F3 exactly (prefill 1496, decode 1398 top-level nodes).

Per layer (both sub-models, 29 ops)::

    input_norm  q_proj kv_proj  q_norm k_norm  rope_q rope_k  k_scatter v_scatter
    attn  o_proj  attn_sync [attn_dyn_d2d]  attn_gather  attn_residual
    post_attn_norm  router  router_sync  router_gather  gate_pre
    expert_gate expert_up  silu  multiply  expert_down  gate_post  expert_reduce
    moe_sync [moe_dyn_d2d]  moe_gather  moe_residual

``[...]`` ops exist only in prefill (2 dynamic D2D per layer -> 31/layer).
Outside the layers: decode 6 ops (embedding, embed_sync, final_norm,
lm_head, logits_gather, logits_sync); prefill adds 2 layout conversions
(8 ops).  So decode = 29·L + 6 and prefill = 31·L + 8.

The report names the categories and counts but not the order nor which
matmul is the fourth per layer: the order above and the Q / KV projection
split (4 quantised matmuls per layer = q_proj, kv_proj, o_proj, router) are
our inference.

Dense Llama family (``ModelShape.family == "llama_dense"``, the pilot): no q/k norms, no
router, one SwiGLU MLP whose gate/up columns and down rows are split over the chips, the same
kinds of sync points (a barrier, then the gather of the partial sums, per block)::

    input_norm  q_proj kv_proj  rope_q rope_k  k_scatter v_scatter  attn  o_proj
    attn_sync [attn_dyn_d2d]  attn_gather  attn_residual
    post_attn_norm  mlp_gate mlp_up  silu  multiply  mlp_down
    mlp_sync [mlp_dyn_d2d]  mlp_gather  mlp_residual

i.e. 21 ops a layer in decode, 23 in prefill; the same ops outside the layers (the embedding on
chip0, a tied LM head reads the embedding table's copy on each chip).

Per-chip profile rule (our inference from facts.md F3): the per-chip ``.profparts``
files have 1254/1253 (decode) and 1352/1351 (prefill) rows, i.e. every graph
node minus 144 (= 3 per layer) on both chips, minus the embedding on chip1.
We take the 3 per-layer ``sync_d2d`` nodes to be data-less barriers executed
by the CCU between the two chiplets' command streams: both chips stall on
them (they are on both chips' timelines), but neither chiplet executes a
command for them, so they have no profile row.  The data they guard is moved
by chiplet commands that *are* profiled (the gathers in decode, the dynamic
D2D moves in prefill).  The 2 graph-boundary syncs (embedding broadcast,
logits hand-off to the host buffer) move data with each chip's own DMA, so
each chip has a row for them.  ``Op.profile_chips`` records the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from sim_backend.bundle.shapes import LLAMA_DENSE, QWEN3_MOE, ModelShape

Kind = Literal["prefill", "decode"]

#: Stable snake_case category ids, in facts.md F3 table order.
CATEGORIES: tuple[str, ...] = (
    "fused_rmsnorm",
    "quant_matmul",
    "sync_d2d",
    "gather",
    "moe_dense_group",
    "kv_scatter",
    "fused_rope",
    "add_residual",
    "dynamic_d2d",
    "silu",
    "multiply",
    "reduce",
    "gate_pre",
    "gate_post",
    "flash_attention",
    "embedding",
    "layout_conversion",
)


@dataclass(frozen=True)
class Op:
    """One top-level node of a sub-model graph.

    Attributes:
        index: position in ``OpGraph.ops`` (execution order).
        name: e.g. ``"L12.attn.q_matmul"``; ops outside layers start with ``"G."``.
        category: one of :data:`CATEGORIES` (facts.md F3).
        layer: 0..n_layers-1, or -1 for ops outside the layers.
        chips: chips whose timeline the op occupies (chips run in parallel).
        role: what it computes, used by the cost model to price it.
        profile_chips: chips whose profile has a row for it (see module docstring).
    """

    index: int
    name: str
    category: str
    layer: int
    chips: tuple[int, ...]
    role: str
    profile_chips: tuple[int, ...] = field(default=())


# (block, short name, category, role, prefill_only, profiled)
_LAYER_OPS: tuple[tuple[str, str, str, str, bool, bool], ...] = (
    ("attn", "input_norm", "fused_rmsnorm", "input_norm", False, True),
    ("attn", "q_matmul", "quant_matmul", "q_proj", False, True),
    ("attn", "kv_matmul", "quant_matmul", "kv_proj", False, True),
    ("attn", "q_norm", "fused_rmsnorm", "q_norm", False, True),
    ("attn", "k_norm", "fused_rmsnorm", "k_norm", False, True),
    ("attn", "rope_q", "fused_rope", "rope_q", False, True),
    ("attn", "rope_k", "fused_rope", "rope_k", False, True),
    ("attn", "k_scatter", "kv_scatter", "k_scatter", False, True),
    ("attn", "v_scatter", "kv_scatter", "v_scatter", False, True),
    ("attn", "flash_attn", "flash_attention", "attn", False, True),
    ("attn", "o_matmul", "quant_matmul", "o_proj", False, True),
    ("attn", "sync", "sync_d2d", "attn_sync", False, False),
    ("attn", "dyn_d2d", "dynamic_d2d", "attn_dyn_d2d", True, True),
    ("attn", "gather", "gather", "attn_gather", False, True),
    ("attn", "residual", "add_residual", "attn_residual", False, True),
    ("moe", "post_attn_norm", "fused_rmsnorm", "post_attn_norm", False, True),
    ("moe", "router", "quant_matmul", "router", False, True),
    ("moe", "router_sync", "sync_d2d", "router_sync", False, False),
    ("moe", "router_gather", "gather", "router_gather", False, True),
    ("moe", "gate_pre", "gate_pre", "gate_pre", False, True),
    ("moe", "expert_gate", "moe_dense_group", "expert_gate", False, True),
    ("moe", "expert_up", "moe_dense_group", "expert_up", False, True),
    ("moe", "silu", "silu", "silu", False, True),
    ("moe", "multiply", "multiply", "multiply", False, True),
    ("moe", "expert_down", "moe_dense_group", "expert_down", False, True),
    ("moe", "gate_post", "gate_post", "gate_post", False, True),
    ("moe", "expert_reduce", "reduce", "expert_reduce", False, True),
    ("moe", "sync", "sync_d2d", "moe_sync", False, False),
    ("moe", "dyn_d2d", "dynamic_d2d", "moe_dyn_d2d", True, True),
    ("moe", "gather", "gather", "moe_gather", False, True),
    ("moe", "residual", "add_residual", "moe_residual", False, True),
)

# The dense Llama family's layer (same tuple layout as _LAYER_OPS)
_DENSE_LAYER_OPS: tuple[tuple[str, str, str, str, bool, bool], ...] = (
    ("attn", "input_norm", "fused_rmsnorm", "input_norm", False, True),
    ("attn", "q_matmul", "quant_matmul", "q_proj", False, True),
    ("attn", "kv_matmul", "quant_matmul", "kv_proj", False, True),
    ("attn", "rope_q", "fused_rope", "rope_q", False, True),
    ("attn", "rope_k", "fused_rope", "rope_k", False, True),
    ("attn", "k_scatter", "kv_scatter", "k_scatter", False, True),
    ("attn", "v_scatter", "kv_scatter", "v_scatter", False, True),
    ("attn", "flash_attn", "flash_attention", "attn", False, True),
    ("attn", "o_matmul", "quant_matmul", "o_proj", False, True),
    ("attn", "sync", "sync_d2d", "attn_sync", False, False),
    ("attn", "dyn_d2d", "dynamic_d2d", "attn_dyn_d2d", True, True),
    ("attn", "gather", "gather", "attn_gather", False, True),
    ("attn", "residual", "add_residual", "attn_residual", False, True),
    ("mlp", "post_attn_norm", "fused_rmsnorm", "post_attn_norm", False, True),
    ("mlp", "gate_matmul", "quant_matmul", "mlp_gate", False, True),
    ("mlp", "up_matmul", "quant_matmul", "mlp_up", False, True),
    ("mlp", "silu", "silu", "silu", False, True),
    ("mlp", "multiply", "multiply", "multiply", False, True),
    ("mlp", "down_matmul", "quant_matmul", "mlp_down", False, True),
    ("mlp", "sync", "sync_d2d", "mlp_sync", False, False),
    ("mlp", "dyn_d2d", "dynamic_d2d", "mlp_dyn_d2d", True, True),
    ("mlp", "gather", "gather", "mlp_gather", False, True),
    ("mlp", "residual", "add_residual", "mlp_residual", False, True),
)


def layer_ops(family: str) -> tuple[tuple[str, str, str, str, bool, bool], ...]:
    """The per-layer op table of a model family (``qwen3_moe`` or ``llama_dense``); ValueError otherwise."""
    if family == QWEN3_MOE:
        return _LAYER_OPS
    if family == LLAMA_DENSE:
        return _DENSE_LAYER_OPS
    raise ValueError(f"unknown model family {family!r}")


# Ops outside the layers: (name, category, role, prefill_only, chip0_only)
_PRE_OPS: tuple[tuple[str, str, str, bool, bool], ...] = (
    ("embedding", "embedding", "embedding", False, True),
    ("embed_sync", "sync_d2d", "embed_sync", False, False),
    ("layout_in", "layout_conversion", "layout_in", True, False),
)
_POST_OPS: tuple[tuple[str, str, str, bool, bool], ...] = (
    ("layout_out", "layout_conversion", "layout_out", True, False),
    ("final_norm", "fused_rmsnorm", "final_norm", False, False),
    ("lm_head", "quant_matmul", "lm_head", False, False),
    ("logits_gather", "gather", "logits_gather", False, False),
    ("logits_sync", "sync_d2d", "logits_sync", False, False),
)


@dataclass(frozen=True)
class OpGraph:
    """A generated sub-model graph.

    Attributes:
        shape: the model it was generated from.
        kind: ``"prefill"`` or ``"decode"``.
        ops: ops in execution order (``ops[i].index == i``).
    """

    shape: ModelShape
    kind: str
    ops: tuple[Op, ...]

    def count(self) -> int:
        """Top-level node count (facts.md F3 'total': 1496 prefill / 1398 decode at 48 layers)."""
        return len(self.ops)

    def counts_by_category(self) -> dict[str, int]:
        """Nodes per category id, every id of :data:`CATEGORIES` present (0 if absent)."""
        out = {c: 0 for c in CATEGORIES}
        for op in self.ops:
            out[op.category] += 1
        return out

    def per_chip_profile_count(self) -> list[int]:
        """Profile rows per chip (facts.md F3: decode 1254/1253, prefill 1352/1351)."""
        out = [0] * self.shape.n_chips
        for op in self.ops:
            for c in op.profile_chips:
                out[c] += 1
        return out

    def ops_on_chip(self, chip: int) -> list[Op]:
        """Ops with a profile row on ``chip`` (what a per-chip trace track shows)."""
        return [op for op in self.ops if chip in op.profile_chips]


def per_layer_op_count(kind: Kind, family: str = QWEN3_MOE) -> int:
    """Ops per layer: 29 decode, 31 prefill (Qwen3-MoE); 21 / 23 (dense Llama)."""
    return sum(1 for e in layer_ops(family) if kind == "prefill" or not e[4])


def global_op_count(kind: Kind) -> int:
    """Ops outside the layers: 6 decode, 8 prefill."""
    return sum(1 for e in _PRE_OPS + _POST_OPS if kind == "prefill" or not e[3])


@lru_cache(maxsize=64)
def build_graph(shape: ModelShape, kind: Kind) -> OpGraph:
    """Generate the ``kind`` sub-model graph for ``shape`` (cached per (shape, kind)).

    Returns an :class:`OpGraph` whose counts are facts.md F3 for the 48-layer
    model: ``29·L + 6`` (decode) or ``31·L + 8`` (prefill) nodes; the dense family
    ``21·L + 6`` / ``23·L + 8`` (the pilot's 30 layers: 636 / 698).
    """
    if kind not in ("prefill", "decode"):
        raise ValueError(f"kind must be 'prefill' or 'decode', not {kind!r}")
    prefill = kind == "prefill"
    all_chips = tuple(range(shape.n_chips))
    ops: list[Op] = []

    def add(name: str, category: str, layer: int, chips: tuple[int, ...], role: str,
            profiled: bool) -> None:
        ops.append(Op(len(ops), name, category, layer, chips, role,
                      chips if profiled else ()))

    for name, cat, role, pf_only, chip0_only in _PRE_OPS:
        if pf_only and not prefill:
            continue
        add(f"G.{name}", cat, -1, (0,) if chip0_only else all_chips, role, True)
    table = layer_ops(shape.family)
    for layer in range(shape.n_layers):
        for block, name, cat, role, pf_only, profiled in table:
            if pf_only and not prefill:
                continue
            add(f"L{layer}.{block}.{name}", cat, layer, all_chips, role, profiled)
    for name, cat, role, pf_only, chip0_only in _POST_OPS:
        if pf_only and not prefill:
            continue
        add(f"G.{name}", cat, -1, (0,) if chip0_only else all_chips, role, True)
    return OpGraph(shape=shape, kind=kind, ops=tuple(ops))
