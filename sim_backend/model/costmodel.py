"""Per-op roofline cost model of the dual-chiplet NPU at FULL Qwen3-30B-A3B size.

Every time this module returns is **simulated device time in microseconds**
(``*_us``); byte counts are bytes; nothing here measures the host.

Method (GenZ ``operator_base.get_roofline``; STYLE.md "Simulators")::

    op_us = max(flops / (peak * compute_eff),
                sum_s bytes_s / (dram_bw * eff_s)) + per_op_overhead_us

with a separate efficiency per byte stream ``s``: weight streaming (and the
prefill's KV blocks, sequential like the weights), activations.  Decode flash
attention is priced by mechanism (:func:`flash_decode`: per KV block
max(DMA, vector work), the DMA latency unless double-buffered, partitions
merged in a tree).  SRAM tiling: each op's activation tensors that fit the
SRAM workspace (facts.md F4) move at SRAM rate, larger ones through DRAM; tile
intermediates (the expert intermediate of the MoE tiles) stay in SRAM.
:func:`data_moving_table` derives the explicit DMA entries of a prefill
(facts.md F3's data-moving table).  Chiplet-to-chiplet ops (syncs, decode
gathers, prefill dynamic D2D) cost ``d2d_latency_us + bytes / (link * d2d_eff)``.

Sharding (facts.md F3, report §6): every layer runs on both chips; each chip
holds 16 of 32 Q heads, 2 of 4 KV heads, half the columns of every expert
(all 128 experts on both chips), half the router outputs and half the vocab
of the LM head; the embedding runs on chip0 only.  Quantisation per role is
stated in ``hardware/calculet_npu.yaml`` (facts.md F2: mixed W8A8 / W4AF16).

MoE: expert weight bytes are priced by the experts a layer actually touches
(``experts_touched``), or by the expectation ``E·(1-((E-k)/E)^n)`` (27 tokens
-> 105.6 of 128).  Prefill GEMMs are priced with a row tile (an expert that
got r tokens costs ``max(r, prefill_m_tile)`` rows), decode with GEMV rows
(the decode sub-model is compiled separately for n=1).

Outside the layers: embedding (chip0), final norm, LM head (about 14% of a
short-context decode step's bytes), logits gather, and in prefill 2 layout
conversions.  They are attributed per chip as two rows beside the layers
(``StepCost.outside_chip_us``): "embed" (the ops before layer 0) and "head" (after
the last layer), so per chip the layer rows + embed + head are its busy time, and
busy + the time it waits at barriers + the submit overhead is ``infer_us``.  This
is attribution only: the step's price is the chip timelines' (unchanged).

Prefill computes logits for the last token only (the manifest's prefill output
is ``[1, 151936]``; llama.cpp samples from the last row), so the LM head and the
D2H of 303,872 B happen once per step in both kinds.

Where the parts live: the hardware YAML in :mod:`sim_backend.model.hwspec`, decode flash attention
and the data-moving table in :mod:`sim_backend.model.attention_cost`, each op family's roles in
:mod:`sim_backend.model.families.moe_cost` and :mod:`sim_backend.model.families.dense_cost`, the
chip timelines and :class:`~sim_backend.model.stepcost.StepCost` in :mod:`sim_backend.model.stepcost`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.families.dense_cost import dense_role_costs
from sim_backend.model.families.moe_cost import expected_experts_touched, moe_role_costs
from sim_backend.model.hwspec import HardwareSpec
from sim_backend.model.opgraph import OpGraph, build_graph
from sim_backend.model.stepcost import PreparedGraph, StepCost, assemble_step


class CostModel:
    """Prices prefill/decode steps of the simulated NPU (simulated µs).

    Build with :meth:`load`; :meth:`price_step` is vectorised because the
    device calls it on every step (its host cost per call is printed by
    ``calconsole bench calibrate --timing``, not asserted by unit tests).
    """

    def __init__(self, hw: HardwareSpec) -> None:
        self.hw = hw
        self._prepared: dict[tuple[ModelShape, str], PreparedGraph] = {}

    @classmethod
    def load(cls, path: str | Path | None = None) -> CostModel:
        """Load from a hardware YAML (default: the shipped ``hardware/calculet_npu.yaml``)."""
        return cls(HardwareSpec.load(path))

    def with_fitted(self, **overrides: float) -> CostModel:
        """A new model with some fitted parameters replaced (shares the prepared graphs: they
        depend on the shape only, so a fit that prices thousands of variants builds them once)."""
        new = CostModel(self.hw.with_fitted(**overrides))
        new._prepared = self._prepared
        return new

    def with_hardware(self, **overrides: float) -> CostModel:
        """A new model with some hardware peaks replaced (the joint sampling of ``tools/sweep.py``);
        shares the prepared graphs like :meth:`with_fitted`."""
        new = CostModel(self.hw.with_hardware(**overrides))
        new._prepared = self._prepared
        return new

    def __getstate__(self) -> dict[str, Any]:
        # pickled for the numerics worker: the spec only; the prepared graphs are rebuilt there
        return {"hw": self.hw, "_prepared": {}}

    @property
    def host_overhead_ms_per_token(self) -> float:
        """Fitted host-side allowance, ms per generated token (host wall time stand-in).

        Used ONLY by the cost-model-only E2E calibration case
        (:func:`sim_backend.tools.calibration_cases.e2e_cost_model_us`).  :meth:`price_step`
        never includes it (a step is device time: H2D + infer + D2H), and the
        engine measures its real host work instead, so host time is never
        counted twice.
        """
        return float(self.hw.fitted["host_overhead_ms_per_token"])

    def graph(self, shape: ModelShape, kind: str) -> OpGraph:
        return self._prep(shape, kind).graph

    def _prep(self, shape: ModelShape, kind: str) -> PreparedGraph:
        key = (shape, kind)
        p = self._prepared.get(key)
        if p is None:
            p = self._prepared[key] = PreparedGraph(build_graph(shape, kind))
        return p

    # ------------------------------------------------------------------ pricing
    def _role_costs(self, shape: ModelShape, kind: str, n: int, past: int,
                    touched: np.ndarray) -> tuple[dict[str, Any], dict[str, float]]:
        """Per-role time (µs; an array over layers for the MoE roles) and DRAM bytes per chip.

        The family seam: each op family prices its roles from its own shapes
        (:mod:`sim_backend.model.families.moe_cost`, :mod:`sim_backend.model.families.dense_cost`)."""
        if not shape.is_moe:
            return dense_role_costs(self.hw, shape, kind, n, past)
        return moe_role_costs(self.hw, shape, kind, n, past, touched)

    def price_step(self, shape: ModelShape, kind: str, n_tokens: int, past_len: int,
                   experts_touched: Sequence[float] | np.ndarray | None = None,
                   chip_scale: Sequence[float] | None = None) -> StepCost:
        """Simulated cost of one step.

        Args:
            shape: model priced (full size: ``ModelShape()``).
            kind: ``"prefill"`` or ``"decode"`` (decode requires ``n_tokens == 1``).
            n_tokens: tokens processed in this step.
            past_len: tokens already in the KV cache (context before the step).
            experts_touched: per layer, the number of distinct experts the router
                chose in this step (length ``n_layers``); None -> the expectation
                :func:`expected_experts_touched`.
            chip_scale: per chip (length ``n_chips``), a time multiplier >= 1 for
                every op that chip runs (a slow-chip fault); None -> all 1.0. Each
                chip's column of ``layer_chip_us`` shows its own time; the chips
                align at every barrier, so the slowest chip gates ``infer_us``.
                PCIe H2D/D2H are the host link and are not scaled.

        Raises:
            ValueError: bad kind, token counts, context, ``experts_touched`` or ``chip_scale``.
        """
        if kind not in ("prefill", "decode"):
            raise ValueError(f"kind must be 'prefill' or 'decode', not {kind!r}")
        if n_tokens < 1 or past_len < 0:
            raise ValueError("n_tokens must be >= 1 and past_len >= 0")
        if kind == "decode" and n_tokens != 1:
            raise ValueError("the decode sub-model takes exactly 1 token (hardware batch 1)")
        if past_len + n_tokens > shape.n_ctx:
            raise ValueError(f"context {past_len + n_tokens} exceeds n_ctx {shape.n_ctx}")
        L = shape.n_layers
        if not shape.is_moe:  # no experts to price (a dense family); counts given for one are refused
            if experts_touched is not None and len(experts_touched):
                raise ValueError(f"a {shape.family} model has no experts: experts_touched must be None")
            touched = np.zeros(L)
        elif experts_touched is None:
            touched = np.full(L, expected_experts_touched(n_tokens, shape.n_experts, shape.n_experts_active))
        else:
            touched = np.asarray(experts_touched, dtype=np.float64)
            if touched.shape != (L,):
                raise ValueError(f"experts_touched must have {L} entries, got {touched.shape}")
            hi = min(shape.n_experts, n_tokens * shape.n_experts_active)
            if (touched < 1).any() or (touched > hi).any():
                raise ValueError(f"experts_touched entries must be in [1, {hi}] for {n_tokens} tokens")

        if chip_scale is None:
            scale = np.ones(shape.n_chips)
        else:
            scale = np.asarray(chip_scale, dtype=np.float64)
            if scale.shape != (shape.n_chips,) or not np.isfinite(scale).all() or (scale < 1).any():
                raise ValueError(f"chip_scale must be {shape.n_chips} finite factors >= 1, got {list(chip_scale)!r}")

        p = self._prep(shape, kind)
        t, dram = self._role_costs(shape, kind, n_tokens, past_len, touched)
        sram_bytes = dram.pop("sram_activations")
        op_us = np.empty(p.n_ops, dtype=np.float64)
        for role, idx in p.role_ops.items():
            op_us[idx] = t[role]

        hw, q, f = self.hw.hardware, self.hw.quantisation, self.hw.fitted
        pcie = hw["pcie_gbps"] * 1e3
        h2d = hw["pcie_latency_us"] + (2 * n_tokens * q["token_input_bytes"] + q["csr_bytes"]) / pcie
        d2h = hw["pcie_latency_us"] + shape.logits_bytes_per_token / pcie
        return assemble_step(p, kind, n_tokens, past_len, op_us, scale, h2d_us=float(h2d), d2h_us=float(d2h),
                             submit_us=float(f["step_submit_overhead_us"]), dram=dram, sram_bytes=float(sram_bytes),
                             experts=touched, experts_expected=experts_touched is None)


@lru_cache(maxsize=1)
def default_cost_model() -> CostModel:
    """The shipped model (cached)."""
    return CostModel.load()


def kv_shift_us(hw: HardwareSpec, shape: ModelShape, n_cells: int) -> float:
    """Simulated device µs of one KV shift (CalRT ``DoShift``, facts.md F5 C1): RoPE re-applied to the K rows
    of ``n_cells`` moved cells (llama.cpp's K-shift graph, run before the next step).

    Per chip, every layer reads and writes the K rows of its KV heads: ``n_cells x n_layers x kv_heads/chip x
    head_dim x kv_bytes x 2`` bytes (BF16 K [F4]; 48 layers x 2 heads per chip x 128 [F2]), streamed at
    ``dram_bw_gbps x weight_stream_eff`` (sequential KV rows, as ``flash_decode``'s KV blocks), plus one graph
    submission (``step_submit_overhead_us``, the F1 path); the chips run their halves in parallel, and the
    rotation's few FLOPs per element hide under the DMA. 0 for no cell (nothing is submitted). Numbers: the
    hardware YAML (``hardware.dram_bw_gbps``, ``fitted.weight_stream_eff``, ``fitted.step_submit_overhead_us``,
    ``quantisation.kv_bytes``). Raises ValueError for ``n_cells < 0``.
    """
    if n_cells < 0:
        raise ValueError(f"n_cells must be >= 0, got {n_cells}")
    if n_cells == 0:
        return 0.0
    q, f = hw.quantisation, hw.fitted
    row = shape.head_dim * float(q["kv_bytes"])
    nbytes = 2.0 * n_cells * shape.n_layers * shape.kv_heads_per_chip * row  # K read + K written
    bw = float(hw.hardware["dram_bw_gbps"]) * 1e3 * float(f["weight_stream_eff"])  # bytes per µs
    return float(f["step_submit_overhead_us"]) + nbytes / bw
