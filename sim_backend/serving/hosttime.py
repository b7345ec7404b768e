"""How the serving layer measures its own host work (tokenise, KV apply, sampling, detokenise).

``HostTimer`` reads this thread's CPU time (waiting for the GIL behind the console's UI is not host
work); ``ScriptedHostTimer`` makes host work deterministic for tests. Units: µs.
"""

from __future__ import annotations

import threading
import time


class HostTimer:
    """Measures host work in microseconds of this thread's CPU time. Tests inject a scripted one.

    CPU time, not wall time: in the console the engine thread shares one
    interpreter (one GIL) with the UI, and waiting for the GIL is not host
    work the real serving host would do; a wall clock would book the
    console's own rendering onto TTFT/TPOT.
    """

    def now(self) -> float:
        return time.thread_time() * 1e6


class ScriptedHostTimer(HostTimer):
    """Deterministic host clock: every ``now()`` call advances by ``step_us`` (0 = host work is free)."""

    def __init__(self, step_us: float = 0.0) -> None:
        self._t = 0.0
        self.step_us = step_us
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            self._t += self.step_us
            return self._t


#: how host work reaches the simulated clock (``Engine(host_time=...)``)
HOST_TIME_MODES: tuple[str, ...] = ("modeled", "measured")


class HostBooking:
    """What host work the engine puts on the SIMULATED clock, and how much.

    The simulator stands in for the real device and its serving host. Two modes:

    - ``"modeled"`` (default): each sampled token books ``per_token_us`` of host work, the
      real serving host's allowance fitted to facts.md F7 (``host_overhead_ms_per_token`` in the
      hardware YAML, 0.204 ms: the E2E of 4.41 s minus the device time of the 27-token prefill
      and 245 decode steps, over 246 tokens); tokenising, KV applies and submission book 0 (the
      allowance covers the host's work per token). Simulated timings then do not depend on
      this machine and are deterministic, and both modes of the numerics reproduce F7.
    - ``"measured"``: this machine's own host work (``HostTimer``, thread CPU µs) is booked as
      measured. Honest about this host, which is not the real one: sampling 151,936 real
      logits in Python costs 0.7-1 ms here, so decode reads ~4 % under F7 in numeric mode.

    Either way the measured parts are kept (``Timings.host_ms``, the stage table); what went on
    the clock is ``Timings.host_booked_ms``. Units: µs in, µs out.

    Raises:
        ValueError: an unknown mode, or a negative or non-finite ``per_token_us``.
    """

    def __init__(self, mode: str = "modeled", per_token_us: float = 0.0) -> None:
        if mode not in HOST_TIME_MODES:
            raise ValueError(f"host time must be one of {', '.join(HOST_TIME_MODES)}, not {mode!r}")
        if not (per_token_us >= 0.0 and per_token_us < float("inf")):
            raise ValueError(f"per_token_us must be finite and >= 0, got {per_token_us!r}")
        self.mode = mode
        self.per_token_us = float(per_token_us)

    @property
    def measured(self) -> bool:
        return self.mode == "measured"

    def before(self, measured_us: float) -> float:
        """Host µs to book for work before a device step (tokenise, KV apply, staging)."""
        return max(0.0, measured_us) if self.measured else 0.0

    def after(self, measured_us: float, tokens_sampled: int) -> float:
        """Host µs to book after a step that sampled ``tokens_sampled`` tokens (0 or 1)."""
        return max(0.0, measured_us) if self.measured else self.per_token_us * tokens_sampled

    def describe(self) -> str:
        """One line for a pane or a report."""
        if self.measured:
            return "host work measured on this machine"
        return f"host work modeled: {self.per_token_us / 1e3:.3f} ms per token (facts.md F7 fit)"
