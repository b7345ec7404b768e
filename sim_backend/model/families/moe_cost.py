"""Roofline prices of a Qwen3-MoE step, per op role, in SIMULATED µs (the op family of the full model).

The method is :mod:`sim_backend.model.costmodel`'s (GenZ ``get_roofline`` with a separate
efficiency per byte stream, SRAM tiling, chiplet exchanges); this module holds what is the MoE
family's own: the router, the grouped expert GEMMs priced by the experts a layer touches
(:func:`expected_experts_touched`, :func:`priced_experts_touched`) and the sharding of facts.md F3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.attention_cost import flash_decode
from sim_backend.model.hwspec import HardwareSpec, sram_workspace_bytes


def expected_experts_touched(n_tokens: int, n_experts: int = 128, k: int = 8) -> float:
    """Expected distinct experts n tokens touch in one layer: ``E·(1 - ((E-k)/E)^n)``.

    27 tokens -> 105.6; 1 token -> 8 (STYLE.md "Simulators").
    """
    return n_experts * (1.0 - ((n_experts - k) / n_experts) ** n_tokens)


def priced_experts_touched(router_touched: Sequence[int], n_tokens: int, n_experts: int = 128,
                           k: int = 8) -> NDArray[np.float64]:
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
    out: NDArray[np.float64] = np.clip(scaled, min(float(k), hi), hi)
    return out


def moe_role_costs(hw_spec: HardwareSpec, shape: ModelShape, kind: str, n: int, past: int,
                   touched: NDArray[np.float64]) -> tuple[dict[str, Any], dict[str, float]]:
    """Per-role simulated µs of one step of the MoE family, and DRAM bytes per chip by stream.

    Args:
        hw_spec: the hardware and fitted parameters.
        shape: a MoE :class:`ModelShape`.
        kind: "prefill" or "decode"; n: tokens in the step; past: tokens already in the KV cache.
        touched: float64 ``(n_layers,)`` distinct experts per layer to price the expert weights with.
    Returns:
        ``(t, bytes)``: ``t[role]`` µs (a float, or an ``(n_layers,)`` array for the expert roles)
        for every role of the MoE op graph, ``bytes`` with keys ``weights``, ``lm_head``, ``kv``,
        ``activations``, ``sram_activations`` (bytes per chip).
    """
    hw, q, f = hw_spec.hardware, hw_spec.quantisation, hw_spec.fitted
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
    sram_ws = sram_workspace_bytes(hw_spec)
    sram_bw: float = hw["sram_bw_gbps"] * 1e3
    link = hw["d2d_link_gbps"] * 1e3 * f["d2d_eff"]
    lat = hw["d2d_latency_us"]
    int8 = hw["peak_int8_tops"] * 1e6 * f["int8_compute_eff"]      # ops per µs
    fp16 = hw["peak_fp16_tflops"] * 1e6 * f["fp16_compute_eff"]
    attn_c = hw["peak_fp16_tflops"] * 1e6 * f["attn_compute_eff"]
    ov = f["per_op_overhead_us"]
    tile: float = f["prefill_m_tile"]  # an integer (hwspec checks it)

    def rows(m: float) -> float:
        """Rows an op of m tokens computes: a prefill's are padded to its m tile."""
        return max(m, tile) if prefill else m

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

    def mm(role: str, m: int, kdim: int, ndim: int, bpw: float, peak: float, key: str = "weights") -> None:
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
        fd = flash_decode(hw_spec, shape, ctx)
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
    e_flops = 2.0 * touched * (np.maximum(r, tile) if prefill else r) * H * Fc
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
