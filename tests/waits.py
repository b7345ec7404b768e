"""Waiting for a state in tests: bounded polling of a condition, never a fixed sleep that gates an assert."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, step: float = 0.02) -> bool:
    """Poll ``cond`` every ``step`` host seconds for up to ``timeout``; True once it holds (checked once more
    at the deadline, so a state reached during the last sleep counts)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())
