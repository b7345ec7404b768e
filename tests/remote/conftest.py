"""Servers for the remote-plane tests: the serving-face tests' factory (``tests/server/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.server.conftest import ADMIN_KEY, API_KEY, ServerFactory

__all__ = ["ADMIN_KEY", "API_KEY"]


@pytest.fixture
def make_server(make_system: Any) -> Iterator[ServerFactory]:
    f = ServerFactory(make_system)
    yield f
    f.stop_all()
