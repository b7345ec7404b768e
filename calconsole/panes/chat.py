"""Chat pane: multi-turn chat with streaming, cancel (Escape), sampling parameters
and per-request TTFT / TPOT / E2E (simulated ms: device time plus the host work booked on the clock).

Under each reply one line of figures (``figures_line``: TTFT, TPOT, tokens, stop); whether they are simulated
or wall ms is said once, in the pane's border title (``ChatPane.legend``). The full set of the last reply
(``metrics_line``: prompt and cached tokens, E2E, seed, host work, wall time streamed) is shown on demand
(Ctrl+R).

Generation runs in a thread worker; tokens reach the UI via ``call_from_thread``.
The log is capped and append-only; the reply being streamed lives in one
small Static that is updated at most ~15 times a second.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, cast

from rich.cells import cell_len
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.widgets import Button, Collapsible, Input, Label, RichLog, Static
from textual.widgets.input import Selection

from sim_backend.planes import (
    ChatRequest,
    DoneEvent,
    InferencePlane,
    RequestError,
    RequestResult,
    RequestStream,
    SamplingParams,
    Snapshot,
    TokenEvent,
    seed_or_random,
)

from ..widgets.inputs import HelpKeyInput
from ..widgets.render import numeric_limit, set_subtitle, timing_only_reason
from ..widgets.wraplog import WrapLog
from .focus import HELP_BINDING

#: the one-line banner (the transcript needs the rows), longest first: the longest that fits the pane is shown,
#: never cut to "…" (at 80x24 it read "synthetic weights: the text is not…"); the whole notice is its tooltip
SYNTHETIC_BANNER = "synthetic weights: the text is not meaningful"
SYNTHETIC_BANNERS = (SYNTHETIC_BANNER, "synthetic weights: text not meaningful", "synthetic weights (no meaning)",
                     "synthetic weights")
SYNTHETIC_NOTICE = ("Weights are synthetic: the text is not meaningful. Tokens, timings and KV are real "
                    "products of the simulated run. Times are simulated ms: device time plus the host work "
                    "booked on the clock (modeled by default, --host-time).")
#: the dense pilot bundle (real GGUF weights): replies are the small model's own
REAL_BANNER = "real weights: the dense pilot (C3), not the product's model"
REAL_BANNERS = (REAL_BANNER, "real weights: the dense pilot (C3)", "real weights: pilot (C3)", "real weights")
REAL_NOTICE = ("Real weights (the pilot bundle's GGUF, a small dense model run by the simulator's numerics): replies "
               "are that model's own, not Qwen3-30B-A3B's. Times are simulated ms: device time plus the host work "
               "booked on the clock (modeled by default, --host-time).")
#: a timing-only device (--timing-only): no model runs at all, whatever weights the bundle names
TIMING_BANNER = "timing-only: tokens from a seeded generator, no model"
TIMING_BANNERS = (TIMING_BANNER, "timing-only: seeded tokens, no model", "timing-only: no model", "timing-only")
TIMING_NOTICE = ("The device runs timing-only (--timing-only): no numerics run and no logits come back; every "
                 "token is drawn by a seeded generator, so the text comes from no model. Steps, KV and timings are "
                 "priced as with numerics (prefill prices the expected experts, no router runs). Times are "
                 "simulated ms: device time plus the host work booked on the clock (modeled by default, "
                 "--host-time).")
STREAM_UPDATE_S = 1 / 10
STREAM_TAIL_CHARS = 600  # live stream box shows the last characters of the reply
CANCEL_GRACE_S = 10.0  # after a no-progress cancel, how long to wait for the request to end
NO_PROGRESS_S = 300.0  # a request that streams nothing for this long is cancelled (host wall s)
LOG_MAX_LINES = 2000
#: replies whose full figures the pane keeps (Ctrl+R shows the last one)
FULL_FIGURES_KEPT = 200

#: the pane's reply length; every other default comes from SamplingParams() (the engine's)
DEFAULT_MAX_TOKENS = 128

# (input id, label, parser, the engine's parameter name)
PARAMS = (
    ("p-temperature", "temp", float, "temperature"),
    ("p-top-k", "top_k", int, "top_k"),
    ("p-top-p", "top_p", float, "top_p"),
    ("p-min-p", "min_p", float, "min_p"),
    ("p-max-tokens", "max_tok", int, "max_tokens"),
    ("p-seed", "seed", int, "seed"),
    ("p-repeat-penalty", "rep_pen", float, "repeat_penalty"),
    ("p-presence", "pres", float, "presence_penalty"),
    ("p-frequency", "freq", float, "frequency_penalty"),
    ("p-stop", "stop", str, "stop"),
)


def param_defaults() -> dict[str, str]:
    """Each parameter input's default text (input id -> value): SamplingParams() for the sampling
    values, DEFAULT_MAX_TOKENS, no stop strings; an empty seed means a random one."""
    sp = SamplingParams()
    vals: dict[str, object] = {"max_tokens": DEFAULT_MAX_TOKENS, "stop": ""}
    out = {}
    for pid, _, _, name in PARAMS:
        v = vals[name] if name in vals else getattr(sp, name)
        out[pid] = "" if v is None else str(v)
    return out


PARAM_INPUT = {name: pid for pid, _, _, name in PARAMS}
PARAM_HELP = {"seed": "seed (empty or -1: a random one, shown under the reply; another negative is read modulo "
                      "2**32, as llama-server: -5 is 4294967291)",
              "stop": "stop strings, separated by |", "max_tokens": "max_tokens (the reply stops at the context end)"}


class ChatPane(Vertical):
    """Chat with the simulated model through the inference plane only."""

    #: keys the help lists that are not bindings of the pane (the input's own)
    HELP_KEYS = (("enter", "send the message"),)

    BINDINGS = [
        HELP_BINDING,
        Binding("escape", "cancel", "cancel", priority=True),  # short: at 80 columns the footer has 5 keys
        Binding("ctrl+l", "new_chat", "new chat"),
        # the sampling panel had no key: it opens on its first field, and closes back to the message input
        Binding("ctrl+s", "toggle_params", "sampling"),
        # one line of figures under a reply (the transcript keeps its rows at 80x24); the full set on demand
        Binding("ctrl+r", "toggle_details", "figures", tooltip="the last reply's full figures: prompt and cached "
                "tokens, E2E, seed, host work, wall time streamed"),
        # the input keeps focus: the transcript scrolls from it (one footer entry for both keys);
        # priority, as Input binds PageUp/PageDown itself (to scroll its one line)
        Binding("pageup", "scroll_log(-1)", "scroll", key_display="pgup/pgdn", priority=True),
        Binding("pagedown", "scroll_log(1)", "scroll", show=False, priority=True),
    ]

    def __init__(self, inference: InferencePlane, **kw: Any) -> None:
        super().__init__(**kw)
        self.inference = inference
        self.history: list[dict[str, Any]] = []  # the conversation: ChatRequest.messages
        self.handle: RequestStream | None = None
        self._stream_text = ""
        self._stream_lines: int | None = None  # wrapped height of the live reply box as last laid out
        self._submitting = False
        self._wall_start = time.monotonic()
        self._restored: str | None = None  # the prompt _restore_prompt put back in the input
        # the device's numeric limit (new prompt tokens; 0: timing-only device; None: not known yet / no device)
        self._numeric_limit: int | None = None
        #: the full figures (``metrics_line``) of each reply so far, oldest first (bounded); Ctrl+R shows the last
        self.full_figures: deque[str] = deque(maxlen=FULL_FIGURES_KEPT)

    @property
    def wall_clock(self) -> bool:
        """True when the figures are wall ms (a real server, measured by this console as its client)."""
        return bool(getattr(self.inference, "server_kind", None))

    def legend(self) -> str:
        """The border title: the pane's name and, once, the clock its figures are in."""
        return f"Chat · figures in {'wall' if self.wall_clock else 'sim'} ms (Ctrl+R: all)"

    def compose(self) -> ComposeResult:
        kind = getattr(self.inference, "server_kind", None)  # a real server (llama-server): its own model
        if kind:
            notice = Banner((f"{kind}: the server's own model and weights · times are wall ms",
                             f"{kind}: its own model · wall ms", f"{kind}: its own model"),
                            id="chat-notice", classes="dim")
            notice.tooltip = (f"Replies come from the {kind}'s model. Under each reply: the server's timings "
                              "(prompt / predicted ms, its wall clock) and TTFT / TPOT / E2E measured by this "
                              "console as client (wall ms).")
        else:
            notice = Banner(*self._banner(getattr(self.inference, "numerics", True)), id="chat-notice",
                            classes="dim")
        yield notice
        # WrapLog: re-wraps on resize, renders a long reply in slices (keys stay responsive at its end)
        # not focusable: PgUp / PgDn scroll it from the input (and the mouse wheel), so Tab from the input goes
        # to the sampling panel, not to the transcript
        log = WrapLog(id="chat-log", max_lines=LOG_MAX_LINES, auto_scroll=True, min_width=20)
        log.can_focus = False
        yield log
        yield Static("", id="chat-stream")  # shown while a reply streams
        yield Static("", id="chat-status", classes="dim")  # shown while it has something to say
        yield Static("", id="chat-details", classes="dim")  # the last reply's full figures (Ctrl+R)
        with Collapsible(title="sampling parameters", collapsed=True, id="chat-params"):
            # label + borderless input pairs, two per row: each value gets ~1/3 of the pane, not 5 cells
            with Grid(id="param-grid"):
                for pid, label, _, name in PARAMS:
                    default = param_defaults()[pid]
                    yield Label(label, classes="param-label")
                    # no select-all on focus: a refused field is focused, and its value under the selection
                    # on the red mark read as blank
                    yield HelpKeyInput(default, id=pid, classes="param-input", compact=True, select_on_focus=False,
                                tooltip=PARAM_HELP.get(name, name), placeholder="none" if default == "" else "")
            yield Button("reset to defaults", id="p-reset", compact=True,
                         tooltip="every sampling parameter back to its default (Ctrl+L keeps them)")
        yield ChatInput(placeholder=PLACEHOLDERS[0], id="chat-input", compact=True)

    def _banner(self, numerics: bool) -> tuple[tuple[str, ...], str]:
        """(banner variants, tooltip) for the device's mode: timing-only before the weights (a timing-only
        device said "synthetic weights" though no model ran), then real (the pilot) or synthetic weights."""
        if not numerics:
            return TIMING_BANNERS, TIMING_NOTICE
        if getattr(self.inference, "weights", "synthetic") == "real":
            return REAL_BANNERS, REAL_NOTICE
        return SYNTHETIC_BANNERS, SYNTHETIC_NOTICE

    # --- parameters ---------------------------------------------------------------

    def read_params(self) -> tuple[SamplingParams, int | str, tuple[str, ...]]:
        """The parameter inputs as the request's values (nothing is checked here).

        A number that does not parse is passed on as its text, so the engine refuses it
        (``InvalidRequestError`` naming the parameter) exactly as any other bad value: the
        pane's errors and the engine's read the same and count in the same ``rejected``.
        An empty seed, or llama-server's -1, means a random one.
        """
        vals: dict[str, Any] = {}
        for pid, _, parser, _ in PARAMS:
            raw = self.query_one(f"#{pid}", Input).value.strip()
            if parser is str:
                vals[pid] = raw
            elif raw == "" and pid == "p-seed":
                vals[pid] = None
            else:
                try:
                    vals[pid] = parser(raw)
                except ValueError:
                    vals[pid] = raw
        vals["p-seed"] = seed_or_random(vals["p-seed"])  # -1: a random one, as llama-server
        sp = SamplingParams(temperature=vals["p-temperature"], top_k=vals["p-top-k"], top_p=vals["p-top-p"],
                            min_p=vals["p-min-p"], repeat_penalty=vals["p-repeat-penalty"],
                            presence_penalty=vals["p-presence"], frequency_penalty=vals["p-frequency"],
                            seed=vals["p-seed"])
        stops = tuple(s for s in vals["p-stop"].split("|")) if vals["p-stop"] else ()
        return sp, vals["p-max-tokens"], stops

    # --- sending ------------------------------------------------------------------

    @on(Input.Submitted, "#chat-input")
    def send(self, event: Input.Submitted) -> None:
        text = event.value
        if not text.strip():
            return
        if self.handle is not None or self._submitting:
            self.notify("a reply is still streaming: Esc cancels it", severity="warning")
            return
        sp, max_tokens, stops = self.read_params()
        self._mark_param(None)
        # an unparsed max_tokens stays text on purpose: the engine refuses it by name, like any bad value
        req = ChatRequest(messages=tuple(self.history + [{"role": "user", "content": text}]),
                          max_tokens=cast(Any, max_tokens), sampling=sp, stop=stops, client="chat-pane")
        event.input.value = ""
        self._restored = None
        self._show_details(False)  # they were the previous reply's
        self._submitting = True  # set now: the handle only exists once the worker has submitted
        # the "you ..." line is written once the request is admitted (_on_started): a refused send leaves the
        # prompt in the input to edit, and each resend had added another "you ..." line
        self._set_status("submitting…")
        self._generate(req, text)

    @work(thread=True, group="chat", exit_on_error=False)
    def _generate(self, req: ChatRequest, prompt: str) -> None:
        """Runs on a worker thread: submit, then forward events to the UI thread (every path ends
        in exactly one of _on_refused / _on_done / _on_abandoned, which free the pane)."""
        app = self.app
        try:
            handle = self.inference.submit(req)
        except RequestError as e:
            app.call_from_thread(self._on_refused, e, prompt)
            return
        app.call_from_thread(self._on_started, req, handle, prompt)
        # Pieces are batched: at most ~15 UI updates a second however fast tokens come
        # (fast pacing streams thousands of tokens a second; one UI call each would flood the loop).
        pending: list[str] = []
        last_flush = last_event = time.monotonic()
        while True:
            ev = handle.next_event(STREAM_UPDATE_S)
            now = time.monotonic()
            if isinstance(ev, TokenEvent):
                pending.append(ev.text)
                last_event = now
            if pending and (ev is None or isinstance(ev, DoneEvent) or now - last_flush >= STREAM_UPDATE_S):
                app.call_from_thread(self._on_piece, "".join(pending))
                pending.clear()
                last_flush = now
            if isinstance(ev, DoneEvent):
                app.call_from_thread(self._on_done, req, ev.result, prompt)
                return
            if ev is None and now - last_event > NO_PROGRESS_S:
                handle.cancel(f"chat pane: no progress for {NO_PROGRESS_S:.0f} s")
                try:  # the cancel normally ends the request within a device step
                    app.call_from_thread(self._on_done, req, handle.result(CANCEL_GRACE_S), prompt)
                except TimeoutError:
                    app.call_from_thread(self._on_abandoned, handle.id, prompt)
                return

    def _on_refused(self, e: RequestError, prompt: str) -> None:
        self._submitting = False
        msg = f"{e.error_type}: {e}"
        self._restore_prompt(prompt)
        pid = PARAM_INPUT.get(getattr(e, "param", None) or "")
        # once, on the status line by the input (seen even when the log is scrolled); it was also written to
        # the transcript, so every refusal read twice
        self._set_status(Text(msg, style="bold red"))
        if pid is not None:
            self._mark_param(pid)

    def _mark_param(self, pid: str | None) -> None:
        """Show the refused field (open the collapsed panel, mark and focus it); None clears the mark."""
        for inp in self.query(".param-input"):
            inp.set_class(inp.id == pid, "-refused")
        if pid is not None:
            self.query_one("#chat-params", Collapsible).collapsed = False
            self.query_one(f"#{pid}", Input).focus()

    @on(Input.Changed, ".param-input")
    def _param_edited(self, event: Input.Changed) -> None:
        event.input.remove_class("-refused")

    def _on_abandoned(self, request_id: int, prompt: str) -> None:
        """The request made no progress and did not end after cancel: free the pane anyway."""
        self.handle = None
        self._submitting = False
        self._set_stream(None)
        self._set_status("")
        self._log_error(f"request {request_id}: no progress for {NO_PROGRESS_S:.0f} s; cancelled and abandoned")
        self._restore_prompt(prompt)

    def on_mount(self) -> None:
        self.border_title = self.legend()
        self._set_stream(None)
        self._set_status("")
        self._show_details(False)

    def _on_started(self, req: ChatRequest, handle: RequestStream, prompt: str) -> None:
        self.query_one("#chat-log", RichLog).write(Text.assemble(("you ", "bold cyan"), prompt))  # wraps (WrapLog)
        self.handle = handle
        self._submitting = False
        self._stream_text = ""
        self._wall_start = time.monotonic()
        self._set_status(
            f"request {handle.id}: prompt {handle.prompt_n} tokens (template included) · streaming… Esc cancels")

    def _on_piece(self, text: str) -> None:
        """A batch of streamed text (already rate-limited by the worker)."""
        self._stream_text += text
        # only the tail is live-rendered: the box is a few lines high, and re-wrapping a whole long
        # reply on every update would make typing lag; the full reply goes to the log when done
        tail = self._stream_text[-STREAM_TAIL_CHARS:]
        prefix = "model …" if len(self._stream_text) > STREAM_TAIL_CHARS else "model "
        self._set_stream(Text.assemble((prefix, "bold green"), tail))

    def _on_done(self, req: ChatRequest, result: RequestResult, prompt: str) -> None:
        self.handle = None
        self._submitting = False
        log = self.query_one("#chat-log", RichLog)
        self._set_stream(None)
        reply = Text.assemble(("model ", "bold green"), result.text)
        if result.status == "cancelled":
            reply.append(f"  [cancelled: {(result.error or {}).get('message', '')}]", style="bold yellow")
        elif result.status == "failed":
            reply.append(f"  [failed: {(result.error or {}).get('type_name', '')}: "
                         f"{(result.error or {}).get('message', '')}]", style="bold red")
        log.write(reply)
        log.write(Text(figures_line(result), style="grey62"))
        self.full_figures.append(metrics_line(result, time.monotonic() - self._wall_start, self._numeric_limit))
        self._set_status("")
        if result.status == "finished":
            self.history.extend([{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": result.text}])
        elif result.status == "cancelled":
            self._restore_prompt(prompt)
            self._set_status(Text("prompt restored, selected: Enter resends it, typing replaces it, Ctrl+L clears "
                                  "it", style="grey62"))

    def _restore_prompt(self, prompt: str) -> None:
        """The prompt back in the input, selected: Enter resends it, typing replaces it (a new message typed
        after a cancel had been appended to it: "Count to tenHi"), an arrow key or End edits it, and Ctrl+L
        clears it while it is unchanged (``action_new_chat``). The cursor is at its end."""
        inp = self.query_one("#chat-input", Input)
        inp.value = prompt
        inp.selection = Selection(0, len(prompt))
        self._restored = prompt

    def _set_status(self, content: str | Text) -> None:
        """The line by the input; hidden while empty (the transcript gets the row)."""
        status = self.query_one("#chat-status", Static)
        status.update(content)
        status.display = bool(content.plain if isinstance(content, Text) else content)

    def _set_stream(self, content: Text | None) -> None:
        """The live reply box under the transcript; None hides it. Laid out again only when its wrapped
        height changes (below its max-height): a layout pass arranges every pane's widgets again, several ms
        of UI time at 120x36, ten times a second while a reply streams."""
        stream = self.query_one("#chat-stream", Static)
        width, height = stream.content_region.size
        lines = len(content.wrap(self.app.console, width)) if content is not None and width > 0 else None
        before = self._stream_lines
        # at its max-height the box shows the text's last rows whatever their number: no new height either
        same = lines is not None and before is not None and (lines == before or min(lines, before) >= height > 0)
        stream.update(content or "", layout=not same)
        self._stream_lines = lines
        stream.display = content is not None

    def _log_error(self, msg: str) -> None:
        self.query_one("#chat-log", RichLog).write(Text(msg, style="bold red"))

    # --- actions ------------------------------------------------------------------

    def action_cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel("cancelled from the chat pane (Esc)")

    def action_toggle_details(self) -> None:
        """Ctrl+R: show the last reply's full figures under the transcript; again, hide them."""
        if not self.full_figures:
            self.notify("no reply yet: the figures come under the first one", timeout=3)
            return
        self._show_details(not self.query_one("#chat-details", Static).display)

    def _show_details(self, on: bool) -> None:
        details = self.query_one("#chat-details", Static)
        if on and self.full_figures:
            details.update(Text.assemble(("last reply (Ctrl+R hides):", "bold"), self.full_figures[-1]))
        details.display = on and bool(self.full_figures)

    def action_scroll_log(self, pages: int) -> None:
        """PageUp / PageDown: scroll the transcript a page while the input keeps focus."""
        log = self.query_one("#chat-log", RichLog)
        (log.scroll_page_down if pages > 0 else log.scroll_page_up)(animate=False)

    def action_toggle_params(self) -> None:
        """Ctrl+S: open the sampling panel and focus its first field; from inside the open panel, close it
        and focus the message input again (its fields keep their values)."""
        panel = self.query_one("#chat-params", Collapsible)
        focused = self.screen.focused
        if not panel.collapsed and focused is not None and panel in focused.ancestors:
            panel.collapsed = True
            self.query_one("#chat-input", Input).focus()
            return
        panel.collapsed = False
        first = self.query_one(f"#{PARAMS[0][0]}", Input)
        self.call_after_refresh(first.focus)  # once the opened panel's fields can take focus

    @on(Button.Pressed, "#p-reset")
    def reset_params(self) -> None:
        """Every parameter input back to its default (param_defaults); marks cleared."""
        for pid, value in param_defaults().items():
            self.query_one(f"#{pid}", Input).value = value
        self._mark_param(None)
        self.notify("sampling parameters reset to their defaults")

    def action_new_chat(self) -> None:
        """Ctrl+L: a new conversation (history and transcript cleared, sampling parameters kept). A prompt the
        pane put back in the input (cancelled or refused) goes too while it is unchanged; text the user typed
        stays (it is the next message)."""
        if self.handle is not None:
            self.handle.cancel("new chat started")
        self.history.clear()
        self.query_one("#chat-log", RichLog).clear()
        inp = self.query_one("#chat-input", Input)
        if self._restored is not None and inp.value == self._restored:
            inp.value = ""
        self._restored = None
        self._set_status("")

    def on_unmount(self) -> None:
        # a closed pane is a vanished client: cancel what it started
        if self.handle is not None:
            self.handle.cancel("chat pane closed")

    def update_snapshot(self, snap: Snapshot) -> None:
        d = snap.device
        if d is None:  # a server without a device (llama-server)
            set_subtitle(self, f"{snap.source} · model {snap.server.model if snap.server is not None else '?'}")
            return
        set_subtitle(self, d.mode + (f" (lease: {d.lease_holder})" if d.lease_holder else ""))
        self._numeric_limit = numeric_limit(d)
        if getattr(self.inference, "server_kind", None) is None:  # the device's mode, as the snapshot says it
            variants, tip = self._banner(d.numerics)
            banner = self.query_one("#chat-notice", Banner)
            banner.set_variants(variants)
            banner.tooltip = tip


class Banner(Static):
    """One line showing the longest of its ``variants`` (longest first) that fits its width, never cut to "…";
    the last variant when none fits."""

    def __init__(self, variants: tuple[str, ...], tooltip: str | None = None, **kw: Any) -> None:
        super().__init__(variants[0], **kw)
        self.variants = tuple(variants)
        if tooltip is not None:
            self.tooltip = tooltip

    def set_variants(self, variants: tuple[str, ...]) -> None:
        if tuple(variants) != self.variants:
            self.variants = tuple(variants)
            self._fit()

    def on_resize(self) -> None:
        self._fit()

    def _fit(self) -> None:
        w = self.size.width
        fits = [v for v in self.variants if w <= 0 or cell_len(v) <= w]
        self.update(fits[0] if fits else self.variants[-1])


#: the chat input's placeholder, longest first: the longest that fits the input is shown, whole (at 80 and 100
#: columns the first read "... Ctrl+S" and "... PgUp/PgDn", cut); the footer and the help name every key
PLACEHOLDERS = ("Type a message, Enter to send · Esc cancels · Ctrl+L new chat · Ctrl+S sampling · PgUp/PgDn scroll",
                "Type a message, Enter to send · Esc cancels · Ctrl+L new chat · Ctrl+S sampling",
                "Type a message, Enter to send · Esc cancels · Ctrl+L new chat",
                "Type a message, Enter to send · Esc cancels", "Type a message, Enter to send", "Type a message")


class ChatInput(HelpKeyInput):
    """The chat's message input: "?" on an empty input opens the help (``HelpKeyInput``), otherwise it is typed.
    Its placeholder is the longest of ``PLACEHOLDERS`` that fits its width."""

    def on_resize(self) -> None:
        w = self.content_size.width
        fits = [p for p in PLACEHOLDERS if w <= 0 or cell_len(p) < w]  # a cell left for the cursor at its end
        placeholder = fits[0] if fits else PLACEHOLDERS[-1]
        if placeholder != self.placeholder:
            self.placeholder = placeholder


def figures_line(result: RequestResult) -> str:
    """The one dim line under a reply: ``TTFT 127 ms · TPOT 17.1 ms · 128 tok · limit`` (the stop type);
    a cancelled or failed reply says so and what is defined so far; ``timing-only`` when the tokens did not
    come from the model. Milliseconds are sim or wall as the pane's legend says (``ChatPane.legend``); the
    full set is ``metrics_line``."""
    t = result.timings
    if result.status == "finished":
        parts = [f"TTFT {_short_ms(t.ttft_ms)}", f"TPOT {_short_ms(t.tpot_ms)}", f"{t.predicted_n} tok",
                 result.stop_type]
    else:
        parts = [f"{result.status} after {t.predicted_n} tok",
                 f"TTFT {_short_ms(t.ttft_ms)}" if t.predicted_n and t.ttft_ms is not None else "no token came"]
    if getattr(t, "time_base", "simulated") != "wall" and not t.numerics:
        parts.append("timing-only")
    return "  " + " · ".join(parts)


def _short_ms(v: float | None) -> str:
    """127 ms, 17.1 ms: three significant figures at most (a figure line is read, not diffed)."""
    if v is None:
        return "-"
    return f"{v:.0f} ms" if abs(v) >= 100 else f"{v:.1f} ms"


def metrics_line(result: RequestResult, wall_s: float, limit: int | None = None) -> str:
    """The dim line under a reply: token counts, TTFT / TPOT / E2E (sim ms), stop, seed; for a timing-only
    reply, why (``render.timing_only_reason``; ``limit``: the device's numeric limit in new prompt tokens, 0
    when it runs timing-only, None when not known).

    TPOT and E2E are defined for finished replies only (as the observation pane counts them):
    a cancelled or failed reply shows what is defined so far (TTFT once a token came, tokens
    generated so far) and says so. ``wall_s``: host wall seconds the reply streamed.
    """
    t = result.timings
    head = f"  prompt {t.prompt_n + t.cache_n} tok (cached {t.cache_n}) · "
    if getattr(t, "time_base", "simulated") == "wall":  # a real server: its timings, and ours as client
        if result.status == "finished":
            body = (f"generated {t.predicted_n} tok · server prompt {_ms(t.prompt_ms)} predicted "
                    f"{_ms(t.predicted_ms)} (server wall) · client TTFT {_ms(t.ttft_ms)} TPOT {_ms(t.tpot_ms)} "
                    f"E2E {_ms(t.e2e_ms)} (client wall) · stop {result.stop_type}")
        else:
            ttft = f"client TTFT {_ms(t.ttft_ms)}" if t.ttft_ms is not None else "no token came"
            body = f"{result.status} after {t.predicted_n} pieces · {ttft} (client wall)"
        return head + body + f" · streamed in {wall_s:.2f} s wall"
    if result.status == "finished":
        body = (f"generated {t.predicted_n} tok · TTFT {_ms(t.ttft_ms)} · TPOT {_ms(t.tpot_ms)} · "
                f"E2E {_ms(t.e2e_ms)} · stop {result.stop_type}")
    else:
        ttft = f"TTFT {_ms(t.ttft_ms)}" if t.predicted_n and t.ttft_ms is not None else "no token came"
        body = (f"{result.status} after {t.predicted_n} tok · {ttft} · "
                f"TPOT/E2E are for finished replies only")
    return (head + body + f" · seed {result.seed} · sim ms (device time + {t.host_time} host work)"
            + ("" if t.numerics else " · timing-only (tokens not from the model: "
               + timing_only_reason(t.prompt_n, t.cache_n, limit, new_chat_key="Ctrl+L",
                                    recorded=t.timing_only_reason) + ")")
            + f" · streamed in {wall_s:.2f} s wall")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"
