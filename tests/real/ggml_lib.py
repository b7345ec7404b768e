"""ggml's own CPU operations, called through ctypes from the ``xllamacpp`` wheel (the library its llama-server runs).

The wheel's extension module exports ggml's C API (``ggml_init``, ``ggml_mul_mat``, ``ggml_flash_attn_ext``,
``quantize_row_q8_1``, ...). :class:`Ggml` builds one-operation graphs on caller data and computes them on
one CPU thread, so a test can compare the pilot's emulation of an operation with the very code llama-server
runs, bit for bit. Tensors are given numpy-style (outermost dimension first; ggml's ``ne`` is the reverse).
Raises :class:`GgmlUnavailable` when the wheel or a symbol is missing (the tests then fail: the test extra has it).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

F32 = np.float32
#: ggml_type values (ggml.h): F32, F16, Q4_1, Q8_0, I32.
T_F32, T_F16, T_Q4_1, T_Q8_0, T_I32 = 0, 1, 3, 8, 26
_VP = ctypes.c_void_p
_F = ctypes.c_float


class GgmlUnavailable(RuntimeError):
    """The xllamacpp wheel is not installed or does not export a ggml function this needs."""


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _VP), ("no_alloc", ctypes.c_bool)]


#: (name, argtypes, restype) of every function used.
_SIGNATURES: tuple[tuple[str, list[Any], Any], ...] = (
    ("ggml_cpu_init", [], None),
    ("ggml_init", [_InitParams], _VP),
    ("ggml_free", [_VP], None),
    ("ggml_new_tensor_1d", [_VP, ctypes.c_int, ctypes.c_int64], _VP),
    ("ggml_new_tensor_2d", [_VP, ctypes.c_int] + [ctypes.c_int64] * 2, _VP),
    ("ggml_new_tensor_3d", [_VP, ctypes.c_int] + [ctypes.c_int64] * 3, _VP),
    ("ggml_new_tensor_4d", [_VP, ctypes.c_int] + [ctypes.c_int64] * 4, _VP),
    ("ggml_get_data", [_VP], _VP),
    ("ggml_nbytes", [_VP], ctypes.c_size_t),
    ("ggml_new_graph", [_VP], _VP),
    ("ggml_build_forward_expand", [_VP, _VP], None),
    ("ggml_graph_compute_with_ctx", [_VP, _VP, ctypes.c_int], ctypes.c_int),
    ("ggml_mul_mat", [_VP, _VP, _VP], _VP),
    ("ggml_rope_ext", [_VP, _VP, _VP, _VP, ctypes.c_int, ctypes.c_int, ctypes.c_int] + [_F] * 6, _VP),
    ("ggml_flash_attn_ext", [_VP, _VP, _VP, _VP, _VP, _F, _F, _F], _VP),
    ("ggml_swiglu_split", [_VP, _VP, _VP], _VP),
    ("ggml_rms_norm", [_VP, _VP, _F], _VP),
    ("ggml_mul", [_VP, _VP, _VP], _VP),
    ("quantize_row_q8_1", [_VP, _VP, ctypes.c_int64], None),
)


def load() -> Any:
    """The wheel's library with the signatures above set (ggml's CPU backend initialised). Raises GgmlUnavailable."""
    try:
        import xllamacpp
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise GgmlUnavailable(f"xllamacpp is not installed: {e}") from e
    lib = ctypes.CDLL(xllamacpp.xllamacpp.__file__)
    for name, args, res in _SIGNATURES:
        try:
            f = getattr(lib, name)
        except AttributeError as e:
            raise GgmlUnavailable(f"the xllamacpp wheel exports no {name}") from e
        f.argtypes, f.restype = args, res
    lib.ggml_cpu_init()
    return lib


class Ggml:
    """One ggml context (``mem_mb`` MiB, allocating) for building and computing single operations."""

    def __init__(self, lib: Any, mem_mb: int = 256) -> None:
        self.lib = lib
        self.ctx = lib.ggml_init(_InitParams(mem_mb << 20, None, False))
        if not self.ctx:
            raise GgmlUnavailable("ggml_init failed")

    def close(self) -> None:
        if self.ctx:
            self.lib.ggml_free(self.ctx)
            self.ctx = None

    def __enter__(self) -> Ggml:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tensor(self, typ: int, shape: tuple[int, ...], data: np.ndarray | None = None) -> Any:
        """A new tensor of ggml type ``typ`` and numpy-style ``shape`` (elements; ``ne`` reversed), filled with
        ``data``'s bytes when given (their size must be ggml's). Raises ValueError on a size mismatch."""
        ne = list(reversed(shape))
        t = getattr(self.lib, f"ggml_new_tensor_{len(ne)}d")(self.ctx, typ, *ne)
        if data is not None:
            a = np.ascontiguousarray(data)
            n = self.lib.ggml_nbytes(t)
            if n != a.nbytes:
                raise ValueError(f"tensor of {n} B given {a.nbytes} B")
            ctypes.memmove(self.lib.ggml_get_data(t), a.ctypes.data, n)
        return t

    def compute(self, t: Any, shape: tuple[int, ...]) -> np.ndarray:
        """Compute ``t``'s graph on one thread; its float32 result in numpy-style ``shape``."""
        g = self.lib.ggml_new_graph(self.ctx)
        self.lib.ggml_build_forward_expand(g, t)
        if self.lib.ggml_graph_compute_with_ctx(self.ctx, g, 1) != 0:
            raise RuntimeError("ggml_graph_compute_with_ctx failed")
        out = np.empty(shape, dtype=F32)
        if out.nbytes != self.lib.ggml_nbytes(t):
            raise ValueError(f"result of {self.lib.ggml_nbytes(t)} B read as {out.nbytes} B")
        ctypes.memmove(out.ctypes.data, self.lib.ggml_get_data(t), out.nbytes)
        return out
