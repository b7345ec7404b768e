"""A bench's numeric arguments out of their bounds are refused before anything starts (no server, no load):
exit code 2 and a message naming the flag, for both benches of the server's connections."""

from __future__ import annotations

import pytest

from calconsole.cli import main


@pytest.mark.parametrize(("argv", "said"), [
    (["conncap", "--addresses", "0"], "--addresses must be in 1..250, got 0"),
    (["conncap", "--per-address", "501"], "--per-address must be in 1..500"),
    (["conncap", "--interval", "nan"], "--interval must be in 0..10, got nan"),
    (["conncap", "--files", "100"], "--files must be in 112..1048576"),
    (["conncap", "--mode", "pooled", "--poll", "0.01"], "--poll must be in 0.05..60"),
    (["http", "--clients", "0"], "--clients must be in 1..512, got 0"),
    (["http", "--seconds", "nan"], "--seconds must be in 0.2..120, got nan"),
    (["http", "--rounds", "21"], "--rounds must be in 1..20"),
    (["http", "--http", "h11,h11"], "--http must be a comma list of distinct h11, httptools"),
    (["http", "--http", "", "--no-llama"], "nothing to measure"),
])
def test_out_of_bounds_is_refused_before_anything_starts(argv, said, capsys, monkeypatch):
    import calconsole.bench.conncap as conncap
    import calconsole.bench.http as http

    def started(*a, **k):
        raise AssertionError("a server was started for a refused argument")

    monkeypatch.setattr(conncap, "serve_child", started)
    monkeypatch.setattr(http, "children", started)
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err, err
