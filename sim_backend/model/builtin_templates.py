"""llama-server's built-in chat templates by name (``--chat-template NAME``), as Jinja equivalents.

llama.cpp formats these names with its own C++ code (``llm_chat_apply_template`` in its src/llama-chat.cpp),
not with Jinja. Each entry here is a Jinja template that renders the same text for chats of system, user and
assistant messages (with and without the generation prompt); ``tests/server/test_builtin_templates_llama_server.py``
checks every one against the real llama-server started with the same name. Names whose C++ formatter has
rules these templates do not reproduce (llama2's system folding, mistral-v1/v3's spacing, ...) are not
offered: ``chat_template.builtin_template`` refuses them by name, listing these.

The sources are raw strings: ``\\n`` inside a Jinja string literal is Jinja's escape for a newline. ``trim``
is Jinja's (Python ``str.strip``), llama.cpp's ``trim`` strips the same ASCII whitespace.
"""

from __future__ import annotations

from collections.abc import Mapping

#: llama.cpp's ChatML template (``CHATML_TEMPLATE_SRC`` in its common/chat.cpp; what llama-server's
#: ``--chat-template chatml`` renders and reports in ``/props``, checked against the real server)
CHATML = ("{%- for message in messages -%}\n"
          "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
          "{%- endfor -%}\n"
          "{%- if add_generation_prompt -%}\n"
          "  {{- '<|im_start|>assistant\\n' -}}\n"
          "{%- endif -%}")

def _each(body: str, gen: str | None) -> str:
    """A template writing ``body`` per message (``m`` in scope) and then ``gen`` when the generation prompt
    is asked for (None: the format has none)."""
    return "{%- for m in messages -%}" + body + "{%- endfor -%}" + (
        "" if gen is None else "{%- if add_generation_prompt -%}{{- '" + gen + "' -}}{%- endif -%}")


#: name -> Jinja source; each checked against llama-server's C++ formatter of that name
BUILTIN_TEMPLATES: Mapping[str, str] = {
    "chatml": CHATML,
    "llama3": _each(r"{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim"
                    r" + '<|eot_id|>' -}}", r"<|start_header_id|>assistant<|end_header_id|>\n\n"),
    "command-r": _each(r"{%- set tag = {'system': 'SYSTEM', 'user': 'USER', 'assistant': 'CHATBOT'}.get(m.role) -%}"
                       r"{%- if tag -%}{{- '<|START_OF_TURN_TOKEN|><|' + tag + '_TOKEN|>' + m.content | trim"
                       r" + '<|END_OF_TURN_TOKEN|>' -}}{%- endif -%}", r"<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    # a system message is held and written at the start of the next user turn
    "gemma": ("{%- set ns = namespace(sys='') -%}"
              + _each(r"{%- if m.role == 'system' -%}{%- set ns.sys = ns.sys + m.content | trim -%}{%- else -%}"
                      r"{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
                      r"{{- '<start_of_turn>' + role + '\n' -}}"
                      r"{%- if ns.sys and role != 'model' -%}{{- ns.sys + '\n\n' -}}{%- set ns.sys = '' -%}"
                      r"{%- endif -%}{{- m.content | trim + '<end_of_turn>\n' -}}{%- endif -%}",
                      r"<start_of_turn>model\n")),
    "phi3": _each(r"{{- '<|' + m.role + '|>\n' + m.content + '<|end|>\n' -}}", r"<|assistant|>\n"),
    "phi4": _each(r"{{- '<|im_start|>' + m.role + '<|im_sep|>' + m.content + '<|im_end|>' -}}",
                  r"<|im_start|>assistant<|im_sep|>"),
    "zephyr": _each(r"{{- '<|' + m.role + '|>\n' + m.content + '<|endoftext|>\n' -}}", r"<|assistant|>\n"),
    "falcon3": _each(r"{{- '<|' + m.role + '|>\n' + m.content + '\n' -}}", r"<|assistant|>\n"),
    "granite": _each(r"{{- '<|start_of_role|>' + m.role + '<|end_of_role|>' + m.content + '<|end_of_text|>\n' -}}",
                     r"<|start_of_role|>assistant<|end_of_role|>"),
    # no generation prompt: the format ends a user turn with [/INST]
    "mistral-v7": _each(r"{%- if m.role == 'system' -%}{{- '[SYSTEM_PROMPT] ' + m.content + '[/SYSTEM_PROMPT]' -}}"
                        r"{%- elif m.role == 'user' -%}{{- '[INST] ' + m.content + '[/INST]' -}}"
                        r"{%- else -%}{{- ' ' + m.content + '</s>' -}}{%- endif -%}", None),
    "vicuna": _each(r"{%- if m.role == 'system' -%}{{- m.content + '\n\n' -}}"
                    r"{%- elif m.role == 'user' -%}{{- 'USER: ' + m.content + '\n' -}}"
                    r"{%- elif m.role == 'assistant' -%}{{- 'ASSISTANT: ' + m.content + '</s>\n' -}}{%- endif -%}",
                    "ASSISTANT:"),
    "deepseek3": _each(r"{%- if m.role == 'system' -%}{{- m.content + '\n\n' -}}"
                       r"{%- elif m.role == 'user' -%}{{- '<｜User｜>' + m.content -}}"
                       r"{%- elif m.role == 'assistant' -%}"
                       r"{{- '<｜Assistant｜>' + m.content + '<｜end▁of▁sentence｜>' -}}"
                       r"{%- endif -%}", "<｜Assistant｜>"),
}
