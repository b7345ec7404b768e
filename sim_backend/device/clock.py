"""The simulated clock and pacing: how simulated device time (µs) maps to host wall time.

``SimClock`` advances only by the cost model's step prices; ``Pacing`` says whether the device
thread sleeps so that simulated time is also wall time (real time, scaled by ``speed``) or runs
as fast as possible (benchmarks, tests).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum

import numpy as np


class PacingMode(str, Enum):
    """How simulated device time maps to wall time."""

    REALTIME = "realtime"  # a 17 ms simulated step takes 17 ms of wall time (x 1/speed)
    FAST = "fast"  # as fast as the host can compute (benchmarks, headless)


@dataclass(frozen=True)
class Pacing:
    """Pacing setting: ``mode`` and ``speed`` (simulated seconds per wall second in real time).

    ``speed`` must be a real number in [MIN_SPEED, MAX_SPEED] (ValueError otherwise). The
    bounds keep the device thread's pacing sleep finite and far below ``threading.TIMEOUT_MAX``
    for the longest step (a 2048-token prefill at 40k context, ~3.7 s sim, x1000 slow chip:
    ~3.7e7 s wall at the minimum), so no accepted speed can kill the thread. The CLI allows
    a narrower range (0.1 to 1000), where every unfaulted step fits the engine's step timeout.
    """

    mode: PacingMode = PacingMode.FAST
    speed: float = 1.0
    MIN_SPEED = 1e-4
    MAX_SPEED = 1e6

    def __post_init__(self) -> None:
        s = self.speed
        if isinstance(s, bool) or not isinstance(s, (int, float, np.integer, np.floating)) \
                or not self.MIN_SPEED <= s <= self.MAX_SPEED:
            raise ValueError(f"pacing speed must be a number in [{self.MIN_SPEED:g}, {self.MAX_SPEED:g}] "
                             f"simulated s per wall s, got {s!r}")


class SimClock:
    """The simulated device clock, in microseconds since power-on of the simulator.

    It only moves forward: device steps move it to their end time, host
    work measured by the engine moves it by the host wall time (so TTFT
    includes host work). Concurrent host and device work overlap: each
    advances the clock to ``max(now, its end)``.
    """

    def __init__(self) -> None:
        self._now = 0.0
        self._lock = threading.Lock()

    @property
    def now_us(self) -> float:
        with self._lock:
            return self._now

    def advance_to(self, t_us: float) -> float:
        with self._lock:
            if t_us > self._now:
                self._now = t_us
            return self._now

    def host_span(self, start_us: float, dt_us: float) -> float:
        """Account host work of ``dt_us`` that started at simulated ``start_us``; returns its end."""
        end = start_us + max(0.0, dt_us)
        self.advance_to(end)
        return end
