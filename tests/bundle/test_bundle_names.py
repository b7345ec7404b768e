"""``--bundle NAME``: an installed bundle by its name from any directory, and a refused path that names them.

The README's paths (``sim_backend/bundles/...``) worked only from the source tree: a ``pip install`` user in
another directory got "bundle directory not found" and no hint where the installed bundles are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calconsole.cli import main
from sim_backend.bundle.manifest import BUNDLES_DIR, DEFAULT_BUNDLE_DIR, bundle_dir, installed_bundles, load_bundle


def test_the_installed_bundles_are_listed_by_name():
    names = installed_bundles()
    assert {"qwen3-30b-a3b", "qwen3-30b-a3b-b8", "smollm2-135m-pilot"} <= set(names), names
    assert names == sorted(names)


@pytest.mark.parametrize("given", ["qwen3-30b-a3b-b4", "sim_backend/bundles/qwen3-30b-a3b-b4"])
def test_a_bundle_name_loads_from_any_directory(tmp_path, monkeypatch, given):
    monkeypatch.chdir(tmp_path)  # not the source tree
    b = load_bundle(given)
    assert b.path == BUNDLES_DIR / "qwen3-30b-a3b-b4" and b.decode_batch == 4


def test_a_directory_of_that_name_here_comes_first(tmp_path, monkeypatch):
    # a directory the user points at is never replaced by an installed one
    monkeypatch.chdir(tmp_path)
    (tmp_path / "qwen3-30b-a3b").mkdir()
    assert bundle_dir("qwen3-30b-a3b") == Path("qwen3-30b-a3b")  # the one here, relative as given
    assert bundle_dir("./smollm2-135m-pilot") == Path("./smollm2-135m-pilot")  # a path, not a name: unchanged
    assert bundle_dir(None) == DEFAULT_BUNDLE_DIR


def test_a_bad_bundle_says_which_bundles_are_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["snapshot", "--json", "--bundle", "smollm2-135m"])  # a typo of the pilot's name
    err = capsys.readouterr().err
    assert code == 2 and "bundle directory not found" in err, err
    assert "installed bundles" in err and "smollm2-135m-pilot" in err and "qwen3-30b-a3b-b8" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_snapshot_with_a_bundle_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["snapshot", "--json", "--timing-only", "--bundle", "qwen3-30b-a3b-b8"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["device"]["bundle"].startswith("qwen3-30b-a3b-b8 [C3"), snap["device"]["bundle"]
