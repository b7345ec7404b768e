"""Stateful property test: KVCacheManager vs a plain-Python llama.cpp-style reference.

The reference is a list of cells, each ``[pos, set(seq_ids), shift]``, with the
semantics of llama.cpp's ``llama_kv_cells_unified`` written the obvious,
slow way. Which free cells ``apply`` picks is the manager's choice, so the
model takes the cells the manager returned (after checking they were free)
and from then on every cell must match exactly.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from sim_backend.errors import KVExhausted
from sim_backend.kv import KVCacheManager

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
        for c, p in zip(cells.tolist(), pos):
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
        assert dict(zip(cells.tolist(), shift.tolist())) == want
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
        # llama.cpp: the destination sequence is replaced; all or nothing (issue 9)
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
        for c, p in zip(cells.tolist(), pos.tolist()):
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
            assert list(zip(pos.tolist(), cells.tolist())) == seq
            assert self.kv.seq_pos_min(s) == (seq[0][0] if seq else -1)
            assert self.kv.seq_pos_max(s) == (max(p for p, _ in seq) if seq else -1)


KVMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVStateful = KVMachine.TestCase
