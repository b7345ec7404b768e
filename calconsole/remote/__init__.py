"""The three planes over HTTP: a client of a running ``calconsole serve`` (or ``calconsole --listen``).

    system = connect("http://127.0.0.1:8080", api_key=..., admin_key=...)
    system.observation.snapshot()          # the live device's Snapshot
    system.inference.submit(req).stream()  # streams through /v1/chat/completions
    system.maintenance                     # None without an admin key
    system.close()

``RemoteSystem`` has the attributes of the in-process ``System`` the console and the headless
commands use (``inference``, ``observation``, ``maintenance``, ``close``), so they cannot tell
which one they have; plus ``url``, ``connection`` (``connected`` / ``disconnected_since``) and
``describe()`` for the header line.

``connect`` detects the kind of server: calconsole (``GET /snapshot`` answers) or a stock llama-server
(``/props`` has ``build_info``, ``/snapshot`` is 404), and returns a ``RemoteSystem`` or a
``calconsole.remote.llamacpp.LlamaServerSystem``; both have ``kind``. Anything else is a
``NotAServer`` error at attach.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim_backend.planes import CalError, UnavailableError

from .attached import AttachedSystem
from .connection import Connection, RemoteAuthError, RemoteError, ServerUnreachable, error_body, raise_for
from .inference import RemoteInferencePlane, RemoteRequestStream
from .maintenance import RemoteAudit, RemoteMaintenancePlane
from .observation import RemoteObservationPlane, SnapshotStreamReader


class RemoteSystem(AttachedSystem):
    """The planes of one server, sharing one ``Connection``. ``maintenance`` is None without an admin key."""

    kind = "calconsole"

    def __init__(self, conn: Connection, props: dict[str, Any], maintenance_status: dict[str, Any] | None) -> None:
        super().__init__(conn)
        self.props = props
        self.inference = RemoteInferencePlane(conn, props, _n_vocab(conn))  # the served model's vocabulary
        self.observation = RemoteObservationPlane(conn)
        dev = props.get("device") or {}
        self.device_name = str(dev.get("name", "?"))
        self.maintenance: RemoteMaintenancePlane | None = None
        if maintenance_status is not None:
            self.maintenance = RemoteMaintenancePlane(conn, self.device_name, maintenance_status)

    def describe(self) -> str:
        return f"attached to {self.url}"


class NotAServer(CalError):
    """The URL answers, but neither as ``calconsole serve`` nor as a llama-server (``url``, ``reason``)."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(f"{url} is neither a calconsole server nor a llama-server: {reason}")


def connect(url: str, *, api_key: str | None = None, admin_key: str | None = None,
            read_timeout_s: float = 30.0, audit_path: str | Path | None = None) -> Any:
    """Attach to the server at ``url``: read ``/props``, tell the kind by ``/snapshot``, then (calconsole,
    with an admin key) ``/maintenance/status``.

    Returns a ``RemoteSystem`` (calconsole) or a ``LlamaServerSystem`` (llama-server; ``admin_key`` is
    not used: llama-server has no admin routes; ``audit_path`` is the local log of its maintenance calls).
    Raises ValueError for a URL that is not http(s); ServerUnreachable if nothing answers;
    RemoteAuthError for a refused API key; UnavailableError for a llama-server still loading its model;
    NotAServer for any other server; MaintenanceRefused for a refused admin key or a calconsole server without
    maintenance routes (so a console never shows a pane that cannot work).
    """
    conn = Connection(url, api_key=api_key, admin_key=admin_key, read_timeout_s=read_timeout_s)
    try:
        resp = conn.call("GET", "/props")
        if resp.status_code == 401:
            raise_for(resp)
        if resp.status_code == 503:  # llama-server while it loads its model
            raise UnavailableError(f"{conn.url} is not ready: GET /props answered 503 "
                                   f"({error_body(resp).get('message')}); a llama-server answers so while it "
                                   "loads its model: try again once /health says ok")
        try:
            props = resp.json() if resp.status_code == 200 else None
        except (ValueError, UnicodeDecodeError):
            props = None
        if not isinstance(props, dict):
            raise NotAServer(conn.url, f"GET /props answered HTTP {resp.status_code} "
                                       f"{resp.headers.get('content-type', '')} without llama-server's JSON")
        snap = conn.call("GET", "/snapshot", read_timeout_s=10.0)
        if snap.status_code == 200:
            status = None
            if admin_key is not None:
                status = conn.json("GET", "/maintenance/status", admin=True, action="attach")
            return RemoteSystem(conn, props, status)
        if snap.status_code == 401:
            raise_for(snap)
        from .llamacpp import LlamaServerSystem, is_llama_server

        if snap.status_code == 404 and is_llama_server(props):
            return LlamaServerSystem(conn, props, _n_vocab(conn), audit_path=audit_path)
        raise NotAServer(conn.url, f"GET /snapshot answered HTTP {snap.status_code} and /props has "
                                   f"{'a' if 'build_info' in props else 'no'} build_info")
    except BaseException:
        conn.close()
        raise


def _n_vocab(conn: Connection) -> int:
    """The model's vocabulary size from llama-server's ``/v1/models`` (``data[0].meta.n_vocab``)."""
    models = conn.json("GET", "/v1/models")
    try:
        return int(models["data"][0]["meta"]["n_vocab"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise NotAServer(conn.url, "/v1/models does not give the model's n_vocab") from None


__all__ = ["Connection", "NotAServer", "RemoteAudit", "RemoteAuthError", "RemoteError", "RemoteInferencePlane",
           "RemoteMaintenancePlane", "RemoteObservationPlane", "RemoteRequestStream", "RemoteSystem",
           "ServerUnreachable", "SnapshotStreamReader", "connect"]
