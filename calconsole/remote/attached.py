"""What every attached server's planes share: one ``Connection``, its state, and closing it."""

from __future__ import annotations

from typing import Any

from .connection import Connection


class AttachedSystem:
    """Base of the planes of one server reached over HTTP (``RemoteSystem``, ``LlamaServerSystem``).

    ``connection``: the one ``Connection`` the planes share; ``maintenance``: the subclass's plane
    (None when it has none). A context manager: leaving it closes the system.
    """

    maintenance: Any

    def __init__(self, conn: Connection) -> None:
        self.connection = conn
        self.url = conn.url

    @property
    def connected(self) -> bool:
        """Whether the last call reached the server."""
        return self.connection.connected

    @property
    def disconnected_since(self) -> float | None:
        """``time.monotonic()`` when the server stopped answering, or None while it answers."""
        return self.connection.disconnected_since

    def close(self) -> None:
        """Release a held lease (bounded), stop renewing, close the connection."""
        if self.maintenance is not None:
            self.maintenance.close()
        self.connection.close()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
