"""The D2H logits dtype is shown as it is: the production calbin's BF16 in the long device panel, and a C3
calbin's F32 (the dense pilot's) also in the device table, marked as the variant's."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

from rich.console import Console

from calconsole.widgets import render
from tests.console.pilot_helpers import typed

SCRIPTED = json.loads((Path(__file__).parent / "data" / "scripted_snapshot.json").read_text())


def shown(renderable, width: int = 200) -> str:
    console = Console(width=width, file=io.StringIO(), record=True)
    console.print(renderable)
    return console.export_text()


def test_bf16_in_the_panel_and_nothing_extra_in_the_table():
    snap = typed(SCRIPTED)
    assert snap.device.logits_dtype == "bf16"  # an older snapshot without the field reads as the production calbin
    assert "logits BF16" in shown(render.device_panel(snap))
    assert "logits" not in shown(render.device_table(snap))


def test_a_c3_calbin_s_f32_logits_are_shown_as_the_variant_s():
    raw = copy.deepcopy(SCRIPTED)
    raw["device"].update(logits_dtype="f32", bundle_status="C3")
    snap = typed(raw)
    assert "logits F32" in shown(render.device_panel(snap))
    for compact in (False, True):
        assert "C3 logits F32" in shown(render.device_table(snap, compact=compact)), compact
