"""Differential: ``POST /infill`` on a real llama-server and on ``calconsole serve``.

SmolLM2's GGUF has no fill-in-the-middle tokens, so the real server runs a copy whose metadata names five of
its special tokens as FIM prefix / suffix / middle / repo / file separator (``gguf_new_metadata``); Qwen3's
vocabulary has its own (``<|fim_prefix|>`` ...). Both servers run with ``n_batch`` 32, ``n_predict`` 8 and a
256-token slot, so the prefix, suffix and extra-context cuts all bite. Compared: each refusal (status, type,
words), and the prompt each builds, as its ``/infill`` response echoes it (``prompt``), with each vocabulary's
FIM token texts mapped to one name. Digits are one token each in both vocabularies, so the cuts are
comparable.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.server.parity.streams import FULL, assert_same_stream, body_of, both, unexplained

N_BATCH, N_PREDICT, N_CTX = 32, 8, 256
#: the SmolLM2 ids named as FIM tokens in the copy (its <repo_name>, <file_sep> and three unused specials)
FIM_IDS = {"fim_rep": 3, "fim_sep": 5, "fim_pre": 7, "fim_suf": 8, "fim_mid": 9}
QWEN_FIM = {"fim_rep": "<|repo_name|>", "fim_sep": "<|file_sep|>", "fim_pre": "<|fim_prefix|>",
            "fim_suf": "<|fim_suffix|>", "fim_mid": "<|fim_middle|>"}
DIGITS = "".join(str(i % 10) for i in range(400))
REFUSED = [
    {}, {"input_prefix": "a"}, {"input_suffix": "b"},
    {"input_prefix": "a", "input_suffix": "b", "input_extra": {}},
    {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"filename": "x"}]},
    {"input_prefix": "a", "input_suffix": "b", "input_extra": [3]},
    {"input_prefix": "a", "input_suffix": "b", "input_extra": [{"text": "t", "filename": 3}]},
    {"input_prefix": 3, "input_suffix": "b"}, {"input_prefix": "a", "input_suffix": {"x": 1}},
    {"input_prefix": ["a", None], "input_suffix": "b"}, {"input_prefix": "a", "input_suffix": ["b", "c", {}]},
]
LAID_OUT = [
    {"input_prefix": "def f(", "input_suffix": "):",
     "input_extra": [{"filename": "u.py", "text": "import os\n"}, {"text": "zz"}], "prompt": "12"},
    {"input_prefix": "x = 1", "input_suffix": ""},
    {"input_prefix": DIGITS[:100], "input_suffix": DIGITS[:100], "prompt": "12"},
    {"input_prefix": DIGITS[:100], "input_suffix": DIGITS[:100], "input_extra": [{"filename": "a", "text": DIGITS}]},
    {"input_prefix": ["12", "34"], "input_suffix": "56", "input_extra": []},
    {"input_prefix": ["ab", "cd"], "input_suffix": "", "prompt": 5},  # a prompt not a string: none, as there
]


@pytest.fixture(scope="module")
def real_fim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.real.llama_server import smollm2_gguf, start_llama_server

    out = tmp_path_factory.mktemp("fim") / "smollm2-fim.gguf"
    ids = [a for k, v in FIM_IDS.items() for a in ("--special-token-by-id", k, str(v))]
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", smollm2_gguf(), str(out), *ids,
                    "--force"], check=True, capture_output=True, timeout=300)

    def configure(p: Any) -> None:
        p.model.path = str(out)
        p.n_batch = N_BATCH
        p.n_predict = N_PREDICT

    server = start_llama_server(n_parallel=1, n_ctx=N_CTX, configure=configure)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def ours(make_module_server: Any) -> str:
    return str(make_module_server(n_batch=N_BATCH, n_predict=N_PREDICT, n_ctx=N_CTX).url)


def _post(url: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


@pytest.mark.parametrize("body", REFUSED, ids=range(len(REFUSED)))
def test_the_same_refusal(real_fim: Any, ours: str, body: dict[str, Any]) -> None:
    theirs, mine = _post(real_fim.url, "/infill", body), _post(ours, "/infill", body)
    assert theirs.status_code == 400, theirs.text
    assert (mine.status_code, mine.json()["error"]) == (theirs.status_code, theirs.json()["error"])


def _named(text: str, names: dict[str, str]) -> str:
    for name, piece in names.items():
        text = text.replace(piece, f"[{name}]")
    return text


@pytest.mark.parametrize("body", LAID_OUT, ids=range(len(LAID_OUT)))
def test_the_same_prompt_layout(real_fim: Any, ours: str, body: dict[str, Any]) -> None:
    smol = {k: _post(real_fim.url, "/detokenize", {"tokens": [v]}).json()["content"] for k, v in FIM_IDS.items()}
    req = {**body, "n_predict": 1, "temperature": 0}
    theirs, mine = _post(real_fim.url, "/infill", req), _post(ours, "/infill", req)
    assert theirs.status_code == mine.status_code == 200, (theirs.text, mine.text)
    t, m = theirs.json(), mine.json()
    assert _named(m["prompt"], QWEN_FIM) == _named(t["prompt"], smol)
    assert "[fim_pre]" in _named(m["prompt"], QWEN_FIM)
    assert unexplained(m, t) == []  # the same shape as /completion's, its known differences allowed


def test_the_same_stream(real_fim: Any, ours: str) -> None:
    body = {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 3, "stream": True, **FULL}
    pair = (ours, real_fim.url)
    mine, theirs = both(pair, "POST", "/infill", body)
    assert mine.status_code == theirs.status_code == 200
    assert_same_stream(body_of(mine), body_of(theirs), "native")
