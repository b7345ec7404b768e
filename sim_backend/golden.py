"""Golden input/output of the bundle, and the comparison the self-test uses (FACTS F5 C1: golden I/O).

    python -m sim_backend.golden --write   # regenerate <bundle>/golden.npz
    python -m sim_backend.golden --check   # recompute; exit 1 if the stored reference no longer matches

The golden input is the Qwen3 chat-template fragment
``"<|im_start|>user\\nhi<|im_end|>\\n"`` = ``[151644, 872, 198, 6023, 151645, 198]``
(DESIGN "Tokenizer" reference ids), run as ONE prefill of 6 tokens at
positions 0..5 by a freshly built ``numerics.ShardedModel`` (the synthetic
weights are deterministic from the manifest's ``numerics.seed``).

What ``golden.npz`` stores, and why (about 0.3 MB):

- ``logits``: uint16[151936], the BF16 bit patterns of the last token's
  logits — exactly what a healthy device returns over D2H (FACTS F1: logits
  come back as BF16, 303,872 B). This is what the self-test compares to.
  A float32 golden would not do: these logits reach |x| ~ 40, where BF16
  spacing is 0.25, so even a perfect device differs from float32 by up to
  0.125 > the manifest's ``max_abs_error`` 0.05. Compared BF16 to BF16, a
  healthy device gives 0.0, and any corrupted weight, KV or routing shows as
  a large error.
- ``ref_topk_ids`` / ``ref_topk_logits``: the 64 largest float32 reference
  logits (int32 / float32), for a readable report and for checking the
  float32 path without storing 600 KB.
- ``ref_sha256``: SHA-256 of the full float32 reference logits (little
  endian), so ``--check`` proves the numerics still reproduce the reference
  bit for bit.
- ``input_ids`` (int32), ``input_text``, ``meta`` (JSON: bundle, widths, seed, format).

The file is written with ``np.savez_compressed``; it is far under the
700 KB budget (the full float32 vector alone would be 608 KB).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GOLDEN_FORMAT = "calconsole-golden/1"
GOLDEN_TEXT = "<|im_start|>user\nhi<|im_end|>\n"
GOLDEN_IDS = (151644, 872, 198, 6023, 151645, 198)
TOPK = 64
GOLDEN_FILE_NAME = "golden.npz"


@dataclass(frozen=True)
class Golden:
    """A loaded golden file. ``logits_bf16``: uint16 BF16 bits (vocab,); ``expected`` the same as float32."""

    path: Path
    input_ids: np.ndarray
    logits_bf16: np.ndarray
    ref_topk_ids: np.ndarray
    ref_topk_logits: np.ndarray
    ref_sha256: str
    meta: dict

    @property
    def expected(self) -> np.ndarray:
        return bf16_bits_to_f32(self.logits_bf16)


def bf16_bits_to_f32(u16: np.ndarray) -> np.ndarray:
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    from .sampling import f32_to_bf16

    return np.asarray(f32_to_bf16(np.asarray(x, dtype=np.float32)), dtype=np.uint16)


def reference_logits(bundle) -> np.ndarray:
    """Float32 last-token logits of the golden input from a fresh ``ShardedModel`` (host wall ~0.1 s)."""
    from .numerics import ShardedModel

    n = len(GOLDEN_IDS)
    model = ShardedModel(bundle.shape, bundle.numeric, n_cells=max(8, n))
    ids = np.asarray(GOLDEN_IDS, dtype=np.int64)
    pos = np.arange(n, dtype=np.int64)
    out = model.forward(ids, pos, pos.copy(), pos.copy(), pos.copy())
    return np.asarray(out.logits, dtype=np.float32)


def sha256_f32(x: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(x, dtype="<f4").tobytes()).hexdigest()


def compute_golden(bundle) -> dict[str, np.ndarray]:
    """The arrays written to golden.npz (see module docstring)."""
    from .tokenizer import get_tokenizer

    ids = get_tokenizer().encode(GOLDEN_TEXT, allow_special=True)
    if tuple(ids) != GOLDEN_IDS:
        raise RuntimeError(f"tokenizer gives {ids} for the golden text, expected {list(GOLDEN_IDS)}")
    ref = reference_logits(bundle)
    top = np.argsort(-ref, kind="stable")[:TOPK]
    meta = {"format": GOLDEN_FORMAT, "bundle": bundle.name, "numerics": {
        "hidden": bundle.numeric.hidden, "head_dim": bundle.numeric.head_dim,
        "expert_ffn": bundle.numeric.expert_ffn, "seed": bundle.numeric.seed},
        "vocab": int(ref.shape[0]), "job": "one prefill, positions 0..5",
        "logits": "uint16 BF16 bits of the expected device output (D2H dtype)",
        "max_abs_logit": float(np.max(np.abs(ref)))}
    return {
        "input_ids": np.asarray(ids, dtype=np.int32),
        "input_text": np.array(GOLDEN_TEXT),
        "logits": _f32_to_bf16_bits(ref),
        "ref_topk_ids": top.astype(np.int32),
        "ref_topk_logits": ref[top].astype(np.float32),
        "ref_sha256": np.array(sha256_f32(ref)),
        "meta": np.array(json.dumps(meta)),
    }


def write_golden(bundle_dir: str | Path | None = None, path: str | Path | None = None) -> Path:
    """Regenerate the golden file (default ``<bundle>/golden.npz``); returns its path."""
    from .bundle import load_bundle

    bundle = load_bundle(bundle_dir)
    out = Path(path) if path is not None else bundle.path / GOLDEN_FILE_NAME
    arrays = compute_golden(bundle)
    tmp = out.with_name(out.name + ".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(out)
    return out


def load_golden(path: str | Path) -> Golden:
    """Read a golden file; ValueError naming the missing array if it is malformed."""
    p = Path(path)
    with np.load(p, allow_pickle=False) as z:
        for k in ("input_ids", "logits"):
            if k not in z:
                raise ValueError(f"{p}: golden file lacks '{k}'")
        logits = np.asarray(z["logits"]).reshape(-1)
        if logits.dtype != np.uint16:  # a float golden: convert to the device's BF16
            logits = _f32_to_bf16_bits(logits.astype(np.float32))
        return Golden(
            path=p, input_ids=np.asarray(z["input_ids"]).reshape(-1).astype(np.int64), logits_bf16=logits,
            ref_topk_ids=np.asarray(z["ref_topk_ids"]) if "ref_topk_ids" in z else np.zeros(0, np.int32),
            ref_topk_logits=np.asarray(z["ref_topk_logits"]) if "ref_topk_logits" in z else np.zeros(0, np.float32),
            ref_sha256=str(z["ref_sha256"]) if "ref_sha256" in z else "",
            meta=json.loads(str(z["meta"])) if "meta" in z else {},
        )


def compare(golden: Golden, device_logits_bf16: np.ndarray, tolerance: float) -> dict:
    """Compare device BF16 logits with the golden output.

    Returns {"ok", "max_abs_error", "tolerance", "argmax_device", "argmax_golden",
    "top1_match", "topk_overlap", "n_mismatched"}; ``ok`` iff shapes match, every logit is
    finite and the max abs error (over the whole vocabulary) is <= ``tolerance``.
    """
    got = bf16_bits_to_f32(np.asarray(device_logits_bf16).reshape(-1))
    want = golden.expected
    if got.shape != want.shape:
        return {"ok": False, "max_abs_error": None, "tolerance": tolerance,
                "detail": f"logits shape {got.shape} != golden {want.shape}"}
    finite = bool(np.isfinite(got).all())
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    err = float(np.max(diff)) if finite else float("inf")
    k = len(golden.ref_topk_ids) or TOPK
    top_dev = set(np.argsort(-got, kind="stable")[:k].tolist())
    top_ref = set(golden.ref_topk_ids.tolist()) if len(golden.ref_topk_ids) else set(
        np.argsort(-want, kind="stable")[:k].tolist())
    return {"ok": bool(finite and err <= tolerance), "max_abs_error": err, "tolerance": tolerance,
            "argmax_device": int(np.argmax(got)), "argmax_golden": int(np.argmax(want)),
            "top1_match": bool(np.argmax(got) == np.argmax(want)),
            "topk_overlap": f"{len(top_dev & top_ref)}/{k}",
            "n_mismatched": int(np.count_nonzero(diff > tolerance)) if finite else int(got.size)}


def check_golden(bundle_dir: str | Path | None = None) -> dict:
    """Recompute the reference and compare it with the stored file (hash, BF16 bits, top-k)."""
    from .bundle import load_bundle

    bundle = load_bundle(bundle_dir)
    if bundle.golden_file is None:
        return {"ok": False, "detail": "no golden file in the bundle"}
    g = load_golden(bundle.golden_file)
    ref = reference_logits(bundle)
    same_hash = sha256_f32(ref) == g.ref_sha256
    same_bits = bool(np.array_equal(_f32_to_bf16_bits(ref), g.logits_bf16))
    return {"ok": same_hash and same_bits, "path": str(g.path), "sha256_match": same_hash,
            "bf16_match": same_bits, "bytes": g.path.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim_backend.golden", description=__doc__.split("\n")[0])
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
        rep = check_golden(a.bundle)
        print(json.dumps(rep))
        return 0 if rep["ok"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
