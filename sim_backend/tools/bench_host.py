"""``calconsole bench host``: the per-token host path (D2H landing copy, BF16 -> FP32, sampling)
timed on this machine, fast sampler vs the naive reference. Host wall ms."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from sim_backend.planes.types import SamplingParams
from sim_backend.serving.sampling import N_VALID, VOCAB_SIZE, Sampler, bf16_to_f32, f32_to_bf16
from sim_backend.serving.sampling_reference import naive_sample


def _bench_logits(rng: np.random.Generator, n: int) -> np.ndarray:
    """LLM-like FP32 logits: a Gaussian floor plus a few dozen strong candidates."""
    x = rng.standard_normal(n).astype(np.float32) * 2.0
    hot = rng.choice(N_VALID if n == VOCAB_SIZE else n, size=32, replace=False)
    x[hot] += rng.uniform(6.0, 14.0, size=32).astype(np.float32)
    return x


def bench_host(iterations: int = 200, seed: int = 0) -> dict[str, Any]:
    """Time the per-token host path: D2H landing copy -> BF16->FP32 -> sample.

    Fast path: copy of the 303,872 B BF16 logits into a preallocated landing
    buffer (facts.md F1/F4), :func:`bf16_to_f32` into a preallocated FP32 buffer,
    :meth:`Sampler.sample` with default :class:`SamplingParams`. Naive path:
    same copy, conversion with a fresh allocation (the production "full FP32
    temp copy", F6), :func:`naive_sample`.

    Returns:
        ``{"median_ms", "p95_ms", "naive_median_ms", "naive_p95_ms",
        "iterations", "vocab"}`` — host wall milliseconds per token
        (``time.perf_counter``).
    """
    rng = np.random.default_rng(seed)
    n = VOCAB_SIZE
    sources = [f32_to_bf16(_bench_logits(rng, n)) for _ in range(8)]
    recent = [int(t) for t in rng.integers(0, N_VALID, size=64)]
    landing = np.empty(n, dtype=np.uint16)
    f32 = np.empty(n, dtype=np.float32)
    sampler = Sampler(SamplingParams(seed=seed))
    naive_rng = np.random.Generator(np.random.PCG64(seed))
    params = sampler.params

    def fast(src: np.ndarray) -> None:
        np.copyto(landing, src)
        sampler.sample(bf16_to_f32(landing, out=f32), recent)

    def naive(src: np.ndarray) -> None:
        np.copyto(landing, src)
        naive_sample(bf16_to_f32(landing), params, naive_rng, recent)

    def run(fn: Callable[[np.ndarray], None]) -> list[float]:
        for i in range(3):  # warm-up
            fn(sources[i % len(sources)])
        out: list[float] = []
        for i in range(iterations):
            t0 = time.perf_counter()
            fn(sources[i % len(sources)])
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    t_fast = run(fast)
    t_naive = run(naive)
    return {
        "median_ms": float(np.median(t_fast)),
        "p95_ms": float(np.percentile(t_fast, 95)),
        "naive_median_ms": float(np.median(t_naive)),
        "naive_p95_ms": float(np.percentile(t_naive, 95)),
        "iterations": int(iterations),
        "vocab": n,
    }
