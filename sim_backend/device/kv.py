"""KV cache metadata manager of the simulated device.

This is the fixed counterpart of the production integration's KV code
(FACTS F6): there, KV apply spins in ``do{}while(!Apply())`` with no timeout,
back-off, cancel or error; a failed update calls ``abort()``;
seq_cp/seq_keep/seq_add/seq_div and state save/load are empty; seq_rm only
removes a tail. Here every one of those is implemented with llama.cpp's
unified-KV-cache semantics (``llama_kv_cells_unified`` /
``llama_memory_seq_*``), and every wait is bounded and cancellable
(DESIGN "No unbounded waits").

Model
-----
The cache is ``n_cells`` cells (default 40960 = the calbin context, FACTS
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
  server uses one id per slot and FACTS F1 says the hardware batch is 1, so 64
  is ample). Ids outside that range raise ``ValueError`` (except in
  ``seq_rm``, see there).

The manager holds metadata only. The K/V numbers live in arrays owned by the
device, indexed by cell along one axis; ``apply`` and ``seq_cells`` return
cell indices so the device can write/read those rows. Capacity in bytes is
``n_cells x bytes_per_token_per_chip`` per chip: 40960 x 49,152 B =
2,013,265,920 B = 1.875 GiB per chip in BF16 (FACTS F4: 48 layers x 2 KV
heads per chip x K/V x 128 x 2 B).

Positions shifted by ``seq_add`` / ``seq_div`` are also accumulated per cell
(llama.cpp's ``shift[]``) so the device can re-rotate RoPE'd keys; see
``take_shift``.

Thread safety: one ``threading.Lock`` wrapped in a ``Condition``; every public
method takes it. ``apply`` waits on the Condition and is woken by any
operation that frees cells.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sim_backend.bundle.shapes import ModelShape
from sim_backend.errors import KVExhausted, RequestCancelled

__all__ = [
    "KVCacheManager",
    "KVOccupancy",
    "KVCounters",
    "N_SEQ_MAX",
    "KV_STATE_FORMAT",
    "KV_STATE_VERSION",
]

#: Largest number of distinct sequence ids (ids 0..63): one bit each in a uint64 mask.
N_SEQ_MAX = 64

#: Identifier and version written into every saved sequence-state file.
KV_STATE_FORMAT = "calconsole-kv-seq-state"
KV_STATE_VERSION = 1

# Back-off of a waiting apply (host wall seconds): 1 ms doubling to 50 ms.
# Any free() notifies the Condition, so the back-off only bounds how late a
# cancel Event is noticed (Event.set() cannot notify our Condition).
_BACKOFF_START_S = 0.001
_BACKOFF_MAX_S = 0.050

_POS_INF = np.iinfo(np.int64).max
_EMPTY = np.int64(-1)
_ZERO = np.uint64(0)


@dataclass(frozen=True)
class KVOccupancy:
    """Read-only snapshot of KV usage (for the observation plane).

    Attributes:
        used_cells: cells holding at least one sequence (tokens).
        capacity_cells: total cells (tokens); 40960 by default (FACTS F2/F4).
        free_cells: ``capacity_cells - used_cells``.
        used_blocks: blocks of ``block_size`` cells with any used cell (paged view).
        total_blocks: ``ceil(capacity_cells / block_size)``.
        block_size: cells per block of the paged view (display only).
        per_seq_tokens: ``((seq_id, n_cells_containing_it), ...)`` sorted by seq_id;
            shared cells count once for every sequence holding them.
        bytes_used_per_chip: ``used_cells x bytes_per_token_per_chip`` (bytes).
        bytes_capacity_per_chip: ``capacity_cells x bytes_per_token_per_chip``
            (bytes); 2,013,265,920 B = 1.875 GiB by default (FACTS F4).
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
    """Cumulative ``apply`` statistics (for the observation plane, FACTS F8 "KV wait").

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


def _bit(seq_id: int) -> np.uint64:
    return np.uint64(1) << np.uint64(seq_id)


def _norm_range(p0: int, p1: int) -> tuple[int, int]:
    """llama.cpp's negative-bound convention: p0 < 0 -> 0, p1 < 0 -> +infinity."""
    p0 = int(p0)
    p1 = int(p1)
    if p0 < 0:
        p0 = 0
    if p1 < 0:
        p1 = _POS_INF
    return p0, p1


class KVCacheManager:
    """Cell-based KV cache metadata (llama.cpp unified KV cache semantics).

    Args:
        n_cells: capacity in cells = tokens (default 40960, the calbin
            context, FACTS F2; not the tokenizer's 131072).
        n_chips: chiplets the KV heads are split over (2, FACTS F1/F3); each
            chip holds every cell for its 2 of the 4 KV heads.
        bytes_per_token_per_chip: BF16 K+V bytes one cell costs on one chip
            (49,152 B for Qwen3-30B-A3B, FACTS F4).
        block_size: cells per block for the paged display view (allocation
            unit stays the cell, as in llama.cpp).
        n_seq_max: number of usable sequence ids, ``1..64`` (ids ``0..n_seq_max-1``).
    """

    def __init__(
        self,
        n_cells: int = 40960,
        n_chips: int = 2,
        bytes_per_token_per_chip: int = ModelShape().kv_bytes_per_token_per_chip,
        block_size: int = 256,
        *,
        n_seq_max: int = N_SEQ_MAX,
    ) -> None:
        if int(n_cells) <= 0:
            raise ValueError(f"n_cells must be > 0, got {n_cells}")
        if int(n_chips) <= 0:
            raise ValueError(f"n_chips must be > 0, got {n_chips}")
        if int(bytes_per_token_per_chip) <= 0:
            raise ValueError(f"bytes_per_token_per_chip must be > 0, got {bytes_per_token_per_chip}")
        if int(block_size) <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if not 1 <= int(n_seq_max) <= N_SEQ_MAX:
            raise ValueError(f"n_seq_max must be in 1..{N_SEQ_MAX} (uint64 bitmask), got {n_seq_max}")
        self.n_cells = int(n_cells)
        self.n_chips = int(n_chips)
        self.bytes_per_token_per_chip = int(bytes_per_token_per_chip)
        self.block_size = int(block_size)
        self.n_seq_max = int(n_seq_max)

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

    def _check_seq(self, seq_id: int, name: str = "seq_id") -> int:
        s = int(seq_id)
        if not 0 <= s < self.n_seq_max:
            raise ValueError(f"{name} must be in 0..{self.n_seq_max - 1} (n_seq_max={self.n_seq_max}), got {seq_id}")
        return s

    def _has(self, seq_id: int) -> np.ndarray:
        return (self._seqs & _bit(seq_id)) != _ZERO

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

        Replaces production's ``do{}while(!Apply())`` (FACTS F6).

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
            ValueError: bad seq_id, n_tokens, timeout or positions.

        Nothing is allocated when an exception is raised. If too few cells
        are free it waits on the Condition with exponential back-off (1 ms
        doubling to 50 ms, bounded by the deadline), woken at once by any
        operation that frees cells; never a busy loop.
        """
        with self._cond:
            return self._apply_locked(seq_id, n_tokens, timeout=timeout, cancel=cancel, positions=positions)

    def _apply_locked(self, seq_id, n_tokens, *, timeout, cancel, positions) -> np.ndarray:
        s = self._check_seq(seq_id)
        n = int(n_tokens)
        if n < 0:
            raise ValueError(f"n_tokens must be >= 0, got {n_tokens}")
        timeout = float(timeout)
        if not math.isfinite(timeout) or timeout < 0:
            raise ValueError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
        if positions is not None:
            pos_req = np.asarray(positions, dtype=np.int64).reshape(-1)
            if pos_req.size != n:
                raise ValueError(f"positions has {pos_req.size} entries, n_tokens is {n}")
            if pos_req.size and int(pos_req.min()) < 0:
                raise ValueError("positions must be >= 0")
        else:
            pos_req = None

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
                free = self.n_cells - self._n_used()
                if free >= n:
                    break
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

        if n == 0:
            return np.empty(0, dtype=np.int64)
        has = self._has(s)
        pos_max = int(self._pos[has].max()) if has.any() else -1
        if pos_req is None:
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
        """True if ``n_tokens`` cells (tokens) are free right now (CalRT canAllocate, FACTS F5)."""
        with self._cond:
            return 0 <= int(n_tokens) <= self.n_cells - self._n_used()

    # ------------------------------------------------------- CalRT-style frees

    def free(self, seq_id: int) -> int:
        """Remove ``seq_id`` from every cell (CalRT Free). Returns cells freed.

        Cells still shared with other sequences stay used and are not counted.
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
        """
        s = self._check_seq(seq_id)
        n = int(n)
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._cond:
            cells, _ = self._seq_cells_locked(s)
            if n == 0 or cells.size == 0:
                return 0
            victims = cells[-n:]
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
        """
        s = int(seq_id)
        if s >= self.n_seq_max:
            return False
        p0, p1 = _norm_range(p0, p1)
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
        kept.
        """
        src = self._check_seq(src, "src")
        dst = self._check_seq(dst, "dst")
        if src == dst:
            return
        p0, p1 = _norm_range(p0, p1)
        with self._cond:
            sel = (self._pos >= p0) & (self._pos < p1) & self._has(src)
            self._seqs[sel] |= _bit(dst)

    def seq_keep(self, seq_id: int) -> None:
        """Keep only ``seq_id`` (llama_memory_seq_keep).

        Cells not containing ``seq_id`` are emptied; cells containing it keep
        only ``seq_id``.
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
        """
        s = self._check_seq(seq_id)
        delta = int(delta)
        p0, p1 = _norm_range(p0, p1)
        if delta == 0 or p0 >= p1:
            return
        with self._cond:
            sel = (self._pos >= p0) & (self._pos < p1) & self._has(s)
            self._pos[sel] += delta
            self._shift[sel] += delta
            neg = sel & (self._pos < 0)
            self._freed(self._clear_cells(neg))

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Integer-divide positions ``[p0, p1)`` of ``seq_id`` by ``d`` (llama_memory_seq_div).

        New position = ``pos // d`` (positions are >= 0, so floor = C++
        truncation). Shared cells change for every sequence holding them, as
        in llama.cpp. ``d == 1`` is a no-op; ``d <= 0`` raises ValueError. The
        change is accumulated for ``take_shift``.
        """
        s = self._check_seq(seq_id)
        d = int(d)
        if d <= 0:
            raise ValueError(f"d must be >= 1, got {d}")
        p0, p1 = _norm_range(p0, p1)
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

    def save_seq_state(self, seq_id: int, path, arrays: Sequence[tuple[np.ndarray, int]] = ()) -> int:
        """Save one sequence's state to ``path`` (``np.savez``; llama_state_seq_save_file).

        Saved: format id and version, ``n_cells`` and
        ``bytes_per_token_per_chip`` the file was made with, the sequence's
        positions (sorted), and for each ``(array, cell_axis)`` the rows of
        ``array`` at the sequence's cells along ``cell_axis`` (e.g. K/V shaped
        ``(layers, kv_heads, n_cells, head_dim)`` with axis 2). Written to a
        temp file then renamed, so a crash never leaves a half file.

        Returns the number of tokens saved.
        """
        s = self._check_seq(seq_id)
        with self._cond:
            cells, pos = self._seq_cells_locked(s)
        payload: dict[str, np.ndarray] = {
            "format": np.array(KV_STATE_FORMAT),
            "version": np.array(KV_STATE_VERSION, dtype=np.int64),
            "n_cells": np.array(self.n_cells, dtype=np.int64),
            "bytes_per_token_per_chip": np.array(self.bytes_per_token_per_chip, dtype=np.int64),
            "seq_id": np.array(s, dtype=np.int64),
            "positions": pos,
            "n_arrays": np.array(len(arrays), dtype=np.int64),
        }
        for i, (arr, axis) in enumerate(arrays):
            axis = self._check_array(arr, axis, i)
            payload[f"axis_{i}"] = np.array(axis, dtype=np.int64)
            payload[f"rows_{i}"] = np.take(arr, cells, axis=axis)
        path = os.fspath(path)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:  # explicit file: np.savez would append ".npz" to a str
            np.savez(f, **payload)
        os.replace(tmp, path)
        return int(cells.size)

    def load_seq_state(
        self,
        seq_id: int,
        path,
        arrays: Sequence[tuple[np.ndarray, int]] = (),
        *,
        timeout: float,
        cancel: threading.Event | None = None,
    ) -> int:
        """Load a sequence state saved by ``save_seq_state`` into ``seq_id``.

        The whole file is validated first (format, version, ``n_cells``,
        ``bytes_per_token_per_chip``, array count/axis/shape/dtype); any
        mismatch raises ``ValueError`` and changes nothing. Then, as
        llama.cpp does, ``seq_id``'s current cells are removed and fresh
        cells are applied at the saved positions (bounded: ``timeout`` host
        wall seconds, ``cancel``; may raise ``KVExhausted`` /
        ``RequestCancelled``, in which case ``seq_id`` is left empty), and the
        saved rows are written into ``arrays`` at those cells.

        Returns the number of tokens loaded.
        """
        s = self._check_seq(seq_id)
        path = os.fspath(path)
        try:
            npz = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path}: not a readable KV state file ({e})") from e
        with npz:
            data = {k: npz[k] for k in npz.files}
        if "format" not in data or str(data["format"]) != KV_STATE_FORMAT:
            raise ValueError(f"{path}: not a {KV_STATE_FORMAT} file")
        version = int(data["version"])
        if version != KV_STATE_VERSION:
            raise ValueError(f"{path}: KV state format version {version}, this build reads {KV_STATE_VERSION}")
        f_cells = int(data["n_cells"])
        f_bpt = int(data["bytes_per_token_per_chip"])
        if f_cells != self.n_cells or f_bpt != self.bytes_per_token_per_chip:
            raise ValueError(
                f"{path}: made for n_cells={f_cells}, bytes_per_token_per_chip={f_bpt}; "
                f"this cache has n_cells={self.n_cells}, bytes_per_token_per_chip={self.bytes_per_token_per_chip}"
            )
        pos = data["positions"].astype(np.int64)
        n = int(pos.size)
        n_arrays = int(data["n_arrays"])
        if n_arrays != len(arrays):
            raise ValueError(f"{path}: file has {n_arrays} arrays, {len(arrays)} given")
        targets = []
        for i, (arr, axis) in enumerate(arrays):
            axis = self._check_array(arr, axis, i)
            f_axis = int(data[f"axis_{i}"])
            rows = data[f"rows_{i}"]
            if f_axis != axis:
                raise ValueError(f"{path}: array {i} saved with cell axis {f_axis}, given axis {axis}")
            want = list(arr.shape)
            want[axis] = n
            if list(rows.shape) != want or rows.dtype != arr.dtype:
                raise ValueError(
                    f"{path}: array {i} rows are {rows.shape} {rows.dtype}, expected {tuple(want)} {arr.dtype}"
                )
            targets.append((arr, axis, rows))

        with self._cond:
            self._freed(self._drop_seq(self._has(s), s))
            cells = self._apply_locked(s, n, timeout=timeout, cancel=cancel, positions=pos)
        # The device owns the arrays; rows are written outside our lock.
        for arr, axis, rows in targets:
            idx = [slice(None)] * arr.ndim
            idx[axis] = cells
            arr[tuple(idx)] = rows
        return n

    def _check_array(self, arr: np.ndarray, axis: int, i: int) -> int:
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"array {i} is not a numpy array")
        axis = int(axis)
        if axis < 0:
            axis += arr.ndim
        if not 0 <= axis < arr.ndim or arr.shape[axis] != self.n_cells:
            raise ValueError(f"array {i} of shape {arr.shape} has no axis {axis} of length n_cells={self.n_cells}")
        return axis

    # ------------------------------------------------------------ observation

    def occupancy(self) -> KVOccupancy:
        """Snapshot of KV usage in cells, blocks and bytes per chip (FACTS F4)."""
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

    def cells_snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of ``(pos int64[n_cells], seq bitmask uint64[n_cells])`` (debug/tests)."""
        with self._cond:
            return self._pos.copy(), self._seqs.copy()
