"""Servers for the serving-face tests: a system from ``make_system`` behind a ``ServerThread`` bound to
127.0.0.1 on an ephemeral port, stopped (and its system closed) by the fixture's teardown.

``make_server(api_key=..., admin_key=..., **config)`` returns a ``Served`` with ``url``, ``face``,
``system`` and ``headers(kind)`` (the Authorization header for the API or admin key).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from calconsole.server.face import ServeConfig, ServingFace
from calconsole.server.keys import KeyRing
from calconsole.server.run import ServerThread
from tests.waits import wait_until  # noqa: F401 - the server tests import it from here

API_KEY = "test-api-key-0123456789"
ADMIN_KEY = "test-admin-key-9876543210"


@dataclass
class Served:
    url: str
    face: ServingFace
    system: Any
    thread: ServerThread
    keys: dict[str, str] = field(default_factory=dict)

    def headers(self, kind: str = "api") -> dict[str, str]:
        key = self.keys.get(kind)
        return {"Authorization": f"Bearer {key}"} if key else {}


class ServerFactory:
    def __init__(self, systems: Any) -> None:
        self.systems = systems
        self.started: list[Served] = []

    def __call__(self, *, system: Any = None, api_key: str | None = None, admin_key: str | None = None,
                 system_kw: dict[str, Any] | None = None, **config: Any) -> Served:
        if system is None:
            kw = {"numerics": False, "maintenance": admin_key is not None or "admin_keys" in config,
                  **(system_kw or {})}
            system = self.systems(**kw)
        cfg = ServeConfig(host="127.0.0.1", port=0,
                          api_keys=KeyRing([("api-1", api_key)], "api") if api_key else None,
                          admin_keys=config.pop("admin_keys", None)
                          or (KeyRing([("admin-1", admin_key)], "admin") if admin_key else None), **config)
        audit = system.maintenance.audit if system.maintenance is not None else None
        face = ServingFace(system.inference, system.observation, system.maintenance, cfg, audit=audit)
        thread = ServerThread(face).start()
        keys = {k: v for k, v in (("api", api_key), ("admin", admin_key)) if v}
        s = Served(thread.url, face, system, thread, keys)
        self.started.append(s)
        return s

    def stop_all(self) -> None:
        while self.started:
            self.started.pop().thread.stop()


@pytest.fixture
def make_server(make_system: Any) -> Iterator[ServerFactory]:
    f = ServerFactory(make_system)
    yield f
    f.stop_all()


@pytest.fixture(scope="module")
def make_module_server(make_module_system: Any) -> Iterator[ServerFactory]:
    f = ServerFactory(make_module_system)
    yield f
    f.stop_all()


@pytest.fixture(scope="module")
def pair(make_module_server: ServerFactory, llama_server: Any) -> tuple[str, str]:
    """(our url, a real llama-server's url) for the differential tests (tests/server/parity/streams.py): ours a
    timing-only simulator with 2 slots, theirs the session's ``llama_server`` (SmolLM2, 2 slots)."""
    ours = make_module_server(system_kw={"n_slots": 2})
    return ours.url, llama_server.url
