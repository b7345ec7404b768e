"""Attention's DMA mechanisms, family-neutral: decode flash attention and a prefill's data-moving table.

Both op families price decode attention with :func:`flash_decode` (the MoE family in
:mod:`sim_backend.model.families.moe_cost`, the dense one in
:mod:`sim_backend.model.families.dense_cost`); only the shape's heads, head dim and chip count
enter.  Times are SIMULATED µs, sizes bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.hwspec import HardwareSpec, sram_workspace_bytes


@dataclass(frozen=True)
class FlashDecode:
    """One decode flash-attention op on one chip (:func:`flash_decode`); times are simulated µs.

    Attributes:
        us: the op's time without its issue overhead (stream + merge).
        stream_us: the KV blocks' time on the critical partition (max of the shared-DRAM time and
            the per-core chain of DMA latency, transfer and vector work).
        merge_us: the tree merge of the partitions.
        block_rows: KV rows (positions) per block of one head's K or V.
        blocks_per_head: ``ceil(ctx / block_rows)``.
        partitions_per_head: partitions each KV head's blocks are spread over.
        block_steps: blocks (K and V pairs) the critical partition streams in sequence.
        merge_levels: ``ceil(log2(partitions_per_head))``.
        double_buffered: the partitions' next K and V blocks fit the SRAM workspace beside the
            current ones, so each block's DMA latency is hidden behind the previous block.
        kv_bytes: K and V bytes the op reads on this chip.
    """

    us: float
    stream_us: float
    merge_us: float
    block_rows: int
    blocks_per_head: int
    partitions_per_head: int
    block_steps: int
    merge_levels: int
    double_buffered: bool
    kv_bytes: float


def flash_decode(hw: HardwareSpec, shape: ModelShape, ctx: int, *, k_bytes: float | None = None,
                 v_bytes: float | None = None) -> FlashDecode:
    """Flash decoding of ONE query token over ``ctx`` KV positions on one chip (one layer).

    Mechanism (every parameter in the hardware YAML with its range and reason):

    * each of the chip's KV heads (``n_kv_heads / n_chips``) is cut into blocks of
      ``kv_block_kib`` of K (and as many rows of V); the blocks are spread over
      ``attn_cores // heads`` partitions per head (at most one block each);
    * a partition streams its blocks in sequence; a block costs
      ``max(DMA of its K+V, vector work of its QK + softmax + PV)``.  The DRAM is shared: all
      partitions' bytes move at ``dram_bw * weight_stream_eff`` (KV blocks are sequential reads
      like the weights); the vector work of a block (``group x rows x (4 x head_dim +
      softmax_flops_per_score)`` flops, group = query heads per KV head) runs on one core at
      ``attn_vector_tflops / attn_cores``;
    * the DMA latency ``kv_dma_latency_us`` of each block is hidden (double buffering) only when
      every partition's next K and V blocks fit in the SRAM workspace beside the current ones
      (``2 x 2 x block x partitions <= workspace``, facts.md F4); else each block pays it;
    * the partitions of a head are merged in a tree: ``ceil(log2(partitions))`` levels of
      ``attn_merge_level_us`` (they run in parallel, so the merge does not grow linearly).

    Family-neutral: only the shape's heads (the busiest chip's KV heads), head dim and chip count
    enter; the dense pilot's attention uses it as the MoE family's does.  ``k_bytes`` /
    ``v_bytes``: bytes per K / V element (default the YAML's ``kv_bytes``; an S8 V-cache gives 1).
    Raises ValueError for ``ctx < 1``.
    """
    if ctx < 1:
        raise ValueError(f"ctx must be >= 1, got {ctx}")
    hwf, f, q = hw.hardware, hw.fitted, hw.quantisation
    kb = float(q["kv_bytes"] if k_bytes is None else k_bytes)
    vb = float(q["kv_bytes"] if v_bytes is None else v_bytes)
    d = shape.head_dim
    heads = max(1, shape.kv_heads_per_chip)                  # the busiest chip's KV heads (uneven splits: chip0)
    group = max(1, shape.n_q_heads // shape.n_kv_heads)
    rows = max(1, int(f["kv_block_kib"]) * 1024 // int(d * kb))
    nb = math.ceil(ctx / rows)
    cores = int(f["attn_cores"])
    p = max(1, min(nb, cores // heads))
    steps = math.ceil(nb / p)
    r = ctx / p                                               # rows of the critical partition (balanced split)
    kv_bw = hwf["dram_bw_gbps"] * 1e3 * f["weight_stream_eff"]          # bytes per µs
    block_kv = rows * d * (kb + vb)                           # one K block + its V block
    db = 2.0 * block_kv * heads * p <= sram_workspace_bytes(hw)
    xfer = r * d * (kb + vb) / kv_bw                          # the partition's K+V alone at the shared rate
    vec_rate = f["attn_vector_tflops"] * 1e6 / cores  # flops per µs of one core
    vec = r * group * (4.0 * d + f["softmax_flops_per_score"]) / vec_rate
    lat = f["kv_dma_latency_us"]
    chain = lat + max(xfer, vec) if db else steps * lat + xfer + vec
    shared = heads * p * xfer                                 # every partition's bytes through the one DRAM
    stream = max(shared, chain)
    levels = math.ceil(math.log2(p)) if p > 1 else 0
    merge = levels * f["attn_merge_level_us"]
    return FlashDecode(us=stream + merge, stream_us=stream, merge_us=merge, block_rows=rows, blocks_per_head=nb,
                       partitions_per_head=p, block_steps=steps, merge_levels=levels, double_buffered=db,
                       kv_bytes=ctx * heads * d * (kb + vb))


#: the data-moving table's block classes (facts.md F3: 64 / 32 / 1 KiB), bytes
DATA_MOVING_BLOCKS = (64 * 1024, 32 * 1024, 1024)


def data_moving_table(hw: HardwareSpec, shape: ModelShape, n_tokens: int | None = None) -> list[dict[str, Any]]:
    """The explicit DMA moves (data-moving entries) of a prefill of ``n_tokens`` per chip, derived from the
    mechanisms the cost model prices; default ``n_tokens`` = the calbin context (the static
    upper-bound graph of facts.md F3).

    Per chip: ``{"chip", "entries", "bytes", "gib", "blocks": {block_bytes: count}, "moves": [...]}``
    where each move is ``{"what", "tensors", "bytes", "block", "entries"}`` (block 0: one entry per tensor):

    * the prefill's dynamic D2D (``2 x n_layers`` ops, facts.md F3): every token's hidden state
      (``n x hidden x activation_bytes``) per op, cut into 64 KiB link descriptors;
    * the KV scatter (K and V of the chip's heads, ``2 x n_layers`` ops) and flash attention's KV
      read (``n_layers`` ops, each KV block read once: the compiled loop re-uses a descriptor), in
      ``kv_block_kib`` blocks;
    * chip0 only: the embedding gather (``n x hidden x embedding_bytes_per_weight``, one entry) and
      the token ids (``n x token_input_bytes``, one entry).

    Not derived (no mechanism of ours produces it): the table's 1 KiB class (75,968 entries,
    0.07 GiB per chip).  Weights and activations streamed by the compute ops are their operands,
    not data-moving entries, and are not in this table.
    """
    q, f = hw.quantisation, hw.fitted
    n = shape.n_ctx if n_tokens is None else int(n_tokens)
    if n < 1:
        raise ValueError(f"n_tokens must be >= 1, got {n}")
    L, H, a = shape.n_layers, shape.hidden, q["activation_bytes"]
    heads = shape.n_kv_heads // shape.n_chips
    kv_block = int(f["kv_block_kib"]) * 1024
    per_tensor = n * shape.head_dim * q["kv_bytes"]            # one head's K (or V) for n positions

    def move(what: str, tensors: int, nbytes_each: float, block: int,
             entries_each: int | None = None) -> dict[str, Any]:
        e = tensors * (math.ceil(nbytes_each / block) if entries_each is None else entries_each)
        return {"what": what, "tensors": tensors, "bytes": float(tensors * nbytes_each), "block": block,
                "entries": int(e)}

    out = []
    for chip in range(shape.n_chips):
        moves = [move("dynamic D2D (hidden states)", 2 * L, n * H * a, 64 * 1024),
                 move("KV scatter (K and V)", 2 * L * heads, per_tensor, kv_block),
                 move("flash attention KV read", 2 * L * heads, per_tensor, kv_block)]
        if chip == 0:
            moves += [move("embedding gather", 1, n * H * q["embedding_bytes_per_weight"], 0, 1),
                      move("token ids", 1, n * q["token_input_bytes"], 0, 1)]
        blocks: dict[int, int] = {}
        for m in moves:
            if m["block"]:
                blocks[m["block"]] = blocks.get(m["block"], 0) + m["entries"]
        nbytes = sum(m["bytes"] for m in moves)
        out.append({"chip": chip, "entries": sum(m["entries"] for m in moves), "bytes": nbytes,
                    "gib": nbytes / 2**30, "blocks": blocks, "moves": moves})
    return out
