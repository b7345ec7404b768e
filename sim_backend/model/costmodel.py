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
"""

from __future__ import annotations

import math
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import yaml

from sim_backend import safe_yaml
from sim_backend.bundle.manifest import bounded_repr
from sim_backend.bundle.shapes import ModelShape
from sim_backend.errors import ManifestError
from sim_backend.model.opgraph import CATEGORIES, OpGraph, build_graph

#: Rows of ``StepCost.outside_chip_us``: the ops before layer 0 and the ops after the last layer.
OUTSIDE_PARTS: tuple[str, ...] = ("embed", "head")

DEFAULT_HW_PATH = Path(__file__).resolve().parents[1] / "hardware" / "calculet_npu.yaml"
# A hardware YAML is a few KiB (the shipped one ~6 KiB); refuse to parse anything huge.
_MAX_HW_BYTES = 1 << 20

_REQUIRED: dict[str, tuple[str, ...]] = {
    "hardware": ("n_chips", "peak_int8_tops", "peak_fp16_tflops", "dram_bw_gbps", "sram_bw_gbps",
                 "dram_physical_gib", "sram_physical_mib", "d2d_link_gbps", "d2d_latency_us",
                 "pcie_gbps", "pcie_latency_us"),
    "quantisation": ("attn_proj_bytes_per_weight", "router_bytes_per_weight",
                     "expert_bytes_per_weight", "lm_head_bytes_per_weight",
                     "embedding_bytes_per_weight", "norm_bytes_per_weight", "activation_bytes",
                     "kv_bytes", "token_input_bytes", "csr_bytes"),
    "memory": ("param_dram_shared_gib", "param_file_gib", "param_sram_window_mib",
               "dram_reservation_gib", "sram_reservation_mib", "address_union_gib"),
    "fitted": ("weight_stream_eff", "kv_block_kib", "attn_cores", "kv_dma_latency_us", "attn_vector_tflops",
               "attn_merge_level_us", "softmax_flops_per_score", "activation_eff", "d2d_eff",
               "int8_compute_eff", "fp16_compute_eff", "attn_compute_eff", "prefill_m_tile",
               "per_op_overhead_us", "step_submit_overhead_us", "host_overhead_ms_per_token"),
}
#: fitted parameters that must be integers (tile rows, partition counts)
_INTEGER_FITTED = ("prefill_m_tile", "kv_block_kib", "attn_cores")
#: hardware figures that may carry a physical range (``hardware_ranges``) for the joint sampling
_RANGED_HARDWARE = ("peak_int8_tops", "peak_fp16_tflops", "dram_bw_gbps", "sram_bw_gbps", "d2d_link_gbps",
                    "pcie_gbps")


# Accepted range (lo, hi, lo inclusive?) of every number in the hardware YAML, so a
# typo cannot reach the cost model or memory plan as inf, nan, 0 or 1e300. Wide
# on purpose: about 10-100x above the shipped figures (and any real accelerator)
# at the top, just above zero at the bottom; latencies/overheads may be 0.
_GIB_MAX = 1024.0     # GiB of DRAM per chiplet (shipped 16; 64x)
_MIB_MAX = 4096.0     # MiB of SRAM per chiplet (shipped 18)
_RANGES: dict[str, tuple[float, float, bool]] = {
    "hardware.n_chips": (1, 16, True),
    "hardware.peak_int8_tops": (0.0, 10_000.0, False),      # shipped 128
    "hardware.peak_fp16_tflops": (0.0, 10_000.0, False),    # shipped 32
    "hardware.dram_bw_gbps": (0.0, 100_000.0, False),       # shipped 102.4; HBM3e stacks ~ 1e3-1e4
    "hardware.sram_bw_gbps": (0.0, 1_000_000.0, False),     # shipped 2048
    "hardware.dram_physical_gib": (0.0, _GIB_MAX, False),
    "hardware.sram_physical_mib": (0.0, _MIB_MAX, False),
    "hardware.d2d_link_gbps": (0.0, 100_000.0, False),
    "hardware.d2d_latency_us": (0.0, 1e6, True),
    "hardware.pcie_gbps": (0.0, 10_000.0, False),
    "hardware.pcie_latency_us": (0.0, 1e6, True),
    "quantisation.*": (0.0, 8.0, False),                    # bytes per weight / element: at most FP64
    "quantisation.csr_bytes": (0.0, 65_536.0, False),
    "memory.*_gib": (0.0, _GIB_MAX, False),
    "memory.*_mib": (0.0, _MIB_MAX, False),
    "fitted.prefill_m_tile": (1, 4096, True),
    "fitted.kv_block_kib": (1, 1 << 20, True),
    "fitted.attn_cores": (1, 4096, True),
    "fitted.*": (0.0, 1e7, True),                           # overheads (us, ms per token); _eff checked apart
}


def _range_for(sec: str, key: str) -> tuple[float, float, bool]:
    for pat in (f"{sec}.{key}", f"{sec}.*_{key.rsplit('_', 1)[-1]}", f"{sec}.*"):
        if pat in _RANGES:
            return _RANGES[pat]
    raise KeyError(f"{sec}.{key}")


def _check_number(path: str, fld: str, val: Any, rng: tuple[float, float, bool], *, integer: bool = False) -> None:
    lo, hi, lo_incl = rng
    if isinstance(val, bool) or not isinstance(val, (int, float)) or (integer and not isinstance(val, int)):
        raise ManifestError(path, fld, f"must be {'an integer' if integer else 'a number'}, got {bounded_repr(val)}")
    ok = math.isfinite(val) and (lo <= val if lo_incl else lo < val) and val <= hi
    if not ok:
        raise ManifestError(path, fld, f"must be in {'[' if lo_incl else '('}{lo:g}, {hi:g}], got {bounded_repr(val)}")


def _freeze(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return tuple(_freeze(v) for v in obj)
    return obj


def _thaw(obj: Any) -> Any:
    """Plain dicts and lists again (the inverse of ``_freeze``): what pickle can carry."""
    if isinstance(obj, Mapping):
        return {k: _thaw(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [_thaw(v) for v in obj]
    return obj


def _spec_from_plain(path: str, sections: dict[str, Any]) -> HardwareSpec:
    """Rebuild a pickled :class:`HardwareSpec` (values were checked when it was first made)."""
    return HardwareSpec(path=path, **{k: _freeze(v) for k, v in sections.items()})


@dataclass(frozen=True)
class HardwareSpec:
    """Parsed ``calculet_npu.yaml``: read-only sections of plain numbers.

    Attributes:
        path: file it came from.
        hardware: per-chip peaks (TOPS/TFLOPS), DRAM/link/PCIe GB/s, latencies (µs).
        quantisation: bytes per weight by role, activation/KV/input byte widths.
        memory: facts.md F4 figures the model cannot derive (GiB / MiB).
        fitted: fitted or assumed cost-model parameters (efficiencies, overheads µs, tile sizes).
        ranges: ``(lo, hi)`` physical range of every ``fitted`` parameter (the YAML's
            ``ranges`` section): fits stay inside it, sensitivity ranges sweep it, and
            a value outside it is refused at load.
        hardware_ranges: ``(lo, hi)`` of the assumed hardware peaks that have one (the YAML's
            optional ``hardware_ranges``; keys of :data:`_RANGED_HARDWARE`): the joint sampling of
            ``tools/sweep.py`` moves them; a value outside is refused at load.
    """

    path: str
    hardware: Mapping[str, Any]
    quantisation: Mapping[str, Any]
    memory: Mapping[str, Any]
    fitted: Mapping[str, Any]
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    hardware_ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path | None = None) -> HardwareSpec:
        """Load and validate a hardware YAML; raises :class:`ManifestError` on a bad file."""
        p = Path(path) if path is not None else DEFAULT_HW_PATH
        try:
            st = p.stat()
            if not stat.S_ISREG(st.st_mode):  # a FIFO would block the read forever
                raise ManifestError(str(p), "", "not a regular file")
            if st.st_size > _MAX_HW_BYTES:
                raise ManifestError(str(p), "", f"{st.st_size} bytes: not a hardware YAML (limit {_MAX_HW_BYTES})")
            doc = safe_yaml.load(p.read_text(encoding="utf-8"), what="a hardware file")  # an alias bomb is refused
        except OSError as exc:
            raise ManifestError(str(p), "", f"cannot read: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ManifestError(str(p), "", f"not UTF-8 text (byte {exc.start})") from None
        except (yaml.YAMLError, ValueError, RecursionError) as exc:
            # ValueError: an integer too long to convert; RecursionError: absurd nesting
            raise ManifestError(str(p), "", f"invalid YAML: {str(exc)[:200]}") from None
        return cls.from_dict(doc, str(p))

    @classmethod
    def from_dict(cls, doc: Any, path: str = "<dict>") -> HardwareSpec:
        if not isinstance(doc, Mapping):
            raise ManifestError(path, "", "top level must be a mapping")
        sections: dict[str, Mapping[str, Any]] = {}
        for sec, keys in _REQUIRED.items():
            body = doc.get(sec)
            if not isinstance(body, Mapping):
                raise ManifestError(path, sec, "missing section (must be a mapping)")
            for key in keys:
                if key not in body:
                    raise ManifestError(path, f"{sec}.{key}", "missing field")
                val = body[key]
                fld = f"{sec}.{key}"
                if sec == "fitted" and key.endswith("_eff"):
                    _check_number(path, fld, val, (0.0, 1.0, False))
                elif key == "param_file_gib":  # one file size per chip
                    n = sections["hardware"]["n_chips"]
                    if not isinstance(val, list) or len(val) != n:
                        raise ManifestError(path, fld,
                                            f"must be a list of {n} numbers (one per chip), got {bounded_repr(val)}")
                    for i, v in enumerate(val):
                        _check_number(path, f"{fld}[{i}]", v, _RANGES["memory.*_gib"])
                elif key == "address_union_gib":
                    if not isinstance(val, Mapping) or set(val) != {"decode", "prefill"}:
                        raise ManifestError(path, fld, f"must map decode and prefill to GiB, got {bounded_repr(val)}")
                    for k, v in val.items():
                        _check_number(path, f"{fld}.{k}", v, _RANGES["memory.*_gib"])
                else:
                    _check_number(path, fld, val, _range_for(sec, key),
                                  integer=key == "n_chips" or key in _INTEGER_FITTED)
            sections[sec] = _freeze(dict(body))
        ranges = cls._check_ranges(doc.get("ranges"), sections["fitted"], path)
        hw_ranges = cls._check_hardware_ranges(doc.get("hardware_ranges"), sections["hardware"], path)
        return cls(path=path, ranges=ranges, hardware_ranges=hw_ranges, **sections)

    @staticmethod
    def _check_hardware_ranges(body: Any, hardware: Mapping[str, Any], path: str
                               ) -> Mapping[str, tuple[float, float]]:
        """The optional ``hardware_ranges`` section: ``[lo, hi]`` for some of :data:`_RANGED_HARDWARE`."""
        if body is None:
            return MappingProxyType({})
        if not isinstance(body, Mapping):
            raise ManifestError(path, "hardware_ranges", "must map hardware peaks to [lo, hi]")
        out: dict[str, tuple[float, float]] = {}
        for key, rng in body.items():
            fld = f"hardware_ranges.{key}"
            if key not in _RANGED_HARDWARE:
                raise ManifestError(path, fld, f"not a ranged hardware figure (one of {', '.join(_RANGED_HARDWARE)})")
            if not isinstance(rng, list) or len(rng) != 2:
                raise ManifestError(path, fld, f"must be [lo, hi], got {bounded_repr(rng)}")
            for i, v in enumerate(rng):
                _check_number(path, f"{fld}[{i}]", v, _range_for("hardware", key))
            lo, hi = float(rng[0]), float(rng[1])
            if lo > hi:
                raise ManifestError(path, fld, f"lo {lo:g} > hi {hi:g}")
            if not lo <= float(hardware[key]) <= hi:
                raise ManifestError(path, f"hardware.{key}", f"{hardware[key]:g} is outside its range [{lo:g}, {hi:g}]")
            out[key] = (lo, hi)
        return MappingProxyType(out)

    @staticmethod
    def _check_ranges(body: Any, fitted: Mapping[str, Any], path: str) -> Mapping[str, tuple[float, float]]:
        """The ``ranges`` section: a physical ``[lo, hi]`` for EVERY fitted parameter, the value inside it."""
        if not isinstance(body, Mapping):
            raise ManifestError(path, "ranges", "missing section (must map every fitted parameter to [lo, hi])")
        extra = sorted(set(body) - set(fitted))
        if extra:
            raise ManifestError(path, f"ranges.{extra[0]}", "not a fitted parameter")
        out: dict[str, tuple[float, float]] = {}
        for key, val in fitted.items():
            fld = f"ranges.{key}"
            rng = body.get(key)
            if not isinstance(rng, list) or len(rng) != 2:
                raise ManifestError(path, fld, f"must be [lo, hi] (physical range of fitted.{key}), "
                                               f"got {bounded_repr(rng)}")
            hard = (0.0, 1.0, False) if key.endswith("_eff") else _range_for("fitted", key)
            for i, v in enumerate(rng):
                _check_number(path, f"{fld}[{i}]", v, hard, integer=key in _INTEGER_FITTED)
            lo, hi = float(rng[0]), float(rng[1])
            if lo > hi:
                raise ManifestError(path, fld, f"lo {lo:g} > hi {hi:g}")
            if not lo <= float(val) <= hi:
                raise ManifestError(path, f"fitted.{key}", f"{val:g} is outside its physical range [{lo:g}, {hi:g}]")
            out[key] = (lo, hi)
        return MappingProxyType(out)

    def __reduce__(self) -> tuple[Any, tuple[str, dict[str, Any]]]:
        # read-only mappings do not pickle; the numerics worker process gets the same spec this way
        plain = {f.name: _thaw(getattr(self, f.name)) for f in fields(self) if f.name != "path"}
        return _spec_from_plain, (self.path, plain)

    def with_fitted(self, **overrides: float) -> HardwareSpec:
        """Copy with some ``fitted`` values replaced (offline fitting, what-if studies)."""
        unknown = set(overrides) - set(self.fitted)
        if unknown:
            raise KeyError(f"unknown fitted parameter(s): {sorted(unknown)}")
        return replace(self, fitted=MappingProxyType({**self.fitted, **overrides}))

    def with_hardware(self, **overrides: float) -> HardwareSpec:
        """Copy with some ``hardware`` peaks replaced (the joint sampling of assumed figures)."""
        unknown = set(overrides) - set(self.hardware)
        if unknown:
            raise KeyError(f"unknown hardware figure(s): {sorted(unknown)}")
        return replace(self, hardware=MappingProxyType({**self.hardware, **overrides}))


def sram_workspace_bytes(hw: HardwareSpec) -> float:
    """Bytes of SRAM the memory plan leaves for activations, per chip: the reservation minus the
    parameters' window (facts.md F4: 16.844 - 14.381 MiB = 2.463 MiB)."""
    return max(0.0, (hw.memory["sram_reservation_mib"] - hw.memory["param_sram_window_mib"]) * 2**20)


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

    def move(what: str, tensors: int, nbytes_each: float, block: int, entries_each: int | None = None) -> dict:
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


def expected_experts_touched(n_tokens: int, n_experts: int = 128, k: int = 8) -> float:
    """Expected distinct experts n tokens touch in one layer: ``E·(1 - ((E-k)/E)^n)``.

    27 tokens -> 105.6; 1 token -> 8 (STYLE.md "Simulators").
    """
    return n_experts * (1.0 - ((n_experts - k) / n_experts) ** n_tokens)


def priced_experts_touched(router_touched: Sequence[int], n_tokens: int, n_experts: int = 128,
                           k: int = 8) -> np.ndarray:
    """Per-layer distinct experts to PRICE a step with, from the synthetic router's own choices.

    The synthetic router (random reduced-width weights) routes the tokens of a prompt to
    fewer distinct experts than a trained one: the 27-token calibration prompt touches 95.9
    per layer on average where the independent-routing expectation, which we take for the
    trained Qwen3 router (trained with a load-balancing loss), is 105.6.  F7 was measured with
    the trained router, so the router's per-layer PATTERN is kept and its mean brought to the
    expectation: ``touched * expected / mean(touched)``, clipped to ``[k, min(E, n*k)]``.
    One token (decode) always gives ``k``.  Timing-only mode prices the expectation itself,
    so both modes price the same mean and F7 holds in both (tests/tools/test_calibration.py).

    Args:
        router_touched: per layer, distinct experts the router chose in the step (ints >= 1).
        n_tokens: tokens in the step.
    Returns:
        float64 (n_layers,) distinct experts per layer.
    Raises:
        ValueError: empty input or entries < 1.
    """
    t = np.asarray(router_touched, dtype=np.float64)
    if t.size == 0 or (t < 1).any():
        raise ValueError("router_touched must be a non-empty list of counts >= 1")
    hi = float(min(n_experts, n_tokens * k))
    scaled = t * (expected_experts_touched(n_tokens, n_experts, k) / t.mean())
    return np.clip(scaled, min(float(k), hi), hi)


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

    def to_dict(self) -> dict:
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


class _Prepared:
    """Index arrays of one graph, computed once per (shape, kind)."""

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


def chip_timelines(p: _Prepared, op_us: np.ndarray, scale: np.ndarray) -> dict[str, Any]:
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


class CostModel:
    """Prices prefill/decode steps of the simulated NPU (simulated µs).

    Build with :meth:`load`; :meth:`price_step` is vectorised because the
    device calls it on every step (its host cost per call is printed by
    ``calconsole bench calibrate --timing``, not asserted by unit tests).
    """

    def __init__(self, hw: HardwareSpec) -> None:
        self.hw = hw
        self._prepared: dict[tuple[ModelShape, str], _Prepared] = {}

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
        (:func:`sim_backend.tools.calibration.e2e_cost_model_us`).  :meth:`price_step`
        never includes it (a step is device time: H2D + infer + D2H), and the
        engine measures its real host work instead, so host time is never
        counted twice.
        """
        return float(self.hw.fitted["host_overhead_ms_per_token"])

    def graph(self, shape: ModelShape, kind: str) -> OpGraph:
        return self._prep(shape, kind).graph

    def _prep(self, shape: ModelShape, kind: str) -> _Prepared:
        key = (shape, kind)
        p = self._prepared.get(key)
        if p is None:
            p = self._prepared[key] = _Prepared(build_graph(shape, kind))
        return p

    # ------------------------------------------------------------------ pricing
    def _role_costs(self, shape: ModelShape, kind: str, n: int, past: int,
                    touched: np.ndarray) -> tuple[dict[str, Any], dict[str, float]]:
        """Per-role time (µs; an array over layers for the MoE roles) and DRAM bytes per chip."""
        if not shape.is_moe:  # the family seam: a dense model's roles are priced from its own shapes
            from sim_backend.model.families.dense_cost import dense_role_costs
            return dense_role_costs(self.hw, shape, kind, n, past)
        hw, q, f = self.hw.hardware, self.hw.quantisation, self.hw.fitted
        prefill = kind == "prefill"
        C = shape.n_chips
        H, d = shape.hidden, shape.head_dim
        hq, hkv = shape.n_q_heads // C, shape.n_kv_heads // C
        Fc, Ec, Vc = shape.expert_ffn // C, shape.n_experts // C, shape.vocab // C
        k = shape.n_experts_active
        a = q["activation_bytes"]
        ctx = past + n

        bw = hw["dram_bw_gbps"] * 1e3                      # bytes per µs
        w_bw, act_bw = bw * f["weight_stream_eff"], bw * f["activation_eff"]
        row = d * q["kv_bytes"]
        # SRAM: what the memory plan reserves beyond the parameters' window is the activation
        # workspace (facts.md F4: 16.844 - 14.381 MiB per chip).  SRAM tiling: an op runs tile by
        # tile through it, so only the tensors it reads or writes that do not fit the workspace as a
        # whole go through DRAM; smaller ones, and what stays inside a tile (the expert
        # intermediate between gate/up and down, attention scores), stay at SRAM bandwidth.
        sram_ws = sram_workspace_bytes(self.hw)
        sram_bw = hw["sram_bw_gbps"] * 1e3
        link = hw["d2d_link_gbps"] * 1e3 * f["d2d_eff"]
        lat = hw["d2d_latency_us"]
        int8 = hw["peak_int8_tops"] * 1e6 * f["int8_compute_eff"]      # ops per µs
        fp16 = hw["peak_fp16_tflops"] * 1e6 * f["fp16_compute_eff"]
        attn_c = hw["peak_fp16_tflops"] * 1e6 * f["attn_compute_eff"]
        ov = f["per_op_overhead_us"]
        tile = f["prefill_m_tile"]
        rows = (lambda r: np.maximum(r, tile)) if prefill else (lambda r: r)

        t: dict[str, Any] = {}
        wbytes = {"weights": 0.0, "lm_head": 0.0, "kv": 0.0, "activations": 0.0, "sram_activations": 0.0}

        def act(nbytes: float | Sequence[float], mult: float, resident: float = 0.0) -> float:
            """µs to move an op's activation tensors ``nbytes`` (one size or a list), booking the bytes (x mult
            ops): each tensor that fits the workspace at SRAM rate, each larger one through DRAM;
            ``resident`` bytes stay inside the op's tiles (SRAM)."""
            us = resident / sram_bw
            wbytes["sram_activations"] += resident * mult
            for nb_ in ([nbytes] if isinstance(nbytes, (int, float)) else nbytes):
                if nb_ <= sram_ws:
                    wbytes["sram_activations"] += nb_ * mult
                    us += nb_ / sram_bw
                else:
                    wbytes["activations"] += nb_ * mult
                    us += nb_ / act_bw
            return us

        def mm(role: str, m: int, kdim: int, ndim: int, bpw: float, peak: float, key="weights") -> None:
            wb = kdim * ndim * bpw
            mult = shape.n_layers if role not in ("lm_head",) else 1
            t[role] = max(2.0 * rows(m) * kdim * ndim / peak, wb / w_bw + act([m * kdim * a, m * ndim * a], mult)) + ov
            wbytes[key] += wb * mult

        def vec(role: str, nbytes: float | list[float], layers: bool = True) -> None:
            t[role] = act(nbytes, shape.n_layers if layers else 1) + ov

        def d2d(role: str, nbytes: float, profiled: bool = True) -> None:
            t[role] = lat + nbytes / link + (ov if profiled else 0.0)

        # --- attention block
        for role, width in (("input_norm", H), ("post_attn_norm", H), ("q_norm", hq * d), ("k_norm", hkv * d)):
            vec(role, [n * width * a] * 2)                           # reads x, writes norm(x)
        mm("q_proj", n, H, hq * d, q["attn_proj_bytes_per_weight"], int8)
        mm("kv_proj", n, H, 2 * hkv * d, q["attn_proj_bytes_per_weight"], int8)
        mm("o_proj", n, hq * d, H, q["attn_proj_bytes_per_weight"], int8)
        vec("rope_q", [n * hq * d * a] * 2)
        vec("rope_k", [n * hkv * d * a] * 2)
        vec("k_scatter", n * hkv * d * q["kv_bytes"])
        vec("v_scatter", n * hkv * d * q["kv_bytes"])
        # flash attention: KV read grows with context; prefill FLOPs are quadratic (causal)
        ctx_eff = past + (n + 1) / 2.0 if prefill else float(ctx)
        attn_flops = 4.0 * n * hq * d * ctx_eff
        kv_read = ctx * hkv * 2 * row
        attn_t = act([n * hq * d * a] * 2, shape.n_layers)              # Q in, output out
        if prefill:
            # query tiles on the GEMM array; each KV block read once (facts.md F3: the data-moving table lists
            # every KV block once), at the weights' sequential rate
            t["attn"] = max(attn_flops / attn_c, kv_read / w_bw + attn_t) + ov
        else:
            # flash decoding (flash_decode): per-block max(DMA, vector work), latency, tree merge
            fd = flash_decode(self.hw, shape, ctx)
            t["attn"] = fd.us + attn_t + ov
        wbytes["kv"] += kv_read * shape.n_layers
        # --- chiplet exchanges: barriers are data-less (CCU, not profiled)
        for role in ("attn_sync", "router_sync", "moe_sync"):
            d2d(role, 0.0, profiled=False)
        if prefill:
            d2d("attn_dyn_d2d", n * H * a)
            d2d("moe_dyn_d2d", n * H * a)
            vec("attn_gather", [n * H * a] * 2)
            vec("moe_gather", [n * H * a] * 2)
            vec("router_gather", [n * Ec * a] * 2)
        else:  # decode gathers read the peer's partials over the link
            d2d("attn_gather", n * H * a)
            d2d("moe_gather", n * H * a)
            d2d("router_gather", n * Ec * a)
        vec("attn_residual", [n * H * a] * 4)                        # four hidden-sized tensors (residual add + copy)
        vec("moe_residual", [n * H * a] * 4)
        # --- MoE block (MoE tiles): the dispatch is an index (token ids + weights per expert); the grouped
        # GEMMs gather their rows by it and keep each tile's intermediate (rows x expert_ffn) in SRAM, so
        # gate -> up -> SiLU -> multiply -> down never writes the n x k x expert_ffn tensors to DRAM
        idx = n * k * (4 + a)                                        # int32 token id + BF16 weight per choice
        mm("router", n, H, Ec, q["router_bytes_per_weight"], fp16)
        vec("gate_pre", [n * Ec * 2 * a, idx])                       # router logits in, top-k index out
        # restore: down's epilogue stores each output row at its token's slot (a scatter store of 4 KiB rows
        # costs the bytes of a contiguous one), so the restore op only reads the index and the weights
        vec("gate_post", [idx])
        vec("expert_reduce", [n * k * H * a, n * H * a])             # weighted sum over top-k
        t["silu"] = act(0.0, shape.n_layers, resident=2 * n * k * Fc * a) + ov
        t["multiply"] = act(0.0, shape.n_layers, resident=3 * n * k * Fc * a) + ov
        r = n * k / touched                                          # tokens per touched expert
        e_w = touched * H * Fc * q["expert_bytes_per_weight"]        # (n_layers,)
        # per grouped GEMM: gate and up read the gathered rows (n x k x hidden), down writes its outputs
        # (n x k x hidden); the expert intermediate is tile-resident
        e_act_t = act([n * k * H * a], 3 * shape.n_layers, resident=n * k * Fc * a)
        e_flops = 2.0 * touched * rows(r) * H * Fc
        e_t = np.maximum(e_flops / fp16, e_w / w_bw + e_act_t) + ov
        for role in ("expert_gate", "expert_up", "expert_down"):
            t[role] = e_t
        wbytes["weights"] += 3 * float(e_w.sum())
        # --- outside the layers
        # the embedding rows are gathered from the DRAM table (one data-moving entry, facts.md F3) into
        # the hidden buffer both chips read
        t["embedding"] = n * H * q["embedding_bytes_per_weight"] / act_bw + act(n * H * a, 1) + ov
        wbytes["activations"] += n * H * q["embedding_bytes_per_weight"]
        d2d("embed_sync", 0.0)                                       # a barrier: chip1 reads the rows chip0 wrote
        vec("layout_in", [n * H * a] * 2, layers=False)
        vec("layout_out", [n * H * a] * 2, layers=False)
        vec("final_norm", [H * a] * 2, layers=False)                 # last row only
        mm("lm_head", 1, H, Vc, q["lm_head_bytes_per_weight"], int8, key="lm_head")
        d2d("logits_gather", Vc * a)
        d2d("logits_sync", 0.0)
        return t, wbytes

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


def assemble_step(p: _Prepared, kind: str, n_tokens: int, past_len: int, op_us: np.ndarray, scale: np.ndarray, *,
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


@lru_cache(maxsize=1)
def default_cost_model() -> CostModel:
    """The shipped model (cached)."""
    return CostModel.load()
