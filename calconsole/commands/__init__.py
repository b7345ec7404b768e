"""Headless sub-commands. Each module defines ``register(subparsers, common)``
adding its parser with ``set_defaults(func=run)``; ``run(args) -> int`` is the exit code."""

from __future__ import annotations

import importlib
from types import ModuleType

# modules listed here are registered in this order in ``calconsole --help``
COMMAND_MODULES = ("snapshot", "chat", "metrics", "model", "bench", "trace", "drill", "audit", "serve", "fleet")


def load_commands() -> list[ModuleType]:
    """The command modules of ``COMMAND_MODULES`` that are installed, in that order."""
    mods = []
    for name in COMMAND_MODULES:
        try:
            mods.append(importlib.import_module(f"{__name__}.{name}"))
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    return mods
