"""Per-chip memory plan of the calbin (facts.md F4, report §7).

Units: every ``*_bytes`` is bytes (int); GiB = 2**30 B, MiB = 2**20 B.

What is derived from :class:`~sim_backend.bundle.shapes.ModelShape` and what is taken
from the report:

* derived: the KV cache (BF16, 2 of 4 KV heads per chip:
  ``48 x 2 x 2 x 128 x 2 B x 40960 = 1.875 GiB`` per chip), the BF16 embedding
  table on chip0 (``151936 x 2048 x 2 B = 0.580 GiB``, exactly the chip0 -
  chip1 parameter difference in F4), the logits per token
  (``151936 x 2 B = 303,872 B``);
* taken from F4 via ``hardware/calculet_npu.yaml`` (``memory:``): chip1's
  parameter bytes in DRAM (8.165 GiB: compiler layout and quantisation scales
  we cannot reproduce exactly — the model-derived estimate, 8.173 GiB, is
  reported alongside), the parameter files, the SRAM parameter window
  (14.381 MiB), the DRAM (14.075 GiB) and SRAM (16.844 MiB) reservations and
  the tensor address unions (decode 10.634 GiB, prefill 14.091 GiB per-chip
  plan);
* remainders: DRAM workspace = reservation - parameters - KV; SRAM workspace
  = SRAM reservation - parameter window.  Address ranges alias over
  lifetimes (facts.md F4), so the workspace is a reservation, not a live peak.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.hwspec import HardwareSpec

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Region:
    """One region of one chip's memory.

    Attributes:
        name: ``parameters``, ``kv_cache``, ``workspace`` (DRAM) or
            ``param_window``, ``sram_workspace`` (SRAM).
        used_bytes: bytes in use now (KV: used tokens x bytes per token).
        reserved_bytes: bytes the plan reserves for it.
        physical_bytes: physical capacity of the memory it lives in (per chip).
        kind: ``"dram"`` or ``"sram"``.
    """

    name: str
    used_bytes: int
    reserved_bytes: int
    physical_bytes: int
    kind: Literal["dram", "sram"] = "dram"


def dense_param_bytes(shape: ModelShape, hw: HardwareSpec) -> list[int]:
    """Parameter bytes per chip of a dense (``llama_dense``) model, derived from its shapes and the
    bundle's bytes per weight: each chip's share of the Q/K/V/O heads (uneven when the KV heads do
    not divide: chip0 holds the extra one) and of the MLP columns, BF16 norms on both chips, the
    embedding table (``embed_bytes_per_weight``) on chip0, and the LM head's vocabulary half on each
    chip (a tied head is a copy of the embedding's rows, so chip0 holds the table twice: once to
    gather rows, once laid out for the matmul)."""
    q = hw.quantisation
    C, H, d, L = shape.n_chips, shape.hidden, shape.head_dim, shape.n_layers
    out = []
    for c, (hq, hkv) in enumerate(zip(shape.q_heads_split(), shape.kv_heads_split(), strict=True)):
        fc = shape.ffn // C + (1 if c < shape.ffn % C else 0)
        vc = shape.vocab // C + (1 if c < shape.vocab % C else 0)
        layer = (2 * H * hq * d + 2 * H * hkv * d + 3 * H * fc) * shape.proj_bytes_per_weight
        norms = (2 * H * L + H) * q["norm_bytes_per_weight"]
        lm = H * vc * shape.embed_bytes_per_weight
        emb = shape.vocab * H * shape.embed_bytes_per_weight if c == 0 else 0
        out.append(int(L * layer + norms + lm + emb))
    return out


def estimate_param_bytes(shape: ModelShape, hw: HardwareSpec) -> list[int]:
    """Model-derived parameter bytes per chip from the YAML's bytes/weight per role.

    A cross-check of F4 (8.745 / 8.165 GiB), not used by the plan: at full size
    it gives ~8.752 / 8.173 GiB. A dense model: :func:`dense_param_bytes` (what its plan uses).
    """
    if not shape.is_moe:
        return dense_param_bytes(shape, hw)
    q = hw.quantisation
    C = shape.n_chips
    H, d, L = shape.hidden, shape.head_dim, shape.n_layers
    hq, hkv = shape.n_q_heads // C, shape.n_kv_heads // C
    attn = L * (2 * H * hq * d + H * 2 * hkv * d) * q["attn_proj_bytes_per_weight"]
    router = L * H * (shape.n_experts // C) * q["router_bytes_per_weight"]
    experts = L * shape.n_experts * 3 * H * (shape.expert_ffn // C) * q["expert_bytes_per_weight"]
    lm_head = H * (shape.vocab // C) * q["lm_head_bytes_per_weight"]
    norms = (L * (2 * H + 2 * d) + H) * q["norm_bytes_per_weight"]
    shared = int(attn + router + experts + lm_head + norms)
    return [shared + (embedding_bytes(shape, hw) if c == 0 else 0) for c in range(C)]


def embedding_bytes(shape: ModelShape, hw: HardwareSpec) -> int:
    """BF16 embedding table, chip0 only: vocab x hidden x 2 B = 622,329,856 B (0.580 GiB, F4)."""
    return int(shape.vocab * shape.hidden * hw.quantisation["embedding_bytes_per_weight"])


@dataclass(frozen=True)
class MemoryPlan:
    """Per-chip memory plan (facts.md F4).

    Attributes:
        shape: the model.
        chips: per chip, its regions (DRAM first, then SRAM).
        kv_used_tokens: KV cells in use (tokens); sets the KV region's ``used_bytes``.
        kv_bytes_per_token: per chip, BF16 K+V of one token over all layers (49,152 B).
        param_file_bytes: per chip, ``param_blk*.bin`` size (F4, taken).
        param_estimate_bytes: per chip, model-derived cross-check (not used by the plan).
        address_union_bytes: ``{"decode", "prefill"}`` tensor address union of the
            per-chip plan (F4, taken; prefill ~ DRAM + SRAM reservation).
        logits_bytes_per_token: logits D2H per token, derived from the shape's ``logits_dtype``
            (BF16: 303,872 B; the pilot's F32 C3 calbin: 196,608 B).
    """

    shape: ModelShape
    chips: tuple[tuple[Region, ...], ...]
    kv_used_tokens: int
    kv_bytes_per_token: int
    param_file_bytes: tuple[int, ...]
    param_estimate_bytes: tuple[int, ...]
    address_union_bytes: dict[str, int]
    logits_bytes_per_token: int

    @classmethod
    def for_bundle(cls, shape: ModelShape | None = None, hw: HardwareSpec | None = None,
                   kv_used_tokens: int = 0) -> MemoryPlan:
        """Build the plan for ``shape`` (default full Qwen3-30B-A3B) on ``hw`` (default shipped YAML)."""
        shape = shape or ModelShape()
        hw = hw or HardwareSpec.load()
        if not shape.is_moe:
            return cls._dense(shape, hw).with_kv_used(kv_used_tokens)
        m, h = hw.memory, hw.hardware
        C = shape.n_chips
        dram_phys = int(round(h["dram_physical_gib"] * GiB))
        sram_phys = int(round(h["sram_physical_mib"] * MiB))
        shared_params = int(round(m["param_dram_shared_gib"] * GiB))
        emb = embedding_bytes(shape, hw)
        kv_tok = shape.kv_bytes_per_token_per_chip
        kv_res = kv_tok * shape.n_ctx
        dram_res = int(round(m["dram_reservation_gib"] * GiB))
        sram_res = int(round(m["sram_reservation_mib"] * MiB))
        window = int(round(m["param_sram_window_mib"] * MiB))
        chips = []
        for c in range(C):
            params = shared_params + (emb if c == 0 else 0)   # embedding table on chip0 only
            work = dram_res - params - kv_res
            if work < 0:
                raise ValueError(f"chip{c}: parameters + KV exceed the DRAM reservation")
            chips.append((
                Region("parameters", params, params, dram_phys, "dram"),
                Region("kv_cache", 0, kv_res, dram_phys, "dram"),
                Region("workspace", work, work, dram_phys, "dram"),
                Region("param_window", window, window, sram_phys, "sram"),
                Region("sram_workspace", sram_res - window, sram_res - window, sram_phys, "sram"),
            ))
        files = m["param_file_gib"]
        plan = cls(
            shape=shape, chips=tuple(chips), kv_used_tokens=0, kv_bytes_per_token=kv_tok,
            param_file_bytes=tuple(int(round(g * GiB)) for g in files),
            param_estimate_bytes=tuple(estimate_param_bytes(shape, hw)),
            address_union_bytes={k: int(round(v * GiB)) for k, v in m["address_union_gib"].items()},
            logits_bytes_per_token=shape.logits_bytes_per_token,
        )
        return plan.with_kv_used(kv_used_tokens)

    @classmethod
    def _dense(cls, shape: ModelShape, hw: HardwareSpec) -> MemoryPlan:
        """The plan of a dense model, every figure derived from its shapes (none is F4's, which are the
        Qwen3 calbin's): parameters from :func:`dense_param_bytes`; KV = BF16 K+V of the chip's KV heads
        x context; DRAM workspace = the prefill's activations at the full context (the residual stream,
        Q/K/V, the MLP's gate and up columns, in and out: ``n_ctx x (2H + (hq + 2 hkv) d + 2 ffn/C) x
        activation bytes``) plus one token's logits; SRAM = the chip's physical SRAM, all workspace (no
        parameter window); address unions: decode = parameters + KV + one token's workspace, prefill =
        the whole reservation."""
        h, q = hw.hardware, hw.quantisation
        C = shape.n_chips
        dram_phys = int(round(h["dram_physical_gib"] * GiB))
        sram_phys = int(round(h["sram_physical_mib"] * MiB))
        params = dense_param_bytes(shape, hw)
        kv_tok = shape.kv_bytes_per_token_per_chip
        kv_res = kv_tok * shape.n_ctx
        per_tok = (2 * shape.hidden + (shape.q_heads_per_chip + 2 * shape.kv_heads_per_chip) * shape.head_dim
                   + 2 * -(-shape.ffn // C)) * q["activation_bytes"]
        work = int(shape.n_ctx * per_tok + shape.logits_bytes_per_token)
        chips = []
        for c in range(C):
            if params[c] + kv_res + work > dram_phys:
                raise ValueError(f"chip{c}: parameters + KV + workspace exceed the chip's DRAM")
            chips.append((
                Region("parameters", params[c], params[c], dram_phys, "dram"),
                Region("kv_cache", 0, kv_res, dram_phys, "dram"),
                Region("workspace", work, work, dram_phys, "dram"),
                Region("param_window", 0, 0, sram_phys, "sram"),
                Region("sram_workspace", sram_phys, sram_phys, sram_phys, "sram"),
            ))
        return cls(
            shape=shape, chips=tuple(chips), kv_used_tokens=0, kv_bytes_per_token=kv_tok,
            param_file_bytes=tuple(params), param_estimate_bytes=tuple(params),
            address_union_bytes={"decode": int(params[0] + kv_res + per_tok + shape.logits_bytes_per_token),
                                 "prefill": int(params[0] + kv_res + work)},
            logits_bytes_per_token=shape.logits_bytes_per_token,
        )

    def with_kv_used(self, tokens: int) -> MemoryPlan:
        """Copy with ``tokens`` KV cells in use on every chip (0..n_ctx)."""
        if not 0 <= tokens <= self.shape.n_ctx:
            raise ValueError(f"KV tokens must be in [0, {self.shape.n_ctx}], got {tokens}")
        used = tokens * self.kv_bytes_per_token
        chips = tuple(tuple(replace(r, used_bytes=used) if r.name == "kv_cache" else r for r in regs)
                      for regs in self.chips)
        return replace(self, chips=chips, kv_used_tokens=tokens)

    def region(self, chip: int, name: str) -> Region:
        for r in self.chips[chip]:
            if r.name == name:
                return r
        raise KeyError(name)

    def reserved_bytes(self, chip: int, kind: str) -> int:
        """Sum of reservations of ``kind`` ("dram"/"sram") on ``chip`` (F4: 14.075 GiB / 16.844 MiB)."""
        return sum(r.reserved_bytes for r in self.chips[chip] if r.kind == kind)

    def used_bytes(self, chip: int, kind: str) -> int:
        return sum(r.used_bytes for r in self.chips[chip] if r.kind == kind)

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict; every size in bytes."""
        return {
            "unit": "bytes",
            "kv_used_tokens": self.kv_used_tokens,
            "kv_bytes_per_token_per_chip": self.kv_bytes_per_token,
            "logits_bytes_per_token": self.logits_bytes_per_token,
            "param_file_bytes": list(self.param_file_bytes),
            "param_estimate_bytes": list(self.param_estimate_bytes),
            "address_union_bytes": dict(self.address_union_bytes),
            "chips": [
                {
                    "chip": c,
                    "dram_reserved_bytes": self.reserved_bytes(c, "dram"),
                    "sram_reserved_bytes": self.reserved_bytes(c, "sram"),
                    "regions": [
                        {"name": r.name, "kind": r.kind, "used_bytes": r.used_bytes,
                         "reserved_bytes": r.reserved_bytes, "physical_bytes": r.physical_bytes}
                        for r in regs
                    ],
                }
                for c, regs in enumerate(self.chips)
            ],
        }
