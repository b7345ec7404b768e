"""Continuous batching on a batch-N variant calbin (C3): decode steps carry up to N sequences, which
join and leave between steps; prefill stays batch 1; cancel, EOS, stop strings, KV reclaim and
fairness behave as at batch 1.

Scripted part: a real ``SimulatedBoard`` whose model is a fake that maps the FED token to the
next one (a per-request chain, so riders of one step get different tokens) and whose cost model
prices a batched decode step at a fixed simulated time; host work is free (ScriptedHostTimer(0)).
Real part: the shipped b8 variant with numerics, against the production bundle.
No assertion depends on wall time.
"""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.bundle.manifest import DEFAULT_BUNDLE_DIR, load_bundle
from sim_backend.device.board import BatchJobRow, SimulatedBoard
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.errors import SubmitError
from sim_backend.model.numerics import StepNumerics
from sim_backend.model.vocab import IM_END
from sim_backend.planes import ChatRequest, SamplingParams
from sim_backend.runtime.session import RuntimeSession
from sim_backend.serving.engine import Engine
from sim_backend.serving.hosttime import ScriptedHostTimer
from tests.serving.test_engine_scripted import TOK, VOCAB, FakeCost, FakeCostModel, Gate

B8 = DEFAULT_BUNDLE_DIR.parent / "qwen3-30b-a3b-b8"
B4 = DEFAULT_BUNDLE_DIR.parent / "qwen3-30b-a3b-b4"


class BatchFakeCost(FakeCostModel):
    """Decode batch of N = ``decode_us`` x (1 + 0.25 (N - 1)) simulated µs; records every batch's pasts."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.batches: list[list[int]] = []

    def price_decode_batch(self, shape, past_lens, experts_touched=None, chip_scale=None):
        self.batches.append(list(past_lens))
        total = self.decode_us * (1 + 0.25 * (len(past_lens) - 1))
        return FakeCost("decode", len(past_lens), max(past_lens), 1_000.0, total - 3_000.0, 2_000.0, total)


class ChainModel:
    """Logits one-hot on ``chain[fed token]`` (else ``default``): each request follows its own chain."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.chain: dict[int, int] = {}
        self.default = TOK.encode(" x")[0]
        self.chips: list = []

    def forward(self, tokens, positions, new_cells, ctx_cells, ctx_positions):
        self.gate.enter(("prefill" if tokens.shape[0] > 1 else "decode", -1, int(positions[-1])))
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[self.chain.get(int(tokens[-1]), self.default)] = 50.0
        return StepNumerics(logits=logits, experts_touched=[])


class ChainBoard(SimulatedBoard):
    gate: Gate

    def load_model(self) -> float:
        self.gate = getattr(self, "gate", None) or Gate()
        self.model = ChainModel(self.gate)
        self._memory_cleared = False
        return 0.0


@pytest.fixture
def harness():
    made = []

    def make(bundle_dir=B8, **kw):
        cost = BatchFakeCost(prefill_us=100_000.0, decode_us=20_000.0)
        board = ChainBoard(load_bundle(bundle_dir), cost, numerics=True, pacing=Pacing(PacingMode.FAST),
                           kv_cells=kw.pop("kv_cells", None))
        kw.setdefault("host_timer", ScriptedHostTimer(0.0))
        kw.setdefault("host_time", "measured")  # host work free: batched step prices alone on the clock
        eng = Engine(RuntimeSession(board, parallel=kw.get("max_inflight", 1) > 1), **kw)
        made.append((board, eng))
        return board, eng, cost

    yield make
    for board, eng in made:
        board.gate.open()
        eng.close()
        board.close()


def req(last: int, max_tokens: int = 8, stop: tuple[str, ...] = (), prompt_len: int = 4) -> ChatRequest:
    toks = tuple([100 + i for i in range(prompt_len - 1)] + [last])
    return ChatRequest(messages=(), prompt_tokens=toks, max_tokens=max_tokens, stop=stop,
                       sampling=SamplingParams.greedy(seed=1))


def chain(model: ChainModel, start: int, seq: list[int]) -> None:
    prev = start
    for t in seq:
        model.chain[prev] = t
        prev = t


WORDS = ("apple river stone cloud green house water light table paper music horse bread chair glass night")


def words(n: int, half: int) -> list[int]:
    """``n`` distinct single-token words from one half of WORDS (0 or 1), so two chains never share a token."""
    ws = WORDS.split()[half * 8:(half + 1) * 8][:n]
    out = [TOK.encode(" " + w) for w in ws]
    assert all(len(ids) == 1 for ids in out) and len(out) == n
    return [ids[0] for ids in out]


def test_decode_steps_carry_up_to_n(harness):
    board, eng, cost = harness(n_slots=12)
    assert eng.decode_batch == 8
    hs = [eng.submit(req(1000 + i, max_tokens=10)) for i in range(12)]
    rs = [h.result(30) for h in hs]
    assert all(r.status == "finished" and r.stop_type == "limit" and len(r.tokens) == 10 for r in rs)
    occ = [b["occupancy"] for b in eng.batch_log]
    assert max(occ) == 8 and all(1 <= o <= 8 for o in occ)
    for b in eng.batch_log:
        assert len(set(b["slots"])) == len(b["slots"]) == b["occupancy"] and b["capacity"] == 8
    # every decode went through a batched job; prefill stayed batch 1 (its own submissions)
    assert sum(len(b) for b in cost.batches) == sum(len(r.tokens) - 1 for r in rs)
    assert all(kind == "prefill" for kind, _, _ in cost.calls)
    assert board.accounting_problems() == []


def test_riders_get_their_own_tokens_and_pasts(harness):
    board, eng, cost = harness(n_slots=4)
    a, b = words(6, 0), words(6, 1)
    chain(board.model, 1000, a)
    chain(board.model, 2000, b)
    ra = eng.submit(req(1000, max_tokens=6))
    rb = eng.submit(req(2000, max_tokens=6, prompt_len=30))
    x, y = ra.result(30), rb.result(30)
    assert list(x.tokens) == a and list(y.tokens) == b
    both = [p for p in cost.batches if len(p) == 2]
    # each rider at its own context: b's prompt is 26 longer, and it joined one step after a
    assert both and all(p[0] - p[1] == 25 for p in both)


def test_join_and_leave_between_steps(harness):
    board, eng, cost = harness(n_slots=4)
    short = eng.submit(req(1000, max_tokens=3))
    long_ = eng.submit(req(2000, max_tokens=12))
    assert short.result(30).status == "finished" and long_.result(30).status == "finished"
    occ = [b["occupancy"] for b in eng.batch_log]
    assert 2 in occ and occ[-1] == 1  # rode together, then the long one alone after the short one left
    late = eng.submit(req(3000, max_tokens=4))
    assert late.result(30).status == "finished"


def test_eos_and_stop_string_per_rider(harness):
    board, eng, _ = harness(n_slots=4)
    chain(board.model, 1000, words(2, 0) + [IM_END])
    stop_toks = [TOK.encode(" hello")[0], TOK.encode(" STOP")[0], TOK.encode(" never")[0]]
    chain(board.model, 2000, stop_toks)
    r_eos = eng.submit(req(1000, max_tokens=10))
    r_word = eng.submit(req(2000, max_tokens=10, stop=("STOP",)))
    r_lim = eng.submit(req(3000, max_tokens=5))
    e, w, lim = r_eos.result(30), r_word.result(30), r_lim.result(30)
    assert e.stop_type == "eos" and len(e.tokens) == 3 and e.tokens[-1] == IM_END
    assert w.stop_type == "word" and w.stopping_word == "STOP" and "STOP" not in w.text and "never" not in w.text
    assert lim.stop_type == "limit" and len(lim.tokens) == 5
    assert max(b["occupancy"] for b in eng.batch_log) >= 2


def test_cancel_one_rider_frees_its_kv(harness):
    board, eng, _ = harness(n_slots=4)
    board.gate.block()
    hs = [eng.submit(req(1000 + i, max_tokens=50)) for i in range(3)]
    board.gate.allow(3)  # the three prefills
    board.gate.wait_blocked("decode")
    seq = None
    for s in eng.slots:
        if s.req is not None and s.req.id == hs[1].id:
            seq = s.seq_id
    hs[1].cancel("client went away")
    board.gate.open()
    rs = [h.result(30) for h in hs]
    assert rs[1].status == "cancelled" and rs[0].status == rs[2].status == "finished"
    assert len(rs[0].tokens) == len(rs[2].tokens) == 50
    assert seq is not None and board.kv.seq_cells(seq)[0].shape[0] == 0
    assert board.accounting_problems() == []


def test_long_prompt_does_not_block_short_ones(harness):
    """Fairness: while a long prompt prefills in chunks, short requests prefill between its chunks and
    decode batched; nobody starves."""
    board, eng, _ = harness(n_slots=4, prefill_chunk=64)
    long_ = eng.submit(req(1000, max_tokens=4, prompt_len=600))
    shorts = [eng.submit(req(2000 + i, max_tokens=6)) for i in range(3)]
    rs = [h.result(30) for h in shorts]
    lr = long_.result(30)
    assert all(r.status == "finished" for r in rs) and lr.status == "finished"
    assert max(r.timings.ttft_ms for r in rs) < lr.timings.ttft_ms
    assert max(r.timings.done_ms for r in rs) < lr.timings.done_ms


def test_kv_pressure_with_batching(harness):
    board, eng, _ = harness(n_slots=4, kv_cells=48, kv_timeout_s=0.5)
    hs = [eng.submit(req(1000 + i, max_tokens=20)) for i in range(4)]
    rs = [h.result(30) for h in hs]
    done = [r for r in rs if r.status == "finished"]
    failed = [r for r in rs if r.status == "failed"]
    assert done and len(done) + len(failed) == 4
    assert all(r.error and r.error["type"] in ("exceed_context_size_error", "unavailable_error", "kv_exhausted")
               or r.error for r in failed)
    assert board.accounting_problems() == []
    # reclaimed: nothing is held but finished requests' prefix caches
    held = sum(board.kv.seq_cells(s.seq_id)[0].shape[0] for s in eng.slots)
    assert held <= 48 and eng.active_count() == 0


def test_batch1_bundle_never_batches(harness):
    board, eng, cost = harness(bundle_dir=DEFAULT_BUNDLE_DIR, n_slots=4)
    assert eng.decode_batch == 1
    hs = [eng.submit(req(1000 + i, max_tokens=5)) for i in range(4)]
    assert all(h.result(30).status == "finished" for h in hs)
    assert not eng.batch_log and not cost.batches


def test_overlap_with_batching(harness):
    board, eng, cost = harness(bundle_dir=B4, n_slots=6, max_inflight=2)
    hs = [eng.submit(req(1000 + i, max_tokens=8)) for i in range(6)]
    rs = [h.result(30) for h in hs]
    assert all(r.status == "finished" and len(r.tokens) == 8 for r in rs)
    assert max(b["occupancy"] for b in eng.batch_log) <= 4


def test_runtime_refuses_bad_batches():
    board = SimulatedBoard(load_bundle(B4), BatchFakeCost(), numerics=False, pacing=Pacing(PacingMode.FAST))
    prod = SimulatedBoard(load_bundle(), BatchFakeCost(), numerics=False, pacing=Pacing(PacingMode.FAST))
    try:
        rt = RuntimeSession(board)
        assert rt.decode_batch == 4
        kv = rt.kv
        rows = []
        for seq in range(5):
            cells = kv.apply(seq, 1, timeout=0.0, positions=np.array([0]))
            rows.append((seq, 7, 0, int(cells[0]), False))
        with pytest.raises(SubmitError, match="1..4"):
            rt.step_batch(rows)
        with pytest.raises(SubmitError, match="only once"):
            rt.step_batch([rows[0], rows[0]])
        with pytest.raises(SubmitError, match="not cells of sequence"):
            rt.step_batch([(0, 7, 0, int(rows[1][3]), False)])
        res = rt.step_batch(rows[:3]).wait(10)
        assert [r.seq_id for r in res.batch] == [0, 1, 2] and res.n_tokens == 1
        assert rt.pool.wait_all_free(1.0) == rt.pool.size  # the buffer pair came back
        rt1 = RuntimeSession(prod)
        assert rt1.decode_batch == 1
        c = rt1.kv.apply(0, 1, timeout=0.0, positions=np.array([0]))
        with pytest.raises(SubmitError, match="batch 1"):
            rt1.step_batch([(0, 7, 0, int(c[0]), False)])
        with pytest.raises(SubmitError, match="batch 1"):
            prod.submit_batch([BatchJobRow(0, np.array([7]), np.array([0]), np.array([int(c[0])]),
                                           np.array([int(c[0])]), np.array([0]), 0, False)])
    finally:
        board.close()
        prod.close()


@pytest.mark.slow
def test_real_b8_numerics_match_batch1(make_system):
    """The b8 variant runs each rider's real numerics: greedy tokens equal the production bundle's."""
    msgs = [({"role": "user", "content": f"count to {i}"},) for i in range(4)]

    def run(bundle_dir):
        s = make_system(bundle_dir=bundle_dir, n_slots=4, maintenance=False)
        hs = [s.engine.submit(ChatRequest(messages=m, max_tokens=6, sampling=SamplingParams.greedy(seed=3)))
              for m in msgs]
        out = [h.result(120).tokens for h in hs]
        snap = s.observation.snapshot()
        return out, snap

    prod, _ = run(None)
    b8, snap = run(B8)
    assert b8 == prod
    assert snap.device.decode_batch == 8 and snap.device.bundle_status == "C3" and "batch-8" in snap.device.bundle_label
    assert max(b.occupancy for b in snap.decode_batches) == 4
    assert snap.last_decode.batch_seq_ids
    again = type(snap).from_dict(snap.to_dict())
    assert again.decode_batches == snap.decode_batches
