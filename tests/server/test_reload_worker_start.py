"""Reload (a new numerics worker) while the program's files changed under a running ``calconsole serve``.

A fresh user reinstalled calconsole while ``serve`` ran; the console's Reload then got a 500 whose message
ended in an empty reason ("numerics process connection lost during start:") and the server's stderr held a
multiprocessing traceback (``FileNotFoundError: .../venv/bin/calconsole``): the spawned worker re-ran the
console script by its path, which was gone. Now the worker never re-runs the main script, and a worker that
cannot start is one line in a typed JSON error, with no traceback.
"""

from __future__ import annotations

import os
import re
import sys
import types

import httpx
import pytest

from tests.server.conftest import ADMIN_KEY


def call(s, path, body=None):
    return httpx.post(s.url + path, json=body, headers=s.headers("admin"), timeout=300)


@pytest.fixture
def srv(make_server):
    return make_server(admin_key=ADMIN_KEY, system_kw={"numerics": True, "numerics_process": True})


def gone_main_script(monkeypatch, tmp_path) -> None:
    """``__main__`` as a console script run by its path (``.../bin/calconsole``), that path now removed."""
    main = types.ModuleType("__main__")
    main.__file__ = str(tmp_path / "bin" / "calconsole")  # never created: reinstalled away
    monkeypatch.setitem(sys.modules, "__main__", main)


def test_reload_starts_a_worker_though_the_main_script_is_gone(srv, monkeypatch, tmp_path, capfd):
    lid = call(srv, "/maintenance/exclusive", {"holder": "ops", "drain_timeout_s": 1}).json()["lease_id"]
    capfd.readouterr()
    gone_main_script(monkeypatch, tmp_path)
    r = call(srv, "/maintenance/reload", {"lease_id": lid})
    err = capfd.readouterr().err
    assert r.status_code == 200 and r.json()["ok"] is True, r.text
    assert "Traceback" not in err and "FileNotFoundError" not in err, err
    assert sys.modules["__main__"].__file__.endswith("calconsole")  # put back after the start


@pytest.mark.parametrize("python", ["missing", "/bin/false"])  # the interpreter removed; one that exits at once
def test_a_worker_that_cannot_start_is_a_typed_json_error_without_traceback(srv, monkeypatch, tmp_path, capfd,
                                                                          python):
    import multiprocessing.spawn

    lid = call(srv, "/maintenance/exclusive", {"holder": "ops", "drain_timeout_s": 1}).json()["lease_id"]
    capfd.readouterr()
    exe = str(tmp_path / "python") if python == "missing" else python
    original = multiprocessing.spawn.get_executable()
    monkeypatch.setattr(multiprocessing.spawn, "_python_exe", os.fsencode(exe) if isinstance(original, bytes) else exe)
    r = call(srv, "/maintenance/reload", {"lease_id": lid})
    err = capfd.readouterr().err
    assert r.status_code == 500 and r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()["error"]
    # the reason, not an empty one: "... connection lost during start:" ended there
    assert body["type"] == "server_error", body
    assert re.search(r"during start: the worker exited with code \d+ before it had started", body["message"]), body
    assert "\n" not in body["message"] and "Traceback" not in err, err
    monkeypatch.undo()  # the interpreter back: a reload works again
    assert call(srv, "/maintenance/reload", {"lease_id": lid}).json()["ok"] is True
