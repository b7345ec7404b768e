"""The three planes of a stock llama-server (llama.cpp's HTTP server), beside the calconsole ones.

    system = connect("http://127.0.0.1:8080")    # calconsole.remote.connect detects the kind
    system.kind                                   # "llama-server"
    system.observation.snapshot()                 # Snapshot: server, slots, load, client request metrics
    system.inference.submit(req).stream()         # /v1/chat/completions (SSE)
    system.maintenance.clear_kv(None)             # slot erase, audited locally; the rest NotOffered

``LlamaServerSystem`` has the attributes of ``RemoteSystem`` the console and the headless commands use
(``inference``, ``observation``, ``maintenance``, ``connection``, ``connected``,
``disconnected_since``, ``describe()``, ``close()``), plus ``kind``, ``build`` and ``model``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..attached import AttachedSystem
from ..connection import Connection
from .inference import CLIENT_CLOCK, ClientMetrics, LlamaInferencePlane, LlamaRequestStream
from .maintenance import KIND, MISSING, OFFERED, LlamaMaintenancePlane
from .observation import LOAD_CLOCK, LlamaObservationPlane, parse_metrics, slot_view


def is_llama_server(props: Any) -> bool:
    """A llama-server's ``/props``: a ``build_info`` string and ``default_generation_settings.n_ctx``."""
    return (isinstance(props, Mapping) and isinstance(props.get("build_info"), str)
            and isinstance(props.get("default_generation_settings"), Mapping)
            and "n_ctx" in props["default_generation_settings"])


class LlamaServerSystem(AttachedSystem):
    """The planes of one llama-server, sharing one ``Connection`` and one ``ClientMetrics``.

    ``props``: its ``/props``; ``n_vocab``: from ``/v1/models`` (``meta.n_vocab``), for checking token
    ids before sending; ``audit_path``: the local audit log of maintenance calls (None: default path).
    """

    kind = KIND

    def __init__(self, conn: Connection, props: Mapping[str, Any], n_vocab: int,
                 audit_path: str | Path | None = None) -> None:
        super().__init__(conn)
        self.props = dict(props)
        self.client_metrics = ClientMetrics()
        self.inference = LlamaInferencePlane(conn, props, n_vocab, self.client_metrics)
        self.observation = LlamaObservationPlane(conn, props, self.client_metrics, on_props=self._new_props)
        self.maintenance = LlamaMaintenancePlane(conn, int(props.get("total_slots", 1)), audit_path)
        self.device_name = f"llama-server {self.build}"

    def _new_props(self, props: Mapping[str, Any]) -> None:
        self.props = dict(props)

    @property
    def build(self) -> str:
        return str(self.props.get("build_info", "?"))

    @property
    def model(self) -> str:
        path = str(self.props.get("model_path") or self.props.get("model_alias") or "")
        return os.path.basename(path) or "?"

    def describe(self) -> str:
        """The header's words: ``llama-server b… · model … · attached to URL``."""
        return f"llama-server {self.build} · model {self.model} · attached to {self.url}"


__all__ = ["CLIENT_CLOCK", "KIND", "LOAD_CLOCK", "MISSING", "OFFERED", "ClientMetrics", "LlamaInferencePlane",
           "LlamaMaintenancePlane", "LlamaObservationPlane", "LlamaRequestStream", "LlamaServerSystem",
           "is_llama_server", "parse_metrics", "slot_view"]
