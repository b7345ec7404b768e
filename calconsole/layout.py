"""Layouts: YAML files saying which panes, their sizes, the refresh rate and the single-pane breakpoint.

``single_pane_below: {width: W, height: H}`` (optional; default ``SINGLE_PANE_BELOW``): a terminal narrower
than W or lower than H shows one pane at a time at full size (F1 / F2 / F3 switch) instead of the columns.

Shipped layouts live in the repository's ``layouts/`` (copied into the wheel
as ``calconsole/_layouts``); ``--layout`` takes a shipped name or a path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from sim_backend import safe_yaml

PANES = ("observation", "chat", "maintenance")
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)(fr|%|)$")
MIN_REFRESH_HZ, MAX_REFRESH_HZ = 0.1, 10.0
# Size bounds per unit: a pane is never 0 (invisible) and never larger than any terminal
# (a 10,000,000-row pane made Textual allocate GiBs); fr is a ratio, 100:1 is plenty.
SIZE_BOUNDS = {"": (1, 1000), "%": (0, 100), "fr": (0, 100)}  # (exclusive-or-1 low, inclusive high)
MAX_DEPTH = 16  # YAML nesting; a layout needs 5 levels (columns / column / panes / pane / value)
MAX_FILE_BYTES = 64 * 1024


#: below this terminal size (columns, rows) the console shows one pane at a time. Measured on the operator
#: layout (chat transcript, columns x rows): 80x24 35x5, 100x30 44x11, 110x33 49x14, 120x36 54x16, 130x40 58x19.
#: A 128-token English reply (~4 characters a token, ~512) with its prompt and figures line takes 12 rows at 54
#: columns (fits 16 at 120x36), 13 at 49 (only just 14 at 110x33) and 14 at 44 (not 11 at 100x30); the timing-only
#: simulator's multi-script tokens are wider (20 rows at 54: from 130x40). At 120x36 the observation pane's
#: device table keeps its memory figures and every maintenance button label is whole (test_console_sizes).
SINGLE_PANE_BELOW = (120, 36)
#: the breakpoint's bounds: not below the smallest terminal the console draws (80x24), not beyond any terminal
BREAKPOINT_BOUNDS = ((80, 1000), (24, 1000))

MAX_INT_DIGITS = 40  # an integer literal longer than this is no layout value (Python refuses > 4300)


def load_yaml(text: str, what: str = "a layout") -> Any:
    """A console YAML file (layout, fleet file) through the one hardened loader
    (``sim_backend.safe_yaml``): nesting at most ``MAX_DEPTH``, no anchors or aliases, long integers
    kept as ``LongInt``.
    Raises safe_yaml.YAMLRefused, yaml.YAMLError, ValueError."""
    return safe_yaml.load(text, aliases=False, max_depth=MAX_DEPTH, max_int_digits=MAX_INT_DIGITS, what=what)


def _show(v: object, limit: int = 40) -> str:
    """A bounded description of an unchecked value: never formats a large or shared structure."""
    if isinstance(v, str):
        return repr(v[:limit]) + (f" (+{len(v) - limit} characters)" if len(v) > limit else "")
    if isinstance(v, bool | float | safe_yaml.LongInt) or v is None:
        return repr(v)
    if isinstance(v, int):
        return repr(v) if v.bit_length() <= 128 else f"<an integer of {v.bit_length()} bits>"
    if isinstance(v, list | dict):
        return f"a {'list' if isinstance(v, list) else 'mapping'} of {len(v)} items"
    return f"a {type(v).__name__}"


class LayoutError(Exception):
    """A layout file is missing or malformed; names the file and the field."""

    def __init__(self, file: str, field: str, message: str) -> None:
        self.file, self.field = file, field
        super().__init__(f"layout {file}: field '{field}': {message}")


@dataclass(frozen=True)
class PaneSpec:
    pane: str
    height: str


@dataclass(frozen=True)
class ColumnSpec:
    width: str
    panes: tuple[PaneSpec, ...]


@dataclass(frozen=True)
class Layout:
    """A parsed layout: columns of stacked panes, refresh rate in Hz, and the terminal size (columns, rows)
    below which one pane is shown at a time."""

    name: str
    path: Path
    refresh_hz: float
    columns: tuple[ColumnSpec, ...]
    single_pane_below: tuple[int, int] = SINGLE_PANE_BELOW

    def panes(self) -> list[str]:
        return [p.pane for c in self.columns for p in c.panes]

    def without(self, pane: str) -> Layout:
        cols = tuple(ColumnSpec(c.width, tuple(p for p in c.panes if p.pane != pane)) for c in self.columns)
        return Layout(self.name, self.path, self.refresh_hz, tuple(c for c in cols if c.panes), self.single_pane_below)

    def css(self) -> str:
        """The columns' widths and the panes' heights as Textual CSS (ids ``col<i>`` and the pane names); CSS,
        not inline styles, so the single-pane rules of styles.tcss (more specific) can override them."""
        rules = []
        for i, c in enumerate(self.columns):
            rules.append(f"#col{i} {{ width: {c.width}; }}")
            rules += [f"#{p.pane} {{ height: {p.height}; }}" for p in c.panes]
        return "\n".join(rules)


def layout_dirs() -> list[Path]:
    """Where shipped layouts are looked up: the wheel's copy, then the source tree's."""
    here = Path(__file__).resolve().parent
    return [d for d in (here / "_layouts", here.parent / "layouts") if d.is_dir()]


def available_layouts() -> list[str]:
    names: set[str] = set()
    for d in layout_dirs():
        names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def resolve_layout(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise LayoutError(str(p), "<file>", "file not found")
        if not p.is_file():  # a FIFO or device would block or never end
            raise LayoutError(str(p), "<file>", "not a regular file")
        return p
    for d in layout_dirs():
        cand = d / f"{name_or_path}.yaml"
        if cand.is_file():
            return cand
    raise LayoutError(name_or_path, "<name>",
                      f"no such layout (shipped: {', '.join(available_layouts()) or 'none found'})")


def _size(v: object, file: str, fld: str) -> str:
    """A Textual size: ``N`` cells (1..1000), ``N%`` (0 < N <= 100) or ``Nfr`` (0 < N <= 100)."""
    s = str(v).strip() if isinstance(v, (str, int, float)) and not isinstance(v, bool) else ""
    m = _SIZE.match(s)
    if not m:
        raise LayoutError(file, fld, f"size must look like 2fr, 40% or 30 (cells), got {_show(v)}")
    n, unit = float(m.group(1)), m.group(2)
    lo, hi = SIZE_BOUNDS[unit]
    if not (n >= lo if unit == "" else n > lo) or n > hi:
        what = {"": f"{lo}..{hi} cells", "%": f"more than 0% and at most {hi}%",
                "fr": f"more than 0fr and at most {hi}fr"}[unit]
        raise LayoutError(file, fld, f"size must be {what}, got {s[:40]}")
    return s


def load_layout(name_or_path: str) -> Layout:
    """Load and validate a layout. Raises LayoutError naming file and field."""
    path = resolve_layout(name_or_path)
    f = str(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise LayoutError(f, "<file>", f"larger than {MAX_FILE_BYTES // 1024} KiB: not a layout file")
        # the bounded loader: safe tags only, nesting bounded, no anchors/aliases (checked while composing)
        doc = load_yaml(data.decode("utf-8"))
    except safe_yaml.YAMLRefused as e:
        raise LayoutError(f, "<yaml>", f"{e} at line {e.problem_mark.line + 1}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise LayoutError(f, "<yaml>", f"malformed YAML{where}") from None
    except OSError as e:
        raise LayoutError(f, "<file>", str(e)) from None
    except UnicodeDecodeError:
        raise LayoutError(f, "<file>", "not UTF-8 text: not a layout file") from None
    except (ValueError, OverflowError) as e:  # a constructor's own error (a date 2001-13-45); after the
        # UnicodeDecodeError clause, which is a ValueError too
        raise LayoutError(f, "<yaml>", f"malformed YAML value: {str(e)[:120]}") from None
    if not isinstance(doc, dict):
        raise LayoutError(f, "<root>", "expected a mapping")
    name = doc.get("name", path.stem)
    if not isinstance(name, str):
        raise LayoutError(f, "name", f"expected a string, got {_show(name)}")
    hz = doc.get("refresh_hz", 2)
    if isinstance(hz, bool) or not isinstance(hz, (int, float)) or not MIN_REFRESH_HZ <= hz <= MAX_REFRESH_HZ:
        raise LayoutError(f, "refresh_hz",
                          f"expected a number in [{MIN_REFRESH_HZ}, {MAX_REFRESH_HZ}], got {_show(hz)}")
    cols = doc.get("columns")
    if not isinstance(cols, list) or not cols:
        raise LayoutError(f, "columns", "expected a non-empty list of columns")
    seen: set[str] = set()
    columns = []
    for i, c in enumerate(cols):
        if not isinstance(c, dict):
            raise LayoutError(f, f"columns[{i}]", "expected a mapping with width and panes")
        width = _size(c.get("width", "1fr"), f, f"columns[{i}].width")
        panes = c.get("panes")
        if not isinstance(panes, list) or not panes:
            raise LayoutError(f, f"columns[{i}].panes", "expected a non-empty list")
        specs = []
        for j, p in enumerate(panes):
            fld = f"columns[{i}].panes[{j}]"
            if not isinstance(p, dict) or "pane" not in p:
                raise LayoutError(f, fld, "expected {pane: NAME, height: SIZE}")
            if not isinstance(p["pane"], str) or p["pane"] not in PANES:  # a list or mapping is unhashable
                raise LayoutError(f, fld + ".pane", f"unknown pane {_show(p['pane'])} (known: {', '.join(PANES)})")
            if p["pane"] in seen:
                raise LayoutError(f, fld + ".pane", f"pane {p['pane']!r} appears twice")
            seen.add(p["pane"])
            specs.append(PaneSpec(p["pane"], _size(p.get("height", "1fr"), f, fld + ".height")))
        columns.append(ColumnSpec(width, tuple(specs)))
    return Layout(name, path, float(hz), tuple(columns), _breakpoint(doc.get("single_pane_below"), f))


def _breakpoint(v: object, file: str) -> tuple[int, int]:
    """``single_pane_below: {width: W, height: H}`` (either may be left out: its default) as (W, H)."""
    if v is None:
        return SINGLE_PANE_BELOW
    if not isinstance(v, dict) or set(v) - {"width", "height"}:
        raise LayoutError(file, "single_pane_below", f"expected {{width: COLUMNS, height: ROWS}}, got {_show(v)}")
    out = []
    for key, default, (lo, hi) in zip(("width", "height"), SINGLE_PANE_BELOW, BREAKPOINT_BOUNDS, strict=True):
        n = v.get(key, default)
        if isinstance(n, bool) or not isinstance(n, int) or not lo <= n <= hi:
            raise LayoutError(file, f"single_pane_below.{key}", f"expected an integer in {lo}..{hi}, got {_show(n)}")
        out.append(int(n))
    return out[0], out[1]
