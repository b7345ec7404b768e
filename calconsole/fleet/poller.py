"""Poll every board of a fleet, each on its own asyncio task with its own client and back-off.

One ``BoardPoller`` per board: an ``httpx.AsyncClient`` of its own (keep-alive, every phase timed out at
``FleetConfig.timeout_s`` host seconds), a loop that publishes a ``BoardSample`` per tick. A calconsole board
is read from its ``/snapshot/stream`` (the server pushes a snapshot per tick over one long-lived response:
no request per sample, about half the client CPU of polling ``/snapshot``); where the stream is refused it
is polled like a llama-server board (``/health`` + ``/slots`` + ``/metrics`` for those).
A board that does not answer backs off (the interval doubling up to
``BACKOFF_MAX_S``); a board that answers slowly delays only its own next poll. So one slow or dead board
never delays another: they share nothing but the event loop, and every await is bounded.

``FleetMonitor`` runs the pollers of a whole ``FleetConfig`` on the caller's event loop (the Textual app's,
or ``asyncio.run`` for the headless ``calconsole fleet``) and keeps the latest sample and a short history
per board for the sparklines.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec

from ..settings import Settings
from .config import BoardSpec, FleetConfig
from .sample import BoardSample, assess, from_calconsole, from_llama_server, parse_llamacpp_metrics

#: host seconds between the polls of a board that does not answer: the interval, doubling up to this
BACKOFF_MAX_S = 5.0
#: samples of history kept per board (at 1 Hz: the last 2 minutes)
HISTORY_LEN = 120
#: llama-server's /props (model, slots, build) is re-read this often (host s): it changes only on restart
PROPS_EVERY_S = 60.0
#: largest body read from a board (a calconsole snapshot is a few KB idle, tens of KB busy)
MAX_BODY_BYTES = 8 << 20
#: a calconsole board whose /snapshot/stream is refused (503: its stream limit; 404: an older server) is polled
#: instead, and its stream tried again after this many host s
STREAM_RETRY_S = 60.0


class NotABoardServer(Exception):
    """The URL answers, but neither as calconsole (``/snapshot``) nor as llama-server (``/props`` with
    ``build_info``)."""


def read_key(path: str | None, kind: str) -> str | None:
    """The first key of a key file (``server.keys.parse_key_file``: mode 600, bounded), or None."""
    if path is None:
        return None
    from ..server.keys import parse_key_file

    return parse_key_file(path, kind)[0][1]


class BoardPoller:
    """Polls one board until cancelled; ``on_sample(BoardSample)`` after every poll (from the loop).

    Args:
        spec: the board (name, URL, key files; the API key is read once, here: KeySourceError if unusable).
        refresh_hz: polls per host second while the board answers.
        timeout_s: host seconds one request may take (connect, read, write, pool each).
        settings: thresholds and SLO the levels are computed with.
        transport: an httpx async transport (tests: ``httpx.ASGITransport``); None for real sockets.
    """

    def __init__(self, spec: BoardSpec, *, refresh_hz: float, timeout_s: float, settings: Settings,
                 on_sample: Callable[[BoardSample], None],
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.spec = spec
        self.interval_s = 1.0 / refresh_hz
        self.timeout_s = timeout_s
        self.settings = settings
        self.on_sample = on_sample
        key = read_key(spec.api_key_file, "api")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = httpx.AsyncClient(base_url=spec.url, headers=headers, transport=transport,
                                        timeout=httpx.Timeout(timeout_s, connect=min(3.0, timeout_s)),
                                        limits=httpx.Limits(max_connections=4, max_keepalive_connections=2))
        self.kind: str | None = None
        self._props: dict[str, Any] = {}
        self._props_at = 0.0
        self._last_seen: float | None = None
        self._tokens: tuple[float, float] | None = None  # (host wall s, tokens_predicted_total)
        self._prev_sample_s: float | None = None  # host monotonic s of this board's previous sample
        self.polls = 0
        self.failures = 0
        self.last = BoardSample(name=spec.name, url=spec.url)

    async def _get(self, path: str) -> httpx.Response:
        resp = await self.client.get(path)
        if len(resp.content) > MAX_BODY_BYTES:
            raise NotABoardServer(f"{path}: answer of {len(resp.content)} bytes")
        return resp

    async def _detect(self) -> str:
        r = await self._get("/snapshot")
        if r.status_code == 200:
            return "calconsole"
        if r.status_code == 401:
            raise PermissionError("the server refused the API key" if self.client.headers.get("Authorization")
                                  else "the server needs an API key (give api_key_file)")
        p = await self._get("/props")
        if p.status_code == 401:
            raise PermissionError("the server refused the API key")
        try:
            props = p.json() if p.status_code == 200 else None
        except ValueError:
            props = None
        if isinstance(props, dict) and "build_info" in props:
            self._props, self._props_at = props, time.monotonic()
            return "llama-server"
        raise NotABoardServer(f"neither calconsole (/snapshot {r.status_code}) nor llama-server "
                              f"(/props {p.status_code} without build_info)")

    async def _figures(self) -> dict[str, Any]:
        if self.kind is None:
            self.kind = await self._detect()
        if self.kind == "calconsole":
            r = await self._get("/snapshot")
            if r.status_code == 401:
                raise PermissionError("the server refused the API key")
            if r.status_code != 200:
                raise NotABoardServer(f"/snapshot answered {r.status_code}")
            return from_calconsole(self.spec.name, self.spec.url, r.content)
        return await self._llama_figures()

    async def _llama_figures(self) -> dict[str, Any]:
        now = time.monotonic()
        if now - self._props_at > PROPS_EVERY_S:
            p = await self._get("/props")
            if p.status_code == 200:
                self._props, self._props_at = p.json(), now
        health, slots, metrics = await asyncio.gather(self._get("/health"), self._get("/slots"),
                                                      self._get("/metrics"))
        for r in (health, slots, metrics):
            if r.status_code == 401:
                raise PermissionError("the server refused the API key")
        try:
            body = health.json()
        except ValueError:
            body = None
        slot_list = slots.json() if slots.status_code == 200 else None
        parsed = parse_llamacpp_metrics(metrics.text) if metrics.status_code == 200 else None
        fig = from_llama_server(health.status_code, body, slot_list, parsed, self._props)
        wall = time.time()
        total = (parsed or {}).get("llamacpp:tokens_predicted_total")
        if total is not None:
            if self._tokens is not None and wall > self._tokens[0] and total >= self._tokens[1]:
                fig["output_tok_s"] = (total - self._tokens[1]) / (wall - self._tokens[0])
                fig["rate_clock"] = "wall"
            self._tokens = (wall, total)
        elif parsed is not None:
            fig["output_tok_s"], fig["rate_clock"] = 0.0, "wall"  # no sample yet: nothing generated
        return fig

    async def poll_once(self) -> BoardSample:
        """One poll: the board's figures, or the reason it gave none. Never raises for the board's fault."""
        t0 = time.perf_counter()
        self.polls += 1
        state, error = "up", ""
        fig: dict[str, Any] = {}
        try:
            fig = await self._figures()
        except httpx.TransportError as e:
            state, error = "unreachable", f"{type(e).__name__}: {e}".rstrip(": ")
            self.kind = None if self._last_seen is None else self.kind
        except PermissionError as e:
            state, error = "refused", str(e)
        except (NotABoardServer, msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            state, error = "error", f"not a board server answer: {str(e)[:200]}"
            self.kind = None
        now = time.time()
        poll_ms = (time.perf_counter() - t0) * 1e3
        if state == "up":
            self._last_seen = now
            slo = fig.pop("slo", None)
            level, reasons = assess({**fig, "slo": slo}, self.settings)
        else:
            self.failures += 1
            level, reasons = "crit", (f"{state}: {error}",)
            prev = self.last  # keep what is known of the board (kind, model) beside the failure
            fig = {"kind": prev.kind, "model": prev.model, "build": prev.build}
        sample = BoardSample(name=self.spec.name, url=self.spec.url, state=state, error=error,
                             taken_unix_s=now, last_seen_unix_s=self._last_seen, via="poll", poll_ms=poll_ms,
                             sample_gap_s=self._gap(), level=level, reasons=reasons, **fig)
        self.last = sample
        return sample

    def _gap(self) -> float | None:
        """Host wall s since this board's previous sample (None for the first); notes this one's time."""
        now = time.monotonic()
        prev, self._prev_sample_s = self._prev_sample_s, now
        return None if prev is None else now - prev

    def _streamed(self, fig: dict[str, Any]) -> BoardSample:
        """A sample the board pushed on its stream: no request, so no round trip (``poll_ms`` None)."""
        now = time.time()
        self._last_seen = now
        slo = fig.pop("slo", None)
        level, reasons = assess({**fig, "slo": slo}, self.settings)
        sample = BoardSample(name=self.spec.name, url=self.spec.url, state="up", taken_unix_s=now,
                             last_seen_unix_s=now, via="stream", poll_ms=None, sample_gap_s=self._gap(),
                             level=level, reasons=reasons, **fig)
        self.last = sample
        return sample

    async def _stream(self) -> bool:
        """Read ``/snapshot/stream`` until it breaks; a sample per event. False if the server refused the
        stream (then the caller polls); raises the transport error that ended it."""
        from httpx_sse import aconnect_sse

        timeout = httpx.Timeout(max(self.timeout_s, 3.0 * self.interval_s), connect=min(3.0, self.timeout_s))
        async with aconnect_sse(self.client, "GET", "/snapshot/stream", params={"hz": 1.0 / self.interval_s},
                                timeout=timeout) as src:
            if src.response.status_code != 200:
                await src.response.aread()
                return False
            async for ev in src.aiter_sse():
                if ev.data.startswith('{"error"'):
                    raise httpx.RemoteProtocolError(f"stream ended by the server: {ev.data[:200]}")
                self.polls += 1
                try:
                    fig = from_calconsole(self.spec.name, self.spec.url, ev.data.encode())
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    raise NotABoardServer(str(e)[:200]) from None
                self.on_sample(self._streamed(fig))
        raise httpx.RemoteProtocolError("snapshot stream ended")

    async def run(self) -> None:
        """Sample until cancelled: a calconsole board from its stream, others by polling every ``interval_s``;
        backing off while the board does not answer."""
        delay = self.interval_s
        stream_refused_at = -STREAM_RETRY_S
        while True:
            started = time.monotonic()
            if self.kind == "calconsole" and started - stream_refused_at >= STREAM_RETRY_S:
                try:
                    if not await self._stream():
                        stream_refused_at = time.monotonic()
                    continue
                except (httpx.TransportError, NotABoardServer):
                    pass  # the poll below reports why, with the board's state
            sample = await self.poll_once()
            self.on_sample(sample)
            if sample.state == "unreachable":
                delay = min(BACKOFF_MAX_S, max(self.interval_s, delay * 2))
                wait = delay
            else:
                delay = self.interval_s
                wait = max(0.0, self.interval_s - (time.monotonic() - started))
            await asyncio.sleep(wait)

    async def aclose(self) -> None:
        await self.client.aclose()


class FleetMonitor:
    """The pollers of a fleet on one event loop, the latest sample of each board and a short history.

    ``start()`` (inside a running loop) creates one task per board; ``stop()`` cancels them and closes
    their clients. ``on_change(sample)`` is called on the loop after every poll. ``history[name]`` holds
    (host wall s, output tok/s, KV %) of the last ``HISTORY_LEN`` answered polls.
    """

    def __init__(self, config: FleetConfig, settings: Settings | None = None,
                 on_change: Callable[[BoardSample], None] | None = None,
                 transports: dict[str, httpx.AsyncBaseTransport] | None = None) -> None:
        self.config = config
        self.settings = settings or Settings()
        self.on_change = on_change
        self.samples: dict[str, BoardSample] = {b.name: BoardSample(name=b.name, url=b.url) for b in config.boards}
        self.history: dict[str, collections.deque[tuple[float, float | None, float | None]]] = {
            b.name: collections.deque(maxlen=HISTORY_LEN) for b in config.boards}
        self.pollers = [BoardPoller(b, refresh_hz=config.refresh_hz, timeout_s=config.timeout_s,
                                    settings=self.settings, on_sample=self._record,
                                    transport=(transports or {}).get(b.name)) for b in config.boards]
        self._tasks: list[asyncio.Task[None]] = []

    def spec(self, name: str) -> BoardSpec:
        for b in self.config.boards:
            if b.name == name:
                return b
        raise KeyError(name)

    def _record(self, sample: BoardSample) -> None:
        self.samples[sample.name] = sample
        if sample.state == "up":
            self.history[sample.name].append((sample.taken_unix_s, sample.output_tok_s, sample.kv_percent))
        if self.on_change is not None:
            self.on_change(sample)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(p.run(), name=f"fleet-poll-{p.spec.name}") for p in self.pollers]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await asyncio.gather(*(p.aclose() for p in self.pollers), return_exceptions=True)

    async def poll_all_once(self) -> list[BoardSample]:
        """Poll every board once, concurrently (a slow board delays only this call's end, not the others'
        polls); records and returns the samples in the fleet's order."""
        out = await asyncio.gather(*(p.poll_once() for p in self.pollers))
        for s in out:
            self._record(s)
        return list(out)
