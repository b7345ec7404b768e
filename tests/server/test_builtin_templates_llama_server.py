"""Differential: llama-server's built-in templates by name, and a Llama 3.x template's date, on a real
llama-server and on ``calconsole serve``, prompt for prompt.

Each name ``builtin_templates.BUILTIN_TEMPLATES`` offers is given to the real server as its ``--chat-template
NAME`` (without ``--jinja``: llama.cpp's C++ formatter of that name) and to ours as its Jinja equivalent;
``/apply-template`` must give the same text for the same chats. A Llama 3.1-style template (``date_string``
fallback "26 Jul 2024") and a 3.2-style one (``strftime_now``) must both render today's date, as llama-server
renders it, and a request's ``chat_template_kwargs.date_string`` wins on both.

Deliberately not compared: a chat ending in an assistant message. llama-server's C++ formatters (no
``--jinja``) close it as a finished turn; calconsole applies llama-server's ``--jinja`` rule to every template
(the reply is continued, unclosed).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sim_backend.model.builtin_templates import BUILTIN_TEMPLATES
from sim_backend.model.chat_template import builtin_template

CHATS = [
    {"messages": [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": " hi \n"},
                  {"role": "assistant", "content": " hello "}, {"role": "user", "content": "again"}]},
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                  {"role": "user", "content": "b"}], "add_generation_prompt": False},
]
LLAMA31 = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
LLAMA32 = LLAMA31.replace('    {%- set date_string = "26 Jul 2024" %}\n',
                          '    {%- if strftime_now is defined %}\n'
                          '        {%- set date_string = strftime_now("%d %b %Y") %}\n'
                          '    {%- else %}\n        {%- set date_string = "26 Jul 2024" %}\n    {%- endif %}\n')


def _real(template: str, *, jinja: bool) -> Iterator[Any]:
    from tests.real.llama_server import start_llama_server

    def configure(p: Any) -> None:
        p.chat_template = template
        p.use_jinja = jinja

    server = start_llama_server(n_parallel=1, n_ctx=1024, configure=configure)
    try:
        yield server
    finally:
        server.stop()


def _prompt(url: str, body: dict[str, Any]) -> str:
    r = httpx.post(url + "/apply-template", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_a_builtin_name_renders_as_llama_server(make_module_server: Any, name: str) -> None:
    ours = make_module_server(system_kw={"chat_template": builtin_template(name)}).url
    for real in _real(name, jinja=False):
        for body in CHATS:
            assert _prompt(ours, body) == _prompt(real.url, body), (name, body)


@pytest.mark.parametrize("template", [LLAMA31, LLAMA32], ids=["llama3.1", "llama3.2"])
def test_a_llama3_template_gets_todays_date(make_module_server: Any, template: str) -> None:
    ours = make_module_server(system_kw={"chat_template": template}).url
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    given = {**body, "chat_template_kwargs": {"date_string": "01 Jan 2000"}}
    for real in _real(template, jinja=True):
        theirs = _prompt(real.url, body).removeprefix("<|im_start|>")  # SmolLM2's BOS; Qwen3 has none
        assert "26 Jul 2024" not in theirs and _prompt(ours, body) == theirs
        assert "Today Date: 01 Jan 2000" in _prompt(ours, given)
        assert _prompt(ours, given) == _prompt(real.url, given).removeprefix("<|im_start|>")
