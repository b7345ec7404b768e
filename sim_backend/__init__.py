"""Simulated dual-chiplet NPU serving Qwen3-30B-A3B.

Headless: nothing here imports Textual. Layers, bottom to top:
bundle -> model (numerics, op graph, cost model) -> device -> runtime ->
kv -> engine -> planes.  See sim_backend/facts.md ("The stack").
"""

import os

# The numerics are many small matrix ops on 2 cores shared with the UI and
# engine threads: a multi-threaded BLAS spin-waits and runs 3x slower here.
# Set before numpy loads; device.py also limits an already-loaded BLAS.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

__all__ = ["__version__"]
__version__ = "0.1.0"
