"""The compiled kernels against the numpy reference they replace.

Bounds, not bits: the kernels sum in another order than BLAS (and use their own exp), so float32
results differ in the last bits. Token ids are compared exactly (one machine, greedy), except where
the reference's two best logits tie within the drift bound.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape, NumericShape
from sim_backend.model import attention_kernels as KA
from sim_backend.model import golden as G
from sim_backend.model import kernel_cache as KC
from sim_backend.model import kernels as K
from sim_backend.model.layer_ops import apply_rope, prefill_attention, rms_norm, rope_tables, route
from sim_backend.model.numerics import ShardedModel, kernels_choice

SHAPE = ModelShape()
NUM = NumericShape()
F = np.float32
RNG = np.random.default_rng(7)


def test_exp_within_two_ulp_and_its_edges():
    x = np.linspace(-86.8, 88.7, 400_001, dtype=F)
    out = np.empty_like(x)
    for i in range(0, x.size, 50_000):  # scalar kernel, called through a tiny compiled loop below
        _exp_rows(x[i:i + 50_000], out[i:i + 50_000])
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) <= 2 * 2.0**-24
    edge = np.array([np.nan, np.inf, -np.inf, 100.0, -100.0, 0.0], dtype=F)
    got = np.empty_like(edge)
    _exp_rows(edge, got)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == 0.0 and got[3] == np.inf and got[4] == 0.0
    assert got[5] == 1.0


def test_exp_in_range_gives_exp_f32s_bits_on_its_range():
    """The decode attention's unclamped exp is ``exp_f32``'s own code: the same bits wherever it may be used."""
    x = np.linspace(-86.9, 88.7, 200_001, dtype=F)
    want = np.empty_like(x)
    _exp_rows(x, want)
    got = x.copy()
    K.exp_in_range(got)
    assert np.array_equal(got, want)


def _exp_rows(x, out):
    out[:] = x
    KA.exp_shift(out, F(0.0))


def test_rms_norm_matvec_and_bf16_matvec_match_numpy():
    x = RNG.standard_normal(64).astype(F)
    w = RNG.standard_normal(64).astype(F)
    out = np.empty_like(x)
    K.rms_norm(x, w, F(1e-6), out)
    np.testing.assert_allclose(out, rms_norm(x, w, 1e-6), rtol=2e-6, atol=1e-6)
    W = RNG.standard_normal((64, 320)).astype(F)
    o = np.empty(320, F)
    K.matvec(x, W, o)
    np.testing.assert_allclose(o, x @ W, rtol=1e-5, atol=1e-5)
    # BF16 weights: N not a multiple of the block, bias added; exact widening, so only summation order differs
    bits = (RNG.standard_normal((64, 5000)).astype(F).view(np.uint32) >> 16).astype(np.uint16)
    bias = RNG.standard_normal(5000).astype(F)
    got = np.empty(5000, F)
    K.bf16_matvec(x, K.bf16_blocks(bits), bias, got)
    want = x @ (bits.astype(np.uint32) << 16).view(F) + bias
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_head_norm_rope_matches_numpy():
    qk = RNG.standard_normal((18, 16)).astype(F)
    w = (1 + 0.1 * RNG.standard_normal((18, 16))).astype(F)
    cos, sin = rope_tables(np.array([1234]), 16, 1e6)
    want = apply_rope(rms_norm(qk[None], w, 1e-6), cos, sin)[0]
    got = qk.copy()
    K.head_norm_rope(got, w, cos[0], sin[0], F(1e-6))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_softmax_top_k_matches_the_router():
    h = RNG.standard_normal((6, 64)).astype(F)
    router = (RNG.standard_normal((64, 128)) * 0.25).astype(F)
    ids_ref, w_ref = route(h, router, 8)
    for i in range(6):
        logits = h[i] @ router
        ids, w = np.empty(8, np.int64), np.empty(8, F)
        K.softmax_top_k(logits, 8, ids, w)
        assert ids.tolist() == ids_ref[i].tolist()
        np.testing.assert_allclose(w, w_ref[i], rtol=1e-5)
    tie = np.zeros(128, F)  # all equal: the lowest ids, in order, weights 1/k
    ids, w = np.empty(8, np.int64), np.empty(8, F)
    K.softmax_top_k(tie, 8, ids, w)
    assert ids.tolist() == list(range(8)) and np.allclose(w, 1 / 8)


def _top_k_by_scans(p: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    """The selection rule written out: k scans, each the largest probability left (strict >, so the
    lowest id among equal ones), -1 where none is left (NaN never chosen)."""
    left = p.astype(np.float64).copy()
    ids, ws = [], []
    for _ in range(k):
        best, bv = -1, -1.0
        for e, v in enumerate(left):
            if v > bv:
                best, bv = e, v
        ids.append(best)
        ws.append(bv)
        if best >= 0:
            left[best] = -1.0
    return ids, ws


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_top_k_picks_what_k_scans_pick_ties_included(seed):
    """The router's one-pass selection gives the ids, in order, that k scans of E give: on logits drawn
    from a handful of values (many exact ties), with k from 1 to E, and with NaN logits among them."""
    rng = np.random.default_rng(seed)
    E = 128
    for k in (1, 3, 8, 17, E):
        logits = rng.choice(np.array([-2.0, -0.5, 0.0, 0.25, 1.0], dtype=F), size=E)
        if seed % 2:
            logits[rng.choice(E, 5, replace=False)] = np.nan
        probs = logits.copy()
        ids, w = np.empty(k, np.int64), np.empty(k, F)
        K.softmax_top_k(probs, k, ids, w)  # probs now the softmax (NaN where a logit was NaN: all NaN)
        want, _ = _top_k_by_scans(probs, k)
        assert ids.tolist() == want, (k, seed)


@pytest.mark.parametrize("T,contiguous,no_max,G_,D", [
    (1, True, True, 8, 16), (700, True, False, 8, 16), (1100, False, True, 8, 16),
    # heads and dimensions past the register tiles (8 heads x 4 dims for scores, 4 x 2 for values)
    (900, True, True, 13, 18), (300, False, False, 3, 5), (200, True, True, 8, 3)])
def test_attend_decode_matches_softmax_attention(T, contiguous, no_max, G_, D):
    cells = 1200
    q = (RNG.standard_normal((G_, D)) * 0.25).astype(F)
    k_t = RNG.standard_normal((D, cells)).astype(F)
    v_t = RNG.standard_normal((D, cells)).astype(F)
    idx = np.arange(T, dtype=np.int64) + 50 if contiguous else RNG.permutation(cells)[:T].astype(np.int64)
    out = np.empty((G_, D), F)
    KA.attend_decode(q, k_t, v_t, int(idx[0]) if contiguous else -1, idx, T, no_max, np.empty((G_, T), F), out)
    s = q.astype(np.float64) @ k_t[:, idx]
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v_t[:, idx].T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def _attend_prefill(q, ks, vs, ends, k_pos, q_pos, masked, no_max, out) -> None:
    """``KA.attend_prefill_t`` on queries given as (n, G, D) rows, unscaled (the kernel scales them by
    1/sqrt(D) as it reads them, as the chip's prefill passes them): the output written to out (n, G, D)."""
    n, G_, D = q.shape
    qt = np.ascontiguousarray(q.reshape(n, G_ * D).T)  # feature rows, as the chip's transposed projection
    o = np.empty((n, G_ * D), F)
    KA.attend_prefill_t(qt, 0, G_, F(1 / np.sqrt(D)), ks, vs, ends, k_pos, q_pos, masked, no_max, o, 0)
    out[...] = o.reshape(n, G_, D)


@pytest.mark.parametrize("n,past,stride", [(37, 0, 1), (9, 4, 3), (100, 30, 1)])
def test_attend_prefill_matches_the_numpy_prefill(n, past, stride):
    G_, D = 8, 16
    q = (RNG.standard_normal((1, n, G_, D)) * 0.25).astype(F)
    k = RNG.standard_normal((1, past + n, D)).astype(F)
    v = RNG.standard_normal((1, past + n, D)).astype(F)
    k_pos = np.arange(past + n, dtype=np.int64) * stride
    q_pos = k_pos[past:].copy()
    want = prefill_attention(q, k, v, q_pos, k_pos)[0]
    ends = np.searchsorted(k_pos, q_pos, side="right").astype(np.int64)
    got = np.empty((n, G_, D), F)
    qs = np.ascontiguousarray(q[0])  # unscaled: the kernel and the numpy prefill each scale it
    _attend_prefill(qs, k[0], v[0], ends, k_pos, q_pos, False, False, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # keys out of position order: the mask decides, not the ends
    perm = RNG.permutation(past + n)
    for no_max in (True, False):
        _attend_prefill(qs, np.ascontiguousarray(k[0, perm]), np.ascontiguousarray(v[0, perm]),
                        np.full(n, past + n, np.int64), k_pos[perm], q_pos, True, no_max, got)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # scores within the bound (no max shift): the path of the model's every layer
    _attend_prefill(qs, k[0], v[0], ends, k_pos, q_pos, False, True, got)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # queries not in position order (a block's ends not increasing): each still sees its own keys only
    qperm = RNG.permutation(n)
    for no_max in (True, False):
        _attend_prefill(np.ascontiguousarray(qs[qperm]), k[0], v[0], ends[qperm], k_pos, q_pos[qperm], False,
                        no_max, got)
        np.testing.assert_allclose(got, want[qperm], rtol=1e-5, atol=1e-5)


def test_kernels_choice():
    assert kernels_choice("numpy") == "numpy" and kernels_choice("compiled") == "compiled"
    with pytest.raises(ValueError, match="kernels must be one of"):
        kernels_choice("fortran")


@pytest.fixture(scope="module")
def pair():
    compiled = ShardedModel(SHAPE, NUM, n_cells=64, kernels="compiled")
    ref = ShardedModel(SHAPE, NUM, n_cells=64, weights=compiled.weights, kernels="numpy")
    return compiled, ref


def _greedy(model: ShardedModel, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    model.clear_kv()
    ids = np.asarray(prompt, dtype=np.int64)
    pos = np.arange(ids.size, dtype=np.int64)
    out = model.forward(ids, pos, pos.copy(), pos.copy(), pos.copy())
    toks, logits = [int(np.argmax(out.logits))], [out.logits]
    for step in range(n - 1):
        p = np.array([ids.size + step])
        ctx = np.arange(ids.size + step + 1)
        out = model.forward(np.array([toks[-1]]), p, p.copy(), ctx, ctx.copy())
        toks.append(int(np.argmax(out.logits)))
        logits.append(out.logits)
    return toks, logits


@pytest.mark.parametrize("prompt", [list(G.GOLDEN_IDS), [151644, 872, 198, 9707, 11, 1879, 0, 151645, 198]])
def test_greedy_tokens_equal_the_numpy_reference(pair, prompt):
    """Same token ids on this machine, token for token (prefill then decode), with logits within the
    cross-machine drift bound (``golden.F32_DRIFT_ATOL``); a first difference is allowed only where the
    reference's two best logits are closer than that bound (a tie the summation order may break)."""
    compiled, ref = pair
    a, la = _greedy(compiled, prompt, 12)
    b, lb = _greedy(ref, prompt, 12)
    for step, (x, y) in enumerate(zip(la, lb, strict=True)):
        if a[:step] != b[:step]:
            break
        assert np.max(np.abs(x - y)) <= G.F32_DRIFT_ATOL, step
        if a[step] != b[step]:
            top2 = np.sort(y)[-2:]
            assert top2[1] - top2[0] <= G.F32_DRIFT_ATOL, (step, a, b)
            break
    else:
        assert a == b


def test_compiled_model_sees_kv_changes(pair):
    """The compiled step reads the model's own KV arrays (views, not copies): keys of one cached token
    negated move its logits as they move the reference's."""
    compiled, ref = pair
    prompt = np.asarray(G.GOLDEN_IDS, dtype=np.int64)
    pos = np.arange(prompt.size)
    p = np.array([prompt.size])
    ctx = np.arange(prompt.size + 1)
    got = {}
    for name, m in (("compiled", compiled), ("numpy", ref)):
        for bad in (False, True):
            m.clear_kv()
            m.forward(prompt, pos, pos.copy(), pos.copy(), pos.copy())
            if bad:
                m.k_cache[:, :, :, 2] *= -1.0
            got[name, bad] = m.forward(np.array([198]), p, p.copy(), ctx, ctx.copy()).logits
    assert np.max(np.abs(got["compiled", True] - got["compiled", False])) > 0.1
    np.testing.assert_allclose(got["compiled", True], got["numpy", True], atol=G.F32_DRIFT_ATOL)


@pytest.mark.parametrize("scattered", [False, True])
def test_split_decode_gives_the_bits_of_the_one_thread_step(pair, scattered):
    """The two-thread decode step (each layer's chip 1 attention on the pool's thread, handed over by
    semaphores) runs the same kernels per chip in the same order as the one-call step: the same logits,
    bit for bit, and the same K/V written; over a contiguous run of cells and over scattered cells."""
    # split=True runs the two-thread step whatever the host (on one CPU its threads take turns): never skipped
    compiled, _ = pair
    n = 40
    cells = np.arange(n, dtype=np.int64) * (3 if scattered else 1) % 64 if scattered else np.arange(n)
    cells = np.asarray(sorted(set(cells.tolist())), dtype=np.int64)[:n]
    ids = np.asarray((list(G.GOLDEN_IDS) * 8)[:cells.size], dtype=np.int64)
    pos = np.arange(cells.size, dtype=np.int64)
    new = np.array([int(c) for c in range(64) if c not in set(cells.tolist())][0], dtype=np.int64)
    ctx = np.append(cells, new)
    cos, sin = rope_tables(np.array([cells.size]), NUM.head_dim, SHAPE.rope_theta)
    no_max = np.array(compiled._score_bounds(), dtype=np.bool_)
    got = {}
    for split in (False, True):
        compiled.clear_kv()
        compiled.forward(ids, pos, cells, cells.copy(), pos.copy())
        x = compiled.chips[0].embed[198].astype(F)
        got[split] = (compiled._compiled.decode(x, cos[0], sin[0], int(new), ctx, no_max, compiled.k_cache_t,
                                                compiled.v_cache_t, split=split),
                      compiled.k_cache_t[..., int(new)].copy(), compiled.v_cache_t[..., int(new)].copy())
    for a, b in zip(got[False], got[True], strict=True):
        assert np.array_equal(a, b)
    assert np.any(got[True][1] != 0.0)


@pytest.mark.parametrize("failing", ["_decode_split_other", "_decode_layers"])
def test_a_split_decode_thread_that_fails_stops_the_other_at_once(pair, monkeypatch, failing):
    """A failure in either thread of the split step ends the step with that failure, and the other thread
    is released at once (not after its SPLIT_WAIT_S bound): the pool's thread takes new work right after."""
    import sim_backend.model.compiled as C

    compiled, _ = pair
    compiled.clear_kv()
    ids = np.asarray(G.GOLDEN_IDS, dtype=np.int64)
    pos = np.arange(ids.size, dtype=np.int64)
    compiled.forward(ids, pos, pos.copy(), pos.copy(), pos.copy())

    def boom(*a, **k):
        raise ValueError("injected failure")

    monkeypatch.setattr(C, failing, boom)
    cos, sin = rope_tables(np.array([ids.size]), NUM.head_dim, SHAPE.rope_theta)
    ctx = np.arange(ids.size + 1, dtype=np.int64)
    _ends_with_the_injected_failure_at_once(compiled, lambda: compiled._compiled.decode(
        compiled.chips[0].embed[198].astype(F), cos[0], sin[0], ids.size, ctx,
        np.array(compiled._score_bounds(), dtype=np.bool_), compiled.k_cache_t, compiled.v_cache_t, split=True))


def _ends_with_the_injected_failure_at_once(compiled, step) -> None:
    """Run a split step on a thread: it must end within 30 s (not wait out a thread's 120 s SPLIT_WAIT_S)
    raising the injected ValueError, and the pool's thread must take new work right after."""
    import threading

    raised: list[BaseException] = []

    def run() -> None:
        try:
            step()
        except BaseException as e:  # noqa: BLE001 - the test reads it
            raised.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(30.0)
    assert not t.is_alive(), "the split step waited for a thread that had failed"
    assert len(raised) == 1 and isinstance(raised[0], ValueError) and "injected failure" in str(raised[0])
    assert compiled._compiled._threads().submit(lambda: 7).result(timeout=30) == 7


@pytest.mark.parametrize("scattered", [False, True])
def test_split_prefill_gives_the_bits_of_the_one_thread_prefill(pair, scattered):
    """The two-thread prefill (chip 1's attention, router rows and experts on the pool's thread, the threads
    meeting by semaphores three times a layer) makes the same calls per chip as the one-thread prefill: the
    same logits and experts touched, bit for bit, and the same K/V written; a prompt after a cached prefix
    over contiguous cells, and one over scattered cells whose positions are not in cell order (the masked
    path)."""
    compiled, _ = pair
    ids = np.asarray((list(G.GOLDEN_IDS) * 8)[:37], dtype=np.int64)
    if scattered:
        cells = np.asarray([(7 * i) % 64 for i in range(ids.size)], dtype=np.int64)
    else:
        cells = np.arange(5, 5 + ids.size, dtype=np.int64)
    pos = np.arange(ids.size, dtype=np.int64)
    head, tail = slice(0, 20), slice(20, None)
    got = {}
    for split in (False, True):
        compiled.clear_kv()
        compiled.forward(ids[head], pos[head], cells[head], cells[head].copy(), pos[head].copy())
        order = np.argsort(cells) if scattered else np.arange(ids.size)  # scattered: keys not in position order
        x = compiled.chips[0].embed[ids[tail]].astype(F)
        cos, sin = rope_tables(pos[tail], NUM.head_dim, SHAPE.rope_theta)
        logits, touched = compiled._compiled.prefill(
            x, pos[tail], cos, sin, cells[tail], cells[order], pos[order],
            np.array(compiled._score_bounds(), dtype=np.bool_), compiled.k_cache_t, compiled.v_cache_t, split=split)
        got[split] = (logits, np.asarray(touched), compiled.k_cache_t[..., cells].copy(),
                      compiled.v_cache_t[..., cells].copy())
    for a, b in zip(got[False], got[True], strict=True):
        assert np.array_equal(a, b)
    assert np.all(np.isfinite(got[True][0])) and np.any(got[True][2] != 0.0)


@pytest.mark.parametrize("failing_part", [0, 1])
def test_a_split_prefill_thread_that_fails_stops_the_other_at_once(pair, monkeypatch, failing_part):
    """A failure in either thread of the split prefill ends the prefill with that failure, and the other
    thread is released at its next meeting (not after its SPLIT_WAIT_S bound): the pool's thread takes new
    work right after."""
    import sim_backend.model.compiled as C

    compiled, _ = pair
    real = C._prefill_layers

    def failing(part, *a):
        if part == failing_part:
            raise ValueError("injected failure")
        return real(part, *a)

    monkeypatch.setattr(C, "_prefill_layers", failing)
    ids = np.asarray(G.GOLDEN_IDS, dtype=np.int64)
    pos = np.arange(ids.size, dtype=np.int64)
    cos, sin = rope_tables(pos, NUM.head_dim, SHAPE.rope_theta)
    compiled.clear_kv()
    _ends_with_the_injected_failure_at_once(compiled, lambda: compiled._compiled.prefill(
        compiled.chips[0].embed[ids].astype(F), pos, cos, sin, pos, pos.copy(), pos.copy(),
        np.array(compiled._score_bounds(), dtype=np.bool_), compiled.k_cache_t, compiled.v_cache_t, split=True))


def test_split_steps_called_from_two_threads_at_once_run_one_after_the_other(pair):
    """Two threads calling split prefills of one model at once (they share its semaphores and its pool's
    thread) get the bits of calls made one after the other, within a bound: before the model serialised its
    split steps, the callers' chip-0 threads met the wrong chip 1 (a 120 s hang, then a crash)."""
    import threading

    compiled, _ = pair
    ids = np.asarray((list(G.GOLDEN_IDS) * 6)[:33], dtype=np.int64)
    pos = np.arange(ids.size, dtype=np.int64)
    cos, sin = rope_tables(pos, NUM.head_dim, SHAPE.rope_theta)
    no_max = np.array(compiled._score_bounds(), dtype=np.bool_)
    x = compiled.chips[0].embed[ids].astype(F)

    def prefill() -> np.ndarray:
        return compiled._compiled.prefill(x, pos, cos, sin, pos, pos.copy(), pos.copy(), no_max, compiled.k_cache_t,
                                          compiled.v_cache_t, split=True)[0]

    compiled.clear_kv()
    want = prefill()
    got: list[np.ndarray] = []
    errors: list[BaseException] = []

    def caller() -> None:
        try:
            for _ in range(4):
                got.append(prefill())  # the same tokens into the same cells: the same values, whatever the order
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)
    assert not any(t.is_alive() for t in threads), "two callers' split steps met each other's threads"
    assert errors == [] and len(got) == 8
    assert all(np.array_equal(g, want) for g in got)


def test_split_decode_waits_are_bounded():
    """A thread of the split decode step never waits without end: a semaphore nobody posts gives up at its
    deadline (False) and not before it (the bound is on CLOCK_MONOTONIC, slept in 0.2 s slices: five here),
    one that was posted is taken at once (True)."""
    import ctypes
    import time

    from sim_backend.model.kernel_sync import c_library, sem_wait_s

    buf = np.zeros(64, dtype=np.uint8)
    addr = int(buf.ctypes.data)
    assert c_library().sem_init(ctypes.c_void_p(addr), 0, 0) == 0
    ts = np.zeros(2, dtype=np.int64)
    t0 = time.monotonic()
    assert sem_wait_s(addr, ts, 1) is False
    assert time.monotonic() - t0 >= 0.999  # the whole bound, across the slices (Python's clock is monotonic too)
    assert c_library().sem_post(ctypes.c_void_p(addr)) == 0
    assert sem_wait_s(addr, ts, 1) is True


def test_cache_dir_falls_back_to_the_user_cache_when_the_package_is_read_only(monkeypatch, tmp_path):
    """A wheel in a read-only site-packages: the kernels are cached under the user cache directory (numba's
    own fallback needs a usable HOME cache); NUMBA_CACHE_DIR, when set, wins. Either way under the kernels'
    source digest, which numba is told."""
    import numba.core.config as cfg
    import platformdirs

    monkeypatch.setattr(cfg, "CACHE_DIR", cfg.CACHE_DIR)  # restored after the test
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    real_touch = KC.Path.touch

    def read_only(self, *a, **kw):
        if "__pycache__" in str(self):
            raise PermissionError(13, "Read-only file system")
        return real_touch(self, *a, **kw)

    monkeypatch.setattr(KC.Path, "touch", read_only)
    monkeypatch.setattr(platformdirs, "user_cache_dir", lambda app: str(tmp_path / app))
    sub = f"kernels-{KC.kernels_digest()}"
    d = KC.cache_dir()
    assert d == tmp_path / "calconsole" / "numba" / sub and d.is_dir() and cfg.CACHE_DIR == str(d)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "given"))
    assert KC.cache_dir() == tmp_path / "given" / sub and cfg.CACHE_DIR == str(tmp_path / "given" / sub)


def test_kernel_cache_is_named_by_both_kernel_sources(monkeypatch, tmp_path):
    """numba checks a cached function against its own file only: an edit of kernels.py alone must still
    give compiled.py's step (which inlines the kernels) a fresh cache, so the digest reads both files."""
    import shutil

    for name in KC.KERNEL_SOURCES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(KC.__file__).parent / name, tmp_path / name)
    monkeypatch.setattr(KC, "__file__", str(tmp_path / "kernel_cache.py"))
    before = KC.kernels_digest()
    assert before == KC.kernels_digest()
    (tmp_path / "kernels.py").write_text((tmp_path / "kernels.py").read_text() + "\n# edited\n")
    edited = KC.kernels_digest()
    (tmp_path / "compiled.py").write_text((tmp_path / "compiled.py").read_text() + "\n# edited\n")
    both = KC.kernels_digest()
    assert len({before, edited, both}) == 3
    # the dense pilot's kernels inlined into dense_kernels.dense_forward name the cache too
    quant = tmp_path / "families" / "dense_quant.py"
    quant.write_text(quant.read_text() + "\n# edited\n")
    assert len({before, edited, both, KC.kernels_digest()}) == 4


def test_warm_up_announces_a_stage_only_when_numba_compiles(monkeypatch):
    """The start-up line says "compiling" only while numba compiles (its numba:compile event), never for
    kernels loaded from the disk cache, whatever the wall time of the load."""
    from numba import njit

    from sim_backend.model.numerics import ShardedModel

    m = ShardedModel(SHAPE, NUM, n_cells=8, kernels="compiled")
    m.warm_up()  # everything compiled or loaded now
    said: list[tuple[int, int, str]] = []
    assert m.warm_up(lambda i, n, s: said.append((i, n, s))) >= 0 and said == []
    fresh = njit(lambda a: a + 1)  # not cached: compiles at its first call
    real = m._compiled.decode

    def decode_compiling_once(*a, **kw):
        fresh(np.float32(1.0))
        return real(*a, **kw)

    monkeypatch.setattr(m._compiled, "decode", decode_compiling_once)
    m.warm_up(lambda i, n, s: said.append((i, n, s)))
    assert said == [(1, 3, "decode step")]
    m.close()


def test_stale_kernel_caches_are_pruned_and_the_current_one_kept(tmp_path):
    """Folders of other kernel digests go once nothing in them changed for ``STALE_CACHE_AGE_S``; the current
    folder, a recently written sibling (another version compiling now) and other names stay."""
    import os

    current = tmp_path / f"kernels-{'a' * 16}"
    stale, fresh, other = tmp_path / f"kernels-{'b' * 16}", tmp_path / f"kernels-{'c' * 16}", tmp_path / "kernels-x"
    for d in (current, stale, fresh, other):
        d.mkdir()
        (d / "f.nbi").write_bytes(b"x")
    old = 1_000_000.0
    for d in (current, stale, other):
        os.utime(d / "f.nbi", (old, old))
        os.utime(d, (old, old))
    now = old + KC.STALE_CACHE_AGE_S + 1
    os.utime(fresh / "f.nbi", (now - 10, now - 10))
    assert KC.prune_stale_caches(current, now=now) == [stale]
    assert current.is_dir() and fresh.is_dir() and other.is_dir() and not stale.exists()
    assert KC.prune_stale_caches(current, now=now) == []



def _host_has_avx512() -> bool:
    import llvmlite.binding as ll

    return "+avx512f" in ll.get_host_cpu_features().flatten().split(",")


@pytest.mark.skipif(not _host_has_avx512(), reason="the host CPU has no AVX-512: wide_vectors changes nothing")
def test_wide_vectors_makes_a_kernel_use_512_bit_registers_with_the_same_bits():
    """``wide_vectors`` (called first in the long-loop kernels) makes LLVM vectorise with 512-bit registers on an
    AVX-512 host (zmm in the machine code; the default tuning of the reference host picks 256-bit, a Zen 4
    host's 512-bit already), and an element-wise loop keeps its bits; ``wide_legal`` alone keeps the default
    width for the caller's own loops.
    Cached kernels cannot be disassembled, so the same intrinsics are compiled here into fresh functions."""
    from numba import njit

    def body(row):
        for t in range(row.shape[0]):
            row[t] = K._exp_core(row[t])

    def wide(row):
        KC.wide_vectors()
        body_inline(row)

    body_inline = njit(inline="always", fastmath={"contract"})(body)
    narrow_f = njit(fastmath={"contract"}, error_model="numpy")(body)
    wide_f = njit(fastmath={"contract"}, error_model="numpy")(wide)

    def legal(row):
        KC.wide_legal()
        body_inline(row)

    legal_f = njit(fastmath={"contract"}, error_model="numpy")(legal)
    x = np.random.default_rng(3).uniform(-80, 80, 4099).astype(np.float32)
    outs = []
    for f in (narrow_f, wide_f, legal_f):
        y = x.copy()
        f(y)
        outs.append(y)
    assert np.array_equal(outs[0], outs[1]) and np.array_equal(outs[0], outs[2])
    asm = {f: f.inspect_asm(f.signatures[0]) for f in (narrow_f, wide_f, legal_f)}
    assert "zmm" in asm[wide_f]
    # the default width is the host tuning's: 256-bit on the reference host (Intel), 512-bit already where
    # LLVM's tuning prefers it (AMD Zen 4): wide_legal keeps whichever it is
    assert ("zmm" in asm[legal_f]) == ("zmm" in asm[narrow_f])
