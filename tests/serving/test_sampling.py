"""CPU sampling (facts.md F1: 151936 BF16 logits per token, converted to FP32, sampled)."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim_backend.errors import InvalidRequestError
from sim_backend.model.bf16 import bf16_to_f32, f32_to_bf16
from sim_backend.model.vocab import VOCAB_SIZE
from sim_backend.planes import SamplingParams
from sim_backend.serving.sampling import N_VALID, Sampler
from sim_backend.serving.sampling_reference import apply_penalties, naive_sample
from sim_backend.tools.bench_host import bench_host


def peaked_logits(rng: np.random.Generator, n: int = VOCAB_SIZE, hot: int = 20) -> np.ndarray:
    x = (rng.standard_normal(n) * rng.uniform(0.5, 3.0)).astype(np.float32)
    idx = rng.choice(min(n, N_VALID), size=min(hot, n), replace=False)
    x[idx] += rng.uniform(2.0, 12.0, size=idx.shape[0]).astype(np.float32)
    return x


# --- BF16 ------------------------------------------------------------------------------


def test_vocab_and_bytes():
    assert VOCAB_SIZE == 151936 and N_VALID == 151669
    assert np.zeros(VOCAB_SIZE, np.uint16).nbytes == 303_872  # facts.md F1/F4


def test_bf16_all_patterns_round_trip():
    u = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    f = bf16_to_f32(u)
    assert f.dtype == np.float32 and f.shape == u.shape
    back = f32_to_bf16(f)
    nan = np.isnan(f)
    assert np.array_equal(back[~nan], u[~nan])
    assert np.isnan(bf16_to_f32(back[nan])).all()


def test_bf16_values_and_out_buffer():
    f = np.array([1.0, -2.5, 0.0, -0.0, np.inf, -np.inf, 3.140625], dtype=np.float32)
    u = f32_to_bf16(f)
    out = np.empty(f.shape, np.float32)
    r = bf16_to_f32(u, out=out)
    assert r is out
    assert np.array_equal(out.view(np.uint32), f.view(np.uint32))
    with pytest.raises(ValueError):
        bf16_to_f32(u, out=np.empty(f.shape, np.float64))
    with pytest.raises(TypeError):
        bf16_to_f32(f)


def test_f32_to_bf16_round_nearest_even():
    one = np.float32(1.0)
    tie_down = one + np.float32(2.0**-8)  # halfway between 1 and 1+2^-7: even is 1.0
    tie_up = one + np.float32(3 * 2.0**-8)  # halfway between 1+2^-7 (odd) and 1+2^-6 (even)
    above = one + np.float32(2.0**-8 + 2.0**-20)
    got = bf16_to_f32(f32_to_bf16(np.array([tie_down, tie_up, above], np.float32)))
    assert got.tolist() == [1.0, 1.0 + 2.0**-6, 1.0 + 2.0**-7]
    assert bf16_to_f32(f32_to_bf16(np.array([3.4e38], np.float32)))[0] == np.inf
    # A NaN whose payload is only in the low 16 bits must stay NaN.
    low_nan = np.array([0x7F800001], dtype=np.uint32).view(np.float32)
    assert np.isnan(bf16_to_f32(f32_to_bf16(low_nan)))[0]


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_bf16_rounding_is_nearest(v):
    f = np.array([v], np.float32)
    r = float(bf16_to_f32(f32_to_bf16(f))[0])
    if math.isinf(r):
        assert abs(v) > 3.38e38
        return
    # |error| <= half a BF16 ulp (8 significant bits).
    # BF16 subnormals have a fixed spacing of 2^-133.
    ulp = max(2.0 ** (math.frexp(v)[1] - 8), 2.0**-133) if v != 0 else 0.0
    assert abs(r - v) <= ulp / 2 + 1e-45


# --- params validation -------------------------------------------------------------------


def test_defaults_and_greedy():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty, p.seed) == (
        1.0, 64, 0.0, 0.0, None,
    )
    p.validate()
    assert SamplingParams.greedy().temperature == 0.0 and SamplingParams.greedy().is_greedy


BAD = {
    "temperature": [-0.1, float("nan"), float("inf"), "0.5", None, True],
    "top_k": [-1, VOCAB_SIZE + 1, 1.5, "40", True],
    "top_p": [0.0, -0.1, 1.01, float("nan"), "1"],
    "min_p": [-0.01, 1.01, float("nan")],
    "repeat_penalty": [0.0, -1.0, 10.01, float("inf"), float("nan")],
    "repeat_last_n": [-2, 1.0, "64", False],
    "presence_penalty": [2.01, -2.01, float("nan")],
    "frequency_penalty": [2.5, -3.0, float("inf")],
    "seed": ["1", 1.5, True, -1, 2**64],
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_validation_rejects(name):
    for value in BAD[name]:
        p = SamplingParams(**{name: value})
        with pytest.raises(InvalidRequestError) as ei:
            p.validate()
        assert ei.value.param == name, (name, value)
        assert ei.value.http_status == 400
        with pytest.raises(InvalidRequestError):
            Sampler(p)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0), dict(temperature=5), dict(top_k=0), dict(top_k=VOCAB_SIZE), dict(top_p=1.0),
        dict(min_p=0.0), dict(min_p=1.0), dict(repeat_penalty=10.0), dict(repeat_last_n=-1),
        dict(repeat_last_n=0), dict(presence_penalty=-2.0), dict(frequency_penalty=2.0), dict(seed=0),
        dict(seed=2**64 - 1), dict(top_k=np.int64(5)),
    ],
)
def test_validation_accepts(kw):
    SamplingParams(**kw).validate()


def test_top_k_bound_uses_vocab_size():
    SamplingParams(top_k=100).validate(vocab_size=100)
    with pytest.raises(InvalidRequestError) as ei:
        SamplingParams(top_k=101).validate(vocab_size=100)
    assert ei.value.param == "top_k"


# --- sampler behaviour -------------------------------------------------------------------


def test_greedy_picks_argmax_lowest_id_on_tie():
    rng = np.random.default_rng(0)
    x = peaked_logits(rng)
    s = Sampler(SamplingParams.greedy(seed=1))
    assert s.sample(x) == int(np.argmax(x))
    x[[7, 9]] = x.max() + 1
    state = s.rng.bit_generator.state
    assert s.sample(x) == 7
    assert s.rng.bit_generator.state == state  # greedy draws nothing


def test_tiny_top_p_is_greedy():
    x = peaked_logits(np.random.default_rng(1))
    s = Sampler(SamplingParams(top_p=1e-7, top_k=0, seed=3))
    assert all(s.sample(x) == int(np.argmax(x)) for _ in range(5))


def test_caller_logits_not_modified():
    x = peaked_logits(np.random.default_rng(2))
    before = x.copy()
    s = Sampler(SamplingParams(repeat_penalty=1.5, presence_penalty=1.0, seed=0))
    s.sample(x, recent=list(range(100)))
    assert np.array_equal(x, before)


def test_never_returns_padding_ids():
    x = np.zeros(VOCAB_SIZE, np.float32)
    x[N_VALID:] = 100.0  # padding rows with absurd logits
    all_tokens = SamplingParams(top_k=0, top_p=1.0, min_p=0.0, seed=5)
    for params in (SamplingParams(seed=5), SamplingParams.greedy(), all_tokens):
        s = Sampler(params)
        for _ in range(20):
            assert s.sample(x) < N_VALID


def test_non_finite_logits():
    x = np.zeros(VOCAB_SIZE, np.float32)
    x[10] = 5.0
    x[11] = np.nan
    s = Sampler(SamplingParams(seed=0, temperature=2.0))
    picks = {s.sample(x) for _ in range(50)}
    assert 11 not in picks
    x[[20, 30]] = np.inf
    assert {s.sample(x) for _ in range(50)} <= {20, 30}
    with pytest.raises(ValueError):
        s.sample(np.full(VOCAB_SIZE, -np.inf, np.float32))
    with pytest.raises(ValueError):
        s.sample(np.zeros(10, np.float32))


def test_extreme_temperatures_no_nan():
    x = peaked_logits(np.random.default_rng(4))
    top = int(np.argmax(x))
    assert Sampler(SamplingParams(temperature=1e-30, seed=1)).sample(x) == top
    s = Sampler(SamplingParams(temperature=1e6, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    assert all(0 <= s.sample(x) < N_VALID for _ in range(10))


def test_seeded_reproducibility_and_replay():
    rng = np.random.default_rng(7)
    xs = [peaked_logits(rng) for _ in range(20)]
    a = Sampler(SamplingParams(seed=1234, temperature=1.5))
    b = Sampler(SamplingParams(seed=1234, temperature=1.5))
    ra = [a.sample(x, recent=[1, 2, 3]) for x in xs]
    assert ra == [b.sample(x, recent=[1, 2, 3]) for x in xs]
    r = Sampler(SamplingParams(temperature=1.5))  # random seed, exposed for replay
    assert isinstance(r.seed, int)
    first = [r.sample(x) for x in xs]
    replay = Sampler(SamplingParams(temperature=1.5, seed=r.seed))
    assert first == [replay.sample(x) for x in xs]
    assert len(set(ra)) > 1  # actually sampling, not greedy


def test_top_k_one_and_min_p_one_are_deterministic():
    x = peaked_logits(np.random.default_rng(8))
    top = int(np.argmax(x))
    for p in (SamplingParams(top_k=1, seed=2), SamplingParams(min_p=1.0, top_k=0, seed=2)):
        s = Sampler(p)
        assert all(s.sample(x) == top for _ in range(10))


def test_distribution_matches_softmax_small_vocab():
    x = np.log(np.array([0.5, 0.3, 0.2], np.float32))
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11), vocab_size=3)
    counts = np.bincount([s.sample(x) for _ in range(6000)], minlength=3) / 6000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


# --- logit bias (llama.cpp's logit-bias sampler: first in the chain) ----------------------------------------


def test_logit_bias_ban_and_force_hold_greedy_and_sampled():
    x = peaked_logits(np.random.default_rng(21))
    top = int(np.argmax(x))
    ban = Sampler(SamplingParams.greedy(), logit_bias=[(top, -math.inf)])
    second = int(np.argsort(-x[:N_VALID], kind="stable")[1])
    assert ban.sample(x) == second
    sampled = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=3),
                      logit_bias=[(top, -math.inf)])
    assert top not in {sampled.sample(x) for _ in range(200)}
    for params in (SamplingParams.greedy(), SamplingParams(seed=4), SamplingParams(temperature=2.0, top_k=0, seed=4)):
        assert {Sampler(params, logit_bias=[(99, 1e3)]).sample(x) for _ in range(5)} == {99}
        # +inf (a bias past float32's range, as llama-server reads it): only such ids are drawn
        assert {Sampler(params, logit_bias=[(5, math.inf), (6, math.inf)]).sample(x) for _ in range(20)} <= {5, 6}
    assert np.array_equal(x, peaked_logits(np.random.default_rng(21)))  # the caller's logits untouched


def test_logit_bias_comes_before_the_penalties_and_repeats_add_up():
    x = np.array([2.0, 2.5, 0.0], np.float32)
    pen = SamplingParams(temperature=0.0, top_k=0, repeat_penalty=2.0, repeat_last_n=64)
    g3 = SamplingParams(temperature=0.0, top_k=0)
    # biased first: (2 + 2) / 2 = 2 < 2.5; penalised first it would be 2 / 2 + 2 = 3 > 2.5
    assert Sampler(pen, vocab_size=3, logit_bias=[(0, 2.0)]).sample(x, recent=[0]) == 1
    once, twice = [(0, -0.3)], [(0, -0.3), (0, -0.3)]
    y = np.array([1.0, 0.5, 0.0], np.float32)
    assert Sampler(g3, vocab_size=3, logit_bias=once).sample(y) == 0
    assert Sampler(g3, vocab_size=3, logit_bias=twice).sample(y) == 1
    with pytest.raises(ValueError, match="logit_bias ids"):
        Sampler(g3, vocab_size=3, logit_bias=[(3, 1.0)])
    with pytest.raises(ValueError, match="no finite logits"):  # everything banned
        Sampler(g3, vocab_size=3, logit_bias=[(0, -math.inf), (1, -math.inf),
                                                                   (2, -math.inf)]).sample(y)


def test_logit_bias_never_reaches_the_padding_rows():
    x = np.zeros(VOCAB_SIZE, np.float32)
    s = Sampler(SamplingParams.greedy(), logit_bias=[(N_VALID + 1, math.inf), (3, 1.0)])
    assert s.sample(x) == 3


# --- penalties ------------------------------------------------------------------------------


def test_penalties_touch_only_window_ids():
    rng = np.random.default_rng(9)
    x = rng.standard_normal(1000).astype(np.float32)
    x[5], x[6] = 2.0, -2.0
    p = SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, repeat_last_n=4)
    y = x.copy()
    recent = [900, 5, 6, 6, 5, 5]  # window (last 4): 6, 6, 5, 5 ; 900 is outside
    apply_penalties(y, recent, p)
    changed = set(np.flatnonzero(y != x).tolist())
    assert changed == {5, 6}
    assert y[5] == np.float32(2.0 / 2.0 - 2 * 0.25 - 0.5)
    assert y[6] == np.float32(-2.0 * 2.0 - 2 * 0.25 - 0.5)


def test_penalty_window_modes():
    x = np.zeros(10, np.float32) + 1.0
    base = SamplingParams(repeat_penalty=2.0)
    for last_n, expect in ((0, set()), (-1, {1, 2, 3}), (2, {2, 3})):
        y = x.copy()
        apply_penalties(y, [1, 2, 3], SamplingParams(repeat_penalty=2.0, repeat_last_n=last_n))
        assert set(np.flatnonzero(y != x).tolist()) == expect
    y = x.copy()
    apply_penalties(y, [1, 1], SamplingParams())  # all neutral: no-op
    assert np.array_equal(x, y)
    with pytest.raises(ValueError):
        apply_penalties(x.copy(), [10], base)


def test_repeat_penalty_changes_greedy_choice():
    x = np.zeros(100, np.float32)
    x[0], x[1] = 5.0, 4.9
    s = Sampler(SamplingParams.greedy(repeat_penalty=1.1), vocab_size=100)
    assert s.sample(x) == 0
    assert s.sample(x, recent=[0]) == 1  # 5.0 / 1.1 < 4.9
    s = Sampler(SamplingParams.greedy(presence_penalty=-2.0), vocab_size=100)
    assert s.sample(x, recent=[1]) == 1  # negative presence penalty boosts


# --- equivalence with the reference ---------------------------------------------------------

CONFIGS = [
    SamplingParams(),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.8, min_p=0.0),
    SamplingParams(top_k=0),
    SamplingParams(top_k=0, top_p=0.7, min_p=0.0),
    SamplingParams(top_k=0, top_p=1.0, min_p=0.0, temperature=0.7),
    SamplingParams(top_k=0, top_p=1.0, min_p=0.2),
    SamplingParams(top_k=300, top_p=1.0, min_p=0.0),
    SamplingParams(repeat_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3, temperature=1.1),
    SamplingParams.greedy(repeat_penalty=1.2),
]


@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_sampler_equals_naive_full_vocab(ci):
    cfg = CONFIGS[ci]
    rng = np.random.default_rng(1000 + ci)
    for trial in range(6):
        x = peaked_logits(rng, hot=int(rng.integers(1, 200)))
        recent = rng.integers(0, N_VALID, size=80).tolist()
        p = msgspec.structs.replace(cfg, seed=trial)
        fast = Sampler(p)
        ref_rng = np.random.Generator(np.random.PCG64(trial))
        for _ in range(3):
            assert fast.sample(x, recent) == naive_sample(x, p, ref_rng, recent)


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.sampled_from([3, 64, 200, 5000]),
    quantised=st.booleans(),
    cfg=st.sampled_from(CONFIGS),
)
def test_sampler_equals_naive_property(seed, n, quantised, cfg):
    rng = np.random.default_rng(seed)
    x = peaked_logits(rng, n=n, hot=5)
    if quantised:  # many exact ties: order must break them by lower id
        x = np.round(x).astype(np.float32)
    recent = rng.integers(0, n, size=10).tolist()
    p = msgspec.structs.replace(cfg, seed=seed, top_k=min(cfg.top_k, n))
    fast = Sampler(p, vocab_size=n)
    ref_rng = np.random.Generator(np.random.PCG64(seed))
    for _ in range(4):
        assert fast.sample(x, recent) == naive_sample(x, p, ref_rng, recent)


def test_sample_bf16_equals_sample_of_widened_logits():
    """The engine's path (BF16 widened into the sampler's scratch) picks what sample(bf16_to_f32(...)) picks."""
    rng = np.random.default_rng(77)
    for ci, cfg in enumerate(CONFIGS):
        bits = f32_to_bf16(peaked_logits(rng, hot=int(rng.integers(1, 100))))
        keep = bits.copy()
        recent = rng.integers(0, N_VALID, size=40).tolist()
        p = msgspec.structs.replace(cfg, seed=ci)
        a, b = Sampler(p), Sampler(p)
        for _ in range(3):
            assert b.sample_bf16(bits, recent) == a.sample(bf16_to_f32(bits), recent)
        assert np.array_equal(bits, keep)  # the D2H bits are not modified


def test_sample_bf16_refuses_wrong_shape_and_dtype():
    s = Sampler(SamplingParams.greedy(top_k=0), vocab_size=8)
    with pytest.raises(ValueError, match="shape"):
        s.sample_bf16(np.zeros(7, np.uint16))
    with pytest.raises(TypeError, match="uint16"):
        s.sample_bf16(np.zeros(8, np.float32))


def test_sample_d2h_takes_either_dtype_the_device_returns():
    """BF16 bits go the BF16 path, float32 (an F32 calbin's logits) the float32 one; both pick what sample()
    picks from the same values, and a logit only float32 resolves is kept (a BF16 tie broken)."""
    rng = np.random.default_rng(5)
    x = peaked_logits(rng, hot=20)
    p = msgspec.structs.replace(CONFIGS[1], seed=3)
    for d2h, widened in ((f32_to_bf16(x), bf16_to_f32(f32_to_bf16(x))), (x, x)):
        a, b = Sampler(p), Sampler(p)
        for _ in range(3):
            assert b.sample_d2h(d2h, ()) == a.sample(widened, ())
    tie = np.zeros(VOCAB_SIZE, np.float32)
    tie[10], tie[11] = 8.0, 8.0 + 2.0**-10  # one BF16 value (step 2**-4 at 8): the BF16 path takes id 10
    g = SamplingParams.greedy(top_k=0)
    assert Sampler(g).sample_d2h(f32_to_bf16(tie)) == 10 and Sampler(g).sample_d2h(tie) == 11
    with pytest.raises(TypeError, match="uint16 BF16 bits or float32"):
        Sampler(g).sample_d2h(tie.astype(np.float64))


def test_bf16_has_one_home():
    from sim_backend.model import bf16, golden

    assert bf16_to_f32 is bf16.bf16_to_f32 and f32_to_bf16 is bf16.f32_to_bf16  # old import path kept
    u = np.array([0x3F80, 0xC020, 0x7FC0], np.uint16)
    assert np.array_equal(golden.bf16_bits_to_f32(u).view(np.uint32), bf16.bf16_to_f32(u).view(np.uint32))


# --- benchmark -------------------------------------------------------------------------------


def test_bench_host_shape():
    r = bench_host(iterations=5, seed=1)
    assert set(r) == {"median_ms", "p95_ms", "naive_median_ms", "naive_p95_ms", "iterations", "vocab"}
    assert r["iterations"] == 5 and r["vocab"] == VOCAB_SIZE
    assert all(isinstance(r[k], float) and r[k] > 0 for k in ("median_ms", "p95_ms", "naive_median_ms", "naive_p95_ms"))
