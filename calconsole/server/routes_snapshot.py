"""calconsole's own observation routes: ``GET /snapshot`` (the typed Snapshot as JSON) and
``/snapshot/stream`` (SSE at ``hz``, bounded in rate and count)."""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import AsyncIterator
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from . import wire
from .bounds import PeerPlaces, Progress
from .conns import conn_of
from .wire import HTTPError

if TYPE_CHECKING:
    from .context import RouteSpec, ServingFace

#: how often a snapshot stream looks at shutdown while it sleeps between snapshots (host s)
POLL_S = 0.25
#: a stream whose reader took nothing of what waits for it for this long is cut (host s; conns.Progress)
STALL_S = 10.0
#: snapshot-stream places by address, per face: one address holds at most half of them
_PLACES: weakref.WeakKeyDictionary[ServingFace, PeerPlaces] = weakref.WeakKeyDictionary()


def routes(face: ServingFace) -> list[RouteSpec]:
    """(path, handler, methods, auth) of this family."""
    return [("/snapshot", partial(snapshot, face), ["GET"], "api"),
            ("/snapshot/stream", partial(snapshot_stream, face), ["GET"], "api")]


async def snapshot(face: ServingFace, request: Request) -> Response:
    snap = await face.call(face.observation.snapshot)
    # msgspec writes the typed snapshot directly (NaN as null, as to_dict does): ~40x faster than json.dumps
    return Response(msgspec.json.encode(snap), media_type="application/json")

async def snapshot_stream(face: ServingFace, request: Request) -> Response:
    raw = request.query_params.get("hz", "2")
    try:
        hz = float(raw)
    except ValueError:
        raise wire.bad_request(f"'hz' must be a number, got {raw!r}") from None
    top = face.config.snapshot_max_hz
    if not (math.isfinite(hz) and 0.1 <= hz <= top):
        raise wire.bad_request(f"'hz' must be in [0.1, {top:g}], got {raw}")
    peer = request.client.host if request.client else "?"
    places = _peer_places(face)
    if not places.take(peer):
        raise HTTPError(503, "unavailable_error", f"too many snapshot streams from {peer} "
                        f"(limit {places.per_peer} an address, of {face.config.max_snapshot_streams})")
    try:
        face.enter_snapshot_stream()
    except HTTPError:
        places.give(peer)
        raise
    progress = Progress(conn_of(request.scope), STALL_S)

    async def gen() -> AsyncIterator[dict[str, Any]]:
        try:
            while not face.closing.is_set():
                if progress.stalled() and progress.conn is not None:
                    progress.conn.cut(f"stream not read for {STALL_S:g} s")
                    return
                t0 = time.monotonic()
                snap = await face.call(face.observation.snapshot)
                yield {"data": msgspec.json.encode(snap).decode()}
                # slept in POLL_S slices: a stop is seen at once, also at hz=0.1
                while not face.closing.is_set() and (left := 1.0 / hz - (time.monotonic() - t0)) > 0:
                    await anyio.sleep(min(left, POLL_S))
            yield {"data": wire.dumps(HTTPError(503, "unavailable_error", "server shutting down").body())}
        finally:
            face.leave_snapshot_stream()

    return face.sse(gen(), on_end=lambda: places.give(peer))


def _peer_places(face: ServingFace) -> PeerPlaces:
    """The face's snapshot-stream places by address (made on first use)."""
    p = _PLACES.get(face)
    if p is None:
        p = _PLACES[face] = PeerPlaces(max(1, face.config.max_snapshot_streams // 2))
    return p
