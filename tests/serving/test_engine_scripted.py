"""Engine on a scripted board: exact metric definitions, stop rules, streaming, cancel, scheduling.

The board is a real ``SimulatedBoard`` whose model is replaced by a fake that
returns one-hot logits for scripted tokens (so the real sampler picks them)
and whose cost model prices every prefill step at a fixed simulated time and
every decode step at another. With ``ScriptedHostTimer(0)`` host work is
free, so every timing is exact simulated arithmetic. A gate in the fake
model can hold the device inside a step, to cancel requests in a known state.
No assertion here depends on wall time.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from sim_backend.device.board import SimulatedBoard
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.errors import UnavailableError
from sim_backend.model.numerics import StepNumerics
from sim_backend.model.tokenizer import get_tokenizer
from sim_backend.model.vocab import IM_END
from sim_backend.planes import SLO, ChatRequest, DoneEvent, SamplingParams, TokenEvent
from sim_backend.runtime.session import RuntimeSession
from sim_backend.serving.api import RequestState
from sim_backend.serving.engine import Engine
from sim_backend.serving.hosttime import ScriptedHostTimer

TOK = get_tokenizer()
VOCAB = 151936


# --- fakes -----------------------------------------------------------------------------


@dataclass
class FakeCost:
    """StepCost-like result (simulated µs)."""

    kind: str
    n_tokens: int
    past_len: int
    h2d_us: float
    infer_us: float
    d2h_us: float
    total_us: float
    layer_chip_us: np.ndarray = field(default_factory=lambda: np.zeros((48, 2)))
    layer_chip_category_us: np.ndarray = field(default_factory=lambda: np.zeros((48, 2, 1)))
    categories: tuple = ("matmul",)
    global_us: float = 0.0

    @property
    def slowest_category_per_layer(self) -> list[str]:
        return ["matmul"] * 48


class FakeCostModel:
    """Prefill step = ``prefill_us`` (+ ``prefill_us_per_token`` x n); decode step = ``decode_us``.

    Each step is split h2d 1 ms / infer / d2h 2 ms (simulated)."""

    def __init__(self, prefill_us: float = 400_000.0, decode_us: float = 25_000.0,
                 prefill_us_per_token: float = 0.0) -> None:
        self.prefill_us = prefill_us
        self.decode_us = decode_us
        self.prefill_us_per_token = prefill_us_per_token
        self.calls: list[tuple[str, int, int]] = []

    def price_step(self, shape, kind, n_tokens, past_len, experts_touched=None, chip_scale=None):
        self.calls.append((kind, n_tokens, past_len))
        total = (self.prefill_us + self.prefill_us_per_token * n_tokens) if kind == "prefill" else self.decode_us
        h2d, d2h = 1_000.0, 2_000.0
        return FakeCost(kind, n_tokens, past_len, h2d, total - h2d - d2h, d2h, total)


class Gate:
    """Holds the device thread inside a step until permitted (permits None = open)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self.permits: int | None = None
        self.waiting: tuple[str, int, int] | None = None  # (kind, seq_id, last position)
        self.passed = 0

    def block(self) -> None:
        with self._cv:
            self.permits = 0

    def allow(self, n: int = 1) -> None:
        with self._cv:
            self.permits = (self.permits or 0) + n
            self._cv.notify_all()

    def open(self) -> None:
        with self._cv:
            self.permits = None
            self._cv.notify_all()

    def enter(self, info: tuple[str, int, int]) -> None:
        deadline = time.monotonic() + 30
        with self._cv:
            while self.permits == 0:
                self.waiting = info
                self._cv.notify_all()
                if not self._cv.wait(max(0.0, deadline - time.monotonic())):
                    break
            self.waiting = None
            self.passed += 1
            if self.permits:
                self.permits -= 1
            self._cv.notify_all()

    def wait_blocked(self, kind: str | None = None, step: int | None = None,
                     timeout: float = 10.0) -> tuple[str, int, int]:
        """Wait until the device is held in a step (of ``kind``; the ``step``-th one, 0-based)."""
        with self._cv:
            ok = self._cv.wait_for(lambda: self.waiting is not None and (kind is None or self.waiting[0] == kind)
                                   and (step is None or self.passed == step), timeout)
            assert ok, f"device never blocked in a {kind or 'any'} step (waiting={self.waiting})"
            return self.waiting


class FakeModel:
    """ShardedModel stand-in: logits one-hot on ``by_pos[last position]`` (else ``default``)."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.by_pos: dict[int, int] = {}
        self.default = TOK.encode(" x")[0]
        self.chips = []

    def forward(self, tokens, positions, new_cells, ctx_cells, ctx_positions):
        last = int(positions[-1])
        self.gate.enter(("prefill" if tokens.shape[0] > 1 else "decode", -1, last))
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[self.by_pos.get(last, self.default)] = 50.0
        return StepNumerics(logits=logits, experts_touched=[])


class ScriptedBoard(SimulatedBoard):
    """A SimulatedBoard with the fake model (numerics "on": logits exist, from the script)."""

    gate: Gate

    def load_model(self) -> float:
        self.gate = getattr(self, "gate", None) or Gate()
        self.model = FakeModel(self.gate)
        self._memory_cleared = False
        return 0.0


class Harness:
    def __init__(self, bundle, *, cost: FakeCostModel | None = None, host_step_us: float = 0.0, **engine_kw):
        self.cost = cost or FakeCostModel()
        self.board = ScriptedBoard(bundle, self.cost, numerics=True, pacing=Pacing(PacingMode.FAST))
        self.gate = self.board.gate
        self.model: FakeModel = self.board.model
        engine_kw.setdefault("host_timer", ScriptedHostTimer(host_step_us))
        engine_kw.setdefault("host_time", "measured")  # the scripted timer's work is what is booked
        self.engine = Engine(RuntimeSession(self.board, parallel=engine_kw.get("max_inflight", 1) > 1), **engine_kw)

    def script(self, req: ChatRequest, tokens: list[int]) -> int:
        """Make the model produce ``tokens`` after ``req``'s prompt; returns the prompt length."""
        p = len(self.engine.tokenize_prompt(req))
        for i, t in enumerate(tokens):
            self.model.by_pos[p - 1 + i] = t
        return p

    def close(self) -> None:
        self.gate.open()
        self.engine.close()
        self.board.close()


@pytest.fixture
def make(bundle):
    made: list[Harness] = []

    def _make(**kw) -> Harness:
        h = Harness(bundle, **kw)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.close()


def ids(text: str) -> list[int]:
    return TOK.encode(text)


def words(*pieces: str) -> list[int]:
    """One token per piece (asserted), so the test controls token boundaries."""
    out = []
    for p in pieces:
        t = TOK.encode(p)
        assert len(t) == 1, (p, t)
        out += t
    return out


def byte_token(b: int) -> int:
    return TOK._table.index(bytes([b]))


def run(h: Harness, req: ChatRequest, tokens: list[int] | None = None, timeout: float = 30.0):
    if tokens is not None:
        h.script(req, tokens)
    handle = h.engine.submit(req)
    events = list(handle.stream(timeout=timeout))
    assert isinstance(events[-1], DoneEvent)
    pieces = [e for e in events if isinstance(e, TokenEvent)]
    return events[-1].result, pieces


GREEDY = SamplingParams.greedy()


# --- metric definitions on a scripted clock ---------------------------------------------


def test_ttft_itl_tpot_e2e_exact_on_scripted_clock(make):
    """Prefill 400 ms, then a token every 25 ms: TTFT 400, ITL all 25, TPOT 25, E2E 400 + 25 (n-1)."""
    h = make()
    req = ChatRequest.from_prompt("hi", max_tokens=5, sampling=GREEDY)
    res, pieces = run(h, req, words("A", " b", " c", " d", " e"))
    t = res.timings
    assert res.status == "finished" and res.stop_type == "limit" and res.text == "A b c d e"
    assert [p.text for p in pieces] == ["A", " b", " c", " d", " e"]
    assert t.ttft_ms == 400.0
    assert t.itl_ms == (25.0, 25.0, 25.0, 25.0)
    assert t.tpot_ms == 25.0
    assert t.e2e_ms == 500.0
    assert t.queue_ms == 0.0
    # llama.cpp timings: prompt_ms = prefill start -> first token; predicted_ms = first -> last token,
    # over the n - 1 decode steps after the first token (llama-server's predicted_per_* say so)
    assert t.prompt_n == len(h.engine.tokenize_prompt(req)) and t.cache_n == 0
    assert t.prompt_ms == 400.0
    assert t.prompt_per_token_ms == pytest.approx(400.0 / t.prompt_n)
    assert t.prompt_per_second == pytest.approx(1e3 * t.prompt_n / 400.0)
    assert t.predicted_n == 5 and t.predicted_ms == 100.0
    assert t.predicted_per_token_ms == 25.0 and t.predicted_per_second == 40.0 == 1e3 / t.tpot_ms
    # F7: the old CSV's "TTFT" (prompt_ms + predicted_ms) is the whole generation, not TTFT
    assert t.prompt_ms + t.predicted_ms == t.e2e_ms != t.ttft_ms
    # device parts (simulated): 5 steps x (1 ms h2d, 2 ms d2h)
    assert t.device_ms["h2d"] == 5.0 and t.device_ms["d2h"] == 10.0
    assert t.device_ms["infer"] == pytest.approx(397.0 + 4 * 22.0)
    assert all(v == 0.0 for v in t.host_ms.values())
    assert [p.sim_ms for p in pieces] == [t.arrival_ms + x for x in (400.0, 425.0, 450.0, 475.0, 500.0)]
    s = h.engine.metrics.summary()
    assert s["latency_ms"]["ttft"]["p50"] == 400.0 and s["latency_ms"]["itl"]["p99"] == 25.0
    assert s["latency_ms"]["tpot"]["mean"] == 25.0 and s["latency_ms"]["e2e"]["p95"] == 500.0


def test_single_token_has_no_tpot_and_no_itl(make):
    h = make()
    res, _ = run(h, ChatRequest.from_prompt("hi", max_tokens=1, sampling=GREEDY), words("A"))
    t = res.timings
    assert (t.ttft_ms, t.tpot_ms, t.itl_ms, t.e2e_ms) == (400.0, None, (), 400.0)
    assert t.predicted_n == 1 and t.predicted_ms == 0.0
    assert t.predicted_per_second == 0.0 and t.predicted_per_token_ms == 0.0  # llama-server's numbers, never null


def test_host_work_is_on_the_clock(make):
    """With a scripted host clock (every reading +7 µs) TTFT = device time + all host work before it."""
    h = make(host_step_us=7.0)
    res, _ = run(h, ChatRequest.from_prompt("hi", max_tokens=1, sampling=GREEDY), words("A"))
    t = res.timings
    host = sum(t.host_ms.values())
    assert host > 0 and set(t.host_ms) == {"tokenize", "sampling", "detokenize", "kv_wait", "framework"}
    assert t.ttft_ms == pytest.approx(400.0 + host)
    assert t.e2e_ms == pytest.approx(400.0 + host)
    res, _ = run(h, ChatRequest.from_prompt("hello", max_tokens=4, sampling=GREEDY),
                 words("A", " b", " c", " d"))
    t = res.timings
    assert t.e2e_ms == pytest.approx(400.0 + 3 * 25.0 + sum(t.host_ms.values()))
    assert min(t.itl_ms) > 25.0  # each gap includes that step's host work


def test_stage_times_per_step(make):
    """F8 stages: device (h2d, infer, d2h) simulated; host (tokenize, kv_wait, sampling, detokenize, framework)."""
    h = make(host_step_us=5.0)
    res, _ = run(h, ChatRequest.from_prompt("hi", max_tokens=3, sampling=GREEDY), words("A", " b", " c"))
    steps = [s for s in h.engine.stage_history if s.request_id == res.request_id]
    assert [s.kind for s in steps] == ["prefill", "decode", "decode"]
    for s in steps:
        assert (s.h2d_ms, s.d2h_ms) == (1.0, 2.0)
        assert s.infer_ms == (397.0 if s.kind == "prefill" else 22.0)
        assert s.sampling_ms > 0 and s.detokenize_ms > 0 and s.kv_wait_ms > 0 and s.framework_ms > 0
    assert steps[0].tokenize_ms == res.timings.host_ms["tokenize"] > 0
    assert steps[1].tokenize_ms == steps[2].tokenize_ms == 0.0
    # per-request host breakdown is the sum of its steps
    for name in ("sampling", "detokenize", "kv_wait", "framework"):
        assert res.timings.host_ms[name] == pytest.approx(sum(getattr(s, f"{name}_ms") for s in steps))
    summ = h.engine.stage_summary()
    assert summ["decode"]["infer"]["p50"] == 22.0 and summ["prefill"]["h2d"]["n"] == 1
    assert h.engine.last_stage["decode"] is steps[-1]


def test_goodput_against_slo(make):
    """vLLM goodput: requests meeting every SLO / span. TTFT 400 meets ttft<=400, fails ttft<=399."""
    h = make(slo=SLO(ttft_ms=400.0, tpot_ms=25.0))
    run(h, ChatRequest.from_prompt("hi", max_tokens=3, sampling=GREEDY), words("A", " b", " c"))
    g = h.engine.metrics.summary()["goodput"]
    assert g["good_requests"] == 1 and g["span_s"] == 0.45
    assert g["requests_per_s"] == pytest.approx(1 / 0.45) and g["tokens_per_s"] == pytest.approx(3 / 0.45)
    assert h.engine.slo == SLO(ttft_ms=400.0, tpot_ms=25.0)
    h2 = make(slo=SLO(ttft_ms=399.0))
    run(h2, ChatRequest.from_prompt("hi", max_tokens=3, sampling=GREEDY), words("A", " b", " c"))
    assert h2.engine.metrics.summary()["goodput"]["good_requests"] == 0


# --- stop rules and streaming ------------------------------------------------------------


def test_eos_stop_counts_token_prints_nothing(make):
    h = make()
    res, pieces = run(h, ChatRequest.from_prompt("hi", max_tokens=10, sampling=GREEDY),
                      words("A", " b") + [IM_END])
    assert res.stop_type == "eos" and res.text == "A b" and res.tokens[-1] == IM_END
    assert res.timings.predicted_n == 3 and "".join(p.text for p in pieces) == "A b"
    assert res.timings.e2e_ms == 450.0 and res.timings.tpot_ms == 25.0


def test_eos_first_token_still_has_ttft(make):
    h = make()
    res, pieces = run(h, ChatRequest.from_prompt("hi", max_tokens=10, sampling=GREEDY), [IM_END])
    assert res.stop_type == "eos" and res.text == "" and pieces == []
    assert res.timings.ttft_ms == 400.0 and res.timings.predicted_n == 1


def test_stop_word_split_across_tokens_is_held_back(make):
    h = make()
    req = ChatRequest.from_prompt("hi", max_tokens=20, sampling=GREEDY, stop=("STOP",))
    res, pieces = run(h, req, words("Hello", " S", "TO", "P", " world"))
    assert res.stop_type == "word" and res.stopping_word == "STOP"
    assert res.text == "Hello " and "".join(p.text for p in pieces) == "Hello "
    assert not any("S" in p.text for p in pieces)  # no part of the stop string ever shown
    assert res.timings.predicted_n == 4  # the token completing the stop string counts


def test_stop_word_inside_one_token_drops_the_rest(make):
    h = make()
    req = ChatRequest.from_prompt("hi", max_tokens=20, sampling=GREEDY, stop=("lo w",))
    res, pieces = run(h, req, words("Hel", "lo", " world", "!"))
    assert res.stop_type == "word" and res.text == "Hel" and "".join(p.text for p in pieces) == "Hel"


def test_held_prefix_released_when_it_stops_matching(make):
    h = make()
    req = ChatRequest.from_prompt("hi", max_tokens=5, sampling=GREEDY, stop=("STOP",))
    res, pieces = run(h, req, words("Hello", " S", "TO", "RM", "!"))
    texts = [p.text for p in pieces]
    assert res.stop_type == "limit" and res.text == "Hello STORM!"
    assert "".join(texts) == res.text
    assert texts == ["Hello", " ", "STORM", "!"]  # "S", "STO" were held until they stopped matching


@pytest.mark.parametrize("end", ["limit", "eos"])
def test_held_text_flushed_when_generation_ends_otherwise(make, end):
    h = make()
    toks = words("Hello", " S", "TO")
    if end == "eos":
        toks.append(IM_END)
    req = ChatRequest.from_prompt("hi", max_tokens=3 if end == "limit" else 10, sampling=GREEDY, stop=("STOP",))
    res, pieces = run(h, req, toks)
    assert res.stop_type == end and res.text == "Hello STO"
    assert "".join(p.text for p in pieces) == res.text
    # the flushed text arrives with the last step, not as a separate zero-gap piece
    assert [p.text for p in pieces] == ["Hello", " ", "STO"]
    assert 0.0 not in res.timings.itl_ms


def test_stop_type_none_when_cancelled(make):
    h = make()
    h.gate.block()
    handle = h.engine.submit(ChatRequest.from_prompt("hi", max_tokens=50, sampling=GREEDY))
    h.gate.wait_blocked("prefill")
    handle.cancel("test")
    h.gate.open()
    res = handle.result(10)
    assert (res.status, res.stop_type, res.error["type"]) == ("cancelled", "none", "cancelled")


def test_emoji_from_byte_tokens_never_split(make):
    """😀 = F0 9F 98 80, fed as four single-byte tokens: it is shown whole, in one piece."""
    h = make()
    emoji = [byte_token(b) for b in "😀".encode()]
    assert len(emoji) == 4 and all(TOK.token_bytes(t) for t in emoji)
    toks = words("a") + emoji + words("b") + [byte_token(b) for b in "é".encode()] + words("c")
    res, pieces = run(h, ChatRequest.from_prompt("hi", max_tokens=len(toks), sampling=GREEDY), toks)
    texts = [p.text for p in pieces]
    assert res.text == "a😀béc" and "".join(texts) == res.text
    assert texts == ["a", "😀", "b", "é", "c"]
    assert not any("\ufffd" in t for t in texts)
    # pieces appear only when a character completes: ITL has 50 / 100 ms gaps, never a half character
    assert res.timings.itl_ms == (100.0, 25.0, 50.0, 25.0)


def test_emoji_cut_by_limit_becomes_one_replacement_character(make):
    h = make()
    toks = words("a") + [byte_token(b) for b in "😀".encode()][:2]
    res, pieces = run(h, ChatRequest.from_prompt("hi", max_tokens=3, sampling=GREEDY), toks)
    assert res.stop_type == "limit" and res.text == "a\ufffd" and "".join(p.text for p in pieces) == res.text


def test_stop_string_after_emoji(make):
    h = make()
    toks = [byte_token(b) for b in "😀".encode()] + words("END", "more")
    req = ChatRequest.from_prompt("hi", max_tokens=20, sampling=GREEDY, stop=("END",))
    res, pieces = run(h, req, toks)
    assert res.stop_type == "word" and res.text == "😀" and [p.text for p in pieces] == ["😀"]


def test_context_end_stops_with_limit(make):
    """A prompt that fits generates until prompt + generated reach n_ctx; then stop type limit."""
    req = ChatRequest.from_prompt("hi", max_tokens=10, sampling=GREEDY)
    p = len(make().engine.tokenize_prompt(req))
    h = make(n_ctx=p + 3)  # an engine with a shorter context than the calbin's: room for 3 tokens in all
    assert h.script(req, words("A", " b", " c")) == p
    res, _ = run(h, req)
    assert res.stop_type == "limit" and res.timings.predicted_n == 3


# --- cancel in every state -----------------------------------------------------------------


def _kv_seq_cells(h: Harness, seq: int) -> int:
    return dict(h.board.kv.occupancy().per_seq_tokens).get(seq, 0)


def test_cancel_queued_takes_nothing(make):
    h = make(n_slots=1)
    h.gate.block()
    a = h.engine.submit(ChatRequest.from_prompt("first", max_tokens=3, sampling=GREEDY))
    h.gate.wait_blocked("prefill")
    b = h.engine.submit(ChatRequest.from_prompt("second", max_tokens=3, sampling=GREEDY))
    assert b.state is RequestState.QUEUED
    used = h.board.kv.used_cells
    jobs = h.board.counters().submitted
    ttft_n = h.engine.metrics.summary()["latency_ms"]["ttft"]["n"]
    b.cancel("changed my mind")
    res = b.result(5)  # ends at once, while the device is still held in a's step
    assert res.status == "cancelled" and res.stop_type == "none"
    t = res.timings
    assert (t.ttft_ms, t.queue_ms, t.prompt_n, t.predicted_n, t.itl_ms) == (None, None, 0, 0, ())
    assert h.board.kv.used_cells == used and h.board.counters().submitted == jobs
    assert h.engine.metrics.summary()["latency_ms"]["ttft"]["n"] == ttft_n
    assert h.engine.metrics.summary()["balanced"]
    h.gate.open()
    assert a.result(10).status == "finished"
    s = h.engine.metrics.summary()
    assert s["counters"]["cancelled"] == 1 and s["latency_ms"]["ttft"]["n"] == ttft_n + 1
    assert s["tokens"]["prompt"] == a.result(1).timings.prompt_n  # b's prompt never counted


def test_cancel_while_prefilling_frees_kv_within_one_step(make):
    h = make(prefill_chunk=16, n_slots=1)
    long_prompt = " ".join(["word"] * 100)
    h.gate.block()
    a = h.engine.submit(ChatRequest.from_prompt(long_prompt, max_tokens=5, sampling=GREEDY))
    h.gate.wait_blocked("prefill")
    h.gate.allow(1)
    h.gate.wait_blocked("prefill", step=1)  # second chunk on the device: 32 cells applied
    assert _kv_seq_cells(h, 0) == 32
    b_req = ChatRequest.from_prompt("next", max_tokens=2, sampling=GREEDY)
    b = h.engine.submit(b_req)
    a.cancel("test")
    h.gate.allow(1)  # only the step already on the device may run
    res = a.result(10)
    assert res.status == "cancelled" and res.stop_type == "none"
    assert res.timings.ttft_ms is None and res.timings.predicted_n == 0 and res.timings.prompt_n == 32
    # the next step on the device is b's prefill, not a third chunk of a; a's cells are gone
    assert h.gate.wait_blocked(step=2) == ("prefill", -1, len(h.engine.tokenize_prompt(b_req)) - 1)
    assert _kv_seq_cells(h, 0) == len(h.engine.tokenize_prompt(b_req))
    h.gate.open()
    rb = b.result(10)
    assert rb.status == "finished"
    # the slot took the next request at once: b got it when a ended
    assert rb.timings.arrival_ms + rb.timings.queue_ms == res.timings.done_ms
    assert h.engine.metrics.summary()["balanced"]


def test_cancel_while_decoding_frees_kv_and_slot_takes_next(make):
    h = make(n_slots=1)
    h.gate.block()
    a = h.engine.submit(ChatRequest.from_prompt("first", max_tokens=50, sampling=GREEDY))
    h.gate.wait_blocked("prefill")
    h.gate.allow(3)  # prefill + 2 decodes
    h.gate.wait_blocked("decode", step=3)
    b = h.engine.submit(ChatRequest.from_prompt("second", max_tokens=2, sampling=GREEDY))
    assert a.state is RequestState.DECODING and b.state is RequestState.QUEUED
    a.cancel("test")
    h.gate.allow(1)
    res = a.result(10)
    assert res.status == "cancelled" and res.timings.predicted_n == 3 and res.text == " x x x"
    h.gate.wait_blocked("prefill", step=4)  # b's prefill is the next step on the device (no decode of a)...
    assert _kv_seq_cells(h, 0) == len(h.engine.tokenize_prompt(ChatRequest.from_prompt("second")))
    h.gate.open()  # ...and a's cells were freed before it (only b's are in sequence 0)
    rb = b.result(10)
    assert rb.status == "finished"
    assert rb.timings.arrival_ms + rb.timings.queue_ms == res.timings.done_ms
    assert h.engine.metrics.summary()["counters"]["cancelled"] == 1



def _latency_counts(h: Harness) -> dict:
    """Samples per latency in the summary window and in the Prometheus histograms (``_count``)."""
    from prometheus_client.parser import text_string_to_metric_families

    lat = h.engine.metrics.summary()["latency_ms"]
    fam = {f.name: f for f in text_string_to_metric_families(h.engine.metrics.prometheus_text())}
    prom = {k: next(x.value for x in fam[f"llamacpp:{name}"].samples if x.name.endswith("_count"))
            for k, name in (("ttft", "time_to_first_token_seconds"), ("itl", "inter_token_latency_seconds"),
                            ("e2e", "e2e_request_latency_seconds"), ("tpot", "time_per_output_token_seconds"))}
    return {k: (lat[k]["n"], int(prom[k])) for k in prom}


def test_cancel_after_first_token_counts_in_ttft_not_e2e(make):
    """A reply stopped (Esc) after its first tokens: its TTFT and streamed ITLs are samples, E2E/TPOT not."""
    h = make(n_slots=1)
    h.gate.block()
    a = h.engine.submit(ChatRequest.from_prompt("first", max_tokens=50, sampling=GREEDY))
    h.gate.wait_blocked("prefill")
    h.gate.allow(3)  # prefill (first token at 400 ms) + 2 decodes (425, 450 ms)
    h.gate.wait_blocked("decode", step=3)
    # recorded when the first token was produced, while the request still runs
    assert a.state is RequestState.DECODING
    assert _latency_counts(h) == {"ttft": (1, 1), "itl": (2, 2), "e2e": (0, 0), "tpot": (0, 0)}
    a.cancel("Esc")
    h.gate.allow(1)
    res = a.result(10)
    assert res.status == "cancelled" and res.timings.ttft_ms == 400.0 and res.timings.itl_ms == (25.0, 25.0)
    assert _latency_counts(h) == {"ttft": (1, 1), "itl": (2, 2), "e2e": (0, 0), "tpot": (0, 0)}
    s = h.engine.metrics.summary()
    assert s["latency_ms"]["ttft"]["p50"] == 400.0 and s["latency_ms"]["e2e"]["p50"] is None
    h.gate.open()
    rb, _ = run(h, ChatRequest.from_prompt("second", max_tokens=2, sampling=GREEDY))
    assert rb.status == "finished"
    assert _latency_counts(h) == {"ttft": (2, 2), "itl": (3, 3), "e2e": (1, 1), "tpot": (1, 1)}


def test_failure_after_first_token_counts_in_ttft_not_e2e(make):
    h = make(n_slots=1)
    h.gate.block()
    a = h.engine.submit(ChatRequest.from_prompt("first", max_tokens=50, sampling=GREEDY))
    h.gate.wait_blocked("prefill")
    h.gate.allow(2)  # prefill + 1 decode; the third job is held on the device
    h.gate.wait_blocked("decode", step=2)
    h.board.faults.arm("ccu_next")  # the job after the held one fails with a CCU exception
    h.gate.open()
    res = a.result(10)
    assert res.status == "failed" and res.error["type_name"] == "CCUException"
    assert res.timings.ttft_ms == 400.0 and res.timings.predicted_n == 3
    assert _latency_counts(h) == {"ttft": (1, 1), "itl": (2, 2), "e2e": (0, 0), "tpot": (0, 0)}


def test_cancel_with_only_held_text_still_counts_its_ttft(make):
    """The first token was sampled but held (first byte of a UTF-8 character): TTFT = that token's time."""
    h = make(n_slots=1)
    emoji = [byte_token(b) for b in "\U0001F600".encode()]
    req = ChatRequest.from_prompt("first", max_tokens=50, sampling=GREEDY)
    h.script(req, emoji[:2])  # two of its four bytes by the time it is cancelled: nothing is shown
    h.gate.block()
    a = h.engine.submit(req)
    h.gate.wait_blocked("prefill")
    h.gate.allow(2)
    h.gate.wait_blocked("decode", step=2)
    a.cancel("Esc")
    h.gate.open()
    res = a.result(10)
    assert res.status == "cancelled" and res.text == "" and res.timings.ttft_ms == 400.0
    assert _latency_counts(h) == {"ttft": (1, 1), "itl": (0, 0), "e2e": (0, 0), "tpot": (0, 0)}


def test_cancel_before_first_token_gives_no_ttft(make):
    h = make(n_slots=1)
    h.gate.block()
    a = h.engine.submit(ChatRequest.from_prompt("first", max_tokens=50, sampling=GREEDY))
    h.gate.wait_blocked("prefill")
    a.cancel("Esc")
    h.gate.open()
    res = a.result(10)
    assert res.status == "cancelled" and res.timings.ttft_ms is None
    assert _latency_counts(h) == {"ttft": (0, 0), "itl": (0, 0), "e2e": (0, 0), "tpot": (0, 0)}

def test_stream_consumer_leaving_cancels(make):
    h = make()
    h.gate.block()
    handle = h.engine.submit(ChatRequest.from_prompt("hi", max_tokens=50, sampling=GREEDY))
    h.gate.allow(3)
    it = handle.stream(timeout=10)
    next(it)
    it.close()  # the client went away
    assert handle.cancelled
    h.gate.open()
    assert handle.result(10).status == "cancelled"


def test_queue_full_is_unavailable_at_once(make):
    h = make(n_slots=1, queue_limit=2)
    h.gate.block()
    a = h.engine.submit(ChatRequest.from_prompt("a", max_tokens=2, sampling=GREEDY))
    h.gate.wait_blocked("prefill")
    q = [h.engine.submit(ChatRequest.from_prompt(f"q{i}", max_tokens=2, sampling=GREEDY)) for i in range(2)]
    before = h.engine.metrics.summary()["counters"]
    with pytest.raises(UnavailableError) as ei:
        h.engine.submit(ChatRequest.from_prompt("one too many", max_tokens=2, sampling=GREEDY))
    assert ei.value.error_type == "unavailable_error" and ei.value.to_dict()["code"] == 503
    after = h.engine.metrics.summary()["counters"]
    assert after["rejected"] == before["rejected"] + 1 and after["submitted"] == before["submitted"]
    assert after["queued"] == 2 and after["running"] == 1
    h.gate.open()
    assert all(x.result(10).status == "finished" for x in [a, *q])


# --- scheduling ------------------------------------------------------------------------------


def test_long_prompt_does_not_starve_short_ones(make):
    """A 2000-token prompt in 128-token chunks; short prompts submitted after it get their first
    token before it finishes prefill, and its prefill still progresses while they decode."""
    cost = FakeCostModel(prefill_us=1_000.0, prefill_us_per_token=1_000.0, decode_us=25_000.0)
    # numerics_max_prompt raised: the scripted model must see the long prompt's steps
    h = make(cost=cost, prefill_chunk=128, n_slots=4, numerics_max_prompt=4096)
    h.gate.block()
    long_req = ChatRequest.from_prompt(" ".join(["word"] * 2000), max_tokens=2, sampling=GREEDY)
    lh = h.engine.submit(long_req)
    h.gate.wait_blocked("prefill")
    shorts = [h.engine.submit(ChatRequest.from_prompt(f"short {i}", max_tokens=200, sampling=GREEDY))
              for i in range(3)]
    h.gate.open()
    lr = lh.result(30)
    srs = [s.result(30) for s in shorts]
    long_first = lr.timings.arrival_ms + lr.timings.ttft_ms
    for s in srs:
        assert s.status == "finished"
        assert s.timings.arrival_ms + s.timings.ttft_ms < long_first
        # decodes did not hold the long prefill back until they finished (old decode-first rule)
        assert long_first < s.timings.done_ms
    # the long prompt was cut into chunks of <= 128 tokens
    chunks = [n for kind, n, _ in cost.calls if kind == "prefill" and n > 100]
    assert max(chunks) == 128
    # between two of its chunks, each decoding slot got exactly one step (the round rule)
    steps = list(h.engine.stage_history)
    long_idx = [i for i, s in enumerate(steps) if s.request_id == lh.id and s.kind == "prefill"]
    for a, b in itertools.pairwise(long_idx[3:8]):
        between = [s for s in steps[a + 1:b]]
        assert len(between) == 3 and all(s.kind == "decode" for s in between)
        assert sorted(s.request_id for s in between) == sorted(x.id for x in shorts)


def test_counters_balance_at_every_moment(make):
    """Mixed run (finish, cancel in each state, rejection, queue): submitted = finished + failed +
    cancelled + queued + running at every poll."""
    cost = FakeCostModel(prefill_us=1_000.0, prefill_us_per_token=100.0, decode_us=2_000.0)
    h = make(cost=cost, n_slots=2, queue_limit=3, prefill_chunk=32)
    stop = threading.Event()
    bad: list[dict] = []

    def poll():
        while not stop.is_set():
            s = h.engine.metrics.summary()
            if not s["balanced"]:
                bad.append(s["counters"])

    t = threading.Thread(target=poll)
    t.start()
    handles = []
    rejected = 0
    try:
        for i in range(40):
            prompt = " ".join(["word"] * (5 + (i * 37) % 120))
            try:
                hd = h.engine.submit(ChatRequest.from_prompt(prompt, max_tokens=1 + i % 7, sampling=GREEDY))
            except UnavailableError:
                rejected += 1
                continue
            handles.append(hd)
            if i % 3 == 0:
                hd.cancel("mixed run")
            if i % 5 == 0:
                time.sleep(0.002)
        results = [x.result(30) for x in handles]
    finally:
        stop.set()
        t.join()
    assert not bad, bad[:3]
    s = h.engine.metrics.summary()
    c = s["counters"]
    assert s["balanced"] and c["queued"] == 0 and c["running"] == 0
    assert c["submitted"] == len(handles) and c["rejected"] == rejected
    assert c["finished"] == sum(r.status == "finished" for r in results)
    assert c["cancelled"] == sum(r.status == "cancelled" for r in results)
    assert h.board.kv.used_cells == sum(len(x.cache_tokens) for x in h.engine.slots)  # only prefix caches


def test_close_ends_every_request(make):
    h = make(n_slots=1)
    h.gate.block()
    a = h.engine.submit(ChatRequest.from_prompt("a", max_tokens=5, sampling=GREEDY))
    h.gate.wait_blocked("prefill")
    b = h.engine.submit(ChatRequest.from_prompt("b", max_tokens=5, sampling=GREEDY))
    h.gate.open()
    h.engine.close()
    assert a.result(5).status in ("cancelled", "finished") and b.result(5).status == "cancelled"
    assert h.engine.metrics.summary()["balanced"]


def test_ping_pong_two_requests_overlap_and_balance(make):
    """max_inflight=2: two sequences' steps are in flight together; results and counters stay right."""
    h = make(max_inflight=2, n_slots=2)
    reqs = [ChatRequest.from_prompt(p, max_tokens=6, sampling=GREEDY) for p in ("one", "two two")]
    handles = [h.engine.submit(r) for r in reqs]
    results = [x.result(30) for x in handles]
    assert all(r.status == "finished" and r.timings.predicted_n == 6 and r.text == " x" * 6 for r in results)
    s = h.engine.metrics.summary()
    assert s["balanced"] and s["counters"]["finished"] == 2
    # the device is serial: its busy time is the sum of the steps (2 prefills + 2 x 5 decodes)
    assert h.board.clock.now_us >= 2 * 400_000 + 10 * 25_000


def test_closed_engine_refuses(make):
    h = make()
    h.engine.close()
    with pytest.raises(UnavailableError, match="shut down"):
        h.engine.submit(ChatRequest.from_prompt("late", max_tokens=2, sampling=GREEDY))


def test_cancel_while_the_last_token_is_sampled_is_counted_cancelled(make, monkeypatch):
    """A cancel that lands after a step's cancel check but before its end is written (the client left while
    the stopping token was sampled) ends the request cancelled: it is not counted finished."""
    from sim_backend.serving.tokens import TokenPipeline

    h = make()
    req = ChatRequest.from_prompt("hi", max_tokens=2, sampling=GREEDY)
    h.script(req, words("A", " b"))
    handles = []
    push = TokenPipeline.push

    def push_then_cancel(self, tok):
        out = push(self, tok)
        if out[1] is not None:  # the stopping token: the client leaves now
            handles[0].cancel("client left")
        return out

    monkeypatch.setattr(TokenPipeline, "push", push_then_cancel)
    h.gate.block()
    handles.append(h.engine.submit(req))
    h.gate.open()
    res = handles[0].result(10)
    assert (res.status, res.stop_type) == ("cancelled", "none")
    counters = h.engine.metrics.summary()["counters"]
    assert counters["cancelled"] == 1 and counters.get("finished", 0) == 0
