"""One device step, layer by layer: the 48-row table, the heatmap, the per-chip and experts lines."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.text import Text

from sim_backend.planes.snapshot import StepView

from .common import bar, plain_table

HEAT_WIDTH = 12  # cells of the per-layer heat bar
NO_STEP = "no step yet: send a chat message to see per-layer timings"


def layers_uniform(step: StepView) -> bool:
    """Every layer of the step costs the same (within 1%)."""
    per_layer = [max(layer.chip_us) for layer in step.layers]
    return bool(per_layer) and max(per_layer) - min(per_layer) <= 0.01 * max(per_layer)


def layers_panel(step: StepView, max_rows: int | None = None, capacity: int = 1) -> Any:
    """48-row per-layer table: chip0 / chip1 simulated µs, a heat bar and the slowest category.

    ``capacity``: the bundle's decode batch; a batched step (``batch_seq_ids``) of a batch-N bundle is
    titled as one: its rows and seqs, its times the whole step's.

    The heat bar spans the step's fastest..slowest layer; when every layer
    costs the same (a decode touches 8 experts in every layer) it says so
    instead of drawing 48 identical full bars.
    """
    if not step.layers:
        return Text(NO_STEP, style="grey50")
    layers = step.layers
    per_layer = [max(layer.chip_us) for layer in layers]
    lo, hi = min(per_layer), max(per_layer)
    uniform = layers_uniform(step)
    riders = step.batch_seq_ids
    what = (f"batched {step.kind}: {len(riders)}/{capacity} rows, 1 tok each" if capacity > 1 and riders else
            f"{step.kind}: {step.n_tokens} tok @ ctx {step.past_len}")
    title = (f"last {what} · "
             f"{(step.sim_us or 0) / 1e3:.2f} ms sim (h2d {(step.h2d_us or 0) / 1e3:.3f} / "
             f"infer {(step.infer_us or 0) / 1e3:.2f} / "
             f"d2h {(step.d2h_us or 0) / 1e3:.3f} ms) · {step.compute_wall_ms or 0:.1f} ms wall to compute"
             + (" · all layers equal" if uniform else " · heat: fastest..slowest layer"))
    # title as its own line: a Table title wraps at the (narrow) table width. Narrow headers and a
    # fixed-width heat bar: the category column fits 120 columns (a long header widened "heat" to 29)
    t = plain_table()
    # min widths: in a narrow pane the long op list of the head row must shrink, not "embed" or a figure
    t.add_column("L", justify="right", no_wrap=True, min_width=5)
    n_chips = len(layers[0].chip_us)
    for c in range(n_chips):
        t.add_column(f"chip{c} µs", justify="right", no_wrap=True, min_width=len(f"chip{c} µs"))
    t.add_column("heat", width=HEAT_WIDTH if not uniform else None, no_wrap=True, min_width=9)
    # wrappable (the column rich shrinks: the head row lists 4-5 ops), never narrower than its header
    t.add_column("slowest category", overflow="ellipsis", min_width=len("slowest category"))
    outside = {o.part: o for o in step.outside}
    last = len(layers) - 1

    def outside_row(part: str, where: str) -> None:
        o = outside.get(part)
        if o is None:
            return
        # its ops in execution order, the costliest in bold (the LM head; in "embed", chip0's embedding
        # is what makes chip0's figure larger than chip1's)
        ops = Text(style="cyan", overflow="ellipsis", no_wrap=True)
        for i, name in enumerate(o.ops):
            ops.append((", " if i else "") + name, style="bold cyan" if name == o.slowest_op else "cyan")
        t.add_row(Text(part, style="cyan"), *[f"{u:.1f}" for u in o.chip_us], Text(where, style="grey50"), ops)

    outside_row("embed", "before L0")
    if uniform:  # 48 identical rows say less than one
        first = layers[0]
        t.add_row(f"0-{last}", *[f"{u:.1f}" for u in first.chip_us], Text("uniform", style="grey50"),
                  Text(first.slowest_category, style="magenta"))
    else:
        rows = layers if max_rows is None else layers[:max_rows]
        for layer, v in zip(rows, per_layer, strict=False):  # rows may be the first max_rows
            heat = bar((v - lo) / (hi - lo), HEAT_WIDTH, warn=0.7, crit=0.95)
            t.add_row(str(layer.layer), *[f"{u:.1f}" for u in layer.chip_us], heat,
                      Text(layer.slowest_category, style="magenta"))
    outside_row("head", f"after L{last}")
    parts: list[Any] = [Text(title, style="grey70"), t]
    foot = step_chips_line(step)
    if foot is not None:
        parts.append(foot)
    ex = experts_line(step)
    if ex is not None:
        parts.append(ex)
    return Group(*parts)


def step_chips_line(step: StepView) -> Text | None:
    """Per chip: busy (the table's embed + layer + head rows added up) + wait at syncs + submit = the
    step's infer time (simulated µs). None for a step view without the per-chip figures (an older server)."""
    busy, wait = step.chip_busy_us, step.chip_wait_us
    if not busy or len(wait) != len(busy) or step.submit_us is None:
        return None
    sep = " / "
    return Text(f"per chip: busy {sep.join(f'{b:.1f}' for b in busy)} (embed + {len(step.layers)} layers + head) "
                f"+ wait at syncs {sep.join(f'{w:.1f}' for w in wait)} + submit {step.submit_us:.1f} = infer "
                f"{step.infer_us or 0:.1f} µs sim", style="grey62")


def experts_line(step: StepView) -> Text | None:
    """How the step's MoE weights were priced: the router's per-layer choices or the expectation."""
    priced = step.experts_priced
    rule = step.experts_rule
    if not priced or rule is None:
        return None
    if not any(priced):  # a dense model (the pilot): no experts to price
        return Text("dense model: no experts (one MLP per layer, split over the chips)", style="grey62")
    lo, hi, mean = min(priced), max(priced), sum(priced) / len(priced)
    if rule == "expectation":
        return Text(f"experts priced: the expectation, {mean:.1f} per layer in every layer (timing-only: "
                    "no router ran, so no per-layer pattern)", style="grey62")
    spread = f"{mean:.1f} in every layer" if hi - lo < 0.05 else f"{lo:.1f}-{hi:.1f} per layer, mean {mean:.1f}"
    return Text(f"experts priced: the router's choices per layer ({spread}; a prefill's scaled to a trained "
                "router's mean)", style="grey62")


HEAT_STEPS = ("grey23", "dark_green", "green4", "green3", "yellow3", "dark_orange", "red1")


def heat_style(frac: float) -> str:
    """Colour of a heatmap cell on the one shared scale (0 = the scale's low end, 1 = its top)."""
    i = int(max(0.0, min(1.0, frac)) * (len(HEAT_STEPS) - 1) + 0.5)
    return HEAT_STEPS[i]


def layers_heatmap(step: StepView, by: str = "chip", width: int = 80) -> Any:
    """Layers x chips (``by`` "chip") or layers x op category (``by`` "category", summed over chips):
    one cell per layer, coloured on one scale from 0 to the step's largest cell (simulated µs), with
    the legend. A slow or faulted chip shows as a hotter row."""
    if not step.layers:
        return Text(NO_STEP, style="grey50")
    layers = step.layers
    rows: list[tuple[str, list[float]]]
    if by == "chip":
        rows = [(f"chip{c}", [lay.chip_us[c] for lay in layers]) for c in range(len(layers[0].chip_us))]
    else:
        cats: dict[str, list[float]] = {}
        for li, lay in enumerate(layers):
            for cat, per_chip in lay.category_us.items():
                cats.setdefault(cat, [0.0] * len(layers))[li] = float(sum(per_chip))
        rows = sorted(cats.items(), key=lambda kv: -sum(kv[1]))
    top = max((max(v) for _, v in rows), default=0.0) or 1.0
    label_w = max(len(name) for name, _ in rows) + 1
    cell = 2 if label_w + 2 * len(layers) + 12 <= width else 1
    out = Text()
    axis = Text(" " * label_w)
    for li in range(len(layers)):
        axis.append(f"{li:<{cell * 8}}" if li % 8 == 0 else "", style="grey50")
    out.append_text(axis[: label_w + cell * len(layers)])
    out.append("  layer\n", style="grey50")
    for name, vals in rows:
        out.append(f"{name:<{label_w}}", style="bold")
        for v in vals:
            out.append("█" * cell, style=heat_style(v / top))
        out.append(f"  max {max(vals):.0f} µs\n", style="grey62")
    legend = Text(" " * label_w + "scale 0 ")
    for i in range(len(HEAT_STEPS)):
        legend.append("██", style=HEAT_STEPS[i])
    # a category's cell is both chips' time: say so, or its max reads above the layer's own time
    legend.append(f" {top:.0f} µs sim per layer{', both chips summed' if by != 'chip' else ''} "
                  "(one scale for every row)", style="grey62")
    out.append_text(legend)
    outside = step.outside
    if outside:  # not cells on the scale: the LM head alone is ~6 layers and would wash the layers out
        sep = " / "
        out.append("\n" + " " * label_w + "outside the layers (rows in the table): "
                   + " · ".join(f"{o.part} {sep.join(f'{u:.0f}' for u in o.chip_us)}" for o in outside)
                   + f" µs ({sep.join(f'chip{c}' for c in range(len(outside[0].chip_us)))})", style="grey62")
    return out
