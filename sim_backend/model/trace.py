"""Chrome Trace Event Format export of simulated steps (open in Perfetto / chrome://tracing).

Layout: one process (``pid`` 0, the simulated device); one track (``tid``)
per chip showing that chip's profile rows (facts.md F3: decode 1254 / 1253 per
step); a ``CCU barriers`` track for the per-layer syncs that no chip profiles
(see :mod:`sim_backend.model.opgraph`); a ``host PCIe`` track with each step's H2D
and D2H; a ``steps`` track with one event per step.  All ``ts``/``dur`` are
SIMULATED device microseconds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sim_backend.model.stepcost import StepCost

DEVICE_PID = 0


def _meta(name: str, tid: int | None, value: str, sort: int | None = None) -> list[dict[str, Any]]:
    ev: dict[str, Any] = {"ph": "M", "pid": DEVICE_PID, "name": name, "args": {"name": value}}
    if tid is not None:
        ev["tid"] = tid
    out = [ev]
    if sort is not None and tid is not None:
        out.append({"ph": "M", "pid": DEVICE_PID, "tid": tid, "name": "thread_sort_index",
                    "args": {"sort_index": sort}})
    return out


def chrome_trace(steps: Sequence[tuple[str, StepCost, float]]) -> dict[str, Any]:
    """Build a Chrome trace from ``(label, cost, start_us)`` tuples.

    ``start_us`` is the step's start on the simulated clock (µs).  Returns
    ``{"traceEvents": [...], "displayTimeUnit": "ms"}``; op events are complete
    events (``"ph": "X"``) named ``"<category> L<layer>"`` (``"<category> global"``
    for ops outside the layers) with ``args`` ``{layer, role, chip, step}``.
    """
    if not steps:
        n_chips = 2
    else:
        n_chips = steps[0][1].op_start_us.shape[0]
    tid_ccu, tid_pcie, tid_steps = n_chips, n_chips + 1, n_chips + 2
    events: list[dict[str, Any]] = []
    events += _meta("process_name", None, "calculet0 (simulated NPU)")
    for c in range(n_chips):
        events += _meta("thread_name", c, f"chip{c}", c)
    events += _meta("thread_name", tid_ccu, "CCU barriers (chip-to-chip sync)", tid_ccu)
    events += _meta("thread_name", tid_pcie, "host PCIe (H2D / D2H)", tid_pcie)
    events += _meta("thread_name", tid_steps, "steps", tid_steps)

    for label, cost, start in steps:
        graph = cost.graph
        if graph is None:
            raise ValueError("StepCost has no graph; price it with CostModel.price_step")
        t0 = float(start) + cost.h2d_us
        events.append({"ph": "X", "pid": DEVICE_PID, "tid": tid_steps, "name": label, "cat": "step",
                       "ts": float(start), "dur": cost.total_us,
                       "args": {"kind": cost.kind, "n_tokens": cost.n_tokens, "past_len": cost.past_len,
                                "simulated": True}})
        events.append({"ph": "X", "pid": DEVICE_PID, "tid": tid_pcie, "name": "H2D", "cat": "pcie",
                       "ts": float(start), "dur": cost.h2d_us, "args": {"step": label}})
        events.append({"ph": "X", "pid": DEVICE_PID, "tid": tid_pcie, "name": "D2H logits", "cat": "pcie",
                       "ts": t0 + cost.infer_us, "dur": cost.d2h_us, "args": {"step": label}})
        starts = cost.op_start_us
        durs = cost.op_us
        for op in graph.ops:
            where = f"L{op.layer}" if op.layer >= 0 else "global"
            name = f"{op.category} {where}"
            dur = float(durs[op.index])
            if op.profile_chips:
                for c in op.profile_chips:
                    c_dur = dur * (cost.chip_scale[c] if cost.chip_scale else 1.0)  # a slow chip's own time
                    events.append({"ph": "X", "pid": DEVICE_PID, "tid": c, "name": name,
                                   "cat": op.category, "ts": t0 + float(starts[c, op.index]), "dur": c_dur,
                                   "args": {"layer": op.layer, "role": op.role, "chip": c, "step": label}})
            else:
                c = op.chips[0]
                ts = starts[c, op.index]
                events.append({"ph": "X", "pid": DEVICE_PID, "tid": tid_ccu, "name": name,
                               "cat": op.category, "ts": t0 + float(0.0 if np.isnan(ts) else ts),
                               "dur": dur,
                               "args": {"layer": op.layer, "role": op.role, "chip": list(op.chips),
                                        "step": label}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"time": "simulated device microseconds"}}


def write_chrome_trace(path: str | Path, steps: Sequence[tuple[str, StepCost, float]]) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path``; returns the path."""
    p = Path(path)
    p.write_text(json.dumps(chrome_trace(steps)), encoding="utf-8")
    return p


class StepRecorder:
    """Collects every finished step of a board: ``board.add_listener(recorder)``.

    The board calls it on the device thread after the job is marked done, so a
    caller that just saw a request finish must :meth:`wait_for` the last steps.
    ``steps`` holds the ``StepResult`` objects in completion order.
    """

    def __init__(self) -> None:
        self.steps: list[Any] = []
        self._cv = threading.Condition()

    def __call__(self, res: Any) -> None:
        with self._cv:
            self.steps.append(res)
            self._cv.notify_all()

    def wait_for(self, n: int, timeout: float = 5.0) -> list[Any]:
        """Block up to ``timeout`` host seconds until ``n`` steps were recorded; returns a copy.

        Raises TimeoutError if fewer arrived.
        """
        deadline = time.monotonic() + timeout
        with self._cv:
            while len(self.steps) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.steps)} of {n} steps recorded after {timeout:.1f} s")
                self._cv.wait(left)
            return list(self.steps)


def steps_from_results(results: Sequence[Any]) -> list[tuple[str, StepCost, float]]:
    """``(label, cost, start_us)`` for :func:`chrome_trace` from device ``StepResult`` s.

    Labels: ``"prefill #i (n tok, past p)"`` / ``"decode #i (ctx c)"``, numbered
    per kind from 0; ``start_us`` is the step's start on the simulated clock.
    """
    out = []
    count = {"prefill": 0, "decode": 0}
    for r in results:
        i = count[r.kind]
        count[r.kind] += 1
        if r.kind == "prefill":
            label = f"prefill #{i} ({r.n_tokens} tok, past {r.past_len})"
        else:
            label = f"decode #{i} (ctx {r.past_len})"
        out.append((label, r.cost, float(r.sim_start_us)))
    return out
