"""``calconsole --api-key-file F serve``: the top-level key options reach ``serve``.

Found by a fresh-user trial: the subcommand's own ``--api-key-file`` / ``--admin-key-file`` defaulted to None and
overwrote the top-level options of the same names, so the server listened with "API key off" and no maintenance
routes although a key file was given (a missing file was not even noticed)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from calconsole.cli import build_parser
from calconsole.commands.serve import load_serving_keys


def _key_file(tmp_path: Path, name: str, key: str) -> str:
    p = tmp_path / name
    p.write_text(key + "\n")
    os.chmod(p, 0o600)
    return str(p)


@pytest.mark.parametrize("before", [True, False], ids=["before serve", "after serve"])
def test_key_files_given_before_or_after_serve_are_used(tmp_path: Path, before: bool) -> None:
    api = _key_file(tmp_path, "api", "k-api-0123456789abcdef")
    admin = _key_file(tmp_path, "admin", "k-admin-0123456789abcdef")
    opts = ["--api-key-file", api, "--admin-key-file", admin]
    args = build_parser().parse_args(opts + ["serve"] if before else ["serve"] + opts)
    assert (args.api_key_file, args.admin_key_file) == (api, admin)
    api_ring, admin_ring = load_serving_keys(args)
    assert api_ring is not None and admin_ring is not None


def test_no_key_file_anywhere_is_none() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.api_key_file, args.admin_key_file) == (None, None)


def test_a_missing_top_level_key_file_is_refused_by_serve(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--api-key-file", str(tmp_path / "nope"), "serve"])
    with pytest.raises(Exception, match="nope"):
        load_serving_keys(args)
