"""Text routes, llama-server's shapes: ``POST /tokenize /detokenize /apply-template
/chat/completions/input_tokens``, and the routes llama-server has for models the calbin is not
(embeddings, reranking: its 501 ``not_supported_error``), and ``/infill`` (``infill``)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sim_backend.planes import CalError, ChatRequest

from . import wire
from .infill import infill
from .replies import PiecedResponse, json_pieces, reply_limit
from .wire import HTTPError

if TYPE_CHECKING:
    from .context import Handler, RouteSpec, ServingFace


#: the rest of the 501 for embeddings / reranking: llama-server names its start option, calconsole serve has none
NO_OPTION = ("The served model is a text-generation calbin with no {what} output, and `calconsole serve` has no "
             "option that adds one.")


def routes(face: ServingFace) -> list[RouteSpec]:
    """(path, handler, methods, auth) of this family."""
    out: list[RouteSpec] = [("/tokenize", partial(tokenize, face), ["POST"], "api"),
                            ("/detokenize", partial(detokenize, face), ["POST"], "api"),
                            ("/apply-template", partial(apply_template, face), ["POST"], "api"),
                            ("/chat/completions/input_tokens", partial(input_tokens, face), ["POST"], "api"),
                            ("/v1/chat/completions/input_tokens", partial(input_tokens, face), ["POST"], "api")]
    # llama-server's answers for a model without embeddings / reranking: its first
    # sentence (clients match it), then what is true here instead of its "Start it with `--embeddings`" (serve
    # has no such option: the calbin has no pooled-embedding or reranking output to turn on)
    embeddings = not_offered(f"This server does not support embeddings. {NO_OPTION.format(what='embedding')}")
    rerank = not_offered(f"This server does not support reranking. {NO_OPTION.format(what='reranking')}")
    out += [(p, embeddings, ["POST"], "api") for p in ("/embedding", "/embeddings", "/v1/embeddings")]
    out += [(p, rerank, ["POST"], "api") for p in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")]
    out += [("/infill", partial(infill, face), ["POST"], "api")]
    return out


def _pieces(face: ServingFace, ids: list[Any]) -> Iterator[dict[str, Any]]:
    for t in ids:  # one at a time: written into the reply's pieces, never held as a list (replies module)
        b = face.inference.token_bytes(t)
        try:
            piece: Any = b.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(b)  # llama-server: a piece that is not valid UTF-8 is given as its bytes
        yield {"id": t, "piece": piece}


async def tokenize(face: ServingFace, request: Request) -> Response:
    """Tokens, pieces and the JSON text are built in one worker-thread call; a large body also takes a
    generation place (``ServingFace.heavy``)."""
    body = await face.read_json(request)
    content = body.get("content")
    if not isinstance(content, str):
        raise wire.bad_request("'content' must be a string")
    parse_special = wire.flag(body, "parse_special", True)
    wire.flag(body, "add_special", False)  # Qwen3 adds no BOS: accepted, nothing to add
    with_pieces = wire.flag(body, "with_pieces", False)

    limit = reply_limit(face.config.max_body_bytes)

    def run() -> list[bytes]:
        ids = face.inference.tokenize(content, parse_special=parse_special)
        return json_pieces({}, "tokens", _pieces(face, ids) if with_pieces else ids, limit)

    return PiecedResponse(await face.heavy(request, run))


async def detokenize(face: ServingFace, request: Request) -> Response:
    """As ``tokenize``: off the event loop, a large body inside the generation bound."""
    body = await face.read_json(request)
    tokens = body.get("tokens", [])
    if not isinstance(tokens, list):
        raise wire.bad_request("'tokens' must be a list of token ids")
    with_pieces = wire.flag(body, "with_pieces", False)

    limit = reply_limit(face.config.max_body_bytes)

    def run() -> list[bytes]:
        text = face.inference.detokenize(tokens)
        if not with_pieces:
            return json_pieces({"content": text}, None, (), limit)
        # our addition: each token's raw piece (str, or its bytes when not valid UTF-8, as /tokenize gives them)
        return json_pieces({"content": text}, "pieces", _pieces(face, tokens), limit)

    try:
        data = await face.heavy(request, run)
    except CalError as e:
        raise wire.bad_request(str(e)) from None
    return PiecedResponse(data)


async def apply_template(face: ServingFace, request: Request) -> Response:
    """The prompt a chat request with this body would be given (messages, ``chat_template_kwargs``,
    ``add_generation_prompt``, ``continue_final_message``, as ``/v1/chat/completions`` reads them)."""
    body = await face.read_json(request)
    msgs = wire.messages_from(body)
    opts = await face.template_options(body)
    try:
        prompt = await face.call(face.inference.apply_template, msgs, **opts)
    except CalError as e:
        raise wire.bad_request(str(e)) from None
    return JSONResponse({"prompt": prompt})

async def input_tokens(face: ServingFace, request: Request) -> Response:
    """``/chat/completions/input_tokens``: the templated prompt's tokens, as the context limit counts them."""
    body = await face.read_json(request)
    msgs = wire.messages_from(body)
    opts = await face.template_options(body)
    try:
        n = await face.call(face.inference.count_prompt_tokens, ChatRequest(messages=msgs, max_tokens=1, **opts))
    except CalError as e:
        raise wire.bad_request(str(e)) from None
    return JSONResponse({"input_tokens": n, "object": "response.input_tokens"})

def not_offered(message: str) -> Handler:
    """A route llama-server has that needs a model the calbin is not (embeddings, reranking):
    its 501 ``not_supported_error`` with its words."""
    async def handler(request: Request) -> Response:
        raise HTTPError(501, "not_supported_error", message)
    return handler
