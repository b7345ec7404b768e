"""Replay a production trace on simulated boards: capacity planning (``calconsole bench replay``).

A trace is a CSV of ``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure's LLM inference trace 2023, shipped
in ``calconsole/bench/data/azure-llm-2023``). Each row is one request: it arrives at its timestamp (scaled
by ``speedup``), carries a prompt of exactly ContextTokens tokens and yields exactly GeneratedTokens tokens
(EOS ignored), timing-only. A router sends it to one of ``boards`` simulated boards; one board is what one
``calconsole serve`` process runs: ``n_slots`` slots, a FIFO queue of ``queue_limit`` beyond the free slots,
the engine's round scheduler (:class:`~sim_backend.serving.scheduler.RoundScheduler`, the same object), the
bundle's KV pool and the calibrated cost model, host work modeled per sampled token (facts.md F7,
``host_overhead_ms_per_token``), one step in flight (serve's default).

The fast path (:class:`BoardSim`) does not step tokens: a batch-1 board serves one sequence per step and
the cost model prices a step from its size and context alone, so it prices steps from tables
(:class:`StepPrices`: decode = a per-step part by batch size + a per-sequence part by context, prefix-summed
over context; prefill chunks memoised) and runs whole scheduler rounds in closed form while nothing
changes (no arrival, prefill or finish), going step by step only around those events. The token-by-token
engine (:func:`replay_on_engine`) is its reference: the same slice through real ``Engine`` objects.

Clocks: every latency is SIMULATED device time (µs inside, ms out) plus the modeled host work booked on
it; ``wall_seconds`` is this machine's measured time for the replay itself.

Event rule shared by both paths: a board notices an arrival at its first step boundary at or after it
(a device step is never interrupted); the request is refused there if ``queue_limit`` requests already
wait beyond the free slots (llama-server's "server busy"), else it takes a free slot (least recently
used, as ``admission.choose_slot`` with no shared prefix) or waits in the FIFO. Routing looks at each
board at that boundary.
"""

from __future__ import annotations

import csv
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from sim_backend.bundle.manifest import DEFAULT_BUNDLE_DIR, Bundle, load_bundle
from sim_backend.model.batching import price_decode_batch
from sim_backend.model.costmodel import CostModel
from sim_backend.planes.types import SLO
from sim_backend.serving.scheduler import RoundScheduler, SlotState

__all__ = ["ROUTES", "REJECT_REASONS", "BoardSim", "ReplayConfig", "StepPrices", "Trace", "TraceError",
           "load_trace", "prefill_chunks", "prices_for_trace", "replay", "summarize", "variant_bundle_dir", "VARIANTS"]

#: routing policies: round-robin, least outstanding requests (queued + running), least KV cells in use
ROUTES = ("round-robin", "least-outstanding", "least-kv")
#: why a request was not served (counted by reason, never dropped silently)
REJECT_REASONS = {"queue_full": "server busy: queue_limit requests already waiting beyond the free slots",
                  "context": "prompt + output tokens exceed the context of a slot (n_ctx)",
                  "kv_exhausted": "KV pool cannot hold the request's next step and nothing else can free it"}
#: the bundles a search compares: production (batch-1 decode) and the roadmap's batch variants (C3 what-ifs)
VARIANTS = ("qwen3-30b-a3b", "qwen3-30b-a3b-b4", "qwen3-30b-a3b-b8", "qwen3-30b-a3b-b16")
HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A malformed trace: ``row`` (1-based data row; 0 = the header), ``field`` (column name) and why."""

    def __init__(self, path: str, row: int, fld: str, why: str) -> None:
        self.row, self.field = row, fld
        where = "header" if row == 0 else f"row {row}"
        super().__init__(f"{path}: {where}, {fld}: {why}")


def variant_bundle_dir(name: str) -> Path:
    """The shipped bundle directory named ``name`` (one of :data:`VARIANTS`, or any bundle beside them).
    Raises ValueError naming the choices for an unknown name."""
    d = DEFAULT_BUNDLE_DIR.parent / name
    if not (d / "manifest.yaml").is_file() and not d.is_dir():
        raise ValueError(f"no shipped bundle {name!r}; choose one of {', '.join(VARIANTS)}")
    return d


def check_replayable(b: Bundle) -> None:
    """Raise ValueError unless bundle ``b`` is of the MoE family the replay prices (the cost model's decode
    batches and expert tables are Qwen3-30B-A3B's, facts.md F2); a dense pilot bundle is named as such."""
    if not b.shape.is_moe:
        raise ValueError(f"bundle {b.name!r} is of the {b.family} family: the replay prices the MoE model's "
                         f"boards only (choose one of {', '.join(VARIANTS)})")


def check_replayable_dir(bundle_dir: str | Path) -> None:
    """Load the bundle at ``bundle_dir`` and check it as :func:`check_replayable` does, for callers that may
    not import the bundle package themselves (the console's commands reach the simulator through its tools).
    Raises ManifestError for a bad manifest, ValueError for a bundle the replay does not price."""
    check_replayable(load_bundle(Path(bundle_dir)))


@dataclass(frozen=True)
class Trace:
    """A request trace: ``arrival_s`` float64 (n,) seconds since the first kept row (non-decreasing),
    ``prompt`` / ``output`` int64 (n,) tokens per request; ``source`` names where it came from; ``file_rows``
    int64 (n,) each request's 1-based data row in that file (None: 1..n, the trace is its own file)."""

    arrival_s: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    source: str = ""
    file_rows: np.ndarray | None = None

    def file_row(self, i: int) -> int:
        """The 1-based data row of the trace file that request ``i`` (0-based, of this trace) came from."""
        return i + 1 if self.file_rows is None else int(self.file_rows[i])

    def __len__(self) -> int:
        return int(self.arrival_s.shape[0])

    @property
    def span_s(self) -> float:
        """Seconds from the first arrival to the last (0 for fewer than two requests)."""
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    def cut(self, *, start_s: float = 0.0, span_s: float | None = None, limit: int | None = None,
            speedup: float = 1.0) -> Trace:
        """The rows arriving in ``[start_s, start_s + span_s)`` (trace seconds), at most ``limit`` of them,
        arrivals re-based to 0 and divided by ``speedup`` (2 = twice the rate). Raises ValueError for a
        negative start, a non-positive span or limit, a speedup outside 0.001..1e6, or a cut that keeps no row."""
        if not (start_s >= 0 and math.isfinite(start_s)):
            raise ValueError(f"--start must be >= 0 seconds, got {start_s!r}")
        if span_s is not None and not (span_s > 0 and math.isfinite(span_s)):
            raise ValueError(f"--span must be > 0 seconds, got {span_s!r}")
        if limit is not None and limit < 1:
            raise ValueError(f"--limit must be >= 1, got {limit}")
        if not 1e-3 <= speedup <= 1e6:  # NaN fails too
            raise ValueError(f"--speedup must be in 0.001..1e6, got {speedup!r}")
        keep = self.arrival_s >= start_s
        if span_s is not None:
            keep &= self.arrival_s < start_s + span_s
        idx = np.flatnonzero(keep)
        if limit is not None:
            idx = idx[:limit]
        if idx.size == 0:
            raise ValueError(f"the cut keeps no request of {self.source or 'the trace'} "
                             f"({len(self)} rows over {self.span_s:.0f} s)")
        a = self.arrival_s[idx]
        rows = idx + 1 if self.file_rows is None else self.file_rows[idx]
        return Trace((a - a[0]) / speedup, self.prompt[idx], self.output[idx], self.source, rows)

    def stats(self) -> dict[str, Any]:
        """The workload's own figures: ``count``, ``span_s``, ``rate_per_s``, ``prompt`` / ``output``
        {p50, p90, p99, mean, max} in tokens."""
        def q(a: np.ndarray) -> dict[str, float]:
            p50, p90, p99 = np.percentile(a, [50, 90, 99])
            return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(a.mean()),
                    "max": float(a.max())}

        return {"count": len(self), "span_s": self.span_s,
                "rate_per_s": (len(self) - 1) / self.span_s if self.span_s > 0 else None,
                "prompt": q(self.prompt), "output": q(self.output)}


#: the largest token count a trace cell may hold: far above any context (a slot's is 40960, facts.md F2), so a
#: real request is never refused here (it is refused by the replay as "context"), yet a typo of many digits
#: is a TraceError, not an int64 overflow or an hour of pricing
MAX_TOKENS = 10_000_000
#: the longest span a trace may cover (simulated s, ~3.2 years): a longer one is a unit mistake (ms or µs
#: read as s), not a workload
MAX_SPAN_S = 1e8
_INT = re.compile(r"[+-]?[0-9]{1,12}")
_FRAC = re.compile(r"([0-9]+)(Z|[+-][0-9]{2}:?[0-9]{2})?")


def _parse_time(text: str) -> float:
    """A TIMESTAMP cell -> seconds: an ISO date-time (the Azure trace's ``2023-11-16 18:15:46.6805900``,
    more than 6 fractional digits allowed, a ``Z`` or ``+hh:mm`` offset after them; a date-time without an
    offset is read as UTC, so the machine's time zone and its DST changes never move an arrival) or plain
    seconds. Raises ValueError."""
    t = text.strip()
    try:
        v = float(t)
    except ValueError:
        pass
    else:
        if not math.isfinite(v):
            raise ValueError(f"not a finite number of seconds: {t!r}")
        return v
    head, dot, frac = t.partition(".")
    frac_s, tz = 0.0, ""
    if dot:
        m = _FRAC.fullmatch(frac)
        if m is None:
            raise ValueError(f"not a date-time or seconds: {t[:40]!r}")
        frac_s, tz = float("0." + m.group(1)), m.group(2) or ""
    try:
        base = datetime.fromisoformat(head + tz)
    except ValueError:
        raise ValueError(f"not a date-time or seconds: {t[:40]!r}") from None
    if base.tzinfo is None:
        base = base.replace(tzinfo=UTC)
    return base.timestamp() + frac_s


def _tokens(p: str, row: int, name: str, txt: str) -> int:
    """A token-count cell -> int in 1..MAX_TOKENS. Raises TraceError naming the row and the field."""
    if _INT.fullmatch(txt) is None:
        raise TraceError(p, row, name, f"not an integer: {txt[:20]!r}")
    n = int(txt)
    if not 1 <= n <= MAX_TOKENS:
        raise TraceError(p, row, name, f"must be 1..{MAX_TOKENS} tokens, got {n}")
    return n


def load_trace(path: str | Path) -> Trace:
    """Read a ``TIMESTAMP,ContextTokens,GeneratedTokens`` CSV (UTF-8, a byte-order mark allowed; extra columns
    ignored).

    Rows must be in time order over at most ``MAX_SPAN_S``; ContextTokens and GeneratedTokens integers in
    1..``MAX_TOKENS``. Raises TraceError (one line naming the row -- 1-based data row -- and the field) for a
    missing column, a bad timestamp, a bad token count, an unsorted row, a span too long, text that is not
    UTF-8 or a malformed CSV row; OSError if the file cannot be read.
    """
    p = str(path)
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    i = 0
    with open(path, newline="", encoding="utf-8-sig") as f:
        try:
            reader = csv.DictReader(f)
            cols = [c.strip() for c in (reader.fieldnames or [])]
            for name in HEADER:
                if name not in cols:
                    raise TraceError(p, 0, name, f"missing column (the header has {', '.join(cols) or 'nothing'}; "
                                                 f"expected {','.join(HEADER)})")
            reader.fieldnames = cols
            prev = -math.inf
            for i, row in enumerate(reader, start=1):
                cells = {}
                for name in HEADER:
                    v = row.get(name)
                    if v is None or not v.strip():
                        raise TraceError(p, i, name, "empty")
                    cells[name] = v.strip()
                try:
                    ts = _parse_time(cells["TIMESTAMP"])
                except ValueError as e:
                    raise TraceError(p, i, "TIMESTAMP", str(e)) from None
                if ts < prev:
                    raise TraceError(p, i, "TIMESTAMP", "earlier than the row before (rows must be in time order)")
                if times and ts - times[0] > MAX_SPAN_S:
                    raise TraceError(p, i, "TIMESTAMP", f"{ts - times[0]:.3g} s after the first row, over the "
                                                        f"{MAX_SPAN_S:.0e} s a trace may span (seconds in ms?)")
                prev = ts
                prompts.append(_tokens(p, i, "ContextTokens", cells["ContextTokens"]))
                outputs.append(_tokens(p, i, "GeneratedTokens", cells["GeneratedTokens"]))
                times.append(ts)
        except UnicodeDecodeError as e:
            raise TraceError(p, i + 1, "text", f"not UTF-8 ({e.reason} at byte {e.start} of a block)") from None
        except csv.Error as e:
            raise TraceError(p, i + 1, "CSV", str(e)) from None
    if not times:
        raise TraceError(p, 1, "TIMESTAMP", "the trace has no data row")
    a = np.asarray(times, dtype=np.float64)
    return Trace(a - a[0], np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64), p)


# --- prices ---------------------------------------------------------------------------------------


@dataclass
class StepPrices:
    """Step prices of one bundle in simulated µs, as the board's cost model gives them.

    ``decode_fixed_us[n]`` (n = 1..decode_batch; [0] unused): the part of a decode step of ``n`` sequences
    that does not depend on their contexts; ``decode_seq_us[p]``: the part one sequence with ``p`` tokens of
    past adds (batched decode prices each sequence's flash attention on its own context and sums them,
    ``batching.BatchedCostModel``); ``decode_seq_cum`` its prefix sum (``cum[p]`` = sum below p).
    A decode step of pasts ``ps`` costs ``decode_fixed_us[len(ps)] + sum(decode_seq_us[p] for p in ps)``
    (tests check this against the cost model). ``prefill_us[(n, past)]``: one prefill chunk.
    ``host_token_us``: modeled host work per sampled token (facts.md F7 fit, the hardware YAML's
    ``host_overhead_ms_per_token``). ``kv_cells``: the bundle's KV pool in tokens (facts.md F6);
    ``n_ctx``: a slot's context (the calbin's, facts.md F2).
    """

    bundle: str
    decode_batch: int
    decode_fixed_us: np.ndarray
    decode_seq_us: np.ndarray
    decode_seq_cum: np.ndarray
    prefill_us: dict[tuple[int, int], float]
    host_token_us: float
    kv_cells: int
    n_ctx: int
    cost: CostModel | None = field(default=None, repr=False)
    shape: Any = field(default=None, repr=False)

    @classmethod
    def build(cls, bundle_dir: str | Path | None = None, *, max_context: int | None = None,
              prefill_chunks: Iterable[tuple[int, int]] = (), cost: CostModel | None = None) -> StepPrices:
        """Price the tables for ``bundle_dir`` (default the production bundle) up to ``max_context`` tokens
        of past (default the calbin's context), and the given prefill chunks ``(n_tokens, past)``.

        Raises ManifestError for a bad bundle, ValueError for a bundle not of the MoE family or a context
        beyond the calbin's.
        """
        b: Bundle = load_bundle(bundle_dir)
        check_replayable(b)
        cm = cost if cost is not None else CostModel.load()
        shape = b.shape
        top = b.context if max_context is None else int(max_context)
        if not 1 <= top <= b.context:
            raise ValueError(f"max_context must be in 1..{b.context}, got {top}")
        nb = int(b.decode_batch)
        zero = float(price_decode_batch(cm, shape, [0]).total_us)
        seq = np.empty(top, dtype=np.float64)
        for p in range(top):
            seq[p] = float(cm.price_step(shape, "decode", 1, p).total_us) - zero
        seq[0] = 0.0
        fixed = np.zeros(nb + 1, dtype=np.float64)
        for n in range(1, nb + 1):
            fixed[n] = float(price_decode_batch(cm, shape, [0] * n).total_us) if n > 1 else zero
        cum = np.concatenate([[0.0], np.cumsum(seq)])
        out = cls(b.name, nb, fixed, seq, cum, {}, float(cm.host_overhead_ms_per_token) * 1e3,
                  int(b.context), int(b.context), cm, shape)
        for n, past in prefill_chunks:
            out.prefill(n, past)
        return out

    def prefill(self, n: int, past: int) -> float:
        """One prefill chunk of ``n`` tokens after ``past`` (simulated µs); priced once, then memoised.
        Raises RuntimeError for an unpriced chunk once the cost model was dropped (``detached``)."""
        key = (int(n), int(past))
        v = self.prefill_us.get(key)
        if v is None:
            if self.cost is None:
                raise RuntimeError(f"prefill chunk {key} was not priced before the prices were detached")
            v = self.prefill_us[key] = float(self.cost.price_step(self.shape, "prefill", key[0], key[1]).total_us)
        return v

    def decode(self, pasts: Sequence[int]) -> float:
        """One decode step of ``len(pasts)`` sequences with those pasts (simulated µs)."""
        return float(self.decode_fixed_us[len(pasts)] + sum(self.decode_seq_us[p] for p in pasts))

    def detached(self) -> StepPrices:
        """A copy without the cost model (small to ship to another process; every needed chunk priced)."""
        return StepPrices(self.bundle, self.decode_batch, self.decode_fixed_us, self.decode_seq_us,
                          self.decode_seq_cum, dict(self.prefill_us), self.host_token_us, self.kv_cells,
                          self.n_ctx)


def prefill_chunks(prompts: Iterable[int], chunk: int) -> set[tuple[int, int]]:
    """The ``(n_tokens, past)`` prefill chunks the round rule cuts ``prompts`` into (``chunk`` at most)."""
    out: set[tuple[int, int]] = set()
    for p in prompts:
        done = 0
        while done < p:
            n = min(chunk, p - done)
            out.add((n, done))
            done += n
    return out


def prices_for_trace(trace: Trace, bundle_dir: str | Path | None = None, *, prefill_chunk: int = 2048,
                     cost: CostModel | None = None) -> StepPrices:
    """:meth:`StepPrices.build` with the contexts and chunks ``trace`` needs (requests over the calbin's
    context are not priced: the replay refuses them)."""
    b = load_bundle(bundle_dir)
    total = trace.prompt + trace.output
    ok = total <= b.context  # the rest is refused before a step, so never priced
    need = int(total[ok].max()) if ok.any() else 1
    return StepPrices.build(bundle_dir, max_context=need, prefill_chunks=prefill_chunks(
        (int(p) for p in trace.prompt[ok]), prefill_chunk), cost=cost)


# --- one board ------------------------------------------------------------------------------------


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


# --- a fleet ------------------------------------------------------------------------------------


def _route(boards: Sequence[BoardSim], i: int, how: str) -> BoardSim:
    """The board request ``i`` goes to (ties: the lowest index)."""
    if how == "round-robin":
        return boards[i % len(boards)]
    if how == "least-outstanding":
        return min(boards, key=lambda b: (b.outstanding, b.index))
    return min(boards, key=lambda b: (b.kv_demand, b.outstanding, b.index))


def _q(vals: np.ndarray) -> dict[str, float | None]:
    """{p50, p95, p99} of ``vals`` (already in ms), None when empty."""
    if vals.size == 0:
        return {"p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(vals, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


def summarize(trace: Trace, led: Ledger, *, slo: SLO, attainment: float) -> dict[str, Any]:
    """Metrics of a finished replay (vLLM's definitions, simulated ms): per request TTFT = arrival -> first
    token, E2E = arrival -> last, TPOT = (E2E - TTFT) / (out - 1), queue = arrival -> slot; ITL pooled gaps.
    ``attainment`` = share of ALL trace requests that finished meeting every SLO (a refused one misses);
    ``goodput`` = those requests (and their output tokens) per trace second (None over a zero span);
    ``meets_slo`` = attainment >= the target."""
    arr = trace.arrival_s * 1e6
    done = ~np.isnan(led.last)
    ttft = (led.first - arr)[done] / 1e3
    e2e = (led.last - arr)[done] / 1e3
    outs = trace.output[done]
    tpot = np.where(outs > 1, (e2e - ttft) / np.maximum(1, outs - 1), np.nan)
    queue = (led.assigned - arr)[~np.isnan(led.assigned)] / 1e3
    good = np.ones(int(done.sum()), dtype=bool)
    if slo.ttft_ms is not None:
        good &= ttft <= slo.ttft_ms
    if slo.tpot_ms is not None:
        good &= np.isnan(tpot) | (tpot <= slo.tpot_ms)
    if slo.e2el_ms is not None:
        good &= e2e <= slo.e2el_ms
    n = len(trace)
    att = float(good.sum()) / n if n else 0.0
    span = trace.span_s  # a rate over no time is no rate: None for a single instant
    return {"metrics": {"ttft_ms": _q(ttft), "tpot_ms": _q(tpot[~np.isnan(tpot)]), "itl_ms": _q(led.gaps() / 1e3),
                        "e2e_ms": _q(e2e), "queue_ms": _q(queue)},
            "finished": int(done.sum()),
            "slo": slo.to_dict(), "attainment_target": attainment, "attainment": att,
            "meets_slo": att >= attainment,
            "goodput": {"requests_per_s": float(good.sum()) / span if span > 0 else None,
                        "tokens_per_s": float(outs[good].sum()) / span if span > 0 else None}}


def replay(trace: Trace, prices: StepPrices, *, boards: int, cfg: ReplayConfig | None = None,
           slo: SLO | None = None, attainment: float = 0.9,
           progress: Callable[[int, int], None] | None = None,
           timeline_points: int = 0, refused_out: set[int] | None = None) -> dict[str, Any]:
    """Replay ``trace`` on ``boards`` boards priced by ``prices`` (the fast path); returns the report dict.
    ``refused_out``, when given, receives the 0-based indices of the requests refused at arrival (queue full,
    context).

    Keys: ``requests``, ``trace_seconds``, ``boards``, ``bundle``, ``metrics`` {ttft_ms, tpot_ms, itl_ms,
    e2e_ms, queue_ms: {p50, p95, p99}} (simulated ms), ``goodput``, ``attainment``, ``meets_slo``,
    ``rejected`` {reason: count}, ``rejected_rows`` (first 20 per reason, 1-based data rows of the trace
    file: ``Trace.file_row``),
    ``per_board`` [{requests, busy_pct, kv_peak_pct}], ``trace`` (the workload's figures), ``steps``,
    the router: ``round-robin`` (row i to board i mod N), ``least-outstanding`` (fewest queued + running),
    ``least-kv`` (least KV demand: prompt + output of its outstanding requests), ties to the lowest index;
    ``rounds_skipped`` and, with ``timeline_points`` > 0, ``timeline`` (latency and queue over trace time).
    ``progress(done, total)`` is called every 512 arrivals. Raises ValueError for boards < 1 or an
    attainment outside (0, 1].
    """
    if boards < 1:
        raise ValueError(f"boards must be >= 1, got {boards}")
    if not 0 < attainment <= 1:
        raise ValueError(f"attainment must be in (0, 1], got {attainment}")
    cfg = cfg or ReplayConfig()
    slo = slo or SLO()
    n = len(trace)
    led = Ledger(n)
    fleet = [BoardSim(i, prices, cfg, led, trace.prompt, trace.output) for i in range(boards)]
    arr = trace.arrival_s * 1e6
    stateful = cfg.route != "round-robin"
    quiet = [0.0] * boards  # per board: no request ends before this (simulated µs)
    for i in range(n):
        a = float(arr[i])
        if stateful:
            # what the router reads changes only when a request ends: run only boards where one may have
            for k, bk in enumerate(fleet):
                if quiet[k] <= a:
                    bk.run_until(a)
                    quiet[k] = bk.quiet_until()
        b = _route(fleet, i, cfg.route)
        b.run_until(a)
        why = b.submit(i, a)
        quiet[b.index] = b.quiet_until()
        if why:
            led.reason[i] = why
            if refused_out is not None:
                refused_out.add(i)
        if progress is not None and (i % 512 == 511 or i == n - 1):
            progress(i + 1, n)
    for b in fleet:
        b.run_until(math.inf)
    out: dict[str, Any] = {"requests": n, "trace_seconds": trace.span_s, "boards": boards,
                           "bundle": prices.bundle, "route": cfg.route,
                           "board_config": {"slots": cfg.slots_for(prices.decode_batch), "queue_limit": cfg.queue_limit,
                                            "prefill_chunk": cfg.prefill_chunk, "decode_batch": prices.decode_batch,
                                            "kv_cells": prices.kv_cells, "n_ctx": prices.n_ctx,
                                            "host_token_ms": prices.host_token_us / 1e3}}
    out.update(summarize(trace, led, slo=slo, attainment=attainment))
    rejected: dict[str, int] = {}
    rows: dict[str, list[int]] = {}
    for i, why in enumerate(led.reason):
        if why:
            rejected[why] = rejected.get(why, 0) + 1
            if len(rows.setdefault(why, [])) < 20:
                rows[why].append(trace.file_row(i))
    out["rejected"] = rejected
    out["rejected_rows"] = rows
    span_us = max(max(b.t for b in fleet), float(arr[-1]), 1.0)
    out["per_board"] = [{"requests": b.served, "busy_pct": 100.0 * b.busy_us / span_us,
                         "kv_peak_pct": 100.0 * b.kv_peak / prices.kv_cells} for b in fleet]
    out["trace"] = trace.stats()
    out["steps"] = sum(b.steps for b in fleet)
    out["rounds_skipped"] = sum(b.rounds_skipped for b in fleet)
    out["clock"] = ("latencies are SIMULATED ms (cost model at full size + modeled host work per token); "
                    "wall_seconds is this machine's time for the replay")
    if timeline_points:
        out["timeline"] = _timeline(trace, led, timeline_points)
    return out


def _timeline(trace: Trace, led: Ledger, points: int) -> dict[str, list[float | None]]:
    """Per trace-time bin (``points`` bins): p95 TTFT / E2E of the requests arriving in it (simulated ms) and
    the longest fleet queue met by an arrival in it (requests arrived, not refused, not yet in a slot). A bin
    whose arrivals all went unserved has None for its latencies (JSON has no NaN)."""
    edges = np.linspace(0.0, max(trace.span_s, 1e-9), points + 1)
    which = np.clip(np.searchsorted(edges, trace.arrival_s, side="right") - 1, 0, points - 1)
    arr = trace.arrival_s * 1e6
    served = led.board >= 0
    got = np.sort(led.assigned[served & ~np.isnan(led.assigned)])
    queue_len = (np.searchsorted(np.sort(arr[served]), arr, side="right")
                 - np.searchsorted(got, arr, side="right"))
    ttft = (led.first - arr) / 1e3
    e2e = (led.last - arr) / 1e3
    t_out: list[float | None] = []
    ttft_out: list[float | None] = []
    e2e_out: list[float | None] = []
    q_out: list[float | None] = []
    for k in range(points):
        m = which == k
        if not m.any():
            continue
        t_out.append(float(edges[k]))
        tt, ee = ttft[m], e2e[m]
        ttft_out.append(float(np.nanpercentile(tt, 95)) if np.isfinite(tt).any() else None)
        e2e_out.append(float(np.nanpercentile(ee, 95)) if np.isfinite(ee).any() else None)
        q_out.append(float(queue_len[m].max()))
    return {"t_s": t_out, "ttft_p95_ms": ttft_out, "e2e_p95_ms": e2e_out, "queue_max": q_out}

