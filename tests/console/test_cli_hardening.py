"""Break report 3, 5, 6, 10 and trial report 6, 7: bad input that still got through.

Layouts with YAML aliases or 5,000-digit integers, audit logs and trace files on kernel
pseudo-filesystems, ``bench host --seed`` out of range, a repeated ``--slo`` field. Each
CLI refusal: exit code 2 and one line on stderr, no traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

import sim_backend.planes.audit as audit_mod
from calconsole.cli import main
from calconsole.commands import trace as trace_cmd
from calconsole.layout import LayoutError, load_layout
from sim_backend.planes import SLO
from sim_backend.planes.audit import AuditLog, AuditLogError, pseudo_filesystem

ROOT = Path(__file__).resolve().parents[2]
CHAT = "columns: [{width: 1fr, panes: [{pane: chat, height: 1fr}]}]\n"


def refused(capsys, *argv: str, says: str) -> str:
    code = main(list(argv))
    _, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith("calconsole: error: ") and says in err, err
    return err


def _laughs(levels: int = 5) -> str:
    """A "billion laughs" layout prefix: ``levels`` levels of 9 aliases each (9 shared 9 times ...).
    In-process tests use 5 levels (9**6 leaves), so a regression fails in seconds, not gigabytes;
    the subprocess test uses the break report's 9 under a memory limit."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


# --- layouts: aliases, anchors, long integers, bounded messages ------------------------------------

@pytest.mark.parametrize("where", ["refresh_hz: *a5\n", "name: *a5\n", "x: *a5\n"])
def test_layout_alias_bomb_is_refused_at_compose_time(tmp_path, where):
    p = tmp_path / "bomb.yaml"
    p.write_text(_laughs() + "name: x\n" * (not where.startswith("name")) + CHAT + where)
    with pytest.raises(LayoutError) as e:
        load_layout(str(p))
    assert e.value.field == "<yaml>" and "anchors and aliases" in str(e.value) and "line 1" in str(e.value)


def test_layout_with_only_an_anchor_is_refused(tmp_path):
    p = tmp_path / "a.yaml"
    p.write_text("name: &n x\n" + CHAT)
    with pytest.raises(LayoutError, match="anchors and aliases"):
        load_layout(str(p))


def test_layout_alias_bomb_cli_exits_2_quickly_in_bounded_memory(tmp_path):
    # the break report's reproduction: 41.8 s and 2.26 GB before the fix; here 1 GB of
    # address space above what the interpreter needs would fail with MemoryError
    p = tmp_path / "bomb.yaml"
    p.write_text(_laughs(9) + "name: x\n" + CHAT + "refresh_hz: *a9\n")
    assert p.stat().st_size < 1024
    code = ("import resource, sys; from calconsole.cli import main; "
            "soft = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + (1 << 30); "
            "resource.setrlimit(resource.RLIMIT_DATA, (soft, resource.RLIM_INFINITY)); "
            "sys.exit(main(['--layout', sys.argv[1]]))")
    r = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "anchors and aliases" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("which, field", [
    ("height", "columns[0].panes[0].height"), ("width", "columns[0].width"), ("refresh_hz", "refresh_hz"),
    ("name", "name"),
])
def test_layout_5000_digit_integer_names_the_field(tmp_path, which, field):
    big = "9" * 5000
    p = tmp_path / "bigint.yaml"
    if which == "height":
        p.write_text(f"name: x\ncolumns: [{{width: 1fr, panes: [{{pane: chat, height: {big}}}]}}]\n")
    elif which == "width":
        p.write_text(f"name: x\ncolumns: [{{width: {big}, panes: [{{pane: chat}}]}}]\n")
    else:
        p.write_text(CHAT + f"{which}: {big}\n")
    with pytest.raises(LayoutError) as e:
        load_layout(str(p))
    assert e.value.field == field and "an integer of 5000 characters" in str(e.value)
    assert len(str(e.value)) < 250


def test_layout_5000_digit_integer_cli_exits_2(tmp_path, capsys):
    p = tmp_path / "bigint.yaml"
    p.write_text("name: x\ncolumns: [{width: 1fr, panes: [{pane: chat, height: " + "9" * 5000 + "}]}]\n")
    refused(capsys, "--layout", str(p), says="field 'columns[0].panes[0].height'")


@pytest.mark.parametrize("text, field", [
    (CHAT + "refresh_hz: '" + "z" * 60_000 + "'\n", "refresh_hz"),
    (CHAT + "refresh_hz: [" + ", ".join(["[1, 2, 3]"] * 3000) + "]\n", "refresh_hz"),
    ("name: [" + ", ".join(["abc"] * 5000) + "]\n" + CHAT, "name"),
    ("columns: [{panes: [{pane: [" + ", ".join(["chat"] * 5000) + "]}]}]\n", "columns[0].panes[0].pane"),
    ("columns: [{panes: [{pane: {a: 1}}]}]\n", "columns[0].panes[0].pane"),  # unhashable: no TypeError
    ("columns: [{panes: [{pane: chat, height: '" + "7" * 60_000 + "'}]}]\n", "columns[0].panes[0].height"),
])
def test_layout_errors_never_format_a_large_value(tmp_path, text, field):
    p = tmp_path / "l.yaml"
    p.write_text(text)
    with pytest.raises(LayoutError) as e:
        load_layout(str(p))
    assert e.value.field == field and len(str(e.value)) < 250, str(e.value)[:300]


def test_layout_bad_date_value_is_a_layout_error(tmp_path):
    p = tmp_path / "d.yaml"
    p.write_text("name: 2001-13-45\n" + CHAT)  # PyYAML's constructor raises a bare ValueError
    with pytest.raises(LayoutError, match="malformed YAML value"):
        load_layout(str(p))


def test_shipped_layouts_still_load():
    for name in ("operator", "chat"):
        assert load_layout(name).panes()


# --- audit log on a pseudo-filesystem ----------------------------------------------------------------

@pytest.mark.parametrize("path, fstype", [
    ("/proc/self/status", "proc"), ("/proc/nope/a.jsonl", "proc"), ("/sys/kernel/calconsole.jsonl", "sysfs"),
    ("/dev/calconsole-audit.jsonl", "devtmpfs"),
])
def test_audit_log_on_a_pseudo_filesystem_is_refused_at_start_up(capsys, monkeypatch, path, fstype):
    # a fixed Linux mount table, so the refusal is tested the same way on every machine
    mounts = [SimpleNamespace(mountpoint=m, fstype=t) for m, t in
              (("/", "ext4"), ("/proc", "proc"), ("/sys", "sysfs"), ("/dev", "devtmpfs"), ("/tmp", "tmpfs"))]
    monkeypatch.setattr(psutil, "disk_partitions", lambda all=False: mounts)
    assert pseudo_filesystem(path) == (fstype, "/" + path.split("/")[1])
    refused(capsys, "--audit-log", path, "drill", says=f"audit log {path}: not writable: on the {fstype} "
                                                       "pseudo-filesystem")
    assert path.startswith("/proc") or not Path(path).exists()  # nothing was created


def test_audit_log_probe_write_catches_what_the_open_does_not(monkeypatch):
    # without the mount check, /proc/self/status opens for root (writes then fail with EINVAL);
    # the zero-length probe write refuses it
    monkeypatch.setattr(audit_mod, "pseudo_filesystem", lambda p: None)
    with pytest.raises(AuditLogError) as e:
        AuditLog("/proc/self/status").check_writable()
    assert "not writable" in str(e.value)
    if os.geteuid() == 0:
        assert "probe write failed: Invalid argument" in str(e.value)


def test_audit_log_check_leaves_an_existing_log_unchanged(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_bytes(b'{"x": 1}\n')
    AuditLog(p).check_writable()
    assert p.read_bytes() == b'{"x": 1}\n'
    assert pseudo_filesystem(p) is None


# --- trace --out checked before the request runs ---------------------------------------------------

def _no_build(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the system was built: --out should have been refused first")
    monkeypatch.setattr(trace_cmd, "build_from_args", boom)


@pytest.mark.parametrize("out, says", [
    ("/proc/version", "--out is on the proc pseudo-filesystem"),
    ("/dev/null", "--out is not a regular file"),
    ("", "--out is empty"),
])
def test_trace_out_unwritable_is_refused_before_running(capsys, monkeypatch, out, says):
    _no_build(monkeypatch)
    refused(capsys, "trace", "--out", out, "hi", says=says)


def test_trace_out_probe_write_refuses_a_file_that_opens(capsys, monkeypatch):
    _no_build(monkeypatch)
    # only the probe is left (the commands take the function through the planes' public surface)
    monkeypatch.setattr(audit_mod, "pseudo_filesystem", lambda p: None)
    monkeypatch.setattr("sim_backend.planes.pseudo_filesystem", lambda p: None)
    refused(capsys, "trace", "--out", "/proc/version", "hi", says="--out is not writable")


def test_trace_out_read_only_file_is_refused_before_running(capsys, monkeypatch, tmp_path):
    p = tmp_path / "ro.json"
    p.write_text("keep")
    p.chmod(0o444)
    real_open = os.open

    def open_as_a_user(path, flags, *a):  # root may write a 0444 file; an operator may not
        if str(path) == str(p) and flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *a)

    monkeypatch.setattr(os, "open", open_as_a_user)
    _no_build(monkeypatch)
    refused(capsys, "trace", "--out", str(p), says="--out is not writable")
    assert p.read_text() == "keep"


def test_trace_out_created_for_the_check_is_removed_when_the_run_is_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    refused(capsys, "--audit-log", "/proc/nope/a.jsonl", "trace", "--out", "t.json", says="audit log")
    assert not (tmp_path / "t.json").exists()


# --- bench host --seed ---------------------------------------------------------------------------

@pytest.mark.parametrize("seed, shown", [("-1", "got -1"), (str(2**64), f"got {2**64}"),
                                         ("9" * 40, "got a 40-digit number")])
def test_bench_host_seed_out_of_range_exits_2(capsys, seed, shown):
    err = refused(capsys, "bench", "host", "--seed", seed, "--iterations", "1", says="--seed must be an integer "
                                                                                      "in [0, 2**64)")
    assert shown in err


def test_bench_host_seed_at_the_bounds_runs(capsys):
    for seed in ("0", str(2**64 - 1)):
        assert main(["bench", "host", "--seed", seed, "--iterations", "1", "--json"]) == 0
        capsys.readouterr()


# --- --slo ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, says", [
    ("ttft:1,ttft:2", "--slo field 'ttft' given twice"),
    ("tpot:5, ttft:3 ,tpot:5", "--slo field 'tpot' given twice"),
    ("e2el:1,e2el:1", "--slo field 'e2el' given twice"),
    ("", "--slo names no objective"),
    (",", "--slo names no objective"),
    (" , ", "--slo names no objective"),
])
def test_slo_repeated_or_empty_is_refused(capsys, spec, says):
    refused(capsys, "metrics", "--slo", spec, says=says)


def test_slo_parse_refuses_a_repeated_key():
    with pytest.raises(ValueError, match="SLO field 'ttft' given twice"):
        SLO.parse("ttft:1,ttft:2")
    assert SLO.parse("ttft:1,tpot:2").to_dict() == {"ttft_ms": 1.0, "tpot_ms": 2.0, "e2el_ms": None}
