"""Golden input/output of the bundle, and the comparison the self-test uses (facts.md F5 C1: golden I/O).

    python -m sim_backend.model.golden --write   # regenerate <bundle>/golden.npz
    python -m sim_backend.model.golden --check   # recompute; exit 1 if the stored reference no longer matches

The golden input is the Qwen3 chat-template fragment
``"<|im_start|>user\\nhi<|im_end|>\\n"`` = ``[151644, 872, 198, 6023, 151645, 198]``
(facts.md "Tokenizer" reference ids), run as ONE prefill of 6 tokens at
positions 0..5 by a freshly built ``numerics.ShardedModel`` (the synthetic
weights are deterministic from the manifest's ``numerics.seed``). Another family's
bundle (the dense pilot) uses the same text in its own tokenizer (the pilot:
``[1, 4093, 198, 6004, 2, 198]``) and its own sharded numerics (real GGUF weights).

What ``golden.npz`` stores, and why (about 0.3 MB):

- ``logits``: the last token's logits in the bundle's D2H dtype, exactly what a
  healthy device returns: uint16[151936] BF16 bit patterns for the production
  calbin (facts.md F1: logits come back as BF16, 303,872 B), float32 for a C3
  calbin that declares F32 logits (the pilot: float32[49152]). This is what the
  self-test compares to. For a BF16 device a float32 golden would not do: these
  logits reach |x| ~ 40, where BF16 spacing is 0.25, so even a perfect device
  differs from float32 by up to 0.125 > the manifest's ``max_abs_error`` 0.05.
- ``ref_topk_ids`` / ``ref_topk_logits``: the 64 largest float32 reference
  logits (int32 / float32), for a readable report and for checking the
  float32 path without storing 600 KB.
- ``ref_sha256``: SHA-256 of the full float32 reference logits (little
  endian). Reported by ``--check`` as ``bit_exact``, never required: BLAS
  kernels differ between CPUs and builds, so the float32 logits are
  bit-identical only where the file was written.
- ``input_ids`` (int32), ``input_text``, ``meta`` (JSON: bundle, widths, seed, format).

What passes, on any machine (``compare``): every device logit within one
BF16 step (of the larger magnitude) plus ``golden.max_abs_error`` of the
golden BF16 value (an F32 device: within ``golden.max_abs_error`` of the
golden float32 value, no rounding step), all finite, and the same top-1 token. Why: another CPU's
float32 logits drift by a few 1e-6 (``F32_DRIFT_ATOL``), which BF16
rounding turns into at most one step (0.03125 at |x| in [4, 8)); a healthy
device here gives 0.0 and elsewhere a few one-step flips. A corrupted
weight, KV cell or routing decision moves many logits by 0.3 to 20 and
fails. ``--write`` refuses a golden input whose top-1 lead is not twice
the bound, so top-1 agreement follows from the bound.

The file is written with ``np.savez_compressed``; it is far under the
700 KB budget (the full float32 vector alone would be 608 KB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import stat
import sys
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sim_backend.errors import ManifestError
from sim_backend.model.bf16 import bf16_to_f32, f32_to_bf16
from sim_backend.model.logits import NUMPY_DTYPES, dtype_of, to_d2h, to_f32

if TYPE_CHECKING:
    from sim_backend.bundle.manifest import Bundle

GOLDEN_FORMAT = "calconsole-golden/1"
GOLDEN_TEXT = "<|im_start|>user\nhi<|im_end|>\n"
GOLDEN_IDS = (151644, 872, 198, 6023, 151645, 198)
TOPK = 64
GOLDEN_FILE_NAME = "golden.npz"
#: Largest float32 logit drift (absolute) allowed between machines for the same golden job.
#: Measured: the job recomputed under six OpenBLAS 0.3.31 kernels (Prescott, Nehalem, Sandybridge,
#: Haswell, Zen, SkylakeX via OPENBLAS_CORETYPE; numpy 2.4) moves float32 logits by at most 7.9e-6
#: (relative 6.1e-6, |logit| <= 40). 1e-3 is >100x that, and 60x below one BF16 step at |x| = 8.
F32_DRIFT_ATOL = 1e-3
#: Largest golden file accepted (bytes); the shipped one is ~0.25 MB.
GOLDEN_MAX_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Golden:
    """A loaded golden file. ``logits``: the expected device output (vocab,) in the D2H dtype, uint16 BF16
    bits or float32 (``dtype``); ``expected`` the same as float32."""

    path: Path
    input_ids: np.ndarray
    logits: np.ndarray
    ref_topk_ids: np.ndarray
    ref_topk_logits: np.ndarray
    ref_sha256: str
    meta: dict[str, Any]

    @property
    def dtype(self) -> str:
        """``bf16`` or ``f32``: the D2H dtype the stored output is in."""
        return dtype_of(self.logits)

    @property
    def expected(self) -> np.ndarray:
        return np.array(to_f32(self.logits), dtype=np.float32)


def bf16_bits_to_f32(u16: np.ndarray) -> np.ndarray:
    """BF16 bits (taken as uint16, any shape) -> float32, the same shape."""
    return bf16_to_f32(np.asarray(u16, dtype=np.uint16))


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 (anything array-like) -> BF16 bits, uint16 of the same shape."""
    return f32_to_bf16(x)


def golden_ids(bundle: Bundle) -> tuple[int, ...]:
    """The golden input's ids in the bundle's tokenizer (Qwen3: ``GOLDEN_IDS``, checked)."""
    from sim_backend.model.families import tokenizer_for

    ids = tuple(int(i) for i in tokenizer_for(bundle).encode(GOLDEN_TEXT, allow_special=True))
    if bundle.family == "qwen3_moe" and ids != GOLDEN_IDS:
        raise RuntimeError(f"tokenizer gives {list(ids)} for the golden text, expected {list(GOLDEN_IDS)}")
    return ids


def reference_logits(bundle: Bundle, kernels: str = "numpy") -> np.ndarray:
    """Float32 last-token logits of the golden input from the bundle's freshly built sharded numerics
    (host wall ~0.1 s for Qwen3's synthetic weights, a few s for the pilot's GGUF).

    ``kernels``: ``numpy`` (the reference the golden file is written from) or ``compiled`` (the kernels
    the device runs by default; ``check_golden`` reports how far they are from the reference)."""
    from sim_backend.model.families import build_numerics

    ids = np.asarray(golden_ids(bundle), dtype=np.int64)
    n = len(ids)
    model = build_numerics(bundle.shape, bundle.numeric, max(8, n), kernels=kernels)
    pos = np.arange(n, dtype=np.int64)
    out = model.forward(ids, pos, pos.copy(), pos.copy(), pos.copy())
    return np.asarray(out.logits, dtype=np.float32)


def sha256_f32(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x, dtype="<f4").tobytes()).hexdigest()


def compute_golden(bundle: Bundle) -> dict[str, np.ndarray]:
    """The arrays written to golden.npz (see module docstring)."""
    ids = list(golden_ids(bundle))
    ref = reference_logits(bundle)
    top = np.argsort(-ref, kind="stable")[:TOPK]
    # Top-1 agreement is part of the pass rule, so it must follow from the error bound on any CPU:
    # the lead over the runner-up must exceed twice the bound at that magnitude.
    gap = float(ref[top[0]] - ref[top[1]])
    need = 2 * (float(error_bound(ref[top[:1]], ref[top[:1]], bundle.golden_max_abs_error)[0])
                if bundle.logits_dtype == "bf16" else bundle.golden_max_abs_error)
    if not gap > need:
        raise RuntimeError(f"golden input's top-1 lead {gap:.4g} is not above twice the error bound ({need:.4g}): "
                           "top-1 agreement would not be guaranteed across machines; pick another golden input")
    meta = {"format": GOLDEN_FORMAT, "bundle": bundle.name, "numerics": {
        "hidden": bundle.numeric.hidden, "head_dim": bundle.numeric.head_dim,
        "expert_ffn": bundle.numeric.expert_ffn, "seed": bundle.numeric.seed, "weights": bundle.numeric.weights},
        "vocab": int(ref.shape[0]), "job": "one prefill, positions 0..5",
        "logits": ("uint16 BF16 bits" if bundle.logits_dtype == "bf16" else "float32 values")
                  + " of the expected device output (D2H dtype)",
        "max_abs_logit": float(np.max(np.abs(ref))), "top1_lead": gap}
    return {
        "input_ids": np.asarray(ids, dtype=np.int32),
        "input_text": np.array(GOLDEN_TEXT),
        "logits": to_d2h(ref, bundle.logits_dtype),
        "ref_topk_ids": top.astype(np.int32),
        "ref_topk_logits": ref[top].astype(np.float32),
        "ref_sha256": np.array(sha256_f32(ref)),
        "meta": np.array(json.dumps(meta)),
    }


def write_golden(bundle_dir: str | Path | None = None, path: str | Path | None = None) -> Path:
    """Regenerate the golden file (default ``<bundle>/golden.npz``); returns its path."""
    from sim_backend.bundle.manifest import load_bundle

    bundle = load_bundle(bundle_dir)
    out = Path(path) if path is not None else bundle.path / GOLDEN_FILE_NAME
    arrays = compute_golden(bundle)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
    tmp.replace(out)
    return out


class GoldenFileError(ManifestError):
    """The golden file is missing, unreadable, truncated or malformed (``file``, ``field`` name it)."""


def load_golden(path: str | Path, dtype: str = "bf16") -> Golden:
    """Read a golden file (npz, at most ``GOLDEN_MAX_BYTES``) for a device that returns ``dtype`` logits
    (the bundle's ``logits_dtype``: ``bf16``, or ``f32`` for a C3 calbin that declares it).

    A BF16 device's golden may hold floats (rounded to BF16 here); an F32 device's must hold floats
    (BF16 bits cannot be widened back to what the device returns).

    Raises GoldenFileError naming the file and the array for anything wrong with it: not a regular
    file, too large, not a zip/npz (truncated, damaged), pickled objects, a missing array, wrong
    dtype (BF16 bits for an F32 device: regenerate the file) or size. Nothing else escapes (no
    BadZipFile, EOFError, KeyError).
    """
    if dtype not in NUMPY_DTYPES:
        raise ValueError(f"unknown logits dtype {dtype!r} (known: {', '.join(NUMPY_DTYPES)})")
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise GoldenFileError(str(p), "golden.file", f"cannot read: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise GoldenFileError(str(p), "golden.file", "not a regular file")
    if st.st_size > GOLDEN_MAX_BYTES:
        raise GoldenFileError(str(p), "golden.file", f"{st.st_size} bytes, more than {GOLDEN_MAX_BYTES}")

    def arr(z: np.lib.npyio.NpzFile, key: str) -> np.ndarray | None:
        return np.asarray(z[key]) if key in z.files else None

    def need(z: np.lib.npyio.NpzFile, key: str) -> np.ndarray:
        got = arr(z, key)
        if got is None:
            raise GoldenFileError(str(p), key, "array missing")
        return got

    try:
        with np.load(p, allow_pickle=False) as z:
            ids = need(z, "input_ids").reshape(-1)
            logits = need(z, "logits").reshape(-1)
            topk_ids, topk_logits = arr(z, "ref_topk_ids"), arr(z, "ref_topk_logits")
            sha, meta = arr(z, "ref_sha256"), arr(z, "meta")
    except GoldenFileError:
        raise
    except (OSError, EOFError, ValueError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        raise GoldenFileError(str(p), "golden.file", f"damaged or not an npz file ({type(e).__name__}: {e})") from None
    if ids.dtype.kind not in "iu" or ids.size == 0 or ids.size > 4096:
        raise GoldenFileError(str(p), "input_ids", f"need 1-4096 integer token ids, got {ids.size} of {ids.dtype}")
    if logits.size == 0 or logits.size > 1 << 20:
        raise GoldenFileError(str(p), "logits", f"need 1..{1 << 20} logits, got {logits.size}")
    if dtype == "f32":
        if logits.dtype.kind != "f":
            held = "BF16 bits" if logits.dtype == np.uint16 else str(logits.dtype)
            raise GoldenFileError(str(p), "logits", f"holds {held}, but this bundle's device returns f32 logits: "
                                  "regenerate it (python -m sim_backend.model.golden --write --bundle <dir>)")
        logits = logits.astype(np.float32)
    elif logits.dtype != np.uint16:  # a float golden: convert to the device's BF16
        if logits.dtype.kind != "f":
            raise GoldenFileError(str(p), "logits", f"need uint16 BF16 bits or floats, got {logits.dtype}")
        logits = _f32_to_bf16_bits(logits.astype(np.float32))
    if topk_ids is None or topk_logits is None or topk_ids.dtype.kind not in "iu" or \
            topk_ids.reshape(-1).shape != topk_logits.reshape(-1).shape or \
            (topk_ids.size and not (0 <= int(topk_ids.min()) and int(topk_ids.max()) < logits.size)):
        topk_ids, topk_logits = np.zeros(0, np.int32), np.zeros(0, np.float32)
    try:
        meta_d = json.loads(str(meta)) if meta is not None else {}
    except ValueError:
        raise GoldenFileError(str(p), "meta", "not JSON") from None
    return Golden(path=p, input_ids=ids.astype(np.int64), logits=logits,
                  ref_topk_ids=topk_ids.reshape(-1), ref_topk_logits=topk_logits.reshape(-1).astype(np.float32),
                  ref_sha256=str(sha) if sha is not None else "",
                  meta=meta_d if isinstance(meta_d, dict) else {})


def bf16_step(x: np.ndarray) -> np.ndarray:
    """Spacing of BF16 values at ``|x|`` (float64, same shape): ``2**(e - 8)`` for ``|x|`` in ``[2**(e-1), 2**e)``.

    BF16 keeps 8 significant bits (7 stored), so one step is between 2**-8 and 2**-7 of ``|x|``;
    zero and subnormals get the smallest normal step (2**-133).
    """
    a = np.abs(np.asarray(x, dtype=np.float64))
    _, e = np.frexp(np.maximum(a, 2.0**-126))  # below the smallest normal the spacing stays 2**-133
    return np.ldexp(1.0, e.astype(np.int64) - 8)


def error_bound(want: np.ndarray, got: np.ndarray, margin: float) -> np.ndarray:
    """Per-logit bound on ``|got - want|`` for a healthy device (float64, same shape as ``want``).

    ``want`` is the golden BF16 output, ``got`` the device's. Both are float32 logits rounded to
    BF16; on another CPU or BLAS build the float32 logits differ by a drift ``d`` (measured at most
    7.9e-6 across six OpenBLAS kernels, ``F32_DRIFT_ATOL``), and round-to-nearest turns that into
    ``|bf16(a) - bf16(b)| <= |a - b| + one BF16 step`` at the larger magnitude. So the bound is one
    BF16 step plus ``margin`` (the manifest's ``golden.max_abs_error``, which must cover the drift).
    """
    return bf16_step(np.maximum(np.abs(want), np.abs(got))) + float(margin)


def compare(golden: Golden, device_logits: np.ndarray, tolerance: float) -> dict[str, Any]:
    """Compare the device's D2H logits (shape (vocab,): uint16 BF16 bits, or float32 from an F32 calbin)
    with the golden output, which must be of the same dtype.

    Pass rule (the same on every machine; never bit-exact): dtypes and shapes match, every logit is
    finite, every ``|device - golden| <= one BF16 step + tolerance`` (``error_bound``; F32 logits:
    ``<= tolerance``, there is no rounding step), and the top-1 token agrees. ``tolerance`` is the
    manifest's ``golden.max_abs_error`` (default 0.05): 6,000x the float32 drift measured across CPUs,
    yet far below what a corrupted weight, KV cell or routing decision does (errors of 0.3 to 20 on
    many logits; see the golden tests).

    Returns {"ok", "max_abs_error", "tolerance", "worst_of_bound", "n_bf16_steps" (BF16) or
    "n_differ" (F32), "argmax_device", "argmax_golden", "top1_match", "topk_overlap", "n_mismatched",
    "rule", "dtype"}: ``worst_of_bound`` is max(|error| / bound) (<= 1 passes), ``n_bf16_steps`` /
    ``n_differ`` how many logits differ at all (one-step rounding flips, last-bit float32 drift, are
    expected across CPUs), ``n_mismatched`` how many exceed the bound.
    Raises TypeError for logits of another dtype.
    """
    dt = dtype_of(np.asarray(device_logits))
    bf16 = dt == "bf16"
    rule = f"|error| <= {'1 BF16 step + ' if bf16 else ''}{tolerance:g}, top-1 agrees"
    if dt != golden.dtype:
        return {"ok": False, "max_abs_error": None, "tolerance": tolerance, "rule": rule, "dtype": dt,
                "top1_match": False, "detail": f"the device returns {dt} logits, the golden file holds {golden.dtype}"
                                               " (regenerate it: python -m sim_backend.model.golden --write)"}
    got = np.array(to_f32(np.asarray(device_logits).reshape(-1)), dtype=np.float32)
    want = golden.expected
    if got.shape != want.shape:
        return {"ok": False, "max_abs_error": None, "tolerance": tolerance, "rule": rule, "dtype": dt,
                "top1_match": False, "detail": f"logits shape {got.shape} != golden {want.shape}"}
    finite = bool(np.isfinite(got).all())
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    if finite:
        ratio = diff / (error_bound(want, got, tolerance) if bf16 else float(tolerance))
        err, worst = float(np.max(diff)), float(np.max(ratio))
        n_bad = int(np.count_nonzero(ratio > 1.0))
    else:
        err, worst, n_bad = float("inf"), float("inf"), int(got.size)
    k = len(golden.ref_topk_ids) or TOPK
    top_dev = set(np.argsort(-got, kind="stable")[:k].tolist())
    top_ref = set(golden.ref_topk_ids.tolist()) if len(golden.ref_topk_ids) else set(
        np.argsort(-want, kind="stable")[:k].tolist())
    top1 = bool(finite and np.argmax(got) == np.argmax(want))
    return {"ok": bool(finite and n_bad == 0 and top1), "max_abs_error": err, "tolerance": tolerance,
            "worst_of_bound": worst, ("n_bf16_steps" if bf16 else "n_differ"): int(np.count_nonzero(diff)),
            "rule": rule, "dtype": dt,
            "argmax_device": int(np.argmax(got)), "argmax_golden": int(np.argmax(want)),
            "top1_match": top1, "topk_overlap": f"{len(top_dev & top_ref)}/{k}", "n_mismatched": n_bad}


def check_golden(bundle_dir: str | Path | None = None) -> dict[str, Any]:
    """Recompute the reference on this machine and compare it with the stored golden file.

    Passes iff (1) the recomputed logits, in the bundle's D2H dtype (rounded to BF16, or float32),
    meet ``compare``'s rule against the stored output with the bundle's tolerance, and (2) the
    recomputed float32 logits of the stored top-64 tokens are within ``F32_DRIFT_ATOL`` of the stored
    ones. ``bit_exact`` (the SHA-256 of the float32 logits) is reported, never required: it holds only
    on the CPU and BLAS build that wrote the file. Raises GoldenFileError if the file is unreadable.
    """
    from sim_backend.bundle.manifest import load_bundle

    bundle = load_bundle(bundle_dir)
    if bundle.golden_file is None:
        return {"ok": False, "detail": "no golden file in the bundle"}
    g = load_golden(bundle.golden_file, bundle.logits_dtype)
    want_ids = golden_ids(bundle)
    if tuple(int(i) for i in g.input_ids) != want_ids:
        # the device self-test feeds the stored ids: a file whose ids were changed must not pass here
        return {"ok": False, "path": str(g.path), "detail": f"input_ids {g.input_ids.tolist()} are not the golden "
                                                            f"input {list(want_ids)}"}
    ref = reference_logits(bundle)
    rep = compare(g, to_d2h(ref, bundle.logits_dtype), bundle.golden_max_abs_error)
    drift = float(np.max(np.abs(ref[g.ref_topk_ids.astype(np.int64)] - g.ref_topk_logits))) \
        if len(g.ref_topk_ids) and ref.shape == (int(g.logits.size),) else None
    f32_ok = drift is not None and drift <= F32_DRIFT_ATOL
    # the compiled kernels (what the device runs) against the reference: another summation order and exp,
    # so a drift of the same kind as another BLAS build's, held to the same F32_DRIFT_ATOL, and its BF16
    # logits meet the self-test's rule against the stored file
    compiled: dict[str, Any] | None = None
    comp_ok = True
    if bundle.shape.is_moe:  # the family with compiled kernels
        comp = reference_logits(bundle, kernels="compiled")
        comp_drift = float(np.max(np.abs(comp.astype(np.float64) - ref)))
        comp_rep = compare(g, to_d2h(comp, bundle.logits_dtype), bundle.golden_max_abs_error)
        comp_ok = bool(comp_rep["ok"] and comp_drift <= F32_DRIFT_ATOL)
        compiled = {"ok": comp_ok, "f32_max_drift": comp_drift, "device": comp_rep}
    # "device": the comparison in the D2H dtype ("dtype" says which: bf16 or f32)
    return {"ok": bool(rep["ok"] and f32_ok and comp_ok), "path": str(g.path), "device": rep,
            "f32_topk_drift": drift, "f32_drift_atol": F32_DRIFT_ATOL, "compiled": compiled,
            "bit_exact": sha256_f32(ref) == g.ref_sha256, "bytes": g.path.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim_backend.model.golden",
                                description="Write or check the bundle's golden self-test file "
                                            "(golden input and the device's output in its D2H dtype).")
    p.add_argument("--write", action="store_true", help="regenerate the bundle's golden.npz")
    p.add_argument("--check", action="store_true", help="recompute and compare with the stored file")
    p.add_argument("--bundle", default=None, metavar="DIR")
    p.add_argument("--out", default=None, metavar="PATH", help="with --write: write here instead")
    a = p.parse_args(argv)
    if not (a.write or a.check):
        p.error("give --write or --check")
    if a.write:
        out = write_golden(a.bundle, a.out)
        print(f"wrote {out} ({out.stat().st_size} bytes)")
    if a.check:
        try:
            rep = check_golden(a.bundle)
        except ManifestError as e:  # a damaged golden file or bundle: one line, not a traceback
            print(f"golden --check: {e}", file=sys.stderr)
            return 2
        print(json.dumps(rep))
        return 0 if rep["ok"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
