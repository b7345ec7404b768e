"""KV cache metadata manager of the simulated device.

This is the fixed counterpart of the production integration's KV code
(facts.md F6): there, KV apply spins in ``do{}while(!Apply())`` with no timeout,
back-off, cancel or error; a failed update calls ``abort()``;
seq_cp/seq_keep/seq_add/seq_div and state save/load are empty; seq_rm only
removes a tail. Here every one of those is implemented with llama.cpp's
unified-KV-cache semantics (``llama_kv_cells_unified`` /
``llama_memory_seq_*``), and every wait is bounded and cancellable
(facts.md "No unbounded waits").

Model
-----
The cache is ``n_cells`` cells (default 40960 = the calbin context, facts.md
F2/F4). A cell holds ONE position (a token position, int) and a SET of
sequence ids that share it (llama.cpp: a cell is shared, not copied, by
``seq_cp``). A cell is *used* iff its sequence set is non-empty; then its
position is >= 0, otherwise it is -1.

Storage is two numpy arrays so every operation is a vectorised pass over the
cells (well under a millisecond on 40960 cells):

* ``pos``:  ``int64[n_cells]``, -1 for an empty cell;
* ``seqs``: ``uint64[n_cells]`` bitmask; bit ``s`` set <=> sequence ``s`` is
  in the cell. Hence sequence ids are limited to ``0 .. n_seq_max - 1`` with
  ``n_seq_max <= 64`` (llama.cpp's ``LLAMA_MAX_SEQ`` is also 64/256-ish; the
  server uses one id per slot and facts.md F1 says the hardware batch is 1, so 64
  is ample). Ids outside that range raise ``KVArgumentError`` (except in
  ``seq_rm``, see there).

Arguments are checked at this edge, before anything changes:
ids, counts, positions and bounds must be ints (Python or numpy; ``bool``
and floats are refused, never truncated); a cell's position is always in
``0 .. n_ctx - 1``; timeouts are finite and at most ``MAX_TIMEOUT_S``. A
refused call raises ``KVArgumentError`` (a bad state file
``KVStateFileError``, its subclass) and leaves the cache exactly as it was;
every operation either completes or changes nothing.

The manager holds metadata only. The K/V numbers live in arrays owned by the
device, indexed by cell along one axis; ``apply`` and ``seq_cells`` return
cell indices so the device can write/read those rows. Capacity in bytes is
``n_cells x bytes_per_token_per_chip`` per chip: 40960 x 49,152 B =
2,013,265,920 B = 1.875 GiB per chip in BF16 (facts.md F4: 48 layers x 2 KV
heads per chip x K/V x 128 x 2 B).

Positions shifted by ``seq_add`` / ``seq_div`` are also accumulated per cell
(llama.cpp's ``shift[]``) so the device can re-rotate RoPE'd keys; see
``take_shift``.

Thread safety: one ``threading.Lock`` wrapped in a ``Condition``; every public
method takes it. ``apply`` waits on the Condition and is woken by any
operation that frees cells.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim_backend.bundle.shapes import ModelShape
from sim_backend.device.kv_common import (  # noqa: F401
    _BACKOFF_MAX_S,
    _BACKOFF_START_S,
    _EMPTY,
    _POS_INF,
    _ZERO,
    KV_STATE_FORMAT,
    KV_STATE_VERSION,
    MAX_CELLS,
    MAX_TIMEOUT_S,
    N_SEQ_MAX,
    _as_int,
    _bit,
    _check_cancel,
    _check_timeout,
    _norm_range,
    _reason,
    _show,
)
from sim_backend.device.kv_state import KVStateFiles
from sim_backend.errors import KVArgumentError, KVExhausted, KVStateFileError, RequestCancelled  # noqa: F401

__all__ = [
    "KVCacheManager",
    "KVOccupancy",
    "KVCounters",
    "N_SEQ_MAX",
    "KV_STATE_FORMAT",
    "KV_STATE_VERSION",
    "MAX_TIMEOUT_S",
    "MAX_CELLS",
]

@dataclass(frozen=True)
class KVOccupancy:
    """Read-only snapshot of KV usage (for the observation plane).

    Attributes:
        used_cells: cells holding at least one sequence (tokens).
        capacity_cells: total cells (tokens); 40960 by default (facts.md F2/F4).
        free_cells: ``capacity_cells - used_cells``.
        used_blocks: blocks of ``block_size`` cells with any used cell (paged view).
        total_blocks: ``ceil(capacity_cells / block_size)``.
        block_size: cells per block of the paged view (display only).
        per_seq_tokens: ``((seq_id, n_cells_containing_it), ...)`` sorted by seq_id;
            shared cells count once for every sequence holding them.
        bytes_used_per_chip: ``used_cells x bytes_per_token_per_chip`` (bytes).
        bytes_capacity_per_chip: ``capacity_cells x bytes_per_token_per_chip``
            (bytes); 2,013,265,920 B = 1.875 GiB by default (facts.md F4).
    """

    used_cells: int
    capacity_cells: int
    free_cells: int
    used_blocks: int
    total_blocks: int
    block_size: int
    per_seq_tokens: tuple[tuple[int, int], ...]
    bytes_used_per_chip: int
    bytes_capacity_per_chip: int


@dataclass(frozen=True)
class KVCounters:
    """Cumulative ``apply`` statistics (for the observation plane, facts.md F8 "KV wait").

    Attributes:
        apply_calls: calls to ``apply`` (including ``load_seq_state``'s).
        apply_waits: calls that found too few free cells and had to wait.
        apply_timeouts: calls that ended in ``KVExhausted`` after the timeout.
        apply_cancels: calls ended by the cancel Event (``RequestCancelled``).
        apply_oversize: calls asking for more than capacity (rejected at once).
        kv_wait_s: total host wall seconds spent waiting inside ``apply``.
    """

    apply_calls: int
    apply_waits: int
    apply_timeouts: int
    apply_cancels: int
    apply_oversize: int
    kv_wait_s: float


class KVCacheManager(KVStateFiles):
    """Cell-based KV cache metadata (llama.cpp unified KV cache semantics).

    Args:
        n_cells: capacity in cells = tokens (default 40960, the calbin
            context, facts.md F2; not the tokenizer's 131072).
        n_chips: chiplets the KV heads are split over (2, facts.md F1/F3); each
            chip holds every cell for its 2 of the 4 KV heads.
        bytes_per_token_per_chip: BF16 K+V bytes one cell costs on one chip
            (49,152 B for Qwen3-30B-A3B, facts.md F4).
        block_size: cells per block for the paged display view (allocation
            unit stays the cell, as in llama.cpp).
        n_seq_max: number of usable sequence ids, ``1..64`` (ids ``0..n_seq_max-1``).
        n_ctx: positions a cell may hold are ``0..n_ctx-1`` (tokens). Default
            ``max(n_cells, 40960)``: the calbin context (facts.md F2), or the
            cache size if that is larger.

    Raises:
        KVArgumentError: an argument is not an int, or ``n_cells`` is outside
            ``1..MAX_CELLS``, ``n_seq_max`` outside ``1..64``, another size <= 0.
    """

    def __init__(
        self,
        n_cells: int = 40960,
        n_chips: int = 2,
        bytes_per_token_per_chip: int = ModelShape().kv_bytes_per_token_per_chip,
        block_size: int = 256,
        *,
        n_seq_max: int = N_SEQ_MAX,
        n_ctx: int | None = None,
    ) -> None:
        n_cells = _as_int(n_cells, "n_cells")
        if not 1 <= n_cells <= MAX_CELLS:
            raise KVArgumentError(f"n_cells must be in 1..{MAX_CELLS}, got {n_cells}")
        for name, v in (("n_chips", n_chips), ("bytes_per_token_per_chip", bytes_per_token_per_chip),
                        ("block_size", block_size)):
            if _as_int(v, name) <= 0:
                raise KVArgumentError(f"{name} must be > 0, got {v}")
        if not 1 <= _as_int(n_seq_max, "n_seq_max") <= N_SEQ_MAX:
            raise KVArgumentError(f"n_seq_max must be in 1..{N_SEQ_MAX} (uint64 bitmask), got {n_seq_max}")
        n_ctx = max(n_cells, ModelShape().n_ctx) if n_ctx is None else _as_int(n_ctx, "n_ctx")
        if not 1 <= n_ctx <= MAX_CELLS:
            raise KVArgumentError(f"n_ctx must be in 1..{MAX_CELLS}, got {n_ctx}")
        self.n_cells = n_cells
        self.n_chips = int(n_chips)
        self.bytes_per_token_per_chip = int(bytes_per_token_per_chip)
        self.block_size = int(block_size)
        self.n_seq_max = int(n_seq_max)
        self.n_ctx = n_ctx

        self._pos = np.full(self.n_cells, -1, dtype=np.int64)
        self._seqs = np.zeros(self.n_cells, dtype=np.uint64)
        # Accumulated position shift per cell since the last take_shift()
        # (llama.cpp shift[]): the device re-rotates RoPE'd K by this amount.
        self._shift = np.zeros(self.n_cells, dtype=np.int64)

        self._lock = threading.Lock()
        self.epoch = 0  # bumped by clear()
        self._cond = threading.Condition(self._lock)

        self._apply_calls = 0
        self._apply_waits = 0
        self._apply_timeouts = 0
        self._apply_cancels = 0
        self._apply_oversize = 0
        self._kv_wait_s = 0.0

    # ------------------------------------------------------------------ helpers

    def _check_seq(self, seq_id: Any, name: str = "seq_id") -> int:
        s = _as_int(seq_id, name)
        if not 0 <= s < self.n_seq_max:
            raise KVArgumentError(f"{name} must be in 0..{self.n_seq_max - 1} (n_seq_max={self.n_seq_max}), "
                                  f"got {_show(seq_id)}")
        return s

    def _check_positions(self, positions: Any, n: int) -> np.ndarray | None:
        """``positions`` (None, list/tuple/range of ints or 1-D int array) as int64[n] in 0..n_ctx-1."""
        if positions is None:
            return None
        vals: Any
        if isinstance(positions, np.ndarray):
            if positions.ndim != 1 or (positions.size and positions.dtype.kind not in "iu"):
                raise KVArgumentError(f"positions must be a 1-D integer array, got {positions.ndim}-D "
                                      f"{positions.dtype}")
            vals = positions
        elif isinstance(positions, (list, tuple, range)):
            if len(positions) != n:
                raise KVArgumentError(f"positions has {len(positions)} entries, n_tokens is {n}")
            if not all(type(p) is int for p in positions):  # fast path; bool is not int here
                for i, p in enumerate(positions):
                    _as_int(p, f"positions[{i}]")
            vals = positions
        else:
            raise KVArgumentError(f"positions must be a list of ints or an int array, got {type(positions).__name__}")
        if len(vals) != n:
            raise KVArgumentError(f"positions has {len(vals)} entries, n_tokens is {n}")
        if n:
            lo, hi = (int(vals.min()), int(vals.max())) if isinstance(vals, np.ndarray) else (min(vals), max(vals))
            if not (0 <= lo and hi < self.n_ctx):
                raise KVArgumentError(f"positions must be in 0..{self.n_ctx - 1} (n_ctx), got {_show(lo)}..{_show(hi)}")
        return np.array(vals, dtype=np.int64).reshape(-1)

    def _has(self, seq_id: int) -> np.ndarray:
        has: np.ndarray = (self._seqs & _bit(seq_id)) != _ZERO
        return has

    def _n_used(self) -> int:
        return int(np.count_nonzero(self._seqs))

    def _clear_cells(self, mask: np.ndarray) -> int:
        """Empty the cells in ``mask`` (all sequences). Returns cells freed."""
        n = int(np.count_nonzero(self._seqs[mask]))
        self._seqs[mask] = _ZERO
        self._pos[mask] = _EMPTY
        self._shift[mask] = 0
        return n

    def _drop_seq(self, sel: np.ndarray, seq_id: int) -> int:
        """Remove ``seq_id`` from cells in ``sel`` (all must hold it). Returns cells freed."""
        self._seqs[sel] &= ~_bit(seq_id)
        emptied = sel & (self._seqs == _ZERO)
        n = int(np.count_nonzero(emptied))
        if n:
            self._pos[emptied] = _EMPTY
            self._shift[emptied] = 0
        return n

    def _freed(self, n: int) -> None:
        # Wake waiting apply() calls: cells went back to the pool.
        if n:
            self._cond.notify_all()

    def _pick_cells(self, n: int, has: np.ndarray, pos_max: int) -> np.ndarray:
        """Choose ``n`` free cells (ascending indices). Caller checked enough are free.

        Preference, to keep the paged view compact and sequences contiguous:
        1. the free run right after the sequence's highest-position cell, if
           it holds all n (decode appends stay next to their prefix);
        2. the smallest free run that holds all n (best fit: fills holes in
           partly used blocks, leaves big runs for big prompts);
        3. otherwise the largest runs first (fewest fragments).
        """
        free = self._seqs == _ZERO
        # Free runs [starts[k], ends[k]) from the change points of the mask.
        change = np.flatnonzero(free[1:] != free[:-1]) + 1
        rising = change[free[change]]
        falling = change[~free[change]]
        starts = np.concatenate((np.zeros(1 if free[0] else 0, dtype=np.int64), rising))
        ends = np.concatenate((falling, np.full(1 if free[-1] else 0, self.n_cells, dtype=np.int64)))
        lengths = ends - starts

        if pos_max >= 0:
            cells = np.flatnonzero(has)
            last = int(cells[np.argmax(self._pos[cells])])
            nxt = last + 1
            if nxt < self.n_cells and free[nxt]:
                k = int(np.searchsorted(starts, nxt))
                if k < len(starts) and starts[k] == nxt and lengths[k] >= n:
                    return np.arange(nxt, nxt + n, dtype=np.int64)

        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            k = fits[np.argmin(lengths[fits])]  # argmin -> lowest start on ties
            s = int(starts[k])
            return np.arange(s, s + n, dtype=np.int64)

        order = np.argsort(-lengths, kind="stable")
        picked = []
        need = n
        for k in order:
            take = min(need, int(lengths[k]))
            picked.append(np.arange(starts[k], starts[k] + take, dtype=np.int64))
            need -= take
            if need == 0:
                break
        return np.sort(np.concatenate(picked))

    def _seq_pos_max(self, seq_id: int) -> int:
        has = self._has(seq_id)
        return int(self._pos[has].max()) if has.any() else -1

    # -------------------------------------------------------------------- apply

    def apply(
        self,
        seq_id: int,
        n_tokens: int,
        *,
        timeout: float,
        cancel: threading.Event | None = None,
        positions: Sequence[int] | None = None,
    ) -> np.ndarray:
        """Reserve ``n_tokens`` free cells for ``seq_id`` (bounded, cancellable).

        Replaces production's ``do{}while(!Apply())`` (facts.md F6).

        Args:
            seq_id: sequence id, ``0..n_seq_max-1``.
            n_tokens: cells (tokens) to reserve, >= 0.
            timeout: host wall seconds to wait for cells at most; required,
                finite, >= 0 (0 = try once, never wait).
            cancel: if set before or while waiting, raise ``RequestCancelled``
                (noticed within the back-off, <= 50 ms).
            positions: token positions of the new cells, one per token, each
                >= 0; default ``seq_pos_max(seq_id)+1 ...`` (next positions).
                Not required to be unique or new: llama.cpp lets a sequence
                hold several cells at one position (e.g. after ``seq_div``);
                consecutiveness is the batch layer's job.

        Returns:
            ``int64[n_tokens]`` cell indices, ``cells[i]`` holds
            ``positions[i]``; ascending cells are given to ascending
            positions, so for the default positions it is position order.

        Raises:
            KVExhausted: more than capacity requested (at once, waited_s 0),
                or not enough free cells when ``timeout`` passes.
            RequestCancelled: ``cancel`` was set ("kv apply cancelled").
            KVArgumentError: seq_id, n_tokens or a position not an int or out
                of range (positions ``0..n_ctx-1``), timeout not finite in
                ``0..MAX_TIMEOUT_S``, cancel not an Event.

        Nothing is allocated when an exception is raised. If too few cells
        are free it waits on the Condition with exponential back-off (1 ms
        doubling to 50 ms, bounded by the deadline), woken at once by any
        operation that frees cells; never a busy loop.
        """
        args = self._check_apply_args(seq_id, n_tokens, timeout, cancel, positions)
        with self._cond:
            return self._apply_locked(*args)

    def _check_apply_args(self, seq_id: Any, n_tokens: Any, timeout: Any, cancel: Any, positions: Any
                          ) -> tuple[int, int, float, threading.Event | None, np.ndarray | None]:
        """Validated ``(seq_id, n, timeout, cancel, positions int64[n] | None)``; raises KVArgumentError."""
        s = self._check_seq(seq_id)
        n = _as_int(n_tokens, "n_tokens")
        if n < 0:
            raise KVArgumentError(f"n_tokens must be >= 0, got {n}")
        timeout = _check_timeout(timeout)
        cancel = _check_cancel(cancel)
        pos_req = self._check_positions(positions, n)
        return s, n, timeout, cancel, pos_req

    def _wait_for(self, n: int, available: Callable[[], int], timeout: float,
                  cancel: threading.Event | None) -> None:
        """Wait (lock held, released while waiting) until ``available() >= n``.

        Counts the call in the apply counters. Raises KVExhausted (oversize:
        at once; else at the deadline) or RequestCancelled; changes no cell.
        """
        self._apply_calls += 1
        if n > self.n_cells:
            # Can never fit: fail now instead of waiting out the timeout.
            self._apply_oversize += 1
            raise KVExhausted(n, self.n_cells - self._n_used(), self.n_cells, 0.0)

        t0 = time.monotonic()
        deadline = t0 + timeout
        backoff = _BACKOFF_START_S
        wait_start: float | None = None
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    self._apply_cancels += 1
                    raise RequestCancelled("kv apply cancelled")
                free = available()
                if free >= n:
                    return
                now = time.monotonic()
                remaining = deadline - now
                if remaining <= 0:
                    self._apply_timeouts += 1
                    # waited_s: 0.0 when it never waited (timeout 0)
                    raise KVExhausted(n, free, self.n_cells, now - t0 if wait_start is not None else 0.0)
                if wait_start is None:
                    self._apply_waits += 1
                    wait_start = now
                self._cond.wait(min(backoff, remaining))
                backoff = min(backoff * 2.0, _BACKOFF_MAX_S)
        finally:
            if wait_start is not None:
                self._kv_wait_s += time.monotonic() - wait_start

    def _apply_locked(self, s: int, n: int, timeout: float, cancel: threading.Event | None,
                      pos_req: np.ndarray | None) -> np.ndarray:
        if pos_req is None:
            self._check_next_positions(s, n)  # before the counters or a wait
        self._wait_for(n, lambda: self.n_cells - self._n_used(), timeout, cancel)
        return self._allocate(s, n, pos_req)

    def _check_next_positions(self, s: int, n: int) -> None:
        pos_max = self._seq_pos_max(s)
        if n and pos_max + n >= self.n_ctx:
            raise KVArgumentError(f"sequence {s} ends at position {pos_max}; {n} more tokens pass "
                                  f"n_ctx={self.n_ctx}")

    def _allocate(self, s: int, n: int, pos_req: np.ndarray | None) -> np.ndarray:
        """Give ``n`` free cells to ``s`` (caller checked they are free, lock held)."""
        if n == 0:
            return np.empty(0, dtype=np.int64)
        has = self._has(s)
        pos_max = int(self._pos[has].max()) if has.any() else -1
        if pos_req is None:
            self._check_next_positions(s, n)  # again: another thread may have moved s while we waited
            pos_req = np.arange(pos_max + 1, pos_max + 1 + n, dtype=np.int64)
        chosen = self._pick_cells(n, has, pos_max)
        order = np.argsort(pos_req, kind="stable")
        cells = np.empty(n, dtype=np.int64)
        cells[order] = chosen
        self._pos[cells] = pos_req
        self._seqs[cells] = _bit(s)
        self._shift[cells] = 0
        return cells

    def can_allocate(self, n_tokens: int) -> bool:
        """True if ``n_tokens`` cells (tokens) are free right now (CalRT canAllocate, facts.md F5).

        Any int is accepted (negative -> False). Raises KVArgumentError for a non-int.
        """
        n = _as_int(n_tokens, "n_tokens")
        with self._cond:
            return 0 <= n <= self.n_cells - self._n_used()

    # ------------------------------------------------------- CalRT-style frees

    def free(self, seq_id: int) -> int:
        """Remove ``seq_id`` from every cell (CalRT Free). Returns cells freed.

        Cells still shared with other sequences stay used and are not counted.
        Raises KVArgumentError for a bad seq_id.
        """
        s = self._check_seq(seq_id)
        with self._cond:
            n = self._drop_seq(self._has(s), s)
            self._freed(n)
            return n

    def remove_tokens_at_end(self, seq_id: int, n: int) -> int:
        """Remove the ``n`` highest-position tokens of ``seq_id`` (CalRT RemoveTokensAtEnd).

        Returns the number of tokens removed from the sequence (``min(n,
        tokens held)``); shared cells stay with their other sequences.
        Raises KVArgumentError for a bad seq_id or an ``n`` that is not an int >= 0.
        """
        s = self._check_seq(seq_id)
        n = _as_int(n, "n")
        if n < 0:
            raise KVArgumentError(f"n must be >= 0, got {n}")
        with self._cond:
            cells, _ = self._seq_cells_locked(s)
            if n == 0 or cells.size == 0:
                return 0
            victims = cells[-min(n, cells.size):]
            sel = np.zeros(self.n_cells, dtype=bool)
            sel[victims] = True
            self._freed(self._drop_seq(sel, s))
            return int(victims.size)

    def clear(self) -> None:
        """Empty every cell (llama_memory_clear / CalRT Clear) and bump ``epoch``.

        ``epoch`` lets holders of derived state (the engine's per-slot prefix
        caches) notice that the cells they remember are gone.
        """
        with self._cond:
            self.epoch += 1
            n = self._n_used()
            self._pos.fill(-1)
            self._seqs.fill(0)
            self._shift.fill(0)
            self._freed(n)

    # ---------------------------------------------------------- llama.cpp seq_*

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove positions ``[p0, p1)`` from ``seq_id`` (llama_memory_seq_rm).

        ``p0 < 0`` means 0, ``p1 < 0`` means infinity; ``seq_id < 0`` means
        any sequence: every cell with a position in range is emptied. For
        ``seq_id >= 0`` only that id is removed from the cells; a cell is
        freed when its sequence set becomes empty, other sequences sharing it
        are undisturbed.

        Returns:
            True whenever the removal was done. False only for ``seq_id >=
            n_seq_max``: no such sequence can exist and nothing is changed.
            (llama.cpp's unified cache always returns True; the bool exists
            for caches that cannot remove a partial range.)

        Raises:
            KVArgumentError: seq_id, p0 or p1 not an int (nothing changed).
        """
        s = _as_int(seq_id, "seq_id")
        p0, p1 = _norm_range(p0, p1)
        if s >= self.n_seq_max:
            return False
        with self._cond:
            in_range = (self._pos >= p0) & (self._pos < p1)
            if s < 0:
                n = self._clear_cells(in_range)
            else:
                n = self._drop_seq(in_range & self._has(s), s)
            self._freed(n)
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Share ``src``'s cells with positions in ``[p0, p1)`` with ``dst`` (llama_memory_seq_cp).

        The cells are SHARED, not copied: ``dst`` is added to their sequence
        sets, so the used-cell count does not change. Negative bounds as in
        ``seq_rm``. ``src == dst`` is a no-op. Cells ``dst`` already held are
        kept. Raises KVArgumentError for bad ids or bounds (nothing changed).
        """
        src = self._check_seq(src, "src")
        dst = self._check_seq(dst, "dst")
        p0, p1 = _norm_range(p0, p1)
        if src == dst:
            return
        with self._cond:
            sel = (self._pos >= p0) & (self._pos < p1) & self._has(src)
            self._seqs[sel] |= _bit(dst)

    def seq_keep(self, seq_id: int) -> None:
        """Keep only ``seq_id`` (llama_memory_seq_keep).

        Cells not containing ``seq_id`` are emptied; cells containing it keep
        only ``seq_id``. Raises KVArgumentError for a bad seq_id.
        """
        s = self._check_seq(seq_id)
        with self._cond:
            has = self._has(s)
            n = self._clear_cells(~has)
            self._seqs[has] = _bit(s)
            self._freed(n)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions ``[p0, p1)`` of ``seq_id`` by ``delta`` tokens (llama_memory_seq_add).

        Exactly llama.cpp's behaviour: a cell has ONE position shared by all
        its sequences, so shifting a cell that ``seq_id`` shares with other
        sequences shifts it for them too; and a cell whose new position is
        < 0 is emptied entirely (all its sequences), not just dropped from
        ``seq_id``. ``delta == 0`` or an empty range is a no-op. The shift is
        accumulated per cell for ``take_shift`` (RoPE re-rotation of K).

        Raises:
            KVArgumentError: a non-int argument, ``|delta| > n_ctx``, or a
                shifted position that would reach ``n_ctx`` or beyond (then no
                cell moves: a shift is all or nothing).
        """
        s = self._check_seq(seq_id)
        p0, p1 = _norm_range(p0, p1)
        delta = _as_int(delta, "delta")
        if abs(delta) > self.n_ctx:
            # every position is in 0..n_ctx-1: a larger shift is never meaningful (and would overflow int64)
            raise KVArgumentError(f"delta must be in -{self.n_ctx}..{self.n_ctx} (n_ctx), got {_show(delta)}")
        if delta == 0 or p0 >= p1:
            return
        with self._cond:
            sel = (self._pos >= p0) & (self._pos < p1) & self._has(s)
            if delta > 0 and sel.any() and int(self._pos[sel].max()) + delta >= self.n_ctx:
                raise KVArgumentError(f"seq_add({s}, {p0}, {p1}, {delta}) would move position "
                                      f"{int(self._pos[sel].max())} past n_ctx={self.n_ctx}; nothing moved")
            self._pos[sel] += delta
            self._shift[sel] += delta
            neg = sel & (self._pos < 0)
            self._freed(self._clear_cells(neg))

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Integer-divide positions ``[p0, p1)`` of ``seq_id`` by ``d`` (llama_memory_seq_div).

        New position = ``pos // d`` (positions are >= 0, so floor = C++
        truncation). Shared cells change for every sequence holding them, as
        in llama.cpp. ``d == 1`` is a no-op; ``d <= 0`` or a non-int argument
        raises KVArgumentError (nothing changed). The change is accumulated
        for ``take_shift``.
        """
        s = self._check_seq(seq_id)
        p0, p1 = _norm_range(p0, p1)
        d = _as_int(d, "d")
        if d <= 0:
            raise KVArgumentError(f"d must be >= 1, got {d}")
        d = min(d, self.n_ctx)  # same quotients (positions < n_ctx), no int64 overflow
        if d == 1 or p0 >= p1:
            return
        with self._cond:
            sel = (self._pos >= p0) & (self._pos < p1) & self._has(s)
            old = self._pos[sel]
            new = old // d
            self._pos[sel] = new
            self._shift[sel] += new - old

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest token position of ``seq_id``; -1 when it has no cells."""
        s = self._check_seq(seq_id)
        with self._cond:
            has = self._has(s)
            return int(self._pos[has].min()) if has.any() else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest token position of ``seq_id``; -1 when it has no cells."""
        s = self._check_seq(seq_id)
        with self._cond:
            return self._seq_pos_max(s)

    def seq_cells(self, seq_id: int) -> tuple[np.ndarray, np.ndarray]:
        """``(cell indices, positions)`` of ``seq_id``, both int64, sorted by position.

        Ties (several cells at one position) are ordered by cell index. This
        is what attention reads: rows ``cells`` of the device's K/V arrays.
        Returned arrays are copies.
        """
        s = self._check_seq(seq_id)
        with self._cond:
            return self._seq_cells_locked(s)

    def _seq_cells_locked(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        cells = np.flatnonzero(self._has(s)).astype(np.int64)
        pos = self._pos[cells]
        order = np.argsort(pos, kind="stable")
        return cells[order], pos[order]

    def take_shift(self) -> tuple[np.ndarray, np.ndarray]:
        """Return and reset ``(cells, shift)`` for cells moved by seq_add/seq_div.

        ``shift`` is new position minus the position the cell's K was rotated
        with (tokens). llama.cpp's ``has_shift``/``reset_shift``: the device
        re-applies RoPE to K at those cells before the next attention read.
        """
        with self._cond:
            cells = np.flatnonzero(self._shift).astype(np.int64)
            shift = self._shift[cells].copy()
            self._shift[cells] = 0
            return cells, shift

    @property
    def has_shift(self) -> bool:
        """True if some cell's position changed since the last ``take_shift``."""
        with self._cond:
            return bool(self._shift.any())

    # ------------------------------------------------------------- state files

    def occupancy(self) -> KVOccupancy:
        """Snapshot of KV usage in cells, blocks and bytes per chip (facts.md F4)."""
        with self._cond:
            used = self._seqs != _ZERO
            n_used = int(np.count_nonzero(used))
            total_blocks = -(-self.n_cells // self.block_size)
            padded = np.zeros(total_blocks * self.block_size, dtype=bool)
            padded[: self.n_cells] = used
            used_blocks = int(np.count_nonzero(padded.reshape(total_blocks, self.block_size).any(axis=1)))
            present = int(np.bitwise_or.reduce(self._seqs)) if self.n_cells else 0
            per_seq = tuple(
                (s, int(np.count_nonzero(self._has(s)))) for s in range(self.n_seq_max) if present >> s & 1
            )
        return KVOccupancy(
            used_cells=n_used,
            capacity_cells=self.n_cells,
            free_cells=self.n_cells - n_used,
            used_blocks=used_blocks,
            total_blocks=total_blocks,
            block_size=self.block_size,
            per_seq_tokens=per_seq,
            bytes_used_per_chip=n_used * self.bytes_per_token_per_chip,
            bytes_capacity_per_chip=self.n_cells * self.bytes_per_token_per_chip,
        )

    def counters(self) -> KVCounters:
        """Snapshot of the cumulative apply counters."""
        with self._cond:
            return self._counters_locked()

    def _counters_locked(self) -> KVCounters:
        return KVCounters(
            apply_calls=self._apply_calls,
            apply_waits=self._apply_waits,
            apply_timeouts=self._apply_timeouts,
            apply_cancels=self._apply_cancels,
            apply_oversize=self._apply_oversize,
            kv_wait_s=self._kv_wait_s,
        )

    @property
    def apply_waits(self) -> int:
        """apply calls that had to wait for cells."""
        return self.counters().apply_waits

    @property
    def apply_timeouts(self) -> int:
        """apply calls that ended in KVExhausted after their timeout."""
        return self.counters().apply_timeouts

    @property
    def apply_cancels(self) -> int:
        """apply calls ended by their cancel Event."""
        return self.counters().apply_cancels

    @property
    def kv_wait_s(self) -> float:
        """Total host wall seconds spent waiting inside apply."""
        return self.counters().kv_wait_s

    @property
    def used_cells(self) -> int:
        """Cells (tokens) currently used."""
        with self._cond:
            return self._n_used()

    def state_snapshot(self) -> dict[str, Any]:
        """Everything the manager holds, copied (tests compare it before/after a refused call).

        Keys: ``pos`` int64[n_cells], ``seqs`` uint64[n_cells], ``shift``
        int64[n_cells] (pending RoPE shift, tokens), ``epoch`` int,
        ``counters`` :class:`KVCounters`.
        """
        with self._cond:
            return {"pos": self._pos.copy(), "seqs": self._seqs.copy(), "shift": self._shift.copy(),
                    "epoch": self.epoch, "counters": self._counters_locked()}

    def cells_snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of ``(pos int64[n_cells], seq bitmask uint64[n_cells])`` (debug/tests)."""
        with self._cond:
            return self._pos.copy(), self._seqs.copy()
