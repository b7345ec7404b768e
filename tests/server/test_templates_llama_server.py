"""Differential: chat templates on a real llama-server and on ``calconsole serve``, prompt for prompt.

The real server (``tests/real/llama_server.py``, SmolLM2's GGUF) is started with Qwen3's own template
(``sim_backend/model/templates/qwen3.jinja``, llama-server's ``--chat-template``); ours serves the production
bundle twice: with its built-in Qwen3 template and with the same file (``--chat-template-file``). For each
body ``/apply-template`` must give the same text on all three: the default thinking mode, ``enable_thinking``
true and false, ``reasoning_effort: "none"``, prefills, ``continue_final_message``, ``add_generation_prompt``,
history with reasoning; the refusals the same status, type and words. A second real server with a template
that calls ``raise_exception`` checks that refusal and the template variables. ``--reasoning on|off|auto``
(serve's flag, and on the real server the fields llama-server's flag sets) must render as on llama-server.

Deliberately not compared: llama-server ignores a ``chat_template_kwargs`` or ``add_generation_prompt`` of
the wrong type, calconsole refuses it (400 naming the field).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

QWEN3 = (Path(__file__).parents[2] / "sim_backend" / "model" / "templates" / "qwen3.jinja").read_text()
U = [{"role": "user", "content": "Say hi."}]
PRE = U + [{"role": "assistant", "content": "Hi"}]
HISTORY = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
           {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"}, {"role": "user", "content": "again"}]
OFF, ON = {"chat_template_kwargs": {"enable_thinking": False}}, {"chat_template_kwargs": {"enable_thinking": True}}
NO_GEN = {"add_generation_prompt": False}
SAME = [
    {"messages": U}, {"messages": U, **OFF}, {"messages": U, "reasoning_effort": "none"},
    {"messages": U, **NO_GEN}, {"messages": PRE}, {"messages": PRE, **ON},
    {"messages": PRE, "continue_final_message": "content", **NO_GEN},
    {"messages": U, "continue_final_message": True, **NO_GEN}, {"messages": HISTORY, **OFF},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>r</think>a"},
                  {"role": "user", "content": "<tool_response>x</tool_response>"}], **OFF},
]
REFUSED = [
    {"messages": PRE, "continue_final_message": True},
    {"messages": PRE + [{"role": "assistant", "content": "b"}]},
    {"messages": U, "continue_final_message": "yes", **NO_GEN},
    {"messages": U, "chat_template_kwargs": {"enable_thinking": "false"}},
]
#: shows the variables llama-server gives a template; refuses two user turns in a row
ECHO = ("[{{ foo }}|{{ enable_thinking }}|{{ reasoning_effort }}]"
        "{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _real(template: str) -> Iterator[Any]:
    from tests.real.llama_server import start_llama_server

    server = start_llama_server(n_parallel=1, n_ctx=2048, configure=lambda p: setattr(p, "chat_template", template))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def real_qwen3() -> Iterator[Any]:
    yield from _real(QWEN3)


@pytest.fixture(scope="module")
def ours(make_module_server: Any) -> tuple[str, str]:
    """(built-in Qwen3 template, the qwen3.jinja file) servers."""
    return make_module_server().url, make_module_server(system_kw={"chat_template": QWEN3}).url


def _post(url: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_props_report_the_template(real_qwen3: Any, ours: tuple[str, str]) -> None:
    assert httpx.get(ours[1] + "/props", timeout=30).json()["chat_template"] == real_qwen3.props["chat_template"] \
        == QWEN3


@pytest.mark.parametrize("body", SAME, ids=range(len(SAME)))
def test_the_same_prompt(real_qwen3: Any, ours: tuple[str, str], body: dict[str, Any]) -> None:
    theirs = _post(real_qwen3.url, "/apply-template", body)
    assert theirs.status_code == 200, theirs.text
    for url in ours:
        r = _post(url, "/apply-template", body)
        assert r.status_code == 200 and r.json()["prompt"] == theirs.json()["prompt"], (url, r.text, theirs.text)


@pytest.mark.parametrize("body", REFUSED, ids=range(len(REFUSED)))
def test_the_same_refusal(real_qwen3: Any, ours: tuple[str, str], body: dict[str, Any]) -> None:
    for path in ("/apply-template",) + (("/v1/chat/completions",) if body is REFUSED[0] else ()):
        theirs = _post(real_qwen3.url, path, {**body, "max_tokens": 1}).json()["error"]
        for url in ours:
            r = _post(url, path, {**body, "max_tokens": 1})
            err = r.json()["error"]
            assert r.status_code == theirs["code"] and (err["type"], err["message"]) == (theirs["type"],
                                                                                       theirs["message"]), (path, err)


def test_template_variables_and_a_template_that_raises(make_module_server: Any) -> None:
    ours = make_module_server(system_kw={"chat_template": ECHO}).url
    for real in _real(ECHO):
        for body in ({"messages": U}, {"messages": U, "chat_template_kwargs": {"foo": "bar", "enable_thinking": True}},
                     {"messages": U, "chat_template_kwargs": {"foo": 3}, "reasoning_effort": "high"}):
            a, b = (_post(u, "/apply-template", body).json()["prompt"] for u in (ours, real.url))
            assert a == b, body
        two = U + [{"role": "user", "content": "again"}]
        for path in ("/apply-template", "/chat/completions/input_tokens", "/v1/chat/completions"):
            a_r, b_r = (_post(u, path, {"messages": two, "max_tokens": 1}) for u in (ours, real.url))
            ea, eb = a_r.json()["error"], b_r.json()["error"]
            assert a_r.status_code == b_r.status_code == 400 and ea["type"] == eb["type"] == "invalid_request_error"
            assert "Conversation roles must alternate" in ea["message"] and "Conversation roles must alternate" in \
                eb["message"]


#: what llama-server's ``--reasoning VALUE`` sets (its handler in llama.cpp's common/arg.cpp): enable_reasoning
#: and, for on / off, the default template kwarg enable_thinking (a JSON text, as the option stores it)
REASONING = {"on": (1, "true"), "off": (0, "false"), "auto": (-1, None)}


@pytest.mark.parametrize("mode", sorted(REASONING))
def test_reasoning_mode_renders_as_llama_server(make_module_server: Any, mode: str) -> None:
    from calconsole.cli import build_parser
    from calconsole.commands.serve import server_template_kwargs
    from tests.real.llama_server import start_llama_server

    enable, kwarg = REASONING[mode]

    def configure(p: Any) -> None:
        p.chat_template = QWEN3
        p.enable_reasoning = enable
        if kwarg is not None:
            p.default_template_kwargs = {"enable_thinking": kwarg}

    kwargs = server_template_kwargs(build_parser().parse_args(["serve", "--reasoning", mode]))
    ours = [make_module_server(chat_template_kwargs=kwargs).url,
            make_module_server(system_kw={"chat_template": QWEN3}, chat_template_kwargs=kwargs).url]
    real = start_llama_server(n_parallel=1, n_ctx=2048, configure=configure)
    try:
        for body in ({"messages": U}, {"messages": U, **OFF}, {"messages": U, **ON}, {"messages": HISTORY},
                     {"messages": U, "reasoning_effort": "none"}):
            theirs = _post(real.url, "/apply-template", body).json()["prompt"]
            if mode == "off" and body == {"messages": U}:
                assert theirs.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
            for url in ours:
                assert _post(url, "/apply-template", body).json()["prompt"] == theirs, (mode, body, url)
    finally:
        real.stop()
