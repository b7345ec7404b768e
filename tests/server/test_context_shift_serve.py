"""``serve --context-shift`` on the face: the options, the fleet launcher's pass-through, the request fields
``n_keep`` / ``n_discard``, and the shift figures in results and ``/slots`` (the counts against a real
llama-server: tests/real/test_context_shift.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from calconsole.cli import build_parser
from calconsole.commands.common import finalize
from calconsole.commands.serve import _context_kw
from calconsole.fleet.launcher import board_command

PROMPT = [11, 12, 13, 14]


@pytest.mark.parametrize(("argv", "shift"), [([], False), (["--context-shift"], True),
                                             (["--context-shift", "--no-context-shift"], False)])
def test_context_shift_option_defaults_off_as_llama_server(argv: list[str], shift: bool, tmp_path: Path) -> None:
    args = finalize(build_parser().parse_args(["serve", "-c", "256", *argv]))
    assert args.context_shift is shift
    assert _context_kw(args) == ({"context_shift": True, "n_ctx": 256} if shift else {})
    cmd = board_command(args, 9000, tmp_path / "audit.jsonl")
    assert ("--context-shift" if shift else "--no-context-shift") in cmd
    assert cmd[cmd.index("--ctx-size") + 1] == "256"


def test_shift_fields_in_result_and_slots(make_server: Any) -> None:
    srv = make_server(system_kw={"n_slots": 1, "n_ctx": 64, "context_shift": True})
    body = {"prompt": PROMPT, "n_predict": 100, "ignore_eos": True, "temperature": 0, "n_keep": -1}
    r = httpx.post(srv.url + "/completion", json=body, timeout=60).json()
    # 63 held at the 60th token: keep the 4 prompt tokens, drop 29 of the 59 others; again at the 89th
    assert (r["stop_type"], r["truncated"], r["tokens_predicted"]) == ("limit", True, 100)
    assert r["tokens_cached"] == 4 + 99 - 58 and r["generation_settings"]["n_keep"] == -1
    assert (r["calconsole"]["n_shifts"], r["calconsole"]["n_discarded"]) == (2, 58)
    slot = httpx.get(srv.url + "/slots", timeout=30).json()[0]
    assert slot["n_ctx"] == 64 and slot["n_prompt_tokens"] == r["tokens_cached"]
    assert slot["params"]["n_keep"] == -1
    assert slot["calconsole"] == {"n_shifts": 2, "n_discarded": 58, "truncated": True}


@pytest.mark.parametrize(("field", "value"), [("n_keep", -2), ("n_keep", "all"), ("n_discard", -1),
                                              ("n_discard", 1.5)])
def test_bad_shift_fields_are_400(make_server: Any, field: str, value: Any) -> None:
    srv = make_server(system_kw={"n_slots": 1})
    r = httpx.post(srv.url + "/completion", json={"prompt": PROMPT, "n_predict": 2, field: value}, timeout=60)
    assert r.status_code == 400 and field in r.json()["error"]["message"]


def test_console_slot_table_shows_shifts_beside_the_cached_tokens() -> None:
    from calconsole.widgets.render.serving import _cached
    from sim_backend.planes.snapshot import SlotView

    def view(**kw: Any) -> SlotView:
        return SlotView(index=0, state="decoding", request_id=1, prompt_n=4, n_prefilled=4, predicted_n=100,
                        cached_tokens=45, **kw)

    assert _cached(view()) == "45"  # no shift (or a server that does not say): the count alone
    assert _cached(view(n_shifts=1, n_discarded=29)) == "45 (1 shift, -29)"
    assert _cached(view(n_shifts=2, n_discarded=58)) == "45 (2 shifts, -58)"
