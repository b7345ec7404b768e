"""Read a GGUF weights file with the ``gguf`` package (llama.cpp's own reader): metadata, tokenizer
tables, chat template and tensors dequantised to float32 (Q4_1, Q8_0, F32 ... as the file stores them).

Opening a GGUF parses every metadata field (about 2-4 s of host wall time for the pilot's 49,152-token
vocabulary on a 2-core host), so :func:`open_gguf` keeps one parsed file per path per process.
Raises :class:`~sim_backend.errors.ManifestError` (file, field) for a missing, unreadable or
inconsistent file, naming the pip extra when the ``gguf`` package is absent.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from sim_backend.bundle.shapes import ModelShape
from sim_backend.errors import ManifestError

if TYPE_CHECKING:
    from gguf import GGUFReader

_EXTRA = "pip install 'calconsole[pilot]'"
#: GGUF ``tokenizer.ggml.token_type`` of a control (special) token (llama.cpp LLAMA_TOKEN_TYPE_CONTROL).
TOKEN_TYPE_CONTROL = 3


@dataclass(frozen=True)
class GGUFMeta:
    """What the serving layer and the numerics need from a GGUF's metadata.

    ``arch`` (``general.architecture``), ``context_length`` (tokens), ``tokens`` (id -> token text
    in the byte-level form), ``token_types`` (ints, 3 = control), ``merges`` ("a b" strings, by rank),
    ``bos_id`` / ``eos_id`` (token ids, -1 if absent), ``chat_template`` (Jinja source, "" if absent),
    ``add_bos`` (whether llama.cpp prepends BOS), ``pre`` (the pre-tokeniser name, e.g. "smollm").
    """

    path: str
    arch: str
    context_length: int
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    chat_template: str
    add_bos: bool
    pre: str
    scalars: dict[str, Any]


class GGUFFile:
    """One parsed GGUF: :attr:`meta` and :meth:`tensor` (float32, numpy row-major (rows, cols))."""

    def __init__(self, path: str) -> None:
        try:
            import gguf
        except ImportError:
            raise ManifestError(path, "numerics.weights", f"the gguf package is not installed: {_EXTRA}") from None
        try:
            self._reader = _reader_class()(path, "r")
        except (OSError, ValueError) as e:
            raise ManifestError(path, "<gguf>", f"cannot read GGUF: {str(e)[:200]}") from None
        self._gguf = gguf
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.meta = self._read_meta(path)

    def _field(self, key: str, default: Any = None) -> Any:
        f = self._reader.fields.get(key)
        if f is None:
            if default is None:
                raise ManifestError(self._reader_path(), key, "missing GGUF metadata field")
            return default
        return f.contents()

    def _reader_path(self) -> str:
        return str(getattr(self._reader, "path", "<gguf>"))

    def _read_meta(self, path: str) -> GGUFMeta:
        arch = str(self._field("general.architecture"))
        scalars = {}
        for k, f in self._reader.fields.items():
            if k.startswith(arch + ".") or k in ("general.name", "general.file_type"):
                v = f.contents()
                if isinstance(v, (int, float, str)):
                    scalars[k] = v
        tokens = tuple(str(t) for t in self._field("tokenizer.ggml.tokens"))
        types = tuple(int(t) for t in self._field("tokenizer.ggml.token_type"))
        merges = tuple(str(m) for m in self._field("tokenizer.ggml.merges"))
        if len(types) != len(tokens):
            raise ManifestError(path, "tokenizer.ggml.token_type", f"{len(types)} types for {len(tokens)} tokens")
        return GGUFMeta(
            path=path, arch=arch, context_length=int(self._field(f"{arch}.context_length")),
            tokens=tokens, token_types=types, merges=merges,
            bos_id=int(self._field("tokenizer.ggml.bos_token_id", -1)),
            eos_id=int(self._field("tokenizer.ggml.eos_token_id", -1)),
            chat_template=str(self._field("tokenizer.chat_template", "")),
            add_bos=bool(self._field("tokenizer.ggml.add_bos_token", False)),
            pre=str(self._field("tokenizer.ggml.pre", "default")),
            scalars=scalars,
        )

    def has_tensor(self, name: str) -> bool:
        return name in self._tensors

    def tensor_type(self, name: str) -> str:
        """The stored format of tensor ``name`` ("Q4_1", "Q8_0", "F32", ...)."""
        return str(self._tensors[name].tensor_type.name)

    def tensor(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantised to float32, shape (rows, cols) = GGUF (ne1, ne0) (a matrix's
        rows are its outputs). Raises ManifestError for a missing tensor."""
        t = self._tensors.get(name)
        if t is None:
            raise ManifestError(self._reader_path(), name, "missing tensor in the GGUF")
        a = self._gguf.quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(a, dtype=np.float32)

    def raw(self, name: str) -> tuple[np.ndarray, int, int]:
        """Tensor ``name`` as stored: (its bytes as a uint8 array, rows, cols), rows = GGUF ne1 (a matrix's
        outputs), cols = ne0. Raises ManifestError for a missing tensor."""
        t = self._tensors.get(name)
        if t is None:
            raise ManifestError(self._reader_path(), name, "missing tensor in the GGUF")
        cols = int(t.shape[0])
        rows = int(np.prod([int(v) for v in t.shape[1:]])) if len(t.shape) > 1 else 1
        return np.asarray(t.data).view(np.uint8), rows, cols

    def tensor_table(self) -> tuple[tuple[str, str, int, int, int, int], ...]:
        """Where each tensor is in the file: (name, format, rows, cols, file offset, bytes), picklable. A
        process given it reads the tensors with :class:`MappedTensors` without parsing the GGUF again."""
        out = []
        for name, t in self._tensors.items():
            cols = int(t.shape[0])
            rows = int(np.prod([int(v) for v in t.shape[1:]])) if len(t.shape) > 1 else 1
            out.append((name, str(t.tensor_type.name), rows, cols, int(t.data_offset), int(t.n_bytes)))
        return tuple(out)

    def check_shape(self, shape: ModelShape) -> None:
        """Raise ManifestError unless the GGUF's hyper-parameters are the bundle's ``shape``."""
        a = self.meta.arch
        want = {f"{a}.block_count": shape.n_layers, f"{a}.embedding_length": shape.hidden,
                f"{a}.attention.head_count": shape.n_q_heads, f"{a}.attention.head_count_kv": shape.n_kv_heads,
                f"{a}.feed_forward_length": shape.ffn, f"{a}.rope.dimension_count": shape.head_dim}
        for key, v in want.items():
            got = self.meta.scalars.get(key)
            if got is not None and int(got) != v:
                raise ManifestError(self.meta.path, key, f"GGUF says {got}, the bundle's model says {v}")
        if len(self.meta.tokens) != shape.vocab:
            raise ManifestError(self.meta.path, "tokenizer.ggml.tokens",
                                f"{len(self.meta.tokens)} tokens, the bundle's vocab is {shape.vocab}")
        theta = self.meta.scalars.get(f"{a}.rope.freq_base")
        if theta is not None and abs(float(theta) - shape.rope_theta) > 1e-6 * shape.rope_theta:
            raise ManifestError(self.meta.path, f"{a}.rope.freq_base", f"GGUF {theta}, bundle {shape.rope_theta}")
        if shape.n_ctx > self.meta.context_length:
            raise ManifestError(self.meta.path, f"{a}.context_length",
                                f"the bundle's context {shape.n_ctx} exceeds the model's {self.meta.context_length}")
        if shape.tied_embeddings == self.has_tensor("output.weight"):
            raise ManifestError(self.meta.path, "output.weight",
                                "tied_embeddings disagrees with the GGUF (an output.weight tensor "
                                + ("exists)" if shape.tied_embeddings else "is missing)"))


class MappedTensors:
    """The tensors of a GGUF already parsed elsewhere (:meth:`GGUFFile.tensor_table`), read from a memory
    map of the file: what the numerics worker process uses, so the pilot's GGUF is parsed once at start
    (by the console's process, for the tokenizer) instead of once per process (2-9 s of host wall each).
    Same ``has_tensor`` / ``tensor_type`` / ``raw`` / ``tensor`` (F32 tensors only) as :class:`GGUFFile`.
    Raises ManifestError for an unreadable file or a table that does not fit it."""

    def __init__(self, path: str, table: tuple[tuple[str, str, int, int, int, int], ...]) -> None:
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ManifestError(path, "<gguf>", f"cannot map GGUF: {str(e)[:200]}") from None
        self.path = path
        self._table = {row[0]: row for row in table}
        size = int(self._map.shape[0])
        for name, _, _, _, off, nbytes in table:
            if off < 0 or off + nbytes > size:
                raise ManifestError(path, name, f"tensor bytes {off}+{nbytes} lie outside the {size}-byte file")

    def has_tensor(self, name: str) -> bool:
        return name in self._table

    def tensor_type(self, name: str) -> str:
        return self._row(name)[1]

    def _row(self, name: str) -> tuple[str, str, int, int, int, int]:
        row = self._table.get(name)
        if row is None:
            raise ManifestError(self.path, name, "missing tensor in the GGUF")
        return row

    def raw(self, name: str) -> tuple[np.ndarray, int, int]:
        _, _, rows, cols, off, nbytes = self._row(name)
        return np.asarray(self._map[off:off + nbytes]).view(np.ndarray), rows, cols

    def tensor(self, name: str) -> np.ndarray:
        """An F32 tensor as float32 (rows, cols), or (cols,) for a vector. ManifestError for another format."""
        kind = self.tensor_type(name)
        if kind != "F32":
            raise ManifestError(self.path, name, f"{kind} tensor read as F32")
        raw, rows, cols = self.raw(name)
        a = np.ascontiguousarray(raw).view("<f4").astype(np.float32)
        return a if rows == 1 else a.reshape(rows, cols)


def _reader_class() -> type[GGUFReader]:
    """``gguf.GGUFReader`` over a plain ndarray view of its memory map: the reader slices the map
    ~250,000 times while parsing a 49k-token vocabulary, and ``np.memmap``'s per-slice hooks made
    that 3.1 s of CPU; on the plain view it is 0.9 s (same bytes, same fields, same tensors). Raises
    ImportError without the ``gguf`` package (the pilot extra)."""
    import gguf

    class _Reader(gguf.GGUFReader):
        # the reader's np.memmap becomes a plain view of it: no longer a memmap, on purpose (the reader only
        # slices and views it), so the override narrows nothing the reader uses
        @property  # type: ignore[override]
        def data(self) -> NDArray[np.uint8]:
            return self._plain

        @data.setter
        def data(self, value: NDArray[np.uint8]) -> None:
            self._plain: NDArray[np.uint8] = value.view(np.ndarray)  # keeps the mapping alive through .base

    return _Reader


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=2)
def _open(path: str) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The parsed GGUF at ``path`` (one per path per process; thread-safe). Raises ManifestError."""
    with _LOCK:
        return _open(path)
