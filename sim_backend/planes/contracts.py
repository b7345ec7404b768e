"""The three planes as contracts (facts.md F9): what any backend implements and any client uses.

The console, the headless commands and (next) the HTTP serving face are written against these
Protocols only. The in-process simulator (``sim_backend.planes.inprocess`` and
``sim_backend.planes.maintenance``) is one implementation; a remote client of the serving face
or a real-hardware backend is another. ``tests/planes/test_contracts.py`` holds the behaviour
every implementation must show.

- ``InferencePlane``: submit / stream / cancel chat requests. No registers, no reset, no raw
  memory (facts.md F5 C4).
- ``ObservationPlane``: read-only; ``snapshot()`` returns an immutable typed ``Snapshot``.
- ``MaintenancePlane``: exclusive lease, then guarded actions; every call is audited. Absent
  (None) in observe-only mode.

Times: arguments named ``timeout`` / ``*_s`` are host wall seconds; results name their unit.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sim_backend.planes.snapshot import Health, Snapshot
from sim_backend.planes.types import ChatRequest, RequestResult, StreamEvent

#: Maintenance results are JSON-shaped maps: {"ok": bool, "detail": str, ...action fields}.
Report = dict[str, Any]


@dataclass(frozen=True)
class Lease:
    """Proof of exclusive mode. Only one exists at a time; actions check it is the current one.

    ``id``: opaque token (never logged in full); ``holder``: who asked; ``granted_unix_s``: host wall clock.
    """

    id: str
    holder: str
    granted_unix_s: float

    def to_dict(self) -> dict[str, Any]:
        """Loggable form: the first 8 characters of the id only."""
        return {"lease": self.id[:8], "holder": self.holder, "granted_unix_s": round(self.granted_unix_s, 3)}


@runtime_checkable
class RequestStream(Protocol):
    """Client side of one submitted request: stream events, cancel, wait for the result. Thread-safe."""

    @property
    def id(self) -> int: ...

    @property
    def prompt_n(self) -> int: ...

    @property
    def done(self) -> bool: ...

    @property
    def cancelled(self) -> bool: ...

    def cancel(self, reason: str = "cancelled by client") -> None:
        """Cancel in any state; idempotent; returns at once. The request ends within one device step."""
        ...

    def stop_generation(self, reason: str) -> None:
        """End the request at its next sampled token as if its limit were reached (finished, stop_type
        ``limit``, its text kept); returns at once. Where that is not possible it is cancelled."""
        ...

    def next_event(self, timeout: float) -> StreamEvent | None:
        """The next event within ``timeout`` host seconds, or None (a ``ProgressEvent`` only for a request
        that asked for ``return_progress``)."""
        ...

    def stream(self, timeout: float = 60.0) -> Iterator[StreamEvent]:
        """Events until the DoneEvent; TimeoutError if none arrives for ``timeout`` s. Closing it cancels."""
        ...

    def result(self, timeout: float) -> RequestResult:
        """The final result within ``timeout`` host seconds; TimeoutError otherwise."""
        ...


@runtime_checkable
class InferencePlane(Protocol):
    """Submit, stream and cancel chat requests (the ordinary serving API)."""

    @property
    def n_ctx(self) -> int:
        """Context in tokens per sequence (the calbin's, 40960; facts.md F2)."""
        ...

    @property
    def step_timeout_s(self) -> float:
        """Longest a client should wait for one event of a running request (host s)."""
        ...

    def submit(self, req: ChatRequest) -> RequestStream:
        """Queue a request. Raises InvalidRequestError / ExceedContextSizeError / UnavailableError
        (llama-server's error types) before anything is allocated."""
        ...

    def generate(self, req: ChatRequest, timeout: float = 600.0) -> RequestResult:
        """Submit and wait for the result (failures are results, not exceptions, once admitted)."""
        ...

    def count_prompt_tokens(self, req: ChatRequest) -> int:
        """Prompt tokens with the chat template applied, as the context limit counts them."""
        ...

    def tokenize(self, text: str, *, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (Qwen3 BPE; no BOS: Qwen3 adds none). ``parse_special``: text such as
        ``<|im_end|>`` becomes the control token instead of ordinary text (llama-server ``/tokenize``)."""
        ...

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (invalid UTF-8 becomes U+FFFD). InvalidRequestError for an id outside the vocabulary."""
        ...

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes of one token's piece (may be part of a UTF-8 character)."""
        ...

    def apply_template(self, messages: Sequence[Mapping[str, Any]], *, enable_thinking: bool = False,
                       add_generation_prompt: bool = True, continue_final_message: bool = False,
                       template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The chat prompt ``messages`` renders to, as text: as ``ChatRequest`` renders with the same fields
        (llama-server's ``/apply-template``). InvalidRequestError for a bad message list or a template that
        refuses it."""
        ...

    @property
    def chat_template(self) -> str:
        """The chat template as Jinja text (reported by ``/props``)."""
        ...


@runtime_checkable
class SlotActions(Protocol):
    """llama-server's slot actions on an inference plane that has them (``POST /slots/{id}?action=``):
    save an idle slot's cached prompt KV to a file, restore it (the next request sharing the prefix reuses
    it), erase it. ``path`` is a full file path the caller has already confined to its save directory.

    Results (host wall ms): save {"n_saved": tokens, "n_written": bytes, "save_ms"}; restore
    {"n_restored", "n_read", "restore_ms"}; erase {"n_erased"}. Errors: InvalidRequestError (no such
    slot, a file that cannot be written or restored), UnavailableError (the slot is busy).
    """

    def save_slot(self, slot: int, path: str) -> dict[str, Any]: ...

    def restore_slot(self, slot: int, path: str) -> dict[str, Any]: ...

    def erase_slot(self, slot: int) -> dict[str, Any]: ...


@runtime_checkable
class ObservationPlane(Protocol):
    """Read-only view of device, jobs, KV, steps, requests and host. Nothing here changes the device."""

    def snapshot(self) -> Snapshot:
        """One immutable observation (see ``sim_backend.planes.snapshot``)."""
        ...

    def health(self) -> Health:
        """The device's state only (status, mode, lease holder): what GET /health needs, without the cost
        of a snapshot (a few µs in process against ~2 ms for ``snapshot()``). An implementation that never
        blocks in it (no I/O, no lock held across work) says so with a true ``health_nonblocking`` attribute."""
        ...

    def metrics_text(self) -> str:
        """Prometheus text exposition, ``llamacpp:`` names (vLLM's metric definitions)."""
        ...


@runtime_checkable
class AuditReader(Protocol):
    """The maintenance audit log as a reader sees it."""

    @property
    def path(self) -> Path: ...

    def entries(self) -> list[dict[str, Any]]:
        """Every record, oldest first (corrupt lines as records marked corrupt)."""
        ...


@runtime_checkable
class MaintenancePlane(Protocol):
    """Exclusive mode and guarded device actions. Every call, granted or refused, is audited.

    Actions take the current ``Lease`` and raise ``MaintenanceRefused`` without it (or with an old
    one); they return a ``Report``. Reset and memory clear are confirmed by the caller (typed
    device name in the console) before they are called.
    """

    @property
    def audit(self) -> AuditReader: ...

    @property
    def lease(self) -> Lease | None:
        """The current lease, if any (held by whoever entered exclusive mode)."""
        ...

    def mode(self) -> Mapping[str, Any]:
        """{"mode": serving | draining | exclusive, "lease_holder": str | None, "since_unix_s": float}."""
        ...

    def status(self) -> Mapping[str, Any]:
        """Mode, armed faults, memory state, audit log path (read-only, not audited)."""
        ...

    def enter_exclusive(self, holder: str, drain_timeout_s: float | None = None) -> Lease:
        """Stop admission, drain or cancel in-flight work within the bounded time, return the lease."""
        ...

    def leave_exclusive(self, lease: Lease | None, *, force: bool = False) -> Report: ...

    def reset(self, lease: Lease | None) -> Report:
        """Reset the device and run a health check; ``ok`` False if the check fails."""
        ...

    def clear_device_memory(self, lease: Lease | None) -> Report:
        """ClearAllDevMem: weights and KV gone; inference refused until ``reload_model``."""
        ...

    def reload_model(self, lease: Lease | None) -> Report: ...

    def clear_kv(self, lease: Lease | None) -> Report: ...

    def dump(self, lease: Lease | None, path: str | Path | None = None) -> Report:
        """Trace + config metadata + registers to a JSON file (default: beside the audit log)."""
        ...

    def self_test(self, lease: Lease | None) -> Report:
        """Golden self-test (``sim_backend.model.golden.compare``'s rule)."""
        ...

    def health_check(self, lease: Lease | None) -> Report: ...

    def read_register(self, lease: Lease | None, key: str | int) -> Report: ...

    def write_register(self, lease: Lease | None, key: str | int, value: int | str) -> Report: ...

    def dump_registers(self, lease: Lease | None) -> Report: ...

    def inject_fault(self, lease: Lease | None, kind: str, *, chip: int = 1, factor: float = 4.0,
                     count: int = 1) -> Report:
        """Arm a fault: ccu_exception | kv_exhaustion | link_error | slow_chip."""
        ...

    def clear_faults(self, lease: Lease | None) -> Report: ...

    def acknowledge_faults(self, holder: str) -> Report:
        """Mark the faults that fired as seen (no lease needed: it changes nothing on the device); audited."""
        ...

    def probe_request(self, lease: Lease | None, prompt: str = "hi", max_tokens: int = 8) -> Report:
        """A request on the scratch sequence while exclusive (greedy), with its step timings."""
        ...
