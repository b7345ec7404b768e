"""CLI: ``chat`` sampling options and typed errors (exit 2), ``metrics`` (Prometheus text), ``bench host``."""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families

from calconsole.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# invalid values are refused before any system is built: these are cheap
BAD = [
    (["--top-k", "-1"], "top_k"),
    (["--top-k", "151937"], "top_k"),
    (["--top-k", "2.5"], "top_k"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--min-p", "-0.1"], "min_p"),
    (["--min-p", "2"], "min_p"),
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "warm"], "temperature"),
    (["--repeat-penalty", "0"], "repeat_penalty"),
    (["--presence-penalty", "2.5"], "presence_penalty"),
    (["--frequency-penalty", "-3"], "frequency_penalty"),
    (["--seed", "abc"], "seed"),
    (["--seed", "1.5"], "seed"),
    (["--stop", ""], "stop"),
    (["--stop", "ok", "--stop", ""], "stop"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--max-tokens", "-5"], "max_tokens"),
    (["--max-tokens", "1.5"], "max_tokens"),
]


@pytest.mark.parametrize("args,param", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_invalid_sampling_values_exit_2_with_typed_message(capsys, args, param):
    code, out, err = run(capsys, "chat", "hello", "--timing-only", *args)
    assert code == 2 and out == ""
    assert "invalid_request_error" in err and param in err


def test_empty_prompt_exits_2(capsys):
    code, _, err = run(capsys, "chat", "   ", "--timing-only")
    assert code == 2 and "invalid_request_error" in err and "prompt is empty" in err


def spy_submit(monkeypatch) -> dict:
    """Record the request the engine receives (``seen["req"]``); the engine still runs it."""
    from sim_backend.serving.engine import Engine

    seen: dict = {}
    orig = Engine.submit

    def spy(self, req):
        seen["req"] = req
        return orig(self, req)

    monkeypatch.setattr(Engine, "submit", spy)
    return seen


def test_chat_passes_every_sampling_option(capsys, monkeypatch):
    """The request built from the options carries them all (checked on the request the engine receives)."""
    seen = spy_submit(monkeypatch)
    code, out, _ = run(capsys, "chat", "hello", "--timing-only", "--json", "--max-tokens", "3",
                       "--temperature", "0.7", "--top-k", "7", "--top-p", "0.9", "--min-p", "0.1",
                       "--repeat-penalty", "1.1", "--repeat-last-n", "32", "--presence-penalty", "0.5",
                       "--frequency-penalty", "-0.5", "--seed", "42", "--stop", "zzz", "--stop", "qqq")
    assert code == 0
    sp = seen["req"].sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p) == (0.7, 7, 0.9, 0.1)
    assert (sp.repeat_penalty, sp.repeat_last_n, sp.presence_penalty, sp.frequency_penalty, sp.seed) == \
        (1.1, 32, 0.5, -0.5, 42)
    assert seen["req"].stop == ("zzz", "qqq") and seen["req"].max_tokens == 3
    d = json.loads(out)
    assert d["seed"] == 42 and d["timings"]["predicted_n"] == 3 and d["status"] == "finished"


def test_max_tokens_minus_one_runs_until_a_stop_as_llama_server(capsys, monkeypatch):
    # the CLI refused -1 while the HTTP face took it (llama-server's n_predict -1: until the context is full
    # or a stop); the timing-only stand-in writes ordinary text, so a one-letter stop string ends it soon
    seen = spy_submit(monkeypatch)
    code, out, err = run(capsys, "chat", "hello", "--timing-only", "--json", "--max-tokens", "-1", "--stop", "e",
                         "--seed", "3")
    assert code == 0, err
    assert seen["req"].max_tokens == 40960  # the context: the limit is the context end
    d = json.loads(out)
    assert d["status"] == "finished" and d["stop_type"] == "word" and d["stopping_word"] == "e"
    assert "note" not in err  # -1 is not "more than the context leaves"


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_fresh_registry(capsys):
    code, out, _ = run(capsys, "metrics")
    assert code == 0
    fam = _families(out)
    for name in ("llamacpp:prompt_tokens", "llamacpp:tokens_predicted", "llamacpp:requests_processing",
                 "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio",
                 "llamacpp:time_to_first_token_seconds", "llamacpp:inter_token_latency_seconds",
                 "llamacpp:e2e_request_latency_seconds"):
        assert name in fam, name
    assert fam["llamacpp:prompt_tokens"].samples[0].value == 0
    assert fam["llamacpp:kv_cache_usage_ratio"].samples[0].value == 0


def test_metrics_after_warmup(capsys):
    code, out, _ = run(capsys, "metrics", "--warmup", "3", "--max-tokens", "4", "--slo", "ttft:100000")
    assert code == 0
    fam = _families(out)
    assert fam["llamacpp:tokens_predicted"].samples[0].value == 12
    assert fam["llamacpp:prompt_tokens"].samples[0].value > 0
    assert fam["llamacpp:requests_good"].samples[0].value == 3
    ttft = {s.name: s.value for s in fam["llamacpp:time_to_first_token_seconds"].samples}
    assert ttft["llamacpp:time_to_first_token_seconds_count"] == 3
    itl = {s.name: s.value for s in fam["llamacpp:inter_token_latency_seconds"].samples}
    assert itl["llamacpp:inter_token_latency_seconds_count"] >= 3  # some pieces may join over tokens
    assert fam["llamacpp:requests_processing"].samples[0].value == 0
    assert 0 < fam["llamacpp:kv_cache_usage_ratio"].samples[0].value < 1  # cached prefixes stay


def test_metrics_bad_slo_exits_2(capsys):
    code, _, err = run(capsys, "metrics", "--slo", "ttfb:3")
    assert code == 2 and "ttfb" in err


def test_bench_host_json(capsys):
    code, out, _ = run(capsys, "bench", "host", "--json", "--iterations", "5")
    assert code == 0
    d = json.loads(out)
    assert {"median_ms", "naive_median_ms", "p95_ms", "naive_p95_ms", "iterations"} <= set(d)
    assert d["iterations"] == 5 and d["median_ms"] > 0 and d["naive_median_ms"] > 0
    code, out, _ = run(capsys, "bench", "host", "--iterations", "3")
    assert code == 0 and "naive" in out and "host wall" in out
