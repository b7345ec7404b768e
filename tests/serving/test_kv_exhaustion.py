"""KV exhaustion through the engine: a bounded, typed failure for one request, and the device keeps serving.

512 KV cells; each request needs ~313 prompt + 150 generated cells, so two
cannot both fit. Timing-only numerics keep it fast.
"""

from __future__ import annotations

import pytest

from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.planes import ChatRequest, SamplingParams

KV_TIMEOUT_S = 0.3
RESULT_S = 60.0  # bound on waiting a result (host s); a hang fails the test, not a timing assertion


def _req(word: str, max_tokens: int) -> ChatRequest:
    return ChatRequest.from_prompt(f"{word} " * 300, max_tokens=max_tokens,
                                   sampling=SamplingParams(temperature=0.0, seed=1))


# 1: serial infer()+Wait(); 2: ping/pong. Both need the second request's prefill to run while the
# first request decodes (the engine's round rule: every decoding slot once, then one prefill chunk).
@pytest.mark.parametrize("max_inflight", [1, 2])
def test_second_request_fails_with_kv_exhausted_and_device_keeps_serving(max_inflight):
    # real-time pacing (x2): the first request holds its KV for ~1.3 s, longer than the second's
    # 0.3 s KV deadline. The second is parked (not blocking the scheduler) until then.
    with build_system(numerics=False, kv_cells=512, kv_timeout_s=KV_TIMEOUT_S, n_slots=2, maintenance=False,
                      max_inflight=max_inflight, pacing=Pacing(PacingMode.REALTIME, speed=2.0)) as s:
        h1 = s.inference.submit(_req("alpha", 150))
        h2 = s.inference.submit(_req("beta", 150))
        assert h1.prompt_n + 150 <= 512 < h1.prompt_n + h2.prompt_n + 150  # one fits, two do not
        r1, r2 = h1.result(RESULT_S), h2.result(RESULT_S)
        assert r1.status == "finished" and r1.timings.predicted_n == 150
        assert r2.status == "failed"
        assert r2.error["type_name"] == "KVExhausted"
        assert "KV cache exhausted" in r2.error["message"] and "of 512" in r2.error["message"]
        # its own numbers: the prefill it asked for (its whole prompt, one chunk), what was free, the pool
        assert (r2.error["requested"], r2.error["capacity"]) == (h2.prompt_n, 512)
        assert r2.error["requested"] > r2.error["free"] and "KV deadline" in r2.error["message"]
        kvc = s.board.kv.counters()
        assert kvc.apply_timeouts >= 1  # non-blocking attempts that found the cache full
        # it waited (bounded, with back-off) for its deadline instead of spinning or aborting
        assert r2.timings.host_ms["kv_wait"] >= KV_TIMEOUT_S * 1e3
        assert r2.timings.e2e_ms >= KV_TIMEOUT_S * 1e3  # the wait is on the simulated clock too
        # its KV was freed; the device still serves the next request
        r3 = s.inference.generate(ChatRequest.from_prompt("hello", max_tokens=8,
                                                          sampling=SamplingParams(temperature=0.0)), RESULT_S)
        assert r3.status == "finished" and r3.timings.predicted_n == 8
        snap = s.observation.snapshot().to_dict()
        assert snap["kv"]["apply_full_attempts"] == kvc.apply_timeouts
        # request-level: exactly one request waited and exactly one timed out
        assert snap["kv"]["waits"] == 1 and snap["kv"]["timeouts"] == 1
        assert snap["kv"]["kv_wait_wall_ms"] >= KV_TIMEOUT_S * 1e3
        assert snap["requests"] is not None


def test_prompt_larger_than_kv_is_refused_at_submit():
    """A prompt that can never fit the KV pool (but fits the 40960 context) is refused up front with
    exceed_context_size_error naming the KV capacity: nothing is allocated."""
    from sim_backend.errors import ExceedContextSizeError

    with build_system(numerics=False, kv_cells=256, kv_timeout_s=KV_TIMEOUT_S, n_slots=1, maintenance=False) as s:
        with pytest.raises(ExceedContextSizeError) as e:
            s.inference.submit(_req("gamma", 4))
        assert e.value.n_ctx == 256 and e.value.n_prompt_tokens > 256
        assert s.board.kv.occupancy().used_cells == 0
        assert s.engine.metrics.summary()["counters"]["submitted"] == 0
        r2 = s.inference.generate(ChatRequest.from_prompt("hi", max_tokens=4,
                                                          sampling=SamplingParams(temperature=0.0)), RESULT_S)
        assert r2.status == "finished"


def test_request_waiting_for_kv_does_not_block_others_and_gets_cells_when_freed():
    """The second request is parked while the first decodes (the scheduler is not blocked), and
    when the first finishes and frees its cells within the deadline, the second succeeds."""
    with build_system(numerics=False, kv_cells=512, kv_timeout_s=30.0, n_slots=2, maintenance=False) as s:
        h1 = s.inference.submit(_req("alpha", 150))
        h2 = s.inference.submit(_req("beta", 150))
        r1, r2 = h1.result(RESULT_S), h2.result(RESULT_S)
        assert r1.status == "finished" and r2.status == "finished"
        assert r2.timings.predicted_n == 150
        assert r2.timings.host_ms["kv_wait"] > 0


def test_when_every_running_request_waits_for_kv_the_newest_is_ended_at_once():
    """4 slots on 260 cells, each request wanting ~300: all would park and wait out the deadline.
    The engine ends the newest at once so the others can finish; nothing waits the full 30 s."""
    with build_system(numerics=False, kv_cells=260, kv_timeout_s=30.0, n_slots=4, maintenance=False) as s:
        hs = [s.inference.submit(ChatRequest.from_prompt(f"w{i} " * 10, max_tokens=300,
                                                         sampling=SamplingParams(temperature=0.0))) for i in range(4)]
        rs = [h.result(RESULT_S) for h in hs]
        statuses = [r.status for r in rs]
        assert "failed" in statuses and all(st in ("finished", "failed") for st in statuses)
        assert all(r.error["type_name"] == "KVExhausted" for r in rs if r.status == "failed")
        # each was ended by the deadlock rule, none by its 30 s deadline (was a wall bound, < 20 s: a loaded
        # host can take that long for 4 x 300 fast-paced tokens; the reason says which rule ended it)
        assert all("every running request was waiting for KV cells" in r.error["message"]
                   for r in rs if r.status == "failed"), [r.error for r in rs]
        assert all(v >= 0 for r in rs for v in r.timings.host_ms.values())  # no negative host stage
        snap = s.observation.snapshot().to_dict()
        assert snap["kv"]["waits"] <= 4  # requests that waited, not parkings
        assert snap["requests"]["balanced"] and snap["kv"]["used_tokens"] <= 260
