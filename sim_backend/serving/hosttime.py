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
