"""Metric definitions (facts.md F7), aggregates, goodput (vLLM) and the Prometheus exposition."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sim_backend.planes import SLO
from sim_backend.planes.metrics import LATENCY_BUCKETS_S, MetricsRegistry, percentiles, request_latencies


def test_request_latencies_scripted_clock():
    """Arrival 1000 ms; prefill 400 ms; a piece every 25 ms; 5 tokens."""
    pieces = [1400.0, 1425.0, 1450.0, 1475.0, 1500.0]
    ttft, tpot, itl, e2e = request_latencies(1000.0, pieces, 1500.0, 5)
    assert (ttft, tpot, itl, e2e) == (400.0, 25.0, (25.0, 25.0, 25.0, 25.0), 500.0)


def test_tpot_is_mean_gap_after_first_token_not_itl_mean():
    # 4 tokens but only 3 visible pieces (a character completed over two tokens)
    ttft, tpot, itl, e2e = request_latencies(0.0, [400.0, 450.0, 475.0], 475.0, 4)
    assert ttft == 400.0 and itl == (50.0, 25.0) and e2e == 475.0
    assert tpot == 25.0  # (E2E - TTFT) / (n - 1), not mean(ITL) = 37.5


def test_single_token_and_nothing_visible():
    assert request_latencies(0.0, [400.0], 400.0, 1) == (400.0, None, (), 400.0)
    assert request_latencies(0.0, [], 300.0, 0) == (None, None, (), 300.0)


def test_percentiles():
    p = percentiles(range(1, 101))
    assert p["p50"] == pytest.approx(50.5) and p["p95"] == pytest.approx(95.05) and p["p99"] == pytest.approx(99.01)
    assert p["mean"] == 50.5 and p["n"] == 100
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None, "mean": None, "n": 0}


def test_slo_met_is_inclusive_and_parse():
    slo = SLO(ttft_ms=400.0, tpot_ms=25.0, e2el_ms=1000.0)
    assert slo.met(400.0, 25.0, 1000.0)
    assert not slo.met(400.1, 25.0, 1000.0) and not slo.met(400.0, 25.1, 1000.0)
    assert not slo.met(400.0, 25.0, 1000.1)
    assert slo.met(100.0, None, 100.0)  # one-token request: TPOT counts as 0 (vLLM)
    assert not slo.met(None, None, 100.0)  # nothing shown fails a TTFT objective
    assert SLO().met(None, None, 1e9)
    assert SLO.parse("ttft:500, tpot:50,e2el:5000") == SLO(500.0, 50.0, 5000.0)
    assert SLO.parse("tpot:40") == SLO(tpot_ms=40.0)
    for bad in ("ttfb:5", "ttft:", "ttft:abc"):
        with pytest.raises(ValueError):
            SLO.parse(bad)
    with pytest.raises(ValueError):
        SLO(ttft_ms=-1)


def _done(reg: MetricsRegistry, status="finished", *, arrival=0.0, ttft=400.0, tpot=25.0, n=5, e2e=500.0,
          prompt_n=20, cache_n=0, live=(0, 0, 0.0)):
    itl = tuple([tpot] * (n - 1)) if tpot is not None else ()
    # as the engine does: TTFT and each ITL gap when produced, the rest when the request ends
    if ttft is not None:
        reg.on_first_token(ttft)
    for g in itl:
        reg.on_token_gap(g)
    reg.on_done(status, prompt_n=prompt_n, cache_n=cache_n, predicted_n=n, prompt_ms=ttft or 0.0,
                predicted_ms=(e2e - (ttft or 0.0)), ttft=ttft, tpot=tpot, itl=itl, e2e=e2e, queue_ms=0.0,
                done_ms=arrival + e2e, arrival_ms=arrival, live=live)


def test_goodput_vllm_definition():
    reg = MetricsRegistry(slo=SLO(ttft_ms=450.0, tpot_ms=30.0))
    for _ in range(4):
        reg.on_submitted(live=(1, 0, 0.0))
    _done(reg, arrival=0.0, ttft=400.0, tpot=25.0, n=5, e2e=500.0)         # good
    _done(reg, arrival=100.0, ttft=500.0, tpot=25.0, n=5, e2e=600.0)       # ttft too slow
    _done(reg, arrival=200.0, ttft=300.0, tpot=40.0, n=3, e2e=380.0)       # tpot too slow
    _done(reg, arrival=300.0, ttft=420.0, tpot=None, n=1, e2e=420.0)       # one token: good
    s = reg.summary()
    g = s["goodput"]
    assert g["good_requests"] == 2 and g["good_fraction"] == 0.5
    assert g["span_s"] == pytest.approx(0.72)  # first arrival 0 -> last end 720 ms
    assert g["requests_per_s"] == pytest.approx(2 / 0.72) and g["tokens_per_s"] == pytest.approx(6 / 0.72)
    assert g["slo"] == {"ttft_ms": 450.0, "tpot_ms": 30.0, "e2el_ms": None}
    lat = s["latency_ms"]
    assert lat["ttft"]["n"] == 4 and lat["tpot"]["n"] == 3 and lat["itl"]["n"] == 4 + 4 + 2
    assert lat["e2e"]["p50"] == pytest.approx(460.0)


def test_counters_and_samples_by_status():
    reg = MetricsRegistry()
    for _ in range(3):
        reg.on_submitted(live=(0, 1, 0.1))
    _done(reg, "cancelled", ttft=None, tpot=None, n=0, prompt_n=0, live=(0, 2, 0.1))
    assert reg.summary()["balanced"]
    _done(reg, "failed", ttft=None, tpot=None, n=0, prompt_n=32, live=(0, 1, 0.1))
    _done(reg, "finished", prompt_n=20, cache_n=5, live=(0, 0, 0.05))
    s = reg.summary()
    assert s["balanced"] and s["counters"]["cancelled"] == s["counters"]["failed"] == s["counters"]["finished"] == 1
    assert s["tokens"] == {"prompt": 32 + 15, "cached": 5, "predicted": 5}
    assert s["latency_ms"]["ttft"]["n"] == 1  # only the finished one produced a token here
    assert s["kv_cache_usage_ratio"] == 0.05


def test_latency_percentiles_are_computed_once_per_new_sample(monkeypatch):
    """The summary's percentiles are recomputed only when a latency was recorded since the last summary (an
    idle console asks twice a second), and always equal ``percentiles`` of the recent samples."""
    import numpy as np

    import sim_backend.planes.metrics as M

    calls = {"n": 0}
    real = np.percentile

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(M.np, "percentile", counting)
    reg = MetricsRegistry()
    reg.on_submitted(live=(0, 1, 0.1))
    _done(reg, "finished", prompt_n=20, live=(0, 0, 0.05))
    first = reg.summary()["latency_ms"]
    after_first = calls["n"]
    assert after_first > 0
    for _ in range(3):
        assert reg.summary()["latency_ms"] == first
    assert calls["n"] == after_first  # nothing recorded: nothing recomputed
    reg.summary()["latency_ms"]["ttft"]["p50"] = -1.0  # a caller's change does not reach the cache
    assert reg.summary()["latency_ms"] == first
    reg.on_submitted(live=(0, 1, 0.1))
    _done(reg, "finished", ttft=900.0, prompt_n=20, live=(0, 0, 0.05))
    second = reg.summary()["latency_ms"]
    assert calls["n"] > after_first and second["ttft"]["n"] == 2
    assert second["ttft"] == percentiles(reg.hist["ttft"].recent)


def test_stopped_after_first_token_counts_in_ttft_and_itl_not_in_e2e_or_tpot():
    # vLLM's time_to_first_token_seconds counts every request with a first token; E2E/TPOT only finished
    reg = MetricsRegistry(slo=SLO(ttft_ms=1000.0))
    for _ in range(3):
        reg.on_submitted(live=(0, 1, 0.0))
    _done(reg, "finished", ttft=100.0, tpot=10.0, n=3, e2e=120.0)
    _done(reg, "cancelled", ttft=900.0, tpot=10.0, n=4, e2e=930.0)  # the user stopped it after 4 tokens
    _done(reg, "failed", ttft=700.0, tpot=None, n=1, e2e=800.0)  # a device error after its first token
    s = reg.summary()
    lat = s["latency_ms"]
    assert lat["ttft"]["n"] == 3 and lat["ttft"]["p50"] == 700.0
    assert lat["itl"]["n"] == 2 + 3
    assert lat["e2e"]["n"] == 1 and lat["e2e"]["p50"] == 120.0
    assert lat["tpot"]["n"] == 1
    assert s["goodput"]["good_requests"] == 1  # goodput stays over finished requests
    assert "every request that produced a first token" in s["latency_sampled_from"]["ttft"]
    assert s["latency_sampled_from"]["e2e"] == "finished requests only"
    fam = _families(reg.prometheus_text())
    count = {f: next(x.value for x in fam[f"llamacpp:{f}"].samples if x.name.endswith("_count"))
             for f in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                       "e2e_request_latency_seconds", "time_per_output_token_seconds")}
    assert count == {"time_to_first_token_seconds": 3, "inter_token_latency_seconds": 5,
                     "e2e_request_latency_seconds": 1, "time_per_output_token_seconds": 1}
    assert "every request that produced a first token" in fam["llamacpp:time_to_first_token_seconds"].documentation
    assert "finished requests only" in fam["llamacpp:e2e_request_latency_seconds"].documentation
    assert "finished requests" in fam["llamacpp:time_per_output_token_seconds"].documentation


def test_unbalanced_is_detected():
    reg = MetricsRegistry()
    reg.on_submitted()  # without live counts: the request is in no state
    assert not reg.summary()["balanced"]


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_prometheus_exposition_parses_with_llamacpp_names():
    reg = MetricsRegistry()
    reg.on_submitted(live=(0, 1, 0.0))
    reg.on_submitted(live=(1, 1, 0.25))
    fam = _families(reg.prometheus_text())
    for name in ("llamacpp:prompt_tokens", "llamacpp:tokens_predicted", "llamacpp:prompt_seconds",
                 "llamacpp:tokens_predicted_seconds"):
        assert fam[name].type == "counter", name
    assert fam["llamacpp:requests_processing"].samples[0].value == 1
    assert fam["llamacpp:requests_deferred"].samples[0].value == 1
    assert fam["llamacpp:kv_cache_usage_ratio"].samples[0].value == 0.25
    _done(reg, arrival=0.0, ttft=400.0, tpot=25.0, n=5, e2e=500.0, prompt_n=20, live=(0, 1, 0.3))
    fam = _families(reg.prometheus_text())
    assert fam["llamacpp:prompt_tokens"].samples[0].value == 20
    assert fam["llamacpp:tokens_predicted"].samples[0].value == 5
    for name, count, total in (("llamacpp:time_to_first_token_seconds", 1, 0.4),
                               ("llamacpp:inter_token_latency_seconds", 4, 0.1),
                               ("llamacpp:e2e_request_latency_seconds", 1, 0.5)):
        f = fam[name]
        assert f.type == "histogram"
        by = {s.name: s for s in f.samples if not s.name.endswith("_bucket")}
        assert by[name + "_count"].value == count and by[name + "_sum"].value == pytest.approx(total)
        buckets = [(s.labels["le"], s.value) for s in f.samples if s.name.endswith("_bucket")]
        assert buckets[-1] == ("+Inf", count)
        values = [v for _, v in buckets]
        assert values == sorted(values)  # cumulative
        bounds = [float(le) for le, _ in buckets[:-1]]
        assert bounds == list(LATENCY_BUCKETS_S)
    ttft = {s.labels["le"]: s.value for s in fam["llamacpp:time_to_first_token_seconds"].samples
            if s.name.endswith("_bucket")}
    assert ttft["0.25"] == 0 and ttft["0.5"] == 1  # 0.4 s lands in the 0.5 s bucket


def test_history_series_for_sparklines():
    reg = MetricsRegistry()
    reg.on_submitted(live=(0, 1, 0.0))
    _done(reg, ttft=400.0, n=5, e2e=500.0)
    h = reg.history_series()
    assert h["ttft_ms"] == [400.0] and h["e2e_ms"] == [500.0] and h["tokens_per_s"][0] == pytest.approx(50.0)
    assert not any(math.isnan(x) for x in h["tokens_per_s"])


def test_exposition_is_llama_servers_text_whatever_the_client_library():
    """Written by the registry itself: a counter without ``_total`` keeps its name (``n_tokens_max``, as
    llama-server writes it), integers have no fraction, HELP and label values are escaped."""
    from sim_backend.planes.metrics import PromFamily, exposition

    reg = MetricsRegistry()
    _done(reg, arrival=0.0, ttft=400.0, tpot=25.0, n=5, e2e=500.0, prompt_n=20, live=(0, 1, 0.3))
    lines = reg.prometheus_text().splitlines()
    i = lines.index("# TYPE llamacpp:n_tokens_max counter")
    assert lines[i + 1] == "llamacpp:n_tokens_max 25"
    assert "llamacpp:prompt_tokens_total 20" in lines and "llamacpp:requests_processing 1" in lines
    assert not any("n_tokens_max_total" in x for x in lines)
    assert 'llamacpp:time_to_first_token_seconds_bucket{le="+Inf"} 1' in lines
    text = exposition([PromFamily("x", "gauge", 'a\\b\nc', (("x", (("k", 'q"\n'),), float("inf")),))])
    assert text == '# HELP x a\\\\b\\nc\n# TYPE x gauge\nx{k="q\\"\\n"} +Inf\n'
    assert [(s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples] == \
        [({"k": 'q"\n'}, float("inf"))]
