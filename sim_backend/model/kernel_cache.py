"""How every compiled kernel is built and kept: numba's on-disk cache under a digest of the kernel
sources (:func:`cache_dir`, :func:`kernels_digest`, stale folders pruned), the decorator every kernel is
compiled with (:func:`kernel`), the LLVM flags it may allow (:data:`FMA`, :data:`SUM`) and the vector-width
attributes a kernel can ask for (``wide_vectors``, ``wide_legal``).

Imported before any kernel is defined (numba reads its cache directory when a kernel is decorated):
every kernel module takes ``kernel`` from here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import numba.core.config
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.base import BaseContext as TargetContext
from numba.core.dispatcher import Dispatcher
from numba.core.typing.context import BaseContext as TypingContext
from numba.core.typing.templates import Signature
from numba.extending import intrinsic
from numpy.typing import NDArray

#: The arrays kernels take, by dtype (C-contiguous unless a docstring says otherwise; shapes in each docstring).
F32Array = NDArray[np.float32]
U16Array = NDArray[np.uint16]
I64Array = NDArray[np.int64]
I32Array = NDArray[np.int32]
I8Array = NDArray[np.int8]
U8Array = NDArray[np.uint8]
BoolArray = NDArray[np.bool_]
#: An integer argument of a kernel: a Python int or a numpy one (``np.int64(0)`` keeps numba from compiling a
#: literal-specialised copy of a callee).
IntLike = int | np.integer[Any]

#: An intrinsic's LLVM code generator: (target context, IR builder, the compiled signature, the argument
#: values) -> the result value (a dummy value for ``void``).
Codegen = Callable[[TargetContext, ir.IRBuilder, Signature, Sequence[ir.Value]], ir.Value]
#: What an intrinsic's typing function returns (numba's ``@intrinsic`` protocol): its signature and codegen.
Lowering = tuple[Signature, Codegen]

_F = TypeVar("_F", bound=Callable[..., object])

# How an intrinsic is typed (every kernel module): numba's stubs type ``intrinsic(f)`` as a Python-level
# call of ``f`` (typing context first, numba types as arguments, returning ``Never``: outside a kernel it
# always raises), but a kernel calls it without the typing context, on values, and gets what its codegen
# builds. So each intrinsic is ``cast`` to the ``Callable`` a kernel calls (for mypy only; the object is
# numba's): ``name = cast("Callable[[arguments], result]", intrinsic(typing_function))``.

#: The modules whose compiled kernels share the cache, as paths relative to this file's folder: their text
#: names the cache. This module (the decorator and the vector-width intrinsics), the family-neutral kernels
#: and the MoE step that inlines them (with its threads' hand-over, ``kernel_sync.py``); and the dense
#: pilot's modules whose kernels (or code generators) are compiled into another file's kernel
#: (``families/dense_kernels.py``'s ``dense_forward``): numba checks a cached function against its own file
#: only.
KERNEL_SOURCES = ("kernel_cache.py", "kernels.py", "attention_kernels.py", "compiled.py", "kernel_sync.py",
                  "families/ggml_ops.py", "families/dense_quant.py", "families/dense_attention.py")


def kernels_digest() -> str:
    """First 16 hex digits of the SHA-256 of ``KERNEL_SOURCES``' bytes (a file that is missing counts as empty).

    numba checks a cached function against its own source file only, so a compiled step in ``compiled.py``
    that inlines kernels from ``kernels.py`` would load stale machine code after an edit of ``kernels.py``
    alone (an editable install; a wheel rewrites every file). The cache is kept under this digest instead:
    any change to either file starts a fresh cache, and an unchanged pair always finds its own."""
    import hashlib

    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in KERNEL_SOURCES:
        try:
            h.update((here / name).read_bytes())
        except OSError:
            pass
        h.update(b"\0")
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where numba keeps the compiled kernels, set as numba's cache directory: ``kernels-<digest>``
    (``kernels_digest``) under ``$NUMBA_CACHE_DIR`` if set, else under ``__pycache__`` beside this file
    (e.g. in site-packages after a wheel install) when it is writable, else under ``<user cache
    dir>/calconsole/numba`` (platformdirs). numba's own fallback (its user-wide directory) fails where
    HOME has no usable cache directory; this one is created here. Called at import, before any kernel
    is defined (numba reads the directory when a kernel is decorated). Raises OSError if no directory
    can be created."""
    import platformdirs

    cfg: Any = numba.core.config  # set at runtime from the environment; not in its type stubs
    sub = f"kernels-{kernels_digest()}"
    given = os.environ.get("NUMBA_CACHE_DIR")
    if given:
        d = Path(given) / sub
        d.mkdir(parents=True, exist_ok=True)
        cfg.CACHE_DIR = str(d)
        prune_stale_caches(d)
        return d
    here = Path(__file__).resolve().parent
    pyc = here / "__pycache__"
    try:
        pyc.mkdir(exist_ok=True)
        probe = pyc / f".calconsole-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
        d = pyc / sub
        d.mkdir(exist_ok=True)
    except OSError:
        d = Path(platformdirs.user_cache_dir("calconsole")) / "numba" / sub
        d.mkdir(parents=True, exist_ok=True)
    cfg.CACHE_DIR = str(d)
    prune_stale_caches(d)
    return d


#: A sibling cache folder is pruned only when nothing in it changed for this long (host wall seconds): a
#: process of another version that shares the parent directory and is compiling into its folder right now
#: (numba writes its index and machine code there) keeps it; one hour is far above a first start's compile.
STALE_CACHE_AGE_S = 3600.0


def prune_stale_caches(current: Path, *, min_age_s: float = STALE_CACHE_AGE_S, now: float | None = None) -> list[Path]:
    """Delete the ``kernels-<digest>`` folders beside ``current`` (other digests: caches of kernel sources
    that no longer exist here, e.g. after an upgrade or an edit) whose newest entry is older than
    ``min_age_s``; ``current`` itself and anything not named ``kernels-`` + 16 hex digits are never
    touched. Returns the folders removed. Never raises: a folder that cannot be read or removed is left
    (numba ignores it; the next start tries again)."""
    import re
    import shutil
    import time

    now = time.time() if now is None else now
    name = re.compile(r"kernels-[0-9a-f]{16}")
    removed: list[Path] = []
    try:
        siblings = list(current.parent.iterdir())
    except OSError:
        return removed
    for d in siblings:
        if d.name == current.name or not name.fullmatch(d.name) or d.is_symlink() or not d.is_dir():
            continue
        try:
            newest = max([d.stat().st_mtime] + [f.stat().st_mtime for f in d.iterdir()])
        except OSError:
            continue
        if now - newest < min_age_s:
            continue
        shutil.rmtree(d, ignore_errors=True)
        if not d.exists():
            removed.append(d)
    return removed


CACHE_DIR = cache_dir()


class KernelDecorator(Protocol):
    """What :func:`kernel` returns: a decorator compiling a function into a numba dispatcher of the same
    signature (called from Python or from another kernel)."""

    def __call__(self, fn: _F, /) -> Dispatcher[_F]: ...


def kernel(fastmath: set[str] | None = None) -> KernelDecorator:
    """The decorator every kernel is compiled with: on-disk cache, GIL released, numpy's float error
    semantics (a division by zero gives inf, no exception), no bounds checks; ``fastmath`` names the LLVM
    flags allowed (see ``FMA`` and ``SUM``; none by default). numba ignores the annotations: a kernel is
    compiled for the types it is called with; they say what the callers pass."""
    return njit(cache=True, nogil=True, error_model="numpy", boundscheck=False, fastmath=fastmath or False)


#: LLVM function attributes of ``wide_vectors``: vectorise with 512-bit registers where the CPU has them.
WIDE_ATTRIBUTES = ('"prefer-vector-width"="512"', '"min-legal-vector-width"="512"')


#: ... and of ``wide_legal``: keep 512-bit operations (of inlined wide kernels) whole, vectorise at the default.
LEGAL_ATTRIBUTES = ('"min-legal-vector-width"="512"',)


def _attributes_intrinsic(attributes: tuple[str, ...]) -> Callable[[], None]:
    def fn(typingctx: TypingContext) -> Lowering:
        def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                    args: Sequence[ir.Value]) -> ir.Value:
            try:
                attrs = builder.function.attributes
                for a in attributes:
                    set.add(attrs, a)  # string attributes: llvmlite's own add() takes only the enumerated ones
            except (AttributeError, TypeError):  # a future llvmlite storing them otherwise: default vectors
                pass
            return context.get_dummy_value()

        return types.none(), codegen

    return cast("Callable[[], None]", intrinsic(fn))  # as kernels call it (see above)


wide_vectors = _attributes_intrinsic(WIDE_ATTRIBUTES)
wide_vectors.__doc__ = """Let LLVM vectorise the calling kernel with 512-bit registers (16 float32 lanes) where the CPU
has them (AVX-512); elsewhere nothing changes. Called first in the kernels whose loops run over hundreds
of elements or more (keys, vocabulary columns): the attention, exp, sums over keys, the LM head.

Why: LLVM's tuning for many AVX-512 CPUs prefers 256-bit vectors in vectorised loops (the reference host
reports itself as "rocketlake", a tuning with that preference, yet has 512-bit units); the function
attributes ``prefer-vector-width`` / ``min-legal-vector-width`` lift it for one function, where numba's
process-wide ``NUMBA_CPU_FEATURES`` would change every numba user's code. Measured on the reference 2-core
host, idle: ``exp_in_range`` 0.31 -> 0.21 ns an element; one chip's attention of a 512-token prefill layer
3.3 -> 2.8 ms. Not for short loops: the hidden-size (64) and expert-width (16) loops of the router and the
experts ran slower at 16 lanes (route 0.44 -> 0.53 ms, experts 0.30 -> 0.45 ms a layer), their vector
bodies then too long for the trip counts.

Bits: an element-wise loop gives the same bits at either width; a sum in vector lanes (``SUM``) adds in a
lane-count-dependent order, within the bound of the module docstring, as between any two CPUs. If the
attributes cannot be set (another llvmlite), the kernel compiles with the default vectors."""


wide_legal = _attributes_intrinsic(LEGAL_ATTRIBUTES)
wide_legal.__doc__ = """Keep 512-bit vector operations whole in the calling kernel without widening its own loops:
called first in every kernel that is not ``wide_vectors``. LLVM inlines the kernels a kernel calls into
it, and a function without ``min-legal-vector-width`` = 512 would split an inlined 512-bit loop back into
256-bit halves; its own loops (short ones, see ``wide_vectors``) keep the default width."""


#: Fused multiply-add allowed (one rounding instead of two); no sum is reordered.
FMA = {"contract"}


#: Summation order only (``reassoc``: dot products and sums over keys in vector lanes; ``contract``:
#: fused multiply-add); no finite-math or sign assumptions, so -inf masks and NaN propagate as usual.
SUM = {"reassoc", "contract"}
