"""Append-only audit log of maintenance calls (JSON lines).

Every maintenance call, granted or refused, is written with aiofiles,
flushed and fsync'd before the action is reported done.

The log has a size cap: an append that would take the file past ``max_bytes`` first renames it
to ``<path>.1`` (``.1`` to ``.2`` ... up to ``backups`` files; the oldest is dropped), as
logrotate and Python's ``RotatingFileHandler`` do, so the log's disk use is bounded by
``(backups + 1) x max_bytes``. ``tail(n)`` reads the newest entries from the end of the file
(and of the rotated files, as far as it needs) without reading or parsing the rest. An action writes a
``started`` record before it runs and a ``finished`` record after, so a crash
in the middle leaves a log showing the action began and did not end.

Lines are ASCII JSON (non-ASCII escaped), so a line torn by a crash never
splits a multi-byte character; a writer that finds the file not ending in a
newline (a torn last line) starts a fresh line, so the torn line stays one
corrupt line and the next record is intact. The reader never fails on a
damaged log: every unreadable line is returned as a corrupt record and the
rest is still read.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import getpass
import json
import os
import stat
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import aiofiles
import platformdirs
import psutil

from sim_backend.errors import CalError

PHASES = ("started", "finished", "event")
MAX_DEPTH = 32  # JSON nesting a record may have (real records nest 3 levels)
MAX_LINE_BYTES = 1 << 20  # a longer line is corrupt; the reader never holds more than this of it
DEFAULT_MAX_BYTES = 32 << 20  # one log file; an append past it rotates (module docstring)
DEFAULT_BACKUPS = 3  # rotated files kept: <path>.1 (newest) .. <path>.3
TAIL_BLOCK_BYTES = 64 << 10  # the tail reader reads backwards in blocks of this size
CORRUPT_TEXT_CHARS = 1000  # how much of a corrupt line is kept


class AuditLogError(CalError, OSError):
    """The audit log cannot be used: ``path`` (Path) and ``reason`` (str). Also an OSError,
    so callers that handle a failed write keep working."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"audit log {path}: {reason}")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


# Kernel pseudo-filesystems: a "file" there is a kernel interface, not storage. Root may
# open /proc/self/status for writing and only the write fails (EINVAL), so the type of the
# mount is checked, not just the open.
PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
    "configfs", "pstore", "efivarfs", "bpf", "fusectl", "mqueue", "binfmt_misc", "autofs", "nsfs",
    "rpc_pipefs", "hugetlbfs",
})


def pseudo_filesystem(path: str | Path) -> tuple[str, str] | None:
    """``(fstype, mount point)`` if ``path`` (symlinks resolved; it need not exist) lies on a
    kernel pseudo-filesystem (``PSEUDO_FILESYSTEMS``: /proc, /sys, /dev, cgroups, ...), else None.
    None too when the mount table cannot be read (the write probe still runs)."""
    real = os.path.realpath(path)
    try:
        parts = psutil.disk_partitions(all=True)
    except Exception:  # noqa: BLE001 - no mount table on this platform: rely on the probe write
        return None
    best: tuple[str, str] | None = None
    for part in parts:  # the deepest mount point holding the path; a later entry is mounted on top
        mp = part.mountpoint
        if real == mp or real.startswith(mp.rstrip("/") + "/"):
            if best is None or len(mp) >= len(best[1]):
                best = (part.fstype, mp)
    return best if best is not None and best[0] in PSEUDO_FILESYSTEMS else None


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


#: Who is calling, for records written while it is set: {"remote": "host:port", "key": label, "via": "http"}.
#: Set by the HTTP serving face around each maintenance call (never holds a key, only its label).
_ORIGIN: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("audit_origin", default=None)


@contextlib.contextmanager
def audit_origin(origin: dict[str, Any]) -> Any:
    """Records appended inside this block (in this thread/context) carry ``"origin": origin``."""
    token = _ORIGIN.set(dict(origin))
    try:
        yield
    finally:
        _ORIGIN.reset(token)


class AuditLog:
    """JSON-lines audit log at ``path`` (created with parents on first write)."""

    def __init__(self, path: str | Path | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 backups: int = DEFAULT_BACKUPS) -> None:
        if max_bytes < 4096 or not 0 <= backups <= 100:
            raise ValueError(f"audit log: max_bytes must be >= 4096 and backups in 0..100, got {max_bytes}, {backups}")
        self.path = Path(path) if path is not None else default_audit_path()
        self.max_bytes = max_bytes
        self.backups = backups
        self.rotations = 0
        self._lock = threading.Lock()
        self.user = _os_user()

    def rotated_paths(self) -> list[Path]:
        """The rotated files that exist, newest first (``<path>.1``, ``<path>.2``, ...)."""
        out = []
        for i in range(1, self.backups + 1):
            p = self.path.with_name(f"{self.path.name}.{i}")
            if not p.exists():
                break
            out.append(p)
        return out

    def _rotate_if_needed(self, incoming: int) -> None:
        """Rename the log away if ``incoming`` more bytes would take it past ``max_bytes`` (lock held)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return  # missing: the append creates it
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or st.st_size + incoming <= self.max_bytes:
            return
        if self.backups == 0:
            os.truncate(self.path, 0)
        else:
            name = self.path.name
            for i in range(self.backups - 1, 0, -1):
                src = self.path.with_name(f"{name}.{i}")
                if src.exists():
                    os.replace(src, self.path.with_name(f"{name}.{i + 1}"))
            os.replace(self.path, self.path.with_name(f"{name}.1"))
        self.rotations += 1

    def _refuse_special(self) -> None:
        # opening a FIFO or device could block or write somewhere else entirely
        try:
            st = os.stat(self.path)
        except OSError:
            return  # missing, or a parent is not a directory: the open reports it
        if not stat.S_ISREG(st.st_mode):
            raise AuditLogError(self.path, f"is {_kind(st.st_mode)}, not a regular file")

    def check_writable(self) -> None:
        """Raise AuditLogError with the reason unless records can be appended to ``path``.

        Creates nothing: a missing log (and missing parent directories) is created by the first
        record written (``append``), so a command refused or failing after the check leaves no
        trace on disk. A missing log is accepted when its nearest existing ancestor is a
        directory this process may create entries in (``os.access`` W_OK | X_OK, which also
        says no on a read-only mount). Never blocks (a FIFO is refused, not opened for writing).
        Refuses a path on a kernel pseudo-filesystem (``pseudo_filesystem``: /proc, /sys,
        /dev, ...); an existing log gets a zero-length probe write through the opened file
        (changes nothing in a regular file; fails where writes would, e.g. EINVAL on a /proc
        file that root can open).
        """
        self._refuse_special()
        pseudo = pseudo_filesystem(self.path)
        if pseudo is not None:
            raise AuditLogError(self.path, f"not writable: on the {pseudo[0]} pseudo-filesystem (mounted at "
                                           f"{pseudo[1]}), which holds kernel interfaces, not files")
        if not os.path.lexists(self.path):
            anc = self.path.parent
            while not anc.exists() and anc != anc.parent:
                anc = anc.parent
            if not anc.is_dir():  # mkdir would say "File exists", which misleads
                raise AuditLogError(self.path, f"not writable: {anc} is not a directory")
            if not os.access(anc, os.W_OK | os.X_OK):
                what = "directory" if anc == self.path.parent else "nearest existing directory"
                raise AuditLogError(self.path, f"not writable: the {what} {anc} does not allow creating files "
                                               "in it (permission denied or a read-only file system)")
            return
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
        except OSError as e:
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(self.path) else ""
            raise AuditLogError(self.path, f"not writable: {e.strerror or e}{where}") from None
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISREG(mode):
                os.write(fd, b"")  # the probe: O_APPEND, zero bytes
        except OSError as e:
            raise AuditLogError(self.path, f"not writable: a probe write failed: {e.strerror or e}") from None
        finally:
            os.close(fd)
        if not stat.S_ISREG(mode):
            raise AuditLogError(self.path, f"is {_kind(mode)}, not a regular file")

    def create(self) -> None:
        """Create the log (an empty regular file, and its missing directories) if it is missing, then
        ``check_writable``: a server that keeps the log for hours shows it from its start, and the
        probe write then proves the very file its records will go to. An existing log is left as is.
        Raises AuditLogError with the reason (as ``check_writable``)."""
        self.check_writable()  # refuses FIFOs, devices and pseudo-filesystems before anything is created
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # mode as the first append makes it (umask applies)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666)
        except OSError as e:
            raise AuditLogError(self.path, f"not writable: cannot create it: {e.strerror or e}") from None
        os.close(fd)
        self.check_writable()

    async def _append_async(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._refuse_special()
        async with aiofiles.open(self.path, "a+b") as f:
            end = await f.seek(0, os.SEEK_END)
            if end:
                await f.seek(end - 1)
                if await f.read(1) != b"\n":
                    data = b"\n" + data  # a torn last line: keep it apart from this record
            await f.write(data)  # O_APPEND: at the end whatever the read position
            await f.flush()
            await asyncio.to_thread(os.fsync, f.fileno())

    def append(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write one record (adds time, user, pid) durably; returns it. Safe from any thread."""
        rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "unix_s": round(time.time(), 6),
               "user": self.user, "pid": os.getpid(), **record}
        origin = _ORIGIN.get()
        if origin is not None and "origin" not in rec:
            rec["origin"] = origin
        # ASCII only: a line torn by a crash can never end inside a multi-byte character
        line = (json.dumps(rec, default=str, ensure_ascii=True) + "\n").encode("ascii")
        with self._lock:
            self._rotate_if_needed(len(line))
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

    def entries(self, limit: int | None = None) -> list[dict[str, Any]]:
        """One entry per action, oldest first: ``summarize(self.read())``, or with ``limit`` the last
        ``limit`` entries, read from the end (``tail``)."""
        if limit is None:
            return summarize(self.read())
        return self.tail(limit)[0]

    def tail(self, n: int) -> tuple[list[dict[str, Any]], bool]:
        """(the last ``n`` entries oldest first, whether older ones exist), read from the end of the log
        and of its rotated files as far as needed; the cost is that of the entries read, not of the log.

        An action whose ``started`` record lies beyond the window is an entry of its ``finished``
        record alone (which repeats the action, arguments, user and time). Corrupt lines are corrupt
        entries, as in ``read`` (without a line number: the tail does not count the lines before it).
        Raises ValueError for n < 1, AuditLogError / OSError as ``read``.
        """
        entries, _records, more = self.tail_read(n)
        return entries, more

    def tail_read(self, n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]], bool]:
        """``tail`` with the records it read: (last ``n`` entries, the records read, older ones exist)."""
        if n < 1:
            raise ValueError(f"tail: n must be >= 1, got {n}")
        want = 2 * n + 8  # records: a finished action is two
        while True:
            records, more = self.tail_records(want)
            entries = summarize(records)
            if len(entries) > n or not more:
                return entries[-n:], records, more or len(entries) > n
            want *= 4

    def tail_records(self, n: int) -> tuple[list[dict[str, Any]], bool]:
        """(the last ``n`` records oldest first, whether older records exist): the current file first,
        then the rotated ones, newest first, until ``n`` are read. Records as ``read`` gives them."""
        out: list[dict[str, Any]] = []
        files = [self.path, *self.rotated_paths()]
        for i, p in enumerate(files):
            got, more = _tail_file(p, n - len(out))
            out[:0] = got
            if len(out) >= n:
                return out, more or i < len(files) - 1
        return out, False

    def read_all(self) -> list[dict[str, Any]]:
        """``read`` of the rotated files, oldest first, then of the log: every record kept."""
        out: list[dict[str, Any]] = []
        for p in reversed(self.rotated_paths()):
            out.extend(AuditLog(p).read())
        return out + self.read()

    def read(self) -> list[dict[str, Any]]:
        """All records of the log file (not of its rotated files: ``read_all``), oldest first.
        Never fails on a damaged log.

        Each unreadable line (not UTF-8, not JSON, not a JSON object, nested deeper than
        MAX_DEPTH, longer than MAX_LINE_BYTES, no valid ``id``/``phase``/``action``) is
        returned as ``{"corrupt": text, "line": n, "reason": why}`` (``text``: at most
        CORRUPT_TEXT_CHARS characters, undecodable bytes as ``\\xNN``; ``line``: 1-based)
        and the rest of the log is still read. A missing file is an empty log.

        Raises AuditLogError if ``path`` is not a regular file (a FIFO is refused without
        blocking), OSError if it cannot be read.
        """
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return []
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise AuditLogError(self.path, f"is {_kind(mode)}, not a regular file")
        except BaseException:
            os.close(fd)
            raise
        out = []
        with os.fdopen(fd, "rb") as f:
            n = 0
            while True:
                raw = f.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    break
                n += 1
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    while (more := f.readline(MAX_LINE_BYTES)) and not more.endswith(b"\n"):
                        pass  # skip the rest of the over-long line without holding it
                    out.append(_corrupt(raw, n, f"line longer than {MAX_LINE_BYTES} bytes"))
                    continue
                raw = raw.strip()
                if raw:
                    out.append(parse_line(raw, n))
        return out


def _tail_file(path: Path, n: int) -> tuple[list[dict[str, Any]], bool]:
    """The last ``n`` records of one file, oldest first, and whether lines remain before them.

    Reads backwards in TAIL_BLOCK_BYTES blocks; never holds more than MAX_LINE_BYTES of one line
    (a longer line is one corrupt record). A missing file has no records.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return [], False
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise AuditLogError(path, f"is {_kind(mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        pos = f.seek(0, os.SEEK_END)
        lines: list[dict[str, Any]] = []
        partial = b""  # the start of the line being read (its end is already in ``partial``)
        overlong = False
        while pos > 0 and len(lines) < n:
            step = min(TAIL_BLOCK_BYTES, pos)
            pos -= step
            f.seek(pos)
            block = f.read(step)
            parts = block.split(b"\n")
            # parts[-1] continues the line after this block; parts[0] may continue before it
            parts[-1] += partial
            for i in range(len(parts) - 1, 0, -1):
                raw = parts[i]
                if overlong:
                    lines.append(_corrupt(raw[:MAX_LINE_BYTES], 0, f"line longer than {MAX_LINE_BYTES} bytes"))
                    overlong = False
                elif raw.strip():
                    lines.append(parse_line(raw.strip(), 0))
                if len(lines) >= n:
                    return lines[::-1], pos > 0 or any(q.strip() for q in parts[:i])
            partial = parts[0]
            if len(partial) > MAX_LINE_BYTES:
                partial, overlong = partial[:MAX_LINE_BYTES], True
        if len(lines) < n and (partial.strip() or overlong):
            if overlong:
                lines.append(_corrupt(partial, 0, f"line longer than {MAX_LINE_BYTES} bytes"))
            else:
                lines.append(parse_line(partial.strip(), 0))
            partial = b""
        return lines[::-1], pos > 0 or bool(partial.strip())


def _corrupt(raw: bytes, n: int, reason: str) -> dict[str, Any]:
    text = raw[: CORRUPT_TEXT_CHARS * 4].decode("utf-8", errors="backslashreplace")[:CORRUPT_TEXT_CHARS]
    return {"corrupt": text, "line": n, "reason": reason}


def _too_deep(obj: Any, limit: int) -> bool:
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > limit:
                return True
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return False


def parse_line(raw: bytes, n: int = 0) -> dict[str, Any]:
    """One log line (bytes, no newline) -> its record, or a corrupt record (see ``AuditLog.read``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return _corrupt(raw, n, f"not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})")
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        return _corrupt(raw, n, f"not JSON: {e.msg} (column {e.colno})")
    except RecursionError:
        return _corrupt(raw, n, f"JSON nested deeper than {MAX_DEPTH} levels")
    if not isinstance(rec, dict):
        return _corrupt(raw, n, f"JSON {type(rec).__name__}, not an audit record (an object)")
    if _too_deep(rec, MAX_DEPTH):
        return _corrupt(raw, n, f"JSON nested deeper than {MAX_DEPTH} levels")
    for key, ok in (("phase", rec.get("phase") in PHASES), ("id", isinstance(rec.get("id"), str)),
                    ("action", isinstance(rec.get("action"), str))):
        if not ok:
            return _corrupt(raw, n, f"not an audit record (field {key!r} is {rec.get(key)!r:.40})")
    return rec


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _flag(v: Any) -> bool | None:
    return v if isinstance(v, bool) else None


def summarize(records: list[Any]) -> list[dict[str, Any]]:
    """Pair ``started`` and ``finished`` records by id: one entry per action, in start order.

    Each entry: {"id", "time", "user", "pid", "action", "args", "status", "granted", "ok",
    "result", "duration_ms", "sim_ms"} where ``status`` is ``granted`` / ``refused`` /
    ``failed`` (granted, not ok) / ``not run`` (granted, but its result says ``"ran": false``:
    it cannot run on this device now, e.g. a self-test on a timing-only device) /
    ``did not finish`` (a started record with no finished
    one: the process crashed or was killed mid-action, or the action is still running) /
    ``corrupt`` (an unreadable line; ``result`` says which line and why, then its text).

    Entries are well typed whatever the records hold: ``time``, ``user``, ``action`` and
    ``status`` are str; ``args`` a dict; ``duration_ms`` / ``sim_ms`` (host wall ms /
    simulated ms) float or None; ``granted`` / ``ok`` bool or None; ``pid`` int or None.
    Anything in ``records`` that is not a valid record (see ``parse_line``) becomes a
    corrupt entry.
    """
    out: list[dict[str, Any]] = []
    by_id: dict[str, dict[str, Any]] = {}
    for rec in records:
        if isinstance(rec, dict) and "corrupt" in rec and "phase" not in rec:
            where = f"line {rec['line']}: " if isinstance(rec.get("line"), int) and rec["line"] > 0 else ""
            why = f"{rec['reason']}: " if isinstance(rec.get("reason"), str) else ""
            out.append({"id": None, "time": "", "user": "", "pid": None, "action": "?", "args": {},
                        "status": "corrupt", "granted": None, "ok": None,
                        "result": (where + why + str(rec["corrupt"]))[:200], "duration_ms": None, "sim_ms": None})
            continue
        if not isinstance(rec, dict) or rec.get("phase") not in PHASES or not isinstance(rec.get("id"), str) \
                or not isinstance(rec.get("action"), str):
            out.extend(summarize([{"corrupt": repr(rec)[:CORRUPT_TEXT_CHARS], "reason": "not an audit record"}]))
            continue
        phase, rid = rec["phase"], rec["id"]
        if phase in ("started", "event") or rid not in by_id:
            args = rec.get("args", {})
            pid = rec.get("pid")
            e = {"id": rid, "time": str(rec.get("time", "")), "user": str(rec.get("user", "")),
                 "pid": pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                 "action": rec["action"], "args": args if isinstance(args, dict) else {"args": args},
                 "status": "did not finish", "granted": None, "ok": None, "result": None, "duration_ms": None,
                 "sim_ms": None, "origin": rec["origin"] if isinstance(rec.get("origin"), dict) else None}
            out.append(e)
            by_id[rid] = e
        else:
            e = by_id[rid]
        if phase in ("finished", "event"):
            granted, ok = _flag(rec.get("granted")), _flag(rec.get("ok"))
            e.update(granted=granted, ok=ok, result=rec.get("result"), duration_ms=_num(rec.get("duration_ms")),
                     sim_ms=_num(rec.get("sim_ms")),
                     status="refused" if granted is False else ("granted" if ok else "failed"))
            res = rec.get("result")
            if granted and isinstance(res, dict) and res.get("ran") is False:
                e["status"] = "not run"  # granted, but it cannot run on this device now (no failure)
            # an event refused and not ok is a refusal (the serving face's); a drill step refused as
            # expected is ok
            if phase == "event" and not (granted is False and not ok):
                e["status"] = "ok" if ok else "not as expected"
    return out
