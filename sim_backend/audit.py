"""Append-only audit log of maintenance calls (JSON lines).

Every maintenance call, granted or refused, is written with aiofiles,
flushed and fsync'd before the action is reported done. An action writes a
``started`` record before it runs and a ``finished`` record after, so a crash
in the middle leaves a log showing the action began and did not end.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiofiles
import platformdirs


def default_audit_path() -> Path:
    """``$CALCONSOLE_AUDIT_LOG`` or ``<user state dir>/calconsole/audit.jsonl``."""
    env = os.environ.get("CALCONSOLE_AUDIT_LOG")
    if env:
        return Path(env)
    return Path(platformdirs.user_state_dir("calconsole")) / "audit.jsonl"


def _os_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return str(os.getuid()) if hasattr(os, "getuid") else "unknown"


class AuditLog:
    """JSON-lines audit log at ``path`` (created with parents on first write)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_audit_path()
        self._lock = threading.Lock()
        self.user = _os_user()

    async def _append_async(self, line: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        async with aiofiles.open(self.path, "a", encoding="utf-8") as f:
            await f.write(line)
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write one record (adds time, user, pid) durably; returns it. Safe from any thread."""
        rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unix_s": round(time.time(), 6),
               "user": self.user, "pid": os.getpid(), **record}
        line = json.dumps(rec, default=str, ensure_ascii=False) + "\n"
        with self._lock:
            try:
                asyncio.get_running_loop()
                running = True
            except RuntimeError:
                running = False
            if running:
                # called on an event loop thread: run the async write on a private loop in a helper thread
                t = threading.Thread(target=lambda: asyncio.run(self._append_async(line)))
                t.start()
                t.join()
            else:
                asyncio.run(self._append_async(line))
        return rec

    def start(self, action: str, args: dict[str, Any]) -> str:
        """Record that ``action`` started; returns the action id to pass to ``finish``."""
        aid = uuid.uuid4().hex[:12]
        self.append({"id": aid, "phase": "started", "action": action, "args": args})
        return aid

    def finish(self, aid: str, action: str, args: dict[str, Any], *, granted: bool, ok: bool, result: Any,
               duration_ms: float, sim_ms: float | None = None, **extra: Any) -> dict[str, Any]:
        """Record the outcome of ``aid``. ``duration_ms``: host wall ms; ``sim_ms``: simulated device ms."""
        rec = {"id": aid, "phase": "finished", "action": action, "args": args, "granted": granted,
               "ok": ok, "result": result, "duration_ms": round(duration_ms, 3)}
        if sim_ms is not None:
            rec["sim_ms"] = round(sim_ms, 3)
        return self.append({**rec, **extra})

    def event(self, action: str, args: dict[str, Any], *, granted: bool, ok: bool, result: Any,
              duration_ms: float, sim_ms: float | None = None) -> dict[str, Any]:
        """A one-record entry (e.g. a drill step that is not itself a maintenance call)."""
        return self.append({"id": uuid.uuid4().hex[:12], "phase": "event", "action": action, "args": args,
                            "granted": granted, "ok": ok, "result": result, "duration_ms": round(duration_ms, 3),
                            **({"sim_ms": round(sim_ms, 3)} if sim_ms is not None else {})})

    def entries(self) -> list[dict[str, Any]]:
        """``summarize(self.read())``: one entry per action, oldest first."""
        return summarize(self.read())

    def read(self) -> list[dict[str, Any]]:
        """All records, oldest first; unreadable lines are returned as {"corrupt": line}."""
        if not self.path.exists():
            return []
        out = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    out.append({"corrupt": line})
        return out


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Pair ``started`` and ``finished`` records by id: one entry per action, in start order.

    Each entry: {"id", "time", "user", "pid", "action", "args", "status", "granted", "ok",
    "result", "duration_ms", "sim_ms"} where ``status`` is ``granted`` / ``refused`` /
    ``failed`` (granted, not ok) / ``did not finish`` (a started record with no finished
    one: the process crashed or was killed mid-action, or the action is still running) /
    ``corrupt`` (an unreadable line).
    """
    out: list[dict[str, Any]] = []
    by_id: dict[str, dict[str, Any]] = {}
    for rec in records:
        if "corrupt" in rec:
            out.append({"id": None, "time": "", "user": "", "pid": None, "action": "?", "args": {},
                        "status": "corrupt", "granted": None, "ok": None, "result": rec["corrupt"][:200],
                        "duration_ms": None, "sim_ms": None})
            continue
        phase = rec.get("phase")
        if phase in ("started", "event") or rec.get("id") not in by_id:
            e = {"id": rec.get("id"), "time": rec.get("time", ""), "user": rec.get("user", ""),
                 "pid": rec.get("pid"), "action": rec.get("action", "?"), "args": rec.get("args", {}),
                 "status": "did not finish", "granted": None, "ok": None, "result": None, "duration_ms": None,
                 "sim_ms": None}
            out.append(e)
            if rec.get("id") is not None:
                by_id[rec["id"]] = e
        else:
            e = by_id[rec["id"]]
        if phase in ("finished", "event"):
            granted, ok = rec.get("granted"), rec.get("ok")
            e.update(granted=granted, ok=ok, result=rec.get("result"), duration_ms=rec.get("duration_ms"),
                     sim_ms=rec.get("sim_ms"),
                     status="refused" if granted is False else ("granted" if ok else "failed"))
            if phase == "event":
                e["status"] = "ok" if ok else "not as expected"
    return out
