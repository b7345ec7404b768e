"""Chat templates on the serving face: ``--chat-template-file`` / ``--chat-template`` / ``--jinja`` /
``--chat-template-kwargs``, the request's ``chat_template_kwargs``, ``add_generation_prompt``,
``continue_final_message`` and ``reasoning_effort``, and their refusals (llama-server's words where it has
them; the same cases against the real server are in ``test_templates_llama_server.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from calconsole.cli import main

CHAT = "/v1/chat/completions"
U = [{"role": "user", "content": "Say hi."}]
GEN = "<|im_start|>assistant\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"
#: a template that shows the variables it is given, and refuses two user turns in a row
ECHO = ("[{{ foo }}|{{ enable_thinking }}|{{ bos_token }}|{{ eos_token }}|{{ reasoning_effort }}]"
        "{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def post(url: str, path: str, body: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def prompt(url: str, body: dict[str, Any]) -> str:
    r = post(url, "/apply-template", body)
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


@pytest.fixture(scope="module")
def qwen(make_module_server: Any) -> str:
    """The production bundle with its built-in Qwen3 template."""
    return make_module_server().url


@pytest.fixture(scope="module")
def echo(make_module_server: Any) -> str:
    return make_module_server(system_kw={"chat_template": ECHO}).url


def test_qwen3_thinks_by_default_and_enable_thinking_false_closes_it(qwen: str) -> None:
    # llama-server's default: thinking on when the template has a thinking mode (Qwen3's has)
    on = prompt(qwen, {"messages": U})
    assert on == "<|im_start|>user\nSay hi.<|im_end|>\n" + GEN
    assert prompt(qwen, {"messages": U, "chat_template_kwargs": {"enable_thinking": True}}) == on
    assert prompt(qwen, {"messages": U, "chat_template_kwargs": {"enable_thinking": False}}) == on + EMPTY_THINK
    assert prompt(qwen, {"messages": U, "reasoning_effort": "none"}) == on + EMPTY_THINK
    # what the context counts is the same prompt, tokenised
    for kw in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        n = post(qwen, "/chat/completions/input_tokens", {"messages": U, **kw}).json()["input_tokens"]
        text = prompt(qwen, {"messages": U, **kw})
        assert n == len(post(qwen, "/tokenize", {"content": text}).json()["tokens"])
    r = post(qwen, CHAT, {"messages": U, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.json()["usage"]["prompt_tokens"] == len(post(qwen, "/tokenize", {"content": on + EMPTY_THINK})
                                                     .json()["tokens"])


def test_prefill_and_continue_final_message(qwen: str) -> None:
    pre = U + [{"role": "assistant", "content": "Hi"}]
    want = "<|im_start|>user\nSay hi.<|im_end|>\n" + GEN + EMPTY_THINK + "Hi"
    for extra in ({}, {"add_generation_prompt": False}, {"chat_template_kwargs": {"enable_thinking": True}},
                  {"continue_final_message": True, "add_generation_prompt": False},
                  {"continue_final_message": "content", "add_generation_prompt": False}):
        assert prompt(qwen, {"messages": pre, **extra}) == want, extra
    # continue_final_message continues any last message
    assert prompt(qwen, {"messages": U, "continue_final_message": True, "add_generation_prompt": False}) == \
        GEN + EMPTY_THINK + "Say hi."
    assert prompt(qwen, {"messages": U, "add_generation_prompt": False}) == "<|im_start|>user\nSay hi.<|im_end|>\n"
    d = post(qwen, CHAT, {"messages": pre, "max_tokens": 2}).json()
    assert d["choices"][0]["message"]["content"].startswith("Hi")


@pytest.mark.parametrize("body,message", [
    ({"messages": U + [{"role": "assistant", "content": "Hi"}], "continue_final_message": True},
     "Cannot set both add_generation_prompt and continue_final_message to true."),
    ({"messages": U + [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "Cannot have 2 or more assistant messages at the end of the list."),
    ({"messages": U, "continue_final_message": "yes", "add_generation_prompt": False},
     'Invalid continue_final_message: expected a boolean, "content" or "reasoning_content"'),
    ({"messages": U, "chat_template_kwargs": {"enable_thinking": "false"}},
     'invalid type for "enable_thinking" (expected boolean, got string)'),
    ({"messages": U, "continue_final_message": "reasoning_content", "add_generation_prompt": False},
     "no reasoning content"),
    ({"messages": U, "chat_template_kwargs": [1]}, "'chat_template_kwargs' must be an object"),
    ({"messages": U, "add_generation_prompt": "no"}, "'add_generation_prompt' must be true or false"),
])
def test_refusals(qwen: str, body: dict[str, Any], message: str) -> None:
    for path in ("/apply-template", "/chat/completions/input_tokens", CHAT):
        r = post(qwen, path, {**body, "max_tokens": 1})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error" and message in err["message"], \
            (path, r.text)


def test_a_template_file_replaces_the_models(echo: str) -> None:
    assert httpx.get(echo + "/props", timeout=30).json()["chat_template"] == ECHO
    # not a thinking template: thinking off by default; kwargs and reasoning_effort are template variables
    assert prompt(echo, {"messages": U}) == "[|False||<|im_end|>|]<|im_start|>user\nSay hi.<|im_end|>\n" + GEN
    got = prompt(echo, {"messages": U, "chat_template_kwargs": {"foo": "bar", "enable_thinking": True},
                        "reasoning_effort": "high"})
    assert got.startswith("[bar|True||<|im_end|>|high]")
    r = post(echo, CHAT, {"messages": U, "max_tokens": 3, "chat_template_kwargs": {"foo": 7}})
    n = len(post(echo, "/tokenize", {"content": prompt(echo, {"messages": U, "chat_template_kwargs": {"foo": 7}})})
            .json()["tokens"])
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == n


def test_a_template_that_raises_is_llama_servers_400(echo: str) -> None:
    two = U + [{"role": "user", "content": "again"}]
    for path, extra in (("/apply-template", {}), ("/chat/completions/input_tokens", {}), (CHAT, {"max_tokens": 1}),
                        (CHAT, {"max_tokens": 1, "stream": True})):
        r = post(echo, path, {"messages": two, **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error", (path, r.text)
        assert "Conversation roles must alternate" in err["message"]


def test_server_default_kwargs(make_server: Any) -> None:
    url = make_server(chat_template_kwargs={"enable_thinking": False}).url
    assert prompt(url, {"messages": U}).endswith(GEN + EMPTY_THINK)
    assert prompt(url, {"messages": U, "chat_template_kwargs": {"enable_thinking": True}}).endswith(GEN)


@pytest.mark.parametrize("argv,message", [
    (["--chat-template-file", "{bad}"], "line 1"),
    (["--chat-template-file", "{missing}"], "No such file"),
    (["--chat-template-file", "{json}"], "no 'chat_template' string"),
    (["--chat-template", "llama2"], "offered: chatml, llama3, command-r"),
    (["--chat-template", "chatml", "--chat-template-file", "{bad}"], "not both"),
    (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
    (["--chat-template-kwargs", '{"enable_thinking": "no"}'], "enable_thinking must be true or false"),
])
def test_bad_template_options_are_one_line_errors(tmp_path: Path, capsys: Any, argv: list[str], message: str) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    (tmp_path / "t.json").write_text('{"eos_token": "x"}')
    paths = {"{bad}": str(bad), "{missing}": str(tmp_path / "nope.jinja"), "{json}": str(tmp_path / "t.json")}
    rc = main(["serve", "--port", "0", "--timing-only", "--jinja", "--audit-log", str(tmp_path / "a.jsonl"),
               *[paths.get(a, a) for a in argv]])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("argv", [["--reasoning", "maybe"], ["-rea", "ON"], ["--reasoning", "yes", "--boards", "2"]])
def test_a_bad_reasoning_value_is_a_one_line_error(tmp_path: Path, capsys: Any, argv: list[str]) -> None:
    rc = main(["serve", "--port", "0", "--timing-only", "--audit-log", str(tmp_path / "a.jsonl"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "--reasoning must be on, off or auto" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_reasoning_sets_the_default_thinking_and_the_boards_get_it() -> None:
    from calconsole.cli import build_parser
    from calconsole.commands.common import finalize
    from calconsole.commands.serve import server_template_kwargs
    from calconsole.fleet.launcher import board_command

    def kwargs(*argv: str) -> Any:
        return server_template_kwargs(build_parser().parse_args(["serve", *argv]))

    for on in ("on", "enabled", "true", "1"):
        assert kwargs("--reasoning", on) == {"enable_thinking": True}
    for off in ("off", "disabled", "false", "0"):
        assert kwargs("-rea", off) == {"enable_thinking": False}
    assert kwargs("--reasoning", "auto") is None and kwargs("--reasoning", "-1") is None and kwargs() is None
    assert kwargs("--chat-template-kwargs", '{"enable_thinking": true, "x": 1}', "--reasoning", "off") == {
        "enable_thinking": False, "x": 1}
    args = finalize(build_parser().parse_args(["serve", "--boards", "2", "--reasoning", "off"]))
    cmd = board_command(args, 0, Path("b.jsonl"))
    assert cmd[cmd.index("--reasoning") + 1] == "off"
