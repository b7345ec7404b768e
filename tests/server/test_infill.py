"""``/infill``'s prompt builder on its own (the real-server comparison is test_infill_llama_server): the cuts,
``--spm-infill``'s order, the separator without a file token, the 501 words, and a stream on our server."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from calconsole.server.infill import FimTokens, infill_prompt

FIM = FimTokens(pre=-1, suf=-2, mid=-3, rep=-4, sep=-5)


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_cuts_follow_the_batch_and_the_context() -> None:
    body = {"input_prefix": "p" * 100, "input_suffix": "s" * 100, "input_extra": [{"text": "e" * 500}]}
    ids = infill_prompt(body, FIM, chars, chars("12"), n_batch=32, n_predict=8, n_ctx=256)
    pre, suf = ids.index(-1), ids.index(-2)
    assert pre == 256 - 32 - 2 * 8  # the extra context's last 208 tokens
    assert suf - pre - 1 == 24 + 2  # 3*(32/4) of the prefix, then the prompt
    assert len(ids) - suf - 2 == 32 // 4 - (2 + 2)  # the suffix's first n_batch/4 - (2 + prompt)
    # n_predict -1 (the default): 2*n_predict adds room
    assert infill_prompt(body, FIM, chars, [], n_batch=32, n_predict=-1, n_ctx=256).index(-1) == 256 - 32 + 2


def test_spm_puts_the_suffix_first_and_no_file_token_gives_the_snippet_separator() -> None:
    body = {"input_prefix": "p", "input_suffix": "s", "input_extra": [{"text": "t"}]}
    ids = infill_prompt(body, FIM, chars, [], n_batch=2048, n_predict=-1, n_ctx=4096, spm_infill=True)
    assert ids[-5:] == [-2, ord("s"), -1, ord("p"), -3]
    bare = FimTokens(pre=-1, suf=-2, mid=-3, rep=None, sep=None)
    ids = infill_prompt(body, bare, chars, [], n_batch=2048, n_predict=-1, n_ctx=4096)
    assert ids == chars("\n\n--- snippet ---\n\nt") + [-1, ord("p"), -2, ord("s"), -3]


def test_missing_tokens_are_named_as_llama_server_names_them() -> None:
    assert FIM.missing() == ""
    assert FimTokens(pre=None, suf=1, mid=None, rep=None, sep=None).missing() == (
        "Infill is not supported by this model: prefix token is missing. middle token is missing. ")


@pytest.mark.parametrize("stream", [False, True])
def test_infill_answers_as_completion(make_server: Any, stream: bool) -> None:
    url = make_server().url
    body = {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 3, "stream": stream, "seed": 1}
    r = httpx.post(url + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        lines = [ln for ln in r.text.splitlines() if ln.startswith("data: ")]
        assert lines and '"stop":true' in lines[-1].replace(" ", "")
    else:
        out = r.json()
        assert out["prompt"] == "<|repo_name|>myproject\n<|file_sep|>filename\n<|fim_prefix|>def f(<|fim_suffix|>):" \
                                "<|fim_middle|>" and out["tokens_predicted"] == 3


def test_a_vocabulary_without_fim_tokens_is_llama_servers_501(make_server: Any, monkeypatch: Any) -> None:
    srv = make_server()
    real = srv.face.inference.tokenize

    def no_fim(text: str, parse_special: bool = False) -> list[int]:
        return real(text, parse_special=parse_special and not text.startswith("<|fim_"))

    monkeypatch.setattr(srv.face.inference, "tokenize", no_fim)
    r = httpx.post(srv.url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=60)
    assert r.status_code == 501 and r.json()["error"] == {
        "code": 501, "type": "not_supported_error", "message": "Infill is not supported by this model: prefix token "
        "is missing. suffix token is missing. middle token is missing. "}
