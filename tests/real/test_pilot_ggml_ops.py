"""The pilot's numerics (``dense_kernels``) against ggml's own CPU operations, bit for bit.

``tests/real/ggml_lib.py`` calls the ggml C API exported by the ``xllamacpp`` wheel: the very code its
llama-server runs for the pilot's GGUF (x86-64, AVX2 + FMA + F16C). Each operation the pilot's step is built
from is computed by both on the same random inputs and must give the same float32 bits: activation
quantisation, Q4_1 x Q8_1 and Q8_0 x Q8_0 products (one product split over two chips' input rows too),
RMSNorm with its weight, RoPE, SwiGLU and flash attention (its one-query path below 64 queries a step
and its tiled path from 64, short and long contexts). Exact equality is the point: a rounding order
that differs anywhere shows up as a differing bit here, long before it swaps a token.
"""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.model.families import dense_attention as da
from sim_backend.model.families import dense_kernels as dk
from sim_backend.model.families import dense_quant as dq

from .ggml_lib import T_F16, T_F32, T_I32, T_Q4_1, T_Q8_0, Ggml, load

F32 = np.float32


@pytest.fixture(scope="module")
def lib():
    # the test extra installs the xllamacpp wheel: a missing wheel or symbol is a failure, not a skip
    return load()


def _scratch():
    return dq.product_scratch()


def _q4_1_blocks(rng, N, K):
    """Random Q4_1 blocks (N rows of K weights): raw bytes (N, K/32*20)."""
    nb = K // 32
    d = rng.uniform(0.001, 0.05, (N, nb)).astype(np.float16)
    m = (-rng.uniform(0.0, 0.4, (N, nb))).astype(np.float16)
    codes = rng.integers(0, 16, (N, nb, 32)).astype(np.uint8)
    raw = np.zeros((N, nb, 20), np.uint8)
    raw[..., 0:2] = d.view(np.uint8).reshape(N, nb, 2)
    raw[..., 2:4] = m.view(np.uint8).reshape(N, nb, 2)
    raw[..., 4:] = codes[..., :16] | (codes[..., 16:] << 4)
    return raw.reshape(N, nb * 20)


def _quantised(x):
    n, K = x.shape
    xq, xd, xs = np.empty((n, K), np.int8), np.empty((n, K // 32), F32), np.empty((n, K // 32), F32)
    dq.quantise_rows(x, xq, xd, xs)
    return xq, xd, xs


def _ggml_matmul(lib, typ, raw, N, K, x):
    with Ggml(lib) as g:
        w = g.tensor(typ, (N, K), raw)
        return g.compute(lib.ggml_mul_mat(g.ctx, w, g.tensor(T_F32, x.shape, x)), (x.shape[0], N))


def test_activation_quantisation_is_quantize_row_q8_1(lib):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((6, 1536)) * np.array([1e-3, 0.1, 1, 10, 300, 0.0])[:, None]).astype(F32)
    xq, xd, xs = _quantised(x)
    for i in range(x.shape[0]):
        raw = np.zeros(x.shape[1] // 32 * 36, np.uint8)
        lib.quantize_row_q8_1(x[i].ctypes.data, raw.ctypes.data, x.shape[1])
        b = raw.reshape(-1, 36)
        assert np.array_equal(b[:, 0:2].copy().view(np.float16)[:, 0].astype(F32), xd[i])
        assert np.array_equal(b[:, 2:4].copy().view(np.float16)[:, 0].astype(F32), xs[i])
        assert np.array_equal(b[:, 4:].copy().view(np.int8).astype(F32).ravel(), xq[i])


@pytest.mark.parametrize(("n", "K", "N"), [(1, 576, 960), (5, 1536, 576), (13, 576, 3072), (2, 64, 13)])
def test_q4_1_product_is_ggml_mul_mat(lib, n, K, N):
    rng = np.random.default_rng(n * 7 + K)
    raw = _q4_1_blocks(rng, N, K)
    x = (rng.standard_normal((n, K)) * 2.5).astype(F32)
    ref = _ggml_matmul(lib, T_Q4_1, raw, N, K, x)
    out = np.empty((n, N), F32)
    dq.quant_matmul(*dq.pack_q4_1(*dq.split_q4_1(raw, N, K)), True, *_quantised(x), _scratch(), out)
    assert np.array_equal(out, ref), np.abs(out - ref).max()


def test_q8_0_lm_head_product_is_ggml_mul_mat(lib):
    rng = np.random.default_rng(3)
    N, K, nb = 3000, 576, 18
    d = rng.uniform(0.001, 0.05, (N, nb)).astype(np.float16)
    codes = rng.integers(-127, 128, (N, nb, 32)).astype(np.int8)
    raw = np.zeros((N, nb, 34), np.uint8)
    raw[..., :2] = d.view(np.uint8).reshape(N, nb, 2)
    raw[..., 2:] = codes.view(np.uint8)
    raw = raw.reshape(N, nb * 34)
    x = (rng.standard_normal((1, K)) * 3).astype(F32)
    ref = _ggml_matmul(lib, T_Q8_0, raw, N, K, x)
    out = np.empty((1, N), F32)
    dq.quant_matmul(*dq.pack_q8_0(*dq.split_q8_0(raw, N, K)), False, *_quantised(x), _scratch(), out)
    assert np.array_equal(out, ref), np.abs(out - ref).max()


def test_a_product_split_over_two_chips_rows_is_one_ggml_product(lib):
    """The down projection's input rows 768 + 768 on two chips: the chained lanes give ggml's one product."""
    rng = np.random.default_rng(4)
    n, K, N, split = 9, 1536, 576, 768
    raw = _q4_1_blocks(rng, N, K)
    x = (rng.standard_normal((n, K)) * 0.7).astype(F32)
    ref = _ggml_matmul(lib, T_Q4_1, raw, N, K, x)
    codes, d, m = dq.split_q4_1(raw, N, K)
    parts = [slice(0, split), slice(split, K)]
    packed = [dq.pack_q4_1(np.ascontiguousarray(codes[:, s]), np.ascontiguousarray(d[:, s.start // 32:s.stop // 32]),
                           np.ascontiguousarray(m[:, s.start // 32:s.stop // 32])) for s in parts]
    cw, dw, mw = (tuple(p[i][None] for p in packed) for i in range(3))
    q = [_quantised(np.ascontiguousarray(x[:, s])) for s in parts]
    xq, xd, xs = (np.stack([qi[j] for qi in q]) for j in range(3))
    out = np.zeros((n, N), F32)
    dq.chained_matmul(cw, dw, mw, 0, xq, xd, xs, _scratch(), out, False)
    assert np.array_equal(out, ref), np.abs(out - ref).max()


def test_rms_norm_with_weight_is_ggml(lib):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 576)) * 3).astype(F32)
    w = rng.standard_normal(576).astype(F32)
    with Ggml(lib) as g:
        t = lib.ggml_mul(g.ctx, lib.ggml_rms_norm(g.ctx, g.tensor(T_F32, x.shape, x), F32(1e-5)),
                         g.tensor(T_F32, w.shape, w))
        ref = g.compute(t, x.shape)
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        dk.rms_norm_row(x[i], w, F32(1e-5), out[i])
    assert np.array_equal(out, ref)


def test_rope_is_ggml_rope_ext_normal_mode(lib):
    rng = np.random.default_rng(6)
    n, nh, D, theta = 30, 4, 64, 100000.0
    x = (rng.standard_normal((n, nh, D)) * 3).astype(F32)
    pos = (np.arange(n) * 277 + 3).astype(np.int32)  # up to ~8000: angles where libm's cosf is not the float64 cos
    with Ggml(lib) as g:
        t = lib.ggml_rope_ext(g.ctx, g.tensor(T_F32, x.shape, x), g.tensor(T_I32, pos.shape, pos), None, D, 0, 8192,
                              theta, 1.0, 0.0, 1.0, 32.0, 1.0)
        ref = g.compute(t, x.shape)
    cos, sin = dk.rope_tables(pos.astype(np.int64), D, theta)
    y = x.reshape(n, nh * D).copy()
    for i in range(n):
        dk.rope_rotate(y[i], nh, D, cos[i], sin[i])
    assert np.array_equal(y.reshape(x.shape), ref)


def test_swiglu_is_ggml_swiglu_split(lib):
    rng = np.random.default_rng(7)
    f = 1536
    gate = (rng.standard_normal((3, f)) * 5).astype(F32)
    gate[0, :7] = [-100.0, -130.0, 90.0, 0.0, -0.0, 200.0, -87.5]  # ggml_v_expf's slow path and its limits
    up = rng.standard_normal((3, f)).astype(F32)
    with Ggml(lib) as g:
        ref = g.compute(lib.ggml_swiglu_split(g.ctx, g.tensor(T_F32, gate.shape, gate), g.tensor(T_F32, up.shape, up)),
                        gate.shape)
    act = np.empty_like(gate)
    with np.errstate(over="ignore"):
        dk.swiglu(np.ascontiguousarray(np.concatenate([gate, up], axis=1)), f, act)
    assert np.array_equal(act, ref, equal_nan=True)


@pytest.mark.parametrize(("nq", "used", "nkv", "scattered"),
                         [(1, 1, 256, False), (1, 200, 256, False), (7, 40, 256, False), (63, 100, 256, False),
                          (64, 64, 256, False), (130, 200, 256, False), (1, 600, 1024, False), (3, 150, 256, True),
                          (70, 150, 256, True)])
def test_flash_attention_is_ggml_flash_attn_ext(lib, nq, used, nkv, scattered):
    """3 query heads on 1 KV head, F16 K/V, causal mask: the last ``nq`` of ``used`` positions query.
    ``scattered``: our cache holds the keys in shuffled cells of a larger cache (a sequence whose cells are
    not one run): the same result."""
    rng = np.random.default_rng(nq * 1000 + used)
    nh, D = 3, 64
    q = (rng.standard_normal((1, nh, nq, D)) * 2).astype(F32)
    k = (rng.standard_normal((1, 1, nkv, D)) * 2).astype(np.float16)
    v = rng.standard_normal((1, 1, nkv, D)).astype(np.float16)
    pos_q = np.arange(used - nq, used)
    mask = np.full((1, 1, nq, nkv), -np.inf, np.float16)
    for i in range(nq):
        mask[0, 0, i, : pos_q[i] + 1] = 0
    with Ggml(lib) as g:
        t = lib.ggml_flash_attn_ext(g.ctx, g.tensor(T_F32, q.shape, q), g.tensor(T_F16, k.shape, k),
                                    g.tensor(T_F16, v.shape, v), g.tensor(T_F16, mask.shape, mask), F32(0.125),
                                    F32(0.0), F32(0.0))
        ref = g.compute(t, (nq, nh, D))
    kt, vc = np.ascontiguousarray(k[0, 0].astype(F32).T), v[0, 0].astype(F32)  # K transposed (D, cells) as cached
    cells, ends = np.arange(used, dtype=np.int64), (pos_q + 1).astype(np.int64)
    if scattered:
        cells = rng.permutation(2 * nkv)[:used].astype(np.int64)
        kt2, vc2 = np.zeros((D, 2 * nkv), F32), np.zeros((2 * nkv, D), F32)
        kt2[:, cells], vc2[cells] = kt[:, :used], vc[:used]
        kt, vc = kt2, vc2
    out = np.empty((nq, nh, D), F32)
    T = da.FA_TILE
    for h in range(nh):
        if nq >= T:
            oh = np.empty((nq, D), F32)
            for q0 in range(0, nq, T):
                da.attend_tiled(np.ascontiguousarray(q[0, h]), q0, min(T, nq - q0), kt, vc, cells, ends, D, F32(0.125),
                                np.empty(T, F32), np.empty(T, F32), np.empty(T, F32), np.empty((T, D), F32),
                                np.empty((D, T), F32), oh)
            out[:, h] = oh
        else:
            for i in range(nq):
                da.attend_one(q[0, h, i], kt, vc, cells, ends[i], D, F32(0.125), np.empty(D, F32), np.empty(D, F32),
                              np.empty(used, F32), np.empty(used, F32), np.empty((D, used), F32), out[i, h])
    assert np.array_equal(out, ref), np.abs(out - ref).max()
