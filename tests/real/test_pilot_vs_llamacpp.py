"""The dense pilot (SmolLM2-135M-Instruct Q4_1 on the simulated NPU) against llama.cpp on the same GGUF.

The real llama-server fixture (``llama_server``, xllamacpp) serves the very file the pilot bundle
reads. Checked here: tokenisation of 200 varied strings equals ``/tokenize`` exactly (both with and
without control-token parsing), the chat template, and greedy replies to 8 fixed prompts: teacher-forced
on llama.cpp's own tokens, free-running on the numerics' float32 logits, and free-running through our
whole serving path (engine, device, the logits the device returns: F32 for the pilot's C3 calbin; BF16
for a copy of it that returns what the production calbin returns).

The pilot's numerics compute llama.cpp's CPU arithmetic operation by operation, in its order and with its
roundings (``sim_backend/model/families/dense_kernels.py``; each operation is checked bit for bit against
the wheel's ggml in ``test_pilot_ggml_ops.py``), so its float32 logits are llama.cpp's: teacher-forced,
top-1 equal at every position and our log-probabilities of llama.cpp's top tokens within DELTA_MAX of the
server's (measured 2.5e-4 nats at most: the server's own float32 softmax over 49,152 logits; before this
emulation the error was 0.12 nats on average and 0.91 at most). Free-running on the float32 logits the
first 16 tokens equal llama.cpp's for all 8 prompts (the issue's targets: >= 6, and the first token for
all 8).

Through the engine the pilot's device returns F32 logits (its manifest declares them; a C3 calbin the
vendor would compile, priced at 49,152 x 4 B D2H), so the engine samples those same float32 values and the
issue's targets hold there too: >= 6 of 8 prompts equal on 16 tokens, the first token for all 8.

A BF16 device (what the production calbin returns, facts.md F1: 8 bits of mantissa, a step of 0.0625 at
|logit| 8-16 and 0.125 at 16-32) cannot do that: greedy sampling takes the lowest id among equal BF16
maxima, and two logits closer than a step can round to the same BF16 value. That path is still checked,
on a copy of the pilot whose manifest declares BF16 logits, and exactly: every reply follows llama.cpp's
until a position where llama.cpp's top token and the token we took have the SAME BF16 logit (a tie the
device cannot break); measured before the F32 pilot: 16 tokens equal for 4 of 8 prompts, the first
token for 7 of 8, partings at llama.cpp top-2 margins of 0.001-0.05 nats, all BF16 ties.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

from sim_backend.compose import build_system
from sim_backend.model.bf16 import bf16_to_f32, f32_to_bf16
from sim_backend.planes.types import ChatRequest, SamplingParams

PILOT = Path(__file__).resolve().parents[2] / "sim_backend" / "bundles" / "smollm2-135m-pilot"

#: Fixed before the first comparison was run; not chosen by their results.
PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.", "List three primary colors.",
           "How many legs does a spider have?", "Translate 'good morning' into Spanish.", "What is 12 plus 7?",
           "Give me a short tip for learning to code.", "Who wrote Romeo and Juliet?")
N_TOKENS = 16
#: Largest |our log-probability - llama.cpp's| of llama.cpp's top tokens, teacher-forced (nats): the logits
#: are the same bits, so what is left is the server's float32 softmax (measured 2.5e-4).
DELTA_MAX = 1e-3
#: The issue's targets for the float32 logits: the first 16 tokens equal for at least 6 prompts, the first
#: token for all 8.
MIN_FULL, MIN_FIRST = 6, 8


@pytest.fixture(scope="module")
def pilot(tmp_path_factory):
    s = build_system(PILOT, maintenance=True, n_slots=2, audit_path=tmp_path_factory.mktemp("pilot") / "audit.jsonl")
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


def _bf16(x: float) -> float:
    """x rounded to BF16 (round half to even), as the device returns its logits."""
    return float(bf16_to_f32(f32_to_bf16(np.array([x], dtype=np.float32)))[0])


@pytest.fixture(scope="module")
def forced(pilot, reference):
    """Our float32 logits, teacher-forced on llama.cpp's tokens: per prompt one (vocab,) array per position."""
    from sim_backend.model.families import build_numerics

    b = pilot.bundle
    model = build_numerics(b.shape, b.numeric, 256)
    out = []
    for ref in reference:
        model.clear_kv()
        seq = list(ref["ids"])
        pos = np.arange(len(seq))
        step = model.forward(np.array(seq), pos, pos, pos, pos)
        per = []
        for t in ref["tokens"]:
            per.append(step.logits.copy())
            seq.append(t)
            p = len(seq) - 1
            cells = np.arange(p + 1)
            step = model.forward(np.array([t]), np.array([p]), np.array([p]), cells, cells)
        out.append(per)
    return out


def test_teacher_forced_logits_are_llama_cpp_s(reference, forced):
    """On llama.cpp's own tokens: top-1 equal at every position, our log-probabilities of its top tokens within
    DELTA_MAX of the server's, and (since the numerics follow llama.cpp's float32 path) free-running greedy on
    our float32 logits gives the same replies: 16 tokens for >= MIN_FULL prompts, the first for MIN_FIRST."""
    diffs: list[float] = []
    agree = total = 0
    full = first = 0
    for ref, per in zip(reference, forced, strict=True):
        parted = None
        for k, logits in enumerate(per):
            lp = _lp(logits)
            diffs.extend(abs(lp[a] - la) for a, la in ref["top2"][k])
            mine = int(np.argmax(logits))
            agree += mine == ref["tokens"][k]
            total += 1
            if parted is None and mine != ref["tokens"][k]:
                parted = k
        full += parted is None
        first += parted != 0
    d = np.asarray(diffs)
    print(f"teacher-forced: top-1 equal at {agree}/{total}; |d logprob| of llama.cpp's top-2: mean {d.mean():.2e}, "
          f"max {d.max():.2e}; float32 greedy: first {N_TOKENS} tokens equal for {full}/8, first token {first}/8")
    assert d.max() <= DELTA_MAX
    assert agree == total
    assert full >= MIN_FULL and first >= MIN_FIRST


def _engine_agreement(system, reference, forced) -> dict:
    """Greedy replies to the 8 prompts through ``system``'s engine (device, D2H logits, sampler), against
    llama.cpp's: how many equal on all 16 tokens and on the first, and where each other one parts (with
    llama.cpp's top-2 margin there and whether the two tokens' logits are one BF16 value)."""
    full, first, report, partings = 0, 0, [], []
    for ref, per in zip(reference, forced, strict=True):
        res = system.inference.generate(ChatRequest(messages=({"role": "user", "content": ref["prompt"]},),
                                                    max_tokens=N_TOKENS, sampling=SamplingParams(temperature=0.0),
                                                    cache_prompt=False), timeout=300)
        assert res.status == "finished", res
        ours, theirs = list(res.tokens), ref["tokens"]
        k = next((i for i, (x, y) in enumerate(zip(ours, theirs, strict=False)) if x != y), None)
        if k is None and len(ours) != len(theirs):
            k = min(len(ours), len(theirs))
        if k is None:
            full += 1
        elif k < len(per):
            logits = per[k]  # the same prefix: the reply followed llama.cpp's up to k
            (_, la), (_, lc) = ref["top2"][k]
            tie = _bf16(logits[ours[k]]) == _bf16(logits[theirs[k]])
            report.append(f"{ref['prompt'][:24]!r} parts at {k} (llama.cpp margin {la - lc:.4f}, BF16 tie {tie})")
            partings.append({"prompt": ref["prompt"], "k": k, "ours": ours[k], "theirs": theirs[k],
                             "margin": la - lc, "bf16_tie": tie})
        first += k is None or k > 0
    return {"full": full, "first": first, "report": report, "partings": partings}


def test_engine_replies_meet_the_targets_with_the_pilot_s_f32_logits(pilot, reference, forced):
    """Free-running through the engine on the pilot's F32 logits (its C3 calbin declares them): the issue's
    targets, >= MIN_FULL prompts equal on 16 tokens and the first token for MIN_FIRST."""
    assert pilot.bundle.logits_dtype == "f32"
    a = _engine_agreement(pilot, reference, forced)
    print(f"engine (F32 logits): first {N_TOKENS} tokens equal for {a['full']}/8 prompts, first token for "
          f"{a['first']}/8; " + "; ".join(a["report"]))
    assert a["full"] >= MIN_FULL and a["first"] >= MIN_FIRST, a


@pytest.fixture
def pilot_bf16(tmp_path):
    """The pilot with the production calbin's D2H dtype: a copy whose manifest declares BF16 logits."""
    d = tmp_path / "pilot-bf16"
    shutil.copytree(PILOT, d)
    mf = d / "calbin.yaml"
    text = mf.read_text()
    assert text.count("dtype: f32, shape: [1, 49152]") == 2
    mf.write_text(text.replace("dtype: f32, shape: [1, 49152]", "dtype: bf16, shape: [1, 49152]"))
    s = build_system(d, n_slots=1)
    try:
        yield s
    finally:
        s.close()


def test_bf16_engine_replies_part_from_llama_cpp_only_at_bf16_ties(pilot_bf16, reference, forced):
    """Free-running through the engine on BF16 logits (what the production calbin returns; greedy): a reply
    may part from llama.cpp's only at a position where the token we took and llama.cpp's have the same BF16
    logit (a tie of the device's output; the lowest id wins it), never where BF16 still orders them."""
    assert pilot_bf16.bundle.logits_dtype == "bf16"
    a = _engine_agreement(pilot_bf16, reference, forced)
    print(f"engine (BF16 logits): first {N_TOKENS} tokens equal for {a['full']}/8 prompts, first token for "
          f"{a['first']}/8; " + "; ".join(a["report"]))
    bad = [p for p in a["partings"] if not p["bf16_tie"]]
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
