"""Constrained decoding: a request's grammar (llama.cpp GBNF or a JSON schema) as a mask over the next token.

The grammar engine is llguidance (PyPI ``llguidance``, the Rust library llama.cpp itself can use; the
llama-server of the tests compiles ``json_schema`` with it): it parses the grammar, converts GBNF, and
computes which token ids may come next. Nothing here parses a grammar.

- :func:`lltokenizer`: llguidance's view of the model's tokenizer (every row's bytes, which ids are
  special, the EOS ids). Built once per (tokenizer, vocabulary) for the process: ~2-4 s of host CPU for
  Qwen3's 151,936 rows (measured on the 2-core development machine), the work llama.cpp does at model
  load, so the engine builds it before a request's timed host span.
- :func:`compile_grammar`: a :class:`GrammarMatcher` for a ``Grammar``, or ``InvalidRequestError`` (HTTP
  400 ``invalid_request_error``) with llama-server's words (``Failed to initialize samplers: failed to
  parse grammar``) and llguidance's reason.
- :meth:`GrammarMatcher.allowed`: the ``bool`` (vocab,) mask of the next token (the numerics path gives it
  to the sampler, which sets the other logits to ``-inf``); :meth:`GrammarMatcher.consume` advances it by
  the sampled token; :meth:`GrammarMatcher.stand_in` is the timing-only draw (no logits).

JSON schemas compile without free whitespace (llguidance's ``whitespace_flexible`` false, ``,`` and ``:``
separators; a schema's ``x-guidance`` may say otherwise): the output is compact JSON, and a model that
puts its mass on whitespace (synthetic weights do) cannot fill ``max_tokens`` with it.
Once the grammar is complete, only the EOS ids are allowed, so generation stops with ``stop_type`` eos.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Collection
from typing import Any

import llguidance
import numpy as np

from sim_backend.errors import InvalidRequestError
from sim_backend.planes.types import Grammar
from sim_backend.serving.streaming import Tokenizer

__all__ = ["CLOSE_AFTER", "CLOSERS", "GrammarMatcher", "compile_grammar", "lltokenizer", "schema_grammar_text"]

#: timing-only stand-in: after this many generated tokens (or half of max_tokens, if less) it always
#: prefers to end the structure it is in (see :meth:`GrammarMatcher.stand_in`)
CLOSE_AFTER = 16
#: bytes a "closing" token is made of (ends a JSON string, object or array, or a GBNF group)
CLOSERS = frozenset(b'"}])')
#: the JSON compiler's defaults (a schema's ``x-guidance`` overrides them): compact JSON, module docstring
JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
#: llama-server's message for a grammar its sampler cannot build (its words, then llguidance's reason)
PARSE_ERROR = "Failed to initialize samplers: failed to parse grammar"


class _Vocab:
    """What llguidance's ``TokenizerWrapper`` reads of a tokenizer: each row's bytes (``b""`` for padding
    rows), the special ids, an EOS id, and ``__call__(text) -> ids`` (its canonical tokenisation)."""

    def __init__(self, tok: Tokenizer, vocab: int, eos_ids: Collection[int]) -> None:
        self._tok = tok
        self.eos_token_id = min(eos_ids)
        self.bos_token_id = None
        rows: list[bytes] = []
        special: list[int] = []
        for i in range(vocab):
            try:
                b = tok.token_bytes(i)
            except (ValueError, IndexError, KeyError):  # a row past the tokenizer's ids: padding
                b = b""
            rows.append(b)
            if b and tok.is_special(i):
                special.append(i)
        self.tokens = rows
        self.special_token_ids = special

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text)


class _Built:
    """One tokenizer's llguidance view and the tables the stand-in reads (``bool`` (vocab,) each)."""

    def __init__(self, tok: Tokenizer, vocab: int, eos_ids: Collection[int]) -> None:
        v = _Vocab(tok, vocab, eos_ids)
        self.lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(v), n_vocab=vocab, eos_token=sorted(eos_ids))
        self.vocab = vocab
        self.eos = np.zeros(vocab, dtype=np.bool_)
        self.eos[sorted(eos_ids)] = True
        special = set(v.special_token_ids)
        self.closer = np.array([bool(b) and i not in special and set(b) <= CLOSERS
                                for i, b in enumerate(v.tokens)], dtype=np.bool_)


_built: dict[tuple[int, int, tuple[int, ...]], tuple[Tokenizer, _Built]] = {}
_built_lock = threading.Lock()


def lltokenizer(tok: Tokenizer, vocab: int, eos_ids: Collection[int]) -> _Built:
    """llguidance's tokenizer for ``tok`` over ``vocab`` logits rows with ``eos_ids``, built once per
    process (module docstring: seconds of host CPU; later calls return the same object). Thread-safe."""
    key = (id(tok), int(vocab), tuple(sorted(eos_ids)))
    with _built_lock:
        hit = _built.get(key)
        if hit is None or hit[0] is not tok:
            hit = (tok, _Built(tok, int(vocab), eos_ids))
            _built[key] = hit
        return hit[1]


def schema_grammar_text(schema: str) -> str:
    """The grammar llama-server reports for a ``json_schema`` request (``generation_settings.grammar``):
    llguidance's Lark form ``%llguidance {}\\nstart: %json <schema>``."""
    return "%llguidance {}\nstart: %json " + json.dumps(json.loads(schema), separators=(",", ":"),
                                                          ensure_ascii=False)


def _grammar_source(spec: Grammar) -> str:
    """llguidance's grammar text for ``spec``; InvalidRequestError for one that does not convert."""
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.text)
        except ValueError as e:
            raise InvalidRequestError(f"{PARSE_ERROR}: the JSON schema is not JSON: {e}", param="json_schema") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequestError(f"{PARSE_ERROR}: a JSON schema is an object or a boolean, got "
                                      f"{type(schema).__name__}", param="json_schema")
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS))  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"{PARSE_ERROR}: {e}", param="json_schema") from None
    text = spec.text
    try:
        if text.lstrip().startswith("%llguidance"):
            return str(llguidance.LLMatcher.grammar_from_lark(text))
        return str(llguidance.grammar_from("gbnf", text))
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"{PARSE_ERROR}: {e}", param="grammar") from None


def compile_grammar(spec: Grammar, tok: Tokenizer, vocab: int, eos_ids: Collection[int]) -> GrammarMatcher:
    """A fresh matcher of ``spec`` over ``tok``'s ``vocab`` rows (one per request; not thread-safe).

    Raises InvalidRequestError (400; message starts with ``PARSE_ERROR``) for a grammar or schema that
    llguidance refuses (syntax, an undefined rule, an unknown schema type, a resource limit)."""
    built = lltokenizer(tok, vocab, eos_ids)
    src = _grammar_source(spec)
    err = llguidance.LLMatcher.validate_grammar(src, built.lltok)
    if err:
        raise InvalidRequestError(f"{PARSE_ERROR}: {err}", param="json_schema" if spec.kind == "json_schema"
                                  else "grammar")
    m = llguidance.LLMatcher(built.lltok, src, log_level=0)
    if m.is_error():
        raise InvalidRequestError(f"{PARSE_ERROR}: {m.get_error()}", param="grammar")
    return GrammarMatcher(m, built)


class GrammarMatcher:
    """One request's grammar state: the mask of the next token, advanced token by token.

    ``allowed()`` computes the mask (llguidance, ~0.1-0.3 ms host for a JSON schema over 151,936 rows;
    ``calconsole bench grammar`` measures it); ``consume(tok)`` feeds the sampled token. After the
    grammar is complete (or a token it refused, which the mask prevents) only the EOS ids are allowed.
    """

    def __init__(self, matcher: Any, built: _Built) -> None:
        self._m = matcher
        self._b = built
        n = built.vocab
        self._words = np.zeros((n + 31) // 32, dtype=np.int32)
        self._mask: np.ndarray = built.eos.copy()

    @property
    def accepting(self) -> bool:
        """The text so far is a complete sentence of the grammar."""
        return bool(self._m.is_accepting())

    def allowed(self) -> np.ndarray:
        """``bool`` (vocab,): True for the ids the grammar allows next (the EOS ids once it may end).
        The array is this matcher's own (valid until the next call)."""
        if self._m.is_error():
            self._mask = self._b.eos.copy()
            return self._mask
        self._m.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little", count=self._b.vocab)
        self._mask = bits.view(np.bool_)
        return self._mask

    def consume(self, tok: int) -> bool:
        """Advance by the sampled ``tok``; False if the grammar refused it (then only EOS is allowed)."""
        return bool(self._m.consume_token(int(tok)))

    def stand_in(self, rng: np.random.Generator, n_generated: int, max_tokens: int,
                 allowed: np.ndarray | None = None) -> int:
        """The timing-only draw (no logits): a token the grammar allows, from ``rng`` (the request's seeded
        generator, so a run replays).

        Uniform over the allowed ids, except that with probability ``min(1, n_generated / s)``
        (``s = min(CLOSE_AFTER, max_tokens // 2)``, at least 1) it prefers ending: an EOS id if allowed,
        else a uniform pick among the allowed tokens made only of ``CLOSERS`` bytes, if any. So a stand-in
        reply is a few dozen tokens and completes its structure instead of running into ``max_tokens``.
        ``allowed``: the mask to draw from (default: the one :meth:`allowed` computed last; call it first)."""
        mask = self._mask if allowed is None else allowed
        ids = np.flatnonzero(mask)
        if ids.size == 0:
            return int(np.flatnonzero(self._b.eos)[0])
        s = max(1, min(CLOSE_AFTER, max_tokens // 2))
        if rng.random() < min(1.0, n_generated / s):
            eos = ids[self._b.eos[ids]]
            if eos.size:
                return int(eos[0])
            close = ids[self._b.closer[ids]]
            if close.size:
                return int(close[rng.integers(close.size)])
        return int(ids[rng.integers(ids.size)])

    def stand_in_distribution(self, n_generated: int, max_tokens: int,
                              allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The distribution :meth:`stand_in` draws from with the same arguments: ``(ids, p)``, the ids it
        can return (ascending, ``int64``) and each one's probability (``float64``, summing to 1)."""
        mask = self._mask if allowed is None else allowed
        ids = np.flatnonzero(mask)
        if ids.size == 0:
            return np.flatnonzero(self._b.eos)[:1], np.ones(1)
        s = max(1, min(CLOSE_AFTER, max_tokens // 2))
        p_end = min(1.0, n_generated / s)
        p = np.full(ids.size, (1.0 - p_end) / ids.size)
        eos = np.flatnonzero(self._b.eos[ids])
        close = np.flatnonzero(self._b.closer[ids])
        if eos.size:
            p[eos[0]] += p_end
        elif close.size:
            p[close] += p_end / close.size
        else:
            p += p_end / ids.size  # the ending draw found nothing to prefer: the uniform pick
        keep = p > 0
        return ids[keep], p[keep]
