"""Batched decode pricing and the roadmap's cost-model switches (what-if variants, status-coded).

Every time here is **simulated device time in microseconds**; nothing measures the host.

The production calbin decodes batch 1 (facts.md F1). A batch-N decode calbin does not exist
(status ``C3``: the vendor would have to compile it, facts.md "What-if is labelled"); this
module prices one from first principles by composing the per-role pieces of
:class:`~sim_backend.model.costmodel.CostModel` (``_role_costs``: the same roofline,
the same fitted efficiencies) and re-pricing only the roles that batching changes:

- dense weights (attention projections, router, LM head) are read ONCE per step;
  their compute and activations scale with N (GEMV rows = N, no tile padding);
- expert weights are read once per DISTINCT expert the batch's tokens touch in a layer
  (``experts_touched`` = the union over the N tokens), expert compute = N·k rows;
- flash attention reads each sequence's KV at its OWN context (``past_lens[i] + 1``) with
  CostModel's flash decoding (``attention_cost.flash_decode``); the sequences run one after the
  other on the cores (``ramp="sum"``, the default, pessimistic) or share them (``ramp="max"``,
  optimistic: all KV at the shared DRAM rate, the longest sequence's chain and merge once);
- final norm, LM head rows, the logits gather and the D2H are per sequence
  (N x 303,872 B BF16 logits, facts.md F1/F4, in one transfer set-up); H2D carries N token
  ids, N positions and N CSR pairs.

Switches (:class:`Variant`), each a what-if with its status code:

- ``s8_v_cache`` (C1, facts.md F5 "S8 V-cache"): V stored as int8: the attention KV read and
  the V scatter use 1 byte per V element; KV capacity in tokens grows by
  ``2 * 2 / (2 + 1)`` = 4/3 (:func:`kv_capacity_tokens`).
- ``on_device_topk`` (C2, facts.md F8 "full logits vs on-device top-k"): each chip scans its
  vocabulary shard for the top ``topk_k`` (priced as a vector read of its logits + one op
  overhead, folded into the ``logits_gather`` op so the graph keeps the F3 op counts), the
  gather moves k candidates (BF16 value + int32 id) per sequence, and the D2H carries
  ``N * k * 6`` bytes instead of ``N * 303,872``. The CPU sampling over k candidates is
  host work, measured by the engine, not priced here.
- async overlap (C1, facts.md F5 ping/pong) is not a device-time switch: it is the engine's
  ``max_inflight=2``; ``Variant.overlap`` only carries the flag and its label.

Batch 1 with no switch equals ``CostModel.price_step(shape, "decode", 1, past)`` (same
roofline terms; test_batching checks it to a relative 1e-9).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.attention_cost import flash_decode
from sim_backend.model.costmodel import CostModel
from sim_backend.model.families.moe_cost import expected_experts_touched
from sim_backend.model.hwspec import sram_workspace_bytes
from sim_backend.model.stepcost import StepCost, assemble_step

#: Decode batch sizes a variant calbin may declare (the ones the report's roadmap asks the vendor for, facts.md F10).
BATCH_SIZES = (1, 4, 8, 16)
#: Report status codes (facts.md "What-if is labelled"; facts.md F5).
STATUS_TEXT = {"C0": "today's calbin", "C1": "in the SDK, unused", "C2": "buildable by us",
               "C3": "needs a vendor-compiled calbin"}
#: Bytes per candidate of on-device top-k: BF16 value + int32 token id.
TOPK_CANDIDATE_BYTES = 6


@dataclass(frozen=True)
class Variant:
    """Cost-model switches of one roadmap stage (all off = today's pricing).

    Attributes:
        s8_v_cache: V cache in int8 (1 B per element) instead of BF16.
        on_device_topk: top-k on the device; D2H of ``topk_k`` candidates per sequence.
        topk_k: candidates per sequence (1..vocab); 40 (llama.cpp's default top_k).
        overlap: async ping/pong overlap (an engine setting; recorded here for the label).
    """

    s8_v_cache: bool = False
    on_device_topk: bool = False
    topk_k: int = 40
    overlap: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.topk_k, bool) or not isinstance(self.topk_k, int) or self.topk_k < 1:
            raise ValueError(f"topk_k must be an int >= 1, got {self.topk_k!r}")

    @property
    def is_default(self) -> bool:
        """No device-time switch on (overlap does not change device time)."""
        return not (self.s8_v_cache or self.on_device_topk)

    def status(self, decode_batch: int = 1) -> str:
        """The report status code of this variant on a bundle of ``decode_batch``.

        C3 if the decode calbin is batched, else C2 with on-device top-k (a graph we would
        rebuild), else C1 with S8 V-cache or overlap (SDK features unused), else C0.
        """
        if decode_batch > 1:
            return "C3"
        if self.on_device_topk:
            return "C2"
        if self.s8_v_cache or self.overlap:
            return "C1"
        return "C0"


def kv_capacity_tokens(base_tokens: int, variant: Variant) -> int:
    """KV capacity in tokens with ``variant`` for a pool sized ``base_tokens`` at BF16 K and V.

    S8 V-cache: K 2 B + V 1 B per element instead of 2 + 2, so the same bytes hold 4/3 as many tokens.
    """
    return int(base_tokens * 4 // 3) if variant.s8_v_cache else int(base_tokens)


def expected_union_touched(n_seqs: int, shape: ModelShape, per_seq: Sequence[Sequence[int]] | None = None
                           ) -> np.ndarray:
    """Distinct experts per layer that ``n_seqs`` decode tokens touch, float64 ``(n_layers,)``.

    Without per-sequence counts: the expectation ``E·(1-((E-k)/E)^N)`` for N independent
    top-k choices (:func:`expected_experts_touched`). With per-sequence counts (the
    numerics report distinct counts per layer, not expert ids), the same expectation
    clamped per layer to ``[max_i count_i, min(E, sum_i count_i)]``, the only bounds the
    counts give.
    """
    E, k = shape.n_experts, shape.n_experts_active
    exp = np.full(shape.n_layers, expected_experts_touched(n_seqs, E, k))
    if per_seq is None:
        return exp
    c = np.asarray(per_seq, dtype=np.float64)
    if c.shape != (n_seqs, shape.n_layers):
        raise ValueError(f"per_seq must be ({n_seqs}, {shape.n_layers}), got {c.shape}")
    touched: np.ndarray = np.clip(exp, c.max(axis=0), np.minimum(float(E), c.sum(axis=0)))
    return touched


class BatchedCostModel:
    """A :class:`CostModel` plus batched decode and the :class:`Variant` switches.

    ``price_step`` has CostModel's signature (the board calls it for every batch-1 step):
    with no switch on it IS ``CostModel.price_step``; otherwise the switched roles are
    re-priced. ``price_decode_batch`` prices one batched decode step.

    Args:
        base: the calibrated cost model (default: the shipped one is the caller's choice).
        variant: switches applied to every step priced through this object.
        ramp: "sum" (default) or "max": how the flash decoding of N sequences combines.
    """

    def __init__(self, base: CostModel, variant: Variant | None = None, *, ramp: str = "sum") -> None:
        if ramp not in ("sum", "max"):
            raise ValueError(f"ramp must be 'sum' or 'max', got {ramp!r}")
        self.base = base
        self.variant = variant or Variant()
        self.ramp = ramp
        self.hw = base.hw

    @property
    def host_overhead_ms_per_token(self) -> float:
        return self.base.host_overhead_ms_per_token

    def graph(self, shape: ModelShape, kind: str) -> Any:
        return self.base.graph(shape, kind)

    def with_fitted(self, **overrides: float) -> BatchedCostModel:
        """Same switches over a base model with some fitted parameters replaced (ranges)."""
        return BatchedCostModel(self.base.with_fitted(**overrides), self.variant, ramp=self.ramp)

    # ------------------------------------------------------------------ batch 1 (board path)
    def price_step(self, shape: ModelShape, kind: str, n_tokens: int, past_len: int,
                   experts_touched: Sequence[int] | None = None,
                   chip_scale: Sequence[float] | None = None) -> StepCost:
        """``CostModel.price_step`` with this object's switches (simulated µs); same errors."""
        if self.variant.is_default:
            return self.base.price_step(shape, kind, n_tokens, past_len, experts_touched, chip_scale)
        if kind == "decode":
            return self.price_decode_batch(shape, [past_len], experts_touched, chip_scale)
        ref = self.base.price_step(shape, kind, n_tokens, past_len, experts_touched, chip_scale)  # validates
        touched = (np.full(shape.n_layers, expected_experts_touched(n_tokens, shape.n_experts,
                                                                    shape.n_experts_active))
                   if experts_touched is None else np.asarray(experts_touched, dtype=np.float64))
        t, dram = self.base._role_costs(shape, kind, n_tokens, past_len, touched)
        ctx = past_len + n_tokens
        self._switch_attn(t, dram, shape, kind, n_tokens, [ctx], [past_len + (n_tokens + 1) / 2.0])
        self._switch_v_scatter(t, shape, n_tokens)
        self._switch_logits(t, dram, shape, 1)
        return self._assemble(shape, kind, n_tokens, past_len, t, dram, ref.chip_scale, n_seqs=1,
                              touched=touched, expected=experts_touched is None)

    # ------------------------------------------------------------------ batched decode
    def price_decode_batch(self, shape: ModelShape, past_lens: Sequence[int],
                           experts_touched: Sequence[float] | None = None,
                           chip_scale: Sequence[float] | None = None) -> StepCost:
        """Simulated cost of one batched decode step: N sequences, one token each.

        Args:
            shape: full-size model (``ModelShape()``).
            past_lens: per sequence, tokens already in its KV (its context before the step); N = len.
            experts_touched: per layer (``n_layers``), distinct experts the batch's N tokens touch
                (the union); each in ``[1, min(E, N·k)]``. None -> :func:`expected_union_touched`.
            chip_scale: per-chip slow factors >= 1 (see ``CostModel.price_step``).

        Returns a :class:`StepCost` with ``kind="decode"``, ``n_tokens=N`` and ``past_len`` the
        longest sequence's; ``dram_bytes`` as CostModel's (chip0), per-layer arrays included.

        Raises:
            ValueError: empty batch, negative or over-long context, bad ``experts_touched``
                or ``chip_scale``.
        """
        N = len(past_lens)
        if N < 1:
            raise ValueError("a batched decode step needs at least one sequence")
        pasts = [int(p) for p in past_lens]
        if min(pasts) < 0 or max(pasts) + 1 > shape.n_ctx:
            raise ValueError(f"every past_len must be in [0, {shape.n_ctx - 1}], got {pasts}")
        L, E, k = shape.n_layers, shape.n_experts, shape.n_experts_active
        if experts_touched is None:
            touched = expected_union_touched(N, shape)
        else:
            touched = np.asarray(experts_touched, dtype=np.float64)
            if touched.shape != (L,):
                raise ValueError(f"experts_touched must have {L} entries, got {touched.shape}")
            hi = min(E, N * k)
            if (touched < 1).any() or (touched > hi).any():
                raise ValueError(f"experts_touched entries must be in [1, {hi}] for {N} decode tokens")
        if chip_scale is None:
            scale = tuple(1.0 for _ in range(shape.n_chips))
        else:
            sc = np.asarray(chip_scale, dtype=np.float64)
            if sc.shape != (shape.n_chips,) or not np.isfinite(sc).all() or (sc < 1).any():
                raise ValueError(f"chip_scale must be {shape.n_chips} finite factors >= 1, got {list(chip_scale)!r}")
            scale = tuple(float(x) for x in sc)

        # the shared roles at N rows: dense weights once, activations/compute x N, experts by the union
        t, dram = self.base._role_costs(shape, "decode", N, 0, touched)
        ctxs = [p + 1 for p in pasts]
        self._switch_attn(t, dram, shape, "decode", N, ctxs, [float(c) for c in ctxs])
        self._switch_v_scatter(t, shape, N)
        self._per_sequence_head(t, dram, shape, N)
        self._switch_logits(t, dram, shape, N)
        return self._assemble(shape, "decode", N, max(pasts), t, dram, scale, n_seqs=N,
                              touched=touched, expected=experts_touched is None)

    # ------------------------------------------------------------------ pieces
    def _consts(self) -> dict[str, float]:
        hw, f = self.hw.hardware, self.hw.fitted
        bw = hw["dram_bw_gbps"] * 1e3  # bytes per µs
        # as CostModel._role_costs: the SRAM activation workspace (facts.md F4) and its bandwidth
        sram_ws = sram_workspace_bytes(self.hw)
        return {"act_bw": bw * f["activation_eff"], "w_bw": bw * f["weight_stream_eff"],
                "sram_ws": sram_ws, "sram_bw": hw["sram_bw_gbps"] * 1e3,
                "attn_c": hw["peak_fp16_tflops"] * 1e6 * f["attn_compute_eff"],
                "int8": hw["peak_int8_tops"] * 1e6 * f["int8_compute_eff"],
                "link": hw["d2d_link_gbps"] * 1e3 * f["d2d_eff"], "lat": hw["d2d_latency_us"],
                "ov": f["per_op_overhead_us"]}

    @staticmethod
    def _act_us(c: dict[str, float], nbytes: float) -> float:
        """µs to move an op's activations: SRAM when they fit the workspace, else DRAM (CostModel's rule)."""
        return nbytes / c["sram_bw"] if nbytes <= c["sram_ws"] else nbytes / c["act_bw"]

    def _kv_elem_bytes(self) -> tuple[float, float]:
        kvb = float(self.hw.quantisation["kv_bytes"])
        return kvb, (1.0 if self.variant.s8_v_cache else kvb)

    def _switch_attn(self, t: dict[str, float], dram: dict[str, float], shape: ModelShape, kind: str, n: int,
                     ctxs: Sequence[int], ctx_eff: Sequence[float]) -> None:
        """Flash attention over sequences at their own contexts, with CostModel's mechanism
        (``attention_cost.flash_decode``: per KV block max(DMA, vector work), DMA latency unless double
        buffered, tree merge of the partitions; an S8 V block is half as many bytes).  The
        sequences' attention runs one after the other on the chip's cores (``ramp="sum"``, the
        default, pessimistic), or, ``ramp="max"``, their partitions share the cores so the step
        costs the longest sequence's merge once and the KV of all at the shared DRAM rate
        (optimistic)."""
        c = self._consts()
        a = self.hw.quantisation["activation_bytes"]
        hq, hkv, d = shape.n_q_heads // shape.n_chips, shape.n_kv_heads // shape.n_chips, shape.head_dim
        kb, vb = self._kv_elem_bytes()
        act_us = self._act_us(c, n * hq * d * a) * 2
        if kind == "prefill":
            rows_per_seq = n / len(ctxs)
            flops = sum(4.0 * rows_per_seq * hq * d * ce for ce in ctx_eff)
            kv_read = sum(cx * hkv * d * (kb + vb) for cx in ctxs)
            t["attn"] = max(flops / c["attn_c"], kv_read / c["w_bw"] + act_us) + c["ov"]
        else:
            fds = [flash_decode(self.hw, shape, cx, k_bytes=kb, v_bytes=vb) for cx in ctxs]
            if self.ramp == "sum":
                body = sum(fd.us for fd in fds)
            else:
                body = max(sum(fd.kv_bytes for fd in fds) / c["w_bw"], max(fd.stream_us for fd in fds)) \
                    + max(fd.merge_us for fd in fds)
            t["attn"] = body + act_us + c["ov"]
        dram["kv"] = sum(cx * hkv * d * (kb + vb) for cx in ctxs) * shape.n_layers

    def _switch_v_scatter(self, t: dict[str, float], shape: ModelShape, n: int) -> None:
        if self.variant.s8_v_cache:
            c = self._consts()
            t["v_scatter"] = self._act_us(c, n * (shape.n_kv_heads // shape.n_chips) * shape.head_dim * 1.0) + c["ov"]

    def _per_sequence_head(self, t: dict[str, float], dram: dict[str, float], shape: ModelShape, N: int) -> None:
        """Final norm, LM head rows and logits gather for every sequence (CostModel: 1 row)."""
        c = self._consts()
        q = self.hw.quantisation
        a, H, Vc = q["activation_bytes"], shape.hidden, shape.vocab // shape.n_chips
        t["final_norm"] = self._act_us(c, 2 * N * H * a) + c["ov"]
        wb = H * Vc * q["lm_head_bytes_per_weight"]
        ab = (N * H + N * Vc) * a
        t["lm_head"] = max(2.0 * N * H * Vc / c["int8"], wb / c["w_bw"] + self._act_us(c, ab)) + c["ov"]
        t["logits_gather"] = c["lat"] + N * Vc * a / c["link"] + c["ov"]
        dram["activations"] += (N - 1) * (2 * H * a + (H + Vc) * a)

    def _switch_logits(self, t: dict[str, float], dram: dict[str, float], shape: ModelShape, N: int) -> None:
        """On-device top-k: each chip scans its shard's logits, the gather moves k candidates."""
        if not self.variant.on_device_topk:
            return
        c = self._consts()
        a, Vc, kk = self.hw.quantisation["activation_bytes"], shape.vocab // shape.n_chips, self.variant.topk_k
        scan = self._act_us(c, N * Vc * a) + c["ov"]  # the top-k op, folded into logits_gather's slot
        t["logits_gather"] = scan + c["lat"] + N * kk * TOPK_CANDIDATE_BYTES / c["link"] + c["ov"]
        dram["activations"] += N * Vc * a

    def _assemble(self, shape: ModelShape, kind: str, n_tokens: int, past_len: int, t: dict[str, float],
                  dram: dict[str, float],
                  scale: Sequence[float], *, n_seqs: int, touched: np.ndarray, expected: bool) -> StepCost:
        """Chip timelines from per-role times with ``CostModel.price_step``'s own assembly
        (``stepcost.assemble_step``: the same per-layer, embed/head and per-chip attribution)."""
        p = self.base._prep(shape, kind)
        dram = dict(dram)
        sram_bytes = float(dram.pop("sram_activations", 0.0))
        op_us = np.empty(p.n_ops, dtype=np.float64)
        for role, idx in p.role_ops.items():
            op_us[idx] = t[role]
        hw, q, f = self.hw.hardware, self.hw.quantisation, self.hw.fitted
        pcie = hw["pcie_gbps"] * 1e3
        h2d = hw["pcie_latency_us"] + (2 * n_tokens * q["token_input_bytes"] + n_seqs * q["csr_bytes"]) / pcie
        per_seq = (self.variant.topk_k * TOPK_CANDIDATE_BYTES if self.variant.on_device_topk
                   else shape.logits_bytes_per_token)
        d2h = hw["pcie_latency_us"] + n_seqs * per_seq / pcie
        return assemble_step(p, kind, n_tokens, past_len, op_us, np.asarray(scale, dtype=np.float64),
                             h2d_us=float(h2d), d2h_us=float(d2h), submit_us=float(f["step_submit_overhead_us"]),
                             dram=dram, sram_bytes=sram_bytes, experts=touched, experts_expected=expected)


def price_decode_batch(cm: CostModel | BatchedCostModel, shape: ModelShape, past_lens: Sequence[int],
                       experts_touched: Sequence[float] | None = None,
                       chip_scale: Sequence[float] | None = None) -> StepCost:
    """Batched decode price with ``cm``: its own ``price_decode_batch`` if it has one (a
    :class:`BatchedCostModel`, or a test's scripted model), else a plain CostModel without
    switches. See :meth:`BatchedCostModel.price_decode_batch`."""
    own = getattr(cm, "price_decode_batch", None)
    if own is not None:
        out: StepCost = own(shape, past_lens, experts_touched, chip_scale)
        return out
    assert isinstance(cm, CostModel)  # a BatchedCostModel has price_decode_batch
    return BatchedCostModel(cm).price_decode_batch(shape, past_lens, experts_touched, chip_scale)
