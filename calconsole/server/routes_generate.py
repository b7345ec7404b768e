"""Generation routes: ``POST /completion`` (llama.cpp native), ``/v1/completions`` and
``/v1/chat/completions`` (OpenAI), streamed (SSE through the face's bridge) and not; token probabilities
(``logprobs``) per streamed piece or for the whole reply."""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sim_backend.planes import ChatRequest, ProgressEvent, RequestResult, TokenEvent

from ..codec import result_extension
from . import logprobs as lp
from . import wire
from .context import remote_of

if TYPE_CHECKING:
    from .context import RouteSpec, ServingFace


def routes(face: ServingFace) -> list[RouteSpec]:
    """(path, handler, methods, auth) of this family."""
    return [("/completion", partial(completion, face), ["POST"], "api"),
            ("/completions", partial(completion, face), ["POST"], "api"),
            ("/v1/completions", partial(completions_oai, face), ["POST"], "api"),
            ("/v1/chat/completions", partial(chat_completions, face), ["POST"], "api"),
            ("/chat/completions", partial(chat_completions, face), ["POST"], "api")]


def model_of(face: ServingFace, body: dict[str, Any]) -> str:
    """The model name a response reports: the request's (OpenAI echoes it), else the alias."""
    m = body.get("model")
    return m if isinstance(m, str) and m else face.aliases[0]

def client_of(request: Request) -> str:
    return f"http {remote_of(request)}"

def _label(chunk: dict[str, Any], probs: Any) -> None:
    """Say in the chunk's ``calconsole`` key what its probabilities were computed from (timing-only requests
    have no logits: the seeded generator's distribution)."""
    chunk.setdefault("calconsole", {})["logprobs_source"] = lp.source_of(probs)


async def logit_bias_of(face: ServingFace, body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """The body's ``logit_bias`` as (token id, bias) pairs (``wire.logit_bias_from``: its strings tokenized
    by the model's tokenizer, as llama-server's ``common_tokenize`` without special tokens), in a worker
    thread; none without one."""
    if body.get("logit_bias") is None:
        return ()
    return await face.call(wire.logit_bias_from, body, lambda text: face.inference.tokenize(text), face.n_vocab)


async def whole_probs(face: ServingFace, results: list[RequestResult]) -> list[list[dict[str, Any]]]:
    """Each whole reply's probabilities in llama-server's entries (a stop word's tokens dropped), built in a
    worker thread (a reply of many tokens with many alternatives each is a lot of JSON)."""
    def build() -> list[list[dict[str, Any]]]:
        return [lp.probs_json(lp.final_probs(r, lambda w: face.inference.tokenize(w))) for r in results]

    return await face.call(build)


async def chat_completions(face: ServingFace, request: Request) -> Response:
    body = face.with_defaults(await face.read_json(request))
    req = wire.chat_request(body, n_ctx=face.n_ctx, n_predict=face.config.n_predict,
                            client=client_of(request), template=await face.template_options(body),
                            logit_bias=await logit_bias_of(face, body))
    stream = wire.flag(body, "stream", False)
    include_usage = wire.stream_options(body)
    cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    model = model_of(face, body)
    reqs = [req] * wire.choices_of(body)  # n choices: n requests of the same prompt, each its own seed
    if not stream:
        results = await face.generate_all(reqs, request)
        out = wire.chat_completion(results, cid, int(time.time()), model, face.fingerprint, wire.prefill_of(req))
        if req.n_probs:
            for choice, entries in zip(out["choices"], await whole_probs(face, results), strict=True):
                choice["logprobs"] = {"content": entries}
            _label(out, [p for r in results for p in r.probs])
        return JSONResponse(out)
    created = int(time.time())
    fp = face.fingerprint

    def role(i: int) -> dict[str, Any]:
        return wire.chat_chunk(cid, created, model, fp, {"role": "assistant", "content": None}, index=i)

    # the role chunk opens each choice; with return_progress the progress chunks come first (each one a role
    # chunk with prompt_progress, as llama-server sends them) and the role chunk comes with the first piece
    deferred = req.return_progress
    role_due = [deferred] * len(reqs)  # per choice: its role chunk is still to be sent (one pump thread each)

    def opening(i: int) -> list[dict[str, Any]]:
        if not role_due[i]:
            return []
        role_due[i] = False
        return [role(i)]

    def piece(i: int, ev: TokenEvent) -> list[dict[str, Any]]:
        c = wire.chat_chunk(cid, created, model, fp, {"content": ev.text}, index=i)
        if ev.probs:
            c["choices"][0]["logprobs"] = {"content": lp.probs_json(ev.probs)}
            _label(c, ev.probs)
        return opening(i) + [c]

    def progress(i: int, ev: ProgressEvent) -> list[dict[str, Any]]:
        c = role(i)
        c["prompt_progress"] = ev.to_json()
        return [c]

    def last(i: int, res: RequestResult) -> list[dict[str, Any]]:
        out = opening(i) + [wire.chat_chunk(cid, created, model, fp, {}, wire.finish_reason(res), index=i)]
        if include_usage:
            out.append({"choices": [], "created": created, "id": cid, "model": model, "system_fingerprint": fp,
                        "object": "chat.completion.chunk", "usage": wire.usage(res)})
        out[-1]["timings"] = wire.timings(res)
        out[-1]["calconsole"] = result_extension(res)
        return out

    first = [] if deferred else [role(i) for i in range(len(reqs))]
    return await face.stream(reqs, first, piece, last, True, progress)

async def completions_oai(face: ServingFace, request: Request) -> Response:
    body = face.with_defaults(await face.read_json(request))
    prompts = wire.prompts_from(body)
    n = wire.choices_of(body)
    bias = await logit_bias_of(face, body)
    # choice index = prompt index * n + j (OpenAI's order)
    reqs = [r for p in prompts
            for r in [await completion_req(face, {**body, "prompt": p}, request, openai=True, logit_bias=bias)] * n]
    cid = f"cmpl-{uuid.uuid4().hex[:24]}"
    model = model_of(face, body)
    created = int(time.time())
    fp = face.fingerprint
    if not wire.flag(body, "stream", False):
        results = await face.generate_all(reqs, request)
        out = wire.text_completion(results, cid, created, model, fp)
        if reqs[0].n_probs:
            for choice, entries in zip(out["choices"], await whole_probs(face, results), strict=True):
                choice["logprobs"] = {"content": entries}
            _label(out, [p for r in results for p in r.probs])
        return JSONResponse(out)
    if len(prompts) > 1:
        raise wire.bad_request("'prompt': several prompts stream on /completion only; ask /v1/completions "
                               "without 'stream' for several")
    wire.stream_options(body)  # checked; llama-server sends usage in the final chunk whatever it says

    def last(i: int, res: RequestResult) -> list[dict[str, Any]]:
        c = wire.text_chunk(cid, created, model, fp, "", wire.finish_reason(res), index=i)
        c["usage"] = wire.usage(res)
        c["timings"] = wire.timings(res)
        c["calconsole"] = result_extension(res)
        return [c]

    def piece(i: int, ev: TokenEvent) -> list[dict[str, Any]]:
        c = wire.text_chunk(cid, created, model, fp, ev.text, index=i)
        if ev.probs:
            c["choices"][0]["logprobs"] = {"content": lp.probs_json(ev.probs)}
            _label(c, ev.probs)
        return [c]

    def progress(i: int, ev: ProgressEvent) -> list[dict[str, Any]]:  # an empty piece with prompt_progress
        c = wire.text_chunk(cid, created, model, fp, "", index=i)
        c["prompt_progress"] = ev.to_json()
        return [c]

    return await face.stream(reqs, [], piece, last, True, progress)

async def completion_req(face: ServingFace, body: dict[str, Any], request: Request, *, openai: bool,
                         logit_bias: tuple[tuple[int, float], ...] = ()) -> ChatRequest:
    return await face.call(lambda: wire.completion_request(
        body, lambda text: face.inference.tokenize(text, parse_special=True), n_ctx=face.n_ctx,
        n_predict=face.config.n_predict, client=client_of(request), openai=openai, logit_bias=logit_bias))

async def completion(face: ServingFace, request: Request) -> Response:
    """llama.cpp native ``/completion``: no chat template; ``data:`` chunks without ``[DONE]``; a list of
    prompts gives a JSON array of results (streamed: chunks of all, each with its ``index``)."""
    return await completion_of(face, await face.read_json(request), request)

async def completion_of(face: ServingFace, body: dict[str, Any], request: Request) -> Response:
    """``/completion``'s answer to ``body`` (read from ``request`` already; ``/infill`` gives its built
    prompt as ``body["prompt"]``, token ids)."""
    body = face.with_defaults(body)
    prompts = wire.prompts_from(body)
    bias = await logit_bias_of(face, body)
    reqs = [await completion_req(face, {**body, "prompt": p}, request, openai=False, logit_bias=bias)
            for p in prompts]
    return_tokens = wire.flag(body, "return_tokens", False)
    per_token = wire.flag(body, "timings_per_token", False)
    stream = wire.flag(body, "stream", False)
    n_ctx = face.n_ctx
    model = face.aliases[0]
    # the ids ignore_eos sets to -inf, listed in generation_settings.logit_bias (a plane that does not say: none)
    eog_ids = tuple(getattr(face.inference, "eog_ids", ()))
    # echoed in the final result: the prompt as the model saw it (its ids detokenized)
    texts = [await face.call(face.inference.detokenize, list(r.prompt_tokens or ())) for r in reqs]

    def final(res: RequestResult, i: int) -> dict[str, Any]:
        # the slot it ran in, as llama-server reports it (the request's own id_slot when the plane does not say)
        slot = res.id_slot if res.id_slot >= 0 else reqs[i].id_slot
        return wire.native_completion(res, reqs[i], n_ctx, model, id_slot=slot,
                                      return_tokens=return_tokens, stream=stream, prompt=texts[i], index=i,
                                      per_token=per_token, eog_ids=eog_ids)

    if not stream:
        results = await face.generate_all(reqs, request)
        out = [final(r, i) for i, r in enumerate(results)]
        if reqs[0].n_probs:
            for o, r, entries in zip(out, results, await whole_probs(face, results), strict=True):
                o["completion_probabilities"] = entries
                _label(o, r.probs)
        return JSONResponse(out if len(prompts) > 1 else out[0])

    n_prompt = [len(r.prompt_tokens or ()) for r in reqs]
    streamed = [0] * len(reqs)  # tokens each request's pieces carried (each index is one pump thread's)

    def piece(i: int, ev: TokenEvent) -> list[dict[str, Any]]:
        streamed[i] = ev.n_tokens
        # llama-server names the slot only in the final chunk: its partial chunks carry id_slot -1
        # (measured on the real server: -1 even for a request sent to id_slot 1)
        c = wire.native_chunk(ev.text, list(ev.tokens), id_slot=-1, n_predicted=ev.n_tokens,
                              n_evaluated=n_prompt[i])
        c["index"] = i
        if per_token:  # llama-server's per-chunk timings need counts the face does not see: ours instead
            c["calconsole"] = {"sim_ms": ev.sim_ms, "clock": "simulated ms: device time + booked host work"}
        if ev.probs:
            c["completion_probabilities"] = lp.probs_json(ev.probs)
            _label(c, ev.probs)
        return [c]

    def last(i: int, res: RequestResult) -> list[dict[str, Any]]:
        # llama-server streams a piece for every token: the ones that showed no text (an EOS, a stop word's)
        # come in one piece with empty content before the final chunk, with their ids and probabilities
        rest = res.tokens[streamed[i]:]
        if not rest:
            return [final(res, i)]
        ev = TokenEvent(res.request_id, "", len(res.tokens), res.timings.done_ms, tuple(rest),
                        res.probs[streamed[i]:], res.id_slot)
        return piece(i, ev) + [final(res, i)]

    def progress(i: int, ev: ProgressEvent) -> list[dict[str, Any]]:
        return [wire.native_progress_chunk(ev, index=i, id_slot=-1)]  # a partial chunk, as the pieces

    return await face.stream(reqs, [], piece, last, False, progress)
