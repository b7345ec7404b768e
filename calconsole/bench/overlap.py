"""``calconsole bench overlap``: serial vs ping/pong overlapped serving, measured in one run.

Runs the same N concurrent requests twice on fresh systems: serial
(``max_inflight=1``, infer() + Wait() per step, as production does)
and overlapped (``max_inflight=2``: a second job is submitted before the
first is waited, so one request's host work — sampling, detokenising, KV
bookkeeping — overlaps another request's device step; the runtime's ping/pong
+ parallel mode). Reports requests/s and tokens/s on the SIMULATED device
clock and in measured HOST WALL time.

What overlap can give, and why it is small here: the device is serial (one
step at a time, ``device.py``: a job starts at ``max(submitted, device
free)``), so overlap only hides the host work between steps. The engine
books that host work on the simulated clock (``SimClock.host_span``); the
simulated gain is therefore bounded by ``serial / (serial - host work)``,
printed as ``bound``; with short prompts the prefills (~150 ms simulated
each, nothing to overlap them with when all requests arrive together) and
~17 ms decode steps dwarf ~0.5 ms of host work per step. In wall time the gain is larger because the
simulator's own numerics (the "device", on the device thread) also overlap
the host thread's work; that is a property of the simulator, not the NPU.
"""

from __future__ import annotations

import argparse
import sys

from sim_backend.planes import CalError
from sim_backend.tools.overlap import CLOCK_NOTE, measure_overlap, run_mode  # noqa: F401 (re-exported for tests)

from ..commands.common import fail, print_json
from . import BenchParsers


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser("overlap", help="serial vs ping/pong overlapped serving: requests/s, tokens/s",
                        description=__doc__.replace("``", "").split("\n\n")[1] + " " + CLOCK_NOTE + ".",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=4, help="concurrent requests (default 4)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--prompt-words", type=int, default=24, help="words per prompt (default 24, short)")
    p.add_argument("--timing-only", action="store_true",
                   help="skip the numerics (faster; tokens from a seeded generator)")
    p.add_argument("--bundle", metavar="NAME|DIR", default=None,
                   help="calbin bundle: an installed bundle's name or a directory (default: built-in)")
    p.add_argument("--json", action="store_true", help='print {"serial": {...}, "overlapped": {...}, "gain": {...}}')
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.requests <= 32:
        return fail(f"--requests must be in 1..32, got {args.requests}")
    if not 1 <= args.max_tokens <= 4096:
        return fail(f"--max-tokens must be in 1..4096, got {args.max_tokens}")
    if not 1 <= args.prompt_words <= 2000:
        return fail(f"--prompt-words must be in 1..2000, got {args.prompt_words}")
    try:
        rep = measure_overlap(n_requests=args.requests, max_tokens=args.max_tokens, numerics=not args.timing_only,
                              bundle=args.bundle, prompt_words=args.prompt_words)
    except (CalError, ValueError) as e:
        return fail(str(e))
    if args.json:
        print_json(rep)
        return 0
    out = sys.stdout
    out.write(f"{args.requests} concurrent requests x {args.max_tokens} tokens, "
              f"{'numeric' if rep['numerics'] else 'timing-only'} mode, fast pacing\n")
    out.write(f"{'':12}{'req/s (sim)':>13}{'tok/s (sim)':>13}{'req/s (wall)':>14}{'tok/s (wall)':>14}"
              f"{'step dev ms':>13}{'step host ms':>14}\n")
    for name in ("serial", "overlapped"):
        m = rep[name]
        out.write(f"{name:12}{m['requests_per_s']:13.3f}{m['tokens_per_s']:13.2f}{m['wall_requests_per_s']:14.3f}"
                  f"{m['wall_tokens_per_s']:14.2f}{m['decode_step_device_ms'] or 0:13.3f}"
                  f"{m['decode_step_host_ms'] or 0:14.3f}\n")
    g = rep["gain"]
    out.write(f"gain (overlapped / serial): {g['tokens_per_s']:.3f}x simulated, {g['wall_tokens_per_s']:.3f}x wall; "
              f"simulated ceiling if all host work were hidden = {rep['bound']:.3f}x\n")
    out.write(f"same tokens both ways: {rep['same_tokens']}\n")
    out.write(f"({CLOCK_NOTE})\n")
    return 0
