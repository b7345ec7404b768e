"""Checks of constrained-decoding output: a JSON-schema subset checker and the grammars the tests use.

``violations(value, schema)`` lists where ``value`` breaks ``schema`` (the keywords these tests use:
type, enum, const, properties, required, additionalProperties, items, minItems, maxItems,
minLength, maxLength, minimum, maximum); ``[]`` when it conforms. A keyword it does not know fails the
check, so a schema cannot silently go unchecked.
"""

from __future__ import annotations

import re
from typing import Any

#: a tool-call-like schema whose language is finite (bounded strings, arrays and integers): even a model
#: that never "wants" to close a string ends within ~120 tokens
PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}
#: an open schema: any object (strings unbounded): the timing-only stand-in must still end it
OPEN: dict[str, Any] = {"type": "object"}
#: a GBNF that admits a small language, and the same language as a regular expression
GBNF = 'root ::= ("yes" | "no") ", " [0-9] [0-9]? [0-9]? "."'
GBNF_RE = re.compile(r"(yes|no), [0-9]{1,3}\.")

_KNOWN = {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
          "maxItems", "minLength", "maxLength", "minimum", "maximum"}
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is_type(v: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, _TYPES[t])


def violations(v: Any, schema: dict[str, Any], path: str = "$") -> list[str]:
    """Where ``v`` breaks ``schema`` (see module docstring); ``[]`` if it conforms."""
    out: list[str] = []
    unknown = set(schema) - _KNOWN
    if unknown:
        return [f"{path}: the checker does not know {sorted(unknown)}"]
    if "type" in schema and not _is_type(v, schema["type"]):
        return [f"{path}: {v!r} is not of type {schema['type']}"]
    if "enum" in schema and v not in schema["enum"]:
        out.append(f"{path}: {v!r} not in {schema['enum']}")
    if "const" in schema and v != schema["const"]:
        out.append(f"{path}: {v!r} != {schema['const']!r}")
    if isinstance(v, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in v:
                out.append(f"{path}: missing required {k!r}")
        for k, x in v.items():
            if k in props:
                out += violations(x, props[k], f"{path}.{k}")
            elif schema.get("additionalProperties", True) is False:
                out.append(f"{path}: unexpected property {k!r}")
    if isinstance(v, list):
        if len(v) < schema.get("minItems", 0) or len(v) > schema.get("maxItems", len(v)):
            out.append(f"{path}: {len(v)} items outside [{schema.get('minItems', 0)}, {schema.get('maxItems')}]")
        if "items" in schema:
            for i, x in enumerate(v):
                out += violations(x, schema["items"], f"{path}[{i}]")
    if isinstance(v, str) and not schema.get("minLength", 0) <= len(v) <= schema.get("maxLength", len(v)):
        out.append(f"{path}: length {len(v)} outside [{schema.get('minLength', 0)}, {schema.get('maxLength')}]")
    if _is_type(v, "number") and not schema.get("minimum", v) <= v <= schema.get("maximum", v):
        out.append(f"{path}: {v} outside [{schema.get('minimum')}, {schema.get('maximum')}]")
    return out

