"""The board list of a fleet: ``--fleet FILE`` (YAML) or repeated ``--connect URL``.

File shape (every key but ``boards`` optional)::

    refresh_hz: 1            # polls per second per board, 0.1..10 (default 1)
    timeout_s: 10            # host seconds one poll of one board may take, 0.5..120 (default 10)
    boards:
      - name: rack1-b0       # 1..64 of [A-Za-z0-9._-], unique
        url: http://10.0.0.5:8080
        api_key_file: keys/rack1-b0.api      # optional; relative paths are relative to the file
        admin_key_file: keys/rack1-b0.admin  # optional: maintenance on that board

The file is read with the same bounded loader as the layouts (size, depth, no anchors or aliases) and
checked field by field; ``FleetConfigError`` names the file and the field. At most ``MAX_BOARDS`` boards:
beyond that, scrape with a real Prometheus (``calconsole fleet prometheus-config``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from sim_backend import safe_yaml

from ..layout import _show, load_yaml

MAX_BOARDS = 512
MAX_FILE_BYTES = 256 * 1024
REFRESH_RANGE_HZ = (0.1, 10.0)
TIMEOUT_RANGE_S = (0.5, 120.0)
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_KEYS = {"refresh_hz", "timeout_s", "boards"}
_BOARD_KEYS = {"name", "url", "api_key_file", "admin_key_file"}


class FleetConfigError(ValueError):
    """The fleet file (or a ``--connect`` URL) is unusable; names where and the field."""

    def __init__(self, source: str, field: str, message: str) -> None:
        self.source, self.field = source, field
        super().__init__(f"fleet {source}: field '{field}': {message}")


@dataclass(frozen=True)
class BoardSpec:
    """One board: its name, base URL (``http(s)://host:port``, no path) and key files (or None)."""

    name: str
    url: str
    api_key_file: str | None = None
    admin_key_file: str | None = None


@dataclass(frozen=True)
class FleetConfig:
    """The boards to watch and how often (``refresh_hz`` polls per board per wall second)."""

    boards: tuple[BoardSpec, ...]
    refresh_hz: float = 1.0
    timeout_s: float = 10.0
    source: str = "--connect"


def check_url(url: object, source: str, field: str) -> str:
    """A board's base URL, normalised (no trailing slash); FleetConfigError unless http(s)://host[:port]."""
    if not isinstance(url, str) or len(url) > 2048:
        raise FleetConfigError(source, field, f"expected an http:// or https:// URL, got {_show(url)}")
    try:
        parts = urlsplit(url.strip())
        _ = parts.port  # a port outside 0..65535 raises ValueError
    except ValueError as e:
        raise FleetConfigError(source, field, f"not a URL ({e}): {_show(url)}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FleetConfigError(source, field, f"expected an http:// or https:// URL with a host, got {_show(url)}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise FleetConfigError(source, field, "the URL is the server's base address: no path, query, fragment or "
                                              f"credentials (keys go in key files), got {_show(url)}")
    return f"{parts.scheme}://{parts.netloc}"


def name_for_url(url: str) -> str:
    """A board name for a bare ``--connect URL``: its ``host-port`` (characters a name may hold)."""
    parts = urlsplit(url)
    host = (parts.hostname or "board").replace(":", ".")
    return re.sub(r"[^A-Za-z0-9._-]", "-", f"{host}-{parts.port or (443 if parts.scheme == 'https' else 80)}")[:64]


def from_urls(urls: list[str], *, api_key_file: str | None = None, admin_key_file: str | None = None,
              refresh_hz: float = 1.0) -> FleetConfig:
    """A fleet of the given URLs (``--connect URL --connect URL ...``), each named ``host-port``; the same key
    files for every board. Raises FleetConfigError for a bad or repeated URL."""
    boards = []
    seen: set[str] = set()
    for i, u in enumerate(urls):
        url = check_url(u, "--connect", f"--connect[{i}]")
        if url in seen:
            raise FleetConfigError("--connect", f"--connect[{i}]", f"{url} is given twice")
        seen.add(url)
        boards.append(BoardSpec(name_for_url(url), url, api_key_file, admin_key_file))
    if not boards:
        raise FleetConfigError("--connect", "--connect", "no board given")
    if len(boards) > MAX_BOARDS:
        raise FleetConfigError("--connect", "--connect", f"{len(boards)} boards: at most {MAX_BOARDS}")
    _dedupe_names(boards)
    return FleetConfig(tuple(boards), refresh_hz=refresh_hz)


def _dedupe_names(boards: list[BoardSpec]) -> None:
    counts: dict[str, int] = {}
    for i, b in enumerate(boards):
        n = counts.get(b.name, 0)
        counts[b.name] = n + 1
        if n:
            boards[i] = BoardSpec(f"{b.name[:60]}-{n + 1}", b.url, b.api_key_file, b.admin_key_file)


def _number(doc: dict[str, Any], key: str, default: float, lo: float, hi: float, src: str) -> float:
    v = doc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:  # also refuses nan
        raise FleetConfigError(src, key, f"expected a number in [{lo:g}, {hi:g}], got {_show(v)}")
    return float(v)


def load_fleet(path: str | Path) -> FleetConfig:
    """Read and check a fleet file. Raises FleetConfigError naming the file and the field."""
    p = Path(path)
    src = str(p)
    try:
        if not p.is_file():
            raise FleetConfigError(src, "<file>", "file not found" if not p.exists() else "not a regular file")
        with open(p, "rb") as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise FleetConfigError(src, "<file>", f"larger than {MAX_FILE_BYTES // 1024} KiB: not a fleet file")
        doc = load_yaml(data.decode("utf-8"), what="a fleet file")
    except safe_yaml.YAMLRefused as e:
        raise FleetConfigError(src, "<yaml>", f"{e} at line {e.problem_mark.line + 1}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise FleetConfigError(src, "<yaml>", "malformed YAML" + (f" at line {mark.line + 1}" if mark else "")) \
            from None
    except OSError as e:
        raise FleetConfigError(src, "<file>", e.strerror or str(e)) from None
    except UnicodeDecodeError:
        raise FleetConfigError(src, "<file>", "not UTF-8 text: not a fleet file") from None
    except (ValueError, OverflowError) as e:
        if isinstance(e, FleetConfigError):
            raise
        raise FleetConfigError(src, "<yaml>", f"malformed YAML value: {str(e)[:120]}") from None
    if not isinstance(doc, dict):
        raise FleetConfigError(src, "<root>", "expected a mapping with 'boards'")
    unknown = sorted(str(k) for k in doc if k not in _KEYS)
    if unknown:
        raise FleetConfigError(src, unknown[0], f"unknown key (known: {', '.join(sorted(_KEYS))})")
    refresh = _number(doc, "refresh_hz", 1.0, *REFRESH_RANGE_HZ, src)
    timeout = _number(doc, "timeout_s", 10.0, *TIMEOUT_RANGE_S, src)
    raw = doc.get("boards")
    if not isinstance(raw, list) or not raw:
        raise FleetConfigError(src, "boards", "expected a non-empty list of boards")
    if len(raw) > MAX_BOARDS:
        raise FleetConfigError(src, "boards", f"{len(raw)} boards: at most {MAX_BOARDS} (beyond that use "
                                              "'calconsole fleet prometheus-config' and a real Prometheus)")
    base = p.resolve().parent
    boards: list[BoardSpec] = []
    names: set[str] = set()
    urls: set[str] = set()
    for i, b in enumerate(raw):
        fld = f"boards[{i}]"
        if not isinstance(b, dict):
            raise FleetConfigError(src, fld, "expected a mapping with name and url")
        extra = sorted(str(k) for k in b if k not in _BOARD_KEYS)
        if extra:
            raise FleetConfigError(src, f"{fld}.{extra[0]}", f"unknown key (known: {', '.join(sorted(_BOARD_KEYS))})")
        name = b.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise FleetConfigError(src, f"{fld}.name", f"expected 1..64 of A-Z a-z 0-9 . _ -, got {_show(name)}")
        if name in names:
            raise FleetConfigError(src, f"{fld}.name", f"board {name!r} appears twice")
        names.add(name)
        url = check_url(b.get("url"), src, f"{fld}.url")
        if url in urls:
            raise FleetConfigError(src, f"{fld}.url", f"{url} is another board's URL too")
        urls.add(url)
        keys: dict[str, str | None] = {}
        for k in ("api_key_file", "admin_key_file"):
            v = b.get(k)
            if v is not None and (not isinstance(v, str) or not v or len(v) > 4096):
                raise FleetConfigError(src, f"{fld}.{k}", f"expected a file path, got {_show(v)}")
            keys[k] = None if v is None else str((base / v) if not Path(v).is_absolute() else Path(v))
        boards.append(BoardSpec(name, url, keys["api_key_file"], keys["admin_key_file"]))
    return FleetConfig(tuple(boards), refresh_hz=refresh, timeout_s=timeout, source=src)
