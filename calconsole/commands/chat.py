"""``calconsole chat PROMPT``: one headless generation through the same engine as the chat pane."""

from __future__ import annotations

import argparse
import sys

import msgspec

from sim_backend.planes import CalError, ChatRequest, RequestError, SamplingParams

from ..widgets.render import numeric_limit, timing_only_reason
from .common import (
    AnySystem,
    Subparsers,
    add_common_options,
    add_connect_options,
    build_or_connect,
    fail,
    print_json,
    read_prompt,
)


def _number(text: str) -> int | float | str:
    """Parse a numeric option leniently: int if it is an integer literal, else float, else the raw
    string, so the engine's validation reports a bad value with its typed error (exit code 2)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (same parameters as the chat pane; invalid values exit with code 2)")
    g.add_argument("--max-tokens", type=_number, default=128,
                   help="tokens to generate at most, > 0, or -1: until the context is full or a stop (llama-server's "
                        "-1; default 128). A reply also stops at the context end (40960 tokens, prompt and chat "
                        "template included; stop=limit): a larger value is accepted and a note on stderr says how "
                        "many tokens the reply can have at most")
    d = SamplingParams()  # one home for the defaults (llama-server's)
    g.add_argument("--temperature", type=_number, default=d.temperature,
                   help=f">= 0; 0 = greedy (default {d.temperature:g})")
    g.add_argument("--top-k", type=_number, default=d.top_k,
                   help=f"integer in [0, 151936]; 0 = disabled (default {d.top_k})")
    g.add_argument("--top-p", type=_number, default=d.top_p,
                   help=f"nucleus mass in (0, 1]; tiny = greedy (default {d.top_p:g})")
    g.add_argument("--min-p", type=_number, default=d.min_p, help=f"in [0, 1] (default {d.min_p:g})")
    g.add_argument("--repeat-penalty", type=_number, default=d.repeat_penalty,
                   help=f"in (0, 10]; 1.0 = off (default {d.repeat_penalty:g})")
    g.add_argument("--repeat-last-n", type=_number, default=d.repeat_last_n,
                   help=f"tokens the penalties look back over (-1 = all, 0 = off; default {d.repeat_last_n})")
    g.add_argument("--presence-penalty", type=_number, default=d.presence_penalty,
                   help=f"in [-2, 2] (default {d.presence_penalty:g})")
    g.add_argument("--frequency-penalty", type=_number, default=d.frequency_penalty,
                   help=f"in [-2, 2] (default {d.frequency_penalty:g})")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string, non-empty (repeatable)")
    g.add_argument("--seed", type=_number, default=None,
                   help="sampling seed, integer in [0, 2**64); same seed, same tokens; as llama-server, -1 is a "
                        "drawn one and another negative is read modulo 2**32 (-5: 4294967291) (default: drawn, "
                        "reported)")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--think", action="store_true", help="leave thinking on (default: empty <think></think>)")


def request_from_args(args: argparse.Namespace, prompt: str) -> ChatRequest:
    from sim_backend.planes import seed_or_random

    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                        seed=seed_or_random(args.seed))
    msgs = []
    if args.system:
        msgs.append({"role": "system", "content": args.system})
    msgs.append({"role": "user", "content": prompt})
    return ChatRequest(messages=tuple(msgs), max_tokens=args.max_tokens, sampling=sp, stop=tuple(args.stop),
                       enable_thinking=args.think, client="cli")


def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "chat", help="generate one reply headless and print it",
        description="Generate one reply through the serving engine. The weights are synthetic, so the text "
                    "is not meaningful; tokens, timings and KV are real products of the run. All timings "
                    "(prompt_ms, predicted_ms, ttft_ms, ...) are SIMULATED milliseconds: device time plus the host "
                    "work booked on the same clock (--host-time: the fitted allowance per token by default, or "
                    "this machine's measured work). Invalid parameters "
                    "exit with code 2. Without --connect the reply comes from a fresh in-process simulator; with "
                    "--connect URL from the live device a server runs (its /v1/chat/completions stream).")
    p.add_argument("prompt", help="user message ('-' reads stdin, at most 8 MiB); taken as UTF-8 whatever the "
                                  "locale, and input that is not UTF-8 text is refused (exit code 2), not altered")
    add_common_options(p, default_pacing="fast")
    add_connect_options(p, admin=False)
    add_sampling_options(p)
    p.add_argument("--json", action="store_true",
                   help='print {"text","tokens","stop_type","status","seed","timings":{...}}: llama.cpp timings '
                        '(prompt_n, prompt_ms, predicted_n, predicted_ms, ...) plus ttft_ms, tpot_ms, itl_ms, '
                        'e2e_ms, queue_ms in simulated ms; host_ms is measured host time, host_booked_ms what was '
                        'booked on the simulated clock and host_time how (modeled / measured)')
    p.set_defaults(func=run)


def _numeric_limit(system: AnySystem) -> int | None:
    """The device's numeric limit (new prompt tokens; 0 when it runs timing-only), None when it says none
    (a server without a device) or the snapshot cannot be read."""
    try:
        d = system.observation.snapshot().device
    except (CalError, OSError, ValueError):
        return None
    return None if d is None else numeric_limit(d)


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import validate_request

    try:
        prompt = read_prompt(args.prompt)
    except ValueError as e:
        return fail(str(e))
    # -1: until the context is full or a stop, as llama-server's n_predict -1 (the context is the device's:
    # known once it is built or attached); checked as 1 until then
    unbounded = args.max_tokens == -1 and isinstance(args.max_tokens, int)
    if isinstance(args.max_tokens, int) and args.max_tokens < 1 and not unbounded:
        return fail(f"invalid_request_error: max_tokens (--max-tokens) must be a positive integer or -1 (until the "
                    f"context is full or a stop), got {args.max_tokens}")
    req = request_from_args(args, prompt)
    try:
        # before building anything: bad input costs nothing
        validate_request(msgspec.structs.replace(req, max_tokens=1) if unbounded else req)
    except RequestError as e:
        return fail(f"{e.error_type}: {e}")
    try:
        # start stages on stderr as serve says them (the pilot's weights are built at every start, ~10 s;
        # kernels compile at a first start): a silent wait looked hung
        system = build_or_connect(args, maintenance=False,
                                  numerics_progress=lambda line: print(f"calconsole chat: {line}", file=sys.stderr,
                                                                       flush=True))
    except (CalError, ValueError) as e:
        return fail(str(e))
    with system:
        n_ctx = system.inference.n_ctx
        if unbounded:
            req = msgspec.structs.replace(req, max_tokens=n_ctx)
        try:
            handle = system.inference.submit(req)
        except RequestError as e:
            return fail(f"{e.error_type}: {e}")
        room = n_ctx - handle.prompt_n  # the engine stops once prompt + generated reach n_ctx (llama.cpp)
        if req.max_tokens is not None and req.max_tokens > room and not unbounded:
            print(f"calconsole: note: --max-tokens {req.max_tokens} is more than the context leaves: the "
                  f"reply stops at the context end ({n_ctx} tokens, {handle.prompt_n} of them prompt) after "
                  f"at most {room} tokens", file=sys.stderr)
        try:
            for ev in handle.stream(timeout=system.inference.step_timeout_s):
                if hasattr(ev, "text") and not args.json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            handle.cancel("interrupted by user (Ctrl-C)")
            handle.result(10.0)
            print("\n[cancelled]", file=sys.stderr)
            return 130
        except TimeoutError as e:
            handle.cancel("no event within the step timeout")
            return fail(f"server_error: {e}", code=1)
        res = handle.result(1.0)
        limit = _numeric_limit(system)
    t = res.timings
    if args.json:
        print_json({
            "text": res.text, "tokens": list(res.tokens), "stop_type": res.stop_type,
            "stopping_word": res.stopping_word, "status": res.status, "error": res.error, "seed": res.seed,
            "timings": t.to_dict(),
        })
    else:
        sys.stdout.write("\n")
        ttft = f"{t.ttft_ms:.1f}" if t.ttft_ms is not None else "-"
        tpot = f"{t.tpot_ms:.2f}" if t.tpot_ms is not None else "-"
        url = getattr(system, "url", None)
        where = f" | live device at {url}" if url else " | fresh in-process device"
        clock = ("wall ms measured here as client; the server's own timings: prompt "
                 f"{t.prompt_ms:.1f} ms, predicted {t.predicted_ms:.1f} ms (its wall clock)"
                 if t.time_base == "wall" else "simulated device time")
        print(f"[{res.status}, stop={res.stop_type}] prompt {t.prompt_n} tok, generated {t.predicted_n} tok | "
              f"TTFT {ttft} ms, TPOT {tpot} ms, E2E {t.e2e_ms:.1f} ms ({clock}){where}",
              file=sys.stderr)
        if not t.numerics and t.time_base != "wall":
            why = timing_only_reason(t.prompt_n, t.cache_n, limit, recorded=t.timing_only_reason)
            print(f"timing-only: the tokens are the seeded generator's, not the model's ({why})", file=sys.stderr)
        if res.error:
            print(f"error: {res.error.get('message')}", file=sys.stderr)
    return 0 if res.status == "finished" else 1
