"""Simulated dual-chiplet NPU serving Qwen3-30B-A3B.

Headless: nothing here imports Textual. Layers, bottom to top:
bundle -> model (numerics, op graph, cost model) -> device -> runtime ->
kv -> engine -> planes.  See DESIGN.md in the shared folder.
"""

__all__ = ["__version__"]
__version__ = "0.1.0"
