"""JSON shapes for differential tests: key sets (recursively) and value types, compared path by path.

``diff(ours, theirs)`` lists every path where the two documents differ in shape: a key one side has
and the other lacks, or a value of another JSON type (``null``, ``bool``, ``number``, ``string``,
``array``, ``object``; ints and floats are both ``number``, as JSON has one number type). Array
elements are compared as the union of their elements' shapes, so ``[1, 2]`` and ``[3]`` agree.
Paths read ``timings.prompt_n``, ``choices[].delta.content``, ``[]`` for the top-level array.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import Any


def jtype(v: Any) -> str:
    """The JSON type name of a decoded value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    raise TypeError(f"not a JSON value: {type(v).__name__}")


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _merged(items: Iterable[Any]) -> dict[str, Any]:
    """The union of several objects' keys, each key's values gathered (for array elements)."""
    out: dict[str, list[Any]] = {}
    for it in items:
        for k, v in it.items():
            out.setdefault(k, []).append(v)
    return out


def diff(ours: Any, theirs: Any, path: str = "") -> list[str]:
    """Paths where ``ours`` and ``theirs`` differ in key set or JSON type, one line each (sorted)."""
    out: list[str] = []
    _diff([ours], [theirs], path, out)
    return sorted(set(out))


def _diff(ours: list[Any], theirs: list[Any], path: str, out: list[str]) -> None:
    # each side is a list of sample values at this path (several for array elements)
    ta, tb = {jtype(v) for v in ours}, {jtype(v) for v in theirs}
    if ours and theirs and ta != tb:
        out.append(f"{path or '<root>'}: type {'|'.join(sorted(ta))} != llama-server {'|'.join(sorted(tb))}")
        return
    objs_a = [v for v in ours if isinstance(v, dict)]
    objs_b = [v for v in theirs if isinstance(v, dict)]
    if objs_a and objs_b:
        ma, mb = _merged(objs_a), _merged(objs_b)
        for k in sorted(set(ma) | set(mb)):
            p = _join(path, k)
            if k not in mb:
                out.append(f"{p}: only in calconsole")
            elif k not in ma:
                out.append(f"{p}: only in llama-server")
            else:
                _diff(ma[k], mb[k], p, out)
    arrs_a = [x for v in ours if isinstance(v, list) for x in v]
    arrs_b = [x for v in theirs if isinstance(v, list) for x in v]
    if arrs_a and arrs_b:
        _diff(arrs_a, arrs_b, f"{path}[]", out)


def allowed(line: str, allow: Mapping[str, str]) -> bool:
    """True if the diff ``line``'s path matches an allow-list pattern (fnmatch; a pattern ending in
    ``.*`` also covers everything under that path)."""
    p = line.split(":", 1)[0]
    return any(fnmatch.fnmatchcase(p, pat) or (pat.endswith(".*") and p == pat[:-2]) for pat in allow)


def unexplained(ours: Any, theirs: Any, allow: Mapping[str, str]) -> list[str]:
    """``diff`` lines no allow-list entry explains."""
    return [d for d in diff(ours, theirs) if not allowed(d, allow)]
