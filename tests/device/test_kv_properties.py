"""Stateful property test: KVCacheManager vs a plain-Python llama.cpp-style reference.

The reference is a list of cells, each ``[pos, set(seq_ids), shift]``, with the
semantics of llama.cpp's ``llama_kv_cells_unified`` written the obvious,
slow way. Which free cells ``apply`` picks is the manager's choice, so the
model takes the cells the manager returned (after checking they were free)
and from then on every cell must match exactly.
"""

from __future__ import annotations

import tempfile
import threading
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sim_backend.device.kv import KVCacheManager
from sim_backend.errors import KVExhausted

N_CELLS = 32
BLOCK = 4
INF = 2**62
SEQS = st.integers(0, 3)
ANY_SEQ = st.sampled_from([-1, 0, 1, 2, 3, 64])  # -1 = any, 64 = beyond n_seq_max
# bounds hit the interesting cases often: -1 (open end), small positions, past the end
BOUND = st.one_of(st.just(-1), st.integers(-2, 14), st.integers(15, 40))


def norm(p0: int, p1: int) -> tuple[int, int]:
    return (0 if p0 < 0 else p0), (INF if p1 < 0 else p1)


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(n_cells=N_CELLS, block_size=BLOCK)
        # cell -> [pos, set of seq ids, accumulated shift]; pos -1 / empty set when free
        self.cells: list[list] = [[-1, set(), 0] for _ in range(N_CELLS)]
        self.tmp = tempfile.TemporaryDirectory()
        self.n_saves = 0

    def teardown(self) -> None:
        self.tmp.cleanup()

    # -------------------------------------------------------------- helpers
    def m_clear_cell(self, i: int) -> None:
        self.cells[i] = [-1, set(), 0]

    def m_free(self) -> int:
        return sum(1 for c in self.cells if not c[1])

    def m_seq(self, s: int) -> list[tuple[int, int]]:
        """(pos, cell) of seq s sorted by position then cell."""
        return sorted((c[0], i) for i, c in enumerate(self.cells) if s in c[1])

    def m_apply(self, s: int, cells: np.ndarray, pos: list[int]) -> None:
        assert len(set(cells.tolist())) == len(cells)
        for c, p in zip(cells.tolist(), pos, strict=True):
            assert not self.cells[c][1], f"cell {c} handed out while used"
            self.cells[c] = [p, {s}, 0]

    # ---------------------------------------------------------------- rules
    @initialize(n=st.integers(0, 12), k=BOUND)
    def prompt_shared_with_slot1(self, n, k):
        # the server's usual start: a prompt in seq 0, its prefix shared with seq 1
        self.apply_next(0, n)
        self.seq_cp(0, 1, -1, k)

    @rule(s=SEQS, n=st.integers(0, 12))
    def apply_next(self, s, n):
        free = self.m_free()
        seq = self.m_seq(s)
        start = max(p for p, _ in seq) + 1 if seq else 0
        try:
            cells = self.kv.apply(s, n, timeout=0)
        except KVExhausted as e:
            event("apply exhausted")
            assert n > free
            assert (e.requested, e.free, e.capacity, e.waited_s) == (n, free, N_CELLS, 0.0)
            return
        assert n <= free and len(cells) == n
        self.m_apply(s, cells, list(range(start, start + n)))

    @rule(s=SEQS, pos=st.lists(st.integers(0, 30), max_size=8))
    def apply_positions(self, s, pos):
        free = self.m_free()
        try:
            cells = self.kv.apply(s, len(pos), timeout=0, positions=pos)
        except KVExhausted:
            assert len(pos) > free
            return
        self.m_apply(s, cells, pos)

    @rule(s=ANY_SEQ, p0=BOUND, p1=BOUND)
    def seq_rm(self, s, p0, p1):
        ok = self.kv.seq_rm(s, p0, p1)
        if s >= 64:
            assert ok is False
            return
        assert ok is True
        a, b = norm(p0, p1)
        for i, c in enumerate(self.cells):
            if not c[1] or not (a <= c[0] < b):
                continue
            if s < 0:
                self.m_clear_cell(i)
            elif s in c[1]:
                c[1].discard(s)
                if not c[1]:
                    self.m_clear_cell(i)

    @rule(src=SEQS, dst=SEQS, p0=BOUND, p1=BOUND)
    def seq_cp(self, src, dst, p0, p1):
        self.kv.seq_cp(src, dst, p0, p1)
        if src == dst:
            return
        a, b = norm(p0, p1)
        shared = 0
        for c in self.cells:
            if src in c[1] and a <= c[0] < b:
                shared += dst not in c[1]
                c[1].add(dst)
        event(f"seq_cp shares {'some' if shared else 'no'} cells")

    @rule(s=SEQS)
    def seq_keep(self, s):
        self.kv.seq_keep(s)
        for i, c in enumerate(self.cells):
            if s in c[1]:
                c[1] = {s}
            elif c[1]:
                self.m_clear_cell(i)

    @rule(s=SEQS, p0=BOUND, p1=BOUND, delta=st.integers(-12, 12))
    def seq_add(self, s, p0, p1, delta):
        self.kv.seq_add(s, p0, p1, delta)
        a, b = norm(p0, p1)
        if delta == 0 or a >= b:
            return
        for i, c in enumerate(self.cells):
            if s in c[1] and a <= c[0] < b:
                c[0] += delta
                c[2] += delta
                if c[0] < 0:  # llama.cpp pos_add: the whole cell is emptied
                    event("seq_add empties a shared cell" if len(c[1]) > 1 else "seq_add empties a cell")
                    self.m_clear_cell(i)

    @rule(s=SEQS, p0=BOUND, p1=BOUND, d=st.integers(1, 4))
    def seq_div(self, s, p0, p1, d):
        self.kv.seq_div(s, p0, p1, d)
        a, b = norm(p0, p1)
        if d == 1:
            return
        for c in self.cells:
            if s in c[1] and a <= c[0] < b:
                new = c[0] // d
                c[2] += new - c[0]
                c[0] = new

    @rule(s=SEQS)
    def free(self, s):
        n = self.kv.free(s)
        freed = 0
        for i, c in enumerate(self.cells):
            if s in c[1]:
                c[1].discard(s)
                if not c[1]:
                    self.m_clear_cell(i)
                    freed += 1
        assert n == freed

    @rule(s=SEQS, n=st.integers(0, 6))
    def remove_tokens_at_end(self, s, n):
        got = self.kv.remove_tokens_at_end(s, n)
        seq = self.m_seq(s)
        victims = seq[max(0, len(seq) - n):] if n else []
        assert got == len(victims)
        for _, i in victims:
            self.cells[i][1].discard(s)
            if not self.cells[i][1]:
                self.m_clear_cell(i)

    @rule()
    def take_shift(self):
        cells, shift = self.kv.take_shift()
        want = {i: c[2] for i, c in enumerate(self.cells) if c[2] != 0}
        assert dict(zip(cells.tolist(), shift.tolist(), strict=True)) == want
        for c in self.cells:
            c[2] = 0

    @precondition(lambda self: self.n_saves < 3)
    @rule(src=SEQS, dst=SEQS)
    def save_load(self, src, dst):
        # rows of a device-like array (layers, heads, n_cells, dim) must follow the cells
        self.n_saves += 1
        arr = np.arange(2 * N_CELLS * 3, dtype=np.float32).reshape(2, N_CELLS, 3)
        path = Path(self.tmp.name) / f"s{self.n_saves}.npz"
        src_seq = self.m_seq(src)
        rows = arr[:, [i for _, i in src_seq], :].copy()
        assert self.kv.save_seq_state(src, path, [(arr, 1)]) == len(src_seq)
        # llama.cpp: the destination sequence is replaced; all or nothing
        saved = [[c[0], set(c[1]), c[2]] for c in self.cells]
        for i, c in enumerate(self.cells):
            if dst in c[1]:
                c[1].discard(dst)
                if not c[1]:
                    self.m_clear_cell(i)
        free_before = {i for i, c in enumerate(self.cells) if not c[1]}
        target = np.zeros_like(arr)
        try:
            n = self.kv.load_seq_state(dst, path, [(target, 1)], timeout=0)
        except KVExhausted:
            # counting the cells only dst held, still too few: dst keeps its cells
            assert len(src_seq) > len(free_before)
            self.cells = saved
            return
        assert n == len(src_seq)
        cells, pos = self.kv.seq_cells(dst)
        assert set(cells.tolist()) <= free_before
        assert pos.tolist() == [p for p, _ in src_seq]
        for c, p in zip(cells.tolist(), pos.tolist(), strict=True):
            self.cells[c] = [p, {dst}, 0]
        assert np.array_equal(target[:, cells, :], rows)

    @rule()
    def clear(self):
        self.kv.clear()
        for i in range(N_CELLS):
            self.m_clear_cell(i)

    # ----------------------------------------------------------- invariants
    @invariant()
    def cells_match(self):
        pos, seqs = self.kv.cells_snapshot()
        for i, c in enumerate(self.cells):
            assert pos[i] == c[0], (i, pos[i], c)
            assert int(seqs[i]) == sum(1 << s for s in c[1]), (i, int(seqs[i]), c)

    @invariant()
    def counts_and_sequences_match(self):
        occ = self.kv.occupancy()
        used = [bool(c[1]) for c in self.cells]
        assert occ.used_cells == sum(used) == self.kv.used_cells
        assert occ.free_cells == N_CELLS - sum(used)
        assert occ.used_blocks == sum(any(used[b : b + BLOCK]) for b in range(0, N_CELLS, BLOCK))
        assert occ.bytes_used_per_chip == sum(used) * self.kv.bytes_per_token_per_chip
        per_seq = {}
        for c in self.cells:
            for s in c[1]:
                per_seq[s] = per_seq.get(s, 0) + 1
        assert occ.per_seq_tokens == tuple(sorted(per_seq.items()))
        for s in range(4):
            seq = self.m_seq(s)
            cells, pos = self.kv.seq_cells(s)
            assert list(zip(pos.tolist(), cells.tolist(), strict=True)) == seq
            assert self.kv.seq_pos_min(s) == (seq[0][0] if seq else -1)
            assert self.kv.seq_pos_max(s) == (max(p for p, _ in seq) if seq else -1)


KVMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVStateful = KVMachine.TestCase


# ----------------------------------------------------------------------------
# Garbage arguments: every public method either completes or raises a
# typed error, and a refused call leaves the full state dump unchanged.

from sim_backend.device.kv import MAX_TIMEOUT_S  # noqa: E402
from sim_backend.errors import KVArgumentError, RequestCancelled  # noqa: E402

G_CELLS = 32
_FILES = tempfile.TemporaryDirectory()  # read-only inputs shared by every example
_FILE_DIR = Path(_FILES.name)


def _make_state_files() -> dict[str, Path]:
    src = KVCacheManager(n_cells=G_CELLS)
    src.apply(0, 5, timeout=0)
    arr = np.arange(2 * G_CELLS * 3, dtype=np.float32).reshape(2, G_CELLS, 3)
    good = _FILE_DIR / "good.npz"
    src.save_seq_state(0, good, [(arr, 1)])
    empty = _FILE_DIR / "empty_arrays.npz"
    src.save_seq_state(0, empty)
    raw = good.read_bytes()
    (_FILE_DIR / "truncated.npz").write_bytes(raw[: len(raw) // 2])
    (_FILE_DIR / "junk.npz").write_bytes(b"PK\x03\x04" + bytes(range(200)))
    data = dict(np.load(good))
    data["positions"] = np.array([0, -1, 2, 3, 4])
    with open(_FILE_DIR / "negative.npz", "wb") as f:
        np.savez(f, **data)
    return {p.stem: p for p in _FILE_DIR.iterdir()}


_STATE_FILES = _make_state_files()

_SET = threading.Event()
_SET.set()
GARBAGE = st.one_of(
    st.none(), st.booleans(), st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70), st.text(max_size=3), st.binary(max_size=2),
    st.sampled_from([[], [1, 2], (0,), {0: 1}, np.int64(1), np.float64(1.0), np.bool_(True), np.array([1]),
                     complex(1, 0), object()]),
)


def mostly(valid, bad):
    """Valid about five times in six, so whole calls with several arguments often get through too."""
    return st.integers(0, 5).flatmap(lambda i: bad if i == 0 else valid)


SEQ_ARG = mostly(st.integers(0, 3), st.one_of(st.sampled_from([-1, 63, 64, 2**63, -(2**63)]), GARBAGE))
COUNT_ARG = mostly(st.integers(0, 12), st.one_of(st.sampled_from([-1, G_CELLS + 1, 2**62, 2**70]), GARBAGE))
POS_ARG = mostly(st.integers(-3, 40),
                 st.one_of(st.sampled_from([40959, 40960, 40961, -40960, -40961, 2**63 - 2, -(2**63), 2**70]),
                           GARBAGE))
TIMEOUT_ARG = mostly(st.sampled_from([0, 0.0, 0.001, np.float64(0)]),
                     st.sampled_from([-0.001, float("inf"), float("nan"), None, "0", True, MAX_TIMEOUT_S * 2]))
CANCEL_ARG = mostly(st.sampled_from([None, None, threading.Event(), _SET]), st.sampled_from(["set", 1, True]))
POSITIONS_ARG = st.one_of(st.lists(POS_ARG, max_size=6), st.lists(st.integers(0, 30), max_size=6),
                          st.sampled_from([np.array([1, 2]), np.array([0.5]), np.arange(3, dtype=np.uint8),
                                           np.array([[1]]), "ab", range(3)]), GARBAGE)


def _arrays_arg():
    rw = np.zeros((2, G_CELLS, 3), np.float32)
    ro = np.zeros((2, G_CELLS, 3), np.float32)
    ro.flags.writeable = False
    return mostly(st.sampled_from([(), [(rw, 1)], [(rw, -2)]]),
                  st.sampled_from([[(ro, 1)], [(rw, 1.0)], [(rw, 0)], [(np.zeros(5), 0)], [rw], "kv", None,
                                   [(rw, 1), (rw, 1)], [(rw.astype(np.float64), 1)]]))


LOAD_PATH = mostly(st.sampled_from([_STATE_FILES["good"], _STATE_FILES["empty_arrays"]]),
                   st.sampled_from(list(_STATE_FILES.values()) + [None, 42, "", "a\0b", _FILE_DIR, _FILE_DIR / "none",
                                                                  "x" * 300, "/proc/nope/x"]))


def _same(a: dict, b: dict, with_counters: bool) -> None:
    for k in ("pos", "seqs", "shift"):
        assert np.array_equal(a[k], b[k]), k
    assert a["epoch"] == b["epoch"]
    if with_counters:
        assert a["counters"] == b["counters"]


class KVGarbageMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(n_cells=G_CELLS, block_size=BLOCK)
        self.tmp = tempfile.TemporaryDirectory()

    def teardown(self) -> None:
        self.tmp.cleanup()

    def call(self, name: str, *args, **kw):
        before = self.kv.state_snapshot()
        try:
            result = getattr(self.kv, name)(*args, **kw)
        except KVArgumentError:
            event(f"{name}: refused")
            _same(self.kv.state_snapshot(), before, with_counters=True)
            return None
        except (KVExhausted, RequestCancelled) as e:
            event(f"{name}: {type(e).__name__}")
            _same(self.kv.state_snapshot(), before, with_counters=False)  # only the apply counters move
            return None
        event(f"{name}: done")
        return result

    @initialize()
    def some_cells(self):
        self.kv.apply(0, 6, timeout=0)
        self.kv.seq_cp(0, 1, 0, 3)
        self.kv.apply(2, 3, timeout=0, positions=[20, 21, 22])

    @rule(s=SEQ_ARG, n=COUNT_ARG, timeout=TIMEOUT_ARG, cancel=CANCEL_ARG)
    def apply(self, s, n, timeout, cancel):
        cells = self.call("apply", s, n, timeout=timeout, cancel=cancel)
        if cells is not None:
            assert cells.dtype == np.int64 and cells.size == n

    @rule(s=SEQ_ARG, positions=POSITIONS_ARG, n=st.one_of(st.none(), COUNT_ARG), timeout=TIMEOUT_ARG)
    def apply_positions(self, s, positions, n, timeout):
        if n is None:  # usually the matching count, so valid positions get through
            n = len(positions) if isinstance(positions, (list, range, np.ndarray)) else 1
        self.call("apply", s, n, timeout=timeout, positions=positions)

    @rule(n=COUNT_ARG)
    def can_allocate(self, n):
        r = self.call("can_allocate", n)
        assert r is None or isinstance(r, bool)

    @rule(s=SEQ_ARG)
    def free(self, s):
        self.call("free", s)

    @rule(s=SEQ_ARG, n=COUNT_ARG)
    def remove_tokens_at_end(self, s, n):
        self.call("remove_tokens_at_end", s, n)

    @rule(s=SEQ_ARG, p0=POS_ARG, p1=POS_ARG)
    def seq_rm(self, s, p0, p1):
        self.call("seq_rm", s, p0, p1)

    @rule(src=SEQ_ARG, dst=SEQ_ARG, p0=POS_ARG, p1=POS_ARG)
    def seq_cp(self, src, dst, p0, p1):
        self.call("seq_cp", src, dst, p0, p1)

    @rule(s=SEQ_ARG)
    def seq_keep(self, s):
        self.call("seq_keep", s)

    @rule(s=SEQ_ARG, p0=POS_ARG, p1=POS_ARG, delta=POS_ARG)
    def seq_add(self, s, p0, p1, delta):
        self.call("seq_add", s, p0, p1, delta)

    @rule(s=SEQ_ARG, p0=POS_ARG, p1=POS_ARG, d=POS_ARG)
    def seq_div(self, s, p0, p1, d):
        self.call("seq_div", s, p0, p1, d)

    @rule(s=SEQ_ARG, which=st.sampled_from(["seq_pos_min", "seq_pos_max", "seq_cells"]))
    def queries(self, s, which):
        self.call(which, s)

    @rule(which=st.sampled_from(["take_shift", "occupancy", "counters", "cells_snapshot", "clear"]))
    def no_arguments(self, which):
        self.call(which)
        assert isinstance(self.kv.has_shift, bool)

    @rule(s=SEQ_ARG, arrays=_arrays_arg(),
          where=mostly(st.just("ok"), st.sampled_from([None, 42, "", "a\0b", "dir", "missing/x", "x" * 300])))
    def save_seq_state(self, s, arrays, where):
        base = Path(self.tmp.name)
        path = {"ok": base / "s.npz", "dir": base, "missing/x": base / "missing" / "x"}.get(where, where)
        self.call("save_seq_state", s, path, arrays)
        assert not any(p.name.endswith(".tmp") for p in base.iterdir())

    @rule(s=SEQ_ARG, path=LOAD_PATH, arrays=_arrays_arg(), timeout=TIMEOUT_ARG, cancel=CANCEL_ARG)
    def load_seq_state(self, s, path, arrays, timeout, cancel):
        self.call("load_seq_state", s, path, arrays, timeout=timeout, cancel=cancel)

    @invariant()
    def cells_well_formed(self):
        d = self.kv.state_snapshot()
        used = d["seqs"] != 0
        assert ((d["pos"][used] >= 0) & (d["pos"][used] < self.kv.n_ctx)).all()
        assert (d["pos"][~used] == -1).all() and (d["shift"][~used] == 0).all()
        assert (np.abs(d["shift"]) < self.kv.n_ctx).all()


KVGarbageMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVGarbage = KVGarbageMachine.TestCase
