"""How many boards for this traffic: the smallest board count meeting an SLO, per bundle variant.

Each probe is one independent fast-path replay (:func:`sim_backend.tools.replay.replay`) of the whole cut
on ``boards`` boards of one variant. Probes go to a ``concurrent.futures.Executor``: a local
``ProcessPoolExecutor`` on every core, or a dask.distributed cluster through ``Client.get_executor()``
(the ``cluster`` extra); the search itself never schedules work of its own beyond submitting probes and
reading their results.

Search per variant: board counts double from ``start`` until one meets the SLO at the attainment, then
bisect between the last failing and the first meeting count. It assumes attainment does not fall when a
board is added (true of the round-robin and least-loaded routers on a fixed trace up to the noise of
where a request lands; every tried count is reported, so a reader sees if it did not hold). Variants
search side by side, one probe of each in flight at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field
from typing import Any

from sim_backend.planes.types import SLO
from sim_backend.tools.replay import replay
from sim_backend.tools.replay_board import ReplayConfig
from sim_backend.tools.replay_prices import StepPrices, prices_for_trace, variant_bundle_dir
from sim_backend.tools.replay_trace import Trace

__all__ = ["MAX_BOARDS", "Search", "find_boards", "price_variant", "probe"]

#: the largest board count a search tries before it reports "not met"
MAX_BOARDS = 1024


def price_variant(trace: Trace, variant: str, prefill_chunk: int) -> StepPrices:
    """The step tables of bundle ``variant`` (a name of ``replay.VARIANTS`` or a bundle directory) for
    ``trace``, detached from the cost model so they pickle small. Raises ManifestError for a bad bundle."""
    return prices_for_trace(trace, variant_bundle_dir(variant), prefill_chunk=prefill_chunk).detached()


def probe(trace: Trace, prices: StepPrices, boards: int, cfg: ReplayConfig, slo: SLO,
          attainment: float) -> dict[str, Any]:
    """One search point: the replay's figures a table needs (``variant``, ``boards``, ``meets_slo``,
    ``attainment``, ``ttft_p95_ms`` / ``tpot_p95_ms`` / ``e2e_p95_ms`` / ``queue_p95_ms`` simulated ms,
    ``rejected`` count, ``busy_pct`` mean over boards, ``wall_seconds`` this machine's time). Runs in a
    worker process; pure function of its arguments."""
    w0 = time.perf_counter()
    rep = replay(trace, prices, boards=boards, cfg=cfg, slo=slo, attainment=attainment)
    m = rep["metrics"]
    busy = [b["busy_pct"] for b in rep["per_board"]]
    return {"variant": prices.bundle, "boards": boards, "meets_slo": rep["meets_slo"],
            "attainment": rep["attainment"], "ttft_p95_ms": m["ttft_ms"]["p95"], "tpot_p95_ms": m["tpot_ms"]["p95"],
            "e2e_p95_ms": m["e2e_ms"]["p95"], "queue_p95_ms": m["queue_ms"]["p95"],
            "rejected": sum(rep["rejected"].values()), "busy_pct": sum(busy) / len(busy),
            "wall_seconds": time.perf_counter() - w0}


@dataclass
class Search:
    """One variant's search state: ``lo`` = largest count known to miss (0 = none), ``hi`` = smallest known
    to meet (None = none yet), ``tried`` = every probe's record in the order they ended."""

    variant: str
    prices: StepPrices
    next_up: int
    lo: int = 0
    hi: int | None = None
    tried: list[dict[str, Any]] = field(default_factory=list)

    def record(self, rec: dict[str, Any]) -> None:
        """Take one probe's result and choose the next count (``next_up`` 0 = done)."""
        self.tried.append(rec)
        n = int(rec["boards"])
        if rec["meets_slo"]:
            self.hi = n if self.hi is None else min(self.hi, n)
        else:
            self.lo = max(self.lo, n)
        if self.hi is None:
            self.next_up = min(MAX_BOARDS, self.lo * 2) if self.lo < MAX_BOARDS else 0
        elif self.hi - self.lo > 1:
            self.next_up = (self.lo + self.hi) // 2
        else:
            self.next_up = 0

    @property
    def answer(self) -> int | None:
        """The smallest board count that met the SLO (None: not met up to :data:`MAX_BOARDS`)."""
        return self.hi


def find_boards(trace: Trace, variants: list[str], executor: Executor, *, slo: SLO, attainment: float = 0.9,
                cfg: ReplayConfig | None = None, start: int = 1,
                progress: Callable[[int, str], None] | None = None) -> dict[str, Any]:
    """Search each of ``variants`` for the fewest boards meeting ``slo`` at ``attainment`` over ``trace``.

    Pricing and probes run on ``executor`` (results pickled back). Returns ``{"search": [every probe record,
    grouped by variant, in board order], "answers": {variant: boards or None}, "slo", "attainment_target",
    "route", "probes", "wall_seconds"}``. ``progress(done_probes, message)`` is called as probes end.
    Raises ValueError for ``start`` outside 1..MAX_BOARDS or no variant; a probe's own error propagates.
    """
    if not variants:
        raise ValueError("name at least one bundle variant to search")
    if not 1 <= start <= MAX_BOARDS:
        raise ValueError(f"the first board count must be in 1..{MAX_BOARDS}, got {start}")
    cfg = cfg or ReplayConfig()
    w0 = time.perf_counter()
    priced = {v: executor.submit(price_variant, trace, v, cfg.prefill_chunk) for v in variants}
    searches: dict[str, Search] = {}
    pending: dict[Future[Any], str] = {}
    done = 0
    for v, pf in priced.items():
        s = searches[v] = Search(v, pf.result(), start)
        pending[executor.submit(probe, trace, s.prices, start, cfg, slo, attainment)] = v
    while pending:
        finished, _ = wait(list(pending), return_when=FIRST_COMPLETED)
        for f in finished:
            v = pending.pop(f)
            rec: dict[str, Any] = f.result()
            s = searches[v]
            s.record(rec)
            done += 1
            if progress is not None:
                verdict = "meets" if rec["meets_slo"] else "misses"
                progress(done, f"{rec['variant']} on {rec['boards']} boards {verdict} the SLO "
                               f"(attainment {rec['attainment']:.3f})")
            if s.next_up:
                pending[executor.submit(probe, trace, s.prices, s.next_up, cfg, slo, attainment)] = v
    rows = [r for s in searches.values() for r in sorted(s.tried, key=lambda r: r["boards"])]
    return {"search": rows, "answers": {s.prices.bundle: s.answer for s in searches.values()},
            "slo": slo.to_dict(), "attainment_target": attainment, "route": cfg.route, "probes": done,
            "max_boards": MAX_BOARDS, "wall_seconds": time.perf_counter() - w0}

