"""Injected faults (maintenance plane): armed one-shot faults, a slow chip in effect, fired faults
kept until acknowledged, and the KV manager whose next apply can be made to fail."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, TypedDict

import numpy as np

from sim_backend.device.kv import KVCacheManager
from sim_backend.errors import KVExhausted


class FiredFault(TypedDict):
    """A fault that fired and is not acknowledged yet."""

    fault: str  #: the operator's name for it (``FIRED_NAMES``), e.g. "ccu_exception"
    detail: str  #: where it hit, e.g. "job 12"; "" when the caller gave none


@dataclass
class Faults:
    """Injected faults (maintenance plane), visible in the observation snapshot.

    ``ccu_next`` / ``link_error_next`` / ``kv_exhaust_next`` are "the next N jobs / KV applies":
    each one fires once and disarms itself. ``slow_chip`` maps chip -> time multiplier and stays
    until cleared or the device is reset. ``fired`` counts faults that have fired since the last reset.

    Armed is not a failure: ``armed()`` lists what will fire, ``in_effect()`` what acts on every job
    now (a slow chip), and ``unacknowledged()`` the faults that did fire, each kept until the operator
    acknowledges it (``acknowledge()``) or the device is reset (which makes a fresh ``Faults``).
    """

    ccu_next: int = 0
    link_error_next: int = 0
    kv_exhaust_next: int = 0
    slow_chip: dict[int, float] = field(default_factory=dict)  # chip -> time multiplier
    fired: dict[str, int] = field(default_factory=dict)
    _unacked: list[FiredFault] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    #: fired faults kept for the operator at most (older ones are counted, not listed)
    MAX_UNACKED = 20

    def take(self, name: str, detail: str = "") -> bool:
        """Consume one armed ``name`` fault (e.g. "ccu_next"); True if one fired. Thread-safe.

        A fired fault is recorded (``detail``: where it hit, e.g. "job 12") until acknowledged.
        """
        with self._lock:
            n = getattr(self, name)
            if n <= 0:
                return False
            setattr(self, name, n - 1)
            key = name.removesuffix("_next")
            self.fired[key] = self.fired.get(key, 0) + 1
            self._unacked.append(FiredFault(fault=FIRED_NAMES.get(key, key), detail=detail))
            del self._unacked[:-self.MAX_UNACKED]
            return True

    def arm(self, name: str, count: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + int(count))

    def armed(self) -> list[str]:
        """One-shot faults waiting to fire, e.g. ``["ccu_exception x1"]``."""
        out = []
        if self.ccu_next:
            out.append(f"ccu_exception x{self.ccu_next}")
        if self.link_error_next:
            out.append(f"link_error x{self.link_error_next}")
        if self.kv_exhaust_next:
            out.append(f"kv_exhaustion x{self.kv_exhaust_next}")
        return out

    def in_effect(self) -> list[str]:
        """Faults acting on every job now, e.g. ``["slow_chip1 x4"]``."""
        return [f"slow_chip{c} x{f:g}" for c, f in sorted(self.slow_chip.items())]

    def active(self) -> list[str]:
        """Everything injected and not yet spent: ``armed() + in_effect()``."""
        return self.armed() + self.in_effect()

    def unacknowledged(self) -> list[FiredFault]:
        """Faults that fired and are not acknowledged: [{"fault", "detail"}], oldest first."""
        with self._lock:
            return [FiredFault(fault=e["fault"], detail=e["detail"]) for e in self._unacked]

    def acknowledge(self) -> list[FiredFault]:
        """Mark every fired fault as seen; returns the ones acknowledged."""
        with self._lock:
            out, self._unacked = self._unacked, []
            return out


#: Faults.fired key -> the name the operator reads: the kind ``inject_fault`` takes (``FAULT_KINDS``), one name
#: everywhere (the link error was "d2d_link_error" here and "link_error" to the API)
FIRED_NAMES = {"ccu": "ccu_exception", "link_error": "link_error", "kv_exhaust": "kv_exhaustion"}


class FaultInjectingKV(KVCacheManager):
    """The board's KV manager with one injectable fault: the next ``apply`` raises ``KVExhausted``.

    The engine and runtime call ``board.kv.apply(...)`` unchanged; when the
    board's ``faults.kv_exhaust_next`` is armed, that call fails at once
    (nothing allocated, ``waited_s`` 0) exactly as a real exhaustion would
    after its timeout, so the request ends with a typed error.
    """

    def __init__(self, *args: Any, faults: Any = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._faults_source = faults  # callable -> Faults (the board's current one; reset replaces it)

    def apply(self, seq_id: int, n_tokens: int, *, timeout: float, cancel: Any = None,
              positions: Any = None) -> np.ndarray:
        # bad arguments get the typed error and leave the armed fault for a real call
        self._check_apply_args(seq_id, n_tokens, timeout, cancel, positions)
        faults = self._faults_source() if self._faults_source is not None else None
        if faults is not None and faults.take("kv_exhaust_next", f"KV apply of {int(n_tokens)} tokens, seq {seq_id}"):
            occ = self.occupancy()
            # retrying cannot clear an injected fault: callers fail the request at once
            err = KVExhausted(int(n_tokens), occ.free_cells, occ.capacity_cells, 0.0, injected=True)
            # say so: the free count shows the cache was not really full
            err.args = (f"{err}: injected fault (maintenance inject_fault kv_exhaustion), not a full cache",)
            raise err
        return super().apply(seq_id, n_tokens, timeout=timeout, cancel=cancel, positions=positions)
