"""llama-server's slot actions (``POST /slots/{id}?action=save|restore|erase``) over the engine's slots: the
in-process side of the planes' ``SlotActions`` contract.

An action reserves an idle slot (``Slot.action``: nothing assigns it or evicts its cells meanwhile),
works on that slot's KV sequence through the runtime's ``KVView`` and gives the slot back. The state
file a save writes is the KV view's (``KVView.save_seq_state``) with one metadata table: per cell the
prompt token it holds and whether it holds values (1) or not (0, a timing-only request's cells).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sim_backend.errors import InvalidRequestError, KVArgumentError, KVExhausted, KVStateFileError, UnavailableError
from sim_backend.runtime import RuntimeSession
from sim_backend.serving.admission import Admission
from sim_backend.serving.requests import Slot


class SlotActionRunner:
    """Save, restore and erase one idle slot's KV; thread-safe (each action holds the engine's lock while it
    reserves and gives back the slot, not while it reads or writes the file).

    Args:
        rt: the engine's runtime session (its KV view, vocabulary, simulated clock).
        slots: the engine's slots (the same list objects the scheduler sees).
        admission: the engine's admission (an action is refused while it is stopped).
        lock / wake: the engine's lock and its condition (a request waiting for a slot is woken when the
            slot is given back).
        stopped: whether the engine is closing.
        kv_timeout_s: bound on a restore's wait for free KV cells (host wall s).
    """

    def __init__(self, rt: RuntimeSession, slots: Sequence[Slot], admission: Admission, *, lock: threading.Lock,
                 wake: threading.Condition, stopped: Callable[[], bool], kv_timeout_s: float) -> None:
        self.rt = rt
        self.slots = slots
        self._admission = admission
        self._lock = lock
        self._wake = wake
        self._stopped = stopped
        self.kv_timeout_s = kv_timeout_s

    def _take(self, idx: Any, action: str) -> Slot:
        """Reserve slot ``idx`` for ``action`` (nothing assigns it or evicts its cells until ``_give_back``).
        InvalidRequestError for no such slot; UnavailableError while it serves a request or another action, or
        while admission is stopped (maintenance: a reset or KV clear must not meet a restore half way)."""
        n = len(self.slots)
        if isinstance(idx, bool) or not isinstance(idx, int) or not 0 <= idx < n:
            raise InvalidRequestError(f"Invalid slot ID: {idx!r} (slots 0..{n - 1})", param="id_slot")
        with self._lock:
            why = self._admission.refusal(self._stopped())
            if why is not None:
                raise UnavailableError(why)
            Admission.drop_stale_caches(self.slots, self.rt.kv.epoch)
            s = self.slots[idx]
            if s.req is not None or s.action is not None:
                what = f"request {s.req.id}" if s.req is not None else f"a slot {s.action}"
                raise UnavailableError(f"slot {idx} is busy ({what}); try again once it is idle")
            s.action = action
            return s

    def _give_back(self, s: Slot) -> None:
        with self._lock:
            s.action = None
            self._wake.notify_all()  # a request waiting for this slot (id_slot) may take it now

    def save(self, idx: int, path: str) -> dict[str, Any]:
        """Save idle slot ``idx``'s cached prefix to ``path`` (``KVView.save_seq_state``: its cells' positions,
        the prompt tokens they hold and whether they hold values, and the device's K/V rows when it computes
        them). Returns {"n_saved": tokens, "n_written": file bytes, "save_ms": host wall ms}.

        Raises InvalidRequestError (no such slot, the file cannot be written), UnavailableError (slot busy).
        """
        s = self._take(idx, "save")
        t0 = time.perf_counter()
        try:
            tokens = list(s.cache_tokens)
            cells, pos = self.rt.kv.seq_cells(s.seq_id)
            meta = np.full((2, int(self.rt.kv.n_cells)), -1, dtype=np.int64)  # token, holds values (1/0)
            held = pos < len(tokens)
            meta[0, cells[held]] = np.asarray(tokens, dtype=np.int64)[pos[held]]
            meta[1, cells] = 1 if s.cache_numeric else 0
            try:
                n = self.rt.kv.save_seq_state(s.seq_id, path, [(meta, 1)], values=self.rt.kv_values())
            except KVStateFileError as e:
                raise InvalidRequestError(f"Unable to save slot {idx}: {e.reason}") from None
            return {"n_saved": int(n), "n_written": os.path.getsize(path),
                    "save_ms": (time.perf_counter() - t0) * 1e3}
        finally:
            self._give_back(s)

    def restore(self, idx: int, path: str) -> dict[str, Any]:
        """Replace idle slot ``idx``'s KV with a state ``save`` wrote (all or nothing): its cells, the
        prompt tokens they hold (the slot's cached prefix: the next request sharing it reuses them, as its
        ``Timings.cache_n`` shows) and the K/V values. Returns {"n_restored", "n_read": file bytes,
        "restore_ms": host wall ms}.

        Raises InvalidRequestError ("Unable to restore slot": missing, damaged or foreign file, not
        enough free KV cells within the KV timeout), UnavailableError (slot busy).
        """
        s = self._take(idx, "restore")
        t0 = time.perf_counter()
        try:
            meta = np.full((2, int(self.rt.kv.n_cells)), -1, dtype=np.int64)
            try:
                n = self.rt.kv.load_seq_state(s.seq_id, path, [(meta, 1)], timeout=self.kv_timeout_s,
                                              values=self.rt.kv_values())
            except (KVArgumentError, KVExhausted) as e:
                reason = getattr(e, "reason", None) or str(e)
                raise InvalidRequestError("Unable to restore slot: No available space in KV cache or invalid "
                                          f"slot save file ({reason})") from None
            cells, pos = self.rt.kv.seq_cells(s.seq_id)
            toks, flags = meta[0, cells], meta[1, cells]
            vocab = int(self.rt.vocab)
            if not (np.array_equal(pos, np.arange(n)) and bool(np.all((toks >= 0) & (toks < vocab)))):
                self.rt.kv.free(s.seq_id)
                with self._lock:
                    s.cache_tokens = []
                raise InvalidRequestError(f"Unable to restore slot: the file holds no prompt prefix (positions "
                                          f"0..n-1 with token ids below {vocab}); slot {idx} was erased")
            with self._lock:
                s.cache_tokens = [int(t) for t in toks]
                s.cache_numeric = bool(n) and bool(np.all(flags == 1)) and self.rt.kv_values() is not None
                s.cache_epoch = self.rt.kv.epoch
                s.last_used = self.rt.clock.now_us / 1e3
            return {"n_restored": int(n), "n_read": os.path.getsize(path),
                    "restore_ms": (time.perf_counter() - t0) * 1e3}
        finally:
            self._give_back(s)

    def erase(self, idx: int) -> dict[str, Any]:
        """Free idle slot ``idx``'s cached cells. Returns {"n_erased": tokens it held}.
        Raises InvalidRequestError (no such slot), UnavailableError (slot busy)."""
        s = self._take(idx, "erase")
        try:
            with self._lock:
                n = len(s.cache_tokens)
                self.rt.kv.free(s.seq_id)
                s.cache_tokens = []
            return {"n_erased": n}
        finally:
            self._give_back(s)


__all__ = ["SlotActionRunner"]
