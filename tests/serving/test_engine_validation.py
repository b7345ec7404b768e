"""Request validation (typed llama.cpp errors, nothing allocated) and the context boundary.

Timing-only system (numerics=False): the boundary prompts are 40957..40961 tokens.
"""

from __future__ import annotations

import math

import pytest

from sim_backend.errors import ExceedContextSizeError, InvalidRequestError, UnavailableError
from sim_backend.planes import SLO, ChatRequest, SamplingParams, validate_request

N_CTX = 40960


SLO_ = SLO(ttft_ms=1000.0, tpot_ms=50.0, e2el_ms=20000.0)


@pytest.fixture(scope="module")
def system(make_module_system):
    return make_module_system(numerics=False, maintenance=False, slo=SLO_)


def requests_view(system):
    """The serving metrics as the observation plane shows them (counters, balance, goodput SLOs)."""
    return system.observation.snapshot().requests


def state(system) -> dict:
    """Everything a refused request must leave unchanged."""
    e, b = system.engine, system.board
    c = e.metrics.summary()["counters"]
    kvc = b.kv.counters()
    return {
        "kv_used": b.kv.used_cells, "kv_apply_calls": kvc.apply_calls, "jobs": b.counters().submitted,
        "submitted": c["submitted"], "queued": c["queued"], "running": c["running"],
        "finished": c["finished"], "failed": c["failed"], "cancelled": c["cancelled"],
        "slots": [s.state for s in e.slot_info()], "queue": e.queued_count(),
    }


def req(prompt="hello", *, max_tokens=8, stop=(), **sp) -> ChatRequest:
    return ChatRequest.from_prompt(prompt, max_tokens=max_tokens, stop=stop, sampling=SamplingParams(**sp))


INVALID = [
    ("empty prompt", req(""), "prompt"),
    ("blank prompt", req("  \n "), "prompt"),
    ("no messages", ChatRequest(messages=()), "messages"),
    ("bad role", ChatRequest(messages=({"role": "robot", "content": "hi"},)), "messages"),
    ("non-string content", ChatRequest(messages=({"role": "user", "content": 5},)), "messages"),
    ("max_tokens 0", req(max_tokens=0), "max_tokens"),
    ("max_tokens negative", req(max_tokens=-1), "max_tokens"),
    ("max_tokens absent", req(max_tokens=None), "max_tokens"),
    ("max_tokens bool", req(max_tokens=True), "max_tokens"),
    ("max_tokens float", req(max_tokens=8.0), "max_tokens"),
    ("temperature < 0", req(temperature=-0.01), "temperature"),
    ("temperature NaN", req(temperature=math.nan), "temperature"),
    ("top_p 0", req(top_p=0.0), "top_p"),
    ("top_p > 1", req(top_p=1.01), "top_p"),
    ("top_p negative", req(top_p=-0.5), "top_p"),
    ("top_k < 0", req(top_k=-1), "top_k"),
    ("top_k > vocab", req(top_k=151937), "top_k"),
    ("top_k float", req(top_k=2.5), "top_k"),
    ("min_p < 0", req(min_p=-0.1), "min_p"),
    ("min_p > 1", req(min_p=1.5), "min_p"),
    ("repeat_penalty 0", req(repeat_penalty=0.0), "repeat_penalty"),
    ("repeat_penalty > 10", req(repeat_penalty=11.0), "repeat_penalty"),
    ("repeat_last_n < -1", req(repeat_last_n=-2), "repeat_last_n"),
    ("presence_penalty > 2", req(presence_penalty=2.5), "presence_penalty"),
    ("presence_penalty < -2", req(presence_penalty=-2.1), "presence_penalty"),
    ("frequency_penalty > 2", req(frequency_penalty=3.0), "frequency_penalty"),
    ("frequency_penalty inf", req(frequency_penalty=math.inf), "frequency_penalty"),
    ("empty stop string", req(stop=("",)), "stop"),
    ("non-string stop", req(stop=("ok", 3)), "stop"),
    ("stop not a list", req(stop="STOP"), "stop"),
    ("seed float", req(seed=1.5), "seed"),
    ("seed string", req(seed="7"), "seed"),
    ("seed bool", req(seed=True), "seed"),
    ("seed negative", req(seed=-1), "seed"),
    ("enable_thinking not bool", ChatRequest.from_prompt("hi", enable_thinking="yes"), "enable_thinking"),
]


@pytest.mark.parametrize("name,request_,param", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_request_allocates_nothing(system, name, request_, param):
    before = state(system)
    rejected = requests_view(system).counters.rejected
    with pytest.raises(InvalidRequestError) as ei:
        system.inference.submit(request_)
    err = ei.value
    assert err.error_type == "invalid_request_error" and err.param == param
    assert err.to_dict() == {"code": 400, "message": str(err), "type": "invalid_request_error"}
    assert state(system) == before
    after = requests_view(system)
    assert after.counters.rejected == rejected + 1 and after.balanced


VALID_EDGES = [
    req(temperature=0.0), req(top_p=1.0), req(top_p=1e-9), req(top_k=0), req(top_k=151936), req(min_p=0.0),
    req(min_p=1.0), req(repeat_penalty=10.0), req(repeat_last_n=-1), req(presence_penalty=-2.0),
    req(frequency_penalty=2.0), req(seed=0), req(seed=2**64 - 1), req(max_tokens=1), req(stop=("a", " b")),
]


@pytest.mark.parametrize("r", VALID_EDGES, ids=range(len(VALID_EDGES)))
def test_edge_values_are_valid(r):
    validate_request(r)


def test_from_dict_requires_max_tokens_and_checks_values(system):
    with pytest.raises(InvalidRequestError) as ei:
        ChatRequest.from_dict({"prompt": "hi"})
    assert ei.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError):
        ChatRequest.from_dict({"max_tokens": 4})
    r = ChatRequest.from_dict({"messages": [{"role": "user", "content": "hi"}], "n_predict": 4, "stop": "END",
                               "seed": 3, "temperature": 0, "top_k": 5})
    assert r.max_tokens == 4 and r.stop == ("END",) and r.sampling.seed == 3 and r.sampling.top_k == 5
    with pytest.raises(InvalidRequestError) as ei:
        system.inference.submit(ChatRequest.from_dict({"prompt": "hi", "max_tokens": 4, "seed": "abc"}))
    assert ei.value.param == "seed"


def test_paused_admission_is_unavailable(system):
    before = state(system)
    system.engine.gate.pause("maintenance window")
    try:
        with pytest.raises(UnavailableError, match="maintenance window") as ei:
            system.inference.submit(req())
        assert ei.value.error_type == "unavailable_error"
    finally:
        system.engine.gate.resume()
    assert state(system) == before


# --- context boundary --------------------------------------------------------------------


def exact_prompt(system, n_tokens: int, word: str = "hello") -> ChatRequest:
    """A request whose templated prompt is exactly ``n_tokens`` tokens."""
    overhead = system.inference.count_prompt_tokens(ChatRequest.from_prompt(word)) - 1
    r = ChatRequest.from_prompt(word + f" {word}" * (n_tokens - overhead - 1), max_tokens=64)
    n = system.inference.count_prompt_tokens(r)
    assert n == n_tokens, (n, n_tokens)
    assert system.inference.count_prompt_tokens(r) == n_tokens
    return r


@pytest.mark.parametrize("n_prompt", [N_CTX, N_CTX + 1])
def test_prompt_of_context_or_more_is_refused(system, n_prompt):
    """llama.cpp: a prompt of n_ctx tokens or more leaves no room for a token."""
    r = exact_prompt(system, n_prompt)
    before = state(system)
    with pytest.raises(ExceedContextSizeError) as ei:
        system.inference.submit(r)
    e = ei.value
    assert (e.n_prompt_tokens, e.n_ctx) == (n_prompt, N_CTX)
    body = e.to_dict()
    assert body["type"] == "exceed_context_size_error" and body["n_prompt_tokens"] == n_prompt
    assert body["n_ctx"] == 40960 and body["code"] == 400
    assert state(system) == before


@pytest.mark.parametrize("n_prompt,n_out", [(N_CTX - 1, 1), (N_CTX - 2, 2), (N_CTX - 3, 3)])
def test_prompt_that_fits_stops_at_context_end(system, n_prompt, n_out):
    """llama.cpp's accounting: a prompt < n_ctx stops with ``limit`` when prompt + generated reach
    n_ctx (40959 -> 1 token; 40958 -> 2; 40957 -> 3), max_tokens 64: total tokens never exceed n_ctx."""
    words = {N_CTX - 1: "hello", N_CTX - 2: "world", N_CTX - 3: "token"}  # no prefix reuse between cases
    r = exact_prompt(system, n_prompt, words[n_prompt])
    res = system.inference.generate(r, timeout=120)
    assert res.status == "finished" and res.stop_type == "limit"
    assert res.timings.predicted_n == n_out
    assert res.timings.prompt_n + res.timings.cache_n == n_prompt
    assert n_prompt + res.timings.predicted_n == N_CTX
    assert res.timings.numerics is False
    assert requests_view(system).balanced


def test_slo_is_configured_through_build_system(system):
    slo = requests_view(system).goodput.slo
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2el_ms) == (SLO_.ttft_ms, SLO_.tpot_ms, SLO_.e2el_ms) == (1000.0, 50.0,
                                                                                                    20000.0)
