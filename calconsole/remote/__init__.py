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
"""

from __future__ import annotations

from typing import Any

from .connection import Connection, RemoteAuthError, RemoteError, ServerUnreachable
from .inference import RemoteInferencePlane, RemoteRequestStream
from .maintenance import RemoteAudit, RemoteMaintenancePlane
from .observation import RemoteObservationPlane, SnapshotFeed


class RemoteSystem:
    """The planes of one server, sharing one ``Connection``. ``maintenance`` is None without an admin key."""

    def __init__(self, conn: Connection, props: dict[str, Any], maintenance_status: dict[str, Any] | None) -> None:
        self.connection = conn
        self.url = conn.url
        self.props = props
        self.inference = RemoteInferencePlane(conn, props)
        self.observation = RemoteObservationPlane(conn)
        dev = props.get("device") or {}
        self.device_name = str(dev.get("name", "?"))
        self.maintenance: RemoteMaintenancePlane | None = None
        if maintenance_status is not None:
            self.maintenance = RemoteMaintenancePlane(conn, self.device_name, maintenance_status)

    @property
    def connected(self) -> bool:
        return self.connection.connected

    @property
    def disconnected_since(self) -> float | None:
        return self.connection.disconnected_since

    def describe(self) -> str:
        return f"attached to {self.url}"

    def close(self) -> None:
        """Release a held lease (bounded), stop renewing, close the connection."""
        if self.maintenance is not None:
            self.maintenance.close()
        self.connection.close()

    def __enter__(self) -> RemoteSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(url: str, *, api_key: str | None = None, admin_key: str | None = None,
            read_timeout_s: float = 30.0) -> RemoteSystem:
    """Attach to the server at ``url``: read ``/props`` (and ``/maintenance/status`` with an admin key).

    Raises ValueError for a URL that is not http(s); ServerUnreachable if nothing answers;
    RemoteAuthError for a refused API key; MaintenanceRefused for a refused admin key or a server
    without maintenance routes (so a console never shows a pane that cannot work).
    """
    conn = Connection(url, api_key=api_key, admin_key=admin_key, read_timeout_s=read_timeout_s)
    try:
        props = conn.json("GET", "/props")
        status = None
        if admin_key is not None:
            status = conn.json("GET", "/maintenance/status", admin=True, action="attach")
        return RemoteSystem(conn, props, status)
    except BaseException:
        conn.close()
        raise


__all__ = ["Connection", "RemoteAudit", "RemoteAuthError", "RemoteError", "RemoteInferencePlane",
           "RemoteMaintenancePlane", "RemoteObservationPlane", "RemoteRequestStream", "RemoteSystem",
           "ServerUnreachable", "SnapshotFeed", "connect"]
