"""The replay's board model: one simulated board as one ``calconsole serve`` process runs it
(:class:`BoardSim`: slots, the FIFO queue, the engine's round scheduler, the KV pool), priced from
:class:`~sim_backend.tools.replay_prices.StepPrices`, its settings (:class:`ReplayConfig`) and what it
books per request (:class:`Ledger`).  The event rule is :mod:`sim_backend.tools.replay`'s."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from sim_backend.serving.scheduler import RoundScheduler, SlotState
from sim_backend.tools.replay_prices import StepPrices

#: routing policies: round-robin, least outstanding requests (queued + running), least KV cells in use
ROUTES = ("round-robin", "least-outstanding", "least-kv")


#: why a request was not served (counted by reason, never dropped silently)
REJECT_REASONS = {"queue_full": "server busy: queue_limit requests already waiting beyond the free slots",
                  "context": "prompt + output tokens exceed the context of a slot (n_ctx)",
                  "kv_exhausted": "KV pool cannot hold the request's next step and nothing else can free it"}


class _Seq:
    """One request on a board: trace index, prompt / output tokens, progress."""

    __slots__ = ("rid", "prompt", "out", "prefilled", "n_gen", "slot", "parked")

    def __init__(self, rid: int, prompt: int, out: int) -> None:
        self.rid, self.prompt, self.out = rid, prompt, out
        self.prefilled = 0
        self.n_gen = 0
        self.slot = -1
        self.parked = False


@dataclass
class ReplayConfig:
    """What every board runs: ``n_slots`` (serve's --slots; None = 4, or the calbin's decode batch when larger,
    so a batch-8 board can fill its batch), ``queue_limit`` (serve's --queue-limit, 16), ``prefill_chunk``
    (2048 tokens, the engine's round rule), and the router (one of :data:`ROUTES`).
    Raises ValueError for a bad value."""

    n_slots: int | None = None
    queue_limit: int = 16
    prefill_chunk: int = 2048
    route: str = "round-robin"

    def __post_init__(self) -> None:
        if self.n_slots is not None and not 1 <= self.n_slots <= 32:
            raise ValueError(f"slots must be in 1..32, got {self.n_slots}")
        if self.queue_limit < 0:
            raise ValueError(f"queue limit must be >= 0, got {self.queue_limit}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill chunk must be >= 1, got {self.prefill_chunk}")
        if self.route not in ROUTES:
            raise ValueError(f"route must be one of {', '.join(ROUTES)}, got {self.route!r}")

    def slots_for(self, decode_batch: int) -> int:
        """Slots of a board whose calbin decodes ``decode_batch`` sequences a step."""
        return self.n_slots if self.n_slots is not None else max(4, int(decode_batch))


class Ledger:
    """Per-request outcomes of a replay, float64 arrays over the trace's rows (simulated µs; NaN = never):
    ``assigned``, ``first`` (first token), ``last`` (last token = end); ``board`` int (-1 = none);
    ``reason`` (a :data:`REJECT_REASONS` key or ""); ``itl`` pooled token gaps (µs)."""

    def __init__(self, n: int) -> None:
        self.assigned = np.full(n, np.nan)
        self.first = np.full(n, np.nan)
        self.last = np.full(n, np.nan)
        self.board = np.full(n, -1, dtype=np.int64)
        self.reason = [""] * n
        self.itl: list[np.ndarray] = []
        self._gaps: list[float] = []

    def gap(self, us: float) -> None:
        self._gaps.append(us)
        if len(self._gaps) >= 65536:
            self.flush()

    def flush(self) -> None:
        if self._gaps:
            self.itl.append(np.asarray(self._gaps))
            self._gaps = []

    def gaps(self) -> np.ndarray:
        self.flush()
        return np.concatenate(self.itl) if self.itl else np.empty(0)


class BoardSim:
    """One simulated board: slots, FIFO queue, the engine's round scheduler, KV pool, priced steps.

    Times are simulated µs on the board's own clock ``t`` (it idles to an arrival when it has nothing
    to do). Call :meth:`run_until` before each :meth:`submit` (at non-decreasing times), then
    :meth:`run_until` with ``math.inf`` to finish. ``busy_us``: device time; ``kv_peak``: most KV cells
    held by running requests; ``served``: requests submitted and not refused.
    """

    def __init__(self, index: int, prices: StepPrices, cfg: ReplayConfig, ledger: Ledger,
                 prompts: np.ndarray, outputs: np.ndarray) -> None:
        self.index = index
        self.p = prices
        self.cfg = cfg
        self.led = ledger
        self._prompts = prompts
        self._outputs = outputs
        self.t = 0.0
        self.busy_us = 0.0
        self.kv_used = 0
        self.kv_peak = 0
        self.served = 0
        n_slots = cfg.slots_for(prices.decode_batch)
        self.slots: list[_Seq | None] = [None] * n_slots
        self.last_used = [0.0] * n_slots
        self.queue: deque[_Seq] = deque()
        self.sched = RoundScheduler(n_slots, cfg.prefill_chunk, prices.decode_batch)
        self.steps = 0
        self.rounds_skipped = 0

    # what a router reads
    @property
    def outstanding(self) -> int:
        """Requests queued or in a slot."""
        return len(self.queue) + sum(1 for s in self.slots if s is not None)

    @property
    def kv_demand(self) -> int:
        """KV cells the outstanding requests will hold at their ends (prompt + output each): what "least
        KV" routes by. It changes only when a request arrives or ends, so a router may read a board
        that has not run up to the arrival yet (see :meth:`quiet_until`)."""
        return sum(r.prompt + r.out for r in self.slots if r is not None) + sum(r.prompt + r.out for r in self.queue)

    def quiet_until(self) -> float:
        """Simulated µs before which no request on this board can end: each running request needs at least
        as many more steps as it has tokens to sample (plus its prefill chunks), each step at least the
        cheapest decode step plus one token's host work. ``math.inf`` when the board holds nothing."""
        left = [(r.out - r.n_gen) + (0 if r.prefilled >= r.prompt else 1) for r in self.slots if r is not None]
        if not left:
            return math.inf
        return self.t + min(left) * (float(self.p.decode_fixed_us[1]) + self.p.host_token_us)

    def submit(self, rid: int, arrival_us: float) -> str:
        """Request ``rid`` (trace row) arrives at ``arrival_us``; returns "" or the refusal's reason key."""
        if self.outstanding == 0 and self.t < arrival_us:
            self.t = arrival_us  # idle until it arrives
        prompt, out = int(self._prompts[rid]), int(self._outputs[rid])
        if prompt + out > self.p.n_ctx:
            return "context"
        free = sum(1 for s in self.slots if s is None)
        if len(self.queue) >= self.cfg.queue_limit + free:
            return "queue_full"
        self.served += 1
        self.led.board[rid] = self.index
        self.queue.append(_Seq(rid, prompt, out))
        self._admit()
        return ""

    def _admit(self) -> None:
        while self.queue and None in self.slots:
            # admission.choose_slot with no shared prefix: the least recently used free slot (first on ties)
            free = [i for i, s in enumerate(self.slots) if s is None]
            i = min(free, key=lambda k: self.last_used[k])
            r = self.queue.popleft()
            r.slot = i
            self.slots[i] = r
            self.led.assigned[r.rid] = self.t
            self.sched.slot_changed(i)

    def _states(self) -> list[SlotState]:
        out = []
        for i, r in enumerate(self.slots):
            if r is None:
                out.append(SlotState(i, "idle", False))
            elif r.prefilled < r.prompt:
                out.append(SlotState(i, "prefilling", not r.parked, r.prompt - r.prefilled))
            else:
                out.append(SlotState(i, "decoding", not r.parked))
        return out

    def _finish(self, r: _Seq, t_end: float) -> None:
        self.led.last[r.rid] = t_end
        self.kv_used -= r.prompt + max(0, r.n_gen - 1)
        self.slots[r.slot] = None
        self.last_used[r.slot] = t_end
        self.sched.slot_changed(r.slot)
        for s in self.slots:
            if s is not None:
                s.parked = False  # KV was freed: parked riders retry

    def _fail(self, r: _Seq, reason: str) -> None:
        self.led.reason[r.rid] = reason
        self.kv_used -= r.prefilled + max(0, r.n_gen - 1)
        self.slots[r.slot] = None
        self.last_used[r.slot] = self.t
        self.sched.slot_changed(r.slot)

    def _take_kv(self, n: int) -> bool:
        if self.kv_used + n > self.p.kv_cells:
            return False
        self.kv_used += n
        if self.kv_used > self.kv_peak:
            self.kv_peak = self.kv_used
        return True

    def _step(self) -> bool:
        """Run the next step the round rule picks; False when no slot can take one."""
        self._admit()
        states = self._states()
        work = self.sched.next(states)
        if work is None:
            running = [s for s in self.slots if s is not None]
            if running and all(s.parked for s in running):
                # the engine's deadlock break: nothing else can free KV; fail the youngest
                self._fail(max(running, key=lambda s: s.rid), "kv_exhausted")
                for s in self.slots:
                    if s is not None:
                        s.parked = False
                return True
            return False
        h = self.p.host_token_us
        led = self.led
        if work.kind == "prefill":
            r = self.slots[work.slots[0]]
            assert r is not None
            if not self._take_kv(work.n_tokens):
                r.parked = True
                return True
            cost = self.p.prefill(work.n_tokens, r.prefilled)
            self.t += cost
            self.busy_us += cost
            r.prefilled += work.n_tokens
            self.steps += 1
            if r.prefilled >= r.prompt:
                self.t += h
                led.first[r.rid] = self.t
                r.n_gen = 1
                if r.out <= 1:
                    self._finish(r, self.t)
            return True
        riders: list[_Seq] = []
        for i in work.slots:
            r = self.slots[i]
            assert r is not None
            if self._take_kv(1):
                riders.append(r)
            else:
                r.parked = True
        if not riders:
            return True
        cost = self.p.decode([r.prompt + r.n_gen - 1 for r in riders])
        self.t += cost
        self.busy_us += cost
        self.steps += 1
        prev = {r.rid: (led.last[r.rid] if r.n_gen > 1 else led.first[r.rid]) for r in riders}
        for r in riders:
            self.t += h
            led.gap(self.t - prev[r.rid])
            led.last[r.rid] = self.t
            r.n_gen += 1
            if r.n_gen >= r.out:
                self._finish(r, self.t)
        return True

    def _skip_rounds(self, until_us: float) -> bool:
        """Run whole steady rounds in closed form while they end by ``until_us``, no rider reaches its
        last token and the KV pool holds them; False if not one round could be skipped."""
        self._admit()  # a freed slot takes the queue's head first, as the engine's loop top does
        steps = self.sched.steady_round(self._states())
        if steps is None:
            return False
        order = [i for st in steps for i in st]
        seqs = [self.slots[i] for i in order]
        assert all(s is not None for s in seqs)
        k = len(order)
        pasts = np.asarray([s.prompt + s.n_gen - 1 for s in seqs], dtype=np.int64)  # type: ignore[union-attr]
        left = min(s.out - s.n_gen for s in seqs)  # type: ignore[union-attr]
        r_max = min(left - 1, (self.p.kv_cells - self.kv_used) // k)
        if r_max < 1:
            return False
        h = self.p.host_token_us
        fixed = float(sum(self.p.decode_fixed_us[len(st)] for st in steps)) + k * h
        cum = self.p.decode_seq_cum

        def elapsed(n_rounds: int) -> float:
            return n_rounds * fixed + float((cum[pasts + n_rounds] - cum[pasts]).sum())

        budget = until_us - self.t
        if elapsed(1) > budget:
            return False
        lo, hi = 1, r_max
        if elapsed(hi) > budget:
            while hi - lo > 1:  # largest n with elapsed(n) <= budget (elapsed grows with n)
                mid = (lo + hi) // 2
                if elapsed(mid) <= budget:
                    lo = mid
                else:
                    hi = mid
            n = lo
        else:
            n = hi
        # exact token times: seq j of the round (step s_j, place q_j in it) in round r
        g = self.p.decode_seq_us[pasts[:, None] + np.arange(n)[None, :]]  # (k, n)
        offsets = np.empty((k, n))
        acc = np.zeros(n)
        j = 0
        for st in steps:
            acc = acc + self.p.decode_fixed_us[len(st)] + g[j:j + len(st)].sum(axis=0)
            for q in range(len(st)):
                offsets[j + q] = acc + (q + 1) * h
            acc = acc + len(st) * h
            j += len(st)
        round_len = acc  # (n,): each round's duration
        starts = self.t + np.concatenate([[0.0], np.cumsum(round_len)[:-1]])
        times = starts[None, :] + offsets  # (k, n)
        led = self.led
        for j, s in enumerate(seqs):
            assert s is not None
            before = led.last[s.rid] if s.n_gen > 1 else led.first[s.rid]
            gaps = np.diff(times[j], prepend=before)
            led.itl.append(gaps)
            led.last[s.rid] = times[j, -1]
            s.n_gen += n
        device = float(round_len.sum()) - n * k * h
        self.busy_us += device
        self.t = float(starts[-1] + round_len[-1])
        self.kv_used += n * k
        self.kv_peak = max(self.kv_peak, self.kv_used)
        self.steps += n * len(steps)
        self.rounds_skipped += n
        return True

    def run_until(self, until_us: float) -> None:
        """Run every step that starts before ``until_us`` (simulated µs; ``math.inf`` = until idle)."""
        while self.t < until_us:
            if self._skip_rounds(until_us):
                continue
            if not self._step():
                return
