"""The round scheduler: slot states in, the next unit of work out. Pure: no threads, no locks,
no device; the engine builds the states under its lock and runs what comes back.

Scheduling rule (stated, tested in ``tests/serving/test_scheduler.py``): work goes in ROUNDS. A
round runs ONE decode step for each decoding slot (round-robin over slots), then ONE prefill chunk
(<= ``prefill_chunk`` tokens) for the next prefilling slot in round-robin order; then the next
round starts. Consequences: a decode never waits behind more than one prefill chunk plus the other
slots' decode steps; a long prompt is cut into chunks, and prompts admitted after it get their
chunks between its chunks, so short prompts reach their first token while a long one is still
prefilling; a prefilling slot gets a chunk at least once every ``n_slots`` rounds, so no request
starves.

Continuous batching (a C3 variant calbin whose decode sub-model carries N > 1 sequences): the
same rounds, but one decode step carries up to N ready decoding slots (filled in round-robin
order); sequences join when their prefill ends and leave when they stop, between steps. A batch-1
calbin is the N = 1 case of the same rule. Prefill chunks stay their own submissions (facts.md F1:
prefill and decode never share one), one per round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SlotState:
    """What the scheduler needs to know of one slot.

    ``phase``: ``"idle"``, ``"prefilling"`` or ``"decoding"``; ``ready``: it may take a step now
    (not in flight, not cancelled, not parked on KV before its retry time, not held for ending);
    ``prefill_left``: prompt tokens still to prefill (prefilling slots).
    """

    index: int
    phase: str
    ready: bool
    prefill_left: int = 0


@dataclass(frozen=True)
class Work:
    """One device step to run: ``kind`` ``"prefill"`` (one slot, ``n_tokens`` prompt tokens) or
    ``"decode"`` (``slots`` in round-robin order, one token each; ``n_tokens`` = len(slots))."""

    kind: str
    slots: tuple[int, ...]
    n_tokens: int


class RoundScheduler:
    """The round rule (module docstring) over ``n_slots`` slots.

    Args:
        n_slots: slots (indices 0..n_slots-1); >= 1.
        prefill_chunk: most prompt tokens one prefill step carries; >= 1.
        decode_batch: most sequences one decode step carries (the decode sub-model's batch); >= 1.
    Raises ValueError for a bad size.
    """

    def __init__(self, n_slots: int, prefill_chunk: int, decode_batch: int = 1) -> None:
        if n_slots < 1 or prefill_chunk < 1 or decode_batch < 1:
            raise ValueError("n_slots, prefill_chunk and decode_batch must be >= 1")
        self.n_slots = n_slots
        self.prefill_chunk = prefill_chunk
        self.decode_batch = decode_batch
        self._rr_decode = 0
        self._rr_prefill = 0
        self._served: set[int] = set()  # slots whose decode ran in the current round

    def slot_changed(self, index: int) -> None:
        """Slot ``index`` got a new request or lost its request: it owes nothing to this round."""
        self._served.discard(index)

    def next(self, states: Sequence[SlotState]) -> Work | None:
        """The next step, or None when no slot is ready. ``states``: one per slot, by index."""
        if len(states) != self.n_slots:
            raise ValueError(f"expected {self.n_slots} slot states, got {len(states)}")
        work = self._next_decode(states)
        if work is not None:
            return work
        n = self.n_slots
        for k in range(n):
            s = states[(self._rr_prefill + k) % n]
            if s.ready and s.phase == "prefilling":
                self._rr_prefill = (s.index + 1) % n
                self._served.clear()  # the chunk closes the round
                return Work("prefill", (s.index,), min(self.prefill_chunk, s.prefill_left))
        if self._served:
            self._served.clear()  # no prefill waiting: next round of decodes
            return self._next_decode(states)
        return None

    def steady_round(self, states: Sequence[SlotState]) -> list[tuple[int, ...]] | None:
        """The decode steps of the next round when the rule would repeat the round just ended unchanged.

        That is the case when the current round is complete (every decoding slot served since the
        round began), no slot is prefilling and every occupied slot is decoding and ready: the next
        round then runs the same steps (slot groups of at most ``decode_batch``, round-robin order),
        and leaves this scheduler in the state it is in now, so a caller may run any number of such
        rounds without calling ``next`` (the trace replay's fast path). None otherwise.
        """
        decoding = [s.index for s in states if s.phase == "decoding"]
        if not decoding or any(s.phase == "prefilling" or (s.phase == "decoding" and not s.ready) for s in states):
            return None
        if self._served != set(decoding):
            return None
        n = self.n_slots
        order = [i for i in ((self._rr_decode + k) % n for k in range(n)) if i in self._served]
        b = self.decode_batch
        return [tuple(order[j:j + b]) for j in range(0, len(order), b)]

    def _next_decode(self, states: Sequence[SlotState]) -> Work | None:
        n = self.n_slots
        picked = [s.index for s in (states[(self._rr_decode + k) % n] for k in range(n))
                  if s.index not in self._served and s.ready and s.phase == "decoding"][:self.decode_batch]
        if not picked:
            return None
        self._served.update(picked)
        self._rr_decode = (picked[-1] + 1) % n
        return Work("decode", tuple(picked), len(picked))
