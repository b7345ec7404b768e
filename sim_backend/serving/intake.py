"""Request intake: what ``Engine.submit`` does before a request takes a place in the queue.

The bundle's tokenizer (with a replacement chat template, ``serve --chat-template-file``), the
tokenised prompt as the context counts it (chat template applied), the request's grammar compiled
in the same host span, the prompt's bounds (``admission.check_prompt``), and the request's token
pipeline. Nothing here takes the engine's lock or allocates device state: a refusal here costs
nothing but the ``rejected`` counter the engine moves.
"""

from __future__ import annotations

from typing import Any

from sim_backend.model.families import tokenizer_for
from sim_backend.model.vocab import N_BPE
from sim_backend.planes.types import ChatRequest, validate_request
from sim_backend.runtime import RuntimeSession
from sim_backend.serving import grammar as _grammar
from sim_backend.serving.admission import check_prompt
from sim_backend.serving.hosttime import HostTimer
from sim_backend.serving.streaming import Tokenizer
from sim_backend.serving.tokens import TokenPipeline


class RequestIntake:
    """Validate and tokenise requests for one engine.

    Args:
        rt: the runtime session (its bundle's tokenizer, vocabulary, KV pool size).
        n_ctx: context in tokens per sequence; n_slots: the engine's slots (an ``id_slot`` beyond is refused).
        host_timer: measures the tokenising span (host µs).
        chat_template: a ``model.chat_template.JinjaChatTemplate`` that replaces the bundle's, or None.
        context_shift: llama-server's ``--context-shift`` for every request's pipeline (``TokenPipeline``).
    """

    def __init__(self, rt: RuntimeSession, *, n_ctx: int, n_slots: int, host_timer: HostTimer,
                 chat_template: Any = None, context_shift: bool = False) -> None:
        self.rt = rt
        self.context_shift = context_shift
        self.n_ctx = n_ctx
        self.n_slots = n_slots
        self.host_timer = host_timer
        # the bundle's tokenizer (Qwen3's BPE, or a GGUF's own for the dense pilot); a stand-in runtime
        # without a bundle gets Qwen3's
        self.tokenizer: Tokenizer = tokenizer_for(getattr(rt, "bundle", None))
        if chat_template is not None:
            from sim_backend.model.chat_template import TemplatedTokenizer
            self.tokenizer = TemplatedTokenizer(self.tokenizer, chat_template)
        self.eos_ids = frozenset(self.tokenizer.eos_ids)
        #: token ids the timing-only stand-in draws from: the tokenizer's ordinary text tokens
        lo, hi = getattr(self.tokenizer, "text_id_range", (0, N_BPE))
        self.text_ids = (int(lo), int(hi))

    def tokenize_prompt(self, req: ChatRequest) -> list[int]:
        """Prompt token ids with the chat template applied (what counts against the context);
        a raw ``prompt_tokens`` request's own ids."""
        if req.prompt_tokens is not None:
            return [int(t) for t in req.prompt_tokens]
        return self.tokenizer.encode_chat(list(req.messages), add_generation_prompt=req.add_generation_prompt,
                                          enable_thinking=req.enable_thinking,
                                          continue_final_message=req.continue_final_message,
                                          template_kwargs=req.template_kwargs)

    def validate(self, req: ChatRequest) -> None:
        """InvalidRequestError for a request the model cannot take (``planes.types.validate_request``)."""
        validate_request(req, self.rt.vocab)

    def prepare(self, req: ChatRequest) -> tuple[list[int], _grammar.GrammarMatcher | None, float]:
        """(prompt ids, compiled grammar or None, tokenising host µs) of a validated request.

        The grammar is compiled inside the measured span (booked as ``tokenize``); the process's one-off
        llguidance tokenizer build (``serving.grammar.lltokenizer``, llama.cpp's model-load work) is not.
        Raises InvalidRequestError (a grammar that does not compile, an ``id_slot`` that does not exist),
        ExceedContextSizeError (prompt >= n_ctx, or more tokens than the KV pool holds).
        """
        vocab = int(self.rt.vocab)
        if req.grammar is not None:
            _grammar.lltokenizer(self.tokenizer, vocab, self.eos_ids)
        t0 = self.host_timer.now()
        prompt = self.tokenize_prompt(req)
        matcher = None
        if req.grammar is not None:
            matcher = _grammar.compile_grammar(req.grammar, self.tokenizer, vocab, self.eos_ids)
        tok_us = self.host_timer.now() - t0
        check_prompt(len(prompt), req.id_slot, n_ctx=self.n_ctx, n_slots=self.n_slots,
                     kv_cells=self.rt.kv.occupancy().capacity_cells)
        return prompt, matcher, tok_us

    def pipeline(self, req: ChatRequest, prompt: list[int], matcher: _grammar.GrammarMatcher | None) -> TokenPipeline:
        """The request's token pipeline (sampler, stop rules, visible text) over this engine's tokenizer."""
        return TokenPipeline(req, prompt, n_ctx=self.n_ctx, max_tokens=int(req.max_tokens or 0),
                             tokenizer=self.tokenizer, vocab=int(self.rt.vocab), eos_ids=self.eos_ids,
                             text_ids=self.text_ids, grammar=matcher, context_shift=self.context_shift)


__all__ = ["RequestIntake"]
