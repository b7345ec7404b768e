"""The step runner: one device step for one or more requests, from KV cells to streamed text.

``start`` takes KV cells for each rider (parking those the cache cannot hold, ending those whose
KV was cleared, cancelled or failed) and submits ONE job; ``finish`` waits for it once and runs
each rider's part: stage accounting, its token pipeline (sample, stop rules, visible text),
streaming and, on a stop, its end. A prefill chunk has one rider; a decode step has up to the
decode sub-model's batch N of them. With N = 1 (today's calbin) a decode is the one-rider case of
the same path and is submitted with ``RuntimeSession.step``; with N > 1 (a C3 variant calbin)
with ``step_batch``, and riders' host work runs one after the other on the simulated clock.

Clocks: host work (KV apply, buffer set-up, sampling, detokenising) is measured with the
``HostTimer`` (this thread's CPU time; scripted in tests) and put on the simulated clock
(``host_span``, as ``HostBooking`` says) before the device step it precedes or after the step it
follows, so TTFT is honest. Time a request spends parked waiting for KV is wall time, booked too.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from sim_backend.errors import DeviceError, DeviceReset, KVExhausted, RequestCancelled
from sim_backend.planes.metrics import MetricsRegistry, percentiles
from sim_backend.planes.types import STAGES, ProgressEvent, StageTimes, TokenEvent
from sim_backend.runtime import OutputBuf, RuntimeSession
from sim_backend.serving.api import RequestState, error_dict
from sim_backend.serving.context_shift import n_past, shift_if_full
from sim_backend.serving.hosttime import HostBooking, HostTimer
from sim_backend.serving.kv_pressure import KVPressure
from sim_backend.serving.requests import RequestRecord, Slot

log = logging.getLogger(__name__)


class EndRequest(Protocol):
    """The engine's end of a request (called with its lock held)."""

    def __call__(self, r: RequestRecord, status: str, stop_type: str, error: dict[str, Any] | None,
                 stopping_word: str = "", done_ms: float | None = None) -> None: ...


@dataclasses.dataclass
class InFlight:
    """A submitted step: its riders (in order), the job, and each rider's host figures.

    ``n_tokens``: tokens each rider's part carries (the prefill chunk, or 1 for a decode);
    ``kv_wait_us``: each rider's KV wait (host µs); ``submit_host_us``: each rider's share of the
    submit's host work (µs); ``batched``: submitted with ``step_batch`` (N > 1 decode)."""

    kind: str
    riders: list[RequestRecord]
    job: OutputBuf
    n_tokens: int
    kv_wait_us: list[float]
    submit_host_us: float
    batched: bool


def progress_event(r: RequestRecord, time_ms: float) -> ProgressEvent:
    """``r``'s prompt progress now (llama-server's ``prompt_progress``): its prompt tokens, those reused from
    the slot's cache, those whose KV is written (the cached included); ``time_ms``: simulated ms since it took
    its slot."""
    return ProgressEvent(r.id, len(r.prompt), r.cache_n, r.n_prefilled, time_ms,
                         r.slot.idx if r.slot is not None else -1)


def _reset_error() -> dict[str, Any]:
    return error_dict(DeviceReset("KV cache cleared (device reset or memory clear) while the request was running"))


def _add_device_ms(r: RequestRecord, e: DeviceError) -> None:
    """Add the simulated device time a failed job occupied (``DeviceError.device_ms``) to the request's parts."""
    for k, v in (e.device_ms or {}).items():
        if k in r.device:
            r.device[k] += float(v)


class StepRunner:
    """Runs the steps the scheduler picks (module docstring).

    Args:
        rt: the runtime session (step / step_batch, KV view, clock).
        kv: the KV pressure policy (cells, parking, eviction of idle prefixes).
        slots: the engine's slots (for eviction of idle prefixes).
        lock: the engine lock; ``wake``: its condition (notified after a step).
        end: ends a request (with the lock held).
        metrics: TTFT and token gaps are recorded as pieces stream.
        host_timer / host_booking: host work measured and booked on the simulated clock.
        decode_batch: sequences one decode step carries (N); step_timeout_s: bound on each Wait() (host s).
    """

    def __init__(self, rt: RuntimeSession, kv: KVPressure, slots: Sequence[Slot], *, lock: threading.Lock,
                 wake: threading.Condition, end: EndRequest, metrics: MetricsRegistry, host_timer: HostTimer,
                 host_booking: HostBooking, decode_batch: int, step_timeout_s: float) -> None:
        self._rt = rt
        self._kv = kv
        self._slots = slots
        self._lock = lock
        self._wake = wake
        self._end = end
        self._metrics = metrics
        self._ht = host_timer
        self._booking = host_booking
        self.decode_batch = decode_batch
        self.step_timeout_s = step_timeout_s
        #: the last step of each kind ("prefill", "decode"), maintenance steps included
        self.last_stage: dict[str, StageTimes] = {}
        #: recent served steps (the stage percentiles), bounded
        self.stage_history: deque[StageTimes] = deque(maxlen=2000)
        #: recent batched decode steps: {"job_id", "occupancy", "capacity", "slots", "request_ids",
        #: "sim_end_ms"} (simulated ms); empty with a batch-1 calbin
        self.batch_log: deque[dict[str, Any]] = deque(maxlen=64)

    def _end_each(self, riders: Sequence[RequestRecord], status: str, error: dict[str, Any] | None) -> None:
        with self._lock:
            for r in riders:
                self._end(r, status, "none", error)

    # --- submit ------------------------------------------------------------------------

    def start(self, kind: str, riders: Sequence[RequestRecord], n: int) -> InFlight | None:
        """Apply KV cells and submit one job (``n``: prefill chunk tokens; decodes feed one token each).

        The host work before the submit (KV applies, buffer set-up) is put on the simulated clock first,
        so the device step starts after it. A rider whose KV was cleared fails, one parked on KV is left
        out (retried later), a cancelled or failed one ends. None if no rider was submitted.
        """
        kv = self._rt.kv
        t0 = self._ht.now()
        start_sim = self._rt.clock.now_us
        got: list[tuple[RequestRecord, list[int], np.ndarray, np.ndarray]] = []
        attempt_us = 0.0
        for r in riders:
            if r.kv_epoch != kv.epoch:  # the KV was cleared under it (reset / ClearAllDevMem / Clear KV)
                self._end_each([r], "failed", _reset_error())
                continue
            assert r.slot is not None  # set at admission; only admitted requests get steps
            if kind == "prefill":
                toks, p0 = r.prompt[r.n_prefilled:r.n_prefilled + n], r.n_prefilled
            else:
                assert r.pending_token is not None  # a decoding request has its sampled token to feed
                if r.tokens.context_shift:  # a full context is shifted before the token is fed (llama-server)
                    shift_if_full(self._rt, r, self._kv.n_ctx)
                toks, p0 = [r.pending_token], n_past(r)
            positions = np.arange(p0, p0 + len(toks), dtype=np.int64)
            try:
                if not kv.can_allocate(len(toks)):
                    with self._lock:
                        self._kv.evict_idle(self._slots, len(toks))
                cells = self._kv.apply(r, r.slot.seq_id, positions)
            except RequestCancelled:
                self._end_each([r], "cancelled", None)
                continue
            except (KVExhausted, DeviceError) as e:
                self._end_each([r], "failed", error_dict(e))
                continue
            if cells is None:
                continue  # parked: KV is full; retried after a back-off while others run
            attempt_us += r.kv_last_attempt_us
            got.append((r, toks, positions, cells))
        if not got:
            return None
        on = [g[0] for g in got]
        host_us = self._ht.now() - t0
        booked_us = self._booking.before(host_us)
        for r in on:
            r.host_booked_ms += booked_us / 1e3 / len(on)
        self._rt.clock.host_span(start_sim, booked_us)  # the job is submitted after this host work
        batched = kind == "decode" and self.decode_batch > 1
        try:
            if batched:
                job = self._rt.step_batch([(r.slot.seq_id, r.pending_token, int(pos[0]), int(cells.reshape(-1)[0]),
                                            r.numeric) for r, _, pos, cells in got if r.slot is not None])
            else:
                r, toks, positions, cells = got[0]
                assert r.slot is not None
                if kind == "prefill" and r.prefill_start_ms is None:
                    r.prefill_start_ms = start_sim / 1e3
                # CalRT path (facts.md F1): pooled buffers, CSR set and checked, ping/pong task type
                job = self._rt.step(kind, r.slot.seq_id, np.asarray(toks, dtype=np.int64), positions, cells,
                                    numeric=r.numeric)
        except RequestCancelled:
            self._end_each(on, "cancelled", None)
            return None
        except (KVExhausted, DeviceError) as e:
            self._end_each(on, "failed", error_dict(e))
            return None
        for r in on:
            r.host["kv_wait"] += r.kv_last_wait_us / 1e3
        # host work of the submit itself: CPU time minus the applies (parked wall time is not in host_us)
        return InFlight(kind, on, job, len(got[0][1]) if kind == "prefill" else 1,
                        [r.kv_last_wait_us for r in on], max(0.0, host_us - attempt_us) / len(on), batched)

    # --- finish ------------------------------------------------------------------------

    def finish(self, step: InFlight, fail_internal: Callable[[RequestRecord, Exception], None]) -> None:
        """Wait for the job once, then run each rider's part in turn (its host work after the previous one's).
        A bug in one rider's part fails that rider alone (``fail_internal``)."""
        try:
            res = step.job.wait(self.step_timeout_s)
        except DeviceError as e:
            step.job.discard()  # a timed-out job returns its buffers to the pool when it ends
            with self._lock:
                for r in step.riders:
                    _add_device_ms(r, e)  # each rider's timings carry the step, as when it succeeds
                    self._end(r, "failed", "none", error_dict(e))
            return
        with self._lock:
            busy = sum(1 for s in self._slots if s.req is not None)
        self._metrics.on_decode(busy)  # llama.cpp's llama_decode() counters: one per device step
        if step.batched:
            self.batch_log.append({"job_id": res.job_id, "occupancy": len(res.batch), "capacity": self.decode_batch,
                                   "slots": [r.slot.idx for r in step.riders if r.slot is not None],
                                   "request_ids": [r.id for r in step.riders], "sim_end_ms": res.sim_end_us / 1e3})
        t = res.sim_end_us
        for i, r in enumerate(step.riders):
            mine = res
            if step.batched:
                row = res.batch[i]
                mine = dataclasses.replace(res, seq_id=row.seq_id, past_len=row.past_len, logits=row.logits,
                                           experts_touched=row.experts_touched, sim_end_us=t)
            try:
                t = self._after_step(r, mine, step.kind, step.n_tokens, step.kv_wait_us[i], step.submit_host_us)
            except Exception as e:  # noqa: BLE001 - one rider's bug must not take the others (or the engine) down
                fail_internal(r, e)

    def _after_step(self, r: RequestRecord, res: Any, kind: str, n: int, kv_wait_us: float,
                    submit_host_us: float) -> float:
        """Account, sample, apply stop rules and stream one rider's part of a finished step.

        ``res``: the StepResult (for a batched step, this rider's view of it: its logits,
        ``sim_end_us`` = when its host work may start). Returns the simulated µs its host work ended.
        """
        ht = self._ht
        t0 = ht.now()
        cost = res.cost
        # the parts add up to the step's sim time (a slow chip is already in the per-chip pricing)
        dev = {"h2d": cost.h2d_us / 1e3, "infer": cost.infer_us / 1e3, "d2h": cost.d2h_us / 1e3}
        for k in dev:
            r.device[k] += dev[k]
        sampling_us = detok_us = 0.0
        assert r.slot is not None  # set at admission, never cleared
        if kind == "prefill":
            r.n_prefilled += n
            r.slot.cache_tokens = r.prompt[: r.n_prefilled]
        else:
            assert r.pending_token is not None  # the decode step just fed it
            r.slot.cache_tokens.append(r.pending_token)
        visible = ""
        stop: tuple[str, str] | None = None
        need_token = (kind == "decode" or r.n_prefilled >= len(r.prompt)) and not r.handle.cancelled
        if need_token:
            s0 = ht.now()
            tok = r.tokens.sample(res.logits, r.numeric)
            sampling_us = ht.now() - s0
            d0 = ht.now()
            visible, stop = r.tokens.push(tok)
            detok_us = ht.now() - d0
            r.host["sampling"] += sampling_us / 1e3
            r.host["detokenize"] += detok_us / 1e3
        host_us = ht.now() - t0
        framework_us = max(0.0, host_us - sampling_us - detok_us) + submit_host_us
        r.host["framework"] += framework_us / 1e3
        booked_us = self._booking.after(host_us, 1 if need_token else 0)
        r.host_booked_ms += booked_us / 1e3
        t_end = self._rt.clock.host_span(res.sim_end_us, booked_us)
        tok_ms = 0.0
        if kind == "prefill" and not r.tokenize_reported:
            r.tokenize_reported = True
            tok_ms = r.tokenize_ms
        st = StageTimes(kind, dev["h2d"], dev["infer"], dev["d2h"], kv_wait_us / 1e3, sampling_us / 1e3,
                        detok_us / 1e3, framework_us / 1e3, tok_ms, n, r.id)
        self.last_stage[kind] = st
        self.stage_history.append(st)
        if kind == "prefill" and r.req.return_progress:  # after each prefill step, before its first token
            r.handle.emit(progress_event(r, res.sim_end_us / 1e3 - (r.assigned_ms or 0.0)))
        if need_token:
            if r.first_token_ms is None:
                r.first_token_ms = t_end / 1e3
                r.handle.state = RequestState.DECODING
            r.last_token_ms = t_end / 1e3
        if visible:
            # TTFT / ITL are recorded as the pieces stream, so a reply stopped later still counts
            if not r.pieces_ms:
                if not r.ttft_recorded:
                    r.ttft_recorded = True
                    self._metrics.on_first_token(t_end / 1e3 - r.arrival_ms)
            else:
                self._metrics.on_token_gap(t_end / 1e3 - r.pieces_ms[-1])
            r.pieces_ms.append(t_end / 1e3)
            r.text_parts.append(visible)
            r.handle.emit(TokenEvent(r.id, visible, len(r.generated), t_end / 1e3, tuple(r.generated[r.n_streamed:]),
                                     tuple(r.tokens.probs[r.n_streamed:]), r.slot.idx))
            r.n_streamed = len(r.generated)
        with self._lock:
            if stop is not None and r.handle.cancelled:
                # cancelled while this token was sampled (the check above was before the lock): the
                # client left before its end was written down, so it is not counted finished
                self._end(r, "cancelled", "none", None, done_ms=t_end / 1e3)
            elif stop is not None:
                self._end(r, "finished", stop[0], None, stopping_word=stop[1], done_ms=t_end / 1e3)
            else:
                self._wake.notify_all()
        return t_end

    def launch(self, kind: str, riders: Sequence[RequestRecord], n: int) -> InFlight | None:
        """``start``, with a bug in it failing its riders (never the scheduler thread): None then."""
        try:
            return self.start(kind, riders, n)
        except Exception as e:  # noqa: BLE001 - a bug must fail its requests, never the scheduler
            for r in riders:
                self.fail_internal(r, e)
            return None

    def complete(self, step: InFlight) -> None:
        """``finish``, with a bug in it failing the step's riders (never the scheduler thread)."""
        try:
            self.finish(step, self.fail_internal)
        except Exception as e:  # noqa: BLE001 - see launch
            for r in step.riders:
                self.fail_internal(r, e)

    def fail_internal(self, r: RequestRecord, e: Exception) -> None:
        """End ``r`` with a typed internal error (llama-server ``server_error``); the scheduler runs on."""
        log.exception("request %s failed inside the engine", r.id)
        with self._lock:
            if r.slot is not None:
                self._rt.kv.free(r.slot.seq_id)
                r.slot.cache_tokens = []
            self._end(r, "failed", "none", {"code": 500, "type": "server_error", "type_name": type(e).__name__,
                                            "message": f"internal error in the engine: {type(e).__name__}: {e}"})

    def stage_summary(self) -> dict[str, Any]:
        """P50/P95/P99/mean of each stage (facts.md F8) over the recent served steps, per kind.

        {"prefill": {"h2d": {"p50": ..}, ...}, "decode": {...}, "units": ...}. Device
        stages are simulated ms, host stages measured host ms.
        """
        hist = list(self.stage_history)
        out: dict[str, Any] = {"units": "h2d/infer/d2h simulated device ms; other stages measured host ms"}
        for kind in ("prefill", "decode"):
            steps = [s for s in hist if s.kind == kind]
            out[kind] = {name: percentiles(getattr(s, f"{name}_ms") for s in steps) for name in STAGES}
        return out

    def record_external(self, res: Any, *, source: str, framework_ms: float = 0.0,
                        sampling_ms: float = 0.0) -> StageTimes:
        """Show a step the engine did not schedule (a maintenance probe, self-test or health check) as the
        last step of its kind; not added to ``stage_history`` (the percentiles stay those of served requests)."""
        cost = res.cost
        st = StageTimes(res.kind, cost.h2d_us / 1e3, cost.infer_us / 1e3, cost.d2h_us / 1e3, 0.0, sampling_ms, 0.0,
                        framework_ms, 0.0, res.n_tokens, None, source)
        self.last_stage[res.kind] = st
        return st
