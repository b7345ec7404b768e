"""The request ledger: how a request's end is written down. Its ``Timings`` (llama.cpp fields plus
TTFT / TPOT / ITL / E2E / queue time, facts.md F7), its ``RequestResult``, and the metrics of its
end; ``build_timings`` is pure (a record and the end time in, the timings out).

Clocks: request timestamps are SIMULATED ms on the board's clock; ``host_ms`` holds the measured
host parts and ``device_ms`` the simulated device parts (h2d, infer, d2h).
"""

from __future__ import annotations

from typing import Any

from sim_backend.planes.metrics import MetricsRegistry, request_latencies
from sim_backend.planes.types import RequestResult, Timings
from sim_backend.serving.api import RequestState
from sim_backend.serving.requests import RequestRecord

_STATE = {"finished": RequestState.FINISHED, "failed": RequestState.FAILED, "cancelled": RequestState.CANCELLED}


def build_timings(r: RequestRecord, now_ms: float, host_time: str) -> Timings:
    """The timings of ``r`` ending at ``now_ms`` (simulated ms); ``host_time``: how host work was booked.

    TTFT is the first visible piece, or the first token sampled when nothing was shown (EOS first,
    only special tokens, text held back when the request was stopped); ``prompt_ms`` runs from the
    prefill start to the first token (or to the end, for a request ended during prefill).
    """
    n = len(r.generated)
    ttft, tpot, itl, e2e = request_latencies(r.arrival_ms, r.pieces_ms, now_ms, n)
    if ttft is None and r.first_token_ms is not None:
        ttft, tpot, itl, e2e = request_latencies(r.arrival_ms, [r.first_token_ms], now_ms, n)
        itl = ()
    pn = r.n_prefilled - r.cache_n
    if r.first_token_ms is not None and r.prefill_start_ms is not None:
        prompt_ms = r.first_token_ms - r.prefill_start_ms
    elif r.prefill_start_ms is not None:
        prompt_ms = now_ms - r.prefill_start_ms  # ended during prefill
    else:
        prompt_ms = 0.0
    predicted_ms = (r.last_token_ms - r.first_token_ms) if (
        r.first_token_ms is not None and r.last_token_ms is not None) else 0.0  # set together
    done_prefill = r.first_token_ms is not None
    return Timings(
        prompt_n=pn, prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_ms / pn if pn and done_prefill else None,
        prompt_per_second=1e3 * pn / prompt_ms if pn and prompt_ms > 0 and done_prefill else None,
        predicted_n=n, predicted_ms=predicted_ms,
        # llama.cpp: the first token costs no decode step, so n - 1 steps over predicted_ms; 0.0 for one token
        predicted_per_token_ms=predicted_ms / (n - 1) if n > 1 else 0.0,
        predicted_per_second=1e3 * (n - 1) / predicted_ms if n > 1 and predicted_ms > 0 else 0.0,
        cache_n=r.cache_n, ttft_ms=ttft, tpot_ms=tpot, itl_ms=tuple(itl), e2e_ms=e2e,
        # waiting for a slot, nothing else: from the tokenised prompt (its host work is booked before)
        queue_ms=max(0.0, r.assigned_ms - r.tokenized_ms) if r.assigned_ms is not None else None,
        host_ms=dict(r.host), device_ms=dict(r.device), numerics=r.numeric,
        timing_only_reason=r.timing_only_reason,
        arrival_ms=r.arrival_ms, done_ms=now_ms,
        host_booked_ms=r.host_booked_ms, host_time=host_time,
    )


class RequestLedger:
    """Writes down each request's end: timings, result, metrics, and hands the result to its handle.

    Args:
        metrics: the registry ends (and first tokens not yet recorded) go into.
        host_time: the engine's host booking mode (``"modeled"`` | ``"measured"``), copied into Timings.
    """

    def __init__(self, metrics: MetricsRegistry, host_time: str) -> None:
        self.metrics = metrics
        self.host_time = host_time

    def close(self, r: RequestRecord, status: str, stop_type: str, error: dict[str, Any] | None, *,
              stopping_word: str, now_ms: float, live: tuple[int, int, float]) -> RequestResult:
        """End ``r`` with ``status`` (finished | failed | cancelled) at ``now_ms`` (simulated) and deliver
        the result to its handle. ``live``: (queued, running, KV used share) after it left its slot.
        A cancel without an error gets llama-server's ``cancelled`` error with the handle's reason."""
        timings = build_timings(r, now_ms, self.host_time)
        if timings.ttft_ms is not None and not r.ttft_recorded:
            r.ttft_recorded = True
            self.metrics.on_first_token(timings.ttft_ms)
        if status == "cancelled" and error is None:
            error = {"type": "cancelled", "message": r.handle.cancel_reason or "cancelled"}
        result = RequestResult(r.id, status, "".join(r.text_parts), tuple(r.generated), stop_type, stopping_word,
                               error, timings, r.tokens.seed, tuple(r.tokens.probs),
                               r.slot.idx if r.slot is not None else -1, r.tokens.truncated, r.n_shifts,
                               r.n_discarded)
        r.handle.state = _STATE.get(status, RequestState.CANCELLED)
        self.metrics.on_done(status, prompt_n=r.n_prefilled, cache_n=r.cache_n, predicted_n=len(r.generated),
                             prompt_ms=timings.prompt_ms, predicted_ms=timings.predicted_ms, ttft=timings.ttft_ms,
                             tpot=timings.tpot_ms, itl=timings.itl_ms, e2e=timings.e2e_ms, queue_ms=timings.queue_ms,
                             done_ms=now_ms, arrival_ms=r.arrival_ms, live=live)
        r.handle._finish(result)
        return result
