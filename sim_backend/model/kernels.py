"""Compiled numerics kernels (numba), family-neutral: the per-layer work of a decoder layer.

Each kernel is the math of one step of a transformer layer on float32 arrays, written as plain
loops that numba compiles to machine code (``cache=True``: compiled once per machine and kept on
disk; ``nogil=True``: two threads can run kernels at once, one per chiplet). Nothing here knows the
model family: RMSNorm, matrix-vector products (float32 and BF16 weights), per-head RMSNorm with
rotate-half RoPE, grouped-query attention (decode and causal prefill), SwiGLU, a softmax top-k
router. A family's step (``sim_backend.model.compiled`` for Qwen3-MoE) is composed of them inside
one compiled function, so a decode step is one call instead of thousands of numpy calls.

The numpy code in ``layer_ops.py`` and ``numerics.py`` is the reference these kernels are tested against
(``tests/model/test_kernels.py``). Results differ from it only by summation order and by
``exp_f32`` (a polynomial exp within 2 ulp): each dot product of length n is summed in a
different order than BLAS does it, which moves a float32 result by at most ~n * 2**-24 of the sum
of |terms|; over 48 layers this gives logit drifts of order 1e-5 (measured in the tests and by
``python -m sim_backend.model.golden --check``), the same size as the drift between BLAS builds
that the golden bound already covers (``golden.F32_DRIFT_ATOL``). That bound holds for ANY order of
the n additions (|error| <= (n - 1) * 2**-24 * sum|terms| to first order, whatever tree the sums form), so
the register tiling of the decode attention (``_scores``: a score as four 4-term partial sums, added in
turn; ``_weighted_values``: per chunk of keys a sum in vector lanes, chunk sums added in turn) changes no
bound: it is one more order of the same terms. ``exp_in_range`` is ``exp_f32``'s own code without the
clamps, so the same bits on its range.

Layouts (C-contiguous float32 unless said):
- a layer's K and V caches are stored transposed, (kv_heads, D, cells), written in place a cell at a
  time (never rebuilt per call): a decode step's scores ``q . k_t`` and its ``p . v_t`` then read each
  key (value) dimension as one contiguous run over the context, vectorised over keys.
- BF16 weights are ``uint16`` bit patterns (the top half of a float32, ``bf16.py``), widened
  exactly by a 16-bit shift as they are read.

No reshapes: no kernel (here or in ``compiled.py``) reshapes an array or assigns one array to a slice
of another (``a[:, :] = b``). numba compiles the error path of each, and its message formatting (string
joins, integer and repr formatting) took 6.4 s of the 44.5 s of CPU of a first start from an empty cache
(numba's compile events, load ~7, the reference 2-core host); element loops and small copies do the
same work without it.

Shapes in the docstrings: H = hidden, D = head_dim, T = context keys, G = query heads per KV head.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numba.core.config
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

__all__ = [
    "FMA", "SUM", "attend_decode", "attend_prefill_t", "bf16_blocks", "bf16_matvec", "bf16_value",
    "exp_f32", "exp_in_range", "exp_shift", "head_norm_rope", "kernel", "matvec", "matvec_add", "prune_stale_caches",
    "rms_norm", "silu_mul", "softmax_top_k", "wide_legal", "wide_vectors",
]



#: The modules whose compiled kernels share the cache, as paths relative to this file's folder: their text
#: names the cache. Besides the MoE pair, the dense pilot's modules whose kernels (or code generators) are
#: compiled into another file's kernel (``families/dense_kernels.py``'s ``dense_forward``): numba checks that
#: one against its own file only.
KERNEL_SOURCES = ("kernels.py", "compiled.py", "families/ggml_ops.py", "families/dense_quant.py",
                  "families/dense_attention.py")


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


CACHE_DIR = cache_dir()


def kernel(fastmath: set[str] | None = None) -> Any:
    """The decorator every kernel is compiled with: on-disk cache, GIL released, numpy's float error
    semantics (a division by zero gives inf, no exception), no bounds checks; ``fastmath`` names the LLVM
    flags allowed (see ``FMA`` and ``SUM``; none by default)."""
    return njit(cache=True, nogil=True, error_model="numpy", boundscheck=False, fastmath=fastmath or False)


#: LLVM function attributes of ``wide_vectors``: vectorise with 512-bit registers where the CPU has them.
WIDE_ATTRIBUTES = ('"prefer-vector-width"="512"', '"min-legal-vector-width"="512"')
#: ... and of ``wide_legal``: keep 512-bit operations (of inlined wide kernels) whole, vectorise at the default.
LEGAL_ATTRIBUTES = ('"min-legal-vector-width"="512"',)


def _attributes_intrinsic(attributes: tuple[str, ...]) -> Any:
    def fn(typingctx):  # noqa: ANN001, ANN202
        def codegen(context, builder, signature, args):  # noqa: ANN001, ANN202
            try:
                attrs = builder.function.attributes
                for a in attributes:
                    set.add(attrs, a)  # string attributes: llvmlite's own add() takes only the enumerated ones
            except (AttributeError, TypeError):  # a future llvmlite storing them otherwise: default vectors
                pass
            return context.get_dummy_value()

        return types.none(), codegen

    return intrinsic(fn)


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


@intrinsic
def _bits_to_f32(typingctx, bits):
    """Reinterpret an int32's bits as a float32 (no conversion): inlines to one bitcast."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def bf16_value(typingctx, b):
    """BF16 bit pattern (uint16 scalar) -> its float32 value, exactly (as ``bf16.bf16_to_f32``): zero-extend,
    shift left 16, reinterpret; three LLVM instructions in 32-bit lanes, so a loop over it vectorises (a
    numba-level ``np.int32(b) << 16`` widens to int64 first and halves the lanes)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return sig, codegen


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # Cody-Waite split of ln 2: n * _LN2_HI is exact for |n| < 2**13
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_HI = np.float32(88.72283)  # ln(largest float32)
_EXP_LO = np.float32(-86.9)  # n >= -125 above it, so 2**(n-1) is a normal float32


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _exp_core(x):
    """exp of a float32 scalar x in [_EXP_LO, _EXP_HI], without the clamps: the body of ``exp_f32``."""
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI
    r = r - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    # 2**(n-1) * 2: n reaches 128 just below the overflow, whose 2**n alone is not a float32
    return p * _bits_to_f32(np.int32(n + np.float32(126.0)) << 23) * np.float32(2.0)


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def exp_f32(x):
    """exp of a float32 scalar, float32, within 2 ulp of the true value on [-87.3, 88.4] (Cephes'
    expf: Cody-Waite reduction to |r| <= ln2/2, degree-6 polynomial, 2**n from its exponent bits);
    +inf above, 0.0 below (where the true value is subnormal or 0), NaN for NaN. Branch-free
    besides the clamps, so loops over it vectorise (libm's expf would be one call per element)."""
    y = _exp_core(min(max(x, _EXP_LO), _EXP_HI))
    if x > _EXP_HI:
        y = np.float32(np.inf)
    if x < _EXP_LO:
        y = np.float32(0.0)
    if x != x:
        y = x
    return y


@kernel(FMA)
def exp_in_range(row):
    """row[:] = exp(row) in place, float32, for a row known to lie in [-86.9, 88.7] (e.g. scores proven
    within ``layer_ops.SCORE_BOUND``): ``exp_f32`` without its clamps and edge selects, so the same bits
    for every such input (the same code, ``_exp_core``, compiled with the same flags as ``exp_shift``),
    in 5 fewer vector operations an element (decode attention at 4K: 12.2 -> 7.9 ms CPU for its 6.3 M
    exps, load ~7). Outside the range the result is meaningless (no clamp): never call it there."""
    wide_vectors()
    for t in range(row.shape[0]):
        row[t] = _exp_core(row[t])


@kernel()
def rms_norm(x, w, eps, out):
    """out = x / sqrt(mean(x^2) + eps) * w; x, w, out (H,) float32 (out may be x). eps float32."""
    wide_legal()
    n = x.shape[0]
    ss = np.float32(0.0)
    for i in range(n):
        ss += x[i] * x[i]
    inv = np.float32(1.0) / np.sqrt(ss * np.float32(1.0 / n) + eps)
    for i in range(n):
        out[i] = x[i] * inv * w[i]


@kernel()
def matvec(x, w, out):
    """out = x @ w; x (K,), w (K, N) C-contiguous, out (N,) float32 (overwritten)."""
    wide_legal()
    out[:] = 0.0
    matvec_add(x, w, out)


@kernel(FMA)
def matvec_add(x, w, out):
    """out += x @ w; x (K,), w (K, N) C-contiguous, out (N,) float32. Row by row (axpy), so the
    inner loop runs over N contiguous weights and vectorises without reordering any sum."""
    wide_legal()
    K, N = w.shape
    for k in range(K):
        xk = x[k]
        row = w[k]
        for j in range(N):
            out[j] += xk * row[j]


#: Output columns per block of the BF16 weight layout (:func:`bf16_blocks`): a block's float32
#: accumulators (4 KiB) stay in L1 while its K x 1024 weights stream past once, in memory order.
BF16_BLOCK = 1024


def bf16_blocks(w_bits: np.ndarray, block: int = BF16_BLOCK) -> np.ndarray:
    """(K, N) uint16 BF16 weights -> (ceil(N / block), K, block) uint16, zero-padded past N: each
    block of output columns is one contiguous run, so :func:`bf16_matvec` reads the weights as one
    sequential stream (K strided row streams defeat the prefetcher). Same bytes, one copy."""
    K, N = w_bits.shape
    nb = -(-N // block)
    out = np.zeros((nb, K, block), dtype=np.uint16)
    full = N // block
    out[:full] = w_bits[:, :full * block].reshape(K, full, block).transpose(1, 0, 2)
    if full < nb:
        out[full, :, :N - full * block] = w_bits[:, full * block:]
    return out


@kernel(FMA)
def bf16_matvec(x, w_blocks, bias, out):
    """out = x @ w + bias with BF16 weights: x (K,) float32; w_blocks (nb, K, B) uint16 BF16 bit
    patterns in :func:`bf16_blocks`' layout; bias, out (N,) float32 (N <= nb * B). Half the bytes of
    float32 weights; each weight is widened exactly (a 16-bit shift); a column's K products are
    summed in row order."""
    wide_vectors()
    nb, K, B = w_blocks.shape
    N = out.shape[0]
    acc = np.empty(B, dtype=np.float32)
    for bi in range(nb):
        j0 = bi * B
        m = min(B, N - j0)
        acc[:] = 0.0
        blk = w_blocks[bi]
        for k in range(K):
            xk = x[k]
            row = blk[k]
            for j in range(B):
                acc[j] += xk * bf16_value(row[j])
        o = out[j0:j0 + m]
        b = bias[j0:j0 + m]
        for j in range(m):
            o[j] = acc[j] + b[j]


@kernel()
def head_norm_rope(qk, w, cos, sin, eps):
    """Per-head RMSNorm then rotate-half (NeoX) RoPE, in place. qk (heads, D) float32; w (heads, D)
    norm weights; cos/sin (D/2,) float32 for this token's position; eps float32."""
    wide_legal()
    nh, D = qk.shape
    half = D // 2
    inv_d = np.float32(1.0 / D)
    for h in range(nh):
        ss = np.float32(0.0)
        for d in range(D):
            ss += qk[h, d] * qk[h, d]
        inv = np.float32(1.0) / np.sqrt(ss * inv_d + eps)
        for d in range(half):
            a = qk[h, d] * inv * w[h, d]
            b = qk[h, d + half] * inv * w[h, d + half]
            qk[h, d] = a * cos[d] - b * sin[d]
            qk[h, d + half] = b * cos[d] + a * sin[d]


#: Keys per chunk of the decode attention kernel: the G heads' scores of a chunk (8 x 512 float32, 16 KiB)
#: stay in L1 between their exp and p @ V; with the register-tiled ``_scores`` / ``_weighted_values`` the
#: cost per chunk is the loop starts (64 vector iterations a loop at 512), so bigger chunks run faster:
#: 192 heads at T = 4096, interleaved 7 times in one process (load ~11, the reference 2-core host), CPU ms
#: median 33.5 at 128, 30.7 at 256, 29.1 at 512, 28.5 at 2048 (within noise of 512 from 512 on).
ATT_CHUNK = 512



@kernel(FMA)
def exp_shift(row, m):
    """row[:] = exp(row - m) in place, float32 (``exp_f32``; m float32). The two halves of the row go
    through one loop as two independent chains: ``exp_f32`` is one long dependent chain of operations,
    and one chain per vector loop kept the core waiting on it (1.5-2.1 ns an element measured, 0.65-0.77
    with two chains and fused multiply-adds, same host). Compiled with ``FMA`` only (no ``reassoc``):
    the range reduction and the polynomial are evaluated in the order written, each multiply-add with
    one rounding instead of two (measured max error 0.97 ulp on [-87, 88], within ``exp_f32``'s 2)."""
    wide_vectors()
    n = row.shape[0]
    h = n // 2
    a = row[:h]
    b = row[h:2 * h]
    for t in range(h):
        ea = exp_f32(a[t] - m)
        eb = exp_f32(b[t] - m)
        a[t] = ea
        b[t] = eb
    if n % 2:
        row[n - 1] = exp_f32(row[n - 1] - m)


#: Query heads per pass of the decode scores (:func:`_scores`): each key is loaded once for this many heads'
#: multiply-adds (the G = 8 query heads of a KV head in Qwen3-30B-A3B), not once per head.
SCORE_HEADS = 8


@kernel(SUM)
def _scores(q, src, off, m, s, s0):
    """s[g, s0:s0+m] = q[g] . src[:, off:off+m] for one chunk of m keys, every query head g.

    q (G, D) float32; src (D, >= off+m) the keys transposed (this head's K cache, or a gathered chunk with
    off = 0); s (G, >= s0+m) C-contiguous (rows are sliced here, not by the caller: a sliced 2-D argument
    loses its known unit stride and with it the vector loads).

    Register tiling: ``SCORE_HEADS`` heads a pass, four key dimensions a pass. The loop over the chunk's
    keys loads each of the 4 key rows once (one vector load of 8 keys each) and does the 8 heads' 32
    multiply-adds from it, so a 2K-4K context is bound by multiply-adds and not by loads (the former
    head-by-head loop reloaded every key row once per head: 5 loads per 4 multiply-adds). Heads past a
    multiple of 8 go one at a time. Summation order of each score: per 4 dimensions a partial sum added
    to the running score (``SUM`` lets LLVM reassociate the 4 terms); any order of the D terms is within
    the same float32 bound (``kernels`` docstring)."""
    wide_vectors()
    G, D = q.shape
    g0 = 0
    while g0 + SCORE_HEADS <= G:
        r0, r1, r2, r3 = s[g0, s0:s0 + m], s[g0 + 1, s0:s0 + m], s[g0 + 2, s0:s0 + m], s[g0 + 3, s0:s0 + m]
        r4, r5, r6, r7 = s[g0 + 4, s0:s0 + m], s[g0 + 5, s0:s0 + m], s[g0 + 6, s0:s0 + m], s[g0 + 7, s0:s0 + m]
        d = 0
        while d + 4 <= D:
            k0, k1 = src[d, off:off + m], src[d + 1, off:off + m]
            k2, k3 = src[d + 2, off:off + m], src[d + 3, off:off + m]
            a0, a1, a2, a3 = q[g0, d], q[g0, d + 1], q[g0, d + 2], q[g0, d + 3]
            b0, b1, b2, b3 = q[g0 + 1, d], q[g0 + 1, d + 1], q[g0 + 1, d + 2], q[g0 + 1, d + 3]
            c0, c1, c2, c3 = q[g0 + 2, d], q[g0 + 2, d + 1], q[g0 + 2, d + 2], q[g0 + 2, d + 3]
            e0, e1, e2, e3 = q[g0 + 3, d], q[g0 + 3, d + 1], q[g0 + 3, d + 2], q[g0 + 3, d + 3]
            f0, f1, f2, f3 = q[g0 + 4, d], q[g0 + 4, d + 1], q[g0 + 4, d + 2], q[g0 + 4, d + 3]
            h0, h1, h2, h3 = q[g0 + 5, d], q[g0 + 5, d + 1], q[g0 + 5, d + 2], q[g0 + 5, d + 3]
            i0, i1, i2, i3 = q[g0 + 6, d], q[g0 + 6, d + 1], q[g0 + 6, d + 2], q[g0 + 6, d + 3]
            j0, j1, j2, j3 = q[g0 + 7, d], q[g0 + 7, d + 1], q[g0 + 7, d + 2], q[g0 + 7, d + 3]
            if d == 0:  # the first 4 dimensions set the scores (no zeroing pass: 5 % of the kernel at 4K)
                for t in range(m):
                    x0, x1, x2, x3 = k0[t], k1[t], k2[t], k3[t]
                    r0[t] = a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
                    r1[t] = b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
                    r2[t] = c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
                    r3[t] = e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3
                    r4[t] = f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3
                    r5[t] = h0 * x0 + h1 * x1 + h2 * x2 + h3 * x3
                    r6[t] = i0 * x0 + i1 * x1 + i2 * x2 + i3 * x3
                    r7[t] = j0 * x0 + j1 * x1 + j2 * x2 + j3 * x3
                d += 4
                continue
            for t in range(m):
                x0, x1, x2, x3 = k0[t], k1[t], k2[t], k3[t]
                r0[t] += a0 * x0 + a1 * x1 + a2 * x2 + a3 * x3
                r1[t] += b0 * x0 + b1 * x1 + b2 * x2 + b3 * x3
                r2[t] += c0 * x0 + c1 * x1 + c2 * x2 + c3 * x3
                r3[t] += e0 * x0 + e1 * x1 + e2 * x2 + e3 * x3
                r4[t] += f0 * x0 + f1 * x1 + f2 * x2 + f3 * x3
                r5[t] += h0 * x0 + h1 * x1 + h2 * x2 + h3 * x3
                r6[t] += i0 * x0 + i1 * x1 + i2 * x2 + i3 * x3
                r7[t] += j0 * x0 + j1 * x1 + j2 * x2 + j3 * x3
            d += 4
        while d < D:
            kd = src[d, off:off + m]
            for g in range(g0, g0 + SCORE_HEADS):
                qd = q[g, d]
                sg = s[g, s0:s0 + m]
                if d == 0:  # D < 4: no tiled pass set the scores
                    for t in range(m):
                        sg[t] = qd * kd[t]
                else:
                    for t in range(m):
                        sg[t] += qd * kd[t]
            d += 1
        g0 += SCORE_HEADS
    for g in range(g0, G):
        sg = s[g, s0:s0 + m]
        for t in range(m):
            sg[t] = 0.0
        for d in range(D):
            qd = q[g, d]
            kd = src[d, off:off + m]
            for t in range(m):
                sg[t] += qd * kd[t]


@kernel(SUM)
def _weighted_values(p, p0, m, src, off, acc, den):
    """acc[g, d] += p[g, p0:p0+m] . src[d, off:off+m] and den[g] += sum(p[g, p0:p0+m]) for one chunk of m
    keys: p (G, >= p0+m) the unnormalised probabilities; src (D, >= off+m) the values transposed (this
    head's V cache, or a gathered chunk with off = 0); acc (G, D), den (G,) float32.

    Register tiling: 4 heads x 2 value dimensions a pass, 8 running sums in vector lanes over the keys,
    so each loaded value serves 4 heads and each loaded probability 2 dimensions (6 loads per 8
    multiply-adds; one head and dimension at a time was 2 loads per multiply-add). Each acc[g, d] gets
    one sum of the chunk's m products (in vector lanes, ``SUM``) added to it, as before."""
    wide_vectors()
    G = p.shape[0]
    D = acc.shape[1]
    for g in range(G):
        pg = p[g, p0:p0 + m]
        tot = np.float32(0.0)
        for t in range(m):
            tot += pg[t]
        den[g] += tot
    g0 = 0
    while g0 + 4 <= G:
        p0r, p1r, p2r, p3r = p[g0, p0:p0 + m], p[g0 + 1, p0:p0 + m], p[g0 + 2, p0:p0 + m], p[g0 + 3, p0:p0 + m]
        d = 0
        while d + 2 <= D:
            v0, v1 = src[d, off:off + m], src[d + 1, off:off + m]
            a00 = np.float32(0.0)
            a01 = np.float32(0.0)
            a10 = np.float32(0.0)
            a11 = np.float32(0.0)
            a20 = np.float32(0.0)
            a21 = np.float32(0.0)
            a30 = np.float32(0.0)
            a31 = np.float32(0.0)
            for t in range(m):
                x0, x1 = v0[t], v1[t]
                y0, y1, y2, y3 = p0r[t], p1r[t], p2r[t], p3r[t]
                a00 += y0 * x0
                a01 += y0 * x1
                a10 += y1 * x0
                a11 += y1 * x1
                a20 += y2 * x0
                a21 += y2 * x1
                a30 += y3 * x0
                a31 += y3 * x1
            acc[g0, d] += a00
            acc[g0, d + 1] += a01
            acc[g0 + 1, d] += a10
            acc[g0 + 1, d + 1] += a11
            acc[g0 + 2, d] += a20
            acc[g0 + 2, d + 1] += a21
            acc[g0 + 3, d] += a30
            acc[g0 + 3, d + 1] += a31
            d += 2
        while d < D:
            vd = src[d, off:off + m]
            for g in range(g0, g0 + 4):
                pg = p[g, p0:p0 + m]
                x = np.float32(0.0)
                for t in range(m):
                    x += pg[t] * vd[t]
                acc[g, d] += x
            d += 1
        g0 += 4
    for g in range(g0, G):
        pg = p[g, p0:p0 + m]
        for d in range(D):
            vd = src[d, off:off + m]
            x = np.float32(0.0)
            for t in range(m):
                x += pg[t] * vd[t]
            acc[g, d] += x


@kernel()
def attend_decode(q, k_t, v_t, start, idx, T, no_max, scores, out):
    """One query's grouped attention over T cached keys of one KV head.

    q (G, D) float32, already scaled by 1/sqrt(D); k_t, v_t (D, cells) this head's transposed K and V
    caches; the keys are cells ``start .. start+T`` if ``start >= 0`` (one contiguous run, read in
    place) else ``idx[:T]`` (int64 cells, gathered a chunk at a time). ``no_max``: the caller proved
    |score| small enough (``layer_ops.SCORE_BOUND``) that exp needs no max shift. scores (G, >= T)
    float32 scratch. Writes softmax(q k^T) v to out (G, D). Sums run in vector lanes (``SUM``).

    With ``no_max`` one pass over the keys, ``ATT_CHUNK`` at a time: the chunk's scores (all G heads
    from each key load, ``_scores``), their exp (``exp_in_range``: the scores are proven within the
    bound) and their share of p @ V (``_weighted_values``) while the chunk's keys, values and scores are
    in L1; K and V are each read once. Without it (a damaged norm weight) two passes: every score and the
    row maxima first, then exp (``exp_shift``, clamped) and p @ V chunk by chunk.
    """
    wide_vectors()
    G, D = q.shape
    contiguous = start >= 0
    kg = np.empty((D, ATT_CHUNK + ATT_CHUNK // 2 if not contiguous else 0), dtype=np.float32)
    vg = np.empty((D, ATT_CHUNK + ATT_CHUNK // 2 if not contiguous else 0), dtype=np.float32)
    acc = np.zeros((G, D), dtype=np.float32)
    den = np.zeros(G, dtype=np.float32)
    # an int64, not the literal 0: a literal argument makes numba compile a second copy of each callee
    # (measured on a first start: _scores, _weighted_values and _gather twice, ~5 s of CPU)
    zero = np.int64(0)
    if no_max:
        t0 = zero
        while t0 < T:
            # a short tail joins the last chunk (<= 1.5 chunks): a chunk costs ~70 loop starts of its own
            m = T - t0 if T - t0 <= ATT_CHUNK + ATT_CHUNK // 2 else ATT_CHUNK
            if contiguous:
                _scores(q, k_t, start + t0, m, scores, zero)
            else:
                _gather(k_t, idx, t0, m, kg)
                _scores(q, kg, zero, m, scores, zero)
            for g in range(G):
                exp_in_range(scores[g, :m])
            if contiguous:
                _weighted_values(scores, zero, m, v_t, start + t0, acc, den)
            else:
                _gather(v_t, idx, t0, m, vg)
                _weighted_values(scores, zero, m, vg, zero, acc, den)
            t0 += m
    else:
        for t0 in range(0, T, ATT_CHUNK):
            m = min(ATT_CHUNK, T - t0)
            if contiguous:
                _scores(q, k_t, start + t0, m, scores, t0)
            else:
                _gather(k_t, idx, t0, m, kg)
                _scores(q, kg, zero, m, scores, t0)
        for g in range(G):
            sg = scores[g, :T]
            mx = np.float32(-np.inf)
            for t in range(T):
                mx = max(mx, sg[t])
            exp_shift(sg, mx)
        for t0 in range(0, T, ATT_CHUNK):
            m = min(ATT_CHUNK, T - t0)
            if contiguous:
                _weighted_values(scores, t0, m, v_t, start + t0, acc, den)
            else:
                _gather(v_t, idx, t0, m, vg)
                _weighted_values(scores, t0, m, vg, zero, acc, den)
    for g in range(G):
        inv = np.float32(1.0) / den[g]
        for d in range(D):
            out[g, d] = acc[g, d] * inv


@kernel()
def _gather(x_t, idx, t0, m, out):
    """out[:, :m] = x_t[:, idx[t0:t0+m]]: a chunk of keys (or values) of scattered cells, (D, cells) -> (D, m)."""
    wide_vectors()
    for d in range(x_t.shape[0]):
        row = x_t[d]
        o = out[d]
        for t in range(m):
            o[t] = row[idx[t0 + t]]


#: Queries per block of :func:`attend_prefill_t`: a block's G x 16 score columns go through one BLAS product
#: with the keys it can see (16 measured as fast as 8-64 at 512 tokens).
PREFILL_QUERY_BLOCK = 16


@kernel()
def attend_prefill_t(qt, q0, G, scale, ks, vs, ends, k_pos, q_pos, masked, no_max, out, o0):
    """Causal grouped attention of n queries of one KV head over T keys, the queries given as feature rows.

    qt (>= q0 + G D, n) float32: query head g's dimension d of every query is row q0 + g D + d (a chip's
    q|k|v projection computed transposed, ``compiled._prefill_attention_chip``), multiplied by ``scale``
    (float32; 1/sqrt(D), or 1 for queries already scaled) as they are read; ks, vs (T, D) the sequence's
    keys and values in position order (gathered, C-contiguous); query i sees keys [0, ends[i]) (int64, from
    the sorted key positions), and if ``masked`` (keys not sorted by position) only those with
    k_pos[t] <= q_pos[i]. ``no_max`` as in :func:`attend_decode`. Writes query i's head g to out[i, o0 + g D:
    o0 + (g + 1) D] (out (n, >= o0 + G D) float32: the chip's attention output row, before ``wo``).

    Per block of ``PREFILL_QUERY_BLOCK`` queries: the scores transposed, a row per key and a column per
    (query, head): one BLAS product (keys the block sees x D) @ (D x m G). That shape ran about twice as
    fast as the scores a row per query (OpenBLAS, D = 16: 14.6 vs 27.8 us for 512 keys x 128 columns); the
    exp then runs along a key's row over the columns of the queries that see it (``exp_in_range`` when
    ``no_max`` and unmasked; else ``exp_f32`` of the score less its column's max, or less 0 with
    ``no_max``), the columns of queries that must not see the key set to 0 (what exp(-inf) gives); each
    column's sum is added over the keys in order, and one more BLAS product with V (the scores' transpose as
    its left operand) and a division by the sums finish the block. Reading the queries as rows saves a
    (n, G, D) copy of them, strided, that cost 0.25 ms of a chip's 2.8 ms layer at 512 tokens.
    """
    wide_vectors()
    n = ends.shape[0]
    D = ks.shape[1]
    mx = np.empty(PREFILL_QUERY_BLOCK * G, dtype=np.float32)
    den = np.empty(PREFILL_QUERY_BLOCK * G, dtype=np.float32)
    for s0 in range(0, n, PREFILL_QUERY_BLOCK):
        s1 = min(n, s0 + PREFILL_QUERY_BLOCK)
        m = s1 - s0
        R = m * G
        e_end = 0
        ordered = True  # the block's ends non-decreasing: a key's visible columns are one run at the end
        for i in range(s0, s1):
            e_end = max(e_end, ends[i])
            if i > s0 and ends[i] < ends[i - 1]:
                ordered = False
        # the block's queries as a (D, m G) operand, column i G + g: query s0 + i's head g (2 K floats)
        qb = np.empty((D, R), dtype=np.float32)
        for g in range(G):
            for d in range(D):
                src = qt[q0 + g * D + d]
                dst = qb[d]
                for i in range(m):
                    dst[i * G + g] = src[s0 + i] * scale
        S = np.dot(ks[:e_end], qb)  # (e_end, R): a row per key
        if no_max and ordered and not masked:  # every visible score proven within the bound: no max shift
            i0 = 0
            for t in range(e_end):
                while i0 < m and ends[s0 + i0] <= t:
                    i0 += 1
                row = S[t]
                for j in range(i0 * G):
                    row[j] = 0.0
                exp_in_range(row[i0 * G:R])
        else:
            for t in range(e_end):  # keys a query must not see: -inf
                row = S[t]
                for i in range(m):
                    if t >= ends[s0 + i] or (masked and k_pos[t] > q_pos[s0 + i]):
                        for g in range(G):
                            row[i * G + g] = -np.inf
            for j in range(R):
                mx[j] = np.float32(0.0) if no_max else np.float32(-np.inf)
            if not no_max:
                for t in range(e_end):
                    row = S[t]
                    for j in range(R):
                        mx[j] = max(mx[j], row[j])
            for t in range(e_end):
                row = S[t]
                for j in range(R):
                    row[j] = exp_f32(row[j] - mx[j])
        for j in range(R):
            den[j] = 0.0
        for t in range(e_end):
            row = S[t]
            for j in range(R):
                den[j] += row[j]
        pv = np.dot(S.T, vs[:e_end])  # (R, D)
        for i in range(m):
            for g in range(G):
                r = i * G + g
                inv = np.float32(1.0) / den[r]
                orow = out[s0 + i]
                for d in range(D):
                    orow[o0 + g * D + d] = pv[r, d] * inv


@kernel()
def silu_mul(g, u, scale, out):
    """out = silu(g) * u * scale (SwiGLU's activation), elementwise over (F,) float32; scale float32."""
    wide_legal()
    for j in range(g.shape[0]):
        out[j] = g[j] / (np.float32(1.0) + exp_f32(-g[j])) * u[j] * scale


@kernel()
def softmax_top_k(logits, k, ids, w):
    """Router: softmax over E logits, the k most probable (descending, ties to the lower id), their
    probabilities renormalised to sum 1. logits (E,) float32 (overwritten with the probabilities);
    ids (k,) int64 and w (k,) float32 outputs."""
    wide_legal()
    E = logits.shape[0]
    m = logits[0]
    for e in range(E):
        m = max(m, logits[e])
    # the exps in a loop of their own (vector lanes), then their sum in id order (the same order, so the
    # same bits, as summing inside the exp loop, which kept that loop scalar)
    for e in range(E):
        logits[e] = exp_f32(logits[e] - m)
    tot = np.float32(0.0)
    for e in range(E):
        tot += logits[e]
    inv = np.float32(1.0) / tot
    for e in range(E):
        logits[e] *= inv
    # selection in one pass over the ids: ids/w hold the best so far, descending; a probability enters only
    # if strictly above the k-th (so of equal ones the lower id, seen first, stays ahead), after every kept
    # one >= it. The same ids and order as k scans of E picking the largest left, lowest id first (strict >),
    # in one scan: most ids are refused by one compare (a prefill of 512 tokens spent 53 ms CPU in the
    # router's k x E compares, idle 2-core host). Unfilled places keep id -1 and weight -1 (probabilities
    # that are NaN never enter, as before).
    for j in range(k):
        ids[j] = -1
        w[j] = np.float32(-1.0)
    if k > 0:
        for e in range(E):
            pe = logits[e]
            if pe > w[k - 1]:
                j = k - 1
                while j > 0 and w[j - 1] < pe:
                    w[j] = w[j - 1]
                    ids[j] = ids[j - 1]
                    j -= 1
                w[j] = pe
                ids[j] = e
    tot = np.float32(0.0)
    for j in range(k):
        tot += w[j]
    for j in range(k):
        w[j] /= tot
