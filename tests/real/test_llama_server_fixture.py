"""The real llama-server fixture answers as llama-server does (the counterpart the other tests compare against)."""

from __future__ import annotations

from typing import Any

import httpx


def test_real_server_is_llama_cpp(llama_server: Any) -> None:
    props = llama_server.props
    assert "build_info" in props and props["total_slots"] == 2
    assert llama_server.url.startswith("http://127.0.0.1:")
    r = httpx.get(llama_server.url + "/snapshot", timeout=5)
    assert r.status_code == 404  # not a calconsole server


def test_real_server_generates_readable_text(llama_server: Any) -> None:
    r = httpx.post(
        llama_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] >= 1
    text = body["choices"][0]["message"]["content"]
    assert text and "\ufffd" not in text
