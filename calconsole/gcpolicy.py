"""Garbage collection in the console's process: no full collection walks what lives long.

CPython 3.11 collects in three generations; a full (generation 2) collection walks every
tracked object that is not frozen, on the UI thread if that is where it triggers. Besides
the start-up objects (tokenizer ranks, CSS, widgets: frozen at mount), the console keeps
alive what its replies leave behind: the transcript's lines (Textual ``Strip`` s, their
segments and per-strip caches), the widgets' render caches, the engine's step history.
After one 3000-token reply that is about 55,000 objects, and the collector's own full
collections took 11-32 ms of the UI thread every few seconds while the reply streamed
(``calconsole bench realtime --ui``, 2 cores under load).

:class:`GCPolicy` (``start`` at mount, ``stop`` at unmount):

- at start: collect, then ``gc.freeze()``;
- after every full collection the collector runs on its own, freeze what survived it, so
  the next full collection walks only what was promoted since (the collector's own rule
  then lets a quarter of the last survivors accumulate first);
- frozen objects are still freed by reference counting; only garbage in reference cycles
  among them waits. :meth:`GCPolicy.idle` (called by the app when nobody types and the
  device is idle) unfreezes, collects everything and freezes again, at most every
  ``DEEP_EVERY_S`` and only after something was frozen since, so such cycles are returned
  without a pause while anyone types or a reply streams.
"""

from __future__ import annotations

import gc
import time
from typing import Any

#: least wall seconds between two deep (unfreeze + full) collections at idle
DEEP_EVERY_S = 300.0


class GCPolicy:
    """Freezes what survives full collections; returns frozen cycles when the console is idle.

    Attributes (for benchmarks and tests): ``refreezes`` (full collections followed by a
    freeze), ``deep_collections`` and ``deep_ms`` (host wall ms of each deep collection).
    """

    def __init__(self, deep_every_s: float = DEEP_EVERY_S) -> None:
        self.deep_every_s = deep_every_s
        self.refreezes = 0
        self.deep_collections = 0
        self.deep_ms: list[float] = []
        self._active = False
        self._deep_running = False
        self._frozen_since_deep = False
        self._last_deep = time.monotonic()

    def start(self) -> None:
        """Collect, freeze, and freeze again after every later full collection."""
        gc.collect()
        gc.freeze()
        if not self._active:
            gc.callbacks.append(self._on_gc)
            self._active = True

    def stop(self) -> None:
        """Stop refreezing and unfreeze everything (collectable again once the console is gone)."""
        if self._active:
            gc.callbacks.remove(self._on_gc)
            self._active = False
        gc.unfreeze()

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # "stop" of a full collection: the young generations are empty, generation 2 holds the
        # survivors; freezing them is a list splice (no walk), done before the program resumes
        if phase == "stop" and info.get("generation") == 2 and not self._deep_running:
            gc.freeze()
            self.refreezes += 1
            self._frozen_since_deep = True

    def idle(self) -> bool:
        """Called when the console is idle: returns True if it ran a deep collection now.

        Runs one (unfreeze, collect, freeze) when something was frozen by a full collection since
        the last one and ``deep_every_s`` have passed; a few tens of ms of the UI thread, at idle.
        """
        now = time.monotonic()
        if not (self._active and self._frozen_since_deep and now - self._last_deep >= self.deep_every_s):
            return False
        t0 = time.perf_counter()
        self._deep_running = True
        try:
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        finally:
            self._deep_running = False
        self.deep_ms.append((time.perf_counter() - t0) * 1e3)
        self.deep_collections += 1
        self._frozen_since_deep = False
        self._last_deep = time.monotonic()
        return True
