"""The ``?`` help screen: keys of the focused pane and the global ones, what the figures mean, thresholds."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ..settings import Settings, settings_path

FIGURES = (
    ("sim", "simulated device time: what the cost model, calibrated to the real device, says the NPU takes "
            "(step and layer times, TTFT / TPOT / ITL / E2E, busy %, tok/s, the sim clock)"),
    ("wall", "measured host time on this machine (compute of a step, drains, waits, host CPU and RSS)"),
    ("host work", "the serving host's work per token on the sim clock: modeled by default (0.204 ms a token, "
                  "fitted to the real system's end-to-end figure), or this machine's measured work with "
                  "--host-time measured"),
    ("busy", "share of the simulated time of the last ~1 s interval the board (or chip) spent executing; "
             "0 % when the simulated clock did not move (nothing ran)"),
    ("DRAM / SRAM", "used / reserved / physical bytes per chip: █ used, ▒ reserved and unused, ░ free"),
    ("KV", "KV cache cells used of the context capacity (tokens)"),
    ("P95", "over the recent requests (TTFT, ITL: every request with a token; TPOT, E2E: finished ones)"),
    ("history", "graphs over the last 1 / 5 / 15 min; x axis: host wall seconds before now"),
    ("heatmap", "per-layer simulated µs of the chosen step, one colour scale for all rows (legend below it)"),
    ("embed / head", "per-layer table rows for the ops outside the layers: before layer 0 the embedding (chip0 "
                     "only) and its broadcast, after the last layer final norm, LM head and logits; each chip's "
                     "busy (all rows) + wait at syncs + submit = the step's infer time"),
)


#: words of this device and its report the console uses; the README's glossary says the same
GLOSSARY = (
    ("F1 / F2 / F3 (keys)", "focus the observation / chat / maintenance pane; ? (on an empty input) is this help"),
    ("timing-only", "a reply whose tokens come from a seeded generator, not from the model: the device still "
                    "prices every op (the figures stay real) but computes no values. A request runs so when it "
                    "must prefill more new prompt tokens than the numeric limit (512 by default; "
                    "--numeric-limit N sets another), when the device runs --timing-only, while "
                    "the numerics start (the top bar says \"numerics starting\"; kernels compile at a first "
                    "start), when the numerics worker is down, and when it continues a timing-only turn (its "
                    "cached prefix holds no values: Ctrl+L starts a new conversation). The reply's line says "
                    "which (serve and chat --json: timings.timing_only_reason)"),
    ("facts.md F1..F10", "a section of sim_backend/facts.md, the facts about the real device the simulator "
                        "follows (F4 the memory map, F7 the cost figures, F8 the stage times)"),
    ("calbin", "the compiled device program: the model's prefill and decode sub-models as the NPU runs them; "
               "the bundle is the calbin with its manifest and weights"),
    ("C0 / C1 / C2 / C3", "status of a capability in the device report: C0 used today, C1 in the SDK but unused, "
                          "C2 buildable by us, C3 needs the vendor (e.g. a batch-8 decode calbin); anything but "
                          "C0 is a what-if, labelled wherever it is shown"),
    ("S8 V-cache", "a KV-cache layout the SDK has but the product does not use (a C1 what-if): 4/3 the tokens"),
    ("job / device step", "one prefill chunk or one decode step run on the device; 'steps' counts those done "
                          "(not requests, and not processes as npu-smi's running jobs are)"),
    ("fault xN", "slow_chipK xN: chip K runs N times slower; ccu_exception / link_error / kv_exhaustion xN: "
                 "the next N jobs it hits"),
    ("pacing A/S", "the device runs paced at S simulated s per wall s; A is what this host achieved "
                   "(below S: the host is behind, replies stream slower than the sim figures)"),
)


def _keys_table(title: str, bindings: list[tuple[str, str]]) -> Group:
    t = Table(box=None, padding=(0, 2), show_header=False)
    t.add_column("key", style="bold cyan", no_wrap=True)
    t.add_column("action")
    for k, d in bindings:
        t.add_row(k, d)
    return Group(Text(title, style="bold"), t)  # a title of its own: a Table title wraps at the table width


def help_renderable(pane_title: str, pane_keys: list[tuple[str, str]], global_keys: list[tuple[str, str]],
                    settings: Settings, extra: str = "") -> Group:
    """The help screen's content (pure: tests read it as text)."""
    parts: list[RenderableType] = [_keys_table(f"{pane_title}: keys", pane_keys or [("-", "no keys of its own")])]
    if extra:
        parts.append(Text(extra, style="yellow"))
    parts += [Text(""), _keys_table("global keys", global_keys), Text("")]
    f = Table(box=None, padding=(0, 2), show_header=False)
    f.add_column(style="bold magenta", no_wrap=True)
    f.add_column()
    for k, d in FIGURES:
        f.add_row(k, d)
    parts += [Text("what the figures mean", style="bold"), f, Text("")]
    w = Table(box=None, padding=(0, 2), show_header=False)
    w.add_column(style="bold magenta", no_wrap=True)
    w.add_column()
    for k, d in GLOSSARY:
        w.add_row(k, d)
    parts += [Text("words", style="bold"), w, Text("")]
    th = Table(box=None, padding=(0, 2))
    for col in ("name", "warn", "crit", "unit", "meaning"):
        th.add_column(col, justify="right" if col in ("warn", "crit") else "left")
    for name, t in settings.thresholds.items():
        low = "" if t.higher_is_worse else " (low is bad)"
        th.add_row(name, f"{t.warn:g}", f"{t.crit:g}", t.unit, t.meaning + low)
    parts += [Text("thresholds in force (yellow at warn, red at crit)", style="bold"), th]
    parts.append(Text(f"SLO: TTFT {settings.slo_ttft_ms:g} ms, TPOT {settings.slo_tpot_ms:g} ms (sim) · settings file: "
                      f"{settings.path or settings_path()} (Ctrl+P \"save settings\")", style="grey62"))
    parts.append(Text("Esc, q or ? closes this screen.", style="grey50"))
    return Group(*parts)


class HelpScreen(ModalScreen[None]):
    """A modal listing keys, figures and thresholds; Esc / q / ? close it."""

    BINDINGS = [Binding("escape", "dismiss", "close"), Binding("q", "dismiss", "close", show=False),
                Binding("question_mark", "dismiss", "close", show=False)]

    def __init__(self, content: Group) -> None:
        super().__init__()
        self.content = content

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as v:
            v.border_title = "calconsole help"
            yield Static(self.content, id="help-text")

    async def action_dismiss(self, result: None = None) -> None:
        self.dismiss(None)
