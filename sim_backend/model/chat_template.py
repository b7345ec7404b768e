"""Chat templates: Hugging Face Jinja templates rendered as transformers and llama-server render them, and
llama-server's rules for a conversation's last message (the assistant prefill, ``continue_final_message``).

- :class:`JinjaChatTemplate`: any Hugging Face chat template (Jinja source), compiled once with ``jinja2``
  in an ``ImmutableSandboxedEnvironment`` configured as transformers configures it (``trim_blocks``,
  ``lstrip_blocks``, the ``loopcontrols`` extension, ``{% generation %}`` blocks) with the helpers HF
  templates call: ``raise_exception(msg)``, ``strftime_now(fmt)`` and transformers' ``tojson`` filter
  (``ensure_ascii=False``; ``indent`` / ``separators`` / ``sort_keys``). Variables: ``messages``,
  ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``enable_thinking`` (always given, as
  llama-server gives it), ``date_string`` (today, local time, ``"%d %b %Y"``: llama-server defines it for
  every template, so a Llama 3.x template's ``"26 Jul 2024"`` fallback is never taken) and every
  ``chat_template_kwargs`` entry (a ``date_string`` there wins).
- :func:`continuation_of`: which messages are rendered and which text continues them, by llama-server's
  rules (checked against its real server in ``tests/server/test_templates_llama_server.py``).
- :class:`TemplatedTokenizer`: a tokenizer whose chat template is a given Jinja template
  (``calconsole serve --chat-template-file``); the pilot's GGUF tokenizer renders its own template the
  same way (:func:`encode_rendered`).

Message content never becomes a control token: the template is rendered a second time with each content
replaced by a placeholder, and only the text the template itself wrote is searched for control tokens
(see :func:`encode_rendered`; llama-server parses control-token text anywhere in the rendered prompt).
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sim_backend.errors import InvalidRequestError
from sim_backend.model.builtin_templates import BUILTIN_TEMPLATES as BUILTIN_TEMPLATES
from sim_backend.model.builtin_templates import CHATML as CHATML

#: longest template source accepted (characters); real templates are 1-20 KB (Qwen3's: 4 KB)
MAX_TEMPLATE_CHARS = 1 << 20
#: llama-server's built-in template names (``--chat-template NAME``; its ``--help`` lists them). The ones with
#: a Jinja equivalent in ``builtin_templates.BUILTIN_TEMPLATES`` are offered; the others are refused by name.
LLAMA_SERVER_BUILTIN_NAMES = (
    "bailing", "bailing-think", "bailing2", "chatglm3", "chatglm4", "chatml", "command-r", "deepseek",
    "deepseek-ocr", "deepseek2", "deepseek3", "exaone-moe", "exaone3", "exaone4", "falcon3", "gemma", "gigachat",
    "glmedge", "gpt-oss", "granite", "granite-4.0", "grok-2", "hunyuan-dense", "hunyuan-moe", "kimi-k2", "llama2",
    "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "llama3", "llama4", "megrez", "minicpm", "mistral-v1",
    "mistral-v3", "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "monarch", "openchat", "orion",
    "pangu-embedded", "phi3", "phi4", "rwkv-world", "seed_oss", "smolvlm", "solar-open", "vicuna", "vicuna-orca",
    "yandex", "zephyr")
#: placeholders for message contents while the template renders (Unicode private use: never in a template)
_OPEN, _CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile(f"{_OPEN}(\\d+){_CLOSE}")


class TemplateRaised(Exception):
    """``raise_exception(msg)`` called by a template (turned into the request's 400 by ``render``)."""


def builtin_template(name: str) -> str:
    """The Jinja source of llama-server's built-in template ``name`` (``--chat-template NAME``).

    Raises ValueError (one line) for another of llama-server's built-in names (no Jinja equivalent here)
    or a value that is neither a name nor Jinja source."""
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    if name in LLAMA_SERVER_BUILTIN_NAMES:
        raise ValueError(f"--chat-template {name}: llama-server's built-in template {name!r} is llama.cpp's own "
                         "C++ formatter with no faithful Jinja equivalent here; "
                         f"offered: {', '.join(BUILTIN_TEMPLATES)}. "
                         "Give the model's Jinja template with --chat-template-file")
    if "{{" not in name and "{%" not in name:
        raise ValueError(f"--chat-template {name[:60]!r} is neither a built-in name ({', '.join(BUILTIN_TEMPLATES)}) "
                         "nor a Jinja template")
    return name


class _Generation:
    """The ``{% generation %}...{% endgeneration %}`` tag transformers' templates may use (its
    ``AssistantTracker``): rendered as its body (assistant masks are not computed here)."""

    @staticmethod
    def extension() -> type:
        from jinja2 import nodes
        from jinja2.ext import Extension

        class GenerationTag(Extension):
            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller: Callable[[], str]) -> str:
                return caller()

        return GenerationTag


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which a prompt must not have
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: Any) -> None:
    raise TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(str(fmt))


class JinjaChatTemplate:
    """One compiled Hugging Face chat template.

    Args:
        source: the template's Jinja text (at most ``MAX_TEMPLATE_CHARS``).
        name: where it came from, for messages (a file name).
        bos_token / eos_token: the text of the model's BOS / EOS tokens (llama-server passes its vocabulary's;
            "" when the model has none).
    Raises:
        ValueError: one line naming ``name`` and the line of a syntax error, or a source that is not text,
            empty or too long; ``jinja2`` missing (``pip install jinja2``).
    Thread-safe: a compiled template holds no state between renders.
    """

    def __init__(self, source: str, *, name: str = "chat template", bos_token: str = "", eos_token: str = "") -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{name}: the chat template is empty")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ValueError(f"{name}: the chat template has {len(source)} characters; at most {MAX_TEMPLATE_CHARS}")
        try:
            import jinja2
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise ValueError(f"{name}: rendering a Jinja chat template needs jinja2: pip install jinja2") from None
        # undefined values chain (``messages[0].role`` of no messages is undefined, not an error), as
        # llama-server's Jinja engine takes them; calling one is still an error
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False,
                                            undefined=jinja2.ChainableUndefined,
                                            extensions=[loopcontrols, _Generation.extension()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"{name}: line {e.lineno}: {e.message}") from None
        except jinja2.TemplateError as e:  # an unknown filter or test, an extension's refusal
            raise ValueError(f"{name}: {type(e).__name__}: {str(e)[:200]}") from None
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               enable_thinking: bool = False, kwargs: Mapping[str, Any] | None = None) -> str:
        """The template's text for ``messages`` (each ``{"role", "content"}``, strings).

        ``kwargs``: more template variables (llama-server's ``chat_template_kwargs``: any JSON values; its
        ``date_string`` replaces today's); ``enable_thinking``, ``add_generation_prompt`` and ``date_string``
        are always given. Raises InvalidRequestError
        (llama-server's 400 ``invalid_request_error``) when the template calls ``raise_exception`` or fails
        (an undefined call, a type error, a sandbox refusal), with the template's own words."""
        from jinja2 import TemplateError

        # llama-server defines date_string (today) for every template; measured on the real server
        variables: dict[str, Any] = {"date_string": _strftime_now("%d %b %Y"), **(kwargs or {})}
        variables.update(messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                         add_generation_prompt=bool(add_generation_prompt), enable_thinking=bool(enable_thinking),
                         bos_token=self.bos_token, eos_token=self.eos_token)
        try:
            return str(self._template.render(**variables))
        except TemplateRaised as e:
            raise InvalidRequestError(f"chat template: {str(e)[:300]}", param="messages") from None
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError,
                OverflowError, RecursionError) as e:
            raise InvalidRequestError(f"chat template failed: {type(e).__name__}: {str(e)[:200]}",
                                      param="messages") from None


def continuation_of(messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> tuple[Sequence[Mapping[str, Any]], bool, str | None]:
    """(messages to render, add_generation_prompt, continuation text) by llama-server's rules.

    - One trailing assistant message is a prefill: the reply so far. Two are refused (400, llama-server's
      words). Whatever ``add_generation_prompt`` says, the others are rendered with the generation prompt
      and the prefill's text follows it, unclosed.
    - ``continue_final_message`` (true or "content" on the wire): the last message, whatever its role, is
      continued the same way; with ``add_generation_prompt`` also true: 400, llama-server's words.
    - Otherwise: all messages, ``add_generation_prompt`` as given, no continuation.

    A continued reply is rendered with thinking off (llama-server closes the thinking block before a
    continued content: Qwen3's ``<think>\\n\\n</think>\\n\\n``); the caller does that.
    Raises InvalidRequestError."""
    msgs = list(messages)
    if not continue_final_message and msgs and msgs[-1].get("role") == "assistant":
        if len(msgs) >= 2 and msgs[-2].get("role") == "assistant":
            raise InvalidRequestError("Cannot have 2 or more assistant messages at the end of the list.",
                                      param="messages")
        continue_final_message, add_generation_prompt = True, False
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError("Cannot set both add_generation_prompt and continue_final_message to true.",
                                  param="continue_final_message")
    if continue_final_message:
        if not msgs:
            raise InvalidRequestError("continue_final_message needs a message to continue", param="messages")
        return msgs[:-1], True, str(msgs[-1].get("content", ""))
    return msgs, add_generation_prompt, None


def encode_rendered(render: Callable[[Sequence[Mapping[str, Any]]], str], messages: Sequence[Mapping[str, Any]],
                    tail: str | None, encode: Callable[[str], list[int]], specials: Mapping[str, int]) -> list[int]:
    """Token ids of ``render(messages)`` followed by ``tail`` (a continued reply's text, may be None).

    The template's control tokens become control ids; everything between two of them (template text and
    message content together) is encoded as one ordinary-text run (``encode``: specials not parsed), so the
    ids equal llama-server's for content without control-token text, and content can never inject one.
    The template is rendered a second time with each content replaced by a placeholder; if the template
    changed a content (the two renderings then differ: a content it splits or trims), the real rendering
    is tokenised with control tokens parsed wherever they are, as llama-server does.
    """
    real = render(messages)
    marked = render([{"role": m["role"], "content": f"{_OPEN}{i}{_CLOSE}"} for i, m in enumerate(messages)])
    pieces: list[tuple[str, bool]] = []  # (text, written by the template)
    pos = 0
    for mt in _SENTINEL.finditer(marked):
        pieces.append((marked[pos:mt.start()], True))
        pieces.append((str(messages[int(mt.group(1))]["content"]), False))
        pos = mt.end()
    pieces.append((marked[pos:], True))
    if "".join(p for p, _ in pieces) != real:
        pieces = [(real, True)]
    if tail:
        pieces.append((tail, False))
    special_re = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))) \
        if specials else None
    ids: list[int] = []
    run: list[str] = []
    for text, tmpl in pieces:
        if not tmpl or special_re is None:
            run.append(text)
            continue
        last = 0
        for sm in special_re.finditer(text):
            run.append(text[last:sm.start()])
            ids.extend(encode("".join(run)))
            run.clear()
            ids.append(specials[sm.group(0)])
            last = sm.end()
        run.append(text[last:])
    ids.extend(encode("".join(run)))
    return ids


class TemplatedTokenizer:
    """``base`` (a model family's tokenizer) with ``template`` as its chat template: ``render_chat`` /
    ``encode_chat`` / ``chat_template`` are the template's, everything else (``encode``, ``decode``,
    ``token_bytes``, ``eos_ids`` ...) is ``base``'s. Thread-safe as ``base`` is."""

    def __init__(self, base: Any, template: JinjaChatTemplate) -> None:
        self._base = base
        self.template = template
        self.eos_ids = base.eos_ids
        self.special_tokens: Mapping[str, int] = dict(getattr(base, "special_tokens", {}))

    def __getattr__(self, name: str) -> Any:  # vocab_size, text_id_range, is_padding, decode_bytes, count ...
        return getattr(self._base, name)

    @property
    def chat_template(self) -> str:
        """The template's Jinja source (what ``/props`` reports)."""
        return self.template.source

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        return list(self._base.encode(text, allow_special=allow_special))

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._base.decode(ids))

    def token_bytes(self, token_id: int) -> bytes:
        return bytes(self._base.token_bytes(token_id))

    def is_special(self, token_id: int) -> bool:
        return bool(self._base.is_special(token_id))

    def render_chat(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                    enable_thinking: bool = False, *, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat prompt as text (see :func:`continuation_of` for the last message)."""
        return render_chat(self.template, check_messages(messages), add_generation_prompt, enable_thinking,
                           continue_final_message=continue_final_message, template_kwargs=template_kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                    enable_thinking: bool = False, *, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of the chat prompt (see :func:`encode_rendered`)."""
        return encode_chat(self.template, check_messages(messages), add_generation_prompt, enable_thinking,
                           encode=self._base.encode, specials=self.special_tokens,
                           continue_final_message=continue_final_message, template_kwargs=template_kwargs)


#: roles a chat message may have
ROLES = ("system", "user", "assistant")


def check_messages(messages: Any) -> list[Mapping[str, Any]]:
    """``messages`` as a list of ``{"role": system|user|assistant, "content": str}``; InvalidRequestError."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("'messages' must be a list of {role, content} objects", param="messages")
    if not messages:
        raise InvalidRequestError("'messages' must not be empty", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.get('role')!r}",
                                      param=f"messages[{i}].role")
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"messages[{i}].content must be a string; got {type(m.get('content')).__name__}",
                                      param=f"messages[{i}].content")
    return list(messages)


def render_chat(template: JinjaChatTemplate, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                enable_thinking: bool, *, continue_final_message: bool = False,
                template_kwargs: Mapping[str, Any] | None = None) -> str:
    """``template``'s prompt text for ``messages`` with llama-server's last-message rules."""
    msgs, agp, tail = continuation_of(messages, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message)
    think = enable_thinking and tail is None
    text = template.render(msgs, add_generation_prompt=agp, enable_thinking=think, kwargs=template_kwargs)
    return text + (tail or "")


def encode_chat(template: JinjaChatTemplate, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                enable_thinking: bool, *, encode: Callable[..., list[int]], specials: Mapping[str, int],
                continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of ``render_chat``'s prompt, content never parsed for control tokens (``encode_rendered``)."""
    msgs, agp, tail = continuation_of(messages, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final_message)
    think = enable_thinking and tail is None

    def render(ms: Sequence[Mapping[str, Any]]) -> str:
        return template.render(ms, add_generation_prompt=agp, enable_thinking=think, kwargs=template_kwargs)

    return encode_rendered(render, msgs, tail, lambda s: list(encode(s)) if s else [], specials)
