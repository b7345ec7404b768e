"""Maintenance leases held over the network: they expire unless their holder renews them.

The maintenance plane's ``Lease`` has no expiry: in one process, whoever holds it is alive. Over
HTTP a holder can vanish (a crashed console, a dropped laptop), so the serving face keeps the
lease with a deadline (host monotonic seconds). The holder renews it (``POST
/maintenance/lease/renew``); a lease not renewed within ``ttl_s`` lapses: the face leaves
exclusive mode for it (forced, audited as ``lease_expired``) and admission resumes, so a
crashed client never holds the device forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sim_backend.planes import Lease

MIN_TTL_S = 2.0
MAX_TTL_S = 3600.0


@dataclass
class HeldLease:
    """A lease granted over HTTP: the plane's lease, its deadline and who took it (key label, remote)."""

    lease: Lease
    ttl_s: float
    expires_mono: float
    key_label: str
    remote: str
    #: the host monotonic clock, seconds (the table's; a test hands in one it advances)
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    def remaining_s(self, now: float | None = None) -> float:
        return max(0.0, self.expires_mono - (self.clock() if now is None else now))

    def to_dict(self) -> dict[str, object]:
        """Wire form for the holder: the full id (it is theirs), holder, ttl and expiry on the host wall clock."""
        left = self.remaining_s()
        return {"lease_id": self.lease.id, "holder": self.lease.holder, "ttl_s": self.ttl_s,
                "expires_in_s": round(left, 3), "expires_unix_s": round(time.time() + left, 3),
                "granted_unix_s": round(self.lease.granted_unix_s, 3)}


class LeaseTable:
    """The one lease held over HTTP (the plane allows one at a time). Thread-safe.

    ``clock``: host monotonic seconds (``time.monotonic``); every deadline is read on it, so a
    test can hand in a clock it advances and check expiry without waiting for it.
    """

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"lease ttl must be in [{MIN_TTL_S:g}, {MAX_TTL_S:g}] s, got {ttl_s:g}")
        self.ttl_s = ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._held: HeldLease | None = None

    def grant(self, lease: Lease, key_label: str, remote: str) -> HeldLease:
        with self._lock:
            self._held = HeldLease(lease, self.ttl_s, self.clock() + self.ttl_s, key_label, remote, self.clock)
            return self._held

    def find(self, lease_id: object) -> HeldLease | None:
        """The held lease with this id if it has not expired, else None."""
        with self._lock:
            h = self._held
            if h is None or not isinstance(lease_id, str) or h.lease.id != lease_id:
                return None
            return h if h.remaining_s() > 0 else None

    def renew(self, lease_id: object) -> HeldLease | None:
        with self._lock:
            h = self._held
            if h is None or not isinstance(lease_id, str) or h.lease.id != lease_id or h.remaining_s() <= 0:
                return None
            h.expires_mono = self.clock() + h.ttl_s
            return h

    def release(self, lease_id: str) -> None:
        with self._lock:
            if self._held is not None and self._held.lease.id == lease_id:
                self._held = None

    def take_expired(self) -> HeldLease | None:
        """Remove and return the held lease if it has expired (the caller leaves exclusive mode for it)."""
        with self._lock:
            h = self._held
            if h is not None and h.remaining_s() <= 0:
                self._held = None
                return h
            return None

    @property
    def held(self) -> HeldLease | None:
        return self._held
