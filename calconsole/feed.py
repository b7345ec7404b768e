"""``SnapshotFeed``: one sampler thread that hands typed snapshots to a console, in-process or attached.

The feed calls ``observation.snapshot()`` every ``1 / rate_hz()`` host wall seconds on its own thread
(nvitop-style: one long-lived thread, cheaper than a worker per refresh) and passes each ``Snapshot``
to ``on_snapshot``. With remote planes (``system.connection``) a failed sample is a link state:
``on_link(since)`` with the host wall unix s the server stopped answering, and ``on_link(None)`` once
it answers again; the panes keep the last snapshot meanwhile. Every wait is bounded by the period.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from sim_backend.planes.snapshot import Snapshot

log = logging.getLogger(__name__)


class SnapshotFeed:
    """Sample ``system.observation`` on a thread; callbacks run on that thread (post to the UI from them).

    ``rate_hz``: read before each wait, so a changed refresh rate applies at the next sample.
    ``start()`` once; ``stop()`` ends the thread at once, or after the sample in flight (a daemon either
    way). ``poke()`` takes the next sample now (a state change the caller made), not a period later.
    """

    def __init__(self, system: Any, rate_hz: Callable[[], float], on_snapshot: Callable[[Snapshot], object],
                 on_link: Callable[[float | None], object] | None = None) -> None:
        self.system = system
        self.rate_hz = rate_hz
        self.on_snapshot = on_snapshot
        self.on_link = on_link
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by poke() and stop(): the wait between samples ends early
        self._thread: threading.Thread | None = None
        self._down = False  # the link was reported lost and not yet back

    def start(self) -> None:
        """Start sampling (the first sample is taken at once)."""
        if self._thread is not None:
            raise RuntimeError("SnapshotFeed already started")
        self._thread = threading.Thread(target=self._run, name="calconsole-snapshots", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop sampling; waits at most ``timeout_s`` for the thread (a sample in flight finishes first)."""
        self._stop.set()
        self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout_s)

    def poke(self) -> None:
        """Sample now (from any thread): the wait for the next period ends; a poke during a sample takes
        another one after it, so the state the caller changed is always in a sample taken after the poke."""
        self._wake.set()

    def sample_once(self) -> Snapshot | None:
        """Take one sample and hand it on; None when it failed (the link is down, or logged)."""
        conn = getattr(self.system, "connection", None)  # remote planes only
        try:
            snap: Snapshot = self.system.observation.snapshot()
        except Exception:  # noqa: BLE001 - a failed sample is skipped, the next one retries
            if conn is not None and not conn.connected:
                # the planes retry with back-off; the console says since when
                self._down = True
                if self.on_link is not None:
                    self.on_link(conn.disconnected_since)
            else:
                log.exception("snapshot failed")
            return None
        if self._down:
            self._down = False
            if self.on_link is not None:
                self.on_link(None)
        self.on_snapshot(snap)
        return snap

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the sample: a poke from here on is answered by this one or the next
            self.sample_once()
            self._wake.wait(1.0 / max(0.01, self.rate_hz()))
