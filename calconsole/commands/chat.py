"""``calconsole chat PROMPT``: one headless generation through the same engine as the chat pane."""

from __future__ import annotations

import argparse
import sys

from sim_backend.errors import CalError, RequestError

from .common import add_common_options, build_from_args, fail, print_json


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (same parameters as the chat pane)")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    g.add_argument("--top-k", type=int, default=40, help="0 = disabled (default 40)")
    g.add_argument("--top-p", type=float, default=0.95, help="nucleus mass in (0, 1] (default 0.95)")
    g.add_argument("--min-p", type=float, default=0.05, help="in [0, 1] (default 0.05)")
    g.add_argument("--repeat-penalty", type=float, default=1.0, help="1.0 = off (default)")
    g.add_argument("--repeat-last-n", type=int, default=64, help="tokens the penalties look back over")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    g.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (integer); same seed, same tokens")
    g.add_argument("--system", default=None, help="system message")
    g.add_argument("--think", action="store_true", help="leave thinking on (default: empty <think></think>)")


def request_from_args(args: argparse.Namespace, prompt: str):
    from sim_backend.engine import ChatRequest
    from sim_backend.sampling import SamplingParams

    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                        seed=args.seed)
    msgs = []
    if args.system:
        msgs.append({"role": "system", "content": args.system})
    msgs.append({"role": "user", "content": prompt})
    return ChatRequest(messages=tuple(msgs), max_tokens=args.max_tokens, sampling=sp, stop=tuple(args.stop),
                       enable_thinking=args.think, client="cli")


def register(sub, common) -> None:
    p = sub.add_parser(
        "chat", help="generate one reply headless and print it",
        description="Generate one reply through the serving engine. The weights are synthetic, so the text "
                    "is not meaningful; tokens, timings and KV are real products of the run. All timings "
                    "(prompt_ms, predicted_ms, ttft_ms, ...) are SIMULATED device milliseconds, with measured "
                    "host work (tokenize, sampling, detokenize) included on the same clock. Invalid parameters "
                    "exit with code 2.")
    p.add_argument("prompt", help="user message ('-' reads stdin)")
    add_common_options(p, default_pacing="fast")
    add_sampling_options(p)
    p.add_argument("--json", action="store_true",
                   help='print {"text","tokens","stop_type","timings":{...}} (timings in simulated ms)')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    req = request_from_args(args, prompt)
    try:
        system = build_from_args(args, maintenance=False)
    except (CalError, ValueError) as e:
        return fail(str(e))
    with system:
        try:
            handle = system.inference.submit(req)
        except RequestError as e:
            return fail(f"{e.error_type}: {e}")
        try:
            for ev in handle.stream(timeout=system.engine.step_timeout_s):
                if hasattr(ev, "text") and not args.json:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            handle.cancel("interrupted by user (Ctrl-C)")
            handle.result(10.0)
            print("\n[cancelled]", file=sys.stderr)
            return 130
        res = handle.result(1.0)
    t = res.timings
    if args.json:
        print_json({
            "text": res.text, "tokens": list(res.tokens), "stop_type": res.stop_type,
            "stopping_word": res.stopping_word, "status": res.status, "error": res.error, "seed": res.seed,
            "timings": {"prompt_n": t.prompt_n, "prompt_ms": t.prompt_ms, "predicted_n": t.predicted_n,
                        "predicted_ms": t.predicted_ms, "predicted_per_second": t.predicted_per_second,
                        "ttft_ms": t.ttft_ms, "tpot_ms": t.tpot_ms, "e2e_ms": t.e2e_ms, "cache_n": t.cache_n,
                        "queue_ms": t.queue_ms, "numerics": t.numerics,
                        "clock": "simulated device ms (measured host work included)"},
        })
    else:
        sys.stdout.write("\n")
        ttft = f"{t.ttft_ms:.1f}" if t.ttft_ms is not None else "-"
        tpot = f"{t.tpot_ms:.2f}" if t.tpot_ms is not None else "-"
        print(f"[{res.status}, stop={res.stop_type}] prompt {t.prompt_n} tok, generated {t.predicted_n} tok | "
              f"TTFT {ttft} ms, TPOT {tpot} ms, E2E {t.e2e_ms:.1f} ms (simulated device time)", file=sys.stderr)
        if res.error:
            print(f"error: {res.error.get('message')}", file=sys.stderr)
    return 0 if res.status == "finished" else 1
