"""A model's KV cache arrays by cell: lazily committed zero pages, views of a sequence's cells, and
reading and writing a slot's rows (:class:`CellKV`, shared by both families' sharded models)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

F32 = np.float32


def lazy_zeros(shape: tuple[int, ...], dtype: DTypeLike = F32) -> np.ndarray:
    """Zero array whose memory is committed page by page as it is written.

    The KV cache is (chips, layers, kv_heads, cells, head_dim): a short
    sequence writes the first cells of every (chip, layer, head) row. With
    transparent huge pages each such write commits a 2 MiB page, ~770 MiB for
    a 5-token prompt; an anonymous mapping advised MADV_NOHUGEPAGE commits 4 KiB.
    """
    import mmap

    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.zeros(shape, dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def cell_index(cells: np.ndarray) -> slice | np.ndarray:
    """Index for a sequence's cells: a slice (view, no copy) when they are one
    contiguous run — the common case of one sequence allocated in order."""
    if cells.size and cells[-1] - cells[0] == cells.size - 1 and (cells.size < 3 or np.all(np.diff(cells) == 1)):
        return slice(int(cells[0]), int(cells[-1]) + 1)
    return cells


def cells_of(cache: np.ndarray, index: slice | np.ndarray) -> np.ndarray:
    """A layer's cache (C, kvh, cells, D) at a sequence's cells: a view for a slice, else a C-ordered
    gather (``np.take``; fancy indexing on a middle axis returns a strided layout that slows the matmuls)."""
    return cache[:, :, index] if isinstance(index, slice) else np.take(cache, index, axis=2)


class CellKV:
    """Read and write a model's KV cache by cell (``device.kv_state.KVValueStore``): what a slot's saved
    state holds besides its positions. Subclasses list their arrays in ``_kv_arrays`` (array, cell axis)."""

    def _kv_arrays(self) -> list[tuple[np.ndarray, int]]:
        raise NotImplementedError

    def kv_layout(self) -> list[tuple[tuple[int, ...], str, int]]:
        """(shape, dtype string, cell axis) of each KV array (float32; the cell axis spans every KV cell)."""
        return [(tuple(a.shape), a.dtype.str, axis) for a, axis in self._kv_arrays()]

    def kv_take(self, cells: np.ndarray) -> list[np.ndarray]:
        """Each KV array's rows at ``cells`` (copies, in ``cells`` order)."""
        return [np.take(a, np.asarray(cells, dtype=np.int64), axis=axis) for a, axis in self._kv_arrays()]

    def kv_put(self, cells: np.ndarray, rows: Sequence[np.ndarray]) -> None:
        """Write ``rows`` (as ``kv_take`` gives them) at ``cells``; ValueError for rows of another shape."""
        arrays = self._kv_arrays()
        if len(rows) != len(arrays):
            raise ValueError(f"{len(rows)} row arrays for {len(arrays)} KV arrays")
        idx_cells = np.asarray(cells, dtype=np.int64)
        for (a, axis), r in zip(arrays, rows, strict=True):
            idx: list[Any] = [slice(None)] * a.ndim
            idx[axis] = idx_cells
            a[tuple(idx)] = r
