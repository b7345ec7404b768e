"""Pure functions turning a typed ``Snapshot`` into Rich renderables, one module per pane section.

No metric is computed here: every number comes from the snapshot's typed fields. Units are in
every label: "sim" = simulated device time, "wall" = measured host time. A section the observed
server does not report (its field None) says so ("not reported by ...") instead of showing 0.

- ``common``: formats, bars, the borderless table, "not reported"
- ``device``: status / mode phrases, the npu-smi style device table, the device panel, decode batches
- ``header``: the thresholds line
- ``serving``: requests, slots, stages, device steps (jobs), KV
- ``layers``: the per-layer table and heatmap of one step
- ``bundle``: memory map, host process, manifest findings, the section bar
"""

from __future__ import annotations

from .bundle import findings_panel, host_panel, memory_panel, sections_bar
from .common import (
                     GIB,
                     MIB,
                     bar,
                     fmt_bytes,
                     fmt_gib,
                     fmt_ms,
                     fmt_pct,
                     not_reported,
                     plain_table,
                     set_subtitle,
)
from .device import (
                     batches_panel,
                     chip_memory,
                     device_panel,
                     device_table,
                     host_behind,
                     mem_bar,
                     mode_text,
                     numeric_limit,
                     numerics_text,
                     status_text,
                     timing_only_reason,
)
from .header import header_line, pacing_ratio
from .layers import (
                     HEAT_STEPS,
                     HEAT_WIDTH,
                     experts_line,
                     heat_style,
                     layers_heatmap,
                     layers_panel,
                     layers_uniform,
                     step_chips_line,
)
from .serving import jobs_panel, kv_panel, requests_panel, slots_panel, stages_panel

__all__ = [
    "GIB", "HEAT_STEPS", "HEAT_WIDTH", "MIB", "bar", "batches_panel", "chip_memory", "device_panel", "device_table",
    "experts_line", "findings_panel", "fmt_bytes", "fmt_gib", "fmt_ms", "fmt_pct", "header_line", "heat_style",
    "host_behind", "host_panel", "jobs_panel", "kv_panel", "layers_heatmap", "layers_panel", "layers_uniform",
    "mem_bar", "memory_panel", "mode_text", "not_reported", "numerics_text", "pacing_ratio", "plain_table",
    "requests_panel", "sections_bar", "set_subtitle", "slots_panel", "stages_panel",
    "numeric_limit", "status_text", "step_chips_line", "timing_only_reason",
]
