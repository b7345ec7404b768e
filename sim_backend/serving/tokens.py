"""One request's token pipeline: sample a token, apply the stop rules, release visible text that
is never half a UTF-8 character and never part of a stop string.

Stop rules (llama.cpp ``stop_type``), checked in this order for each sampled token:
``eos`` (an EOS id was sampled; it counts in ``predicted_n`` but prints nothing), ``word`` (a stop
string appeared in the text made visible by this token; it and everything after it are dropped),
``limit`` (``max_tokens`` reached, or the context end: prompt + generated tokens reached ``n_ctx``,
so ``usage.total_tokens`` never exceeds ``n_ctx``), and ``none`` for a request that is cancelled or
fails (set by the engine, not here). When generation stops for ``eos`` or ``limit``, held text is
released: an incomplete UTF-8 tail becomes U+FFFD, and if the released text completes a stop
string the stop becomes ``word``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from sim_backend.model.logits import dtype_of, neg_inf, to_f32
from sim_backend.model.tokenizer import get_tokenizer
from sim_backend.model.vocab import EOS_IDS, N_BPE
from sim_backend.planes.types import ChatRequest, TokenProbs
from sim_backend.serving.grammar import GrammarMatcher
from sim_backend.serving.sampling import Sampler
from sim_backend.serving.streaming import StopStringMatcher, StreamDecoder, Tokenizer
from sim_backend.serving.token_probs import logit_probs

#: (stop_type, stopping word): ("eos", ""), ("limit", ""), ("word", the stop string)
Stop = tuple[str, str]


class TokenPipeline:
    """Sampler + stop rules + streaming text of one request. Not thread-safe (the engine thread's).

    Args:
        req: the request (sampling parameters, stop strings).
        prompt: its prompt token ids (the penalties' history starts with them).
        n_ctx: context in tokens (the ``limit`` stop at prompt + generated = n_ctx).
        max_tokens: generated tokens at most (``limit``).
        tokenizer: for the pieces' bytes and which ids are special (default the shared Qwen3 tokenizer).
        vocab: the model's logits rows (default Qwen3's); eos_ids: the ids that end generation
        (default Qwen3's); text_ids: the [lo, hi) range of ordinary text ids the timing-only stand-in
        draws from (default Qwen3's BPE tokens).
        grammar: the request's compiled grammar (constrained decoding), or None. Its mask is applied to
        the logits before sampling and to the timing-only draw (``GrammarMatcher.stand_in``), so the text
        matches the grammar whatever the weights; each sampled token advances it. With ``ignore_eos`` the
        EOS ids leave the mask unless the grammar allows nothing else (a complete sentence then ends).
        context_shift: llama-server's ``--context-shift``: no ``limit`` stop at the context end (the engine
        shifts the context, ``serving.context_shift``), except for a request with ``n_probs`` or ``logit_bias``.

    With ``req.n_probs`` > 0 each sampled token's ``TokenProbs`` is appended to ``probs`` (aligned with
    ``generated``): from the step's raw logits (``token_probs.logit_probs``), or after the sampler chain
    with ``req.post_sampling_probs`` (``Sampler.post_sampling_probs``). A timing-only step has no logits and
    records none: probabilities of the seeded stand-in would be invented, not the model's (the engine refuses
    a request with ``n_probs`` that would run timing-only: ``admission.NO_LOGITS``).

    ``req.logit_bias`` is added to the logits first in the sampler chain (``Sampler``), so greedy decoding
    follows it and a banned id (-inf) is never sampled. It needs logits: a timing-only step of a biased request
    raises ValueError (the engine refuses such a request: ``admission.NO_LOGITS_BIAS``), as dropping the bias
    would hand back tokens the client excluded.
    """

    def __init__(self, req: ChatRequest, prompt: Sequence[int], *, n_ctx: int, max_tokens: int,
                 tokenizer: Tokenizer | None = None, vocab: int | None = None,
                 eos_ids: frozenset[int] = EOS_IDS, text_ids: tuple[int, int] = (0, N_BPE),
                 grammar: GrammarMatcher | None = None, context_shift: bool = False) -> None:
        bias = tuple(req.logit_bias)
        self.sampler = Sampler(req.sampling, logit_bias=bias) if vocab is None else \
            Sampler(req.sampling, vocab, logit_bias=bias)
        self._biased = bool(bias)
        # timing-only steps have no logits: a generator seeded like the sampler stands in, so a run replays
        self.fallback_rng = np.random.default_rng(self.sampler.seed)
        # the pieces' bytes of the probabilities' tokens come from the same tokenizer as the text
        self._tok: Any = tokenizer if tokenizer is not None else get_tokenizer()
        self.decoder = StreamDecoder(tokenizer, skip_special=True)
        self.matcher = StopStringMatcher(req.stop)
        self._penalties = req.sampling.has_penalties
        self._prompt = prompt
        self._n_ctx = n_ctx
        self._max_tokens = max_tokens
        self._eos_ids = eos_ids
        self._ban_eos = req.ignore_eos and bool(eos_ids)
        self._eos_index = np.fromiter(sorted(eos_ids), dtype=np.intp, count=len(eos_ids))
        self._text_ids = text_ids
        self.grammar = grammar
        self.generated: list[int] = []
        self.n_probs = int(req.n_probs)
        self.post_sampling = bool(req.post_sampling_probs)
        #: one per sampled token when ``n_probs`` > 0 (aligned with ``generated``)
        self.probs: list[TokenProbs] = []
        #: the last sampled token, fed to the model by the next decode step
        self.pending_token: int | None = None
        # context shift (llama-server --context-shift): no stop at the context end, the engine shifts instead;
        # never for a request that needs the model's logits (the numerics do not re-rotate shifted keys)
        self.context_shift = context_shift and not (self.n_probs or self._biased)
        #: the context filled: shifted (set by ``context_shift``) or stopped at its end (llama-server's)
        self.truncated = False

    def limit_now(self) -> None:
        """The next sampled token is the last (``limit``): the generation limit becomes what is generated
        plus one. Called from another thread (``RequestHandle.stop_generation``): one int store, read by
        the engine thread at the next token."""
        self._max_tokens = min(self._max_tokens, len(self.generated) + 1)

    @property
    def seed(self) -> int:
        """The sampler's seed (drawn when the request gave none), for replay."""
        return self.sampler.seed

    def sample(self, logits: np.ndarray | None, numeric: bool) -> int:
        """The next token id from one step's D2H logits ((vocab,): ``uint16`` BF16 bits, or ``float32`` from a
        calbin that returns F32 logits); timing-only
        (``numeric`` False or no logits): an ordinary text id (``text_ids``) from the seeded generator.
        With a grammar, only a token it allows (its mask on the logits, or its stand-in draw)."""
        allowed = self._allowed()
        if logits is None or not numeric:
            if self._biased:  # the engine refuses such a request (admission.NO_LOGITS_BIAS): never drop the bias
                raise ValueError("logit_bias needs the model's logits, and this step has none (timing-only)")
            if self.grammar is not None and allowed is not None:
                return self.grammar.stand_in(self.fallback_rng, len(self.generated), self._max_tokens, allowed)
            return int(self.fallback_rng.integers(*self._text_ids))
        raw = logits  # the probabilities' softmax is of the model's logits, before any bias (llama.cpp)
        if self._ban_eos and allowed is None:  # llama.cpp's ignore_eos: -inf logits for the end-of-generation ids
            logits = logits.copy()
            logits[self._eos_index] = neg_inf(dtype_of(logits))
        # BF16 bits widen straight into the sampler's scratch buffer: no FP32 copy per step
        recent = list(self._prompt) + self.generated if self._penalties else ()
        tok = self.sampler.sample_d2h(logits, recent, allowed)
        if self.n_probs:
            if self.post_sampling:
                tp = self.sampler.post_sampling_probs(tok, self.n_probs)
            else:  # the raw logits (the sampler's scratch holds them penalised and masked)
                tp = logit_probs(to_f32(raw), tok, self.n_probs, n_valid=self.sampler.n_valid)
            self.probs.append(self._with_pieces(tp))
        return tok

    def _allowed(self) -> np.ndarray | None:
        """The grammar's mask of the next token (None without a grammar); with ``ignore_eos`` the EOS ids
        are taken out of it unless nothing else is allowed."""
        if self.grammar is None:
            return None
        allowed = self.grammar.allowed()
        if self._ban_eos and allowed[self._eos_index].any():
            rest = allowed.copy()
            rest[self._eos_index] = False
            if rest.any():
                return rest
        return allowed

    def _piece(self, tok: int) -> bytes:
        return b"" if self._tok.is_special(tok) else bytes(self._tok.token_bytes(tok))

    def _with_pieces(self, tp: TokenProbs) -> TokenProbs:
        """``tp`` with each token's bytes (special tokens: none, as the streamed text shows them)."""
        top = tuple(msgspec.structs.replace(t, piece=self._piece(t.id)) for t in tp.top)
        return msgspec.structs.replace(tp, top=top, piece=self._piece(tp.id))

    def push(self, tok: int) -> tuple[str, Stop | None]:
        """Apply the stop rules to sampled token ``tok``: (text now visible, the stop or None).

        When a stop is returned the held text has been released (module docstring)."""
        visible, stop = self._consume(tok)
        if stop is not None:
            visible, stop = self._final_flush(visible, stop)
        return visible, stop

    def _consume(self, tok: int) -> tuple[str, Stop | None]:
        self.generated.append(tok)
        if self.grammar is not None:
            self.grammar.consume(tok)
        if tok in self._eos_ids:
            return "", ("eos", "")
        self.pending_token = tok
        piece = self.decoder.push(tok)
        visible, word = self.matcher.push(piece) if piece else ("", None)
        if word is not None:
            return visible, ("word", word)
        if len(self.generated) >= self._max_tokens:
            return visible, ("limit", "")
        # context end (llama.cpp): prompt + generated never exceeds n_ctx, so usage.total_tokens <= n_ctx
        if not self.context_shift and len(self._prompt) + len(self.generated) >= self._n_ctx:
            self.truncated = True
            return visible, ("limit", "")
        return visible, None

    def _final_flush(self, visible: str, stop: Stop) -> tuple[str, Stop]:
        if stop[0] == "word":
            return visible, stop
        tail = self.decoder.flush()
        if tail:
            more, word = self.matcher.push(tail)
            visible += more
            if word is not None:
                return visible, ("word", word)
        return visible + self.matcher.flush(), stop
