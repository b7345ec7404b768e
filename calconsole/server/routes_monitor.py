"""Monitoring routes, llama-server's shapes: ``GET /health /props /slots /metrics /v1/models /models``."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from sim_backend.planes import SamplingParams

from .. import __version__
from . import wire
from .context import device_of
from .wire import HTTPError

if TYPE_CHECKING:
    from .context import RouteSpec, ServingFace


def routes(face: ServingFace) -> list[RouteSpec]:
    """(path, handler, methods, auth) of this family; /health needs no key (llama-server's rule)."""
    return [("/health", partial(health, face), ["GET"], "none"),
            ("/props", partial(props, face), ["GET"], "api"),
            ("/slots", partial(slots, face), ["GET"], "api"),
            ("/metrics", partial(metrics, face), ["GET"], "api"),
            ("/v1/models", partial(models, face), ["GET"], "api"),
            ("/models", partial(models, face), ["GET"], "api")]


async def health(face: ServingFace, request: Request) -> Response:
    """llama-server's ``/health``: 200 ``{"status": "ok"}``, 503 while the model is not usable (memory
    cleared, the device in maintenance, a backend still loading). Reads the plane's ``health()`` (state
    only), not a snapshot; a plane whose ``health()`` never blocks (``health_nonblocking``: the in-process
    one reads a few fields under short locks, ~4 µs) is read on the event loop, others in a worker thread
    (a thread hop is two context switches: on a loaded host each waits for a time slice)."""
    obs = face.observation
    h = obs.health() if getattr(obs, "health_nonblocking", False) else await face.call(obs.health)
    if h.status == "memory cleared":
        raise HTTPError(503, "unavailable_error", "Loading model: device memory is cleared")
    if h.mode != "serving":
        raise HTTPError(503, "unavailable_error", f"device in maintenance ({h.mode}, lease: {h.lease_holder})")
    if h.status in ("loading", "error"):  # a plane over another server: its own refusal
        raise HTTPError(503, "unavailable_error", h.detail or f"backend {h.status}")
    return JSONResponse({"status": "ok"})

def default_params(face: ServingFace) -> dict[str, Any]:
    n = face.config.n_predict
    return wire.sampling_settings(SamplingParams(seed=face.config.seed), n_predict=n)


async def props(face: ServingFace, request: Request) -> Response:
    snap = await face.call(face.observation.snapshot)
    dev = device_of(snap)
    n_ctx = face.n_ctx
    return JSONResponse({
        "default_generation_settings": {"params": default_params(face), "n_ctx": n_ctx},
        "total_slots": dev.n_slots,
        "model_alias": face.aliases[0],
        "model_ftype": "BF16",  # the calbin's weights and KV are BF16 (facts.md F1)
        "model_path": f"{dev.bundle} (simulated calbin bundle)",
        "modalities": {"vision": False, "video": False, "audio": False},
        "media_marker": "<__media__>",
        "endpoint_slots": face.config.slots_endpoint, "endpoint_props": False,
        "endpoint_metrics": face.config.metrics_endpoint,
        "ui": False, "ui_settings": {},
        "chat_template": face.inference.chat_template,
        "chat_template_caps": {"supports_object_arguments": False, "supports_parallel_tool_calls": False,
                               "supports_preserve_reasoning": False, "supports_reasoning_effort": False,
                               "supports_string_content": True, "supports_system_role": True,
                               "supports_tool_calls": False, "supports_tools": False,
                               "supports_typed_content": False},
        # the model's own (the pilot: its GGUF's bos/eos ids), as llama-server reports them
        "bos_token": str(getattr(face.inference, "bos_token", "")),
        "eos_token": str(getattr(face.inference, "eos_token", "<|im_end|>")),
        "build_info": wire.BUILD_INFO,
        "is_sleeping": False, "cors_proxy_enabled": False,
        "device": {"name": dev.name, "status": dev.status, "mode": dev.mode, "calrt_version": dev.calrt_version,
                   "firmware_commit": dev.firmware_commit, "chiplets": msgspec.to_builtins(dev.chiplets),
                   "context_tokens": dev.context_tokens, "numerics": dev.numerics, "weights": dev.weights,
                   "logits_dtype": dev.logits_dtype,
                   "pacing": dev.pacing,
                   "pacing_speed": dev.pacing_speed, "step_timeout_s": face.inference.step_timeout_s,
                   "maintenance_routes": face.maintenance is not None,
                   "findings": msgspec.to_builtins(snap.findings),
                   # which host work the timings book (--host-time): a client comparing runs
                   # (bench matrix records this key) cannot tell modeled from measured otherwise
                   "clock": "timings are "
                            + (snap.requests.clock or "simulated device ms + booked host work"),
                   "calconsole_version": __version__},
    })

async def slots(face: ServingFace, request: Request) -> Response:
    """llama-server's ``/slots``: a slot that never served a request is its id, n_ctx, speculative and
    is_processing; a busy one adds the task, prompt counts, its sampling params and ``next_token`` (an array of
    one object); an idle one that served a request keeps its last task's id and params, and the counters
    llama-server resets when it releases a slot (processed and cached prompt tokens 0, ``next_token``
    ``has_next_token`` false, ``n_remain`` -1, ``n_decoded`` 0). ``n_prompt_tokens`` is what llama-server reports
    there, the slot's prompt: the tokens its KV holds (the prompt so far and the reply but its last token, never
    fed back); ``n_prompt_tokens_processed`` the prompt tokens computed, ``n_prompt_tokens_cache`` those reused
    (as the real llama-server reports them: tests/server/test_parity_llama_server.py ``test_busy_slot_shape``)."""
    if not face.config.slots_endpoint:
        raise HTTPError(501, "not_supported_error", "This server does not support slots endpoint.")
    snap = await face.call(face.observation.snapshot)
    n_ctx = face.n_ctx
    out: list[dict[str, Any]] = []
    for s in snap.slots:
        busy = s.state != "idle"
        slot: dict[str, Any] = {"id": s.index, "n_ctx": n_ctx, "speculative": False, "is_processing": busy}
        task = s.request_id if busy else s.last_request_id
        if busy or task is not None:
            known = {k: v for k, v in s.params.items() if k in wire.SAMPLING_FIELDS}
            n_predict = -1 if s.max_tokens == n_ctx else s.max_tokens
            slot.update({
                "id_task": task if task is not None else -1,
                # llama-server's slot prompt: the tokens its KV holds (the prompt so far and the reply fed back);
                # processed = the prompt tokens computed, cache = those reused (reset to 0 on an idle slot)
                "n_prompt_tokens": s.cached_tokens,
                "n_prompt_tokens_processed": (s.n_prefilled or 0) - (s.reused_tokens or 0) if busy else 0,
                "n_prompt_tokens_cache": (s.reused_tokens or 0) if busy else 0,
                "params": wire.sampling_settings(SamplingParams(**known), n_predict=n_predict,
                                                 n_keep=s.n_keep or 0),
                "next_token": [{"has_next_token": busy, "has_new_line": False,
                                "n_remain": max(0, s.max_tokens - (s.predicted_n or 0)) if busy else -1,
                                "n_decoded": (s.predicted_n or 0) if busy else 0}],
                # calconsole's extension: the request's context shifts (--context-shift) and tokens they dropped
                "calconsole": {"n_shifts": s.n_shifts or 0, "n_discarded": s.n_discarded or 0,
                               "truncated": bool(s.truncated)}})
        out.append(slot)
    if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(o["is_processing"] for o in out):
        raise HTTPError(503, "unavailable_error", "no slot available")
    return JSONResponse(out)

async def metrics(face: ServingFace, request: Request) -> Response:
    if not face.config.metrics_endpoint:
        raise HTTPError(501, "not_supported_error", "This server does not support metrics endpoint.")
    text = await face.call(face.observation.metrics_text)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8",
                             headers={"Process-Start-Time-Unix": str(face.created)})

async def models(face: ServingFace, request: Request) -> Response:
    n_ctx = face.n_ctx
    alias = face.aliases[0]
    return JSONResponse({
        # the Ollama-style list llama-server also sends
        "models": [{"name": alias, "model": alias, "modified_at": "", "size": "", "digest": "", "type": "model",
                    "description": "", "tags": [""], "capabilities": ["completion"], "parameters": "",
                    "details": {"parent_model": "", "format": "calbin", "family": "", "families": [""],
                                "parameter_size": "", "quantization_level": ""}}],
        "object": "list",
        "data": [{"id": alias, "aliases": face.aliases, "tags": list(face.config.model_tags), "object": "model",
                  "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
                  "created": face.created, "owned_by": "calconsole",
                  "meta": {"n_vocab": face.n_vocab, "n_ctx": n_ctx,
                           "n_ctx_train": face.inference.n_ctx}}]})
