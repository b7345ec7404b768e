"""Restricted views the runtime hands upward: the KV manager's inference-plane operations and the
simulated clock's read-and-book surface. Neither can clear, reset or rewind anything."""

from __future__ import annotations

from typing import Any

from sim_backend.device.clock import SimClock
from sim_backend.device.kv import KVCacheManager

# --- KV view (inference-plane subset of the KV manager) ------------------------------


class KVView:
    """The KV manager's inference-plane operations (facts.md F5 C0/C1).

    apply / can_allocate / free / remove_tokens_at_end and the llama.cpp
    ``seq_*`` operations; NOT ``clear`` (whole-cache clear is a maintenance
    action, ``MaintenanceRuntime.clear_kv``).
    """

    _OPS = ("apply", "can_allocate", "free", "remove_tokens_at_end", "seq_rm", "seq_cp", "seq_keep", "seq_add",
            "seq_div", "seq_pos_min", "seq_pos_max", "seq_cells", "occupancy", "counters", "save_seq_state",
            "load_seq_state",
            # read-only state: pool size, cells in use, and the epoch that changes when the cache is cleared
            "n_cells", "used_cells", "epoch")

    def __init__(self, kv: KVCacheManager) -> None:
        self._kv = kv

    def __getattr__(self, name: str) -> Any:
        if name in KVView._OPS:
            return getattr(self._kv, name)
        raise AttributeError(f"KVView has no operation {name!r}")

    def __dir__(self) -> list[str]:
        return sorted(KVView._OPS)


class ClockView:
    """The simulated device clock as the serving layer sees it: read ``now_us`` (simulated µs) and
    book host work on it with ``host_span``; it cannot be reset or advanced otherwise."""

    def __init__(self, clock: SimClock) -> None:
        self._clock = clock

    @property
    def now_us(self) -> float:
        """Simulated device time now (µs)."""
        return self._clock.now_us

    def host_span(self, start_us: float, dt_us: float) -> float:
        """Book ``dt_us`` of host work that started at simulated ``start_us``; returns its end (µs)."""
        return self._clock.host_span(start_us, dt_us)
