"""Constrained decoding in the engine (llguidance's mask over the Qwen3 vocabulary): the output of synthetic
weights (``tests/serving/test_engine_numeric.py``), and of the timing-only stand-in, parses and conforms to the
grammar for many seeds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sim_backend.errors import InvalidRequestError
from sim_backend.model.tokenizer import get_tokenizer
from sim_backend.model.vocab import EOS_IDS, VOCAB_SIZE
from sim_backend.planes import ChatRequest, Grammar, SamplingParams, validate_request
from sim_backend.serving import grammar as G
from sim_backend.serving.sampling import Sampler
from sim_backend.serving.sampling_reference import naive_sample
from sim_backend.serving.tokens import TokenPipeline
from tests.grammar_check import GBNF, GBNF_RE, OPEN, PERSON, violations

SCHEMA = Grammar("json_schema", json.dumps(PERSON))


def compile_(g: Grammar) -> G.GrammarMatcher:
    return G.compile_grammar(g, get_tokenizer(), VOCAB_SIZE, EOS_IDS)


@pytest.fixture(scope="module")
def timing(make_module_system):
    return make_module_system(numerics=False, maintenance=False)


def test_the_checker_can_fail() -> None:
    ok = {"name": "ann", "age": 3, "role": "user", "active": True, "tags": ["a"]}
    assert violations(ok, PERSON) == []
    for bad in ({**ok, "age": 151}, {**ok, "role": "root"}, {**ok, "extra": 1}, {**ok, "tags": ["a"] * 4},
                {**ok, "name": "x" * 13}, {k: v for k, v in ok.items() if k != "active"}, {**ok, "age": True},
                {**ok, "tags": ["toolongtag"]}, [ok]):
        assert violations(bad, PERSON), bad
    assert violations({}, {"type": "object", "pattern": "x"})  # an unknown keyword is not silently passed
    assert GBNF_RE.fullmatch("yes, 42.") and not GBNF_RE.fullmatch("yes, 4242.")


@pytest.mark.parametrize("params", [SamplingParams.greedy(), SamplingParams(temperature=0.8, seed=1),
                                    SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=2),
                                    SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=3)])
def test_masked_sampler_equals_the_reference_and_keeps_to_the_mask(params: SamplingParams) -> None:
    rng = np.random.default_rng(7)
    for _ in range(3):
        x = (rng.standard_normal(VOCAB_SIZE) * 3).astype(np.float32)
        allowed = np.zeros(VOCAB_SIZE, dtype=np.bool_)
        allowed[rng.choice(150_000, size=300, replace=False)] = True
        x[np.argmax(np.where(allowed, -np.inf, x))] = 50.0  # the best logit is one the mask forbids
        s = Sampler(params)
        got = s.sample(x, allowed=allowed)
        want = naive_sample(x, params, np.random.Generator(np.random.PCG64(s.seed)), allowed=allowed)
        assert got == want and allowed[got]
    with pytest.raises(ValueError, match="allowed"):
        Sampler(params).sample(x, allowed=np.ones(10, dtype=np.bool_))


@pytest.mark.parametrize("g,why", [
    (Grammar("gbnf", 'root ::= ("yes" | "no"'), r"Expected '\)'"),
    (Grammar("gbnf", "root ::= undefined-rule"), "not found"),
    (Grammar("json_schema", '{"type": "objectx"}'), "objectx"),
    (Grammar("json_schema", "[1, 2]"), "object or a boolean"),
    (Grammar("json_schema", "{not json"), "not JSON"),
])
def test_a_bad_grammar_is_refused_with_llama_servers_words(g: Grammar, why: str) -> None:
    with pytest.raises(InvalidRequestError, match=why) as e:
        compile_(g)
    assert str(e.value).startswith(G.PARSE_ERROR)


def test_the_request_type_checks_its_grammar() -> None:
    for g in (Grammar("regex", "a+"), Grammar("gbnf", ""), Grammar("gbnf", "x" * ((1 << 20) + 1))):
        with pytest.raises(InvalidRequestError, match="grammar"):
            validate_request(ChatRequest.from_prompt("hi", grammar=g))


def test_the_mask_overrules_the_logits_in_the_pipeline() -> None:
    # logits that want "maybe" and then never stop: the grammar allows "yes"/"no", ", ", digits, "." and EOS
    tok = get_tokenizer()
    req = ChatRequest.from_prompt("hi", sampling=SamplingParams.greedy(), grammar=Grammar("gbnf", GBNF))
    p = TokenPipeline(req, [1, 2], n_ctx=4096, max_tokens=40, grammar=compile_(Grammar("gbnf", GBNF)))
    logits = np.zeros(VOCAB_SIZE, dtype=np.float32)
    logits[tok.encode("maybe")[0]] = 30.0
    logits[tok.encode(" ")[0]] = 20.0
    bf16 = (logits.view(np.uint32) >> 16).astype(np.uint16)
    text, stop = "", None
    while stop is None:
        visible, stop = p.push(p.sample(bf16, True))
        text += visible
    assert GBNF_RE.fullmatch(text) and stop == ("eos", ""), text


@pytest.mark.parametrize("g,check", [
    (SCHEMA, lambda t: violations(json.loads(t), PERSON)),
    (Grammar("json_schema", json.dumps(OPEN)), lambda t: violations(json.loads(t), OPEN)),
    (Grammar("gbnf", GBNF), lambda t: [] if GBNF_RE.fullmatch(t) else [t]),
], ids=["person", "open-object", "gbnf"])
def test_timing_only_output_matches_the_grammar_for_many_seeds(timing, g: Grammar, check) -> None:
    texts = []
    for seed in range(8):
        r = timing.inference.generate(ChatRequest.from_prompt("json please", max_tokens=256, grammar=g,
                                                              sampling=SamplingParams(seed=seed)), timeout=60)
        assert r.status == "finished" and not r.timings.numerics
        assert r.stop_type == "eos", (r.stop_type, r.text)  # the stand-in completes the structure
        assert check(r.text) == [], r.text
        texts.append(r.text)
    assert len(set(texts)) > 4  # the seeds draw different sentences
    again = timing.inference.generate(ChatRequest.from_prompt("json please", max_tokens=256, grammar=g,
                                                              sampling=SamplingParams(seed=3)), timeout=60)
    assert again.text == texts[3]  # a seed replays



def test_ignore_eos_ends_only_where_the_grammar_allows_nothing_else(timing) -> None:
    # "yes, 7" may end or go on to "yes, 77" and "yes, 777": with ignore_eos it goes on as far as the grammar lets
    for seed in range(4):
        r = timing.inference.generate(ChatRequest.from_prompt("x", max_tokens=64, ignore_eos=True,
                                                              grammar=Grammar("gbnf", 'root ::= "yes, " [0-9]{1,3}'),
                                                              sampling=SamplingParams(seed=seed)), timeout=60)
        assert r.stop_type == "eos" and len(r.text) == len("yes, 777") and r.text.startswith("yes, "), r.text


def test_bench_grammar_prints_per_token_figures(capsys) -> None:
    import argparse

    from calconsole.bench.grammar import run

    assert run(argparse.Namespace(tokens=20, requests=0, bundle=None, json=False)) == 0
    out = capsys.readouterr().out
    for g in ("none", "json_schema", "gbnf"):
        assert f"numerics    {g:11}: median" in out and f"timing-only {g:11}: median" in out
    assert "mask alone  json_schema" in out
    assert run(argparse.Namespace(tokens=5, requests=0, bundle=None, json=False)) == 2  # --tokens refused
