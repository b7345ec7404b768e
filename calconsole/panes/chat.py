"""Chat pane: multi-turn chat with streaming, cancel (Escape), sampling parameters
and per-request TTFT / TPOT / E2E (simulated device ms).

Generation runs in a thread worker; tokens reach the UI via ``call_from_thread``.
The log is capped and append-only; the reply being streamed lives in one
small Static that is updated at most ~15 times a second.
"""

from __future__ import annotations

import time
from typing import Any, cast

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.widgets import Collapsible, Input, Label, RichLog, Static

from sim_backend.planes import (
    ChatRequest,
    DoneEvent,
    RequestError,
    RequestStream,
    SamplingParams,
    TokenEvent,
)

from ..widgets.render import set_subtitle
from ..widgets.wraplog import WrapLog

SYNTHETIC_NOTICE = ("Weights are synthetic: the text is not meaningful. Tokens, timings and KV are real "
                    "products of the simulated run. Times are simulated device ms.")
STREAM_UPDATE_S = 1 / 10
STREAM_TAIL_CHARS = 600  # live stream box shows the last characters of the reply
CANCEL_GRACE_S = 10.0  # after a no-progress cancel, how long to wait for the request to end
NO_PROGRESS_S = 300.0  # a request that streams nothing for this long is cancelled (host wall s)
LOG_MAX_LINES = 2000

# (input id, label, default, parser, the engine's parameter name)
PARAMS = (
    ("p-temperature", "temp", "0.8", float, "temperature"),
    ("p-top-k", "top_k", "40", int, "top_k"),
    ("p-top-p", "top_p", "0.95", float, "top_p"),
    ("p-min-p", "min_p", "0.05", float, "min_p"),
    ("p-max-tokens", "max_tok", "128", int, "max_tokens"),
    ("p-seed", "seed", "", int, "seed"),
    ("p-repeat-penalty", "rep_pen", "1.0", float, "repeat_penalty"),
    ("p-presence", "pres", "0.0", float, "presence_penalty"),
    ("p-frequency", "freq", "0.0", float, "frequency_penalty"),
    ("p-stop", "stop", "", str, "stop"),
)
PARAM_INPUT = {name: pid for pid, _, _, _, name in PARAMS}
PARAM_HELP = {"seed": "seed (empty: a random one, shown under the reply)",
              "stop": "stop strings, separated by |", "max_tokens": "max_tokens (the reply stops at the context end)"}


class ChatPane(Vertical):
    """Chat with the simulated model through the inference plane only."""

    BINDINGS = [
        Binding("escape", "cancel", "cancel generation", priority=True),
        Binding("ctrl+l", "new_chat", "new chat"),
    ]

    def __init__(self, inference, **kw) -> None:
        super().__init__(**kw)
        self.inference = inference
        self.history: list[dict] = []
        self.handle: RequestStream | None = None
        self._stream_text = ""
        self._submitting = False
        self._wall_start = time.monotonic()

    def compose(self) -> ComposeResult:
        yield Static(SYNTHETIC_NOTICE, id="chat-notice", classes="dim")
        # WrapLog: re-wraps on resize, renders a long reply in slices (keys stay responsive at its end)
        yield WrapLog(id="chat-log", max_lines=LOG_MAX_LINES, auto_scroll=True, min_width=20)
        yield Static("", id="chat-stream")
        yield Static("", id="chat-status", classes="dim")
        with Collapsible(title="sampling parameters", collapsed=True, id="chat-params"):
            # label + borderless input pairs, two per row: each value gets ~1/3 of the pane, not 5 cells
            with Grid(id="param-grid"):
                for pid, label, default, _, name in PARAMS:
                    yield Label(label, classes="param-label")
                    yield Input(default, id=pid, classes="param-input", compact=True,
                                tooltip=PARAM_HELP.get(name, name), placeholder="none" if default == "" else "")
        yield Input(placeholder="Type a message, Enter to send · Esc cancels · Ctrl+L new chat", id="chat-input")

    # --- parameters ---------------------------------------------------------------

    def read_params(self) -> tuple[SamplingParams, int | str, tuple[str, ...]]:
        """The parameter inputs as the request's values (nothing is checked here).

        A number that does not parse is passed on as its text, so the engine refuses it
        (``InvalidRequestError`` naming the parameter) exactly as any other bad value: the
        pane's errors and the engine's read the same and count in the same ``rejected``.
        An empty seed means a random one.
        """
        vals: dict[str, Any] = {}
        for pid, _, _, parser, _ in PARAMS:
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
        self._submitting = True  # set now: the handle only exists once the worker has submitted
        log = self.query_one("#chat-log", RichLog)
        log.write(Text.assemble(("you ", "bold cyan"), text))
        self.query_one("#chat-status", Static).update("submitting…")
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
        app.call_from_thread(self._on_started, req, handle)
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
        self._log_error(msg)
        self.query_one("#chat-input", Input).value = prompt
        pid = PARAM_INPUT.get(getattr(e, "param", None) or "")
        # the status line sits by the input: a refusal is seen there even when the log is scrolled
        self.query_one("#chat-status", Static).update(Text(msg, style="bold red"))
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
        self.query_one("#chat-stream", Static).update("")
        self.query_one("#chat-status", Static).update("")
        self._log_error(f"request {request_id}: no progress for {NO_PROGRESS_S:.0f} s; cancelled and abandoned")
        self.query_one("#chat-input", Input).value = prompt

    def _on_started(self, req: ChatRequest, handle: RequestStream) -> None:
        self.handle = handle
        self._submitting = False
        self._stream_text = ""
        self._wall_start = time.monotonic()
        self.query_one("#chat-status", Static).update(
            f"request {handle.id}: prompt {handle.prompt_n} tokens (template included) · streaming… Esc cancels")

    def _on_piece(self, text: str) -> None:
        """A batch of streamed text (already rate-limited by the worker)."""
        self._stream_text += text
        # only the tail is live-rendered: the box is a few lines high, and re-wrapping a whole long
        # reply on every update would make typing lag; the full reply goes to the log when done
        tail = self._stream_text[-STREAM_TAIL_CHARS:]
        prefix = "model …" if len(self._stream_text) > STREAM_TAIL_CHARS else "model "
        self.query_one("#chat-stream", Static).update(Text.assemble((prefix, "bold green"), tail))

    def _on_done(self, req: ChatRequest, result, prompt: str) -> None:
        self.handle = None
        self._submitting = False
        log = self.query_one("#chat-log", RichLog)
        self.query_one("#chat-stream", Static).update("")
        reply = Text.assemble(("model ", "bold green"), result.text)
        if result.status == "cancelled":
            reply.append(f"  [cancelled: {(result.error or {}).get('message', '')}]", style="bold yellow")
        elif result.status == "failed":
            reply.append(f"  [failed: {(result.error or {}).get('type_name', '')}: "
                         f"{(result.error or {}).get('message', '')}]", style="bold red")
        log.write(reply)
        t = result.timings
        line = (f"  prompt {t.prompt_n + t.cache_n} tok (cached {t.cache_n}) · generated {t.predicted_n} tok · "
                f"TTFT {_ms(t.ttft_ms)} · TPOT {_ms(t.tpot_ms)} · E2E {_ms(t.e2e_ms)} · "
                f"stop {result.stop_type} · seed {result.seed} · sim ms (device time + measured host work)"
                + ("" if t.numerics else " · timing-only (tokens not from the model)")
                + f" · streamed in {time.monotonic() - self._wall_start:.2f} s wall")
        log.write(Text(line, style="grey62"))
        self.query_one("#chat-status", Static).update("")
        if result.status == "finished":
            self.history.extend([{"role": "user", "content": prompt},
                                 {"role": "assistant", "content": result.text}])
        elif result.status == "cancelled":
            self.query_one("#chat-input", Input).value = prompt

    def _log_error(self, msg: str) -> None:
        self.query_one("#chat-log", RichLog).write(Text(msg, style="bold red"))

    # --- actions ------------------------------------------------------------------

    def action_cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel("cancelled from the chat pane (Esc)")

    def action_new_chat(self) -> None:
        if self.handle is not None:
            self.handle.cancel("new chat started")
        self.history.clear()
        self.query_one("#chat-log", RichLog).clear()

    def on_unmount(self) -> None:
        # a closed pane is a vanished client: cancel what it started
        if self.handle is not None:
            self.handle.cancel("chat pane closed")

    def update_snapshot(self, snap: dict) -> None:
        d = snap["device"]
        set_subtitle(self, d["mode"] + (f" (lease: {d['lease_holder']})" if d.get("lease_holder") else ""))


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f} ms"
