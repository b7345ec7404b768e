"""Context shift, ours against a real llama-server: a 256-token slot, a raw 4-token prompt, 300 tokens asked for.

Without ``--context-shift`` (llama-server's default) both stop with ``limit`` at the context end (4 + 252 = 256),
``truncated``, finish_reason ``length``. With it both go on to the 300 tokens, and what the slot holds at the end
(``tokens_cached``, /slots ``n_prompt_tokens``) tells how many tokens the shift discarded: n_keep 0 drops 127
(half of 255), n_keep -1 (the prompt) 125, n_keep 3 126. Token ids differ (another model); the counts do not.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.real.llama_server import start_llama_server
from tests.server.conftest import ServerFactory

N_CTX = 256
PROMPT = [11, 12, 13, 14]  # raw ids: both servers see exactly 4 prompt tokens
FIELDS = ("stop_type", "truncated", "tokens_predicted", "tokens_evaluated", "tokens_cached")


def _body(n_keep: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": PROMPT, "n_predict": 300, "ignore_eos": True, "temperature": 0}
    if n_keep is not None:
        body["n_keep"] = n_keep
    return body


@pytest.fixture(scope="module", params=[False, True], ids=["no-context-shift", "context-shift"])
def servers(request: pytest.FixtureRequest, make_module_system: Any) -> Iterator[tuple[bool, str, str]]:
    """(shift on?, our url, the real llama-server's url), both with one slot of ``N_CTX`` tokens."""
    shift = bool(request.param)
    real = start_llama_server(n_parallel=1, n_ctx=N_CTX, configure=lambda p: setattr(p, "ctx_shift", shift))
    factory = ServerFactory(make_module_system)
    try:
        if shift:  # as `serve --context-shift -c 256`: the engine runs at the slot context and shifts there
            ours = factory(system_kw={"n_slots": 1, "n_ctx": N_CTX, "context_shift": True})
        else:  # as `serve -c 256`: the face enforces the slot context
            ours = factory(system_kw={"n_slots": 1}, n_ctx=N_CTX)
        yield shift, ours.url, real.url
    finally:
        factory.stop_all()
        real.stop()


def _completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    return {**{k: out[k] for k in FIELDS}, "n_keep": out["generation_settings"]["n_keep"]}


@pytest.mark.parametrize("n_keep", [0, -1, 3])
def test_completion_counts_match(servers: tuple[bool, str, str], n_keep: int) -> None:
    shift, ours, theirs = servers
    got, want = _completion(ours, _body(n_keep)), _completion(theirs, _body(n_keep))
    assert got == want
    if shift:
        discarded = {0: 127, -1: 125, 3: 126}[n_keep]
        assert want == {"stop_type": "limit", "truncated": True, "tokens_predicted": 300, "tokens_evaluated": 4,
                        "tokens_cached": 4 + 300 - 1 - discarded, "n_keep": n_keep}
    else:
        assert want == {"stop_type": "limit", "truncated": True, "tokens_predicted": 252, "tokens_evaluated": 4,
                        "tokens_cached": 255, "n_keep": n_keep}
    # the idle slot holds what the result said it holds
    for url in (ours, theirs):
        slot = httpx.get(url + "/slots", timeout=30).json()[0]
        assert slot["n_ctx"] == N_CTX and slot["n_prompt_tokens"] == want["tokens_cached"]


def test_a_reply_that_ends_before_the_context_is_not_truncated(servers: tuple[bool, str, str]) -> None:
    _, ours, theirs = servers
    body = {**_body(None), "n_predict": 20}
    got, want = _completion(ours, body), _completion(theirs, body)
    assert got == want and want["truncated"] is False and want["tokens_predicted"] == 20


def test_chat_finish_reason_and_usage(servers: tuple[bool, str, str]) -> None:
    shift, ours, theirs = servers
    body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    seen = []
    for url in (ours, theirs):
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        j = r.json()
        seen.append((j["choices"][0]["finish_reason"], j["usage"]["completion_tokens"], j["usage"]["prompt_tokens"]))
    assert seen[0] == seen[1] == ("length", 300 if shift else 252, 4)
