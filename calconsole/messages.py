"""Typed messages carrying results from worker threads to widgets."""

from __future__ import annotations

from textual.message import Message


class SnapshotReady(Message):
    """A fresh observation snapshot (``Snapshot.to_dict()`` form)."""

    def __init__(self, snap: dict) -> None:
        super().__init__()
        self.snap = snap
