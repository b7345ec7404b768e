"""Record every device step of one request for a Chrome trace (``calconsole trace``).

The recorder listens on the board's device thread (simulator-only), so this is a tool, not a
plane: a real backend's trace comes from its own profiler.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim_backend.model.trace import StepRecorder, steps_from_results, write_chrome_trace
from sim_backend.planes.types import ChatRequest, RequestResult


def capture_request_trace(system: Any, req: ChatRequest, out: str | Path) -> tuple[RequestResult, dict[str, Any]]:
    """Run ``req`` on an in-process ``system`` and write the Chrome trace of its steps to ``out``.

    Returns (result, summary); ``summary``: ``steps`` {prefill, decode} counts,
    ``op_events_per_chip``, ``simulated_span_us`` (simulated device µs). The trace is written only
    when the request finished. Raises the typed request errors of ``submit``.
    """
    rec = StepRecorder()
    system.board.add_listener(rec)
    res = system.engine.generate(req, timeout=max(60.0, system.engine.step_timeout_s))
    # the listener runs on the device thread just after each job is marked done
    steps = rec.wait_for(system.board.counters().finished, timeout=5.0)
    chip_events = [sum(len(r.cost.graph.ops_on_chip(c)) for r in steps) for c in range(system.bundle.shape.n_chips)]
    span_us = (steps[-1].sim_end_us - steps[0].sim_start_us) if steps else 0.0
    if res.status == "finished":
        write_chrome_trace(out, steps_from_results(steps))
    return res, {"steps": {"prefill": sum(r.kind == "prefill" for r in steps),
                           "decode": sum(r.kind == "decode" for r in steps)},
                 "n_steps": len(steps), "op_events_per_chip": chip_events, "simulated_span_us": span_us}
