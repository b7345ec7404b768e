"""One hardened YAML loader for every file the project reads: layouts, settings and fleet files
(the console), calbin manifests and the hardware YAML (the simulator).

PyYAML's ``SafeLoader`` (plain data only, never Python objects) with bounds checked while the
document is composed, before anything large or deep is built:

- nesting depth (``max_depth``): PyYAML's composer and constructor are recursive and would hit
  Python's recursion limit first;
- anchors and aliases: refused (``aliases=False``), or allowed with the document's size, aliases
  expanded, bounded (``max_nodes``): a 1 KB "billion laughs" file shares one list billions of
  times, and any later repr or walk of it takes gigabytes (PyYAML's own ``safe_dump`` writes
  aliases for shared objects, so a manifest may carry a few);
- integer literals longer than ``max_int_digits``: kept as a ``LongInt`` (PyYAML's int() raises a
  bare ValueError past 4,300 digits), so the caller's type check names the field.

A bound is refused with ``YAMLRefused`` (a ``yaml.YAMLError`` with ``problem`` and ``problem_mark``);
malformed YAML raises PyYAML's own ``yaml.YAMLError``; a constructor's error (a date 2001-13-45)
ValueError. Byte-size limits are the caller's (it knows its file).

Imports nothing of the project: the console and the simulator share it.
"""

from __future__ import annotations

from typing import Any

import yaml

#: An integer literal longer than this (digits) is no value of ours; Python's int() refuses > 4300.
MAX_INT_DIGITS = 40
#: Values in one file with aliases expanded: the largest valid manifest (16 sub-models of 64 + 64
#: tensors of rank 8) has about 30,000, the shipped one a few hundred.
MAX_EXPANDED_NODES = 100_000
#: Nesting depth (mappings and sequences): a manifest needs about 6, a layout 5.
MAX_DEPTH = 64


class LongInt:
    """An integer literal too long to be a value (kept as its length only)."""

    def __init__(self, n_chars: int) -> None:
        self.n_chars = n_chars

    def __repr__(self) -> str:
        return f"<an integer of {self.n_chars} characters>"


class YAMLRefused(yaml.YAMLError):
    """A bound of ``load`` was passed; ``problem`` says which, ``problem_mark`` where (0-based line/column)."""

    def __init__(self, mark: Any, problem: str) -> None:
        self.problem_mark = mark
        self.problem = problem
        super().__init__(problem)


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader with the bounds of ``load`` (set on the instance before loading)."""

    max_depth = MAX_DEPTH
    max_nodes = MAX_EXPANDED_NODES
    max_int_digits = MAX_INT_DIGITS
    aliases = True
    what = "this file"

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._expanded = 0  # nodes composed so far, an alias counting as the nodes it stands for
        self._weight: dict[int, int] = {}  # id(node) -> its expanded size

    def compose_node(self, parent: Any, index: Any) -> Any:
        ev = self.peek_event()  # type: ignore[no-untyped-call]  # types-PyYAML leaves Parser.peek_event bare
        if not self.aliases and (isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None) is not None):
            raise YAMLRefused(ev.start_mark, f"YAML anchors and aliases (&name, *name) are not allowed in {self.what}")
        self._depth += 1
        try:
            if self._depth > self.max_depth:
                raise YAMLRefused(ev.start_mark, f"nested deeper than {self.max_depth} levels")
            if isinstance(ev, yaml.AliasEvent):
                node = super().compose_node(parent, index)
                self._expanded += self._weight.get(id(node), 1)  # 1: an alias of a node still being composed
            else:
                before = self._expanded
                self._expanded += 1
                node = super().compose_node(parent, index)
                self._weight[id(node)] = self._expanded - before
        finally:
            self._depth -= 1
        if self._expanded > self.max_nodes:
            raise YAMLRefused(ev.start_mark, f"more than {self.max_nodes:,} values once YAML aliases are expanded "
                                             f"(an alias bomb?)")
        return node

    def construct_yaml_int(self, node: Any) -> Any:
        text = str(node.value)
        if len(text.replace("_", "")) > self.max_int_digits:
            return LongInt(len(text))
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def load(text: str, *, aliases: bool = True, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_EXPANDED_NODES,
         max_int_digits: int = MAX_INT_DIGITS, what: str = "this file") -> Any:
    """The one YAML document in ``text`` as plain data (dicts, lists, str, int, float, bool, None,
    dates; ``LongInt`` for an over-long integer), within the bounds (module docstring).

    ``aliases``: False refuses any anchor or alias; ``what``: how a refusal names the file ("a layout").
    Raises YAMLRefused, yaml.YAMLError, ValueError.
    """
    loader = _BoundedLoader(text)
    loader.aliases, loader.max_depth, loader.max_nodes = aliases, max_depth, max_nodes
    loader.max_int_digits, loader.what = max_int_digits, what
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


__all__ = ["MAX_DEPTH", "MAX_EXPANDED_NODES", "MAX_INT_DIGITS", "LongInt", "YAMLRefused", "load"]
