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
               duration_ms: float) -> dict[str, Any]:
        return self.append({"id": aid, "phase": "finished", "action": action, "args": args, "granted": granted,
                            "ok": ok, "result": result, "duration_ms": round(duration_ms, 3)})

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
