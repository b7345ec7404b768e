"""One HTTP connection to a running ``calconsole serve``: keys, timeouts, errors and the link state.

Every remote plane call goes through ``Connection.call``: a sync ``httpx.Client`` (thread-safe,
pooled) with a timeout on every phase. A transport failure (refused, reset, timed out) marks the
connection *disconnected* (``connected`` False, ``disconnected_since`` the host wall time of the
first failure) and raises ``ServerUnreachable``, an ``UnavailableError``; any HTTP answer marks it
connected again. Polled reads (snapshots, metrics) pass ``gate=True``: while disconnected they
fail fast until the back-off delay has passed (0.25 s doubling to 5 s), so a console sampling at
2 Hz does not hammer a dead address; user actions always try.

Error bodies are llama-server's ``{"error": {"code", "message", "type", ...}}``; ``raise_for``
turns them into the typed errors the in-process planes raise (``InvalidRequestError``,
``ExceedContextSizeError``, ``UnavailableError``, ``MaintenanceRefused``, ``DeviceError``).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import httpx

from sim_backend.planes import (
    CalError,
    DeviceError,
    ExceedContextSizeError,
    Health,
    InvalidRequestError,
    MaintenanceArgumentError,
    MaintenanceRefused,
    RequestError,
    UnavailableError,
)

#: host seconds: connect, a write, a pool slot; reads get their own per call (DEFAULT_READ_S)
CONNECT_S, WRITE_S, POOL_S = 3.0, 10.0, 5.0
DEFAULT_READ_S = 30.0
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.25, 5.0


class ServerUnreachable(UnavailableError):
    """The server did not answer (connection refused, reset or timed out).

    Attributes: ``url``; ``since``: host wall time (unix s) the connection was first lost;
    ``retry_in_s``: for a call refused by the back-off, how long until the next attempt (else 0).
    """

    def __init__(self, url: str, reason: str, since: float, retry_in_s: float = 0.0) -> None:
        self.url = url
        self.since = since
        self.retry_in_s = retry_in_s
        lost = time.strftime("%H:%M:%S", time.localtime(since))
        more = f"; next attempt in {retry_in_s:.1f} s" if retry_in_s > 0 else ""
        super().__init__(f"server {url} unreachable (disconnected since {lost}): {reason}{more}")


class RemoteAuthError(RequestError):
    """The server refused the API key (llama-server ``authentication_error``, HTTP 401)."""

    error_type = "authentication_error"
    http_status = 401


class RemoteError(RequestError):
    """Any other error answer of the server: ``http_status``, llama-server ``error_type``, message."""

    def __init__(self, status: int, type_: str, message: str) -> None:
        self.http_status = status
        self.error_type = type_ or "server_error"
        super().__init__(message)


def error_body(resp: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of an error answer (a made-up one for a body that is not llama-server's)."""
    try:
        obj = resp.json()
    except (ValueError, UnicodeDecodeError):
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        err = dict(obj["error"])
        err.setdefault("message", f"HTTP {resp.status_code}")
        err.setdefault("type", "server_error")
        return err
    text = resp.text[:200] if resp.content else ""
    return {"code": resp.status_code, "type": "server_error",
            "message": f"HTTP {resp.status_code} {resp.reason_phrase}" + (f": {text}" if text else "")}


def health_of(resp: httpx.Response) -> Health:
    """``Health`` from a ``GET /health`` answer (llama-server's and ours): 200 "ok"; 503 "loading" (the
    model is loading, memory cleared, or the device is in maintenance: the message says which); any
    other status "error". A server that says nothing about its mode is "serving"."""
    if resp.status_code == 200:
        return Health(status="ok")
    detail = str(error_body(resp).get("message", f"HTTP {resp.status_code}"))
    return Health(status="loading" if resp.status_code == 503 else "error", detail=detail)


def raise_for(resp: httpx.Response, *, action: str | None = None) -> NoReturn:
    """Raise the typed error of an error answer. ``action``: a maintenance action's name (its refusals,
    bad arguments, wrong admin key and missing routes are ``MaintenanceRefused``, a 400 (bad argument)
    its subclass ``MaintenanceArgumentError`` as in process; device failures ``DeviceError``), or None
    for the inference and observation routes."""
    err = error_body(resp)
    status, kind, msg = resp.status_code, str(err.get("type")), str(err.get("message"))
    if action is not None:
        prefix = f"{action} refused: "
        reason = msg[len(prefix):] if msg.startswith(prefix) else msg
        if status == 401:
            raise MaintenanceRefused(action, "the server refused the admin key")
        if status == 404:
            raise MaintenanceRefused(action, "the server has no such maintenance route (started without an "
                                             "admin key?)")
        if status == 400:  # the caller's argument, as the in-process plane types it
            raise MaintenanceArgumentError(action, reason)
        if status in (403, 409):
            raise MaintenanceRefused(action, reason)
        if status == 503:
            raise UnavailableError(msg)
        # the server's message already names the type (wire.from_cal_error: "DeviceError: …"): said once, as
        # the error raised here (a remote console showed "DeviceError: reload_model: DeviceError: …")
        kind_prefix = f"{DeviceError.__name__}: "
        raise DeviceError(f"{action}: {msg[len(kind_prefix):] if msg.startswith(kind_prefix) else msg}")
    if kind == "exceed_context_size_error":
        raise ExceedContextSizeError(int(err.get("n_prompt_tokens", 0)), int(err.get("n_ctx", 0)), msg)
    if status == 400 or kind == "invalid_request_error":
        raise InvalidRequestError(msg)
    if status == 401:
        raise RemoteAuthError(msg)
    if status == 503 or kind == "unavailable_error":
        raise UnavailableError(msg)
    raise RemoteError(status, kind, msg)


class Connection:
    """The client side of one server: base URL, keys, a pooled ``httpx.Client`` and the link state.

    Args:
        url: ``http://host:port`` of ``calconsole serve``.
        api_key / admin_key: sent as ``Authorization: Bearer``; the admin key only to ``/maintenance``.
        read_timeout_s: default read timeout (host s) of one call; long calls pass their own.
    Thread-safe.
    """

    def __init__(self, url: str, *, api_key: str | None = None, admin_key: str | None = None,
                 read_timeout_s: float = DEFAULT_READ_S, transport: httpx.BaseTransport | None = None) -> None:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--connect must be an http:// or https:// URL, got {url!r}")
        self.url = url
        self._api_key = api_key
        self._admin_key = admin_key
        self.has_admin_key = admin_key is not None
        self.read_timeout_s = read_timeout_s
        self.client = httpx.Client(base_url=url, transport=transport,
                                   timeout=httpx.Timeout(read_timeout_s, connect=CONNECT_S, write=WRITE_S,
                                                         pool=POOL_S),
                                   limits=httpx.Limits(max_connections=64, max_keepalive_connections=8))
        self._lock = threading.Lock()
        self._since: float | None = None
        self._last_error = ""
        self._backoff_s = 0.0
        self._next_try = 0.0
        self._listeners: list[Callable[[bool], None]] = []

    # --- link state -------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._since is None

    @property
    def disconnected_since(self) -> float | None:
        """Host wall time (unix s) the connection was lost, or None while connected."""
        return self._since

    @property
    def last_error(self) -> str:
        return self._last_error

    def on_state_change(self, fn: Callable[[bool], None]) -> None:
        """Call ``fn(connected)`` (from the calling thread) whenever the link goes down or comes back."""
        self._listeners.append(fn)

    def _mark_up(self) -> None:
        with self._lock:
            changed = self._since is not None
            self._since, self._backoff_s, self._next_try = None, 0.0, 0.0
        if changed:
            self._notify(True)

    def mark_down(self, reason: str) -> ServerUnreachable:
        """Record a transport failure; returns the error to raise."""
        with self._lock:
            changed = self._since is None
            if changed:
                self._since = time.time()
            self._last_error = reason
            self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, self._backoff_s * 2))
            self._next_try = time.monotonic() + self._backoff_s
            since = self._since
        if changed:
            self._notify(False)
        assert since is not None
        return ServerUnreachable(self.url, reason, since)

    def _notify(self, up: bool) -> None:
        for fn in list(self._listeners):
            try:
                fn(up)
            except Exception:  # noqa: BLE001, S110 - a listener's bug must not break the caller's request
                pass

    def _check_gate(self) -> None:
        with self._lock:
            if self._since is None:
                return
            wait = self._next_try - time.monotonic()
            since, reason = self._since, self._last_error
        if wait > 0:
            raise ServerUnreachable(self.url, reason, since, retry_in_s=wait)

    # --- calls ------------------------------------------------------------------------------

    def headers(self, *, admin: bool = False) -> dict[str, str]:
        key = self._admin_key if admin else self._api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def call(self, method: str, path: str, *, admin: bool = False, json_body: Any = None,
             params: dict[str, Any] | None = None, read_timeout_s: float | None = None,
             gate: bool = False) -> httpx.Response:
        """One request, read whole. Returns any HTTP answer (the caller checks the status);
        raises ``ServerUnreachable`` for a transport failure (or, with ``gate``, during the back-off)."""
        if gate:
            self._check_gate()
        timeout = httpx.Timeout(read_timeout_s or self.read_timeout_s, connect=CONNECT_S, write=WRITE_S,
                                pool=POOL_S)
        try:
            resp = self.client.request(method, path, json=json_body, params=params,
                                       headers=self.headers(admin=admin), timeout=timeout)
        except httpx.TransportError as e:
            raise self.mark_down(describe(e)) from None
        self._mark_up()
        return resp

    def json(self, method: str, path: str, *, action: str | None = None, **kw: Any) -> Any:
        """``call`` and the JSON body of a 2xx answer; the typed error of any other."""
        resp = self.call(method, path, **kw)
        if resp.status_code >= 300:
            raise_for(resp, action=action)
        try:
            return resp.json()
        except (ValueError, UnicodeDecodeError):
            raise CalError(f"{method} {path}: the server's answer is not JSON") from None

    def open_stream(self, path: str, json_body: Any, *, read_timeout_s: float) -> httpx.Response:
        """POST and return the response with its body unread (an SSE stream on success).

        The caller owns the response (``close()`` it). A non-2xx answer is read, closed and raised
        as its typed error; a transport failure is ``ServerUnreachable``.
        """
        timeout = httpx.Timeout(read_timeout_s, connect=CONNECT_S, write=WRITE_S, pool=POOL_S)
        try:
            request = self.client.build_request("POST", path, json=json_body, timeout=timeout,
                                                headers={**self.headers(), "Accept": "text/event-stream"})
            resp = self.client.send(request, stream=True)
        except httpx.TransportError as e:
            raise self.mark_down(describe(e)) from None
        self._mark_up()
        if resp.status_code >= 300:
            try:
                resp.read()
            except httpx.TransportError as e:
                resp.close()
                raise self.mark_down(describe(e)) from None
            resp.close()
            raise_for(resp)
        return resp

    def close(self) -> None:
        self.client.close()


def describe(e: BaseException) -> str:
    """A one-line reason for a transport error (httpx's messages can be empty)."""
    text = str(e).strip() or type(e).__name__
    return f"{type(e).__name__}: {text}" if type(e).__name__ not in text else text


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))
