"""Async overlap at batch 1, measured on the simulator: serial (max_inflight 1) vs overlapped
(max_inflight 2) runs of the same requests (``calconsole bench overlap``).

Times: ``sim_s`` simulated device seconds, ``wall_s`` host wall seconds; step means in ms
(device = simulated, host = measured).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.errors import CalError
from sim_backend.planes.types import ChatRequest, SamplingParams, StageTimes

CLOCK_NOTE = ("requests_per_s / tokens_per_s: SIMULATED device clock (device steps from the cost model at full "
              "Qwen3-30B-A3B size, plus measured host work booked on that clock); wall_*: measured host wall time "
              "of the simulator run")


def _prompt(i: int, words: int) -> str:
    base = f"Request {i}: summarise the maintenance log for chiplet {i % 2} and list the faults. "
    text = base
    while len(text.split()) < words:
        text += base
    return " ".join(text.split()[:words])


def run_mode(max_inflight: int, *, n_requests: int, max_tokens: int, numerics: bool, bundle: Any = None,
             prompt_words: int = 24, host_timer: Any = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """Serve ``n_requests`` concurrent greedy requests on a fresh system; return the figures.

    Times: ``sim_s`` simulated device seconds, ``wall_s`` host wall seconds,
    step means in ms (device = simulated, host = measured). Raises CalError
    if a request does not finish. Host work is booked as MEASURED (``host_time="measured"``):
    what overlap can hide is this host's own work, which the stage history records.
    """
    with build_system(bundle, pacing=Pacing(PacingMode.FAST), numerics=numerics, n_slots=n_requests,
                      max_inflight=max_inflight, maintenance=False, host_timer=host_timer, host_time="measured",
                      numerics_max_prompt=4096) as s:
        # warm-up (tokenizer caches, first-call numpy paths); not measured
        s.inference.generate(ChatRequest.from_prompt("warm up", max_tokens=2,
                                                     sampling=SamplingParams(temperature=0.0)), timeout_s)
        n_hist = len(s.engine.stage_history)
        sim0, wall0 = s.board.clock.now_us, time.perf_counter()
        handles = [s.inference.submit(ChatRequest.from_prompt(
            _prompt(i, prompt_words), max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0, seed=i)))
            for i in range(n_requests)]
        results = [h.result(timeout_s) for h in handles]
        sim1, wall1 = s.board.clock.now_us, time.perf_counter()
        hist = s.engine.stage_history
        steps = list(hist)[n_hist:] if hist.maxlen is None or n_hist < hist.maxlen else []
    bad = [r for r in results if r.status != "finished"]
    if bad:
        raise CalError(f"request {bad[0].request_id} ended {bad[0].status}: {bad[0].error}")
    tokens = sum(r.timings.predicted_n for r in results)
    sim_s, wall_s = (sim1 - sim0) / 1e6, wall1 - wall0
    dec = [st for st in steps if st.kind == "decode"]

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    def dev(st: StageTimes) -> float:
        return st.h2d_ms + st.infer_ms + st.d2h_ms

    def host(st: StageTimes) -> float:
        return st.kv_wait_ms + st.sampling_ms + st.detokenize_ms + st.framework_ms

    dev_ms = mean([dev(st) for st in dec])
    host_ms = mean([host(st) for st in dec])
    return {
        "max_inflight": max_inflight, "requests": n_requests, "tokens": tokens,
        "sim_s": sim_s, "wall_s": wall_s,
        "requests_per_s": n_requests / sim_s if sim_s > 0 else None,
        "tokens_per_s": tokens / sim_s if sim_s > 0 else None,
        "wall_requests_per_s": n_requests / wall_s if wall_s > 0 else None,
        "wall_tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "steps": len(steps), "device_s": sum(dev(st) for st in steps) / 1e3,
        "host_s": sum(host(st) for st in steps) / 1e3,
        "decode_step_device_ms": dev_ms, "decode_step_host_ms": host_ms,
        "mean_ttft_ms": mean([r.timings.ttft_ms for r in results if r.timings.ttft_ms is not None]),
        "mean_e2e_ms": mean([r.timings.e2e_ms for r in results]),
        "token_ids": [list(r.tokens) for r in results],
    }


def measure_overlap(*, n_requests: int = 4, max_tokens: int = 64, numerics: bool = True, bundle: Any = None,
                    prompt_words: int = 24, host_timer_factory: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Serial then overlapped, same requests; returns ``{"serial", "overlapped", "gain", "bound", ...}``.

    ``gain`` values are overlapped / serial ratios (> 1 = overlap is faster).
    ``bound`` is the simulated-clock ceiling ``serial_s / (serial_s - host_s)``:
    the gain if all of the serial run's booked host work were hidden. ``host_timer_factory`` (tests) makes host work
    scripted instead of measured.
    """
    kw = dict(n_requests=n_requests, max_tokens=max_tokens, numerics=numerics, bundle=bundle,
              prompt_words=prompt_words)
    serial = run_mode(1, host_timer=host_timer_factory() if host_timer_factory else None, **kw)
    overlapped = run_mode(2, host_timer=host_timer_factory() if host_timer_factory else None, **kw)
    same = serial.pop("token_ids") == overlapped.pop("token_ids")

    def ratio(k: str) -> float | None:
        a, b = serial.get(k), overlapped.get(k)
        return b / a if a and b else None

    # ceiling: every host step hidden behind device time, i.e. serial time minus all booked host work
    t, h = serial["sim_s"], serial["host_s"]
    return {
        "serial": serial, "overlapped": overlapped,
        "gain": {k: ratio(k) for k in ("requests_per_s", "tokens_per_s", "wall_requests_per_s", "wall_tokens_per_s")},
        "bound": t / (t - h) if t > h > 0 else None,
        "same_tokens": same, "numerics": numerics, "clock": CLOCK_NOTE,
    }


