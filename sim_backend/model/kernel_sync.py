"""The hand-over between the two threads of a split step, inside compiled code: POSIX semaphores (``sem_post``,
a bounded wait ``sem_wait_s`` that spins, then sleeps), libc's calls and the CPU's ``pause`` as numba
intrinsics, and whether this process can split at all (``split_possible``). The split steps themselves are in
:mod:`sim_backend.model.compiled`.

Its kernels are compiled into ``compiled.py``'s steps, so this file is one of ``kernel_cache.KERNEL_SOURCES``
(an edit starts a fresh kernel cache).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.base import BaseContext as TargetContext
from numba.core.typing.context import BaseContext as TypingContext
from numba.core.typing.templates import Signature
from numba.extending import intrinsic

from sim_backend.model.kernel_cache import I64Array, IntLike, Lowering, kernel, wide_legal


@functools.cache
def c_library() -> Any:
    """The C library of this process (ctypes, loaded once), errno kept."""
    return ctypes.CDLL(None, use_errno=True)


@functools.cache
def split_possible() -> bool:
    """True when this process may run on at least two CPUs (its affinity mask; ``os.cpu_count`` where the
    platform has no affinity call) and has process-private POSIX semaphores (``sem_init``: Linux, not macOS),
    which the split decode step hands over with. Read once per process (a decode step asks it)."""
    import os

    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    if cpus < 2:
        return False
    try:
        buf = np.zeros(64, dtype=np.uint8)
        return bool(c_library().sem_init(ctypes.c_void_p(int(buf.ctypes.data)), 0, 0) == 0)
    except (OSError, AttributeError):
        return False


#: Tries of a semaphore before a split decode step's thread sleeps on it (each try one ``pause``, ~40-140
#: cycles): a futex wake-up across CPUs took ~50 us on the reference 2-core VM, longer than a layer's serial
#: part, so a short bounded spin hands over faster; past it the thread sleeps (a busy host loses at most this).
SPLIT_SPIN_TRIES = 3000

#: Bound on one wait of a split decode step's threads for the other (host wall s): far above any layer's
#: attention (about 1 ms at 4K keys on an idle host); a wait past it ends the step with an error, not a hang.
SPLIT_WAIT_S = 120


def _libc_call(name: str, arg_types: tuple[str, ...]) -> object:
    """A numba intrinsic calling the C library's ``int name(...)`` with int64 arguments passed as pointers
    where ``arg_types`` says ``"ptr"`` (addresses from ``array.ctypes.data``) and as int32 where ``"i32"``.
    Declared by name: the JIT links it against the process's libc (as ``dense_kernels`` does libm). Returns
    numba's intrinsic object; each use below casts it to the call a kernel makes (see ``kernel_cache``)."""
    i8p = ir.IntType(8).as_pointer()

    def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                args: Sequence[ir.Value]) -> ir.Value:
        fnty = ir.FunctionType(ir.IntType(32), [i8p if t == "ptr" else ir.IntType(32) for t in arg_types])
        cargs = [builder.inttoptr(a, i8p) if t == "ptr" else builder.trunc(a, ir.IntType(32))
                 for a, t in zip(args, arg_types, strict=True)]
        return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), cargs)

    if len(arg_types) == 1:
        def one(typingctx: TypingContext, a: types.Type) -> Lowering:
            return types.int32(types.int64), codegen
        return intrinsic(one)

    def two(typingctx: TypingContext, a: types.Type, b: types.Type) -> Lowering:
        return types.int32(types.int64, types.int64), codegen
    return intrinsic(two)


#: libc's calls as kernels make them (int64 arguments: addresses, or a clock id), each returning its int32 status.
sem_post = cast("Callable[[IntLike], np.int32]", _libc_call("sem_post", ("ptr",)))
_sem_trywait = cast("Callable[[IntLike], np.int32]", _libc_call("sem_trywait", ("ptr",)))
_sem_timedwait = cast("Callable[[IntLike, IntLike], np.int32]", _libc_call("sem_timedwait", ("ptr", "ptr")))
_clock_gettime = cast("Callable[[IntLike, IntLike], np.int32]", _libc_call("clock_gettime", ("i32", "ptr")))


def _pause_typing(typingctx: TypingContext) -> Lowering:
    """The CPU's spin-wait hint (x86 ``pause``; nothing elsewhere) between two tries of a semaphore."""
    import platform

    def codegen(context: TargetContext, builder: ir.IRBuilder, signature: Signature,
                args: Sequence[ir.Value]) -> ir.Value:
        if platform.machine() in ("x86_64", "AMD64", "i686"):
            fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


_pause = cast("Callable[[], None]", intrinsic(_pause_typing))  # see kernel_cache


#: One sleep of ``sem_wait_s`` on the semaphore (ns): ``sem_timedwait`` takes a CLOCK_REALTIME deadline, so a
#: wait sleeps in slices this long and keeps its bound on CLOCK_MONOTONIC: a system clock step forward ends a
#: slice early instead of failing the step with a false timeout (a step back lengthens one slice by the step).
#: A post wakes the sleeper at once; a slower other thread costs one wake-up per slice (5 a second).
SPLIT_SLICE_NS = 200_000_000


@kernel()
def sem_wait_s(sem: IntLike, ts: I64Array, timeout_s: float) -> bool:
    """Wait on the POSIX semaphore at address ``sem`` (int64) for at most ``timeout_s`` host wall seconds,
    measured on CLOCK_MONOTONIC (``ts`` an int64 (2,) scratch timespec). It first tries the semaphore up to
    ``SPLIT_SPIN_TRIES`` times (a ``pause`` between: a bounded spin, ~0.1-0.4 ms), then sleeps in the kernel
    (futex) in ``SPLIT_SLICE_NS`` slices until the bound. True when the semaphore was taken, False at the
    bound (up to one slice late); an interrupted wait is resumed."""
    wide_legal()
    for _ in range(SPLIT_SPIN_TRIES):
        if _sem_trywait(sem) == 0:
            return True
        _pause()
    tp = ts.ctypes.data
    _clock_gettime(1, tp)  # CLOCK_MONOTONIC
    end = ts[0] + timeout_s
    ns = ts[1]
    while True:
        _clock_gettime(0, tp)  # CLOCK_REALTIME, which sem_timedwait's deadline is on
        ts[1] += SPLIT_SLICE_NS
        if ts[1] >= 1_000_000_000:
            ts[0] += 1
            ts[1] -= 1_000_000_000
        if _sem_timedwait(sem, tp) == 0:
            return True
        _clock_gettime(1, tp)
        if ts[0] > end or (ts[0] == end and ts[1] >= ns):
            return False
