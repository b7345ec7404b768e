"""The tokenizer and chat template of a GGUF model (the pilot): byte-level BPE built with the
``tokenizers`` library from the file's vocabulary and merges, and its Jinja chat template rendered by
``jinja2`` in a sandbox.

Same interface as :class:`sim_backend.model.tokenizer.Qwen3Tokenizer` (``encode`` / ``decode`` /
``token_bytes`` / ``encode_chat`` / ``render_chat`` / ``is_special`` ...), so the engine, the streaming
decoder and the serving face take either. Pre-tokenisation follows the GGUF's ``tokenizer.ggml.pre``
as llama.cpp does; the pilot's ``smollm`` splits digits one by one, then applies the GPT-2 pattern
(``Digits(individual_digits=True)`` then ``ByteLevel``). Text is not normalised (llama.cpp's
byte-level BPE does not normalise either). Control tokens (``token_type`` 3) are special: parsed in
text only with ``allow_special=True``; in :meth:`encode_chat` only the template's own, never a
message's content.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sim_backend.errors import InvalidRequestError, ManifestError
from sim_backend.model.chat_template import JinjaChatTemplate, check_messages, encode_chat, render_chat
from sim_backend.model.families.gguf_file import TOKEN_TYPE_CONTROL, GGUFMeta

#: Pre-tokenisers this module reproduces (``tokenizer.ggml.pre``): the GPT-2 pattern, with digits
#: split singly first for these names (llama.cpp ``LLAMA_VOCAB_PRE_TYPE_SMOLLM`` and kin).
_DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")
_KNOWN_PRE = (*_DIGITS_FIRST, "gpt-2", "default")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character standing for each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class GGUFTokenizer:
    """Byte-level BPE + chat template of one GGUF (ids are ints in ``[0, vocab_size)``).

    Args:
        meta: the GGUF's metadata (:class:`~sim_backend.model.families.gguf_file.GGUFMeta`).
    Raises:
        ManifestError: the ``tokenizers`` / ``jinja2`` package is missing, or the GGUF's tokenizer is
            not a byte-level BPE with a pre-tokeniser this module reproduces.
    Thread-safe after construction (the ``tokenizers`` objects are only read).
    """

    def __init__(self, meta: GGUFMeta) -> None:
        try:
            import jinja2  # noqa: F401 - the chat template (model.chat_template) renders with it
            from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        except ImportError as e:
            raise ManifestError(meta.path, "tokenizer", f"{e.name} is not installed: pip install "
                                                        "'calconsole[pilot]'") from None
        if meta.pre not in _KNOWN_PRE:
            raise ManifestError(meta.path, "tokenizer.ggml.pre", f"pre-tokeniser {meta.pre!r} is not reproduced "
                                                                 f"(known: {', '.join(_KNOWN_PRE)})")
        self.path = meta.path
        self.vocab_size = len(meta.tokens)
        self.n_valid = self.vocab_size
        self.bos_id = meta.bos_id
        self.eos_ids = frozenset(i for i in (meta.eos_id,) if i >= 0)
        self.chat_template = meta.chat_template
        self._specials = {t: i for i, (t, ty) in enumerate(zip(meta.tokens, meta.token_types, strict=True))
                          if ty == TOKEN_TYPE_CONTROL}
        self.special_tokens: Mapping[str, int] = dict(self._specials)
        self._special_ids = frozenset(self._specials.values())
        #: ids of ordinary text tokens, [lo, hi): what a timing-only stand-in draws from
        self.text_id_range = (max(self._special_ids, default=-1) + 1, self.vocab_size)
        dec = _byte_decoder()
        table: list[bytes] = []
        for i, t in enumerate(meta.tokens):
            if i in self._special_ids:
                table.append(t.encode("utf-8"))
            else:
                try:
                    table.append(bytes(dec[ch] for ch in t))
                except KeyError:
                    raise ManifestError(meta.path, "tokenizer.ggml.tokens",
                                        f"token {i} {t[:40]!r} is not byte-level BPE text") from None
        self._table = table
        vocab = {t: i for i, t in enumerate(meta.tokens)}
        merges = []
        for m in meta.merges:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ManifestError(meta.path, "tokenizer.ggml.merges", f"merge {m[:40]!r} is not 'a b'")
            merges.append((a, b))

        def build(parse_special: bool) -> Any:
            tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
            steps: list[Any] = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
            if meta.pre in _DIGITS_FIRST:
                steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
            tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
            tk.decoder = decoders.ByteLevel()
            tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self._specials])
            tk.encode_special_tokens = not parse_special  # special text as ordinary text
            return tk

        self._tk_special = build(True)
        self._tk_plain = build(False)
        self._bos_text = table[meta.bos_id].decode("utf-8", "replace") if 0 <= meta.bos_id < len(table) else ""
        self._eos_text = table[meta.eos_id].decode("utf-8", "replace") if 0 <= meta.eos_id < len(table) else ""
        #: the BOS / EOS tokens' text, as llama-server gives them to a chat template (``bos_token`` / ``eos_token``)
        self.bos_text, self.eos_text = self._bos_text, self._eos_text
        try:
            self._template = JinjaChatTemplate(meta.chat_template, name=f"{meta.path}: tokenizer.chat_template",
                                               bos_token=self._bos_text, eos_token=self._eos_text) \
                if meta.chat_template else None
        except ValueError as e:
            raise ManifestError(meta.path, "tokenizer.chat_template", str(e)) from None

    # --- basic -------------------------------------------------------------------

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; with ``allow_special`` control-token text (``<|im_end|>``) is parsed as
        the control token, otherwise encoded as ordinary text. No BOS is added (the GGUF's
        ``add_bos_token`` is false for the pilot; see :attr:`bos_id`)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        if not text:
            return []
        tk = self._tk_special if allow_special else self._tk_plain
        return list(tk.encode(text, add_special_tokens=False).ids)

    def count(self, text: str, *, allow_special: bool = False) -> int:
        """Number of tokens ``encode(text)`` would return."""
        return len(self.encode(text, allow_special=allow_special))

    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one token (a control token: its text as UTF-8). Out of range -> ValueError."""
        i = operator.index(token_id)
        if not 0 <= i < self.vocab_size:
            raise ValueError(f"token id {i} out of range [0, {self.vocab_size})")
        return self._table[i]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenated bytes of ``ids``."""
        return b"".join(self.token_bytes(t) for t in ids)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 -> U+FFFD; control tokens as their text)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def is_special(self, token_id: int) -> bool:
        """True for the GGUF's control tokens (``token_type`` 3; the pilot: ids 0..16)."""
        return token_id in self._special_ids

    def is_padding(self, token_id: int) -> bool:
        """Always False: every row of the pilot's LM head is a vocabulary token."""
        return False

    # --- chat template -----------------------------------------------------------

    def _check(self, messages: Any) -> list[Mapping[str, Any]]:
        msgs = check_messages(messages)
        if self._template is None:
            raise InvalidRequestError("this model's GGUF has no chat template", param="messages")
        return msgs

    def render_chat(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                    enable_thinking: bool = False, *, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat prompt as text: the GGUF's template (``model.chat_template``: HF semantics, llama-server's
        last-message rules; ``enable_thinking`` and ``template_kwargs`` are template variables).
        For ids use :meth:`encode_chat` (content then cannot inject control tokens)."""
        msgs = self._check(messages)
        assert self._template is not None
        return render_chat(self._template, msgs, add_generation_prompt, enable_thinking,
                           continue_final_message=continue_final_message, template_kwargs=template_kwargs)

    def encode_chat(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                    enable_thinking: bool = False, *, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of the chat prompt: the template's control tokens as control ids, everything between
        two of them (template text and message content together) as one ordinary-text run, so the ids
        equal llama-server's for content without control-token text, and content can never inject one
        (``model.chat_template.encode_rendered``)."""
        msgs = self._check(messages)
        assert self._template is not None
        return encode_chat(self._template, msgs, add_generation_prompt, enable_thinking, encode=self.encode,
                           specials=self._specials, continue_final_message=continue_final_message,
                           template_kwargs=template_kwargs)


_CACHE: dict[str, GGUFTokenizer] = {}
_LOCK = threading.Lock()


def gguf_tokenizer(meta: GGUFMeta) -> GGUFTokenizer:
    """The tokenizer of the GGUF ``meta`` came from (one per file per process; thread-safe)."""
    with _LOCK:
        tok = _CACHE.get(meta.path)
        if tok is None:
            tok = _CACHE[meta.path] = GGUFTokenizer(meta)
        return tok
