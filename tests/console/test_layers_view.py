"""The observation pane's per-layer table and heatmap show the ops outside the layers ("embed"
before layer 0, "head" after the last), each chip's busy + wait = infer, and how the experts
were priced; a step view without those fields (an older server) still renders."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from rich.console import Console

from calconsole.widgets import render
from tests.console.pilot_helpers import typed_step

SCRIPTED = json.loads((Path(__file__).parent / "data" / "scripted_snapshot.json").read_text())


def plain(renderable, width: int = 160) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def _row(text: str, label: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if re.match(rf"\s*{label}\s", ln))
    return line.split()


def test_uniform_decode_has_embed_and_head_rows_around_the_layers():
    step = SCRIPTED["last_decode"]  # chip1 4x slow
    text = plain(render.layers_panel(typed_step(step)))
    lines = [ln.strip() for ln in text.splitlines()]
    i_embed = next(i for i, ln in enumerate(lines) if ln.startswith("embed "))
    i_layers = next(i for i, ln in enumerate(lines) if ln.startswith("0-47 "))
    i_head = next(i for i, ln in enumerate(lines) if ln.startswith("head "))
    assert i_embed < i_layers < i_head
    embed, head = _row(text, "embed"), _row(text, "head")
    out = {o["part"]: o for o in step["outside"]}
    assert embed[1:3] == [f"{u:.1f}" for u in out["embed"]["chip_us"]] and "before" in embed
    assert head[1:3] == [f"{u:.1f}" for u in out["head"]["chip_us"]] and "L47" in head[4]
    assert "embedding, embed_sync" in text and "final_norm, lm_head, logits_gather, logits_sync" in text
    busy = " / ".join(f"{b:.1f}" for b in step["chip_busy_us"])
    assert f"busy {busy} (embed + 48 layers + head)" in text
    assert f"= infer {step['infer_us']:.1f} µs sim" in text
    assert "experts priced: the expectation" in text


def test_numeric_prefill_rows_follow_the_router_and_say_so():
    step = copy.deepcopy(SCRIPTED["last_prefill"])
    pattern = [90.0 + (i % 5) * 4 for i in range(48)]
    for layer, e in zip(step["layers"], pattern, strict=True):
        layer["chip_us"] = [u * e / 100.0 for u in layer["chip_us"]]
    step["experts_priced"], step["experts_rule"] = pattern, "per-layer counts"
    text = plain(render.layers_panel(typed_step(step)))
    assert "all layers equal" not in text
    assert all(re.search(rf"^\s*{i}\s", text, re.M) for i in (0, 1, 47))  # one row per layer
    assert "experts priced: the router's choices per layer (90.0-106.0 per layer" in text
    assert _row(text, "embed") and _row(text, "head")


def test_heatmap_names_the_outside_figures_and_keeps_the_layer_scale():
    step = SCRIPTED["last_decode"]
    text = render.layers_heatmap(typed_step(step), "chip", 160).plain
    out = {o["part"]: o for o in step["outside"]}
    e0, e1 = (f"{u:.0f}" for u in out["embed"]["chip_us"])
    assert f"embed {e0} / {e1}" in text and "head" in text
    top = max(layer["chip_us"][1] for layer in step["layers"])
    assert f"scale 0 ██████████████ {top:.0f} µs" in text  # the head (far larger) is not on the scale


def test_a_step_view_without_the_outside_fields_still_renders():
    step = copy.deepcopy(SCRIPTED["last_decode"])
    for key in ("outside", "chip_busy_us", "chip_wait_us", "submit_us", "experts_priced", "experts_rule"):
        step.pop(key)
    text = plain(render.layers_panel(typed_step(step))) + render.layers_heatmap(typed_step(step), "chip", 160).plain
    assert "0-47" in text and "embed" not in text and "per chip:" not in text and "outside the layers" not in text
