"""Bounds of a bench's numeric arguments, checked before anything starts: one rule for every bench."""

from __future__ import annotations

import argparse
from collections.abc import Collection, Mapping


def out_of_bounds(args: argparse.Namespace, bounds: Mapping[str, tuple[float, float]],
                  ints: Collection[str] = (), optional: Collection[str] = ()) -> str | None:
    """The first argument outside its bounds, said as an error message naming the flag; None when all are in.

    ``bounds``: attribute name -> inclusive (low, high); ``ints``: names that must be integers (a bool is not
    one); ``optional``: names that may be None (not given). NaN is out of every bound (it fails both
    comparisons)."""
    for name, (lo, hi) in bounds.items():
        v = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if v is None and name in optional:
            continue
        if name in ints and (isinstance(v, bool) or not isinstance(v, int)):
            return f"{flag} must be an integer, got {v!r}"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            return f"{flag} must be in {_num(lo)}..{_num(hi)}, got {v!r}"
    return None


def _num(x: float) -> str:
    """A bound as written in the help: a whole number without exponent or point (1048576, not 1.04858e+06)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
