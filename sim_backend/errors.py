"""Typed errors for every layer of the simulator.

Every failure the operator can see is one of these, never a bare
``Exception``, an ``abort()`` or a silent hang (facts.md F6 lists the
production integration's failures this replaces). ``Finding`` is the
manifest check that did not refuse a bundle (its value type lives here, the
one module both the bundle loader and the planes' seam may import).
"""

from __future__ import annotations

from typing import Any

import msgspec


class CalError(Exception):
    """Base of all calconsole / sim_backend errors."""


# --- bundle / manifest -------------------------------------------------------

class Finding(msgspec.Struct, frozen=True):
    """One bundle-manifest check that did not refuse the bundle (that is ``ManifestError``): ``severity``
    "info" | "warning" | "error", a short ``code``, the ``file`` and ``field`` it concerns, the ``message`` and
    the ``action`` the loader took. One struct from the loader to the snapshot (``Snapshot.findings``): it lives
    in this bottom layer so the bundle loader and the planes' seam can both name it."""

    severity: str
    code: str
    file: str
    field: str
    message: str
    action: str


class ManifestError(CalError):
    """A calbin manifest (or other bundle file) is malformed or inconsistent.

    Attributes:
        file: path of the offending file (str).
        field: dotted name of the offending field, e.g. ``submodels.prefill.type``.
    """

    def __init__(self, file: str, field: str, message: str) -> None:
        self.file = str(file)
        self.field = field
        self.message = message
        super().__init__(f"{self.file}: field '{field}': {message}")


# --- request errors (llama.cpp server error types) ---------------------------

class RequestError(CalError):
    """A request was refused. ``error_type`` is llama.cpp's error ``type`` string."""

    error_type = "server_error"
    http_status = 500

    def to_dict(self) -> dict[str, Any]:
        """llama.cpp-style error body: ``{"code", "message", "type"}``."""
        return {"code": self.http_status, "message": str(self), "type": self.error_type}


class InvalidRequestError(RequestError):
    """Bad request parameters (llama.cpp ``invalid_request_error``, HTTP 400)."""

    error_type = "invalid_request_error"
    http_status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        self.param = param
        super().__init__(message)


class ExceedContextSizeError(RequestError):
    """Prompt does not fit the context (llama.cpp ``exceed_context_size_error``).

    Attributes:
        n_prompt_tokens: prompt length in tokens, chat template included.
        n_ctx: context size in tokens (40960 from the calbin, facts.md F2).
    """

    error_type = "exceed_context_size_error"
    http_status = 400

    def __init__(self, n_prompt_tokens: int, n_ctx: int, message: str | None = None) -> None:
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx
        super().__init__(
            message
            or f"the request exceeds the available context size: prompt has {n_prompt_tokens} "
            f"tokens, context is {n_ctx} tokens"
        )

    def to_dict(self) -> dict[str, Any]:
        body = super().to_dict()
        body.update(n_prompt_tokens=self.n_prompt_tokens, n_ctx=self.n_ctx)
        return body


class UnavailableError(RequestError):
    """Server cannot take the request now (llama.cpp ``unavailable_error``, HTTP 503)."""

    error_type = "unavailable_error"
    http_status = 503


class RequestCancelled(CalError):
    """A request ended by cancellation; ``reason`` says who/why."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(f"cancelled: {reason}")


# --- device / runtime -------------------------------------------------------

class DeviceError(CalError):
    """A runtime call on the (simulated) device failed. ``code`` is a CalRT-like status.

    ``device_ms``: the simulated device time the failed job occupied before it failed, as
    ``{"h2d", "infer", "d2h"}`` in simulated ms, or None when it occupied none (the engine adds
    it to the request's ``Timings.device_ms``, so the parts still add up to what the clock moved).
    """

    code = -1
    device_ms: dict[str, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": str(self), "type": type(self).__name__}


class WaitTimeout(DeviceError):
    """``wait(timeout)`` expired before the job finished (the job keeps running)."""

    code = -2


class CCUException(DeviceError):
    """The CCU raised an exception while executing a job (OutputBuf state ccu_exception)."""

    code = -3


class DeviceReset(DeviceError):
    """The device was reset while the job was pending or running."""

    code = -4


class LinkError(DeviceError):
    """Chiplet-to-chiplet (D2D) link failure during a job."""

    code = -5


class DeviceNotReady(DeviceError):
    """Device memory is cleared or the calbin is not configured; reload first."""

    code = -6


class SubmitError(DeviceError):
    """The job could not be submitted (bad buffers, bad CSR values, queue closed)."""

    code = -7


# --- KV cache -----------------------------------------------------------------

class KVExhausted(CalError):
    """KV cells could not be granted within the timeout.

    Attributes:
        requested: cells (tokens) asked for.
        free: free cells when giving up.
        capacity: total cells (40960, facts.md F4).
        waited_s: host wall seconds spent waiting.
        injected: raised by an injected fault (maintenance ``inject_fault kv_exhaustion``), not a
            full cache; retrying cannot clear it.
    """

    def __init__(self, requested: int, free: int, capacity: int, waited_s: float, reason: str = "", *,
                 injected: bool = False) -> None:
        self.requested = requested
        self.free = free
        self.capacity = capacity
        self.waited_s = waited_s
        self.injected = injected
        self.reason = reason  # why this request was the one ended (engine KV pressure rule), or ""
        super().__init__(
            f"KV cache exhausted: requested {requested} tokens, {free} free of {capacity} "
            f"after waiting {waited_s * 1000:.0f} ms" + (f"; {reason}" if reason else "")
        )

    def to_dict(self) -> dict[str, Any]:
        """Error body with the numbers: requested / free / capacity (cells = tokens), waited_s (host wall s)."""
        return {"code": 503, "message": str(self), "type": "KVExhausted", "requested": self.requested,
                "free": self.free, "capacity": self.capacity, "waited_s": self.waited_s}


class KVArgumentError(CalError, ValueError):
    """A KV manager call was refused before it changed anything.

    Raised for an argument of the wrong type (only ints are ids, counts and
    positions; ``bool`` and floats are refused, never truncated), out of range
    (sequence ids ``0..n_seq_max-1``, positions ``0..n_ctx-1``, finite
    bounded timeouts), or an operation whose result would leave that range.
    The cache is exactly as it was before the call. Subclasses ``ValueError``
    so callers that caught the old ``ValueError`` keep working.
    """


class KVStateFileError(KVArgumentError):
    """A KV sequence-state file cannot be read or written (missing, truncated,
    malformed, made for another cache, unwritable path). Nothing was changed.

    Attributes:
        path: the file (str).
        reason: what is wrong with it.
    """

    def __init__(self, path: str, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        shown = self.path if len(self.path) <= 200 else self.path[:200] + f"... ({len(self.path)} characters)"
        super().__init__(f"KV state file {shown}: {reason}")


# --- maintenance --------------------------------------------------------------

class MaintenanceRefused(CalError):
    """A maintenance action was refused (no lease, wrong lease, bad argument, busy)."""

    def __init__(self, action: str, reason: str) -> None:
        self.action = action
        self.reason = reason
        super().__init__(f"{action} refused: {reason}")


class NotOffered(MaintenanceRefused):
    """The server behind a plane does not offer this contract method at all (not a refusal by state):
    e.g. a stock llama-server has no exclusive mode, reset, memory clear, faults or registers.

    Attributes: ``action`` (the method), ``reason`` (what the server offers instead, or why not),
    ``server`` (its kind, e.g. "llama-server"). A ``MaintenanceRefused``, so a caller that handles
    refusals shows it; retrying cannot succeed.
    """

    def __init__(self, action: str, server: str, reason: str) -> None:
        self.server = server
        super().__init__(action, f"not offered by {server}: {reason}")


class MaintenanceArgumentError(MaintenanceRefused):
    """A maintenance action was refused for an argument of the wrong value or form (an unknown fault
    kind, a count out of range, a register that does not exist): the caller's mistake, not the
    device's state. Over HTTP a 400 ``invalid_request_error``; other refusals are 403."""
