"""``logit_bias`` on ``/completion``, ``/v1/completions`` and chat, as llama-server reads and applies it.

The forms (llama-server's ``params_from_json_cmpl``): ``[[id, bias]]`` / ``[["text", bias]]`` pairs and the OpenAI
object ``{"id": bias}`` (a key ``strtol`` reads whole is an id, any other a text); a text's tokens each get the
bias; ``false`` bans the token (-inf); ids outside the vocabulary are skipped. What llama-server skips without a
word (a malformed entry) is a 400 here (allow-listed: ``status:malformed-logit-bias``). The bias is added to the
logits first in the sampler chain, so greedy decoding follows it; a request that would run timing-only has no
logits to bias and is refused, never served unbiased.

Parsing is checked on its own; the effect end to end on ours with the numerics on; the forms, echoes and
refusals against the real llama-server (the session's ``llama_server`` fixture).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from calconsole.codec import logit_bias_to_wire
from calconsole.server import wire
from sim_backend.planes import ChatRequest, InvalidRequestError, SamplingParams, validate_request
from tests.server.parity.streams import CHAT, MSG, assert_same_error, unexplained

# --- parsing -------------------------------------------------------------------------------------------

#: a stand-in tokenizer: one id per character (its code point), none for ""
def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def parse(lb: Any, n_vocab: int = 1000) -> tuple[tuple[int, float], ...]:
    return wire.logit_bias_from({"logit_bias": lb}, chars, n_vocab)


GOOD = [
    (None, ()),
    ([], ()),
    ({}, ()),
    ([[15, -1.0]], ((15, -1.0),)),
    ([[15, 2]], ((15, 2.0),)),
    ([[15, False]], ((15, -math.inf),)),
    ([["ab", 1.5]], ((97, 1.5), (98, 1.5))),  # each token of the text
    ([["ab", False]], ((97, -math.inf), (98, -math.inf))),
    ([["", 3]], ()),  # a text of no tokens
    ([[15, 5], [15, 7]], ((15, 5.0), (15, 7.0))),  # in order; they add up when applied
    ([[-1, 1], [1000, 1], [10**12, 1], [999, 1]], ((999, 1.0),)),  # ids outside [0, n_vocab) skipped
    ({"15": 1.5}, ((15, 1.5),)),
    ({"15": False}, ((15, -math.inf),)),
    ({" 15": 1, "+16": 2, "\t-0": 3}, ((15, 1.0), (16, 2.0), (0, 3.0))),  # strtol reads blanks and a sign
    ({"": 1}, ((0, 1.0),)),  # strtol reads "" as 0 and stops at its end: id 0, as llama-server
    ({"-1": 1, "5000": 1}, ()),  # ids out of range
    ({"15x": 1}, ((49, 1.0), (53, 1.0), (120, 1.0))),  # not a whole id: a text
    ({"15 ": 1}, ((49, 1.0), (53, 1.0), (32, 1.0))),  # a trailing blank is not read by strtol
    ({"15.0": 1}, ((49, 1.0), (53, 1.0), (46, 1.0), (48, 1.0))),
    ({"ab": False, "7": 1}, ((97, -math.inf), (98, -math.inf), (7, 1.0))),
    ([[15, 0.1]], ((15, 0.10000000149011612),)),  # a C float, as llama-server keeps it
    ([[15, 1e39]], ((15, math.inf),)),  # past float32's range: +inf there too
    ([[15, -1e39]], ((15, -math.inf),)),
]


@pytest.mark.parametrize("lb,want", GOOD, ids=[repr(g[0])[:40] for g in GOOD])
def test_every_form_reads_as_llama_server_reads_it(lb: Any, want: tuple[tuple[int, float], ...]) -> None:
    assert parse(lb) == want


BAD = [
    ("abc", "must be a list of [token, bias] pairs or an object"),
    (5, "must be a list"),
    (True, "must be a list"),
    ([15], "'logit_bias[0]' must be a [token, bias] pair"),
    ([[15]], "[token, bias] pair"),
    ([[15, 1, 2]], "[token, bias] pair"),
    ([[15, 1], {"15": 1}], "'logit_bias[1]' must be a [token, bias] pair"),
    ([[1.5, 1]], "the token must be an integer id or a string"),
    ([[True, 1]], "the token must be an integer id or a string"),
    ([[None, 1]], "the token must be an integer id or a string"),
    ([[15, True]], "a bias must be a number, or false"),
    ([[15, "a"]], "a bias must be a number, or false"),
    ([[15, None]], "a bias must be a number, or false"),
    ([[15, [1]]], "a bias must be a number, or false"),
    ({"15": "x"}, "'logit_bias' [\"15\"]: a bias must be a number"),
    ({"15": True}, "a bias must be a number"),
    ([[15, math.nan]], "a finite number"),
    ([[15, math.inf]], "a finite number"),  # a JSON Infinity / 1e999 literal: llama-server's parser refuses it
    ({"15": -math.inf}, "a finite number"),
]


@pytest.mark.parametrize("lb,words", BAD, ids=[repr(b[0])[:40] for b in BAD])
def test_malformed_forms_are_400_naming_the_entry(lb: Any, words: str) -> None:
    with pytest.raises(wire.HTTPError) as e:
        parse(lb)
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert words in e.value.message and "logit_bias" in e.value.message, e.value.message


def test_generation_settings_echo_the_biases_then_the_eog_bans() -> None:
    req = ChatRequest(messages=(), prompt_tokens=(1, 2), max_tokens=2, ignore_eos=True,
                      logit_bias=((15, 0.5), (16, -math.inf), (17, math.inf)))
    gs = wire.generation_settings(req, 4096, eog_ids=(0, 2))
    assert gs["logit_bias"] == [{"bias": 0.5, "token": 15}, {"bias": None, "token": 16}, {"bias": None, "token": 17},
                                {"bias": None, "token": 0}, {"bias": None, "token": 2}]
    keys = list(gs)
    assert keys.index("logit_bias") == keys.index("stream") + 1  # llama-server's key order


def test_validate_request_and_the_wire_form() -> None:
    ok = ChatRequest.from_prompt("hi", max_tokens=1, logit_bias=((3, -math.inf), (4, math.inf), (5, 2.0)))
    validate_request(ok, vocab=100)
    for bad in (((100, 1.0),), ((-1, 1.0),), ((3, math.nan),), ((3, "a"),), ((True, 1.0),)):
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            validate_request(ChatRequest.from_prompt("hi", max_tokens=1, logit_bias=bad), vocab=100)  # type: ignore[arg-type]
    assert logit_bias_to_wire(ok.logit_bias) == [[3, False], [4, 1e39], [5, 2.0]]
    # what the face sends reads back the same (1e39: +inf as llama-server reads it)
    assert wire.logit_bias_from({"logit_bias": logit_bias_to_wire(ok.logit_bias)}, chars, 100) == ok.logit_bias


def test_the_remote_planes_send_the_biases() -> None:
    from calconsole.remote.inference import request_body as ours
    from calconsole.remote.llamacpp.inference import request_body as theirs

    for req in (ChatRequest.from_prompt("hi", max_tokens=1, logit_bias=((3, -math.inf), (5, 2.0))),
                ChatRequest(messages=(), prompt_tokens=(1, 2), max_tokens=1, logit_bias=((3, -math.inf),))):
        for body_of in (ours, theirs):
            _, body = body_of(req)
            assert body["logit_bias"] == logit_bias_to_wire(req.logit_bias)
    assert "logit_bias" not in ours(ChatRequest.from_prompt("hi", max_tokens=1))[1]


# --- the effect, on ours with the numerics on ---------------------------------------------------------------

@pytest.fixture(scope="module")
def numeric(make_module_server: Any) -> str:
    """Ours with the numerics on: the bias is added to the logits the simulated device returned."""
    return make_module_server(system_kw={"n_slots": 1, "numerics": True}).url


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}


def tokens(url: str, **body: Any) -> list[int]:
    r = post(url, "/completion", {"prompt": "The lighthouse keeper", "n_predict": 6, **GREEDY, **body})
    assert r.status_code == 200, r.text[:300]
    return list(r.json()["tokens"])


def test_a_banned_token_never_appears(numeric: str) -> None:
    plain = tokens(numeric)
    assert len(plain) == 6
    banned = sorted(set(plain))
    for form in ([[t, False] for t in banned], {str(t): False for t in banned}):
        got = tokens(numeric, logit_bias=form)
        assert len(got) == 6 and not set(got) & set(banned), (plain, got)
    # sampled, not greedy: still never
    for seed in (1, 2, 3):
        got = tokens(numeric, logit_bias=[[t, False] for t in banned], temperature=1.0, seed=seed)
        assert not set(got) & set(banned), got


def test_a_strong_positive_bias_forces_a_token(numeric: str) -> None:
    for form in ([[42, 100]], {"42": 100.0}, [[42, 1e39]]):
        assert tokens(numeric, logit_bias=form) == [42] * 6
    assert tokens(numeric, logit_bias=[[42, 1e39]], temperature=1.0, seed=5) == [42] * 6


def test_a_text_key_biases_its_tokens(numeric: str) -> None:
    ids = httpx.post(numeric + "/tokenize", json={"content": " the"}, timeout=60).json()["tokens"]
    r = post(numeric, "/completion", {"prompt": "The lighthouse keeper", "n_predict": 3, **GREEDY,
                                      "logit_bias": [[" the", 100]]})
    assert r.status_code == 200 and r.json()["tokens"] == [ids[0]] * 3, (ids, r.text[:300])
    assert r.json()["generation_settings"]["logit_bias"][: len(ids)] == [{"bias": 100.0, "token": t} for t in ids]


def test_chat_and_openai_completions_apply_it(numeric: str) -> None:
    chat = post(numeric, CHAT, {"messages": MSG, "max_tokens": 4, "temperature": 0, "logit_bias": {"42": 100}})
    assert chat.status_code == 200, chat.text[:300]
    assert chat.json()["calconsole"]["tokens"] == [42] * 4
    text = post(numeric, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                             "logit_bias": {"42": 100}})
    assert text.status_code == 200 and text.json()["calconsole"]["tokens"] == [42] * 3, text.text[:300]
    stream = post(numeric, CHAT, {"messages": MSG, "max_tokens": 3, "temperature": 0, "stream": True,
                                  "logit_bias": [[42, False]]})
    assert stream.status_code == 200 and '"finish_reason":"length"' in stream.text.replace(" ", "")


def test_bad_forms_are_refused_on_every_route(numeric: str) -> None:
    for path, body in (("/completion", {"prompt": "Hi", "n_predict": 1}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                       (CHAT, {"messages": MSG, "max_tokens": 1})):
        r = post(numeric, path, {**body, "logit_bias": [[15, "a"]]})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text[:300]
        assert "logit_bias" in r.json()["error"]["message"]


def test_timing_only_requests_with_a_bias_are_refused(make_module_server: Any) -> None:
    """No logits, nothing to bias: 400 saying the request would run timing-only and why; a bias that reads as
    none (ids all out of range, an empty text) asks nothing, and is served."""
    url = make_module_server(system_kw={"n_slots": 1}).url
    for path, body in (("/completion", {"prompt": "Hi", "n_predict": 1}),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                       (CHAT, {"messages": MSG, "max_tokens": 1}),
                       (CHAT, {"messages": MSG, "max_tokens": 1, "stream": True})):
        r = post(url, path, {**body, "logit_bias": {"15": False}})
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and "'logit_bias'" in err["message"], err
        assert "timing-only" in err["message"] and "numerics off" in err["message"], err
        assert post(url, path, {**body, "logit_bias": [[10**9, False], ["", 1]]}).status_code == 200


def test_what_needs_logits() -> None:
    """The engine's test, at submit and again when the request takes its slot (``admission.needs_logits``):
    probabilities or a bias need the logits; the refusal names the field, probabilities' said first."""
    from sim_backend.serving.admission import logits_refusal, needs_logits

    assert not needs_logits(ChatRequest.from_prompt("hi", max_tokens=1))
    biased = ChatRequest.from_prompt("hi", max_tokens=1, logit_bias=((1, 1.0),))
    assert needs_logits(biased)
    e = logits_refusal(biased, "the device runs timing-only (numerics off)")
    assert e.param == "logit_bias" and str(e).startswith("'logit_bias' is added to the model's logits, and this "
                                                         "request would run timing-only: the device runs")
    both = ChatRequest.from_prompt("hi", max_tokens=1, n_probs=1, logit_bias=((1, 1.0),))
    assert logits_refusal(both, "x").param == "n_probs"


# --- against the real llama-server ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def npair(numeric: str, llama_server: Any) -> tuple[str, str]:
    return numeric, llama_server.url


def biases(r: httpx.Response) -> list[dict[str, Any]]:
    return list(r.json()["generation_settings"]["logit_bias"])


#: forms of token ids only: both echo the very same entries (ids and float32 biases; a ban null)
ID_FORMS = [
    [[15, -1.0]], [[15, False]], [[15, 0.1]], [[15, 5], [15, 7]], {"15": 1.5}, {"15": False}, {" 15": 1, "+16": 2},
    {"": 1}, {"15": 1, "16": False}, [[15, 1e39]], [[15, -1e39]], [[-1, 1], [10**8, 1]], {"-1": 1}, [], {}, None,
]


@pytest.mark.parametrize("lb", ID_FORMS, ids=[repr(f)[:40] for f in ID_FORMS])
def test_id_forms_echo_as_llama_server_does(npair: tuple[str, str], lb: Any) -> None:
    body = {"prompt": "Hello", "n_predict": 1, "temperature": 0, "logit_bias": lb}
    ours, theirs = (post(u, "/completion", body) for u in npair)
    assert ours.status_code == theirs.status_code == 200, (ours.text[:300], theirs.text[:300])
    assert biases(ours) == biases(theirs)
    assert unexplained(ours.json(), theirs.json()) == []


#: forms with texts: the same shape, one entry per token (each model its own tokenizer)
TEXT_FORMS = [[["Hello", 2]], [["Hello world", False]], {"Hello": 1}, {"15x": 1}, [["", 1]], {"ab": False, "7": 1}]


@pytest.mark.parametrize("lb", TEXT_FORMS, ids=[repr(f)[:40] for f in TEXT_FORMS])
def test_text_forms_bias_each_token_on_both(npair: tuple[str, str], lb: Any) -> None:
    def tokenized(url: str, text: str) -> list[int]:
        return list(httpx.post(url + "/tokenize", json={"content": text}, timeout=60).json()["tokens"])

    pairs = lb.items() if isinstance(lb, dict) else lb
    for url in npair:
        r = post(url, "/completion", {"prompt": "Hello", "n_predict": 1, "temperature": 0, "logit_bias": lb})
        assert r.status_code == 200, r.text[:300]
        want = []
        for key, bias in pairs:
            b = None if bias is False else float(bias)
            ids = [int(key)] if isinstance(key, str) and key.isdigit() else tokenized(url, key)
            want += [{"bias": b, "token": t} for t in ids]
        assert biases(r) == want, url


@pytest.mark.parametrize("path,body", [("/completion", {"prompt": "Hello", "n_predict": 2}),
                                       ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
                                       (CHAT, {"messages": MSG, "max_tokens": 2})])
def test_every_route_accepts_both_forms_and_follows_a_ban(npair: tuple[str, str], path: str,
                                                         body: dict[str, Any]) -> None:
    for lb in ([[15, False], ["Hello", -2]], {"15": False, "Hello": 2}):
        ours, theirs = (post(u, path, {**body, "temperature": 0, "ignore_eos": True, "logit_bias": lb}) for u in npair)
        assert ours.status_code == theirs.status_code == 200, (ours.text[:300], theirs.text[:300])
        assert unexplained(ours.json(), theirs.json()) == []
    # a ban the greedy reply would take: the reply changes on both, and never holds it
    for url in npair:
        first = post(url, "/completion", {"prompt": "Hello", "n_predict": 3, **GREEDY}).json()["tokens"]
        again = post(url, "/completion", {"prompt": "Hello", "n_predict": 3, **GREEDY,
                                          "logit_bias": [[first[0], False]]}).json()["tokens"]
        assert first[0] not in again and again != first, (url, first, again)


#: JSON both refuse: NaN, Infinity, a number past the double's range (llama-server's parser: 400)
RAW_BAD = ['[[15,NaN]]', '[[15,Infinity]]', '[[15,1e999]]', '{"15":-Infinity}']


@pytest.mark.parametrize("raw", RAW_BAD)
def test_non_finite_biases_are_400_on_both(npair: tuple[str, str], raw: str) -> None:
    content = '{"prompt":"Hello","n_predict":1,"logit_bias":' + raw + "}"
    ours, theirs = (httpx.post(u + "/completion", content=content, headers={"Content-Type": "application/json"},
                               timeout=60) for u in npair)
    assert ours.status_code == theirs.status_code == 400, (ours.text[:300], theirs.text[:300])
    assert_same_error(ours.json(), theirs.json())


#: what llama-server skips without a word (allow-listed: status:malformed-logit-bias); ours says what is wrong
MALFORMED = [[[15, True]], [[15, "a"]], [[15, None]], [[15]], [[15, 1, 2]], [15], [[1.5, 1]], [[True, 1]],
             {"15": "x"}, "abc", 5, True]


@pytest.mark.parametrize("lb", MALFORMED, ids=[repr(f)[:40] for f in MALFORMED])
def test_malformed_forms_are_refused_where_llama_server_skips_them(npair: tuple[str, str], lb: Any) -> None:
    body = {"prompt": "Hello", "n_predict": 1, "temperature": 0, "logit_bias": lb}
    ours, theirs = (post(u, "/completion", body) for u in npair)
    assert theirs.status_code == 200 and biases(theirs) == [], theirs.text[:300]  # skipped: no bias at all
    assert ours.status_code == 400, ours.text[:300]
    bad = post(npair[1], "/completion", {"prompt": "x", "n_predict": "a"})  # a 400 of theirs, for its shape
    assert_same_error(ours.json(), bad.json())
    assert "logit_bias" in ours.json()["error"]["message"]


def test_remote_planes_carry_the_bias(npair: tuple[str, str], tmp_path: Any) -> None:
    from calconsole.remote import connect
    from sim_backend.planes import DoneEvent

    for i, url in enumerate(npair):
        with connect(url, audit_path=tmp_path / f"audit-{i}.jsonl") as system:
            req = ChatRequest(messages=(), prompt_tokens=(19556, 905), max_tokens=3, ignore_eos=True,
                              sampling=SamplingParams.greedy(), logit_bias=((42, 1e39), (43, -math.inf)))
            events = list(system.inference.submit(req).stream(timeout=60))
            res = events[-1].result
            assert isinstance(events[-1], DoneEvent) and res.status == "finished", res
            # the text of three 42s (llama-server's stream gives no ids to the plane)
            assert res.text == system.inference.detokenize([42] * 3) and res.timings.predicted_n == 3, (url, res)
