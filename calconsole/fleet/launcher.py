"""``calconsole serve --boards N``: N isolated simulator processes on consecutive loopback ports, for trials.

Each board is its own ``calconsole serve`` process (the runtime drives one device per process, facts.md F1),
with its own audit log ``<dir>/<name>.audit.jsonl`` and the same options otherwise. The launcher waits
until every board prints its ``listening on`` line (bounded), writes a fleet file naming them (so
``calconsole --fleet FILE`` opens them all), and then waits; SIGINT or SIGTERM stops every board
(SIGTERM, then SIGKILL after ``STOP_GRACE_S``). A board that exits by itself is reported and the others keep
serving: that is what the fleet view is for.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import yaml

MAX_BOARDS = 64
START_TIMEOUT_S = 180.0  # host s for every board to listen (N imports share 2 cores)
STOP_GRACE_S = 10.0
_LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass
class Board:
    """One launched board: its name, process, URL (once listening) and audit log path."""

    name: str
    proc: subprocess.Popen[bytes]
    audit_log: Path
    url: str | None = None


def board_command(args: argparse.Namespace, port: int, audit_log: Path) -> list[str]:
    """The ``calconsole serve`` command line of one board: the launcher's own options, its port and log.

    Keys are passed as the same key files (or the environment), never on the command line."""
    cmd = [sys.executable, "-m", "calconsole", "serve", "--host", args.host, "--port", str(port),
           "--audit-log", str(audit_log), "--pacing", args.pacing, "--speed", repr(args.speed),
           "--slots", str(args.slots), "--host-time", args.host_time,
           "--max-streams", str(args.max_streams), "--queue-limit", str(args.queue_limit),
           "-n", str(args.n_predict)]
    # the launcher's optional serve options, passed on only where given (None: the board's own default)
    for opt, key in (("--alias", "alias"), ("--tags", "tags"), ("--ctx-size", "ctx_size"), ("--seed", "seed"),
                     ("--cors-origins", "cors_origins"), ("--chat-template-file", "chat_template_file"),
                     ("--chat-template", "chat_template"), ("--chat-template-kwargs", "chat_template_kwargs"),
                     ("--reasoning", "reasoning"), ("--batch-size", "batch_size")):
        v = getattr(args, key, None)
        if v not in (None, ""):
            cmd += [opt, str(v)]
    if args.bundle:
        cmd += ["--bundle", args.bundle]
    if args.timing_only:
        cmd.append("--timing-only")
    if args.numeric_limit is not None:
        cmd += ["--numeric-limit", str(args.numeric_limit)]
    if args.api_key_file:
        cmd += ["--api-key-file", args.api_key_file]
    if args.admin_key_file:
        cmd += ["--admin-key-file", args.admin_key_file]
    if getattr(args, "jinja", False):
        cmd.append("--jinja")
    if getattr(args, "context_shift", None) is not None:
        cmd.append("--context-shift" if args.context_shift else "--no-context-shift")
    if getattr(args, "spm_infill", False):
        cmd.append("--spm-infill")
    if getattr(args, "no_metrics", False):
        cmd.append("--no-metrics")
    if getattr(args, "no_slots_endpoint", False):
        cmd.append("--no-slots-endpoint")
    return cmd


_SAY_LOCK = threading.Lock()


def _say(text: str, *, out: Any) -> None:
    """One whole line on ``out`` from any thread: ``print`` writes the text and its newline apart, so two
    boards' reader threads glued lines ("...startup complete.calconsole serve --boards: ...")."""
    with _SAY_LOCK:
        out.write(text + "\n")
        out.flush()


def _reader(board: Board, ready: threading.Event, out: TextIO) -> None:
    """Forward a board's stderr, prefixed with its name, and note its URL when it starts listening."""
    assert board.proc.stderr is not None
    for raw in board.proc.stderr:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        m = _LISTENING.search(line)
        if m and board.url is None:
            board.url = m.group(1)
            ready.set()
        _say(f"[{board.name}] {line}", out=out)
    ready.set()  # exited: nothing more to wait for


def launch(args: argparse.Namespace, *, out: TextIO = sys.stderr) -> int:
    """Run ``args.boards`` boards until a signal; returns the exit code (0 after a clean stop)."""
    n = args.boards
    if not 1 <= n <= MAX_BOARDS:
        print(f"calconsole: error: --boards must be in 1..{MAX_BOARDS}, got {n}", file=sys.stderr)
        return 2
    if args.port != 0 and not 1 <= args.port <= 65535 - n + 1:
        print(f"calconsole: error: --port {args.port} leaves no room for {n} consecutive ports", file=sys.stderr)
        return 2
    root = Path(args.boards_dir or _default_dir())
    if args.audit_log is not None:
        if not getattr(args, "audit_log_from_settings", False):
            print("calconsole: error: with --boards each board keeps its own audit log under --boards-dir; "
                  "--audit-log names one file", file=sys.stderr)
            return 2
        # a default from the settings or $CALCONSOLE_AUDIT_LOG is not an option given: said, not refused
        print(f"calconsole: note: the settings' audit log ({args.audit_log}) is not used with --boards: each "
              f"board keeps its own under {root}", file=sys.stderr)
    root.mkdir(parents=True, exist_ok=True)
    boards: list[Board] = []
    readies: list[threading.Event] = []
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(n):
            name = f"board-{i}"
            log = root / f"{name}.audit.jsonl"
            port = 0 if args.port == 0 else args.port + i
            proc = subprocess.Popen(board_command(args, port, log), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    start_new_session=True)  # a Ctrl-C reaches the launcher, which stops them
            b = Board(name, proc, log)
            ev = threading.Event()
            threading.Thread(target=_reader, args=(b, ev, out), daemon=True, name=f"{name}-stderr").start()
            boards.append(b)
            readies.append(ev)
        deadline = time.monotonic() + START_TIMEOUT_S
        for ev in readies:
            while not ev.wait(0.5):
                if stop.is_set() or time.monotonic() > deadline:
                    break
        missing = [b.name for b in boards if b.url is None]
        if missing and not stop.is_set():
            _say(f"calconsole serve --boards: {', '.join(missing)} did not start listening within "
                  f"{START_TIMEOUT_S:g} s; stopping all", out=out)
            return 1
        fleet_file = Path(args.fleet_out) if args.fleet_out else root / "fleet.yaml"
        write_fleet_file(fleet_file, boards, args)
        _say(f"calconsole serve --boards: {n} boards listening ({', '.join(b.url or '?' for b in boards)}); "
              f"fleet file {fleet_file} (calconsole --fleet {fleet_file}); audit logs in {root}; "
              "Ctrl-C stops them all", out=out)
        exited: set[str] = set()
        while not stop.wait(0.5):
            for b in boards:
                if b.name not in exited and b.proc.poll() is not None:
                    exited.add(b.name)
                    _say(f"calconsole serve --boards: {b.name} exited with code {b.proc.returncode}; the "
                          "others keep serving", out=out)
            if len(exited) == len(boards):
                return 1
        return 0
    finally:
        stop_all(boards)
        for s, h in old.items():
            signal.signal(s, h)
        _say("calconsole serve --boards: stopped", out=out)


def stop_all(boards: list[Board]) -> None:
    """SIGTERM every board, wait up to ``STOP_GRACE_S`` in all, SIGKILL what is left."""
    for b in boards:
        if b.proc.poll() is None:
            b.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for b in boards:
        try:
            b.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            b.proc.kill()
            b.proc.wait(timeout=5)


def write_fleet_file(path: Path, boards: list[Board], args: argparse.Namespace) -> None:
    """A fleet file (see ``fleet.config``) naming every board, its URL and the launcher's key files."""
    entries = []
    for b in boards:
        e: dict[str, str] = {"name": b.name, "url": b.url or ""}
        if args.api_key_file:
            e["api_key_file"] = str(Path(args.api_key_file).resolve())
        if args.admin_key_file:
            e["admin_key_file"] = str(Path(args.admin_key_file).resolve())
        entries.append(e)
    path.write_text("# written by calconsole serve --boards\n" + yaml.safe_dump({"boards": entries}, sort_keys=False),
                    encoding="utf-8")


def _default_dir() -> str:
    import platformdirs

    return os.path.join(platformdirs.user_state_dir("calconsole"), f"boards-{os.getpid()}")
