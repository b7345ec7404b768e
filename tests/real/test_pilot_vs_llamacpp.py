"""The dense pilot (SmolLM2-135M-Instruct Q4_1 on the simulated NPU) against llama.cpp on the same GGUF.

The real llama-server fixture (``llama_server``, xllamacpp) serves the very file the pilot bundle
reads. Checked here: tokenisation of 200 varied strings equals ``/tokenize`` exactly (both with and
without control-token parsing), and greedy replies to 8 fixed prompts, free-running through our
whole serving path (engine, device, BF16 logits) and teacher-forced on llama.cpp's own tokens.

Why replies are not required to be equal token for token. Our device computes the quantised model
with llama.cpp's CPU arithmetic (``sim_backend/model/families/dense_kernels.py``: activations quantised
to 8-bit blocks of 32 before every product, integer block dot products on the Q4_1 / Q8_0 codes, F16
K/V) but not its float32 rounding order, SIMD exp or F16 flash-attention accumulation; and the device
returns BF16 logits. A quantised model is chaotic at that scale: scaling the embeddings by 1 + 3e-7
moved the top-5 log-probabilities of the first reply token by 0.10-0.20 nats (0.001-0.003 without the
activation quantisation), because one activation code that rounds the other way is a step of
amax/127 in its block. So llama.cpp's own log-probabilities carry ~0.1-0.2 nats of rounding noise that
no implementation short of its exact instruction sequence reproduces; that, not a modelling error, is
the real bound. Measured on the 2-core test host, teacher-forced on llama.cpp's tokens (no earlier
divergence compounds): our log-probabilities of llama.cpp's top-2 tokens differ from its own by 0.120
nats on average, 0.262 at the 95th percentile and 0.909 at most over the 121 positions; top-1 equal at
117 of 121 (float32 on dequantised weights, before: 114, mean 0.100). Free-running through the engine:
the first 16 tokens equal llama.cpp's for 4 of the 8 prompts and the first token for 6 (before: 3 and
5); the issue's targets (6 and 8) are not met, and cannot be guaranteed: the replies part where
llama.cpp's own top-2 margin was 0.005, 0.013, 0.050 and 0.237 nats, inside twice the noise above (one
of them, 0.005 nats, is also below a BF16 step of the logits, so the device's BF16 logits alone can
swap it).

The bounds asserted: (teacher-forced, sound) each log-probability within DELTA_MAX, so top-1 must be
equal wherever llama.cpp's margin exceeds 2 * DELTA_MAX, the mean error within MEAN_MAX and top-1
equal at >= 90 % of positions; (free-running, statistical) a reply may part from llama.cpp's only
where llama.cpp's top-2 margin is below FLIP_MARGIN, twice the 95th-percentile error (a swap needs
the two tokens' errors to add up to the margin) plus one BF16 step of the logits. A wrong RoPE mode,
head split, norm or template moves log-probabilities by nats and fails all of them at once.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import numpy as np
import pytest

from sim_backend.compose import build_system
from sim_backend.planes.types import ChatRequest, SamplingParams

PILOT = Path(__file__).resolve().parents[2] / "sim_backend" / "bundles" / "smollm2-135m-pilot"

#: Fixed before the first comparison was run; not chosen by their results.
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
           "How many legs does a spider have?", "Translate 'good morning' into Spanish.", "What is 12 plus 7?",
           "Give me a short tip for learning to code.", "Who wrote Romeo and Juliet?")
N_TOKENS = 16
#: Largest |our log-probability - llama.cpp's| of llama.cpp's top-2 tokens, teacher-forced (nats):
#: measured 0.909 (the pilot's compiled kernels use no BLAS: the same bits on any x86-64 host).
DELTA_MAX = 1.0
#: Mean of that error over the positions: measured 0.120.
MEAN_MAX = 0.15
#: One BF16 step of the pilot's logits (|logit| < 32: 0.125) on the free-running path, which
#: samples the device's BF16 logits (facts.md F1) where llama.cpp samples float32.
BF16_STEP = 0.125
#: Free-running: the largest llama.cpp top-2 margin at which a reply may part from llama.cpp's:
#: 2 x the measured 95th-percentile error (0.262) + one BF16 step.
FLIP_MARGIN = 2 * 0.262 + BF16_STEP
#: Teacher-forced top-1 agreement measured 117/121 (97 %); below 90 % the numerics are wrong, not noisy.
MIN_TF_AGREEMENT = 0.90


@pytest.fixture(scope="module")
def pilot():
    s = build_system(PILOT, maintenance=True, n_slots=2)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def client(llama_server):
    with httpx.Client(base_url=llama_server.url, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(client, pilot):
    """llama.cpp's greedy 16 tokens and top-2 log-probabilities for each prompt, on our prompt ids."""
    tok = pilot.engine.tokenizer
    out = []
    for p in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": p}])
        r = client.post("/completion", json={"prompt": ids, "n_predict": N_TOKENS, "temperature": 0,
                                             "cache_prompt": False, "n_probs": 2, "return_tokens": True})
        r.raise_for_status()
        body = r.json()
        assert body["tokens_evaluated"] == len(ids)  # no BOS added, same prompt
        top2 = [[(t["id"], t["logprob"]) for t in cp["top_logprobs"]] for cp in body["completion_probabilities"]]
        out.append({"prompt": p, "ids": ids, "tokens": list(body["tokens"]), "top2": top2})
    return out


def _strings(n: int) -> list[str]:
    """``n`` varied strings from a fixed seed: ASCII words and code, digits, CJK, emoji (ZWJ sequences, skin
    tones, flags), accents and combining marks, RTL scripts, whitespace runs, control-token text."""
    rng = random.Random(20241)
    parts = ["hello", "world", "The", " quick", "brown fox", "don't", "we'll", "I'm", "x=1+2*3;", "def f(x):",
             "return [i**2 for i in range(10)]", "3.14159", "1234567890", "2024-12-02", "$100", "e-mail@example.com",
             "中文", "日本語のテキスト", "한국어", "繁體字", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "🤖✨",
             "café", "naïve", "Ünïcödé",
             "e\u0301", "ﬁ", "Ω≈ç√", "مرحبا", "שלום", "Привет", "ελληνικά", "<|im_start|>", "<|im_end|>",
             "<|endoftext|>", "<repo_name>", "<|im_start", "&amp;", "\\n", "...", "!!!", "?!", "—", "«»", "\u00a0"]
    spaces = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\n\t  ", "    ", ""]
    out = ["", " ", "\n", "   \n\n   ", "a", "😀" * 5, "1" * 40, "  leading", "trailing  ", "\t\ttabs"]
    while len(out) < n:
        k = rng.randint(1, 8)
        out.append("".join(rng.choice(parts) + rng.choice(spaces) for _ in range(k)))
    return out[:n]


def test_tokenisation_of_200_strings_equals_llama_server(client, pilot):
    strings = _strings(200)
    assert len(set(strings)) > 190
    mismatches = []
    for parse_special in (False, True):
        for s in strings:
            r = client.post("/tokenize", json={"content": s, "parse_special": parse_special})
            r.raise_for_status()
            theirs = r.json()["tokens"]
            ours = pilot.inference.tokenize(s, parse_special=parse_special)
            if ours != theirs:
                mismatches.append((parse_special, s, ours, theirs))
    assert not mismatches, mismatches[:5]


def test_chat_template_renders_as_llama_server(client, pilot):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."}]
    r = client.post("/apply-template", json={"messages": msgs})
    r.raise_for_status()
    assert pilot.inference.apply_template(msgs) == r.json()["prompt"]
    assert pilot.inference.chat_template == client.get("/props").json()["chat_template"]
    # llama-server's last-message rules on the GGUF's own template: a prefill, no generation prompt
    for body, kw in (({"messages": msgs + [{"role": "assistant", "content": "Blue"}]}, {}),
                     ({"messages": msgs, "add_generation_prompt": False}, {"add_generation_prompt": False})):
        r = client.post("/apply-template", json=body)
        r.raise_for_status()
        assert pilot.inference.apply_template(body["messages"], **kw) == r.json()["prompt"], body


def test_bos_eos_and_vocabulary_are_the_gguf_s(client, pilot):
    """/props' bos/eos texts come from the GGUF as llama-server reports them; the vocabulary is the bundle's."""
    theirs = client.get("/props").json()
    assert (pilot.inference.bos_token, pilot.inference.eos_token) == (theirs["bos_token"], theirs["eos_token"])
    assert pilot.inference.n_vocab == client.get("/v1/models").json()["data"][0]["meta"]["n_vocab"] == 49152


def _lp(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_teacher_forced_logprobs_within_the_measured_bound(pilot, reference):
    """Our numerics on llama.cpp's own tokens: every top-2 log-probability within DELTA_MAX of
    llama.cpp's, top-1 equal wherever its margin exceeds 2 * DELTA_MAX, and >= 90 % equal overall."""
    from sim_backend.model.families import build_numerics

    b = pilot.bundle
    model = build_numerics(b.shape, b.numeric, 256)
    diffs: list[float] = []
    agree, total, bad = 0, 0, []
    for ref in reference:
        model.clear_kv()
        seq = list(ref["ids"])
        pos = np.arange(len(seq))
        out = model.forward(np.array(seq), pos, pos, pos, pos)
        for k, t in enumerate(ref["tokens"]):
            lp = _lp(out.logits)
            (a, la), (c, lc) = ref["top2"][k]
            diffs.append(max(abs(lp[a] - la), abs(lp[c] - lc)))
            mine = int(np.argmax(out.logits))
            agree += mine == t
            total += 1
            if mine != t and la - lc > 2 * DELTA_MAX:
                bad.append((ref["prompt"], k, mine, t, la - lc))
            seq.append(t)
            p = len(seq) - 1
            cells = np.arange(p + 1)
            out = model.forward(np.array([t]), np.array([p]), np.array([p]), cells, cells)
    d = np.asarray(diffs)
    print(f"teacher-forced: top-1 equal at {agree}/{total}; |d logprob| of llama.cpp's top-2: mean {d.mean():.3f}, "
          f"p95 {np.percentile(d, 95):.3f}, max {d.max():.3f}")
    assert d.mean() <= MEAN_MAX
    assert d.max() <= DELTA_MAX
    assert not bad, bad
    assert agree / total >= MIN_TF_AGREEMENT


def test_greedy_replies_part_from_llama_cpp_only_at_near_ties(pilot, reference):
    """Free-running through the engine (BF16 logits, greedy): the first token that differs from llama.cpp's
    must be one where llama.cpp's own top-2 margin is below FLIP_MARGIN (it was nearly undecided)."""
    full, first, report, bad = 0, 0, [], []
    for ref in reference:
        res = pilot.inference.generate(ChatRequest(messages=({"role": "user", "content": ref["prompt"]},),
                                                   max_tokens=N_TOKENS, sampling=SamplingParams(temperature=0.0),
                                                   cache_prompt=False), timeout=300)
        assert res.status == "finished", res
        ours, theirs = list(res.tokens), ref["tokens"]
        k = next((i for i, (x, y) in enumerate(zip(ours, theirs, strict=False)) if x != y), None)
        if k is None and len(ours) != len(theirs):
            k = min(len(ours), len(theirs))
        if k is None:
            full += 1
        elif k < len(ref["top2"]):
            (_, la), (_, lc) = ref["top2"][k]
            report.append(f"{ref['prompt'][:24]!r} parts at {k} (llama.cpp margin {la - lc:.3f})")
            if la - lc > FLIP_MARGIN:
                bad.append((ref["prompt"], k, la - lc))
        first += k is None or k > 0
    print(f"greedy: first {N_TOKENS} tokens equal for {full}/8 prompts, first token for {first}/8; "
          + "; ".join(report))
    assert not bad, bad


def test_multi_turn_reuses_the_prefix_kv_and_a_stop_word_stops(pilot):
    """A second turn reuses the KV of the first turn's prompt and reply (``cache_n``); a stop word taken
    from a greedy reply ends the same reply just before it (stop type 'word')."""
    greedy = SamplingParams(temperature=0.0)
    q1 = {"role": "user", "content": "Who wrote Romeo and Juliet?"}
    r1 = pilot.inference.generate(ChatRequest(messages=(q1,), max_tokens=12, sampling=greedy), timeout=300)
    assert r1.status == "finished" and r1.text.strip()
    turn2 = (q1, {"role": "assistant", "content": r1.text}, {"role": "user", "content": "When was he born?"})
    r2 = pilot.inference.generate(ChatRequest(messages=turn2, max_tokens=4, sampling=greedy), timeout=300)
    assert r2.status == "finished"
    first_prompt = len(pilot.engine.tokenizer.encode_chat([q1]))
    assert r2.timings.cache_n >= first_prompt  # the whole first prompt (and the reply's tokens) reused
    words = [w for w in r1.text.split() if w.isalpha() and len(w) > 3]
    assert words, r1.text
    stop = words[-1]
    r3 = pilot.inference.generate(ChatRequest(messages=(q1,), max_tokens=12, sampling=greedy, stop=(stop,)),
                                  timeout=300)
    assert r3.stop_type == "word" and r3.stopping_word == stop
    assert r3.text == r1.text[:r1.text.index(stop)]


def test_golden_self_test_passes_for_the_pilot(pilot):
    m = pilot.maintenance
    lease = m.enter_exclusive("pilot-test")
    try:
        rep = m.self_test(lease)
    finally:
        m.leave_exclusive(lease)
    assert rep["ok"], rep
    assert rep["top1_match"] and rep["n_tokens"] == 6
