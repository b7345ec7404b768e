"""bad input that used to get through now gets a clear answer.

CLI refusals: exit code 2 and exactly one line on stderr, never a traceback, a hang or a dead thread.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from calconsole.cli import main
from calconsole.commands.common import CLI_SPEED_RANGE
from calconsole.layout import MAX_DEPTH as LAYOUT_MAX_DEPTH
from calconsole.layout import LayoutError, load_layout
from sim_backend.compose import build_system
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.planes.audit import MAX_DEPTH, AuditLog, AuditLogError, summarize
from tests.waits import wait_until

ROOT = Path(__file__).resolve().parents[2]
UNWRITABLE = "/proc/nope/a.jsonl"  # /proc refuses new directories, even to root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv: str, says: str) -> str:
    """Run the CLI; assert exit code 2 and one line on stderr containing ``says``."""
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    assert "Traceback" not in err and err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith("calconsole: error: ") and says in err, err
    return err


# --- --speed / --refresh ---------------------------------------------------------------------

@pytest.mark.parametrize("speed", ["1e-300", "1e-9", "0", "-1", "0.05", "nan", "inf", "1e400", "5000"])
@pytest.mark.parametrize("where", ["top", "sub"])
def test_speed_out_of_range_is_refused(capsys, speed, where):
    argv = (["--speed", speed, "chat", "hi"] if where == "top" else ["chat", "hi", "--speed", speed])
    refused(capsys, *argv, "--timing-only", says="--speed must be between 0.1 and 1000")


def test_speed_range_bounds_are_accepted(capsys):
    for speed in (str(CLI_SPEED_RANGE[0]), str(CLI_SPEED_RANGE[1])):
        code, out, err = run(capsys, "snapshot", "--json", "--timing-only", "--speed", speed)
        assert code == 0, err
        assert json.loads(out)["device"]["pacing_speed"] == float(speed)


@pytest.mark.parametrize("hz", ["1e-300", "0", "0.05", "11", "nan", "inf"])
def test_refresh_out_of_range_is_refused(capsys, hz):
    # before the terminal check: the console says what is wrong with the option
    refused(capsys, "--refresh", hz, says="--refresh must be between 0.1 and 10 Hz")


def test_help_states_the_ranges(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = " ".join(capsys.readouterr().out.split())
    assert "0.1 to 1000 (default 1.0)" in top and "0.1 to 10 Hz" in top
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    assert "0.1 to 1000" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("speed", [1e-300, 1e-9, 0.0, -1.0, float("nan"), float("inf"), 1e300, True, "1"])
def test_pacing_api_refuses_speeds_outside_its_range(speed):
    with pytest.raises(ValueError, match="pacing speed must be a number in"):
        Pacing(PacingMode.REALTIME, speed)


def test_pacing_api_range_keeps_the_longest_step_sleep_finite():
    # the device thread died in Event.wait(OverflowError) at --speed 1e-300: at the slowest
    # accepted speed, the longest step (2048-token prefill at full context, x1000 slow chip,
    # the largest factor inject_fault accepts) must still be a valid wait
    with build_system(numerics=False, maintenance=False) as s:
        worst_us = s.board.cost_model.price_step(s.board.shape, "prefill", 2048, 40960 - 2048).total_us * 1000
    wait_s = worst_us / 1e6 / Pacing.MIN_SPEED
    assert np.isfinite(wait_s) and wait_s < threading.TIMEOUT_MAX


@pytest.mark.parametrize("speed", [Pacing.MIN_SPEED, Pacing.MAX_SPEED])
def test_device_thread_survives_the_extreme_accepted_speeds(speed):
    s = build_system(pacing=Pacing(PacingMode.REALTIME, speed), numerics=False, maintenance=False)
    try:
        b = s.board
        cells = b.kv.apply(7, 1, timeout=1.0, positions=[0])
        ctx, pos = b.kv.seq_cells(7)
        job = b.submit("decode", 7, np.array([151644]), np.array([0]), np.asarray(cells), ctx, pos)
        if speed == Pacing.MAX_SPEED:
            assert job.wait(30).sim_us > 0
        else:  # a ~3 min pacing sleep: the thread sleeps in it, it does not die
            def pacing_sleep() -> bool:  # the device thread is inside the job's pacing wait now
                f = sys._current_frames().get(b._thread.ident)
                names = []
                while f is not None:
                    names.append(f.f_code.co_name)
                    f = f.f_back
                return "_execute" in names and "wait" in names

            assert wait_until(pacing_sleep, timeout=30.0)
            assert not job.done
        assert b._thread.is_alive()
    finally:
        s.close()  # interrupts the pacing sleep


# --- layout sizes and nesting --------------------------------------------------------------------

@pytest.mark.parametrize("size, says", [
    ("10000000", "1..1000 cells"), ("100000000.0", "1..1000 cells"), ("0", "1..1000 cells"),
    ("'" + "9" * 5000 + "'", "1..1000 cells"), ("0fr", "more than 0fr"), ("1000fr", "at most 100fr"),
    ("0%", "more than 0%"), ("101%", "at most 100%"), ("1e8", "size must look like"), ("[1]", "size must look like"),
    ("true", "size must look like"),
])
@pytest.mark.parametrize("which", ["height", "width"])
def test_layout_sizes_are_bounded(tmp_path, size, says, which):
    p = tmp_path / "l.yaml"
    if which == "height":
        p.write_text(f"columns: [{{panes: [{{pane: chat, height: {size}}}]}}]")
        field = "columns[0].panes[0].height"
    else:
        p.write_text(f"columns: [{{width: {size}, panes: [{{pane: chat}}]}}]")
        field = "columns[0].width"
    with pytest.raises(LayoutError) as e:
        load_layout(str(p))
    assert e.value.field == field and says in str(e.value) and len(str(e.value)) < 200


def test_layout_size_bounds_themselves_are_accepted(tmp_path):
    p = tmp_path / "l.yaml"
    p.write_text("columns: [{width: 1000, panes: [{pane: chat, height: 100%}, {pane: observation, height: 100fr}]},"
                 " {width: 1, panes: [{pane: maintenance, height: 0.5fr}]}]")
    lay = load_layout(str(p))
    assert [c.width for c in lay.columns] == ["1000", "1"]
    assert [p.height for c in lay.columns for p in c.panes] == ["100%", "100fr", "0.5fr"]


@pytest.mark.parametrize("text", [
    "columns: " + "[" * 5000 + "]" * 5000,
    "columns: " + "{a: " * 5000 + "1" + "}" * 5000,
    "columns:\n" + "".join(" " * i + "-\n" for i in range(200)),  # block style
])
def test_deeply_nested_layout_is_a_clear_error(tmp_path, text):
    p = tmp_path / "deep.yaml"
    p.write_text(text)
    with pytest.raises(LayoutError) as e:
        load_layout(str(p))
    assert e.value.field == "<yaml>" and f"nested deeper than {LAYOUT_MAX_DEPTH} levels" in str(e.value)


def test_layout_nesting_within_the_bound_still_loads(tmp_path):
    p = tmp_path / "l.yaml"
    extra = "[" * (LAYOUT_MAX_DEPTH - 2) + "]" * (LAYOUT_MAX_DEPTH - 2)  # root map + x list
    p.write_text(f"x: {extra}\ncolumns: [{{panes: [{{pane: chat}}]}}]")
    assert load_layout(str(p)).panes() == ["chat"]


def test_layout_cli_deep_file_exits_2(tmp_path, capsys):
    p = tmp_path / "deep.yaml"
    p.write_text("columns: " + "[" * 5000 + "]" * 5000)
    refused(capsys, "--layout", str(p), says="nested deeper than")


def test_huge_or_special_layout_file_is_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("#" * 100_000)
    with pytest.raises(LayoutError, match="larger than 64 KiB"):
        load_layout(str(big))
    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)
    with pytest.raises(LayoutError, match="not a regular file"):  # and it did not block
        load_layout(str(fifo))


# --- audit reader on damaged logs ----------------------------------------------------------------

def _damaged_log(path: Path) -> None:
    log = AuditLog(path)
    a = log.start("reset", {"timeout_s": 10})
    log.finish(a, "reset", {"timeout_s": 10}, granted=True, ok=True, result={"detail": "ok"}, duration_ms=1)
    with open(path, "ab") as f:
        f.write(b"\xff\xfe garbage\n")                                                    # line 3
        f.write('{"id": "x", "phase": "started", "action": "caf\u00e9"}'.encode()[:-3] + b"\n")  # 4: torn in é
        f.write(b"42\n[1, 2]\nnull\n")                                                    # 5, 6, 7
        f.write(b'{"id": [1], "phase": "started", "action": "a"}\n')                      # 8: unhashable id
        f.write(b"[" * 5000 + b"]" * 5000 + b"\n")                                        # 9: deep
        f.write(b'{"a": ' * 100 + b"1" + b"}" * 100 + b"\n")                              # 10: deep object
        f.write(b'{"name": "calconsole", "version": 3, "scripts": {"t": "x"}}\n')         # 11: other JSON
        f.write(b'{"id": "y", "phase": "event", "action": "drill:x", "time": 5, "user": ["[/]"], "args": 3, '
                b'"duration_ms": "abc", "sim_ms": [1], "granted": "yes", "ok": 1, "pid": "p", '
                b'"result": {"health": 3, "error": {"type": 1}}}\n')                      # 12: odd field types
    b = log.start("self_test", {})
    log.finish(b, "self_test", {}, granted=True, ok=True, result={"ok": True}, duration_ms=2)


def test_read_returns_every_unreadable_line_as_corrupt_and_the_rest(tmp_path):
    path = tmp_path / "a.jsonl"
    _damaged_log(path)
    recs = AuditLog(path).read()
    corrupt = {r["line"]: r["reason"] for r in recs if "corrupt" in r}
    assert corrupt.keys() == {3, 4, 5, 6, 7, 8, 9, 10, 11}
    assert corrupt[3].startswith("not UTF-8 (byte 0xff") and corrupt[4].startswith("not UTF-8 (byte 0xc3")
    assert "JSON int" in corrupt[5] and "JSON list" in corrupt[6] and "JSON NoneType" in corrupt[7]
    assert "field 'id'" in corrupt[8] and "field 'phase'" in corrupt[11]
    assert corrupt[9] == corrupt[10] == f"JSON nested deeper than {MAX_DEPTH} levels"
    entries = summarize(recs)
    assert [e["status"] for e in entries] == ["granted"] + ["corrupt"] * 9 + ["not as expected", "granted"]
    odd = entries[10]  # well typed whatever the record held
    assert (odd["time"], odd["user"], odd["args"], odd["duration_ms"], odd["sim_ms"], odd["granted"],
            odd["ok"], odd["pid"]) == ("5", "['[/]']", {"args": 3}, None, None, None, None, None)
    assert entries[1]["result"].startswith("line 3: not UTF-8")


def test_summarize_takes_anything(tmp_path):
    entries = summarize([42, None, [1], {"id": {"a": 1}, "phase": "finished", "action": "x"}, {"corrupt": 5}])
    assert [e["status"] for e in entries] == ["corrupt"] * 5


def test_audit_command_on_a_damaged_log(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich folds long cells at pytest's 80 columns
    path = tmp_path / "a.jsonl"
    _damaged_log(path)
    code, out, err = run(capsys, "audit", "--audit-log", str(path))
    assert code == 0 and "Traceback" not in err
    assert "9 of 14 lines" in err and "unreadable" in err
    assert "9 unreadable lines shown as corrupt" in " ".join(out.split())
    assert "self_test" in out and "reset" in out
    code, out, _ = run(capsys, "audit", "--audit-log", str(path), "--json")
    assert code == 0 and [e["status"] for e in json.loads(out)].count("corrupt") == 9
    code, out, _ = run(capsys, "audit", "--audit-log", str(path), "--raw")
    assert code == 0 and len(json.loads(out)) == 14


def test_audit_command_on_some_other_json_file(tmp_path, capsys):
    path = tmp_path / "package.json"
    path.write_text(json.dumps({"name": "x", "deps": {"a": 1}, "n": 42}, indent=2))
    code, out, err = run(capsys, "audit", "--audit-log", str(path), "--json")
    assert code == 0 and {e["status"] for e in json.loads(out)} == {"corrupt"}
    path.write_text("42")
    code, out, err = run(capsys, "audit", "--audit-log", str(path))
    assert code == 0 and "corrupt" in out and "1 of 1 lines" in err


def test_audit_command_refuses_a_fifo_without_blocking(tmp_path):
    fifo = tmp_path / "a.jsonl"
    os.mkfifo(fifo)
    # a subprocess: if it blocked, the timeout would end it and the test would fail, not hang
    p = subprocess.run([sys.executable, "-m", "calconsole", "audit", "--audit-log", str(fifo)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr == f"calconsole: error: audit log {fifo}: is a FIFO, not a regular file\n"


def test_audit_command_refuses_a_directory(tmp_path, capsys):
    refused(capsys, "audit", "--audit-log", str(tmp_path), says="is a directory, not a regular file")


# --- audit writer ----------------------------------------------------------------------------

def test_writer_lines_are_ascii_so_a_tear_never_splits_a_character(tmp_path):
    log = AuditLog(tmp_path / "a.jsonl")
    args = {"holder": "Jürgen 東京 🚀"}
    log.start("enter_exclusive", args)
    data = log.path.read_bytes()
    assert data.isascii() and log.read()[0]["args"] == args


def test_torn_last_line_does_not_swallow_the_next_record(tmp_path):
    path = tmp_path / "a.jsonl"
    log = AuditLog(path)
    aid = log.start("clear_device_memory", {})
    log.finish(aid, "clear_device_memory", {}, granted=True, ok=True, result={}, duration_ms=1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # killed while writing the finished record: torn, no newline
    nxt = AuditLog(path)  # the next process
    bid = nxt.start("reset", {})
    nxt.finish(bid, "reset", {}, granted=True, ok=True, result={}, duration_ms=1)
    recs = nxt.read()
    assert [r.get("phase", "corrupt") for r in recs] == ["started", "corrupt", "started", "finished"]
    assert recs[1]["line"] == 2
    entries = nxt.entries()
    assert [(e["action"], e["status"]) for e in entries] == [
        ("clear_device_memory", "did not finish"), ("?", "corrupt"), ("reset", "granted")]


def test_writer_refuses_a_fifo(tmp_path):
    fifo = tmp_path / "a.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(AuditLogError, match="is a FIFO"):
        AuditLog(fifo).start("x", {})


# --- unwritable audit path refused at start-up ----------------------------------------------------

@pytest.mark.parametrize("argv", [
    [],                                    # the console (refused before the terminal check)
    ["drill"], ["chat", "hi", "--timing-only"], ["snapshot", "--json"], ["metrics"], ["trace", "--out", "t.json"],
    ["model"],                             # takes the top-level option only
])
def test_unwritable_audit_log_is_refused_at_start_up(capsys, tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    refused(capsys, "--audit-log", UNWRITABLE, *argv,
            says=f"audit log {UNWRITABLE}: not writable: on the proc pseudo-filesystem")
    if argv and argv[0] != "model":
        sub = [argv[0], "--audit-log", UNWRITABLE, *argv[1:]]  # the sub-command's own option
        refused(capsys, *sub, says=f"audit log {UNWRITABLE}")


@pytest.mark.parametrize("kind", ["dir", "fifo", "under_a_file"])
def test_other_unusable_audit_paths(capsys, tmp_path, kind):
    if kind == "dir":
        path, says = tmp_path, "is a directory"
    elif kind == "fifo":
        path, says = tmp_path / "f.jsonl", "is a FIFO"
        os.mkfifo(path)
    else:
        (tmp_path / "file").write_text("x")
        path, says = tmp_path / "file" / "a.jsonl", f"not writable: {tmp_path / 'file'} is not a directory"
    refused(capsys, "drill", "--audit-log", str(path), says=says)


def test_default_audit_path_is_checked_where_maintenance_runs(capsys, monkeypatch):
    monkeypatch.setenv("CALCONSOLE_AUDIT_LOG", UNWRITABLE)
    refused(capsys, "drill", says=f"audit log {UNWRITABLE}: not writable")
    # chat never writes the audit log: the default path is not its business
    code, _, err = run(capsys, "chat", "hi", "--timing-only", "--max-tokens", "1")
    assert code == 0, err


def test_the_check_creates_nothing_and_the_first_record_creates_the_log(tmp_path):
    log = AuditLog(tmp_path / "new" / "a.jsonl")
    log.check_writable()
    assert not (tmp_path / "new").exists()  # checked, not created: a command may still fail after the check
    log.start("self_test", {})
    assert [r["action"] for r in log.read()] == ["self_test"]


@pytest.mark.parametrize("argv", [
    [],                                   # the console: refused without a terminal, after the option checks
    ["drill", "--bundle", "no/such/bundle"],  # fails loading the bundle
])
def test_a_command_that_fails_leaves_no_audit_directories(capsys, tmp_path, argv):
    # a fresh user's `--audit-log` in a new directory: the directories appeared although nothing ran
    path = tmp_path / "new" / "deeper" / "a.jsonl"
    code, _, err = run(capsys, "--audit-log", str(path), *argv)
    assert code == 2 and "Traceback" not in err, err
    assert not (tmp_path / "new").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may create entries in any directory")
def test_a_directory_that_takes_no_new_files_is_refused_at_start_up(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    refused(capsys, "--audit-log", str(locked / "sub" / "a.jsonl"), "drill",
            says=f"the nearest existing directory {locked} does not allow creating files")


# --- chat prompt from stdin ------------------------------------------------------------------------

def _stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


@pytest.mark.parametrize("data, says", [
    (random.Random(0).randbytes(4096), "stdin is not UTF-8 text: byte 0x"),
    ("café".encode()[:-1], "stdin is not UTF-8 text: byte 0xc3 at offset 3 (unexpected end of data)"),
    ("hi".encode("utf-16"), "stdin is not UTF-8 text"),
])
def test_stdin_that_is_not_utf8_is_refused(capsys, monkeypatch, data, says):
    _stdin(monkeypatch, data)
    refused(capsys, "chat", "-", "--timing-only", says=says)


def test_stdin_utf8_with_bom_is_read(capsys, monkeypatch):
    _stdin(monkeypatch, b"\xef\xbb\xbfcaf\xc3\xa9 \xf0\x9f\x9a\x80")
    code, out, err = run(capsys, "chat", "-", "--timing-only", "--max-tokens", "2", "--json")
    assert code == 0, err
    assert json.loads(out)["timings"]["predicted_n"] == 2


def test_undecodable_prompt_argument_is_refused(capsys):
    # a byte that is not UTF-8 in argv reaches Python as a lone surrogate (PEP 383)
    refused(capsys, "chat", "\udcff hi", "--timing-only", says="the prompt argument is not UTF-8 text: byte 0xff")
    refused(capsys, "chat", "\ud800", "--timing-only", says="the prompt argument is not valid text")


def test_random_bytes_piped_into_chat_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "calconsole", "chat", "-", "--timing-only"], cwd=ROOT,
                       input=random.Random(1).randbytes(4096), capture_output=True, timeout=60,
                       env={**os.environ, "PYTHONIOENCODING": "utf-8"})
    err = p.stderr.decode()
    assert p.returncode == 2 and "Traceback" not in err and err.count("\n") == 1 and "not UTF-8" in err


def test_trace_stdin_is_checked_the_same_way(capsys, monkeypatch, tmp_path):
    _stdin(monkeypatch, b"\xff")
    refused(capsys, "trace", "-", "--out", str(tmp_path / "t.json"), says="stdin is not UTF-8 text")


# --- --max-tokens past the context -----------------------------------------------------------------

def test_max_tokens_past_the_context_end_is_noted_and_the_reply_stops_there(capsys):
    prompt = "hello " * 40940  # ~40,950 prompt tokens: the context leaves room for a few
    code, out, err = run(capsys, "chat", prompt, "--max-tokens", "100000", "--timing-only", "--json")
    assert code == 0, err
    m = re.search(r"note: --max-tokens 100000 is more than the context leaves: the reply stops at the context "
                  r"end \(40960 tokens, (\d+) of them prompt\) after at most (\d+) tokens", err)
    assert m, err
    d = json.loads(out)
    assert int(m.group(1)) == d["timings"]["prompt_n"]
    assert int(m.group(2)) == d["timings"]["predicted_n"] == 40960 - d["timings"]["prompt_n"]
    assert d["stop_type"] == "limit"


def test_max_tokens_within_the_context_has_no_note(capsys):
    code, _, err = run(capsys, "chat", "hi", "--max-tokens", "3", "--timing-only")
    assert code == 0 and "note:" not in err


def test_max_tokens_help_says_what_happens_at_the_context_end(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    assert "stops at the context end (40960 tokens" in " ".join(capsys.readouterr().out.split())


# --- --slo -------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, field", [("ttft:abc", "ttft"), ("tpot:-1", "tpot"), ("e2el:nan", "e2el"),
                                         ("ttft:inf", "ttft"), ("ttft:5,tpot:1e400", "tpot"), ("ttft:0", "ttft")])
def test_bad_slo_value_names_the_field(capsys, spec, field):
    refused(capsys, "metrics", "--slo", spec, says=f"--slo field '{field}': expected a positive number")
