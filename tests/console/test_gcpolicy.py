"""The console's garbage-collection policy: survivors of a full collection are frozen, and frozen
reference cycles that became garbage are returned by the idle-time deep collection."""

from __future__ import annotations

import gc
import weakref

from calconsole.gcpolicy import GCPolicy


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cycle collector frees it


def test_full_collection_freezes_survivors_and_idle_returns_frozen_cycles():
    policy = GCPolicy(deep_every_s=0.0)
    policy.start()
    try:
        assert policy.idle() is False  # nothing frozen by a full collection since start: no deep pass
        node = _Node()
        ref = weakref.ref(node)
        frozen = gc.get_freeze_count()
        gc.collect()  # a full collection: the node survives it and is frozen with the other survivors
        assert policy.refreezes == 1 and gc.get_freeze_count() > frozen
        assert all(o is not node for o in gc.get_objects(generation=2))  # frozen: no longer walked
        del node
        gc.collect()
        assert ref() is not None  # frozen garbage in a cycle waits for the deep collection
        assert policy.idle() is True and ref() is None
        assert policy.deep_collections == 1 and len(policy.deep_ms) == 1
        assert policy.refreezes == 2  # the deep pass itself is not a refreeze
        assert policy.idle() is False  # nothing frozen since
    finally:
        policy.stop()
    assert gc.get_freeze_count() == 0 and policy._on_gc not in gc.callbacks


def test_deep_collection_waits_its_interval():
    policy = GCPolicy(deep_every_s=3600.0)
    policy.start()
    try:
        gc.collect()
        assert policy.refreezes == 1 and policy.idle() is False and policy.deep_collections == 0
    finally:
        policy.stop()
