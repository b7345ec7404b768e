"""``calconsole bench keys``: its options, the busy loops beside the console and the idle-CPU windows.

Small runs (a 20-token reply, a fraction of a second of idle): the report's shape, that the busy loops ran
and were stopped, and that every figure is a plain non-negative number. Figures are never compared with
a threshold (a benchmark, not a test of speed).
"""

from __future__ import annotations

import json
import math

import psutil
import pytest

from calconsole.bench import keys as bench_keys
from calconsole.bench.busy import MAX_BUSY_LOOPS, BusyLoops, CpuMeter
from calconsole.cli import build_parser, main


def _spinning_children() -> list[psutil.Process]:
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if "while True" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.Error:
            pass
    return out


def test_registered_with_one_busy_loop_and_an_idle_window_by_default():
    args = build_parser().parse_args(["bench", "keys"])
    assert args.func is bench_keys.run and args.busy_loops == 1 and args.idle_s == 5.0
    args = build_parser().parse_args(["bench", "realtime", "--ui"])
    assert args.ui and args.ui_busy_loops == 1 and args.ui_idle_s == 5.0


@pytest.mark.parametrize("argv, msg", [
    (["keys", "--busy-loops", "-1"], f"--busy-loops must be in 0..{MAX_BUSY_LOOPS}, got -1"),
    (["keys", "--busy-loops", str(MAX_BUSY_LOOPS + 1)], f"--busy-loops must be in 0..{MAX_BUSY_LOOPS}"),
    (["keys", "--idle-s", "-0.5"], "--idle-s must be in 0..120, got -0.5"),
    (["keys", "--idle-s", "121"], "--idle-s must be in 0..120"),
    (["realtime", "--ui", "--ui-busy-loops", "99"], f"--ui-busy-loops must be in 0..{MAX_BUSY_LOOPS}, got 99"),
    (["realtime", "--ui", "--ui-idle-s", "-1"], "--ui-idle-s must be in 0..120"),
])
def test_bad_options_exit_2_before_anything_starts(capsys, argv, msg):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
    assert not _spinning_children()


def test_busy_loops_run_inside_the_block_and_are_stopped_after():
    with BusyLoops(2) as loops:
        pids = loops.pids
        assert len(pids) == 2 and all(psutil.Process(p).is_running() for p in pids)
    assert loops.pids == [] and not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                        for p in pids)
    s = loops.summary()
    assert s["n"] == 2 and s["wall_s"] >= 0 and len(s["cpu_percent"]) == 2
    assert all(p is None or p >= 0 for p in s["cpu_percent"])
    with pytest.raises(ValueError, match="busy loops must be in 0..8"):
        BusyLoops(MAX_BUSY_LOOPS + 1)


def test_busy_loops_are_stopped_when_the_block_raises():
    with pytest.raises(RuntimeError), BusyLoops(1) as loops:
        pid = loops.pids[0]
        raise RuntimeError("the bench failed")
    assert not (psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)


def test_cpu_meter_counts_this_process_cpu_over_the_window():
    m = CpuMeter()
    x = 0
    for i in range(200_000):  # some CPU work of this thread
        x += i
    w = m.window()
    assert x > 0 and w.cpu_s > 0 and w.wall_s > 0 and w.percent >= 0
    d = w.to_dict()
    assert set(d) == {"cpu_s", "wall_s", "percent_of_a_core", "unit"} and "% of one core" in d["unit"]


def test_small_run_reports_the_busy_loop_and_both_idle_windows(capsys):
    rc = main(["bench", "keys", "--json", "--max-tokens", "20", "--after-s", "0", "--idle-s", "0.3",
               "--busy-loops", "1"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert rep["busy_loops"]["n"] == 1 and len(rep["busy_loops"]["cpu_percent"]) == 1
    for k in ("idle_before", "idle_after"):
        w = rep[k]
        assert w["wall_s"] >= 0.3 and w["cpu_s"] >= 0 and math.isfinite(w["percent_of_a_core"])
    assert rep["streaming"]["n"] + rep["end_of_reply"]["n"] > 0
    assert not _spinning_children()  # the bench stopped its loop


def test_text_report_names_the_busy_loops_and_the_idle_cpu(capsys):
    assert main(["bench", "keys", "--max-tokens", "20", "--after-s", "0", "--idle-s", "0.2",
                 "--busy-loops", "0"]) == 0
    out = capsys.readouterr().out
    assert "no busy loop beside the console" in out
    assert "idle CPU before the request:" in out and "idle CPU after the reply:" in out
    assert "% of a core" in out and "process CPU over" in out


def test_idle_window_zero_measures_nothing():
    import asyncio

    r = asyncio.run(bench_keys._measure(20, 0.0, (120, 36), busy_loops=0, idle_s=0.0))
    assert r["idle_before"] is None and r["idle_after"] is None and r["busy_loops"]["n"] == 0
    assert bench_keys.idle_lines(r) == []


def test_numerics_run_is_the_default_console_and_reports_its_worker(capsys):
    """``--numerics``: the console as it starts by default (numerics in their worker process, realtime
    pacing); the report says so, and each idle window also gives the worker's CPU."""
    rc = main(["bench", "keys", "--json", "--numerics", "--max-tokens", "6", "--after-s", "0", "--idle-s", "0.2",
               "--busy-loops", "0"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["numerics"] is True
    for k in ("idle_before_worker", "idle_after_worker"):
        w = rep[k]
        assert w is not None and w["wall_s"] >= 0.2 and w["cpu_s"] >= 0 and math.isfinite(w["percent_of_a_core"])
    lines = bench_keys.idle_lines(rep)
    assert sum("its numerics worker meanwhile" in ln for ln in lines) == 2
    assert rep["reply_tokens"] >= 1
    assert main(["bench", "keys", "--numerics", "--max-tokens", "4", "--after-s", "0", "--idle-s", "0",
                 "--busy-loops", "0"]) == 0
    assert "numerics worker, realtime pacing" in capsys.readouterr().out


def test_children_cpu_meter_counts_child_processes_but_the_excluded():
    """The worker's idle window (``ChildrenCpuMeter``) counts this process's children's CPU and leaves out
    the pids it is told to (the busy loops): a spinning child is counted, the same child excluded is not."""
    from calconsole.bench.busy import ChildrenCpuMeter
    from tests.waits import wait_until

    with BusyLoops(1) as loops:
        counted, excluded = ChildrenCpuMeter([]), ChildrenCpuMeter(loops.pids)
        # until the loop has run a while (windows count from construction, so reading one changes nothing)
        assert wait_until(lambda: counted.window().cpu_s >= 0.05, timeout=30.0)
        assert excluded.window().cpu_s == 0.0


@pytest.mark.parametrize("panes, single", [("single", True), ("columns", False), ("auto", False)])
def test_the_pane_mode_is_forced_as_the_palette_does_and_reported(capsys, panes, single):
    # 120x36 is the operator layout's threshold: auto shows the columns there, "single" one pane at a time
    assert main(["bench", "keys", "--json", "--max-tokens", "10", "--after-s", "0", "--idle-s", "0",
                 "--busy-loops", "0", "--panes", panes]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["single_pane"] is single
    assert main(["bench", "keys", "--max-tokens", "5", "--after-s", "0", "--idle-s", "0", "--busy-loops", "0",
                 "--panes", panes]) == 0
    assert ("one pane at a time (chat)" if single else "the layout's columns") in capsys.readouterr().out
