"""Refusals the serving face decides, into the audit log: off the event loop, and summarised for strangers.

A maintenance call refused before the plane sees it (a missing or wrong admin key, no or an old
lease, a wrong confirmation) is one audit record. Written on the event loop, each record's fsync
stalled every connection; and a caller without an admin key could grow the log without bound
(1,500 refused calls: +552 KB in 22 s). So:

- every write runs in a worker thread (``ServingFace.call``), never on the event loop;
- a caller *without a valid admin key* gets one full record for the first refusal of a window
  (``interval_s``, per peer address); the refusals after it in that window are only counted, and
  when the window ends one ``refused_unauthenticated`` summary record says how many there were,
  from which address, over which span and on which paths (``MAX_PATHS`` most frequent). At most
  two records per address and interval, whatever the rate. Windows are kept for at most
  ``max_peers`` addresses; refusals from more addresses than that share one window under
  ``OTHER_PEERS``.
- refusals of callers that hold an admin key are written one by one, as before (they are few,
  and the operator wants each).

Thread-safe: ``note_unauthenticated`` is called on the event loop, ``flush`` from worker threads.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

OTHER_PEERS = "(other addresses)"
MAX_PATHS = 8
SUMMARY_ACTION = "refused_unauthenticated"


@dataclass
class _Window:
    start_mono: float
    start_unix: float
    last_unix: float
    count: int = 0  # refusals after the first (the first has its own record)
    paths: Counter[str] = field(default_factory=Counter)


class RefusalSummary:
    """Windows of unauthenticated refusals per peer address (module docstring). Times: host seconds."""

    def __init__(self, interval_s: float = 60.0, max_peers: int = 1024) -> None:
        if not 1.0 <= interval_s <= 86400.0 or max_peers < 1:
            raise ValueError(f"refusal summary: interval_s in [1, 86400] and max_peers >= 1, got {interval_s}, "
                             f"{max_peers}")
        self.interval_s = interval_s
        self.max_peers = max_peers
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._closed: list[tuple[str, _Window]] = []  # ended windows with counts, their summary not yet written
        self.counted = 0  # refusals counted into a summary instead of written (read by tests)

    def note_unauthenticated(self, peer: str, path: str) -> bool:
        """Count one refusal of ``peer``; True when it opens a window (write it in full), else False."""
        now_m, now_u = time.monotonic(), time.time()
        with self._lock:
            if peer not in self._windows and len(self._windows) >= self.max_peers:
                peer = OTHER_PEERS
            w = self._windows.get(peer)
            if w is None or now_m - w.start_mono >= self.interval_s:
                if w is not None and w.count:
                    self._closed.append((peer, w))
                self._windows[peer] = _Window(now_m, now_u, now_u)
                return True
            w.count += 1
            w.last_unix = now_u
            if len(w.paths) < 4 * MAX_PATHS or path in w.paths:  # a bounded tally of paths
                w.paths[path] += 1
            self.counted += 1
            return False

    def due(self, force: bool = False) -> list[tuple[str, _Window]]:
        """Remove and return the windows that ended (all with ``force``) and counted something."""
        now = time.monotonic()
        with self._lock:
            out, self._closed = self._closed, []
            for peer, w in list(self._windows.items()):
                if force or now - w.start_mono >= self.interval_s:
                    del self._windows[peer]
                    if w.count:
                        out.append((peer, w))
        return out

    def pending(self) -> bool:
        """True if some window has ended (cheap: the reaper asks twice a second)."""
        now = time.monotonic()
        with self._lock:
            return bool(self._closed) or any(now - w.start_mono >= self.interval_s for w in self._windows.values())

    def flush(self, audit: Any, force: bool = False) -> int:
        """Write one summary record per ended window (blocking: call in a worker thread); the count written."""
        from sim_backend.planes import audit_origin

        n = 0
        for peer, w in self.due(force):
            args = {"remote": peer, "count": w.count, "interval_s": self.interval_s,
                    "from_unix_s": round(w.start_unix, 3), "to_unix_s": round(w.last_unix, 3),
                    "paths": dict(w.paths.most_common(MAX_PATHS))}
            span = w.last_unix - w.start_unix
            with audit_origin({"remote": peer, "key": "(none)", "via": "http"}):
                audit.event(SUMMARY_ACTION, args, granted=False, ok=False, duration_ms=0.0,
                            result=f"{w.count} more calls without a valid admin key refused from {peer} in "
                                   f"{span:.0f} s (the first of the window has its own record)")
            n += 1
        return n
