"""Console settings: a YAML file in the user's config directory, overridden by ``CALCONSOLE_*``.

The file (``settings_path()``: ``$CALCONSOLE_CONFIG``, else ``<user config dir>/calconsole/config.yaml``
from platformdirs) is optional; a missing key keeps its default. Environment variables override it,
nvitop style: ``CALCONSOLE_LAYOUT``, ``CALCONSOLE_REFRESH`` (Hz), ``CALCONSOLE_HISTORY_WINDOW`` (s),
``CALCONSOLE_THEME``, ``CALCONSOLE_COMPACT`` (auto|on|off), ``CALCONSOLE_PANES`` (auto|single|columns),
``CALCONSOLE_AUDIT_LOG``, ``CALCONSOLE_SLO_TTFT_MS`` / ``CALCONSOLE_SLO_TPOT_MS`` and
``CALCONSOLE_THRESHOLD_<NAME>=WARN,CRIT``.
``sections: {order, folded, focus}`` is the observation pane's arrangement (names in ``SECTIONS``),
written by the pane at each change (``save_sections``, the file's other keys kept). Command-line
options override both. A bad value raises ``SettingsError`` naming the file (or the
variable) and the key. ``save_settings`` writes the file back (the console's "save settings").

Thresholds colour a value yellow at ``warn`` and red at ``crit``. Defaults follow nvitop (memory:
80 % moderate, higher is heavy) and the device's figures: TPOT against the SLO, pacing achieved
against asked for, queue depth against the slots (4 by default).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs
import yaml

from sim_backend import safe_yaml

from .layout import MAX_REFRESH_HZ, MIN_REFRESH_HZ

HISTORY_WINDOWS_S = (60, 300, 900)  # 1 / 5 / 15 min (host wall time)
COMPACT_MODES = ("auto", "on", "off")
#: how the panes are shown: by the terminal's size (the layout's ``single_pane_below``), one at a time, or side
#: by side whatever the size
PANE_MODES = ("auto", "single", "columns")
#: below this terminal size, compact mode "auto" switches the observation pane to compact
COMPACT_BELOW = (120, 36)
MAX_FILE_BYTES = 64 * 1024
#: the observation pane's sections, in their default order (names used in the settings file)
SECTIONS = ("device", "thresholds", "graphs", "batches", "requests", "per-layer", "slots", "stages", "kv", "jobs",
            "memory", "host", "findings")


@dataclass(frozen=True)
class Threshold:
    """``warn`` / ``crit`` limits; ``higher_is_worse`` False for figures that alarm when low (pacing)."""

    warn: float
    crit: float
    unit: str
    meaning: str
    higher_is_worse: bool = True

    def level(self, value: float | None) -> str:
        """"ok" | "warn" | "crit" for ``value`` (None, NaN: "ok")."""
        if value is None or value != value:
            return "ok"
        if self.higher_is_worse:
            return "crit" if value >= self.crit else "warn" if value >= self.warn else "ok"
        return "crit" if value <= self.crit else "warn" if value <= self.warn else "ok"


DEFAULT_THRESHOLDS: dict[str, Threshold] = {
    "kv_percent": Threshold(80, 95, "% of KV cells", "KV cache occupancy (nvitop memory: 80 % is heavy)"),
    "queue_depth": Threshold(1, 4, "requests", "requests waiting for a slot"),
    "tpot_slo_ratio": Threshold(0.8, 1.0, "x SLO", "TPOT P95 against the TPOT SLO (sim)"),
    "ttft_slo_ratio": Threshold(0.8, 1.0, "x SLO", "TTFT P95 against the TTFT SLO (sim)"),
    "pacing_ratio": Threshold(0.9, 0.5, "x asked", "pacing achieved / asked for (low: host behind real time)",
                              higher_is_worse=False),
    "failed": Threshold(1, 5, "jobs or requests", "failed device jobs, failed requests"),
}

LEVEL_STYLE = {"ok": "green", "warn": "bold yellow", "crit": "bold red"}


@dataclass(frozen=True)
class Settings:
    """What the console reads at start-up (see the module docstring for the file and variables)."""

    layout: str = "operator"
    refresh_hz: float | None = None  # None: the layout's
    history_window_s: int = 300
    theme: str = "textual-dark"
    compact: str = "auto"
    panes: str = "auto"  # PANE_MODES
    audit_log: str | None = None
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 50.0
    thresholds: dict[str, Threshold] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    #: the observation pane's arrangement: every section once, top to bottom; the folded ones; the one
    #: shown alone (None: all)
    section_order: tuple[str, ...] = SECTIONS
    sections_folded: tuple[str, ...] = ()
    section_focus: str | None = None
    path: Path | None = None  # the file read (or to be written), for messages

    def level(self, name: str, value: float | None) -> str:
        return self.thresholds[name].level(value)

    def style(self, name: str, value: float | None) -> str:
        return LEVEL_STYLE[self.level(name, value)]

    def replace(self, **kw: Any) -> Settings:
        return dataclasses.replace(self, **kw)


class SettingsError(Exception):
    """A setting is unusable; names where it came from (file or variable) and the key."""

    def __init__(self, source: str, key: str, message: str) -> None:
        self.source, self.key = source, key
        super().__init__(f"settings {source}: key '{key}': {message}")


def settings_path() -> Path:
    """``$CALCONSOLE_CONFIG`` or ``<user config dir>/calconsole/config.yaml`` (platformdirs)."""
    env = os.environ.get("CALCONSOLE_CONFIG")
    if env:
        return Path(env)
    return Path(platformdirs.user_config_dir("calconsole", appauthor=False)) / "config.yaml"


def _number(source: str, key: str, v: Any, lo: float, hi: float) -> float:
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise SettingsError(source, key, f"must be a number, got {v[:40]!r}") from None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        shown = repr(v) if isinstance(v, int | float | bool) else f"a {type(v).__name__}"
        raise SettingsError(source, key, f"must be a number in {lo:g}..{hi:g}, got {shown}")
    return float(v)


def _text(source: str, key: str, v: Any, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(v, str) or not v or len(v) > 4096:
        raise SettingsError(source, key, f"must be a non-empty string, got a {type(v).__name__}")
    if choices is not None and v not in choices:
        raise SettingsError(source, key, f"must be one of {', '.join(choices)}, got {v[:40]!r}")
    return v


def _threshold(source: str, key: str, v: Any, base: Threshold) -> Threshold:
    if isinstance(v, str):
        v = [x.strip() for x in v.split(",")]
    if isinstance(v, dict):
        unknown = set(v) - {"warn", "crit"}
        if unknown:
            raise SettingsError(source, f"{key}.{sorted(unknown)[0]}", "unknown key (warn, crit)")
        warn, crit = v.get("warn", base.warn), v.get("crit", base.crit)
    elif isinstance(v, list) and len(v) == 2:
        warn, crit = v
    else:
        raise SettingsError(source, key, "must be {warn: W, crit: C} or 'W,C'")
    w = _number(source, f"{key}.warn", warn, 0, 1e9)
    c = _number(source, f"{key}.crit", crit, 0, 1e9)
    if (c < w) if base.higher_is_worse else (c > w):
        raise SettingsError(source, key, f"crit {c:g} must be {'at least' if base.higher_is_worse else 'at most'} "
                                         f"warn {w:g} ({'higher' if base.higher_is_worse else 'lower'} is worse)")
    return dataclasses.replace(base, warn=w, crit=c)


def _section_names(source: str, key: str, v: Any) -> tuple[str, ...]:
    if not isinstance(v, list):
        raise SettingsError(source, key, f"must be a list of section names ({', '.join(SECTIONS)})")
    out: list[str] = []
    for name in v:
        if name not in SECTIONS:
            shown = repr(name)[:40]
            raise SettingsError(source, key, f"unknown section {shown} (one of {', '.join(SECTIONS)})")
        if name in out:
            raise SettingsError(source, key, f"section {name!r} listed twice")
        out.append(name)
    return tuple(out)


def _sections(source: str, v: Any) -> dict[str, Any]:
    """``sections: {order: [...], folded: [...], focus: NAME|null}``; an order naming only some sections
    gets the others appended in their default order (a section added by a later version shows up)."""
    if not isinstance(v, dict):
        raise SettingsError(source, "sections", "must be a mapping {order: [...], folded: [...], focus: NAME}")
    kw: dict[str, Any] = {}
    for k2, v2 in v.items():
        if k2 == "order":
            order = _section_names(source, "sections.order", v2)
            kw["section_order"] = order + tuple(n for n in SECTIONS if n not in order)
        elif k2 == "folded":
            kw["sections_folded"] = _section_names(source, "sections.folded", v2)
        elif k2 == "focus":
            if v2 is not None and v2 not in SECTIONS:
                raise SettingsError(source, "sections.focus", f"must be null or one of {', '.join(SECTIONS)}, "
                                                              f"got {repr(v2)[:40]}")
            kw["section_focus"] = v2
        else:
            raise SettingsError(source, f"sections.{str(k2)[:40]}", "unknown key (order, folded, focus)")
    return kw


def _apply(s: Settings, source: str, data: dict[str, Any], env: bool = False) -> Settings:
    kw: dict[str, Any] = {}
    thresholds = dict(s.thresholds)
    for key, v in data.items():
        if key == "layout":
            kw["layout"] = _text(source, key, v)
        elif key == "refresh_hz":
            kw["refresh_hz"] = _number(source, key, v, MIN_REFRESH_HZ, MAX_REFRESH_HZ)
        elif key == "history_window_s":
            n = _number(source, key, v, 1, 1e9)
            if n not in HISTORY_WINDOWS_S:
                raise SettingsError(source, key, f"must be one of {', '.join(map(str, HISTORY_WINDOWS_S))} s")
            kw["history_window_s"] = int(n)
        elif key == "theme":
            kw["theme"] = _text(source, key, v)
        elif key == "compact":
            kw["compact"] = _text(source, key, {True: "on", False: "off"}.get(v, v), COMPACT_MODES)
        elif key == "panes":
            kw["panes"] = _text(source, key, v, PANE_MODES)
        elif key == "audit_log":
            kw["audit_log"] = _text(source, key, v)
        elif key == "slo":
            if not isinstance(v, dict):
                raise SettingsError(source, key, "must be a mapping {ttft_ms: MS, tpot_ms: MS}")
            for k2, v2 in v.items():
                if k2 not in ("ttft_ms", "tpot_ms"):
                    raise SettingsError(source, f"slo.{k2}", "unknown key (ttft_ms, tpot_ms)")
                kw[f"slo_{k2}"] = _number(source, f"slo.{k2}", v2, 0.001, 1e7)
        elif key == "thresholds":
            if not isinstance(v, dict):
                raise SettingsError(source, key, f"must be a mapping of {', '.join(DEFAULT_THRESHOLDS)}")
            for name, tv in v.items():
                if name not in DEFAULT_THRESHOLDS:
                    raise SettingsError(source, f"thresholds.{name}",
                                        f"unknown threshold (one of {', '.join(DEFAULT_THRESHOLDS)})")
                thresholds[name] = _threshold(source, f"thresholds.{name}", tv, thresholds[name])
        elif key == "sections":
            kw.update(_sections(source, v))
        else:
            raise SettingsError(source, str(key)[:40], "unknown key (layout, refresh_hz, history_window_s, theme, "
                                                       "compact, panes, audit_log, slo, thresholds, sections)")
    return s.replace(thresholds=thresholds, **kw)


ENV_KEYS = {"CALCONSOLE_LAYOUT": "layout", "CALCONSOLE_REFRESH": "refresh_hz",
            "CALCONSOLE_HISTORY_WINDOW": "history_window_s", "CALCONSOLE_THEME": "theme",
            "CALCONSOLE_COMPACT": "compact", "CALCONSOLE_PANES": "panes", "CALCONSOLE_AUDIT_LOG": "audit_log"}


def load_settings(path: Path | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Defaults, then the file (if it exists), then ``CALCONSOLE_*`` variables. Raises SettingsError."""
    path = path or settings_path()
    environ = dict(os.environ) if environ is None else environ
    s = Settings(path=path)
    src = str(path)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise SettingsError(src, "(file)", f"larger than {MAX_FILE_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        text = None
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError(src, "(file)", f"cannot read it: {e}") from None
    if text is not None:
        try:
            data = safe_yaml.load(text, aliases=False, what="a settings file")
        except (yaml.YAMLError, ValueError) as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise SettingsError(src, "(file)", f"not valid YAML{where}: {getattr(e, 'problem', e)}") from None
        if data is not None:
            if not isinstance(data, dict):
                raise SettingsError(src, "(file)", "must be a mapping of settings")
            s = _apply(s, src, data)
    for var, key in ENV_KEYS.items():
        if var in environ:
            s = _apply(s, var, {key: environ[var]})
    for k2 in ("ttft_ms", "tpot_ms"):
        var = f"CALCONSOLE_SLO_{k2.upper()}"
        if var in environ:
            s = _apply(s, var, {"slo": {k2: environ[var]}})
    for name in DEFAULT_THRESHOLDS:
        var = f"CALCONSOLE_THRESHOLD_{name.upper()}"
        if var in environ:
            s = _apply(s, var, {"thresholds": {name: environ[var]}})
    return s


def to_data(s: Settings) -> dict[str, Any]:
    """The file form of ``s`` (what ``save_settings`` writes)."""
    data: dict[str, Any] = {"layout": s.layout, "history_window_s": s.history_window_s, "theme": s.theme,
                            "compact": s.compact, "panes": s.panes,
                            "slo": {"ttft_ms": s.slo_ttft_ms, "tpot_ms": s.slo_tpot_ms},
                            "thresholds": {k: {"warn": t.warn, "crit": t.crit} for k, t in s.thresholds.items()},
                            "sections": sections_data(s)}
    if s.refresh_hz is not None:
        data["refresh_hz"] = s.refresh_hz
    if s.audit_log is not None:
        data["audit_log"] = s.audit_log
    return data


def sections_data(s: Settings) -> dict[str, Any]:
    """The file form of the observation pane's arrangement."""
    return {"order": list(s.section_order), "folded": list(s.sections_folded), "focus": s.section_focus}


def save_sections(s: Settings, path: Path | None = None) -> Path:
    """Write only the ``sections`` key into the settings file, the file's other keys kept as they are there
    (not as the console runs: an arrangement change does not save a theme tried out). Raises OSError, or
    SettingsError if the file has become unreadable since start-up (then nothing is written)."""
    path = path or s.path or settings_path()
    data: dict[str, Any] = {}
    if path.exists():
        try:
            loaded = safe_yaml.load(path.read_text(encoding="utf-8"), aliases=False, what="a settings file")
        except (yaml.YAMLError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            raise SettingsError(str(path), "(file)", f"not rewritten, it no longer reads: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise SettingsError(str(path), "(file)", "not rewritten, it is not a mapping of settings")
        data = dict(loaded or {})
    data["sections"] = sections_data(s)
    return _write(path, data)


def _write(path: Path, data: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("# calconsole settings (calconsole --help lists the CALCONSOLE_* overrides)\n"
                   + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)
    return path


def save_settings(s: Settings, path: Path | None = None) -> Path:
    """Write ``s`` as YAML (atomically: a temporary file renamed over it). Returns the path; OSError on failure."""
    return _write(path or s.path or settings_path(), to_data(s))
