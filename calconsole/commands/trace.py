"""``calconsole trace --out FILE [PROMPT]``: one request as a Chrome trace (Perfetto / chrome://tracing).

Every step of the request (its prefill chunk(s) and every decode) is recorded
from the board (``board.add_listener``) and written with
:func:`sim_backend.model.trace.chrome_trace`: one track per chip with one event per
profiled op, named ``"<category> L<layer>"`` (``"<category> global"`` outside
the layers), plus a CCU-barrier track, a host PCIe track and a steps track.
``ts`` / ``dur`` are SIMULATED device microseconds on the board clock, so the
gaps between steps are the engine's measured host work.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from sim_backend.planes import CalError, RequestError

from .common import Subparsers, add_common_options, build_from_args, fail, prepare_output_file, print_json, read_prompt

DEFAULT_PROMPT = "Explain in two sentences how an NPU serves a large language model."


MAX_TRACE_TOKENS = 64

def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "trace", help="run one request and write a Chrome trace JSON of every step",
        description="Run one request (fast pacing by default) and write a Chrome trace (Trace Event Format "
                    "JSON, opens in Perfetto or chrome://tracing): one track per chip with one event per op, "
                    "named by category and layer, over every step of the request (prefill and decodes). "
                    "Times are simulated device microseconds.")
    p.add_argument("prompt", nargs="?", default=None,
                   help=f"user message ('-' reads stdin; default: {DEFAULT_PROMPT!r})")
    p.add_argument("--out", required=True, metavar="FILE", help="trace file to write (JSON)")
    p.add_argument("--max-tokens", type=int, default=8,
                   help=f"tokens to generate (default 8, at most {MAX_TRACE_TOKENS})")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of text")
    add_common_options(p, default_pacing="fast")
    p.set_defaults(func=run)


def _drop_empty(out: Path, created: bool) -> None:
    """Remove the file ``prepare_output_file`` created if nothing was written to it."""
    try:
        if created and out.stat().st_size == 0:
            out.unlink()
    except OSError:
        pass


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import ChatRequest, SamplingParams
    from sim_backend.tools.trace_capture import capture_request_trace

    if not 1 <= args.max_tokens <= MAX_TRACE_TOKENS:
        # one event per op per chip: ~2,500 events (~0.5 MB of JSON) per decode step
        return fail(f"--max-tokens must be in 1..{MAX_TRACE_TOKENS} (each step adds ~2,500 trace events), "
                    f"got {args.max_tokens}")
    try:
        prompt = DEFAULT_PROMPT if args.prompt is None else read_prompt(args.prompt)
    except ValueError as e:
        return fail(str(e))
    out = Path(args.out)
    req = ChatRequest.from_prompt(prompt, max_tokens=args.max_tokens, sampling=SamplingParams(seed=args.seed),
                                  client="cli-trace")
    try:
        # checked (and created) before anything runs, not found unwritable after the request
        created = prepare_output_file(args.out, "--out")
    except ValueError as e:
        return fail(str(e))
    try:
        system = build_from_args(args, maintenance=False)
    except (CalError, ValueError) as e:
        _drop_empty(out, created)
        return fail(str(e))
    with system:
        try:
            res, cap = capture_request_trace(system, req, out)
        except RequestError as e:
            _drop_empty(out, created)
            return fail(f"{e.error_type}: {e}")
        except OSError as e:  # the write itself failed (disk full): the run is lost, say so in one line
            _drop_empty(out, created)
            return fail(f"cannot write --out {out}: {e.strerror or e}", code=1)
    if res.status != "finished":
        _drop_empty(out, created)
        return fail(f"request ended {res.status}: {(res.error or {}).get('message', '')}", code=1)
    chip_events, span_us, n_steps = cap["op_events_per_chip"], cap["simulated_span_us"], cap["n_steps"]
    summary = {
        "out": str(out), "prompt_n": res.timings.prompt_n, "predicted_n": res.timings.predicted_n,
        "steps": cap["steps"],
        "op_events_per_chip": chip_events, "numerics": res.timings.numerics,
        "simulated_span_us": span_us, "e2e_ms": res.timings.e2e_ms,
        "time_unit": "simulated device us",
    }
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {out}: {n_steps} steps ({summary['steps']['prefill']} prefill, "
              f"{summary['steps']['decode']} decode), op events per chip {chip_events}, "
              f"{span_us / 1e3:.1f} ms simulated (prompt {res.timings.prompt_n} tok, "
              f"{res.timings.predicted_n} generated); open in https://ui.perfetto.dev or chrome://tracing")
    return 0
