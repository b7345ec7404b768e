"""Unit tests for sim_backend.device.kv.KVCacheManager (llama.cpp unified KV semantics, facts.md F4/F6)."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from sim_backend.bundle.shapes import ModelShape
from sim_backend.device.kv import KV_STATE_VERSION, MAX_TIMEOUT_S, KVCacheManager, KVOccupancy
from sim_backend.errors import KVArgumentError, KVExhausted, KVStateFileError, RequestCancelled
from tests.waits import wait_until


def small(n_cells: int = 64, block_size: int = 8) -> KVCacheManager:
    return KVCacheManager(n_cells=n_cells, block_size=block_size)


def positions(kv: KVCacheManager, s: int) -> list[int]:
    return kv.seq_cells(s)[1].tolist()


# --------------------------------------------------------------- capacity (F4)

def test_default_capacity_is_facts_f4():
    kv = KVCacheManager()
    occ = kv.occupancy()
    assert isinstance(occ, KVOccupancy)
    assert occ.capacity_cells == 40960 == ModelShape().n_ctx
    assert kv.bytes_per_token_per_chip == 49_152
    # 48 layers x 2 KV heads/chip x K/V x 128 x 2 B x 40960 = 1.875 GiB per chip.
    assert occ.bytes_capacity_per_chip == 2_013_265_920 == int(1.875 * 2**30)
    assert occ.bytes_capacity_per_chip * kv.n_chips == int(3.75 * 2**30)
    assert occ.total_blocks == 160 and occ.block_size == 256
    assert occ.used_cells == 0 and occ.free_cells == 40960 and occ.used_blocks == 0
    assert occ.per_seq_tokens == ()


def test_occupancy_counts_blocks_bytes_and_shared_cells():
    kv = small(64, 8)
    kv.apply(0, 10, timeout=0)
    kv.seq_cp(0, 1, 0, 5)
    occ = kv.occupancy()
    assert occ.used_cells == 10 and occ.free_cells == 54
    assert occ.used_blocks == 2  # 10 cells compact -> blocks 0 and 1
    assert occ.per_seq_tokens == ((0, 10), (1, 5))
    assert occ.bytes_used_per_chip == 10 * kv.bytes_per_token_per_chip
    with pytest.raises(Exception):
        occ.used_cells = 3  # frozen


def test_occupancy_partial_last_block():
    kv = KVCacheManager(n_cells=10, block_size=4)
    assert kv.occupancy().total_blocks == 3
    kv.apply(0, 10, timeout=0)
    assert kv.occupancy().used_blocks == 3


# ---------------------------------------------------------------------- apply

def test_apply_default_positions_continue_after_pos_max():
    kv = small()
    c1 = kv.apply(0, 4, timeout=0)
    assert c1.dtype == np.int64 and c1.tolist() == [0, 1, 2, 3]
    assert positions(kv, 0) == [0, 1, 2, 3]
    c2 = kv.apply(0, 2, timeout=0)
    assert positions(kv, 0) == [0, 1, 2, 3, 4, 5]
    # decode appends right after the sequence's last cell
    assert c2.tolist() == [4, 5]
    cells, pos = kv.seq_cells(0)
    assert cells.tolist() == [0, 1, 2, 3, 4, 5] and pos.tolist() == list(range(6))


def test_apply_explicit_positions_aligned_with_cells():
    kv = small()
    cells = kv.apply(2, 3, timeout=0, positions=[7, 5, 6])
    pos, seqs = kv.cells_snapshot()
    assert pos[cells].tolist() == [7, 5, 6]
    assert all(seqs[c] == 1 << 2 for c in cells)
    c_sorted, p_sorted = kv.seq_cells(2)
    assert p_sorted.tolist() == [5, 6, 7]
    assert (np.diff(c_sorted) > 0).all()  # ascending cells for ascending positions


def test_apply_zero_tokens_and_bad_arguments():
    kv = small()
    assert kv.apply(0, 0, timeout=0).size == 0
    with pytest.raises(ValueError):
        kv.apply(0, -1, timeout=0)
    with pytest.raises(ValueError):
        kv.apply(64, 1, timeout=0)  # n_seq_max = 64
    with pytest.raises(ValueError):
        kv.apply(-1, 1, timeout=0)
    with pytest.raises(ValueError):
        kv.apply(0, 1, timeout=float("inf"))  # no unbounded waits
    with pytest.raises(ValueError):
        kv.apply(0, 1, timeout=-1)
    with pytest.raises(ValueError):
        kv.apply(0, 2, timeout=0, positions=[1])
    with pytest.raises(ValueError):
        kv.apply(0, 1, timeout=0, positions=[-3])
    with pytest.raises(TypeError):
        kv.apply(0, 1)  # timeout is required
    assert kv.occupancy().used_cells == 0


def test_apply_prefers_best_fit_hole():
    kv = small(64, 8)
    kv.apply(0, 10, timeout=0)  # cells 0..9
    kv.apply(1, 3, timeout=0)  # 10..12
    kv.apply(2, 10, timeout=0)  # 13..22
    kv.free(1)  # 3-cell hole at 10..12, big run 23..63
    assert kv.apply(3, 2, timeout=0).tolist() == [10, 11]
    assert kv.apply(4, 5, timeout=0).tolist() == [23, 24, 25, 26, 27]


def test_apply_fragmented_uses_scattered_cells():
    kv = small(16, 4)
    for s in range(8):
        kv.apply(s, 2, timeout=0)
    for s in (0, 2, 4, 6):
        kv.free(s)
    cells = kv.apply(9, 8, timeout=0)
    assert sorted(cells.tolist()) == [0, 1, 4, 5, 8, 9, 12, 13]
    assert positions(kv, 9) == list(range(8))
    assert kv.occupancy().free_cells == 0


def test_apply_larger_than_capacity_fails_at_once():
    kv = small(64)
    with pytest.raises(KVExhausted) as ei:
        kv.apply(0, 65, timeout=5.0)
    e = ei.value
    assert (e.requested, e.free, e.capacity, e.waited_s) == (65, 64, 64, 0.0)
    c = kv.counters()  # at once: it never waited for cells (was a < 0.5 s wall bound, which load can pass)
    assert c.apply_oversize == 1 and c.apply_waits == 0 and c.apply_timeouts == 0 and c.kv_wait_s == 0.0
    assert kv.occupancy().used_cells == 0


def test_apply_timeout_raises_kvexhausted_nothing_allocated():
    kv = small(64)
    kv.apply(0, 60, timeout=0)
    before = kv.cells_snapshot()
    timeout = 0.2
    t0 = time.monotonic()
    with pytest.raises(KVExhausted) as ei:
        kv.apply(1, 10, timeout=timeout)
    elapsed = time.monotonic() - t0
    assert timeout <= elapsed < timeout + 0.15
    e = ei.value
    assert (e.requested, e.free, e.capacity) == (10, 4, 64)
    assert timeout <= e.waited_s <= elapsed
    after = kv.cells_snapshot()
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1])
    assert kv.seq_pos_max(1) == -1
    c = kv.counters()
    assert c.apply_timeouts == 1 and c.apply_waits == 1
    assert timeout * 0.9 <= kv.kv_wait_s <= elapsed + 0.01


def test_apply_timeout_zero_does_not_wait():
    kv = small(8)
    kv.apply(0, 8, timeout=0)
    with pytest.raises(KVExhausted) as ei:
        kv.apply(1, 1, timeout=0)
    assert ei.value.waited_s == 0.0
    assert kv.apply_waits == 0 and kv.apply_timeouts == 1


def _wait_parked(kv, n: int = 1) -> None:
    """Until ``n`` applies have started waiting (``apply_waits`` counts a wait when it begins); bounded."""
    assert wait_until(lambda: kv.apply_waits >= n, step=0.005) and kv.apply_waits == n


def test_apply_waits_and_succeeds_when_another_thread_frees(monkeypatch):
    import sim_backend.device.kv as kv_mod

    # back-off far beyond the join below: only the free's notify can wake the waiter in time
    monkeypatch.setattr(kv_mod, "_BACKOFF_START_S", 30.0)
    monkeypatch.setattr(kv_mod, "_BACKOFF_MAX_S", 30.0)
    kv = small(64)
    kv.apply(0, 60, timeout=0)
    result: dict = {}

    def waiter():
        t0 = time.monotonic()
        try:
            result["cells"] = kv.apply(1, 10, timeout=5.0)
        except Exception as e:  # pragma: no cover - reported below
            result["err"] = e
        result["elapsed"] = time.monotonic() - t0

    th = threading.Thread(target=waiter)
    th.start()
    _wait_parked(kv)
    assert "cells" not in result
    assert kv.free(0) == 60
    th.join(10.0)  # woken by the free's notify: its next back-off would end 30 s from now
    assert not th.is_alive()
    assert "err" not in result
    assert len(result["cells"]) == 10 and positions(kv, 1) == list(range(10))
    assert kv.apply_waits == 1 and kv.kv_wait_s > 0


def test_apply_cancel_event_raises_promptly():
    kv = small(16)
    kv.apply(0, 16, timeout=0)
    cancel = threading.Event()
    result: dict = {}

    def waiter():
        try:
            kv.apply(1, 4, timeout=10.0, cancel=cancel)
        except RequestCancelled as e:
            result["err"] = e
            result["t"] = time.monotonic()

    th = threading.Thread(target=waiter)
    th.start()
    _wait_parked(kv)
    cancel.set()
    th.join(5.0)  # within a back-off (capped at 50 ms), long before the apply's own 10 s timeout
    assert not th.is_alive()
    assert isinstance(result["err"], RequestCancelled)
    assert "kv apply cancelled" in str(result["err"])
    assert kv.apply_cancels == 1
    assert kv.seq_pos_max(1) == -1 and kv.occupancy().used_cells == 16


def test_apply_cancel_already_set_allocates_nothing():
    kv = small(16)
    ev = threading.Event()
    ev.set()
    with pytest.raises(RequestCancelled):
        kv.apply(0, 1, timeout=1.0, cancel=ev)
    assert kv.occupancy().used_cells == 0


def test_can_allocate():
    kv = small(8)
    assert kv.can_allocate(8) and not kv.can_allocate(9)
    kv.apply(0, 5, timeout=0)
    assert kv.can_allocate(3) and not kv.can_allocate(4)
    assert not kv.can_allocate(-1)


# --------------------------------------------------- free / tail / clear (F5)

def test_free_returns_cells_freed_shared_cells_stay():
    kv = small()
    kv.apply(0, 6, timeout=0)
    kv.seq_cp(0, 1, 2, 4)
    assert kv.free(0) == 4  # cells at pos 2, 3 still held by seq 1
    assert kv.occupancy().used_cells == 2
    assert positions(kv, 1) == [2, 3]
    assert kv.free(0) == 0


def test_remove_tokens_at_end():
    kv = small()
    kv.apply(0, 10, timeout=0)
    assert kv.remove_tokens_at_end(0, 3) == 3
    assert kv.seq_pos_max(0) == 6
    assert kv.remove_tokens_at_end(0, 0) == 0
    assert kv.remove_tokens_at_end(0, 100) == 7
    assert kv.seq_pos_max(0) == -1
    assert kv.remove_tokens_at_end(5, 1) == 0
    with pytest.raises(ValueError):
        kv.remove_tokens_at_end(0, -1)


def test_clear():
    kv = small()
    kv.apply(0, 10, timeout=0)
    kv.apply(1, 10, timeout=0)
    kv.clear()
    assert kv.occupancy().used_cells == 0
    assert kv.seq_pos_min(0) == -1 and kv.seq_pos_max(1) == -1


# --------------------------------------------------------------- seq_* (F6)

def test_pos_min_max_empty_is_minus_one():
    kv = small()
    assert kv.seq_pos_min(0) == -1 and kv.seq_pos_max(0) == -1
    kv.apply(0, 3, timeout=0, positions=[4, 5, 9])
    assert kv.seq_pos_min(0) == 4 and kv.seq_pos_max(0) == 9
    cells, pos = kv.seq_cells(3)
    assert cells.size == 0 and pos.size == 0


def test_seq_rm_half_open_and_negative_bounds():
    kv = small()
    kv.apply(0, 10, timeout=0)
    assert kv.seq_rm(0, 2, 5) is True
    assert positions(kv, 0) == [0, 1, 5, 6, 7, 8, 9]
    assert kv.seq_rm(0, 8, -1)  # p1 < 0 = infinity
    assert positions(kv, 0) == [0, 1, 5, 6, 7]
    assert kv.seq_rm(0, -5, 1)  # p0 < 0 = 0
    assert positions(kv, 0) == [1, 5, 6, 7]
    assert kv.seq_rm(0, 6, 6)  # empty range
    assert kv.seq_rm(0, 7, 3)  # reversed range: nothing
    assert positions(kv, 0) == [1, 5, 6, 7]
    assert kv.occupancy().used_cells == 4
    assert kv.seq_rm(0, -1, -1)
    assert kv.occupancy().used_cells == 0


def test_seq_rm_middle_not_only_tail():
    # production's seq_rm could only drop a tail (facts.md F6)
    kv = small()
    kv.apply(0, 8, timeout=0)
    kv.seq_rm(0, 3, 4)
    assert positions(kv, 0) == [0, 1, 2, 4, 5, 6, 7]


def test_seq_rm_any_sequence():
    kv = small()
    kv.apply(0, 6, timeout=0)
    kv.apply(1, 6, timeout=0)
    kv.seq_cp(0, 2, -1, -1)
    assert kv.seq_rm(-1, 2, 4)
    for s in (0, 1, 2):
        assert positions(kv, s) == [0, 1, 4, 5]
    assert kv.occupancy().used_cells == 8


def test_seq_rm_false_only_beyond_n_seq_max():
    kv = small()
    kv.apply(0, 4, timeout=0)
    assert kv.seq_rm(64, -1, -1) is False
    assert kv.seq_rm(5, -1, -1) is True  # valid id, nothing held
    assert kv.occupancy().used_cells == 4
    kv8 = KVCacheManager(n_cells=8, n_seq_max=8)
    assert kv8.seq_rm(8, -1, -1) is False
    with pytest.raises(ValueError):
        kv8.apply(8, 1, timeout=0)


def test_seq_cp_shares_cells_then_seq_rm_one_side():
    kv = small()
    kv.apply(0, 8, timeout=0)
    kv.seq_cp(0, 1, 2, 6)
    assert kv.occupancy().used_cells == 8  # shared, not copied
    c0, _ = kv.seq_cells(0)
    c1, p1 = kv.seq_cells(1)
    assert p1.tolist() == [2, 3, 4, 5]
    assert set(c1.tolist()) <= set(c0.tolist())
    # remove from dst: src undisturbed, nothing freed
    kv.seq_rm(1, 3, 5)
    assert positions(kv, 1) == [2, 5]
    assert positions(kv, 0) == list(range(8))
    assert kv.occupancy().used_cells == 8
    # remove from src: cells shared with dst stay used
    kv.seq_rm(0, -1, -1)
    assert positions(kv, 1) == [2, 5]
    assert kv.seq_pos_max(0) == -1
    assert kv.occupancy().used_cells == 2


def test_seq_cp_noop_and_negative_bounds():
    kv = small()
    kv.apply(0, 4, timeout=0)
    before = kv.cells_snapshot()
    kv.seq_cp(0, 0, -1, -1)
    assert np.array_equal(before[1], kv.cells_snapshot()[1])
    kv.seq_cp(0, 3, -1, -1)
    assert positions(kv, 3) == [0, 1, 2, 3]
    kv.seq_cp(0, 3, -1, -1)  # already held: idempotent
    assert positions(kv, 3) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        kv.seq_cp(0, 64, -1, -1)


def test_seq_keep():
    kv = small()
    kv.apply(0, 4, timeout=0)
    kv.apply(1, 4, timeout=0)
    kv.seq_cp(0, 2, 0, 2)
    kv.seq_keep(0)
    assert positions(kv, 0) == [0, 1, 2, 3]
    assert kv.seq_pos_max(1) == -1 and kv.seq_pos_max(2) == -1
    assert kv.occupancy().used_cells == 4
    _, seqs = kv.cells_snapshot()
    assert set(np.unique(seqs).tolist()) == {0, 1}


def test_seq_add_shifts_and_removes_negative_positions():
    kv = small()
    kv.apply(0, 10, timeout=0)
    kv.seq_add(0, 5, -1, 3)
    assert positions(kv, 0) == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]
    kv.seq_add(0, -1, -1, -2)  # cells at 0 and 1 go negative -> removed
    assert positions(kv, 0) == [0, 1, 2, 6, 7, 8, 9, 10]
    assert kv.occupancy().used_cells == 8
    kv.seq_add(0, 0, 0, 5)  # empty range
    kv.seq_add(0, -1, -1, 0)  # zero delta
    assert positions(kv, 0) == [0, 1, 2, 6, 7, 8, 9, 10]


def test_seq_add_on_shared_cell_is_llamacpp_semantics():
    # a cell has ONE position: shifting it for seq 0 moves it for seq 1 too,
    # and going negative empties the whole cell (llama_kv_cells_unified::pos_add)
    kv = small()
    kv.apply(0, 4, timeout=0)
    kv.seq_cp(0, 1, -1, -1)
    kv.apply(1, 2, timeout=0)  # seq 1 own cells at 4, 5
    kv.seq_add(0, 2, -1, 10)
    assert positions(kv, 0) == [0, 1, 12, 13]
    assert positions(kv, 1) == [0, 1, 4, 5, 12, 13]
    kv.seq_add(0, -1, 1, -1)  # cell at pos 0 -> -1: emptied for both
    assert positions(kv, 0) == [1, 12, 13]
    assert positions(kv, 1) == [1, 4, 5, 12, 13]


def test_seq_div():
    kv = small()
    kv.apply(0, 8, timeout=0)
    kv.seq_div(0, 4, -1, 2)
    assert positions(kv, 0) == [0, 1, 2, 2, 2, 3, 3, 3]
    kv.seq_div(0, -1, -1, 1)  # no-op
    assert positions(kv, 0) == [0, 1, 2, 2, 2, 3, 3, 3]
    with pytest.raises(ValueError):
        kv.seq_div(0, -1, -1, 0)
    with pytest.raises(ValueError):
        kv.seq_div(0, -1, -1, -2)
    # next apply continues after pos_max
    kv.apply(0, 1, timeout=0)
    assert kv.seq_pos_max(0) == 4


def test_take_shift_reports_moved_cells():
    kv = small()
    cells = kv.apply(0, 6, timeout=0)
    assert not kv.has_shift
    kv.seq_add(0, 3, -1, 4)
    kv.seq_div(0, 0, 2, 2)
    assert kv.has_shift
    c, sh = kv.take_shift()
    got = dict(zip(c.tolist(), sh.tolist(), strict=True))
    assert got == {int(cells[1]): -1, int(cells[3]): 4, int(cells[4]): 4, int(cells[5]): 4}
    assert not kv.has_shift
    kv.seq_add(0, -1, -1, -100)  # all negative: cleared cells carry no shift
    assert not kv.has_shift


def test_seq_id_validation():
    kv = small()
    for f in (kv.free, kv.seq_keep, kv.seq_pos_min, kv.seq_pos_max, kv.seq_cells):
        with pytest.raises(ValueError):
            f(64)
        with pytest.raises(ValueError):
            f(-1)
    with pytest.raises(ValueError):
        kv.seq_add(64, 0, 1, 1)


# ------------------------------------------------------------- state files

def _kv_arrays(n_cells: int, rng) -> list[tuple[np.ndarray, int]]:
    # like the device's per-chip K and V: (layers, kv_heads, n_cells, head_dim)
    k = rng.standard_normal((3, 2, n_cells, 4)).astype(np.float32)
    v = rng.standard_normal((3, 2, n_cells, 4)).astype(np.float32)
    return [(k, 2), (v, 2)]


def test_save_load_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    kv = small(64)
    arrays = _kv_arrays(64, rng)
    kv.apply(1, 5, timeout=0)  # other seq first so cells differ after reload
    cells = kv.apply(0, 12, timeout=0)
    kv.seq_rm(0, 3, 5)
    kv.seq_div(0, 8, -1, 2)
    c0, p0 = kv.seq_cells(0)
    rows = [np.take(a, c0, axis=ax) for a, ax in arrays]
    path = tmp_path / "seq0.kvstate"
    assert kv.save_seq_state(0, path, arrays) == 10
    assert path.exists()

    kv2 = small(64)
    kv2.apply(3, 7, timeout=0)  # different layout on the target
    arrays2 = [(np.zeros_like(a), ax) for a, ax in arrays]
    assert kv2.load_seq_state(5, path, arrays2, timeout=1.0) == 10
    c5, p5 = kv2.seq_cells(5)
    assert p5.tolist() == p0.tolist()
    for (a2, ax), r in zip(arrays2, rows, strict=True):
        assert np.array_equal(np.take(a2, c5, axis=ax), r)
    assert positions(kv2, 3) == list(range(7))

    # loading over an existing sequence replaces it (llama.cpp clears dest first)
    assert kv.load_seq_state(0, path, arrays, timeout=1.0) == 10
    assert kv.seq_cells(0)[1].tolist() == p0.tolist()
    assert kv.occupancy().used_cells == 15
    del cells


class _Store:
    """A ``KVValueStore`` over arrays this test holds (as the device's model or its worker holds K/V)."""

    def __init__(self, arrays: list[tuple[np.ndarray, int]]) -> None:
        self.arrays = arrays

    def kv_layout(self):
        return [(a.shape, a.dtype.str, ax) for a, ax in self.arrays]

    def kv_take(self, cells):
        return [np.take(a, cells, axis=ax) for a, ax in self.arrays]

    def kv_put(self, cells, rows):
        for (a, ax), r in zip(self.arrays, rows, strict=True):
            idx = [slice(None)] * a.ndim
            idx[ax] = cells
            a[tuple(idx)] = r


def test_values_held_elsewhere_round_trip_after_the_arrays(tmp_path):
    rng = np.random.default_rng(2)
    kv = small(64)
    kv.apply(1, 3, timeout=0)
    kv.apply(0, 6, timeout=0)
    meta = np.arange(64, dtype=np.int64)[None, :].repeat(2, axis=0)  # a (2, n_cells) array, cell axis 1
    store = _Store(_kv_arrays(64, rng))
    c0, _ = kv.seq_cells(0)
    want = store.kv_take(c0)
    path = tmp_path / "v.kvstate"
    assert kv.save_seq_state(0, path, [(meta, 1)], values=store) == 6
    target, meta2, store2 = small(64), np.zeros_like(meta), _Store([(np.zeros_like(a), ax) for a, ax in store.arrays])
    assert target.load_seq_state(2, path, [(meta2, 1)], timeout=1.0, values=store2) == 6
    c2, p2 = target.seq_cells(2)
    assert p2.tolist() == list(range(6)) and meta2[0, c2].tolist() == c0.tolist()
    assert all(np.array_equal(a, b) for a, b in zip(store2.kv_take(c2), want, strict=True))
    # the values are part of the file: loading it without them (or with other ones) changes nothing
    with pytest.raises(ValueError, match="3 arrays, 1 given"):
        target.load_seq_state(3, path, [(meta2, 1)], timeout=0)
    assert target.seq_cells(3)[0].size == 0


def test_load_rejects_mismatched_files(tmp_path):
    rng = np.random.default_rng(1)
    kv = small(64)
    arrays = _kv_arrays(64, rng)
    kv.apply(0, 4, timeout=0)
    path = tmp_path / "s.npz"
    kv.save_seq_state(0, path, arrays)

    other = KVCacheManager(n_cells=128)
    with pytest.raises(ValueError, match="n_cells=64"):
        other.load_seq_state(0, path, _kv_arrays(128, rng), timeout=0)
    other_bpt = KVCacheManager(n_cells=64, bytes_per_token_per_chip=1024)
    with pytest.raises(ValueError, match="bytes_per_token_per_chip"):
        other_bpt.load_seq_state(0, path, arrays, timeout=0)
    target = small(64)
    with pytest.raises(ValueError, match="2 arrays"):
        target.load_seq_state(0, path, arrays[:1], timeout=0)
    bad_dtype = [(a.astype(np.float64), ax) for a, ax in arrays]
    with pytest.raises(ValueError, match="rows"):
        target.load_seq_state(0, path, bad_dtype, timeout=0)
    assert target.occupancy().used_cells == 0

    # wrong version
    data = dict(np.load(path))
    data["version"] = np.array(KV_STATE_VERSION + 1)
    vpath = tmp_path / "v.npz"
    with open(vpath, "wb") as f:
        np.savez(f, **data)
    with pytest.raises(ValueError, match="version"):
        target.load_seq_state(0, vpath, arrays, timeout=0)
    # not a state file at all
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello")
    with pytest.raises(ValueError):
        target.load_seq_state(0, junk, (), timeout=0)


def test_load_bounded_when_full(tmp_path):
    kv = small(16)
    kv.apply(0, 8, timeout=0)
    path = tmp_path / "s"
    kv.save_seq_state(0, path)
    full = small(16)
    full.apply(1, 12, timeout=0)
    with pytest.raises(KVExhausted):
        full.load_seq_state(2, path, timeout=0.05)
    assert full.occupancy().used_cells == 12 and full.seq_pos_max(2) == -1


def test_save_array_without_cell_axis_rejected(tmp_path):
    kv = small(64)
    kv.apply(0, 2, timeout=0)
    with pytest.raises(ValueError):
        kv.save_seq_state(0, tmp_path / "x", [(np.zeros((3, 63)), 1)])


# ------------------------------------- refused arguments change nothing

def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert np.array_equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def populated() -> KVCacheManager:
    kv = small(64, 8)
    kv.apply(0, 6, timeout=0)
    kv.seq_cp(0, 1, 0, 3)
    kv.apply(2, 4, timeout=0, positions=[10, 11, 12, 13])
    kv.seq_add(2, 0, -1, 2)  # leaves a pending shift in the dump
    return kv


@pytest.mark.parametrize("call", [
    pytest.param(lambda kv: kv.seq_add(0, 0, -1, 2**63 - 2), id="seq_add-wraps-int64"),
    pytest.param(lambda kv: kv.seq_add(0, 0, -1, 40961), id="seq_add-delta-beyond-n_ctx"),
    pytest.param(lambda kv: kv.seq_add(0, 0, -1, 40955), id="seq_add-pushes-past-n_ctx"),
    pytest.param(lambda kv: kv.apply(1.5, 2.7, timeout=0), id="apply-floats"),
    pytest.param(lambda kv: kv.apply(0, 2.0, timeout=0), id="apply-integral-float"),
    pytest.param(lambda kv: kv.apply(None, 1, timeout=0), id="apply-None-seq"),
    pytest.param(lambda kv: kv.apply(0, float("inf"), timeout=0), id="apply-inf-tokens"),
    pytest.param(lambda kv: kv.apply(0, None, timeout=0), id="apply-None-tokens"),
    pytest.param(lambda kv: kv.apply(True, 1, timeout=0), id="apply-bool-seq"),
    pytest.param(lambda kv: kv.apply(0, True, timeout=0), id="apply-bool-tokens"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=None), id="apply-None-timeout"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=float("nan")), id="apply-nan-timeout"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=MAX_TIMEOUT_S * 2), id="apply-huge-timeout"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout="1"), id="apply-str-timeout"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=0, cancel=True), id="apply-cancel-not-event"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=0, positions=[1.5]), id="apply-float-position"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=0, positions=[True]), id="apply-bool-position"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=0, positions=[2**70]), id="apply-huge-position"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=0, positions=[40960]), id="apply-position-n_ctx"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=0, positions=np.array([0.5])), id="apply-float-array"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=0, positions=np.array([[1]])), id="apply-2d-positions"),
    pytest.param(lambda kv: kv.apply(0, 1, timeout=0, positions="1"), id="apply-str-positions"),
    pytest.param(lambda kv: kv.can_allocate(None), id="can_allocate-None"),
    pytest.param(lambda kv: kv.can_allocate(1.5), id="can_allocate-float"),
    pytest.param(lambda kv: kv.free(2.0), id="free-float"),
    pytest.param(lambda kv: kv.remove_tokens_at_end(0, 1.5), id="remove-float"),
    pytest.param(lambda kv: kv.remove_tokens_at_end(0, -1), id="remove-negative"),
    pytest.param(lambda kv: kv.seq_rm(None, 0, 1), id="seq_rm-None"),
    pytest.param(lambda kv: kv.seq_rm(0, 0.5, 3), id="seq_rm-float-bound"),
    pytest.param(lambda kv: kv.seq_rm(64, 0.5, 3), id="seq_rm-beyond-seqs-float-bound"),
    pytest.param(lambda kv: kv.seq_rm(0, 0, float("inf")), id="seq_rm-inf"),
    pytest.param(lambda kv: kv.seq_cp(0, 1, None, 3), id="seq_cp-None"),
    pytest.param(lambda kv: kv.seq_cp(0, 0, 1.0, 3), id="seq_cp-self-float"),
    pytest.param(lambda kv: kv.seq_keep(np.float64(0)), id="seq_keep-numpy-float"),
    pytest.param(lambda kv: kv.seq_div(0, 0, -1, 0), id="seq_div-zero"),
    pytest.param(lambda kv: kv.seq_div(0, 0, -1, 2.0), id="seq_div-float"),
    pytest.param(lambda kv: kv.seq_pos_max("0"), id="pos_max-str"),
    pytest.param(lambda kv: kv.seq_cells(np.bool_(True)), id="seq_cells-numpy-bool"),
])
def test_refused_argument_raises_typed_error_and_changes_nothing(call):
    kv = populated()
    before = kv.state_snapshot()
    with pytest.raises(KVArgumentError) as ei:
        call(kv)
    assert isinstance(ei.value, ValueError)  # old callers that caught ValueError still do
    assert "Traceback" not in str(ei.value) and len(str(ei.value)) < 300
    assert_same_state(kv.state_snapshot(), before)


def test_seq_add_near_int64_is_refused_not_wrapped():
    # the case: this used to wrap the position to a negative and erase the cell
    kv = small()
    kv.apply(0, 3, timeout=0)
    with pytest.raises(KVArgumentError, match="delta"):
        kv.seq_add(0, 0, -1, 2**63 - 2)
    assert positions(kv, 0) == [0, 1, 2] and not kv.has_shift
    # a legal shift right up to the last position is still done
    kv.seq_add(0, 0, -1, kv.n_ctx - 3)
    assert positions(kv, 0) == [kv.n_ctx - 3, kv.n_ctx - 2, kv.n_ctx - 1]
    with pytest.raises(KVArgumentError, match="past n_ctx"):
        kv.seq_add(0, 0, -1, 1)
    # default positions after the context end are refused too
    with pytest.raises(KVArgumentError, match="n_ctx"):
        kv.apply(0, 1, timeout=0)
    # a negative shift of the whole context empties the cells (llama.cpp), no error
    kv.seq_add(0, -1, -1, -kv.n_ctx)
    assert kv.used_cells == 0


def test_negative_bound_convention_kept_and_huge_bounds_are_infinity():
    kv = small()
    kv.apply(0, 6, timeout=0)
    kv.seq_cp(0, 1, -7, 2**80)  # p0 < 0 -> 0; a bound above int64 covers everything
    assert positions(kv, 1) == list(range(6))
    assert kv.seq_rm(1, 2, -3) is True  # p1 < 0 -> infinity
    assert positions(kv, 1) == [0, 1]
    assert kv.seq_rm(1, 2**80, -1) is True and positions(kv, 1) == [0, 1]
    kv.seq_div(0, 0, -1, 2**100)  # same as any d >= n_ctx: every position // d == 0
    assert positions(kv, 0) == [0] * 6
    assert kv.remove_tokens_at_end(0, 10**30) == 6
    assert kv.seq_rm(2**70, 0, -1) is False  # no such sequence, any int is fine
    assert kv.can_allocate(2**70) is False and kv.can_allocate(-1) is False
    assert kv.apply(np.int64(3), np.int32(2), timeout=np.float32(0), positions=np.array([4, 5], np.uint8)).size == 2


def test_constructor_arguments_are_bounded():
    for kw in ({"n_cells": 0}, {"n_cells": 2**40}, {"n_cells": 64.0}, {"n_cells": None}, {"n_seq_max": 65},
               {"block_size": True}, {"n_chips": 0}, {"n_ctx": 0}, {"bytes_per_token_per_chip": "1"}):
        with pytest.raises(KVArgumentError):
            KVCacheManager(**kw)


def _save(tmp_path, name="s.npz"):
    rng = np.random.default_rng(7)
    kv = small(64)
    arrays = _kv_arrays(64, rng)
    kv.apply(0, 5, timeout=0)
    path = tmp_path / name
    kv.save_seq_state(0, path, arrays)
    return path, arrays


def _rewrite(path, out, **changes):
    data = dict(np.load(path))
    for k, v in changes.items():
        if v is None:
            del data[k]
        else:
            data[k] = v
    with open(out, "wb") as f:
        np.savez(f, **data)
    return out


def _damaged_files(tmp_path):
    path, _ = _save(tmp_path)
    raw = path.read_bytes()
    files = {}
    for cut in (0, 1, 30, len(raw) // 2, len(raw) - 1):
        f = tmp_path / f"cut{cut}.npz"
        f.write_bytes(raw[:cut])
        files[f"truncated-{cut}"] = f
    files["random-bytes"] = tmp_path / "junk.bin"
    files["random-bytes"].write_bytes(np.random.default_rng(3).bytes(4096))
    mid = bytearray(raw)
    mid[len(raw) // 3: len(raw) // 3 + 64] = b"\xff" * 64
    files["overwritten-middle"] = tmp_path / "mid.npz"
    files["overwritten-middle"].write_bytes(bytes(mid))
    npy = tmp_path / "plain.npy"
    np.save(npy, np.arange(4))
    files["plain-npy"] = npy
    d = tmp_path
    files["negative-positions"] = _rewrite(path, d / "neg.npz", positions=np.array([-1, 0, 1, 2, 3]))
    files["positions-past-n_ctx"] = _rewrite(path, d / "far.npz", positions=np.array([0, 1, 2, 3, 40960]))
    files["float-positions"] = _rewrite(path, d / "fpos.npz", positions=np.arange(5) + 0.5)
    files["2d-positions"] = _rewrite(path, d / "2dpos.npz", positions=np.arange(5).reshape(1, 5))
    files["too-many-positions"] = _rewrite(path, d / "many.npz", positions=np.arange(65))
    files["missing-version"] = _rewrite(path, d / "nover.npz", version=None)
    files["missing-rows"] = _rewrite(path, d / "norows.npz", rows_1=None)
    files["missing-axis"] = _rewrite(path, d / "noaxis.npz", axis_0=None)
    files["string-version"] = _rewrite(path, d / "sver.npz", version=np.array("1"))
    files["array-n_cells"] = _rewrite(path, d / "ncells.npz", n_cells=np.array([64, 64]))
    files["format-wrong-type"] = _rewrite(path, d / "fmt.npz", format=np.array(7))
    files["object-rows"] = tmp_path / "obj.npz"
    data = dict(np.load(path))
    data["rows_0"] = np.array([None, 1], dtype=object)
    with open(files["object-rows"], "wb") as f:
        np.savez(f, **data)  # needs pickle to read back: refused with allow_pickle=False
    files["directory"] = tmp_path
    files["missing"] = tmp_path / "nope.npz"
    files["long-name"] = tmp_path / ("x" * 100_000)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    files["fifo"] = fifo  # must not block waiting for a writer
    big = tmp_path / "big.npz"
    with open(big, "wb") as f:
        f.truncate(64 * 1024 * 1024)  # sparse: larger than any state for this cache
    files["too-big"] = big
    return path, files


def test_damaged_state_files_raise_one_typed_error_and_change_nothing(tmp_path):
    path, files = _damaged_files(tmp_path)
    kv = populated()
    arrays = [(np.full((3, 2, 64, 4), 9.0, np.float32), 2), (np.full((3, 2, 64, 4), 8.0, np.float32), 2)]
    before = kv.state_snapshot()
    for name, f in files.items():
        with pytest.raises(KVStateFileError) as ei:
            kv.load_seq_state(0, f, arrays, timeout=0)
        assert isinstance(ei.value, KVArgumentError), name
        assert len(str(ei.value)) < 400, name
        assert_same_state(kv.state_snapshot(), before)
        assert (arrays[0][0] == 9.0).all() and (arrays[1][0] == 8.0).all(), name
    # the intact file still loads
    assert kv.load_seq_state(0, path, arrays, timeout=0) == 5


def test_load_negative_positions_keeps_target_sequence(tmp_path):
    # the case: the target was emptied before the error
    path, arrays = _save(tmp_path)
    bad = _rewrite(path, tmp_path / "neg.npz", positions=np.array([0, 1, -2, 3, 4]))
    kv = small(64)
    kv.apply(3, 7, timeout=0)
    with pytest.raises(KVStateFileError, match="positions"):
        kv.load_seq_state(3, bad, [(np.zeros_like(a), ax) for a, ax in arrays], timeout=0)
    assert positions(kv, 3) == list(range(7))


def test_load_exhausted_keeps_target_and_counts_its_own_cells(tmp_path):
    kv = small(16)
    kv.apply(0, 10, timeout=0)
    path = tmp_path / "ten"
    kv.save_seq_state(0, path)
    kv.apply(1, 6, timeout=0)  # pool full
    # seq 0's own 10 cells come back when it is replaced: fits without waiting
    assert kv.load_seq_state(0, path, timeout=0) == 10
    # loading 10 into seq 1 (6 cells of its own, nothing free) cannot fit
    with pytest.raises(KVExhausted) as ei:
        kv.load_seq_state(1, path, timeout=0)
    assert ei.value.free == 6
    assert positions(kv, 1) == list(range(6)) and positions(kv, 0) == list(range(10))
    # cells seq 1 shares with seq 0 are not freed by replacing seq 1, so they do not count
    kv.seq_cp(0, 2, 0, 4)
    kv.free(1)
    kv.apply(3, 6, timeout=0)
    with pytest.raises(KVExhausted):
        kv.load_seq_state(2, path, timeout=0)
    assert positions(kv, 2) == [0, 1, 2, 3]


def test_load_arguments_checked_before_anything(tmp_path):
    path, arrays = _save(tmp_path)
    kv = populated()
    before = kv.state_snapshot()
    ro = np.zeros((3, 2, 64, 4), np.float32)
    ro.flags.writeable = False
    for kwargs in (dict(seq_id=0, path=path, arrays=[(ro, 2), (ro.copy(), 2)], timeout=0),
                   dict(seq_id=0, path=path, arrays=[arrays[0]], timeout=0),
                   dict(seq_id=0, path=path, arrays="kv", timeout=0),
                   dict(seq_id=0, path=path, arrays=[(arrays[0][0], 2.0), arrays[1]], timeout=0),
                   dict(seq_id=0, path=None, arrays=arrays, timeout=0),
                   dict(seq_id=0, path=path, arrays=arrays, timeout=-1),
                   dict(seq_id=0, path=path, arrays=arrays, timeout=0, cancel="yes"),
                   dict(seq_id=0.0, path=path, arrays=arrays, timeout=0),
                   dict(seq_id=0, path="a\0b", arrays=arrays, timeout=0)):
        with pytest.raises(KVArgumentError):
            kv.load_seq_state(**kwargs)
        assert_same_state(kv.state_snapshot(), before)


def test_save_to_bad_path_is_typed_and_leaves_no_temp(tmp_path):
    kv = populated()
    for p in ("/proc/nope/a.npz", tmp_path / "missing-dir" / "a.npz", tmp_path, "x" * 100_000, ""):
        with pytest.raises(KVStateFileError):
            kv.save_seq_state(0, p)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(KVArgumentError):
        kv.save_seq_state(0, 42)
    with pytest.raises(KVArgumentError):
        kv.save_seq_state(0, tmp_path / "o", [(np.empty(64, dtype=object), 0)])


def test_injected_kv_fault_not_consumed_by_a_refused_call():
    from sim_backend.device.faults import FaultInjectingKV, Faults

    faults = Faults()
    faults.arm("kv_exhaust_next")
    kv = FaultInjectingKV(n_cells=16, faults=lambda: faults)
    with pytest.raises(KVArgumentError):
        kv.apply(0, 1.5, timeout=0)
    with pytest.raises(KVExhausted):
        kv.apply(0, 1, timeout=0)  # the armed fault is still there for the real call
    assert kv.apply(0, 1, timeout=0).size == 1


# ------------------------------------------------------------ full size

def test_full_size_ops_stay_consistent():
    # full 40960-cell cache; no timing asserted here (team rule: tests never time anything)
    kv = KVCacheManager()
    for s in range(8):
        kv.apply(s, 4000, timeout=0)
    for _ in range(200):
        kv.apply(3, 1, timeout=0)
        kv.seq_rm(3, 3990, -1)
    assert positions(kv, 3) == list(range(3990))
    assert kv.occupancy().used_cells == 7 * 4000 + 3990
    with pytest.raises(KVArgumentError):
        kv.apply(3, 1, timeout=0, positions=[kv.n_ctx])
    assert kv.occupancy().used_cells == 7 * 4000 + 3990


def test_concurrent_apply_free_is_consistent():
    # engine threads contending for a small cache: every apply either gets its
    # cells or a typed error, and the cache ends empty with consistent counts
    kv = small(32, 4)
    errors: list[BaseException] = []

    def worker(s: int) -> None:
        try:
            for _ in range(50):
                cells = kv.apply(s, 7, timeout=2.0)
                assert len(cells) == 7 and kv.seq_cells(s)[0].size == 7
                assert kv.free(s) == 7
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and not any(t.is_alive() for t in threads)
    assert kv.occupancy().used_cells == 0
    assert kv.counters().apply_calls == 300
