"""The composition root: builds the whole simulated stack and hands out its planes.

Not part of the planes' public surface (``sim_backend.planes``): a command that runs the
simulator in-process imports ``build_system`` (and ``Pacing`` / ``PacingMode``, its pacing
setting) from here explicitly; everything else speaks to the planes it returns.

    sys = build_system()                     # numerics on, fast pacing
    h = sys.inference.submit(ChatRequest.from_prompt("hi", max_tokens=8))
    sys.observation.snapshot().to_dict()
    sys.close()

``maintenance=False`` (``--observe-only``) never constructs the maintenance
plane: the attribute is None and nothing else creates one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim_backend.bundle.manifest import Bundle, load_bundle
from sim_backend.device.board import SimulatedBoard
from sim_backend.device.clock import Pacing, PacingMode
from sim_backend.device.memory import MemoryPlan
from sim_backend.model.batching import BatchedCostModel, Variant, kv_capacity_tokens
from sim_backend.model.chat_template import builtin_template as builtin_chat_template
from sim_backend.model.costmodel import CostModel
from sim_backend.planes.audit import AuditLog
from sim_backend.planes.inprocess import InProcessInference, InProcessObservation
from sim_backend.runtime import RuntimeSession
from sim_backend.runtime.monitor import DeviceMonitor
from sim_backend.serving.engine import Engine
from sim_backend.serving.hosttime import HostBooking, HostTimer

#: Longest prompt (tokens) the device runs with numerics by default; longer prompts run timing-only
#: (tokens from the seeded generator; the reply and the observation pane say so). Counted in new tokens
#: to prefill (a cached prefix is not counted: a chat's later turns prefill only their new part). The
#: longest prompt whose numeric prefill keeps real time (real-time factor >= 1) in the console's numerics
#: worker, measured with ``calconsole bench realtime`` on the reference host (2 cores), 2026-12-06, idle
#: (load average 0.8-1.4), seven runs: worker prefill wall RTF 4.7-5.2 at 128 tokens, 2.7-2.9 at 256,
#: 1.7-1.8 at 384, 1.09-1.33 at 512 (a margin of a tenth to a third: a busy host can put it behind, and the
#: pacing flag then says so), 0.49-0.60 at 1024; CPU RTF 0.59-0.68 at 512 (the prefill uses both cores: a
#: host with one core busy elsewhere falls behind from about 350 tokens). Earlier figures: 256 (1.41-1.44
#: at 256, 0.68-0.74 at 512, the same day before the compiled prefill loop and 512-bit kernels; the code
#: before them, efce84e, alternated with these runs: 1.67-1.70 at 256, 1.18 at 384, 0.87 at 512); 128 before.
#: ``--numeric-limit N`` (console, serve, chat, ...) sets another.
NUMERIC_PROMPT_LIMIT = 512
#: The observation pane's reason for the default limit.
NUMERIC_LIMIT_REASON = "real time on the reference host"


#: Host s ``System.close`` lets the step in flight end on its own (most take well under 1 s; a long prompt's
#: prefill paced in real time a few) before it closes the device under it (the step then fails "device closed";
#: its request was being cancelled by the close anyway).
CLOSE_GRACE_S = 5.0


@dataclass
class System:
    """The simulator and its three planes. ``maintenance`` is None in observe-only mode."""

    bundle: Bundle
    board: SimulatedBoard
    engine: Engine
    inference: InProcessInference
    observation: InProcessObservation
    maintenance: Any | None

    def close(self) -> None:
        """Stop the engine, then the device (bounded: about ``CLOSE_GRACE_S`` + 15 s host wall at worst). A step
        still in flight after the grace (a hung numerics worker, a stuck host) is failed by closing the device
        ("device closed"), which ends the scheduler; before, the close waited out the step's own bound."""
        if not self.engine.close(join_timeout_s=CLOSE_GRACE_S):
            self.board.close()
            self.engine.close(join_timeout_s=5.0)
            return
        self.board.close()

    def __enter__(self) -> System:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_bundle(bundle_dir: str | Path | None = None) -> Bundle:
    """The bundle's manifest, loaded strictly as ``build_system`` loads it (raises ManifestError), without
    weights, device or threads (~0.1 s): a command checks its ``--bundle`` before any heavy start."""
    return load_bundle(bundle_dir)


def build_system(bundle_dir: str | Path | None = None, *, pacing: Pacing | None = None, numerics: bool = True,
                 n_slots: int = 4, queue_limit: int = 16, max_inflight: int = 1, maintenance: bool = True,
                 audit_path: str | Path | None = None, host_timer: HostTimer | None = None,
                 kv_timeout_s: float = 2.0, drain_timeout_s: float = 5.0, kv_cells: int | None = None,
                 numerics_max_prompt: int | None = None, numerics_limit_reason: str | None = None,
                 hardware: str | Path | None = None,
                 numerics_process: bool = False,
                 reset_timeout_s: float = 10.0, slo: Any | None = None, variant: Variant | None = None,
                 host_time: str = "modeled", numerics_progress: Callable[[str], None] | None = None,
                 numerics_background_start: bool = False,
                 prefill_chunk: int = 2048, chat_template: str | None = None,
                 chat_template_name: str = "chat template", n_ctx: int | None = None,
                 context_shift: bool = False) -> System:
    """Load the bundle (strict; raises ManifestError) and start device + engine threads.

    ``chat_template``: a Hugging Face chat template's Jinja source that replaces the bundle's
    (``serve --chat-template-file``; ``model.chat_template.JinjaChatTemplate``), compiled before any thread
    starts: ValueError (one line naming ``chat_template_name`` and the line) for one that does not compile.

    ``drain_timeout_s`` / ``reset_timeout_s``: the maintenance plane's bounded drain and reset
    (host wall seconds); unused with ``maintenance=False``. ``variant``: cost-model switches of a
    roadmap what-if (``batching.Variant``: S8 V-cache grows the KV pool to 4/3 of its tokens unless
    ``kv_cells`` is given; on-device top-k); None or all off = today's pricing.
    ``numerics_max_prompt``: requests prefilling more new prompt tokens than this run timing-only; None takes
    ``NUMERIC_PROMPT_LIMIT`` (measured) and its reason (a real-weights bundle, the pilot: its whole
    context). ``numerics_limit_reason``: why this limit, shown by the observation pane (default: the
    measurement, or "set at start-up").
    ``numerics_progress``: called with one line per stage while the numerics kernels compile (a first
    start after install; later starts load them from numba's disk cache); None: silent.
    ``numerics_background_start`` (with ``numerics_process``): return without waiting for the worker's start;
    requests admitted before it answers run timing-only (the console serves at once on a first start). Not for
    a real-weights bundle (the pilot's GGUF): its start is always waited for.
    ``host_time``: ``"modeled"`` books the cost model's fitted host allowance per sampled token
    (facts.md F7) on the simulated clock, ``"measured"`` this machine's measured host work
    (``serving.hosttime.HostBooking``; ValueError for anything else). ``prefill_chunk``: most prompt
    tokens one prefill step carries (the engine's round rule). ``n_ctx``: context per slot in tokens (None: the
    calbin's); ``context_shift``: llama-server's ``--context-shift`` (``sim_backend.serving.context_shift``).
    """
    limit_given = numerics_max_prompt is not None
    if numerics_max_prompt is None:
        numerics_max_prompt, default_reason = NUMERIC_PROMPT_LIMIT, NUMERIC_LIMIT_REASON
    else:
        default_reason = "set at start-up"
    if numerics_max_prompt < 1:
        raise ValueError(f"numerics_max_prompt must be >= 1 token, got {numerics_max_prompt}")
    HostBooking(host_time)  # ValueError for an unknown mode, before any thread starts
    bundle = load_bundle(bundle_dir)
    template = None
    if chat_template is not None:
        from sim_backend.model.chat_template import JinjaChatTemplate
        from sim_backend.model.families import tokenizer_for

        tok = tokenizer_for(bundle)
        template = JinjaChatTemplate(chat_template, name=chat_template_name, bos_token=getattr(tok, "bos_text", ""),
                                     eos_token=getattr(tok, "eos_text", ""))
    if not limit_given and bundle.numeric.weights == "gguf":
        # real weights (the dense pilot): a timing-only reply would be seeded tokens, not the model's, and
        # its host cannot keep real time at any prompt length anyway (the pacing figure says so)
        numerics_max_prompt = bundle.context
        default_reason = "real weights: every prompt runs the numerics (timing-only tokens would not be the model's)"
    cost: Any = CostModel.load(hardware)
    if variant is not None and not variant.is_default:
        cost = BatchedCostModel(cost, variant)
        if kv_cells is None and variant.s8_v_cache:
            kv_cells = kv_capacity_tokens(bundle.context, variant)
    board = SimulatedBoard(bundle, cost, numerics=numerics, pacing=pacing or Pacing(PacingMode.FAST),
                           kv_cells=kv_cells, numerics_process=numerics_process,
                           numerics_progress=numerics_progress,
                           # real weights (the pilot) wait: a timing-only reply would not be the model's
                           numerics_background_start=numerics_background_start and bundle.numeric.weights != "gguf")
    engine = Engine(RuntimeSession(board, parallel=max_inflight > 1), n_slots=n_slots, queue_limit=queue_limit,
                    max_inflight=max_inflight, prefill_chunk=prefill_chunk,
                    kv_timeout_s=kv_timeout_s, host_timer=host_timer, numerics_max_prompt=numerics_max_prompt,
                    host_time=host_time, host_token_us=cost.host_overhead_ms_per_token * 1e3,
                    slo=slo,  # slo: planes.types.SLO for goodput (simulated ms); None = no objectives
                    chat_template=template, n_ctx=n_ctx, context_shift=context_shift)
    memory_plan = MemoryPlan.for_bundle(bundle.shape, cost.hw)
    observation = InProcessObservation(DeviceMonitor(board), engine, bundle, memory_plan,
                                   numerics_limit_reason=numerics_limit_reason or default_reason)
    mplane = None
    if maintenance:
        # imported only when asked for (--observe-only proof)
        from sim_backend.planes.maintenance import InProcessMaintenance
        from sim_backend.runtime import MaintenanceRuntime

        mplane = InProcessMaintenance(lambda check: MaintenanceRuntime(board, check, memory_plan=memory_plan), engine,
                                  AuditLog(audit_path),
                                  drain_timeout_s=drain_timeout_s, reset_timeout_s=reset_timeout_s,
                                  memory_plan=memory_plan)
        observation.set_mode_source(mplane.mode)
    return System(bundle, board, engine, InProcessInference(engine), observation, mplane)


__all__ = ["NUMERIC_LIMIT_REASON", "NUMERIC_PROMPT_LIMIT", "Pacing", "PacingMode", "System", "build_system",
           "builtin_chat_template"]
