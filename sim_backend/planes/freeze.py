"""Deep-immutable views for snapshots: dicts become MappingProxyType, lists tuples,
numpy arrays tuples of Python numbers. ``thaw`` turns them back into JSON-able data."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

import numpy as np


def freeze(obj: Any) -> Any:
    """Return a deeply immutable copy of plain data (dict/list/tuple/ndarray/scalars)."""
    if isinstance(obj, (dict, MappingProxyType)):
        return MappingProxyType({k: freeze(v) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return tuple(freeze(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return freeze(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def thaw(obj: Any) -> Any:
    """JSON-friendly copy of frozen data or (nested) frozen dataclasses."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: thaw(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (dict, MappingProxyType)):
        return {str(k): thaw(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [thaw(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj
