"""In-process implementations of the inference and observation planes (contracts in ``contracts``).

The console talks to the simulator only through the contracts; these classes are the
in-process simulator's implementation, as the HTTP client planes will be another.

- ``InProcessInference`` (an ``InferencePlane``): submit / stream / cancel chat requests. No registers,
  no reset, no raw memory (facts.md F5 C4).
- ``InProcessObservation`` (an ``ObservationPlane``): ``snapshot()`` returns a typed, frozen ``Snapshot`` built in one
  conversion; nothing reachable from it can change the device.
- ``InProcessMaintenance`` (a ``MaintenancePlane``): lives in ``maintenance.py``; built only when asked
  for (``--observe-only`` never constructs it).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import psutil

from sim_backend.bundle.manifest import Bundle
from sim_backend.errors import InvalidRequestError
from sim_backend.model.stepcost import OUTSIDE_PARTS
from sim_backend.model.tokenizer import CHAT_TEMPLATE
from sim_backend.model.vocab import VOCAB_SIZE
from sim_backend.planes.snapshot import Health, Snapshot, convert
from sim_backend.planes.types import ChatRequest, RequestResult
from sim_backend.runtime.monitor import DeviceMonitor
from sim_backend.serving.api import RequestHandle
from sim_backend.serving.engine import Engine


class InProcessInference:
    """Submit, stream and cancel chat requests (the ordinary serving API)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def n_ctx(self) -> int:
        """Context in tokens (calbin, 40960; facts.md F2)."""
        return self._engine.n_ctx

    @property
    def step_timeout_s(self) -> float:
        """Bound on one device step (host wall s): the longest a client waits for the next event."""
        return float(self._engine.step_timeout_s)

    def submit(self, req: ChatRequest) -> RequestHandle:
        """See ``Engine.submit``: returns a handle; raises typed request errors, allocating nothing."""
        return self._engine.submit(req)

    def generate(self, req: ChatRequest, timeout: float = 600.0) -> RequestResult:
        """Submit and wait up to ``timeout`` host s; see ``Engine.generate``."""
        return self._engine.generate(req, timeout)

    def count_prompt_tokens(self, req: ChatRequest) -> int:
        """Prompt tokens with the chat template, as the context limit counts them."""
        return len(self._engine.tokenize_prompt(req))

    # llama-server's slot actions (``SlotActions``): see ``serving.slot_actions.SlotActionRunner``
    def save_slot(self, slot: int, path: str) -> dict[str, Any]:
        """Save idle slot ``slot``'s cached prompt KV (cells, tokens, K/V values) to ``path``."""
        return self._engine.slot_actions.save(slot, path)

    def restore_slot(self, slot: int, path: str) -> dict[str, Any]:
        """Restore a saved slot state into idle slot ``slot`` (its prefix is then reused)."""
        return self._engine.slot_actions.restore(slot, path)

    def erase_slot(self, slot: int) -> dict[str, Any]:
        """Free idle slot ``slot``'s cached prompt KV."""
        return self._engine.slot_actions.erase(slot)

    def tokenize(self, text: str, *, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``; InvalidRequestError if it is not a string."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"content must be a string, got {type(text).__name__}", param="content")
        return self._engine.tokenizer.encode(text, allow_special=bool(parse_special))

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``; InvalidRequestError for a non-integer or out-of-vocabulary id."""
        return self._engine.tokenizer.decode(_check_ids(tokens, self._engine.rt.vocab))

    def token_bytes(self, token: int) -> bytes:
        """Raw bytes of one token's piece; InvalidRequestError for an id outside the vocabulary."""
        return self._engine.tokenizer.token_bytes(_check_ids([token], self._engine.rt.vocab)[0])

    def apply_template(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool = False,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The rendered chat prompt, as a ``ChatRequest`` with these fields is rendered."""
        return self._engine.tokenizer.render_chat(list(messages) if isinstance(messages, (list, tuple)) else messages,
                                                  add_generation_prompt=bool(add_generation_prompt),
                                                  enable_thinking=bool(enable_thinking),
                                                  continue_final_message=bool(continue_final_message),
                                                  template_kwargs=template_kwargs)

    @property
    def n_vocab(self) -> int:
        """Rows of the model's LM head (Qwen3 151936, the pilot 49152)."""
        return int(self._engine.rt.vocab)

    @property
    def weights(self) -> str:
        """The model's weights: "synthetic" (Qwen3 at reduced width) or "real" (a GGUF, the dense pilot)."""
        return "real" if self._engine.rt.bundle.numeric.weights == "gguf" else "synthetic"

    @property
    def numerics(self) -> bool:
        """False on a timing-only device (``--timing-only``): no numerics run, every token comes from the seeded
        generator, whatever the weights."""
        return bool(self._engine.rt.numerics)

    @property
    def chat_template(self) -> str:
        """The model's chat template as Jinja text: Qwen3's (no tools), or the GGUF's for the pilot."""
        return str(getattr(self._engine.tokenizer, "chat_template", CHAT_TEMPLATE))

    @property
    def bos_token(self) -> str:
        """The model's BOS token text ("" for Qwen3, which has none; the GGUF's for the pilot)."""
        return str(getattr(self._engine.tokenizer, "bos_text", ""))

    @property
    def eos_token(self) -> str:
        """The model's EOS token text (Qwen3 "<|im_end|>"; the GGUF's eos_token_id for the pilot)."""
        return str(getattr(self._engine.tokenizer, "eos_text", "<|im_end|>"))

    @property
    def eog_ids(self) -> tuple[int, ...]:
        """The end-of-generation token ids, ascending: those that end a reply, and those ``ignore_eos`` sets to
        -inf (Qwen3's <|endoftext|> and <|im_end|>; the GGUF's eos id for the pilot)."""
        return tuple(sorted(int(t) for t in self._engine.tokenizer.eos_ids))


def _check_ids(tokens: Any, vocab: int = VOCAB_SIZE) -> list[int]:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise InvalidRequestError("tokens must be a list of token ids", param="tokens")
    out = []
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise InvalidRequestError(f"tokens[{i}] must be a token id in [0, {vocab}), got {t!r}",
                                      param="tokens")
        out.append(t)
    return out


def step_view(res: Any | None) -> dict[str, Any]:
    """Observation view of a StepResult: per layer, per chip, per category (simulated µs)."""
    if res is None:
        return {"kind": None, "layers": []}
    cost = res.cost
    slowest = cost.slowest_category_per_layer
    cats = list(cost.categories)
    layers = []
    for li in range(cost.layer_chip_us.shape[0]):
        layers.append({
            "layer": li,
            "chip_us": [float(x) for x in cost.layer_chip_us[li]],
            "category_us": {c: [float(x) for x in cost.layer_chip_category_us[li, :, ci]]
                            for ci, c in enumerate(cats) if cost.layer_chip_category_us[li, :, ci].any()},
            "slowest_category": slowest[li],
        })
    view = {
        "kind": res.kind, "job_id": res.job_id, "seq_id": res.seq_id, "n_tokens": res.n_tokens,
        "past_len": res.past_len, "sim_us": res.sim_us, "h2d_us": cost.h2d_us, "infer_us": cost.infer_us,
        "d2h_us": cost.d2h_us, "global_us": cost.global_us, "sim_end_ms": res.sim_end_us / 1e3,
        "compute_wall_ms": res.compute_wall_ms, "experts_touched": list(res.experts_touched or []),
        "numerics": res.logits is not None, "layers": layers,
        "batch_seq_ids": [row.seq_id for row in getattr(res, "batch", ())],
        "time_unit": "us (simulated device time); compute_wall_ms is host wall time",
    }
    view.update(_outside_view(cost))
    return view


def _outside_view(cost: Any) -> dict[str, Any]:
    """The step's ops outside the layers ("embed" before layer 0, "head" after the last), each chip's
    busy and barrier-wait time, and the experts the MoE weights were priced with (simulated µs).

    Empty for a cost without them (a test's stand-in): the snapshot's defaults then say nothing.
    """
    outside = getattr(cost, "outside_chip_us", None)
    busy = getattr(cost, "chip_busy_us", None)
    if outside is None or busy is None or not np.asarray(busy).size:
        return {}
    cats = list(cost.categories)
    parts = []
    for i, name in enumerate(OUTSIDE_PARTS):
        roles = list(cost.outside_ops[i])
        if not roles:
            continue
        per_cat = cost.outside_chip_category_us[i]
        idx = {op.role: op.index for op in cost.graph.ops if op.layer < 0} if cost.graph is not None else {}
        slowest = max(roles, key=lambda r: float(cost.op_us[idx[r]]) if r in idx else 0.0)
        parts.append({
            "part": name, "ops": roles, "chip_us": [float(x) for x in outside[i]],
            "category_us": {c: [float(x) for x in per_cat[:, ci]] for ci, c in enumerate(cats) if per_cat[:, ci].any()},
            "slowest_op": slowest,
        })
    priced = np.asarray(getattr(cost, "experts_priced", ()), dtype=np.float64)
    return {
        "outside": parts, "chip_busy_us": [float(x) for x in np.asarray(busy)],
        "chip_wait_us": [float(x) for x in cost.chip_wait_us], "submit_us": float(cost.submit_us),
        "experts_priced": [float(x) for x in priced],
        "experts_rule": "expectation" if getattr(cost, "experts_expected", True) else "per-layer counts",
    }


#: host wall seconds the load figures (busy %, output tok/s) are taken over, at least
LOAD_INTERVAL_S = 1.0


class _LoadSampler:
    """Busy % and output rate over the last ~LOAD_INTERVAL_S of wall time, in simulated time.

    Each snapshot adds a sample of cumulative counters (simulated µs busy per chip and board,
    tokens generated, the simulated clock); figures compare it with the newest sample at least
    ``interval_s`` older (or the oldest one kept). Thread-safe; keeps at most ``maxlen`` samples.
    """

    def __init__(self, interval_s: float = LOAD_INTERVAL_S, maxlen: int = 64) -> None:
        self.interval_s = interval_s
        self._samples: deque[tuple[float, float, float, tuple[float, ...], int]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def sample(self, sim_now_us: float, board_busy_us: float, chip_busy_us: tuple[float, ...],
               predicted: int) -> tuple[dict[str, Any], list[float | None]]:
        """Record a sample; returns (LoadInfo fields, busy % per chip or None each)."""
        now = time.monotonic()
        cur = (now, sim_now_us, board_busy_us, chip_busy_us, predicted)
        with self._lock:
            ref = None
            for smp in self._samples:  # oldest first: keep the newest one old enough
                if now - smp[0] >= self.interval_s:
                    ref = smp
            if ref is None and self._samples:
                ref = self._samples[0]
            while len(self._samples) > 1 and now - self._samples[1][0] >= self.interval_s:
                self._samples.popleft()  # the newest old-enough sample stays as the next reference
            self._samples.append(cur)
        out: dict[str, Any] = {"interval_s": self.interval_s}
        if ref is None:
            return out, [None] * len(chip_busy_us)
        d_sim = sim_now_us - ref[1]
        out["window_wall_s"] = now - ref[0]
        out["window_sim_ms"] = d_sim / 1e3

        def pct(d_busy: float) -> float:
            return 0.0 if d_sim <= 0 else min(100.0, max(0.0, 100.0 * d_busy / d_sim))

        out["busy_percent"] = pct(board_busy_us - ref[2])
        out["output_tokens_per_s"] = 0.0 if d_sim <= 0 else max(0, predicted - ref[4]) / (d_sim / 1e6)
        chips: list[float | None] = [pct(b - r) for b, r in zip(chip_busy_us, ref[3], strict=False)]
        return out, chips


class InProcessObservation:
    """Read-only snapshots of device, jobs, KV, last steps, requests and host."""

    #: ``health()`` reads a few fields under locks held for microseconds (never across a device step or a
    #: maintenance action): a caller on an event loop may call it there (the serving face's GET /health)
    health_nonblocking = True

    def __init__(self, monitor: DeviceMonitor, engine: Engine, bundle: Bundle, memory_plan: Any = None,
                 mode_source: Any = None, numerics_limit_reason: str = "") -> None:
        self._mon = monitor
        self._numerics_limit_reason = numerics_limit_reason  # why prompts over the limit run timing-only
        self._engine = engine
        self._bundle = bundle
        self._memory_plan = memory_plan
        self._mode_source = mode_source  # callable -> {"mode", "lease_holder"} (maintenance plane)
        self._proc = psutil.Process(os.getpid())
        self._proc.cpu_percent(None)  # prime: later calls report usage since the previous call
        self._lock = threading.Lock()
        self._step_cache: dict[int, dict[str, Any]] = {}
        self._load = _LoadSampler()

    def set_mode_source(self, fn: Any) -> None:
        self._mode_source = fn

    def _step(self, res: Any | None) -> dict[str, Any]:
        if res is None:
            return step_view(None)
        with self._lock:
            v = self._step_cache.get(res.job_id)
            if v is None:
                v = step_view(res)
                if len(self._step_cache) > 8:
                    self._step_cache.clear()
                self._step_cache[res.job_id] = v
            return v

    def snapshot(self) -> Snapshot:
        b, e = self._mon, self._engine
        c = b.counters()
        # the KV, the slots, the request counters and the tokens generated at one instant (one hold of the
        # engine lock, under which it frees a cancelled request's KV and counts the cancel)
        view = e.observe(b.kv_occupancy)
        occ, slots, requests, generated = view.kv, view.slots, view.requests, view.tokens_generated
        kvc = b.kv_counters()
        mode = self._mode()
        chiplets = b.chiplets()
        load, chip_pct = self._load.sample(b.now_us, b.busy_us, tuple(ch.busy_us for ch in chiplets), generated)
        chips = [
            {"index": ch.index, "state": ch.state, "busy": ch.busy, "slow_factor": ch.slow_factor,
             "jobs_done": ch.jobs_done, "ccu_exceptions": b.read_register(f"CHIP{ch.index}_CCU_EXC"),
             "busy_us": ch.busy_us, "busy_percent": pct}
            for ch, pct in zip(chiplets, chip_pct, strict=True)
        ]
        fstate = b.faults()
        faults, fired, in_effect = fstate["active"], fstate["fired"], fstate["in_effect"]
        status = self._status(mode, bool(fired), bool(in_effect))
        steps = b.last_steps()
        last = max(steps.values(), key=lambda r: r.job_id) if steps else None
        memory = {}
        if self._memory_plan is not None:
            memory = self._memory_plan.with_kv_used(occ.used_cells).to_dict()
            if b.memory_cleared:  # ClearAllDevMem: nothing is loaded until the model is reloaded
                for chip in memory.get("chips", []):
                    for reg in chip["regions"]:
                        reg["used_bytes"] = 0
        with self._proc.oneshot():
            host = {"cpu_percent": self._proc.cpu_percent(None), "rss_bytes": self._proc.memory_info().rss,
                    "threads": self._proc.num_threads(), "system_cpu_percent": psutil.cpu_percent(None)}
        data: dict[str, Any] = dict(
            taken_unix_s=time.time(),
            sim_now_ms=b.now_us / 1e3,
            device={
                # a what-if variant is labelled wherever its name is shown (facts.md "What-if is labelled")
                "name": self._bundle.device_name, "status": status,
                "bundle": self._bundle.name if self._bundle.status == "C0" else self._bundle.display_name,
                "mode": mode.get("mode", "serving"), "lease_holder": mode.get("lease_holder"),
                "calrt_version": self._bundle.calrt_version,
                "firmware_commit": f"{b.read_register('CALCORERT_COMMIT'):07x}",
                "pacing": b.pacing.mode.value, "pacing_speed": b.pacing.speed, "numerics": b.numerics,
                "achieved_speed": b.achieved_speed(),
                "chiplets": chips, "faults": faults, "faults_armed": fstate["armed"], "faults_in_effect": in_effect,
                "faults_fired": fired, "d2d_link_errors": b.read_register("D2D_LINK_ERR"),
                "context_tokens": self._bundle.context,
                "numerics_max_prompt": e.numerics_max_prompt if b.numerics else 0,
                "numerics_limit_reason": self._numerics_limit_reason if b.numerics else "",
                "numerics_starting": b.numerics_starting, "numerics_broken": b.numerics_broken,
                "timing_only_running": [s.request_id for s in slots
                                        if s.request_id is not None and s.numeric is False],
                "n_slots": e.n_slots, "admitting": e.gate.admitting,
                "bundle_status": self._bundle.status, "bundle_label": self._bundle.variant_label,
                "decode_batch": self._bundle.decode_batch, "logits_dtype": self._bundle.logits_dtype,
                "weights": "real" if self._bundle.numeric.weights == "gguf" else "synthetic",
            },
            jobs={"submitted": c.submitted, "pending": c.pending, "running": c.running, "finished": c.finished,
                  "failed": c.failed, "left": c.left, "ccu_exceptions": c.ccu_exceptions, "resets": c.resets},
            kv={"used_tokens": occ.used_cells, "capacity_tokens": occ.capacity_cells, "free_tokens": occ.free_cells,
                "used_blocks": occ.used_blocks, "total_blocks": occ.total_blocks, "block_size": occ.block_size,
                "bytes_used_per_chip": occ.bytes_used_per_chip, "bytes_capacity_per_chip": occ.bytes_capacity_per_chip,
                "per_seq_tokens": {str(s): n for s, n in occ.per_seq_tokens},
                # request-level waits (the engine parks a request while the cache is full)
                "waits": view.kv_stats["parked_requests"], "timeouts": view.kv_stats["timeouts"],
                "kv_wait_wall_ms": view.kv_stats["wait_wall_ms"] + kvc.kv_wait_s * 1e3,
                # KV-manager calls: every non-blocking attempt that found the cache full counts once
                "apply_calls": kvc.apply_calls, "apply_full_attempts": kvc.apply_timeouts},
            last_step=self._step(last),
            last_prefill=self._step(steps.get("prefill")),
            last_decode=self._step(steps.get("decode")),
            memory=memory,
            slots=slots,  # dataclasses: converted by attribute, no dict round trip
            requests=requests,
            stages=dict(e.last_stage),
            # NaN (no first token) is None on the wire and in the typed snapshot alike
            history={k: [None if isinstance(x, float) and x != x else x for x in v]
                     for k, v in e.metrics.history_series().items()},
            host=host,
            findings=self._bundle.findings,
            load=load,
            decode_batches=list(e.batch_log),
        )
        snap: Snapshot = convert(data, Snapshot)
        return snap

    def _mode(self) -> Mapping[str, Any]:
        return self._mode_source() if self._mode_source else {"mode": "serving", "lease_holder": None}

    def _status(self, mode: Mapping[str, Any], fired: bool, in_effect: bool) -> str:
        """``DeviceInfo.status``: an armed fault is not a failure (nothing happened yet); one that fired
        stays a fault until acknowledged or reset; a slow chip degrades every job while it lasts."""
        b = self._mon
        return ("memory cleared" if b.memory_cleared else
                "fault: numerics worker down (reset or reload the model)" if b.numerics_broken else
                "fault: last health check failed (reset or reload the model)" if mode.get("health_failed") else
                "fault" if fired else "degraded" if in_effect else "ok")

    def health(self) -> Health:
        """Status, mode and lease holder only (the same words as the snapshot's ``device``), without
        building a snapshot: GET /health on a kept-alive connection paid ~2 ms for one."""
        mode = self._mode()
        f = self._mon.faults()
        return Health(status=self._status(mode, bool(f["fired"]), bool(f["in_effect"])),
                      mode=str(mode.get("mode", "serving")), lease_holder=mode.get("lease_holder"))

    def metrics_text(self) -> str:
        """Prometheus text exposition (llamacpp: names)."""
        self._engine.wake()
        return self._engine.metrics.prometheus_text()
