"""Pooled buffer pairs: built once per session and reused every step (facts.md F5 C1)."""

from __future__ import annotations

import threading
import time

from sim_backend.errors import SubmitError
from sim_backend.runtime.calbin import Calbin, InputBuf, OutputBuf

# --- buffer pool -------------------------------------------------------------------


class BufferPair:
    """One request's InputBuf + OutputBuf, owned by the pool."""

    def __init__(self, calbin: Calbin, index: int) -> None:
        self.index = index
        self.inp = InputBuf(calbin)
        self.out = OutputBuf(calbin)


class BufferPool:
    """Fixed set of buffer pairs built once (facts.md F6 P1: production rebuilt them on every call).

    Args:
        calbin: the configured calbin.
        size: pairs (one per job that may be in flight; 2 for ping/pong).
    """

    def __init__(self, calbin: Calbin, size: int = 2) -> None:
        if not 1 <= size <= 16:
            raise ValueError(f"pool size must be in 1..16, got {size}")
        self.size = size
        self._pairs = [BufferPair(calbin, i) for i in range(size)]
        self._free = list(self._pairs)
        self._cond = threading.Condition()
        self.constructed = 2 * size  # InputBuf + OutputBuf built, ever

    def acquire(self, timeout: float = 0.0) -> BufferPair:
        """Take a free pair, waiting at most ``timeout`` host seconds. SubmitError if none frees up."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            for p in self._pairs:  # reclaim discarded pairs whose job has ended since
                if p.out._discarded and p.out._job is not None and p.out._job.done:
                    p.out._end()
            with self._cond:
                if self._free:
                    return self._free.pop()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SubmitError(f"all {self.size} buffer pairs in use")
                # a discarded job's end notifies nobody: look again every 10 ms (bounded by the deadline)
                self._cond.wait(min(left, 0.01))

    def release(self, pair: BufferPair) -> None:
        """Return a pair. SubmitError if its job is still in flight or it is not this pool's."""
        if pair not in self._pairs:
            raise SubmitError("buffer pair does not belong to this pool")
        if pair.out._job is not None and not pair.out._job.done:
            raise SubmitError(f"buffer pair {pair.index} still in use by job {pair.out._job.id}")
        with self._cond:
            if pair not in self._free:
                self._free.append(pair)
                self._cond.notify()

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def wait_all_free(self, timeout: float) -> int:
        """Wait up to ``timeout`` host seconds for every pair to be back; returns the free count then.

        Reclaims discarded pairs whose job has ended, like ``acquire``. Never raises.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            for p in self._pairs:
                if p.out._discarded and p.out._job is not None and p.out._job.done:
                    p.out._end()
            with self._cond:
                left = deadline - time.monotonic()
                if len(self._free) == self.size or left <= 0:
                    return len(self._free)
                # release() notifies; a discarded job's end does not: look again every 10 ms
                self._cond.wait(min(left, 0.01))
