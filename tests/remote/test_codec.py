"""calconsole.codec: what the face encodes, the remote plane decodes to the same result (through JSON)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from calconsole.codec import LLAMA_TIMINGS, llama_timings, result_extension, result_from_extension
from sim_backend.planes import RequestResult, Timings

ms = st.floats(min_value=0.0, max_value=1e7, allow_nan=False)
opt_ms = st.none() | ms
n = st.integers(min_value=0, max_value=40960)
parts = st.dictionaries(st.sampled_from(["tokenize", "sampling", "detokenize", "kv_wait", "framework", "h2d",
                                         "infer", "d2h"]), ms, max_size=5)

timings = st.builds(
    Timings, prompt_n=n, prompt_ms=ms, prompt_per_token_ms=opt_ms, prompt_per_second=opt_ms, predicted_n=n,
    predicted_ms=ms, predicted_per_token_ms=opt_ms, predicted_per_second=opt_ms, cache_n=n, ttft_ms=opt_ms,
    tpot_ms=opt_ms, itl_ms=st.lists(ms, max_size=6).map(tuple), e2e_ms=ms, queue_ms=opt_ms, host_ms=parts,
    device_ms=parts, numerics=st.booleans(), arrival_ms=ms, done_ms=ms, host_booked_ms=ms,
    host_time=st.sampled_from(["modeled", "measured"]), time_base=st.sampled_from(["simulated", "wall"]))
errors = st.none() | st.fixed_dictionaries({"type": st.sampled_from(["cancelled", "KVExhausted", "DeviceError"]),
                                            "message": st.text(max_size=40)})
results = st.builds(
    RequestResult, request_id=st.integers(min_value=0, max_value=2**31), status=st.sampled_from(
        ["finished", "failed", "cancelled"]), text=st.text(max_size=60),
    tokens=st.lists(st.integers(min_value=0, max_value=151935), max_size=12).map(tuple),
    stop_type=st.sampled_from(["eos", "word", "limit", "none"]), stopping_word=st.text(max_size=8), error=errors,
    timings=timings, seed=st.none() | st.integers(min_value=0, max_value=2**32 - 1))


@settings(max_examples=150, deadline=None)
@given(results)
def test_result_round_trips_through_json(res: RequestResult) -> None:
    wire = json.loads(json.dumps(result_extension(res), ensure_ascii=False))
    assert result_from_extension(wire, res.text) == res


@settings(deadline=None)  # a loaded 2-core machine is slow, not wrong
@given(timings)
def test_llama_timings_are_its_nine_numbers(t: Timings) -> None:
    d = llama_timings(t)
    assert tuple(d) == LLAMA_TIMINGS
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in d.values())
