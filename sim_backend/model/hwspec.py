"""The hardware YAML (``hardware/calculet_npu.yaml``) as a checked, read-only :class:`HardwareSpec`.

Every number the cost model and the memory plan read: peaks, bandwidths and latencies of the
chiplets (``hardware``), bytes per weight and element (``quantisation``), the memory plan
(``memory``) and the fitted parameters (``fitted``), each checked against a wide range on load so
a typo cannot reach the simulator as inf, nan, 0 or 1e300 (:class:`~sim_backend.errors.ManifestError`).
"""

from __future__ import annotations

import math
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from sim_backend import safe_yaml
from sim_backend.bundle.manifest import bounded_repr
from sim_backend.errors import ManifestError

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
    reservation_mib: float = hw.memory["sram_reservation_mib"]
    window_mib: float = hw.memory["param_sram_window_mib"]
    return max(0.0, (reservation_mib - window_mib) * 2**20)
