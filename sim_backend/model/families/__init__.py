"""Model families behind one interface (the seam the device, the serving layer and the tools use).

``qwen3_moe``: Qwen3-30B-A3B at reduced width with synthetic weights (``sim_backend.model.numerics``).
``llama_dense``: a dense Llama-family model at full width with real GGUF weights (the pilot,
``llama_dense``). Both are sharded over the two chiplets by tensor parallelism and answer
``forward(tokens, positions, new_cells, ctx_cells, ctx_positions) -> StepNumerics`` and
``clear_kv()``; the op graph (``opgraph.build_graph``), cost model and memory plan follow
``ModelShape.family``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sim_backend.bundle.shapes import ModelShape, NumericShape

if TYPE_CHECKING:
    from sim_backend.bundle.manifest import Bundle


def weights_source(shape: ModelShape, num: NumericShape) -> Any:
    """What a numerics process needs to read ``num``'s weights without parsing their file again: for a GGUF
    (the pilot) its tensor table from this process's parse (``GGUFFile.tensor_table``; the tokenizer's
    parse, kept per process by ``open_gguf``, shape checked); None for synthetic weights. Picklable.
    Raises ManifestError."""
    if shape.is_moe or num.weights != "gguf":
        return None
    from sim_backend.model.families.gguf_file import open_gguf

    f = open_gguf(num.weights_file)
    f.check_shape(shape)
    return f.tensor_table()


def weights_stage(shape: ModelShape, num: NumericShape) -> str | None:
    """The start-up line of a family whose weights take a while to build on every start (the pilot: its
    GGUF's quantised blocks read and packed for the dense kernels, several seconds on a busy 2-core host),
    or None (synthetic weights: nothing to say)."""
    if shape.is_moe or num.weights != "gguf":
        return None
    from pathlib import Path

    return (f"building the weights from {Path(num.weights_file).name} (its Q4_1 / Q8_0 blocks packed for the "
            "dense kernels; every start)")


def build_numerics(shape: ModelShape, num: NumericShape, n_cells: int, kernels: str | None = None,
                   source: Any = None) -> Any:
    """The sharded numerics of ``shape``'s family with ``n_cells`` KV cells per chip.

    ``qwen3_moe``: ``numerics.ShardedModel`` (synthetic weights from ``num.seed``; ``kernels``:
    ``compiled`` or ``numpy``, default ``numerics.kernels_choice()``);
    ``llama_dense``: ``llama_dense.DenseShardedModel`` (weights read from ``num.weights_file``,
    kept in the GGUF's quantised formats and computed by compiled kernels as llama.cpp does,
    ``dense_kernels``; ``kernels`` not used; ``source``: ``weights_source``'s table from the process
    that parsed the GGUF, or None to parse it here).
    Raises ManifestError (weights file) or ValueError.
    """
    if shape.is_moe:
        from sim_backend.model.numerics import ShardedModel
        return ShardedModel(shape, num, n_cells=n_cells, kernels=kernels)
    from sim_backend.model.families.llama_dense import DenseShardedModel
    return DenseShardedModel(shape, num, n_cells=n_cells, table=source)


def tokenizer_for(bundle: Bundle | None) -> Any:
    """The tokenizer a bundle's model speaks: the Qwen3 BPE (``tokenizer_source`` "qwen3", also for
    None), or the GGUF's own (``"gguf"``: vocabulary, merges, control tokens and chat template).
    Raises ManifestError when the GGUF or a package for it is missing."""
    if bundle is None or bundle.tokenizer_source == "qwen3":
        from sim_backend.model.tokenizer import get_tokenizer
        return get_tokenizer()
    from sim_backend.model.families.gguf_file import open_gguf
    from sim_backend.model.families.gguf_tokenizer import gguf_tokenizer
    f = open_gguf(bundle.numeric.weights_file)
    f.check_shape(bundle.shape)
    return gguf_tokenizer(f.meta)
