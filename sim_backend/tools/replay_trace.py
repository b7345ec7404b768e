"""A production trace for the replay (:mod:`sim_backend.tools.replay`): a CSV of
``TIMESTAMP,ContextTokens,GeneratedTokens`` (Azure's LLM inference trace 2023, shipped in
``calconsole/bench/data/azure-llm-2023``), read and checked into a :class:`Trace` (:func:`load_trace`;
a bad file raises :class:`TraceError` naming its row)."""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


class TraceError(ValueError):
    """A malformed trace: ``row`` (1-based data row; 0 = the header), ``field`` (column name) and why."""

    def __init__(self, path: str, row: int, fld: str, why: str) -> None:
        self.row, self.field = row, fld
        where = "header" if row == 0 else f"row {row}"
        super().__init__(f"{path}: {where}, {fld}: {why}")


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
