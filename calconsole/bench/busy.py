"""CPU busy loops beside a benchmark, and a process's CPU use over a window (``bench keys``, ``bench realtime --ui``).

A busy loop is a child Python process spinning on ``while True: pass`` (one core's worth of demand, at the
bench's own nice value): the "one CPU busy loop beside the console" condition of the key-latency figures.
They are started by :class:`BusyLoops` and always stopped (terminated, then killed) when it exits, whatever
ends the bench.
"""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

#: Most busy loops a bench may start: more than a few only measures the host's scheduler.
MAX_BUSY_LOOPS = 8
_SPIN = "while True:\n    pass\n"


class BusyLoops:
    """``with BusyLoops(n) as loops:`` runs ``n`` busy child processes for the body (0: none).

    ``loops.pids`` are their process ids while running; after the block ``loops.cpu_s`` holds each one's
    CPU seconds (user + system, read just before it was stopped; None where unreadable) and ``loops.wall_s``
    the host wall seconds they ran. Raises ValueError for ``n`` outside 0..``MAX_BUSY_LOOPS``; OSError if a
    child cannot be started (any already started are stopped first).
    """

    def __init__(self, n: int) -> None:
        if not 0 <= n <= MAX_BUSY_LOOPS:
            raise ValueError(f"busy loops must be in 0..{MAX_BUSY_LOOPS}, got {n}")
        self.n = n
        self._procs: list[subprocess.Popen[bytes]] = []
        self.cpu_s: list[float | None] = []
        self.wall_s = 0.0
        self._t0 = 0.0

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def __enter__(self) -> BusyLoops:
        self._t0 = time.perf_counter()
        try:
            for _ in range(self.n):
                self._procs.append(subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        except OSError:
            self.stop()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every loop (idempotent): terminate, wait up to 2 s, then kill."""
        if not self._procs:
            return
        self.wall_s = time.perf_counter() - self._t0
        self.cpu_s = [_cpu_of(p.pid) for p in self._procs]
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(2.0)
        self._procs = []

    def summary(self) -> dict[str, Any]:
        """``{"n", "wall_s", "cpu_percent": [per loop, % of one core over its run, or None]}``."""
        pct = [None if c is None or self.wall_s <= 0 else round(100.0 * c / self.wall_s, 1) for c in self.cpu_s]
        return {"n": self.n, "wall_s": round(self.wall_s, 2), "cpu_percent": pct}


def _cpu_of(pid: int) -> float | None:
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except Exception:  # noqa: BLE001 - gone already, or unreadable: reported as unknown
        return None


@dataclass(frozen=True)
class CpuWindow:
    """This process's CPU use over a window: ``cpu_s`` (process CPU seconds, all threads, user + system)
    over ``wall_s`` host wall seconds; ``percent`` = % of one core (100 = one core busy all the time)."""

    cpu_s: float
    wall_s: float

    @property
    def percent(self) -> float:
        return 100.0 * self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"cpu_s": round(self.cpu_s, 4), "wall_s": round(self.wall_s, 3),
                "percent_of_a_core": round(self.percent, 2),
                "unit": "process CPU time (all threads) / host wall time of the window, % of one core"}


class CpuMeter:
    """Start with ``m = CpuMeter()``; ``m.window()`` is the :class:`CpuWindow` since then (``time.process_time``)."""

    def __init__(self) -> None:
        self._c0 = time.process_time()
        self._t0 = time.perf_counter()

    def window(self) -> CpuWindow:
        return CpuWindow(time.process_time() - self._c0, time.perf_counter() - self._t0)


class ChildrenCpuMeter:
    """CPU time of this process's child processes (recursive) but those in ``exclude`` (e.g. the busy
    loops' pids) since construction: the console's numerics worker, for a window of ``bench keys
    --numerics``. A child that ends in between counts what was read of it at the start (psutil)."""

    def __init__(self, exclude: list[int]) -> None:
        self._exclude = set(exclude)
        self._t0 = time.perf_counter()
        self._c0 = self._read()

    def _read(self) -> dict[int, float]:
        import psutil

        out: dict[int, float] = {}
        try:
            kids = psutil.Process().children(recursive=True)
        except psutil.Error:
            return out
        for k in kids:
            if k.pid in self._exclude:
                continue
            try:
                t = k.cpu_times()
            except psutil.Error:
                continue
            out[k.pid] = t.user + t.system
        return out

    def window(self) -> CpuWindow:
        now = self._read()
        cpu = sum(max(0.0, c - self._c0.get(pid, 0.0)) for pid, c in now.items() if pid in self._c0)
        return CpuWindow(cpu, time.perf_counter() - self._t0)
