"""Typed messages carrying results from worker threads to widgets."""

from __future__ import annotations

from textual.message import Message

from sim_backend.planes.snapshot import Snapshot


class SnapshotReady(Message):
    """A fresh, typed observation snapshot."""

    def __init__(self, snap: Snapshot) -> None:
        super().__init__()
        self.snap = snap
