"""``ObservationPlane`` over HTTP: ``GET /snapshot`` (the same typed ``Snapshot``) and ``GET /metrics``.

``snapshot()`` decodes the server's JSON into ``Snapshot`` (msgspec: the same validation as
``Snapshot.from_dict``, except that fields a newer server adds are left out: ``decode_snapshot_json``).
Both reads are polled, so they go through the connection's back-off:
while the server is unreachable they raise ``ServerUnreachable`` at once until the next attempt
is due (0.25 s doubling to 5 s).

``SnapshotStreamReader`` reads ``/snapshot/stream?hz=N`` in a background thread and hands each
snapshot to a callback, reconnecting with the same back-off: one long-lived request instead of one
per sample. (The console's sampler, in-process or attached, is ``calconsole.feed.SnapshotFeed``: it
polls ``observation.snapshot()``.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import msgspec
from httpx_sse import EventSource

from sim_backend.planes import CalError, Health, Snapshot
from sim_backend.planes.snapshot import decode_snapshot_json

from .connection import BACKOFF_MAX_S, BACKOFF_MIN_S, Connection, describe, health_of, raise_for

SNAPSHOT_READ_S = 10.0


class RemoteObservationPlane:
    """Read-only view of a running server's device. Nothing here changes the device."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        #: snapshot fields the server sent that this console does not know (a newer server), left out
        self.ignored_fields: set[str] = set()

    @property
    def connection(self) -> Connection:
        return self._conn

    def snapshot(self) -> Snapshot:
        """One snapshot of the live device. ServerUnreachable while disconnected; CalError for a bad answer."""
        resp = self._conn.call("GET", "/snapshot", read_timeout_s=SNAPSHOT_READ_S, gate=True)
        if resp.status_code != 200:
            raise_for(resp)
        try:
            return decode_snapshot_json(resp.content, self.ignored_fields)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise CalError(f"the server's snapshot does not match this console's Snapshot type: {e}") from None

    def health(self) -> Health:
        """The server's ``GET /health`` (no key needed): ok, or loading / error with its message.
        ServerUnreachable while disconnected."""
        return health_of(self._conn.call("GET", "/health", read_timeout_s=SNAPSHOT_READ_S, gate=True))

    def metrics_text(self) -> str:
        """Prometheus text exposition (``llamacpp:`` names) of the server's ``/metrics``."""
        resp = self._conn.call("GET", "/metrics", read_timeout_s=SNAPSHOT_READ_S, gate=True)
        if resp.status_code != 200:
            raise_for(resp)
        return resp.text


class SnapshotStreamReader:
    """Background reader of ``/snapshot/stream``: ``on_snapshot(Snapshot)`` per event, ``on_error(str)``
    when the stream breaks (then it reconnects after a back-off). ``stop()`` ends it (bounded join)."""

    def __init__(self, conn: Connection, hz: float, on_snapshot: Callable[[Snapshot], None],
                 on_error: Callable[[str], None] | None = None) -> None:
        self._conn = conn
        self._hz = hz
        self._on_snapshot = on_snapshot
        self._on_error = on_error or (lambda _msg: None)
        self._stop = threading.Event()
        self._resp: httpx.Response | None = None
        self._thread = threading.Thread(target=self._run, name="calconsole-snapshot-feed", daemon=True)

    def start(self) -> SnapshotStreamReader:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        """The reader thread is running (started and not yet ended)."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 2.0) -> None:
        """End the reader: its stream's socket is shut down, the thread joined for at most ``timeout_s``."""
        self._stop.set()
        resp = self._resp
        if resp is not None:
            stream = resp.extensions.get("network_stream")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                import socket

                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        backoff = 0.0
        ignored: set[str] = set()
        while not self._stop.is_set():
            try:
                timeout = httpx.Timeout(max(SNAPSHOT_READ_S, 3.0 / self._hz), connect=3.0, write=5.0, pool=5.0)
                req = self._conn.client.build_request("GET", "/snapshot/stream", params={"hz": self._hz},
                                                      headers=self._conn.headers(), timeout=timeout)
                resp = self._conn.client.send(req, stream=True)
                self._resp = resp
                try:
                    if resp.status_code != 200:
                        resp.read()
                        raise_for(resp)
                    self._conn._mark_up()
                    backoff = 0.0
                    for sse in EventSource(resp).iter_sse():
                        if self._stop.is_set():
                            return
                        if '"error"' in sse.data[:10]:
                            raise CalError(f"snapshot stream ended by the server: {sse.data[:200]}")
                        self._on_snapshot(decode_snapshot_json(sse.data, ignored))
                finally:
                    self._resp = None
                    resp.close()
                raise CalError("snapshot stream ended")
            except Exception as e:  # noqa: BLE001 - reported, then retried after the back-off
                if self._stop.is_set():
                    return
                if isinstance(e, httpx.TransportError):
                    self._conn.mark_down(describe(e))
                self._on_error(describe(e) if not isinstance(e, CalError) else str(e))
                backoff = min(BACKOFF_MAX_S, max(BACKOFF_MIN_S, backoff * 2))
                self._stop.wait(backoff)
