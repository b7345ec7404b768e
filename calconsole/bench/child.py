"""A ``calconsole serve --timing-only`` child process of a bench, on 127.0.0.1 with an ephemeral port.

Its stderr (the "listening" line, the access log, any traceback) goes to a file in a temporary directory, never
to a pipe: a pipe nobody drains fills (64 KiB, ~700 access-log lines) and then blocks every log write of the
server, its event loop included. The file is read for the listening line, for the tracebacks a bench counts,
and for the last lines shown when the server fails to start.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)")


@dataclass
class ServeChild:
    """A running child server: its ``url``, its admin key (``Authorization: Bearer``), its log file."""

    proc: subprocess.Popen[bytes]
    url: str
    port: int
    admin_key: str
    log_path: str

    def log_text(self) -> str:
        """The server's stderr so far (UTF-8, undecodable bytes replaced)."""
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")

    def tail(self, n: int = 20) -> str:
        """The last ``n`` lines of the server's stderr."""
        return "\n".join(self.log_text().splitlines()[-n:])

    def tracebacks(self) -> int:
        """Tracebacks the server logged so far (lines starting ``Traceback``)."""
        return sum(1 for ln in self.log_text().splitlines() if ln.startswith("Traceback"))


def _limit_files(n: int) -> None:
    """In the child before exec: its soft file limit ``n`` (the connection cap follows it, ``conns.ConnLimits``)."""
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n if hard == resource.RLIM_INFINITY else min(n, hard), hard))


@contextlib.contextmanager
def serve_child(extra_args: Sequence[str] = (), *, nofile: int | None = None,
                start_timeout_s: float = 120.0) -> Iterator[ServeChild]:
    """A child ``calconsole serve --timing-only --pacing fast --port 0`` with an admin key (a 0600 file) and an
    audit log in a temporary directory; ``nofile``: its soft file limit (None: inherited). Stopped (SIGTERM,
    then SIGKILL after 15 s) on exit. RuntimeError, with the last lines of its stderr, if it exits or does not
    say it listens within ``start_timeout_s`` host s."""
    key = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="calconsole-bench-") as d:
        kf = os.path.join(d, "admin.keys")
        fd = os.open(kf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"bench {key}\n")
        log_path = os.path.join(d, "server.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("CALCONSOLE_")}
        env["CALCONSOLE_AUDIT_LOG"] = os.path.join(d, "audit.jsonl")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "calconsole", "serve", "--port", "0", "--timing-only", "--pacing", "fast",
                 "--admin-key-file", kf, *extra_args],
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                preexec_fn=(lambda: _limit_files(nofile)) if nofile is not None else None)
        child = ServeChild(proc, "", 0, key, log_path)
        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                m = _LISTENING.search(child.log_text())
                if m:
                    child.port = int(m.group(1))
                    child.url = f"http://127.0.0.1:{child.port}"
                    break
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {proc.returncode}; its last lines:\n{child.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not say it listens within {start_timeout_s:g} s; "
                                       f"its last lines:\n{child.tail()}")
                time.sleep(0.1)  # polling the child's log file for its listening line
            yield child
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
