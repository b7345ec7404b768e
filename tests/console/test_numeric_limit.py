"""The numeric prompt limit: a measured default with its reason, ``--numeric-limit N`` for another."""

from __future__ import annotations

import json

import pytest

from calconsole.cli import build_parser, main
from sim_backend.compose import NUMERIC_LIMIT_REASON, NUMERIC_PROMPT_LIMIT, build_system


def test_default_limit_and_its_reason_reach_the_snapshot(tmp_path):
    with build_system(maintenance=False, n_slots=1, numerics=True) as s:
        d = s.observation.snapshot().to_dict()["device"]
    assert d["numerics_max_prompt"] == NUMERIC_PROMPT_LIMIT and d["numerics_limit_reason"] == NUMERIC_LIMIT_REASON
    with build_system(maintenance=False, n_slots=1, numerics=False) as s:
        d = s.observation.snapshot().to_dict()["device"]
    assert d["numerics_max_prompt"] == 0 and d["numerics_limit_reason"] == ""


def test_option_parses_for_console_and_serve():
    assert build_parser().parse_args(["--numeric-limit", "64"]).numeric_limit == 64
    assert build_parser().parse_args(["serve", "--numeric-limit", "64"]).numeric_limit == 64


def test_prompt_over_the_option_runs_timing_only_and_the_reply_says_so(capsys):
    # 'hello there' with the chat template is more than 3 tokens: timing-only
    assert main(["chat", "hello there", "--numeric-limit", "3", "--max-tokens", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["timings"]["numerics"] is False
    assert main(["chat", "hello there", "--numeric-limit", "4096", "--max-tokens", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["timings"]["numerics"] is True


@pytest.mark.parametrize("value", ["0", "40961"])
def test_out_of_range_exits_2_with_one_line(capsys, value):
    assert main(["chat", "hi", "--numeric-limit", value]) == 2
    err = capsys.readouterr().err
    assert "--numeric-limit must be in 1..40960" in err and err.count("\n") == 1


def test_build_system_refuses_a_limit_below_one():
    with pytest.raises(ValueError, match="numerics_max_prompt"):
        build_system(maintenance=False, numerics_max_prompt=0)
