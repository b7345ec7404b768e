"""Model families behind one interface (the seam the device, the serving layer and the tools use).

``qwen3_moe``: Qwen3-30B-A3B at reduced width with synthetic weights (``sim_backend.model.numerics``).
``llama_dense``: a dense Llama-family model at full width with real GGUF weights (the pilot,
``llama_dense``). Both are sharded over the two chiplets by tensor parallelism and answer
``forward(tokens, positions, new_cells, ctx_cells, ctx_positions) -> StepNumerics`` and
``clear_kv()``; the op graph (``opgraph.build_graph``), cost model and memory plan follow
``ModelShape.family``.
"""
