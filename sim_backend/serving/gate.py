"""The maintenance plane's hold on the engine's admission: stop it, drain what is in flight, resume.

``pause`` makes every new request (and every slot action) fail with ``UnavailableError(reason)``;
``drain`` waits a bounded time for the queued and running requests to end and cancels the rest;
``resume`` admits again. The engine's lock guards the admission state these change.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from sim_backend.runtime import ClockView
from sim_backend.serving.admission import Admission
from sim_backend.serving.requests import RequestRecord


class AdmissionGate:
    """Pause, drain and resume one engine's admission. Thread-safe.

    Args:
        admission: the engine's admission (its queue and its admitting flag).
        running: the requests in the slots now (called with the engine's lock held).
        lock / wake: the engine's lock and its condition (notified whenever a request ends).
        clock: the simulated clock (the drain's ``sim_ms``).
        step_timeout_s: bound on one device step (host wall s): a cancel takes effect within one.
    """

    def __init__(self, admission: Admission, running: Callable[[], list[RequestRecord]], *,
                 lock: threading.Lock, wake: threading.Condition, clock: ClockView, step_timeout_s: float) -> None:
        self._admission = admission
        self._running = running
        self._lock = lock
        self._wake = wake
        self._clock = clock
        self.step_timeout_s = step_timeout_s

    def pause(self, reason: str) -> None:
        """Refuse new requests with UnavailableError(reason) until ``resume``."""
        with self._lock:
            self._admission.admitting = False
            self._admission.refuse_reason = reason

    def resume(self) -> None:
        """Admit requests again."""
        with self._lock:
            self._admission.admitting = True
            self._admission.refuse_reason = ""

    @property
    def admitting(self) -> bool:
        """New requests are admitted (not paused)."""
        with self._lock:
            return self._admission.admitting

    def drain(self, timeout_s: float, reason: str) -> dict[str, float]:
        """Wait up to ``timeout_s`` host seconds for in-flight requests to end, then cancel the rest with ``reason``.

        Returns {"drained": n ended on their own, "cancelled": n cancelled, "wall_ms", "sim_ms"}.
        Admission should be paused first. Bounded: never waits past timeout + one device step.
        """
        t0 = time.perf_counter()
        sim0 = self._clock.now_us
        with self._lock:
            initial = {r.id: r for r in self._admission.queue} | {r.id: r for r in self._running()}
            deadline = t0 + timeout_s
            while (self._admission.queue or self._running()) and time.perf_counter() < deadline:
                self._wake.wait(min(0.05, max(0.0, deadline - time.perf_counter())))
            remaining = [r for r in initial.values() if not r.ended]
        for r in remaining:
            r.handle.cancel(reason)
        # cancels take effect within one device step; wait for them (bounded)
        end = time.perf_counter() + self.step_timeout_s
        for r in remaining:
            r.handle._done.wait(max(0.0, end - time.perf_counter()))
        return {"drained": len(initial) - len(remaining), "cancelled": len(remaining),
                "wall_ms": (time.perf_counter() - t0) * 1e3, "sim_ms": (self._clock.now_us - sim0) / 1e3}


__all__ = ["AdmissionGate"]
