"""Roofline prices of a dense Llama-family step (the pilot), per op role, in SIMULATED µs.

The same roofline terms as :func:`sim_backend.model.families.moe_cost.moe_role_costs` (GenZ
``get_roofline``: ``max(flops / (peak * eff), bytes / (bw * eff)) + per_op_overhead_us``; chiplet
exchanges ``d2d_latency_us + bytes / (link * d2d_eff)``) and the same hardware and fitted
parameters (``hardware/calculet_npu.yaml``); what differs is derived from the model family and
its shapes, never from Qwen constants:

* one SwiGLU MLP per layer (gate/up columns and down rows split over the chips), no router or
  experts; dense GEMMs of prefill are tile-padded like the expert GEMMs (``prefill_m_tile``);
* heads split by KV group, unevenly when they do not divide (3 KV heads over 2 chips: 2 and 1).
  Every op is priced at the busiest chip's share (chip0's), since both chips meet at the next
  barrier and the busier one gates it; the other chip's attention ops are so over-stated by at
  most the share difference (the pilot: 1 of 3 KV heads);
* bytes per weight are the bundle's (``ModelShape.proj_bytes_per_weight`` for the layers' matrices,
  ``embed_bytes_per_weight`` for the embedding and, tied, the LM head): the GGUF's own formats,
  since a vendor-compiled pilot calbin (status C3) would keep them. They run on the FP16 array
  (weights dequantised on the fly, W4A16 / W8A16): ``peak_fp16_tflops * fp16_compute_eff``;
* the SRAM workspace is the chip's physical SRAM (``hardware.sram_physical_mib``): the pilot's
  parameters are not mapped to an SRAM window, so a compiler would leave all of it to activations.
"""

from __future__ import annotations

import math
from typing import Any

from sim_backend.bundle.shapes import ModelShape
from sim_backend.model.attention_cost import flash_decode


def dense_role_costs(hw_spec: Any, shape: ModelShape, kind: str, n: int, past: int
                     ) -> tuple[dict[str, Any], dict[str, float]]:
    """Per-role simulated µs of one step of the dense family, and DRAM bytes per chip by stream.

    Args:
        hw_spec: a :class:`~sim_backend.model.hwspec.HardwareSpec`.
        shape: a ``llama_dense`` :class:`ModelShape` (``ffn`` > 0, bytes per weight set).
        kind: "prefill" or "decode"; n: tokens in the step; past: tokens already in the KV cache.
    Returns:
        ``(t, bytes)``: ``t[role]`` float µs for every role of the dense op graph
        (:func:`sim_backend.model.opgraph.build_graph`), ``bytes`` with keys ``weights``,
        ``lm_head``, ``kv``, ``activations``, ``sram_activations`` (bytes per chip).
    Raises:
        ValueError: the shape is not a dense one or lacks its bytes per weight.
    """
    if shape.is_moe or shape.ffn <= 0:
        raise ValueError(f"dense_role_costs prices a llama_dense shape, got family {shape.family} ffn {shape.ffn}")
    if shape.proj_bytes_per_weight <= 0 or shape.embed_bytes_per_weight <= 0:
        raise ValueError("a dense shape needs proj_bytes_per_weight and embed_bytes_per_weight (from its bundle)")
    hw, q, f = hw_spec.hardware, hw_spec.quantisation, hw_spec.fitted
    prefill = kind == "prefill"
    C = shape.n_chips
    H, d, L = shape.hidden, shape.head_dim, shape.n_layers
    hq, hkv = shape.q_heads_per_chip, shape.kv_heads_per_chip           # the busiest chip's share
    Fc = max(math.ceil(shape.ffn / C), 1)
    Vc = math.ceil(shape.vocab / C)
    a = q["activation_bytes"]
    wpb, epb = shape.proj_bytes_per_weight, shape.embed_bytes_per_weight
    ctx = past + n

    bw = hw["dram_bw_gbps"] * 1e3                                       # bytes per µs
    w_bw, act_bw = bw * f["weight_stream_eff"], bw * f["activation_eff"]
    row = d * q["kv_bytes"]
    sram_ws = hw["sram_physical_mib"] * 2**20
    sram_bw = hw["sram_bw_gbps"] * 1e3
    link = hw["d2d_link_gbps"] * 1e3 * f["d2d_eff"]
    lat = hw["d2d_latency_us"]
    fp16 = hw["peak_fp16_tflops"] * 1e6 * f["fp16_compute_eff"]        # ops per µs
    attn_c = hw["peak_fp16_tflops"] * 1e6 * f["attn_compute_eff"]
    ov = f["per_op_overhead_us"]
    tile = f["prefill_m_tile"]
    rows = max(n, tile) if prefill else n

    t: dict[str, Any] = {}
    b = {"weights": 0.0, "lm_head": 0.0, "kv": 0.0, "activations": 0.0, "sram_activations": 0.0}

    def act(nbytes: float, mult: float) -> float:
        if nbytes <= sram_ws:
            b["sram_activations"] += nbytes * mult
            t_sram: float = nbytes / sram_bw
            return t_sram
        b["activations"] += nbytes * mult
        t_dram: float = nbytes / act_bw
        return t_dram

    def mm(role: str, kdim: int, ndim: int, bpw: float, key: str = "weights", layers: bool = True) -> None:
        m = 1 if role == "lm_head" else n
        mult = L if layers else 1
        wb = kdim * ndim * bpw
        r = 1 if role == "lm_head" else rows
        t[role] = max(2.0 * r * kdim * ndim / fp16, wb / w_bw + act((m * kdim + m * ndim) * a, mult)) + ov
        b[key] += wb * mult

    def vec(role: str, nbytes: float, layers: bool = True) -> None:
        t[role] = act(nbytes, L if layers else 1) + ov

    def d2d(role: str, nbytes: float, profiled: bool = True) -> None:
        t[role] = lat + nbytes / link + (ov if profiled else 0.0)

    # --- attention block
    vec("input_norm", 2 * n * H * a)
    vec("post_attn_norm", 2 * n * H * a)
    mm("q_proj", H, hq * d, wpb)
    mm("kv_proj", H, 2 * hkv * d, wpb)
    mm("o_proj", hq * d, H, wpb)
    vec("rope_q", 2 * n * hq * d * a)
    vec("rope_k", 2 * n * hkv * d * a)
    vec("k_scatter", n * hkv * d * q["kv_bytes"])
    vec("v_scatter", n * hkv * d * q["kv_bytes"])
    ctx_eff = past + (n + 1) / 2.0 if prefill else float(ctx)
    attn_flops = 4.0 * n * hq * d * ctx_eff
    kv_read = ctx * hkv * 2 * row
    attn_t = act(2 * n * hq * d * a, L)
    if prefill:  # query tiles on the array, each KV block read once at the weights' sequential rate
        t["attn"] = max(attn_flops / attn_c, kv_read / w_bw + attn_t) + ov
    else:  # flash decoding by mechanism, as the MoE family's (attention_cost.flash_decode, shapes only)
        t["attn"] = flash_decode(hw_spec, shape, ctx).us + attn_t + ov
    b["kv"] += kv_read * L
    # --- chiplet exchanges at the same kinds of sync points: a data-less barrier, then the gather
    for role in ("attn_sync", "mlp_sync"):
        d2d(role, 0.0, profiled=False)
    if prefill:
        d2d("attn_dyn_d2d", n * H * a)
        d2d("mlp_dyn_d2d", n * H * a)
        vec("attn_gather", 2 * n * H * a)
        vec("mlp_gather", 2 * n * H * a)
    else:
        d2d("attn_gather", n * H * a)
        d2d("mlp_gather", n * H * a)
    vec("attn_residual", 4 * n * H * a)
    vec("mlp_residual", 4 * n * H * a)
    # --- SwiGLU MLP, this chip's columns
    mm("mlp_gate", H, Fc, wpb)
    mm("mlp_up", H, Fc, wpb)
    mm("mlp_down", Fc, H, wpb)
    vec("silu", 2 * n * Fc * a)
    vec("multiply", 3 * n * Fc * a)
    # --- outside the layers
    t["embedding"] = n * H * epb / act_bw + act(n * H * a, 1) + ov
    b["activations"] += n * H * epb
    d2d("embed_sync", n * H * a)
    vec("layout_in", 2 * n * H * a, layers=False)
    vec("layout_out", 2 * n * H * a, layers=False)
    vec("final_norm", 2 * H * a, layers=False)
    mm("lm_head", H, Vc, epb, key="lm_head", layers=False)
    d2d("logits_gather", Vc * shape.logits_itemsize)  # chip1's half of the logits, in the D2H dtype
    d2d("logits_sync", 0.0)
    return t, b
