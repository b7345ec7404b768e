"""llama-server's serving options on the face: --ctx-size, --seed, --alias (several), --tags, --host lists."""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import pytest

from calconsole.commands.serve import hosts_of, load_serving_keys
from calconsole.server.face import ServeConfig
from tests.server.parity.shapes import diff

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def srv(make_module_server: Any) -> Any:
    return make_module_server(n_ctx=64, seed=1234, model_alias="qwen3,qwen3-30b-a3b", model_tags=("sim", "moe"))


def test_ctx_size_refuses_a_prompt_that_fills_it_as_llama_server_does(srv: Any, llama_server: Any) -> None:
    ours = httpx.post(srv.url + "/completion", json={"prompt": "hi " * 100, "n_predict": 1}, timeout=60)
    # the fixture's slot context is 4096 / 2 slots = 2048 tokens
    theirs = httpx.post(llama_server.url + "/completion", json={"prompt": "hi " * 2100, "n_predict": 1}, timeout=60)
    assert ours.status_code == theirs.status_code == 400
    a, b = ours.json()["error"], theirs.json()["error"]
    assert a["type"] == b["type"] == "exceed_context_size_error" and diff(a, b) == []
    assert a["n_ctx"] == 64 and a["n_prompt_tokens"] >= 64
    assert a["message"] == f"request ({a['n_prompt_tokens']} tokens) exceeds the available context size (64 tokens), " \
                           "try increasing it"
    chat = httpx.post(srv.url + CHAT, json={"messages": [{"role": "user", "content": "hi " * 100}]}, timeout=60)
    assert chat.json()["error"]["type"] == "exceed_context_size_error"


def test_ctx_size_ends_generation_at_the_context(srv: Any) -> None:
    r = httpx.post(srv.url + "/completion", json={"prompt": [1, 2, 3, 4], "n_predict": -1}, timeout=60).json()
    assert r["tokens_evaluated"] + r["tokens_predicted"] <= 64 and r["stop_type"] in ("limit", "eos", "word")
    props = httpx.get(srv.url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 64
    assert httpx.get(srv.url + "/v1/models").json()["data"][0]["meta"]["n_ctx_train"] == 40960


def test_seed_alias_and_tags(srv: Any) -> None:
    props = httpx.get(srv.url + "/props").json()
    assert props["default_generation_settings"]["params"]["seed"] == 1234 and props["model_alias"] == "qwen3"
    body = {"prompt": [1, 2, 3], "n_predict": 4, "temperature": 1.0}
    a, b = (httpx.post(srv.url + "/completion", json=body, timeout=60).json() for _ in range(2))
    assert a["calconsole"]["seed"] == b["calconsole"]["seed"] == 1234
    assert a["calconsole"]["tokens"] == b["calconsole"]["tokens"]  # same seed, same machine: same ids
    c = httpx.post(srv.url + "/completion", json={**body, "seed": 7}, timeout=60).json()
    assert c["calconsole"]["seed"] == 7 and c["generation_settings"]["seed"] == 7
    m = httpx.get(srv.url + "/v1/models").json()["data"][0]
    assert m["id"] == "qwen3" and m["aliases"] == ["qwen3", "qwen3-30b-a3b"] and m["tags"] == ["sim", "moe"]
    chat = httpx.post(srv.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert chat.json()["model"] == "qwen3"


@pytest.mark.parametrize("kw,msg", [({"n_ctx": 0}, "--ctx-size"), ({"n_ctx": 40961}, "--ctx-size"),
                                    ({"seed": -1}, "--seed"), ({"model_alias": " , "}, "--alias"),
                                    ({"slot_save_path": ""}, "--slot-save-path"),
                                    ({"slot_save_path": __file__}, "--slot-save-path")])
def test_bad_options_are_refused(kw: dict[str, Any], msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        ServeConfig(**kw).check()


def test_slot_save_path_option_reaches_the_config() -> None:
    from calconsole.cli import build_parser

    args = build_parser().parse_args(["serve", "--slot-save-path", "/srv/slots"])
    assert args.slot_save_path == "/srv/slots"


def test_host_lists() -> None:
    assert hosts_of("127.0.0.1, ::1") == ["127.0.0.1", "::1"]
    with pytest.raises(ValueError, match="--host"):
        hosts_of(" , ")
    args = argparse.Namespace(host="127.0.0.1,0.0.0.0", api_key=None, api_key_file=None, admin_key_file=None)
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0 without an API key"):
        load_serving_keys(args)
    args.host = "127.0.0.1,::1"
    assert load_serving_keys(args) == (None, None)


# timing-only (the fixture's numerics are off): a bias has no logits to be added to
@pytest.mark.parametrize("extra,word", [({"logit_bias": [[15, -1.0]]}, "'logit_bias' is added to the model's logits, "
                                                                       "and this request would run timing-only")])
def test_what_cannot_be_honoured_is_refused_not_ignored(srv: Any, extra: dict[str, Any], word: str) -> None:
    for path, body in (("/completion", {"prompt": "hi", "n_predict": 1}),
                       (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})):
        r = httpx.post(srv.url + path, json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and word in r.json()["error"]["message"], r.text
    ok = httpx.post(srv.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                          "response_format": {"type": "text"}, "n": 2}, timeout=60)
    assert ok.status_code == 200 and [c["index"] for c in ok.json()["choices"]] == [0, 1]
