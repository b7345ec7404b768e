"""The benches of ``calconsole bench NAME``: one module per bench, ``calconsole/bench/NAME.py``, holding its
parser (``register(bsub)``, adding ``NAME`` with ``set_defaults(func=run)``), its ``run(args) -> int`` (the exit
code) and its measuring code. ``calconsole.commands.bench`` dispatches into them and groups them in
``calconsole bench --help``.

Shared by several benches, and importing no command, console or fleet view (pyproject's import contracts):
``serve_load``, the HTTP load generator of ``serve``, ``matrix`` and ``replay`` (closed-loop streaming clients
over httpx, client-side TTFT / TPOT / ITL / E2E with vLLM's definitions, the server's final-chunk timings and
``/metrics`` deltas beside them); ``busy``, the busy loops and CPU meters of ``keys`` and ``realtime``. The
benches that run the simulator in-process compose it or run its tools (each named in the contracts); the rest
of the package imports only ``sim_backend.planes`` from the simulator.
"""

from __future__ import annotations

import argparse
from typing import Any, Protocol


class BenchParsers(Protocol):
    """What a bench's ``register`` is given: argparse's sub-parsers of ``calconsole bench`` (``add_parser``
    takes argparse's keywords and returns the bench's parser)."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...
