"""The round rule of ``RoundScheduler``, without threads or a device: slot states in, work out."""

from __future__ import annotations

import pytest

from sim_backend.serving.scheduler import RoundScheduler, SlotState, Work


def dec(i: int, ready: bool = True) -> SlotState:
    return SlotState(i, "decoding", ready)


def pre(i: int, left: int, ready: bool = True) -> SlotState:
    return SlotState(i, "prefilling", ready, left)


def idle(i: int) -> SlotState:
    return SlotState(i, "idle", False)


def run(s: RoundScheduler, states: list[SlotState], n: int) -> list[Work | None]:
    return [s.next(states) for _ in range(n)]


def test_a_round_is_each_decode_once_then_one_prefill_chunk():
    s = RoundScheduler(4, prefill_chunk=512)
    states = [dec(0), pre(1, 2000), dec(2), pre(3, 100)]
    got = run(s, states, 6)
    assert got == [Work("decode", (0,), 1), Work("decode", (2,), 1), Work("prefill", (1,), 512),
                   Work("decode", (0,), 1), Work("decode", (2,), 1), Work("prefill", (3,), 100)]


def test_prefill_chunks_alternate_so_a_short_prompt_is_not_stuck_behind_a_long_one():
    s = RoundScheduler(2, prefill_chunk=256)
    got = run(s, [pre(0, 4096), pre(1, 30)], 2)
    assert got == [Work("prefill", (0,), 256), Work("prefill", (1,), 30)]


def test_no_prefill_waiting_starts_the_next_round_of_decodes():
    s = RoundScheduler(3, prefill_chunk=64)
    got = run(s, [dec(0), idle(1), dec(2)], 4)
    assert [w.slots for w in got if w] == [(0,), (2,), (0,), (2,)]


def test_a_slot_that_is_not_ready_is_skipped_and_nothing_ready_is_none():
    s = RoundScheduler(3, prefill_chunk=64)
    assert s.next([dec(0, ready=False), pre(1, 10, ready=False), idle(2)]) is None
    assert s.next([dec(0, ready=False), dec(1), idle(2)]) == Work("decode", (1,), 1)


def test_batched_decode_carries_up_to_n_ready_slots_in_round_robin_order():
    s = RoundScheduler(5, prefill_chunk=64, decode_batch=3)
    states = [dec(0), dec(1), dec(2, ready=False), dec(3), dec(4)]
    first = s.next(states)
    assert first == Work("decode", (0, 1, 3), 3)
    assert s.next(states) == Work("decode", (4,), 1)  # the rest of this round
    assert s.next(states) == Work("decode", (0, 1, 3), 3)  # next round, from the start again


def test_batch_one_is_the_n1_case_of_the_batched_rule():
    """The same rule at N = 1 and N = 4: N = 1 splits each round's decodes into one-slot steps."""
    states = [dec(0), pre(1, 9), dec(2)]
    one, wide = RoundScheduler(3, 8, decode_batch=1), RoundScheduler(3, 8, decode_batch=4)
    assert run(one, states, 3) == [Work("decode", (0,), 1), Work("decode", (2,), 1), Work("prefill", (1,), 8)]
    assert run(wide, states, 2) == [Work("decode", (0, 2), 2), Work("prefill", (1,), 8)]


def test_a_slot_that_changes_request_owes_nothing_to_the_round():
    s = RoundScheduler(2, prefill_chunk=64)
    assert s.next([dec(0), dec(1)]) == Work("decode", (0,), 1)
    s.slot_changed(0)  # slot 0's request ended and a new one took it
    assert s.next([dec(0), dec(1)]) == Work("decode", (1,), 1)
    assert s.next([dec(0), dec(1)]) == Work("decode", (0,), 1)


def test_no_prefilling_slot_starves():
    n = 4
    s = RoundScheduler(n, prefill_chunk=1)
    states = [dec(0), dec(1), dec(2), pre(3, 1000)]
    got = run(s, states, 4 * n)
    prefill_at = [i for i, w in enumerate(got) if w and w.kind == "prefill"]
    assert prefill_at and all(b - a <= n for a, b in zip(prefill_at, prefill_at[1:], strict=False))


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        RoundScheduler(0, 1)
    with pytest.raises(ValueError):
        RoundScheduler(2, 0)
    with pytest.raises(ValueError):
        RoundScheduler(2, 1).next([dec(0)])
