"""Serving engine: the llama.cpp-server layer over the simulated device (FACTS F1).

Slots over a batch-1 device, a bounded admission queue, chunked prefill and
decode scheduled from separate queues, CPU sampling, stop rules, streaming
with UTF-8-safe detokenisation and stop-string holdback, per-request metrics.

Scheduling rule (stated, tested): every round runs ONE decode step for each
decoding slot (round-robin), then ONE prefill chunk (<= ``prefill_chunk``
tokens) for the next prefilling slot in round-robin order. Decodes therefore
never wait behind a whole long prompt, and a long prompt yields to shorter
prompts admitted after it after each chunk: no request starves.

Clocks: request timestamps are on the simulated device clock. Host work
(tokenising, sampling, detokenising, KV waits, framework) is measured in
wall time and added to that clock (``SimClock.host_span``) so TTFT is
honest; ``Timings`` says which part is which.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .device import Job, SimulatedBoard
from .errors import (CalError, DeviceError, ExceedContextSizeError, InvalidRequestError, KVExhausted,
                     RequestCancelled, UnavailableError)
from .metrics import MetricsRegistry, request_latencies
from .sampling import SamplingParams, Sampler, bf16_to_f32
from .tokenizer import EOS_IDS, StopStringMatcher, StreamDecoder, get_tokenizer

STOP_TYPES = ("eos", "limit", "word", "none")


class HostTimer:
    """Measures host work in wall microseconds. Tests inject a scripted one."""

    def now(self) -> float:
        return time.perf_counter() * 1e6


class ScriptedHostTimer(HostTimer):
    """Deterministic host clock: every ``now()`` call advances by ``step_us`` (0 = host work is free)."""

    def __init__(self, step_us: float = 0.0) -> None:
        self._t = 0.0
        self.step_us = step_us

    def now(self) -> float:
        self._t += self.step_us
        return self._t


@dataclass(frozen=True)
class ChatRequest:
    """One chat completion request.

    messages: sequence of {"role", "content"}; max_tokens: > 0 generated
    tokens at most; stop: stop strings (non-empty); sampling: SamplingParams.
    """

    messages: tuple[dict, ...]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    enable_thinking: bool = False
    client: str = "api"

    @staticmethod
    def from_prompt(prompt: str, **kw: Any) -> "ChatRequest":
        return ChatRequest(messages=({"role": "user", "content": prompt},), **kw)


class RequestState(str, Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class StageTimes:
    """Per-step stage times (FACTS F8). Device stages are simulated ms; host stages are wall ms."""

    kind: str
    h2d_ms: float
    infer_ms: float
    d2h_ms: float
    kv_wait_ms: float
    sampling_ms: float
    detokenize_ms: float
    framework_ms: float
    tokenize_ms: float = 0.0


@dataclass(frozen=True)
class Timings:
    """llama.cpp ``timings`` plus TTFT/TPOT/ITL/E2E/queue.

    All ``*_ms`` are simulated device milliseconds on the device clock, which
    includes measured host work; ``host_ms`` breaks out the measured host
    wall time (tokenize, sampling, detokenize, kv_wait, framework) and
    ``device_ms`` the simulated device time (h2d, infer, d2h).
    """

    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float | None
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float | None
    predicted_per_second: float | None
    cache_n: int
    ttft_ms: float | None
    tpot_ms: float | None
    itl_ms: tuple[float, ...]
    e2e_ms: float
    queue_ms: float | None
    host_ms: dict
    device_ms: dict
    numerics: bool

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["itl_ms"] = list(self.itl_ms)
        d["clock"] = "simulated device ms (host work measured and included)"
        return d


@dataclass(frozen=True)
class RequestResult:
    """Final outcome of a request. status: finished | failed | cancelled."""

    request_id: int
    status: str
    text: str
    tokens: tuple[int, ...]
    stop_type: str
    stopping_word: str
    error: dict | None
    timings: Timings
    seed: int | None


@dataclass(frozen=True)
class TokenEvent:
    """A visible piece of streamed text (never half a UTF-8 character, never part of a stop string)."""

    request_id: int
    text: str
    n_tokens: int
    sim_ms: float


@dataclass(frozen=True)
class DoneEvent:
    request_id: int
    result: RequestResult


class RequestHandle:
    """Client side of a request: stream events, cancel, wait for the result. Thread-safe."""

    def __init__(self, req_id: int, prompt_n: int) -> None:
        self.id = req_id
        self.prompt_n = prompt_n
        self._events: queue.Queue[TokenEvent | DoneEvent] = queue.Queue()
        self._cancel = threading.Event()
        self.cancel_reason = ""
        self._result: RequestResult | None = None
        self._done = threading.Event()
        self._engine_wake: Callable[[], None] = lambda: None
        self.state = RequestState.QUEUED

    def cancel(self, reason: str = "cancelled by client") -> None:
        """Cancel in any state (queued, prefilling, decoding); idempotent, returns at once."""
        if not self._cancel.is_set():
            self.cancel_reason = reason
            self._cancel.set()
            self._engine_wake()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def next_event(self, timeout: float) -> TokenEvent | DoneEvent | None:
        """Next event within ``timeout`` host seconds, or None."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def stream(self, timeout: float = 60.0) -> Iterator[TokenEvent | DoneEvent]:
        """Yield events until the DoneEvent. Raises TimeoutError if nothing arrives for ``timeout`` s."""
        while True:
            ev = self.next_event(timeout)
            if ev is None:
                raise TimeoutError(f"request {self.id}: no event for {timeout:.0f} s")
            yield ev
            if isinstance(ev, DoneEvent):
                return

    def result(self, timeout: float) -> RequestResult:
        """Block up to ``timeout`` host seconds for the final result (TimeoutError otherwise)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not done after {timeout:.1f} s")
        assert self._result is not None
        return self._result

    def _finish(self, result: RequestResult) -> None:
        self._result = result
        self._events.put(DoneEvent(self.id, result))
        self._done.set()


class _Request:
    """Engine-side state of one request."""

    def __init__(self, rid: int, req: ChatRequest, prompt: list[int], handle: RequestHandle, arrival_ms: float,
                 tokenize_ms: float) -> None:
        self.id = rid
        self.req = req
        self.prompt = prompt
        self.handle = handle
        self.arrival_ms = arrival_ms
        self.tokenize_ms = tokenize_ms
        self.slot: _Slot | None = None
        self.assigned_ms: float | None = None
        self.n_prefilled = 0  # prompt tokens whose KV is written (including cache_n)
        self.cache_n = 0
        self.generated: list[int] = []
        self.pending_token: int | None = None  # sampled, not yet fed to the model
        self.pieces_ms: list[float] = []
        self.text_parts: list[str] = []
        self.prefill_start_ms: float | None = None
        self.prefill_end_ms: float | None = None
        self.decode_device_ms = 0.0
        self.host = {"tokenize": tokenize_ms, "sampling": 0.0, "detokenize": 0.0, "kv_wait": 0.0, "framework": 0.0}
        self.device = {"h2d": 0.0, "infer": 0.0, "d2h": 0.0}
        self.sampler = Sampler(req.sampling)
        self.decoder = StreamDecoder(skip_special=True)
        self.matcher = StopStringMatcher(req.stop)
        self.numeric = True
        self.fallback_rng = np.random.default_rng(self.sampler.seed)

    @property
    def state(self) -> RequestState:
        return self.handle.state


class _Slot:
    def __init__(self, idx: int) -> None:
        self.idx = idx
        self.seq_id = idx
        self.req: _Request | None = None
        self.cache_tokens: list[int] = []  # tokens whose KV this slot's sequence holds (prefix reuse)
        self.last_used = 0.0


@dataclass(frozen=True)
class SlotInfo:
    """Observation view of one slot."""

    index: int
    state: str  # idle | prefilling | decoding
    request_id: int | None
    prompt_n: int
    n_prefilled: int
    predicted_n: int
    cached_tokens: int


class Engine:
    """Slots + admission + scheduler thread over a ``SimulatedBoard``.

    Args:
        board: the simulated device.
        n_slots: concurrent sequences (default 4); each slot is a KV sequence id.
        queue_limit: waiting requests beyond busy slots; more -> UnavailableError at once.
        prefill_chunk: max tokens per prefill job (CSR cur_seq_len), for fairness.
        max_inflight: 1 = serial infer()+Wait(); 2 = ping/pong overlap of host and device work.
        kv_timeout_s: bound on waiting for KV cells (host wall s), then KVExhausted.
        step_timeout_s: bound on Wait() for one device job (host wall s).
        numerics_max_prompt: prompts longer than this (tokens) run timing-only:
            their tokens are drawn from the seeded generator, and the reply says so
            (exact numerics at long context are O(n^2) in Python; see README).
        host_timer: measures host work; ScriptedHostTimer makes timings deterministic.
    """

    def __init__(self, board: SimulatedBoard, *, n_slots: int = 4, queue_limit: int = 16, prefill_chunk: int = 2048,
                 max_inflight: int = 1, kv_timeout_s: float = 2.0, step_timeout_s: float = 120.0,
                 numerics_max_prompt: int = 1024, host_timer: HostTimer | None = None,
                 metrics: MetricsRegistry | None = None) -> None:
        if n_slots < 1 or n_slots > 64:
            raise ValueError("n_slots must be in 1..64")
        if max_inflight not in (1, 2):
            raise ValueError("max_inflight must be 1 (serial) or 2 (ping/pong)")
        self.board = board
        self.tokenizer = get_tokenizer()
        self.n_ctx = board.bundle.context
        self.n_slots = n_slots
        self.queue_limit = queue_limit
        self.prefill_chunk = prefill_chunk
        self.max_inflight = max_inflight
        self.kv_timeout_s = kv_timeout_s
        self.step_timeout_s = step_timeout_s
        self.numerics_max_prompt = numerics_max_prompt
        self.host_timer = host_timer or HostTimer()
        self.metrics = metrics or MetricsRegistry()
        self.slots = [_Slot(i) for i in range(n_slots)]
        self._queue: deque[_Request] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._admitting = True
        self._refuse_reason = ""
        self._rr_decode = 0
        self._rr_prefill = 0
        self._stop = False
        self.last_stage: dict[str, StageTimes] = {}
        self.stage_history: deque[StageTimes] = deque(maxlen=2000)
        self._thread = threading.Thread(target=self._loop, name="calconsole-engine", daemon=True)
        self._thread.start()

    # --- client API ------------------------------------------------------------------

    def validate(self, req: ChatRequest) -> None:
        """Raise InvalidRequestError for bad parameters (nothing is allocated)."""
        if not isinstance(req.messages, (tuple, list)) or not req.messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        last = req.messages[-1]
        if not isinstance(last, dict) or not isinstance(last.get("content"), str) or not last["content"].strip():
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int) or req.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {req.max_tokens!r}", param="max_tokens")
        if not isinstance(req.stop, (tuple, list)):
            raise InvalidRequestError("stop must be a list of strings", param="stop")
        for s in req.stop:
            if not isinstance(s, str) or s == "":
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}", param="stop")
        req.sampling.validate(self.board.shape.vocab)

    def tokenize_prompt(self, req: ChatRequest) -> list[int]:
        """Prompt token ids with the chat template applied (what counts against the context)."""
        return self.tokenizer.encode_chat(list(req.messages), add_generation_prompt=True,
                                          enable_thinking=req.enable_thinking)

    def submit(self, req: ChatRequest) -> RequestHandle:
        """Validate, tokenise and enqueue. Returns a handle at once.

        Raises (nothing allocated): InvalidRequestError, ExceedContextSizeError
        (prompt > n_ctx = 40960 tokens), UnavailableError (queue full, or
        device in maintenance).
        """
        with self._lock:
            if not self._admitting:
                self.metrics.on_rejected()
                raise UnavailableError(self._refuse_reason or "not admitting requests")
        self.validate(req)
        arrival = self.board.clock.now_us
        t0 = self.host_timer.now()
        prompt = self.tokenize_prompt(req)
        tok_us = self.host_timer.now() - t0
        if len(prompt) > self.n_ctx:
            self.metrics.on_rejected()
            raise ExceedContextSizeError(len(prompt), self.n_ctx)
        with self._lock:
            if not self._admitting:
                self.metrics.on_rejected()
                raise UnavailableError(self._refuse_reason or "not admitting requests")
            busy = sum(1 for s in self.slots if s.req is not None)
            if len(self._queue) >= self.queue_limit and busy >= self.n_slots:
                self.metrics.on_rejected()
                raise UnavailableError(f"server busy: {len(self._queue)} requests queued (limit {self.queue_limit})")
            rid = next(self._ids)
            handle = RequestHandle(rid, len(prompt))
            handle._engine_wake = self._notify
            end = self.board.clock.host_span(arrival, tok_us)
            r = _Request(rid, req, prompt, handle, arrival / 1e3, tok_us / 1e3)
            r.arrival_ms = arrival / 1e3
            self._queue.append(r)
            self.metrics.on_submitted()
            self._update_live_locked()
            self._wake.notify_all()
        del end
        return handle

    def generate(self, req: ChatRequest, timeout: float = 600.0) -> RequestResult:
        """Submit and wait for the final result (headless convenience)."""
        h = self.submit(req)
        try:
            return h.result(timeout)
        except BaseException:
            h.cancel("caller interrupted")  # a vanished client counts as a cancel
            raise

    # --- admission control (maintenance plane) ------------------------------------------

    def pause_admission(self, reason: str) -> None:
        """Refuse new requests with UnavailableError(reason) until ``resume_admission``."""
        with self._lock:
            self._admitting = False
            self._refuse_reason = reason

    def resume_admission(self) -> None:
        with self._lock:
            self._admitting = True
            self._refuse_reason = ""

    @property
    def admitting(self) -> bool:
        with self._lock:
            return self._admitting

    def active_count(self) -> int:
        with self._lock:
            return len(self._queue) + sum(1 for s in self.slots if s.req is not None)

    def drain(self, timeout_s: float, reason: str) -> dict:
        """Wait up to ``timeout_s`` host seconds for in-flight requests to end, then cancel the rest with ``reason``.

        Returns {"drained": n ended on their own, "cancelled": n cancelled, "wall_ms", "sim_ms"}.
        Admission should be paused first. Bounded: never waits past timeout + one device step.
        """
        t0 = time.perf_counter()
        sim0 = self.board.clock.now_us
        with self._lock:
            initial = {r.id: r for r in self._queue} | {s.req.id: s.req for s in self.slots if s.req is not None}
            deadline = t0 + timeout_s
            while self._active_locked() and time.perf_counter() < deadline:
                self._wake.wait(min(0.05, max(0.0, deadline - time.perf_counter())))
            remaining = [r for r in initial.values() if r.handle._result is None]
        for r in remaining:
            r.handle.cancel(reason)
        # cancels take effect within one device step; wait for them (bounded)
        end = time.perf_counter() + self.step_timeout_s
        for r in remaining:
            r.handle._done.wait(max(0.0, end - time.perf_counter()))
        return {"drained": len(initial) - len(remaining), "cancelled": len(remaining),
                "wall_ms": (time.perf_counter() - t0) * 1e3, "sim_ms": (self.board.clock.now_us - sim0) / 1e3}

    def _active_locked(self) -> bool:
        return bool(self._queue) or any(s.req is not None for s in self.slots)

    def slot_info(self) -> list[SlotInfo]:
        with self._lock:
            out = []
            for s in self.slots:
                r = s.req
                out.append(SlotInfo(s.idx, "idle" if r is None else r.state.value, r.id if r else None,
                                    len(r.prompt) if r else 0, r.n_prefilled if r else 0,
                                    len(r.generated) if r else 0, len(s.cache_tokens)))
            return out

    def queued_count(self) -> int:
        with self._lock:
            return len(self._queue)

    def close(self) -> None:
        """Stop the scheduler; every unfinished request is cancelled ("engine shutting down")."""
        with self._lock:
            pending = list(self._queue) + [s.req for s in self.slots if s.req is not None]
        for r in pending:
            r.handle.cancel("engine shutting down")
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        self._thread.join(timeout=5.0)

    def _notify(self) -> None:
        with self._lock:
            self._wake.notify_all()

    def _update_live_locked(self) -> None:
        running = sum(1 for s in self.slots if s.req is not None)
        occ = self.board.kv.occupancy()
        self.metrics.set_live(len(self._queue), running, occ.used_cells / max(1, occ.capacity_cells))

    # --- scheduler -------------------------------------------------------------------

    def _loop(self) -> None:
        inflight: deque[tuple[_Request, Job, dict]] = deque()
        while True:
            with self._lock:
                if self._stop and not inflight:
                    return
                self._reap_cancelled_locked(inflight)
                self._admit_locked()
                busy = {id(r) for r, _, _ in inflight}
                work = self._next_work_locked(busy) if len(inflight) < self.max_inflight else None
                if work is None and not inflight:
                    self._wake.wait(0.25)
                    continue
            if work is not None:
                r, kind, n = work
                started = self._start_step(r, kind, n)
                if started is not None:
                    inflight.append(started)
                    if len(inflight) < self.max_inflight:
                        continue  # ping/pong: submit a second job before waiting the first
            if inflight:
                self._finish_step(*inflight.popleft())

    def _reap_cancelled_locked(self, inflight: deque) -> None:
        busy = {id(r) for r, _, _ in inflight}
        for r in [q for q in self._queue if q.handle.cancelled]:
            self._queue.remove(r)
            self._end_locked(r, "cancelled", "none", None)
        for s in self.slots:
            r = s.req
            if r is not None and r.handle.cancelled and id(r) not in busy:
                self._end_locked(r, "cancelled", "none", None)

    def _admit_locked(self) -> None:
        while self._queue:
            free = [s for s in self.slots if s.req is None]
            if not free:
                return
            r = self._queue.popleft()
            # llama.cpp: prefer the idle slot sharing the longest prefix with the prompt, then LRU
            best = max(free, key=lambda s: (_common_prefix(s.cache_tokens, r.prompt), -s.last_used))
            n_common = min(_common_prefix(best.cache_tokens, r.prompt), len(r.prompt) - 1)
            kv = self.board.kv
            if n_common <= 0 or r.req.sampling is None:
                kv.free(best.seq_id)
                n_common = 0
            else:
                kv.seq_rm(best.seq_id, n_common, -1)
            best.cache_tokens = r.prompt[:n_common]
            best.req = r
            r.slot = best
            r.cache_n = r.n_prefilled = n_common
            r.assigned_ms = self.board.clock.now_us / 1e3
            r.handle.state = RequestState.PREFILLING
            r.numeric = self.board.numerics and len(r.prompt) <= self.numerics_max_prompt
            self._update_live_locked()

    def _next_work_locked(self, busy: set) -> tuple[_Request, str, int] | None:
        """Decode first (round-robin over decoding slots), then one prefill chunk (round-robin)."""
        n = self.n_slots
        for k in range(n):
            s = self.slots[(self._rr_decode + k) % n]
            r = s.req
            if r is not None and r.state is RequestState.DECODING and id(r) not in busy and not r.handle.cancelled:
                self._rr_decode = (s.idx + 1) % n
                return r, "decode", 1
        for k in range(n):
            s = self.slots[(self._rr_prefill + k) % n]
            r = s.req
            if r is not None and r.state is RequestState.PREFILLING and id(r) not in busy and not r.handle.cancelled:
                self._rr_prefill = (s.idx + 1) % n
                return r, "prefill", min(self.prefill_chunk, len(r.prompt) - r.n_prefilled)
        return None

    def _start_step(self, r: _Request, kind: str, n: int) -> tuple[_Request, Job, dict] | None:
        """Apply KV cells and submit one job. On failure the request ends with a typed error."""
        ht = self.host_timer
        t0 = ht.now()
        start_sim = self.board.clock.now_us
        seq = r.slot.seq_id
        if kind == "prefill":
            toks = r.prompt[r.n_prefilled:r.n_prefilled + n]
            p0 = r.n_prefilled
            if r.prefill_start_ms is None:
                r.prefill_start_ms = start_sim / 1e3
        else:
            toks = [r.pending_token]
            p0 = len(r.prompt) + len(r.generated) - 1
        positions = np.arange(p0, p0 + len(toks), dtype=np.int64)
        kv = self.board.kv
        try:
            if not kv.can_allocate(len(toks)):
                self._evict_idle(len(toks))
            k0 = ht.now()
            cells = kv.apply(seq, len(toks), timeout=self.kv_timeout_s, cancel=r.handle._cancel,
                             positions=positions.tolist())
            kv_wait_us = ht.now() - k0
            ctx_cells, ctx_pos = kv.seq_cells(seq)
            job = self.board.submit(kind, seq, np.asarray(toks, dtype=np.int64), positions, np.asarray(cells),
                                    ctx_cells, ctx_pos, task_type="ping" if self.max_inflight > 1 else "auto")
        except RequestCancelled:
            with self._lock:
                self._end_locked(r, "cancelled", "none", None)
            return None
        except (KVExhausted, DeviceError) as e:
            with self._lock:
                self._end_locked(r, "failed", "none", _err(e))
            return None
        host_us = ht.now() - t0
        r.host["kv_wait"] += kv_wait_us / 1e3
        self.board.clock.host_span(start_sim, host_us)
        return r, job, {"kind": kind, "n": len(toks), "kv_wait_us": kv_wait_us, "submit_host_us": host_us - kv_wait_us}

    def _evict_idle(self, need: int) -> None:
        """Free KV of idle slots' cached prefixes, least recently used first, until ``need`` cells fit."""
        kv = self.board.kv
        with self._lock:
            idle = sorted((s for s in self.slots if s.req is None and s.cache_tokens), key=lambda s: s.last_used)
            for s in idle:
                if kv.can_allocate(need):
                    return
                kv.free(s.seq_id)
                s.cache_tokens = []

    def _finish_step(self, r: _Request, job: Job, info: dict) -> None:
        ht = self.host_timer
        try:
            res = job.wait(self.step_timeout_s)
        except DeviceError as e:
            with self._lock:
                self._end_locked(r, "failed", "none", _err(e))
            return
        t0 = ht.now()
        cost = res.cost
        dev = {"h2d": cost.h2d_us / 1e3, "infer": cost.infer_us / 1e3, "d2h": cost.d2h_us / 1e3}
        scale = res.sim_us / cost.total_us if cost.total_us else 1.0  # slow-chip fault scales the step
        for k in dev:
            dev[k] *= scale
            r.device[k] += dev[k]
        kind = info["kind"]
        sampling_us = detok_us = 0.0
        if kind == "prefill":
            r.n_prefilled += info["n"]
            r.slot.cache_tokens = r.prompt[: r.n_prefilled]
        else:
            r.decode_device_ms += res.sim_us / 1e3
            r.slot.cache_tokens.append(r.pending_token)
        visible = ""
        stop: tuple[str, str] | None = None
        need_token = kind == "decode" or r.n_prefilled >= len(r.prompt)
        if r.handle.cancelled:
            need_token = False
        if need_token:
            if kind == "prefill":
                r.prefill_end_ms = res.sim_end_us / 1e3
                r.handle.state = RequestState.DECODING
            s0 = ht.now()
            tok = self._sample(r, res)
            sampling_us = ht.now() - s0
            r.host["sampling"] += sampling_us / 1e3
            d0 = ht.now()
            visible, stop = self._consume_token(r, tok)
            detok_us = ht.now() - d0
            r.host["detokenize"] += detok_us / 1e3
        host_us = ht.now() - t0 + info["submit_host_us"]
        framework_us = max(0.0, host_us - sampling_us - detok_us)
        r.host["framework"] += framework_us / 1e3
        t_end = self.board.clock.host_span(res.sim_end_us, ht.now() - t0)
        st = StageTimes(kind, dev["h2d"], dev["infer"], dev["d2h"], info["kv_wait_us"] / 1e3, sampling_us / 1e3,
                        detok_us / 1e3, framework_us / 1e3)
        self.last_stage[kind] = st
        self.stage_history.append(st)
        if visible:
            r.pieces_ms.append(t_end / 1e3)
            r.text_parts.append(visible)
            r.handle._events.put(TokenEvent(r.id, visible, len(r.generated), t_end / 1e3))
        if stop is not None:
            with self._lock:
                self._end_locked(r, "finished", stop[0], None, stopping_word=stop[1])
        else:
            with self._lock:
                self._notify_locked()

    def _notify_locked(self) -> None:
        self._wake.notify_all()

    def _sample(self, r: _Request, res) -> int:
        if res.logits_bf16 is None or not r.numeric:
            # timing-only: no logits exist; a seeded generator stands in (labelled in Timings.numerics)
            return int(r.fallback_rng.integers(0, 151643))
        logits = bf16_to_f32(res.logits_bf16)
        return r.sampler.sample(logits, r.generated)

    def _consume_token(self, r: _Request, tok: int) -> tuple[str, tuple[str, str] | None]:
        """Apply stop rules to a sampled token; returns (visible text, (stop_type, word) or None)."""
        if tok in EOS_IDS:
            r.generated.append(tok)
            return "", ("eos", "")
        r.generated.append(tok)
        r.pending_token = tok
        piece = r.decoder.push(tok)
        visible, word = r.matcher.push(piece) if piece else ("", None)
        if word is not None:
            return visible, ("word", word)
        if len(r.generated) >= r.req.max_tokens:
            return visible, ("limit", "")
        # context end: the pending token would need position len(prompt)+len(generated)-1
        if len(r.prompt) + len(r.generated) > self.n_ctx:
            return visible, ("limit", "")
        return visible, None

    def _end_locked(self, r: _Request, status: str, stop_type: str, error: dict | None, stopping_word: str = "") -> None:
        """Finish a request: flush held text, free its slot (and KV on cancel/failure), record metrics."""
        if r.handle._result is not None:
            return
        now_ms = self.board.clock.now_us / 1e3
        if status == "finished":
            tail = r.decoder.flush()
            held = r.matcher.push(tail)[0] if tail else ""
            if stop_type != "word":
                held += r.matcher.flush()
            if held:
                r.pieces_ms.append(now_ms)
                r.text_parts.append(held)
                r.handle._events.put(TokenEvent(r.id, held, len(r.generated), now_ms))
        if r in self._queue:
            self._queue.remove(r)
        s = r.slot
        if s is not None:
            s.req = None
            s.last_used = now_ms
            if status != "finished":
                # cancelled/failed: free this sequence's KV now (the in-flight step, if any, has ended)
                self.board.kv.free(s.seq_id)
                s.cache_tokens = []
        n = len(r.generated)
        ttft, tpot, itl, e2e = request_latencies(r.arrival_ms, r.pieces_ms, now_ms, n)
        if ttft is None and status == "finished" and n:
            ttft = (r.prefill_end_ms or now_ms) - r.arrival_ms  # nothing visible (e.g. EOS first)
        prompt_ms = ((r.prefill_end_ms or now_ms) - r.prefill_start_ms) if r.prefill_start_ms is not None else 0.0
        predicted_ms = r.decode_device_ms
        pn = len(r.prompt) - r.cache_n
        timings = Timings(
            prompt_n=pn, prompt_ms=prompt_ms,
            prompt_per_token_ms=prompt_ms / pn if pn and r.prefill_end_ms else None,
            prompt_per_second=pn / (prompt_ms / 1e3) if pn and prompt_ms > 0 and r.prefill_end_ms else None,
            predicted_n=n, predicted_ms=predicted_ms,
            predicted_per_token_ms=predicted_ms / max(1, n - 1) if n > 1 else None,
            predicted_per_second=(n - 1) / (predicted_ms / 1e3) if n > 1 and predicted_ms > 0 else None,
            cache_n=r.cache_n, ttft_ms=ttft, tpot_ms=tpot, itl_ms=itl, e2e_ms=e2e,
            queue_ms=(r.assigned_ms - r.arrival_ms) if r.assigned_ms is not None else None,
            host_ms=dict(r.host), device_ms=dict(r.device), numerics=r.numeric,
        )
        if status == "cancelled" and error is None:
            error = {"type": "cancelled", "message": r.handle.cancel_reason or "cancelled"}
        text = "".join(r.text_parts)
        result = RequestResult(r.id, status, text, tuple(r.generated), stop_type, stopping_word, error, timings,
                               r.sampler.seed)
        r.handle.state = {"finished": RequestState.FINISHED, "failed": RequestState.FAILED}.get(status, RequestState.CANCELLED)
        self.metrics.on_done(status, prompt_n=len(r.prompt), cache_n=r.cache_n, predicted_n=n, prompt_ms=prompt_ms,
                             predicted_ms=predicted_ms, ttft=ttft if status == "finished" else None, tpot=tpot,
                             itl=itl, e2e=e2e, queue_ms=timings.queue_ms, done_ms=now_ms)
        self._update_live_locked()
        r.handle._finish(result)
        self._wake.notify_all()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n]) != np.asarray(b[:n])
    idx = np.flatnonzero(x)
    return int(idx[0]) if idx.size else n


def _err(e: CalError) -> dict:
    d = e.to_dict() if hasattr(e, "to_dict") else {"message": str(e)}
    d.setdefault("type", type(e).__name__)
    d["type_name"] = type(e).__name__
    return d
