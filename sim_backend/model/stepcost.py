"""The price of one step (:class:`StepCost`) assembled from per-op times on the chips' timelines.

Family-neutral: a graph's ops are put on each chip's timeline in order, the chips align at every
barrier (:func:`chip_timelines`), and :func:`assemble_step` attributes the time per layer, per chip
and per category (and the ops outside the layers to :data:`OUTSIDE_PARTS`).  Used by
:class:`~sim_backend.model.costmodel.CostModel` and the batched pricing
(:mod:`sim_backend.model.batching`).  All ``*_us`` are SIMULATED device µs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import numpy as np

from sim_backend.model.opgraph import CATEGORIES, OpGraph

#: Rows of ``StepCost.outside_chip_us``: the ops before layer 0 and the ops after the last layer.
OUTSIDE_PARTS: tuple[str, ...] = ("embed", "head")

@dataclass(frozen=True, eq=False)
class StepCost:
    """Simulated cost of one sub-model submission (one prefill or decode step).

    All ``*_us`` are SIMULATED device microseconds (float).

    Attributes:
        kind, n_tokens, past_len: the step (tokens in this step; tokens already in KV).
        h2d_us: PCIe host->device of token ids, positions and CSR.
        infer_us: graph execution (chip timelines aligned at syncs) + submit overhead.
        d2h_us: PCIe device->host of one token's logits, ``ModelShape.logits_bytes_per_token``
            (BF16: 303,872 B, facts.md F1/F4; an F32 C3 calbin: vocab x 4 B).
        total_us: ``h2d_us + infer_us + d2h_us``.
        layer_chip_us: float64 ``(n_layers, n_chips)``: busy time of each chip in each layer.
        layer_chip_category_us: float64 ``(n_layers, n_chips, len(categories))``.
        categories: category ids (facts.md F3 order) indexing the last axis.
        global_us: time of ops outside the layers on the busiest chip (embedding,
            final norm, lm_head, logits gather/sync, layout conversions).
        op_us: float64 ``(n_ops,)`` per op of ``graph.ops`` on a chip at normal speed;
            on chip ``c`` the op takes ``op_us * chip_scale[c]``.
        op_start_us: float64 ``(n_chips, n_ops)``: start on each chip's timeline,
            relative to the start of ``infer``; NaN where the chip does not run the op.
        chip_scale: per-chip time multiplier the step was priced with (1.0 = nominal;
            a slow-chip fault makes it > 1 for that chip only).
        dram_bytes: per-chip DRAM bytes by stream (``weights``, ``lm_head``, ``kv``, ``activations``)
            on chip0.
        sram_bytes: per-chip activation bytes that fit the SRAM workspace and were priced at
            SRAM bandwidth instead (``hardware.sram_bw_gbps``).
        graph: the priced :class:`~sim_backend.model.opgraph.OpGraph`.
        outside_chip_us: float64 ``(2, n_chips)``: busy time of each chip in the ops outside the
            layers, row 0 ``"embed"`` (before layer 0: embedding on chip0 only, its broadcast sync,
            prefill's input layout conversion), row 1 ``"head"`` (after the last layer: prefill's
            output layout conversion, final norm, LM head, logits gather and sync); see
            :data:`OUTSIDE_PARTS`.  ``global_us`` is the busiest chip's sum of both rows.
        outside_chip_category_us: float64 ``(2, n_chips, len(categories))``.
        outside_ops: per row of ``outside_chip_us``, the roles of its ops in execution order.
        chip_busy_us: float64 ``(n_chips,)``: each chip's own ops (layers and outside), i.e.
            ``layer_chip_us.sum(0) + outside_chip_us.sum(0)``.
        submit_us: the step's submit overhead (part of ``infer_us``, on no chip's ops).
        experts_priced: float64 ``(n_layers,)``: distinct experts per layer the MoE weights were
            priced with (the caller's per-layer counts, or the expectation, uniform).
        experts_expected: True when ``experts_priced`` is the expectation (no per-layer counts given).

    Per chip ``c``: ``chip_busy_us[c] + chip_wait_us[c] + submit_us == infer_us`` (a chip not busy
    waits at a barrier for the other).
    """

    kind: str
    n_tokens: int
    past_len: int
    h2d_us: float
    infer_us: float
    d2h_us: float
    total_us: float
    layer_chip_us: np.ndarray
    layer_chip_category_us: np.ndarray
    categories: tuple[str, ...]
    global_us: float
    op_us: np.ndarray
    op_start_us: np.ndarray
    dram_bytes: Mapping[str, float] = field(default_factory=dict)
    sram_bytes: float = 0.0
    graph: OpGraph | None = None
    chip_scale: tuple[float, ...] = ()
    outside_chip_us: np.ndarray = field(default_factory=lambda: np.zeros((len(OUTSIDE_PARTS), 0)))
    outside_chip_category_us: np.ndarray = field(
        default_factory=lambda: np.zeros((len(OUTSIDE_PARTS), 0, len(CATEGORIES))))
    outside_ops: tuple[tuple[str, ...], ...] = ((), ())
    chip_busy_us: np.ndarray = field(default_factory=lambda: np.zeros(0))
    submit_us: float = 0.0
    experts_priced: np.ndarray = field(default_factory=lambda: np.zeros(0))
    experts_expected: bool = True

    @property
    def chip_wait_us(self) -> np.ndarray:
        """float64 ``(n_chips,)``: time each chip's timeline waits at barriers in ``infer_us``
        (``infer_us - submit_us - chip_busy_us``, clipped at 0 against rounding)."""
        return np.maximum(0.0, self.infer_us - self.submit_us - np.asarray(self.chip_busy_us))

    def until_op(self, index: int) -> tuple[float, np.ndarray]:
        """The step cut short at the end of op ``index`` (a fault that ends it there).

        Returns ``(infer_us, chip_busy_us)``: simulated µs from the submit to the end of that op
        on the last chip to finish it (submit overhead included), and each chip's busy µs in the
        ops it ran up to and including it.  Raises IndexError for an index outside the graph.
        """
        if not 0 <= index < self.op_us.shape[0]:
            raise IndexError(f"op {index} outside the graph's {self.op_us.shape[0]} ops")
        scale = np.asarray(self.chip_scale or (1.0,) * self.op_start_us.shape[0])
        runs = ~np.isnan(self.op_start_us[:, : index + 1])
        busy = np.array([float(self.op_us[: index + 1][runs[c]].sum()) * scale[c] for c in range(runs.shape[0])])
        ends = self.op_start_us[:, index] + self.op_us[index] * scale
        return float(np.nanmax(ends)) + self.submit_us, busy

    @property
    def slowest_category_per_layer(self) -> list[str]:
        """Per layer, the category with the largest time summed over chips."""
        per = self.layer_chip_category_us.sum(axis=1)
        return [self.categories[i] for i in per.argmax(axis=1)]

    def to_wire(self) -> dict[str, Any]:
        """Every field but ``graph`` as picklable values (the numerics worker prices in its own process).

        Arrays go as they are (float64, exact); ``dram_bytes`` as a dict. :meth:`from_wire` inverts it.
        """
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "graph"}
        out["dram_bytes"] = dict(self.dram_bytes)
        return out

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any], graph: OpGraph | None) -> StepCost:
        """The StepCost :meth:`to_wire` described, with ``graph`` (the receiver's own copy of the
        priced graph) attached and the arrays read-only again (pickle makes them writeable)."""
        kw = dict(wire)
        for k in _ARRAY_FIELDS:
            kw[k].flags.writeable = False
        kw["dram_bytes"] = MappingProxyType(dict(kw["dram_bytes"]))
        return cls(**kw, graph=graph)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (lists of floats, µs simulated)."""
        return {
            "simulated": True,
            "time_unit": "us (simulated device time)",
            "kind": self.kind,
            "n_tokens": self.n_tokens,
            "past_len": self.past_len,
            "h2d_us": self.h2d_us,
            "infer_us": self.infer_us,
            "d2h_us": self.d2h_us,
            "total_us": self.total_us,
            "global_us": self.global_us,
            "categories": list(self.categories),
            "layer_chip_us": self.layer_chip_us.tolist(),
            "layer_chip_category_us": self.layer_chip_category_us.tolist(),
            "slowest_category_per_layer": self.slowest_category_per_layer,
            "dram_bytes": dict(self.dram_bytes),
            "sram_bytes": self.sram_bytes,
            "chip_scale": list(self.chip_scale),
            "outside_parts": list(OUTSIDE_PARTS),
            "outside_ops": [list(r) for r in self.outside_ops],
            "outside_chip_us": self.outside_chip_us.tolist(),
            "chip_busy_us": np.asarray(self.chip_busy_us).tolist(),
            "chip_wait_us": self.chip_wait_us.tolist(),
            "submit_us": self.submit_us,
            "experts_priced": np.asarray(self.experts_priced).tolist(),
            "experts_expected": self.experts_expected,
        }


#: StepCost's array fields (read-only; ``from_wire`` makes them so again after pickling)
_ARRAY_FIELDS = ("op_us", "op_start_us", "layer_chip_us", "layer_chip_category_us", "outside_chip_us",
                 "outside_chip_category_us", "chip_busy_us", "experts_priced")


class PreparedGraph:
    """Index arrays of one graph (ops per role, category, layer slot, chip, barrier segment), computed once per
    (shape, kind) by :class:`~sim_backend.model.costmodel.CostModel` and shared by its copies."""

    def __init__(self, graph: OpGraph) -> None:
        ops = graph.ops
        shape = graph.shape
        n = len(ops)
        self.graph = graph
        self.n_ops = n
        self.roles = sorted({op.role for op in ops})
        self.role_ops: dict[str, np.ndarray] = {
            r: np.array([op.index for op in ops if op.role == r], dtype=np.int64) for r in self.roles
        }
        cat_idx = {c: i for i, c in enumerate(CATEGORIES)}
        self.cat = np.array([cat_idx[op.category] for op in ops], dtype=np.int64)
        layer = np.array([op.layer for op in ops], dtype=np.int64)
        self.is_global = layer < 0
        # ops outside the layers go to one of two extra slots: before layer 0 ("embed") or after
        # the last layer ("head"); see OUTSIDE_PARTS
        first_layer_op = int(np.argmax(~self.is_global)) if (~self.is_global).any() else n
        part = np.where(np.arange(n) < first_layer_op, 0, 1)
        self.layer_slot = np.where(self.is_global, shape.n_layers + part, layer)
        self.part_ops: tuple[tuple[str, ...], ...] = tuple(
            tuple(op.role for op in ops if op.layer < 0 and part[op.index] == i) for i in range(len(OUTSIDE_PARTS)))
        self.chip_mask = np.zeros((shape.n_chips, n), dtype=bool)
        for op in ops:
            self.chip_mask[list(op.chips), op.index] = True
        self.profiled = np.array([bool(op.profile_chips) for op in ops])
        # Chips align at every sync_d2d (barrier): a segment starts at each barrier.
        barrier = self.cat == cat_idx["sync_d2d"]
        self.seg = np.cumsum(barrier)
        self.n_seg = int(self.seg[-1]) + 1
        ncat = len(CATEGORIES)
        self.lc_index = self.layer_slot * ncat + self.cat
        self.n_slots = (shape.n_layers + len(OUTSIDE_PARTS)) * ncat


def chip_timelines(p: PreparedGraph, op_us: np.ndarray, scale: np.ndarray) -> dict[str, Any]:
    """Chip timelines of one step from per-op times (simulated µs): each chip runs its ops in
    order at its own speed (``op_us * scale[c]``) and all chips align at every barrier.

    Used by :meth:`CostModel.price_step` and the batched pricing (``batching``), so both
    attribute time the same way. Returns ``seg_len`` (per barrier segment, the slowest chip's
    time; their sum is the graph's execution time), ``op_start`` (C, n_ops; NaN where a chip does
    not run the op), ``layer_chip_cat`` (L, C, ncat), ``outside_chip_cat`` (2, C, ncat: the
    ``OUTSIDE_PARTS``) and ``chip_busy`` (C,: each chip's own ops, all of them).
    """
    C, L = p.chip_mask.shape[0], p.graph.shape.n_layers
    d = p.chip_mask * op_us * scale[:, None]                  # (C, n_ops)
    seg_sum = np.stack([np.bincount(p.seg, weights=row, minlength=p.n_seg) for row in d])
    seg_len = seg_sum.max(axis=0)
    seg_start = np.concatenate(([0.0], np.cumsum(seg_len)[:-1]))
    csum = np.cumsum(d, axis=1)
    before_seg = np.concatenate((np.zeros((C, 1)), np.cumsum(seg_sum, axis=1)), axis=1)
    # start = segment start + time of the earlier ops of the same segment on that chip
    within = csum - d - before_seg[:, p.seg]
    op_start = np.where(p.chip_mask, seg_start[p.seg][None, :] + within, np.nan)
    ncat = len(CATEGORIES)
    lcc = np.stack([np.bincount(p.lc_index, weights=row, minlength=p.n_slots) for row in d])
    lcc = lcc.reshape(C, L + len(OUTSIDE_PARTS), ncat).transpose(1, 0, 2)   # (L+2, C, ncat)
    return {"seg_len": seg_len, "op_start": op_start,
            "layer_chip_cat": np.ascontiguousarray(lcc[:L]), "outside_chip_cat": np.ascontiguousarray(lcc[L:]),
            "chip_busy": d.sum(axis=1)}


def assemble_step(p: PreparedGraph, kind: str, n_tokens: int, past_len: int, op_us: np.ndarray, scale: np.ndarray, *,
                  h2d_us: float, d2h_us: float, submit_us: float, dram: Mapping[str, float], sram_bytes: float,
                  experts: np.ndarray, experts_expected: bool) -> StepCost:
    """The :class:`StepCost` of per-op times ``op_us`` on chips slowed by ``scale`` (simulated µs):
    :func:`chip_timelines`, then ``infer = sum of barrier segments + submit_us``."""
    tl = chip_timelines(p, op_us, scale)
    layer_chip_cat, outside_cat = tl["layer_chip_cat"], tl["outside_chip_cat"]
    layer_chip = layer_chip_cat.sum(axis=2)
    outside = outside_cat.sum(axis=2)
    # the busiest chip's time outside the layers (summed per category first, as it always was)
    glob = outside_cat.sum(axis=0).sum(axis=1)
    infer = float(tl["seg_len"].sum()) + submit_us
    experts = np.array(experts, dtype=np.float64)
    arrays = (op_us, tl["op_start"], layer_chip, layer_chip_cat, outside, outside_cat, tl["chip_busy"], experts)
    for arr in arrays:
        arr.flags.writeable = False
    return StepCost(
        kind=kind, n_tokens=n_tokens, past_len=past_len,
        h2d_us=h2d_us, infer_us=infer, d2h_us=d2h_us, total_us=float(h2d_us + infer + d2h_us),
        layer_chip_us=layer_chip, layer_chip_category_us=layer_chip_cat, categories=CATEGORIES,
        global_us=float(glob.max()), op_us=op_us, op_start_us=tl["op_start"],
        dram_bytes=MappingProxyType(dict(dram)), sram_bytes=float(sram_bytes), graph=p.graph,
        chip_scale=tuple(float(x) for x in scale),
        outside_chip_us=outside, outside_chip_category_us=outside_cat, outside_ops=p.part_ops,
        chip_busy_us=tl["chip_busy"], submit_us=submit_us,
        experts_priced=experts, experts_expected=experts_expected,
    )
