"""API and admin keys: where they come from, how they are compared, how they are named in logs.

A key is never logged, printed or audited: records carry its *label* (``api-1``, ``admin-1`` or the
label given in the key file). Keys are compared in constant time (``hmac.compare_digest`` over
SHA-256 digests, every key checked, no early exit), so the time a refusal takes says nothing
about how much of a key was right.

Sources, first found wins: the ``--api-key`` / ``--admin-key`` flag (visible in ``ps``: the
file and the environment are preferred), ``--api-key-file`` / ``--admin-key-file``, then the
environment variables ``CALCONSOLE_API_KEY`` / ``CALCONSOLE_ADMIN_KEY``.

Presented as ``Authorization: Bearer KEY`` or as ``X-Api-Key: KEY`` (llama-server accepts both; when
both are sent, ``Authorization`` decides: a non-Bearer scheme there is refused, not passed over).

Key file format (llama-server's ``--api-key-file``: one key per line), optionally labelled:
``KEY`` or ``LABEL KEY``; blank lines and ``#`` comments are skipped. A key file readable by
other users is refused, as ssh refuses such a private key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from dataclasses import dataclass
from pathlib import Path

ENV_API_KEY = "CALCONSOLE_API_KEY"
ENV_ADMIN_KEY = "CALCONSOLE_ADMIN_KEY"
MIN_KEY_CHARS = 8
MAX_KEY_FILE_BYTES = 64 * 1024


class KeySourceError(ValueError):
    """A key source is unusable (message names the file or option, never the key)."""


@dataclass(frozen=True)
class _Key:
    label: str
    digest: bytes


class KeyRing:
    """A set of labelled keys. ``match(presented)`` returns the label or None, in constant time."""

    def __init__(self, keys: list[tuple[str, str]], kind: str) -> None:
        if not keys:
            raise KeySourceError(f"no {kind} key given")
        labels = [label for label, _ in keys]
        if len(set(labels)) != len(labels):
            raise KeySourceError(f"{kind} key labels must be distinct")
        for label, key in keys:
            if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key) or not key.isprintable():
                raise KeySourceError(f"{kind} key '{label}' must be at least {MIN_KEY_CHARS} printable characters "
                                f"without spaces")
        self.kind = kind
        self._keys = tuple(_Key(label, hashlib.sha256(key.encode()).digest()) for label, key in keys)

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(k.label for k in self._keys)

    def match(self, presented: str | None) -> str | None:
        """The label of the key equal to ``presented``, or None. Every key is compared (no early exit)."""
        digest = hashlib.sha256((presented or "").encode("utf-8", "surrogatepass")).digest()
        found: str | None = None
        for k in self._keys:
            if hmac.compare_digest(digest, k.digest) and presented:
                found = k.label
        return found

    def shares_a_key_with(self, other: KeyRing) -> bool:
        """True if any key is in both rings (an API key must never open maintenance routes)."""
        mine = {k.digest for k in self._keys}
        return any(k.digest in mine for k in other._keys)


def parse_key_file(path: str | Path, kind: str) -> list[tuple[str, str]]:
    """(label, key) pairs of a key file; KeySourceError naming the file and line for a bad one."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise KeySourceError(f"{kind} key file {p}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeySourceError(f"{kind} key file {p}: not a regular file")
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH | stat.S_IWGRP | stat.S_IWOTH):
        raise KeySourceError(f"{kind} key file {p} is readable or writable by other users "
                        f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
    if st.st_size > MAX_KEY_FILE_BYTES:
        raise KeySourceError(f"{kind} key file {p} is {st.st_size} bytes; a key file is at most {MAX_KEY_FILE_BYTES}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeySourceError(f"{kind} key file {p}: cannot read it ({type(e).__name__})") from None
    out: list[tuple[str, str]] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) == 1:
            out.append((f"{kind}-{len(out) + 1}", parts[0]))
        elif len(parts) == 2:
            out.append((parts[0], parts[1]))
        else:
            raise KeySourceError(f"{kind} key file {p}, line {n}: expected 'KEY' or 'LABEL KEY'")
    if not out:
        raise KeySourceError(f"{kind} key file {p} holds no key")
    return out


def load_keys(kind: str, *, key: str | None = None, key_file: str | Path | None = None,
              env: dict[str, str] | None = None) -> KeyRing | None:
    """The ``kind`` ("api" or "admin") keys from flag, file or environment; None if none is given.

    Raises KeySourceError (a clear one-line reason) for an unusable source or key.
    """
    environ = os.environ if env is None else env
    var = ENV_API_KEY if kind == "api" else ENV_ADMIN_KEY
    if key is not None and key_file is not None:
        raise KeySourceError(f"give --{kind}-key or --{kind}-key-file, not both")
    if key is not None:
        return KeyRing([(f"{kind}-1", key)], kind)
    if key_file is not None:
        return KeyRing(parse_key_file(key_file, kind), kind)
    if environ.get(var):
        return KeyRing([(f"{kind}-env", environ[var])], kind)
    return None
