"""Streaming text for the serving layer: incremental detokenisation that never emits half a UTF-8
character, and stop-string matching that never shows part of a stop string."""

from __future__ import annotations

import codecs
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

from sim_backend.errors import InvalidRequestError
from sim_backend.model.tokenizer import get_tokenizer


class Tokenizer(Protocol):
    """What serving needs of a model family's tokenizer: ``Qwen3Tokenizer`` or another family's
    (``model.families.gguf_tokenizer``). Token ids are ints; pieces are raw bytes (maybe part of a
    UTF-8 character)."""

    eos_ids: Collection[int]

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...

    def render_chat(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                    enable_thinking: bool = False, *, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> str: ...

    def encode_chat(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool = True,
                    enable_thinking: bool = False, *, continue_final_message: bool = False,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]: ...


class StreamDecoder:
    """Incremental detokeniser: never emits half a UTF-8 character.

    ``push(id)`` returns the text that became complete (possibly ``""``),
    holding back an incomplete multi-byte sequence across any number of
    tokens (at most 3 bytes are ever held). ``flush()`` returns the rest
    (invalid leftovers -> U+FFFD). ``"".join(pushes) + flush()`` equals
    ``decode(ids)``. With ``skip_special=True`` the 26 special tokens are
    dropped from the output (padding ids always decode to nothing).
    """

    def __init__(self, tokenizer: Tokenizer | None = None, *, skip_special: bool = False) -> None:
        self._tok = tokenizer or get_tokenizer()
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Feed one token id; return newly complete text."""
        b = self._tok.token_bytes(token_id)
        if self.skip_special and self._tok.is_special(token_id):
            return ""
        return self._dec.decode(b, final=False)

    def flush(self) -> str:
        """End of stream: return held bytes (invalid/incomplete -> U+FFFD) and reset."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    @property
    def pending_bytes(self) -> int:
        """Bytes currently held back (0..3)."""
        return len(self._dec.getstate()[0])


class StopStringMatcher:
    """Stop-string holdback for streamed text.

    ``push(text)`` returns ``(safe_text, matched)``: ``safe_text`` can be sent
    to the client now; any suffix that could begin a stop string is held back.
    When a stop string completes, ``safe_text`` ends just before it,
    ``matched`` is that stop string, and everything after is discarded (later
    pushes return ``("", None)``). The earliest occurrence wins (ties: the
    first listed). ``flush()`` releases held text when generation ends for
    another reason. Emitted pieces + flush == full text truncated before the
    first stop occurrence.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if isinstance(stops, str):
            stops = [stops]
        stops = list(stops)
        for s in stops:
            if not isinstance(s, str):
                raise InvalidRequestError(f"stop strings must be strings; got {type(s).__name__}", param="stop")
            if s == "":
                raise InvalidRequestError("stop strings must not be empty", param="stop")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self._buf = ""
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text currently held back."""
        return self._buf

    def push(self, text: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", None
        if not self.stops:
            return text, None
        buf = self._buf + text
        best = -1
        best_stop = None
        for s in self.stops:
            j = buf.find(s)
            if j != -1 and (best == -1 or j < best):
                best, best_stop = j, s
        if best_stop is not None:
            self.matched = best_stop
            self._buf = ""
            return buf[:best], best_stop
        # Hold back the longest suffix that is a proper prefix of some stop.
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        cut = len(buf) - keep
        self._buf = buf[cut:]
        return buf[:cut], None

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out
