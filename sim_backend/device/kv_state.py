"""KV sequence state files (llama.cpp ``llama_state_seq_save_file`` / ``load_file`` semantics):
save one sequence's cells to an .npz, load them into another sequence all-or-nothing.

``KVStateFiles`` is the part of ``KVCacheManager`` that reads and writes them; a damaged, truncated
or hostile file raises ``KVStateFileError`` and changes nothing.
"""

from __future__ import annotations

import os
import stat
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

#: Largest number of distinct sequence ids (ids 0..63): one bit each in a uint64 mask.
from sim_backend.device.kv_common import (
    KV_STATE_FORMAT,
    KV_STATE_VERSION,
    _as_int,
    _bit,
    _check_cancel,
    _check_timeout,
    _reason,
    _show,
)
from sim_backend.errors import KVArgumentError, KVStateFileError

#: one array of a state file: (shape, dtype, cell axis)
Spec = tuple[tuple[int, ...], np.dtype, int]


@runtime_checkable
class KVValueStore(Protocol):
    """Arrays with an ``n_cells`` axis held by someone else (the device's K/V, in this process or in the
    numerics worker): described by ``kv_layout`` and read or written by cell, never handed out whole."""

    def kv_layout(self) -> list[tuple[tuple[int, ...], str, int]]:
        """(shape, numpy dtype string, cell axis) of each array."""
        ...

    def kv_take(self, cells: np.ndarray) -> list[np.ndarray]:
        """Each array's rows at ``cells`` (int64, in that order) along its cell axis."""
        ...

    def kv_put(self, cells: np.ndarray, rows: Sequence[np.ndarray]) -> None:
        """Write ``rows`` (as ``kv_take`` returns them) into each array at ``cells``."""
        ...


class KVStateFiles:
    """Mixin of ``KVCacheManager``: ``save_seq_state`` / ``load_seq_state`` and their file checks."""

    # what the mixin uses of KVCacheManager (declared for the type checker; defined there)
    n_cells: int
    n_ctx: int
    bytes_per_token_per_chip: int
    _cond: threading.Condition
    _seqs: np.ndarray

    if TYPE_CHECKING:
        def _check_seq(self, seq_id: Any, name: str = "seq_id") -> int: ...
        def _has(self, seq_id: int) -> np.ndarray: ...
        def _n_used(self) -> int: ...
        def _drop_seq(self, sel: np.ndarray, seq_id: int) -> int: ...
        def _freed(self, n: int) -> None: ...
        def _wait_for(self, n: int, available: Callable[[], int], timeout: float,
                      cancel: threading.Event | None) -> None: ...
        def _allocate(self, s: int, n: int, pos_req: np.ndarray | None) -> np.ndarray: ...
        def _seq_cells_locked(self, s: int) -> tuple[np.ndarray, np.ndarray]: ...

    def save_seq_state(self, seq_id: int, path: str | os.PathLike[str],
                       arrays: Sequence[tuple[np.ndarray, int]] = (), *, values: KVValueStore | None = None) -> int:
        """Save one sequence's state to ``path`` (``np.savez``; llama_state_seq_save_file).

        Saved: format id and version, ``n_cells`` and
        ``bytes_per_token_per_chip`` the file was made with, the sequence's
        positions (sorted), and for each ``(array, cell_axis)`` the rows of
        ``array`` at the sequence's cells along ``cell_axis`` (e.g. K/V shaped
        ``(layers, kv_heads, n_cells, head_dim)`` with axis 2). Written to a
        temp file then renamed, so a crash never leaves a half file.

        ``values``: arrays held elsewhere (the device's K/V, possibly in the
        numerics worker process; ``KVValueStore``), saved after ``arrays``
        the same way, their rows taken by cell.

        Returns the number of tokens saved.

        Raises:
            KVArgumentError: bad seq_id, ``path`` not a path, ``arrays`` not a
                list of ``(numpy array with an n_cells axis, int axis)``.
            KVStateFileError: the file cannot be written (no temp file is left;
                an existing symlink at the temp name is not followed).
        """
        s = self._check_seq(seq_id)
        path = self._check_path(path)
        targets = self._check_arrays(arrays, for_load=False)
        specs = self._specs(targets, values)
        with self._cond:
            cells, pos = self._seq_cells_locked(s)
        rows = [np.take(arr, cells, axis=axis) for arr, axis in targets]
        if values is not None:
            rows += list(values.kv_take(cells))
        payload: dict[str, np.ndarray] = {
            "format": np.array(KV_STATE_FORMAT),
            "version": np.array(KV_STATE_VERSION, dtype=np.int64),
            "n_cells": np.array(self.n_cells, dtype=np.int64),
            "bytes_per_token_per_chip": np.array(self.bytes_per_token_per_chip, dtype=np.int64),
            "seq_id": np.array(s, dtype=np.int64),
            "positions": pos,
        }
        payload["n_arrays"] = np.array(len(specs), dtype=np.int64)
        for i, ((_, _, axis), r) in enumerate(zip(specs, rows, strict=True)):
            payload[f"axis_{i}"] = np.array(axis, dtype=np.int64)
            payload[f"rows_{i}"] = r
        tmp = path + ".tmp"
        try:
            # explicit file (np.savez would append ".npz" to a str); O_NOFOLLOW: a symlink planted at the
            # temp name is refused, never written through
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **payload)  # type: ignore[arg-type]  # numpy's stub types **kwds as allow_pickle
            os.replace(tmp, path)
        except (OSError, ValueError) as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise KVStateFileError(path, f"cannot write ({_reason(e)})") from None
        return int(cells.size)

    def load_seq_state(
        self,
        seq_id: int,
        path: str | os.PathLike[str],
        arrays: Sequence[tuple[np.ndarray, int]] = (),
        *,
        timeout: float,
        cancel: threading.Event | None = None,
        values: KVValueStore | None = None,
    ) -> int:
        """Load a sequence state saved by ``save_seq_state`` into ``seq_id``.

        All or nothing. The arguments and the whole file are validated first
        (a regular file no larger than such a state can be; an ``.npz`` with
        every field of the right dtype and shape: format, version,
        ``n_cells``, ``bytes_per_token_per_chip``, positions ``0..n_ctx-1``,
        array count/axis/shape/dtype). Then, as llama.cpp does, ``seq_id``'s
        current cells are replaced by fresh cells at the saved positions and
        the saved rows are written into ``arrays`` at those cells. The swap
        happens only once enough cells are free counting those ``seq_id``
        holds alone (bounded wait: ``timeout`` host wall seconds, ``cancel``).

        ``values``: as for ``save_seq_state`` (their rows follow ``arrays``'
        in the file and are put by cell after the swap).

        Returns the number of tokens loaded.

        Raises:
            KVStateFileError: the file is missing, unreadable, truncated,
                malformed or made for another cache.
            KVArgumentError: bad seq_id, timeout, cancel or arrays (arrays
                must be writeable).
            KVExhausted / RequestCancelled: not enough cells in time / cancelled.
            On any of these nothing changed: ``seq_id`` keeps its cells and
            ``arrays`` their contents.
        """
        s = self._check_seq(seq_id)
        path = self._check_path(path)
        timeout = _check_timeout(timeout)
        cancel = _check_cancel(cancel)
        targets = self._check_arrays(arrays, for_load=True)
        specs = self._specs(targets, values)
        pos, rows = self._read_state_file(path, specs)
        n = int(pos.size)
        bit = _bit(s)
        with self._cond:
            # cells only s holds come back when s is replaced: they count as available
            self._wait_for(n, lambda: self.n_cells - self._n_used() + int(np.count_nonzero(self._seqs == bit)),
                           timeout, cancel)
            # checked and committed under the lock, with no wait in between
            self._freed(self._drop_seq(self._has(s), s))
            cells = self._allocate(s, n, pos)
        # The device owns the arrays; rows are written outside our lock.
        for (arr, axis), r in zip(targets, rows, strict=False):
            idx: list[Any] = [slice(None)] * arr.ndim
            idx[axis] = cells
            arr[tuple(idx)] = r
        if values is not None:
            values.kv_put(cells, rows[len(targets):])
        return n

    @staticmethod
    def _specs(targets: list[tuple[np.ndarray, int]], values: KVValueStore | None) -> list[Spec]:
        """(shape, dtype, cell axis) of every array a state file holds: ``arrays`` then ``values``'."""
        specs: list[Spec] = [(tuple(a.shape), a.dtype, axis) for a, axis in targets]
        if values is not None:
            specs += [(tuple(shape), np.dtype(dt), int(axis)) for shape, dt, axis in values.kv_layout()]
        return specs

    # Failures numpy / zipfile may raise while parsing a damaged file.
    _READ_ERRORS = (OSError, ValueError, KeyError, EOFError, TypeError, OverflowError, RuntimeError,
                    NotImplementedError, SyntaxError, RecursionError, zipfile.BadZipFile, zlib.error,
                    struct.error)
    # Slack for the .npy headers and zip directory of a state file (bytes).
    _FILE_SLACK = 64 * 1024

    def _read_state_file(self, path: str, targets: list[Spec]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Read and validate a state file. Returns ``(positions int64[n], rows per array)``."""
        def bad(reason: str) -> KVStateFileError:
            return KVStateFileError(path, reason)

        # A state file holds at most n_cells positions and n_cells rows of each array.
        max_bytes = self.n_cells * 8 + sum(int(np.prod(sh)) * dt.itemsize for sh, dt, _ in targets) + self._FILE_SLACK
        try:
            # O_NONBLOCK: opening a FIFO must not wait for a writer
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError:
            raise bad("not found") from None
        except (OSError, ValueError) as e:
            raise bad(f"cannot open ({_reason(e)})") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise bad("not a regular file")
        with os.fdopen(fd, "rb") as f:
            if st.st_size > max_bytes:
                raise bad(f"{st.st_size} bytes, more than a state for this cache can be ({max_bytes})")
            try:
                head = f.read(4)
                f.seek(0)
                if head not in (b"PK\x03\x04", b"PK\x05\x06"):  # zip local header / empty archive
                    raise bad("not an .npz archive (empty, truncated at the start, or another format)")
                npz = np.load(f, allow_pickle=False)
                if not isinstance(npz, np.lib.npyio.NpzFile):
                    raise bad("not an .npz archive")
                with npz:
                    assert npz.zip is not None  # open NpzFile
                    unpacked = sum(int(i.file_size) for i in npz.zip.infolist())
                    if unpacked > max_bytes:
                        raise bad(f"unpacks to {unpacked} bytes, more than a state for this cache can be")
                    data = self._state_fields(npz, targets, bad)
            except KVStateFileError:
                raise
            except self._READ_ERRORS as e:
                raise bad(f"unreadable or truncated ({type(e).__name__}: {_show(str(e))})") from None
        return data

    def _state_fields(self, npz: Any, targets: list[Spec], bad: Callable[[str], Exception]
                      ) -> tuple[np.ndarray, list[np.ndarray]]:
        def field(key: str) -> np.ndarray:
            if key not in npz.files:
                raise bad(f"missing field {key!r}")
            value: np.ndarray = npz[key]
            return value

        def scalar(key: str) -> int:
            v = field(key)
            if v.shape != () or v.dtype.kind not in "iu":
                raise bad(f"field {key!r} must be an integer scalar, got {v.dtype} {v.shape}")
            return int(v)

        fmt = field("format")
        if fmt.shape != () or fmt.dtype.kind != "U" or str(fmt) != KV_STATE_FORMAT:
            raise bad(f"not a {KV_STATE_FORMAT} file")
        version = scalar("version")
        if version != KV_STATE_VERSION:
            raise bad(f"KV state format version {version}, this build reads {KV_STATE_VERSION}")
        f_cells = scalar("n_cells")
        f_bpt = scalar("bytes_per_token_per_chip")
        if f_cells != self.n_cells or f_bpt != self.bytes_per_token_per_chip:
            raise bad(f"made for n_cells={f_cells}, bytes_per_token_per_chip={f_bpt}; this cache has "
                      f"n_cells={self.n_cells}, bytes_per_token_per_chip={self.bytes_per_token_per_chip}")
        pos = field("positions")
        if pos.ndim != 1 or (pos.size and pos.dtype.kind not in "iu"):
            raise bad(f"field 'positions' must be a 1-D integer array, got {pos.dtype} {pos.shape}")
        n = int(pos.size)
        if n > self.n_cells:
            raise bad(f"{n} positions, more than n_cells={self.n_cells}")
        if n and not (int(pos.min()) >= 0 and int(pos.max()) < self.n_ctx):
            raise bad(f"positions must be in 0..{self.n_ctx - 1}, file has {int(pos.min())}..{int(pos.max())}")
        n_arrays = scalar("n_arrays")
        if n_arrays != len(targets):
            raise bad(f"file has {n_arrays} arrays, {len(targets)} given")
        rows = []
        for i, (shape, dtype, axis) in enumerate(targets):
            f_axis = scalar(f"axis_{i}")
            if f_axis != axis:
                raise bad(f"array {i} saved with cell axis {f_axis}, given axis {axis}")
            r = field(f"rows_{i}")
            want = list(shape)
            want[axis] = n
            if list(r.shape) != want or r.dtype != dtype:
                raise bad(f"array {i} rows are {r.shape} {r.dtype}, expected {tuple(want)} {dtype}")
            rows.append(r)
        return pos.astype(np.int64), rows

    @staticmethod
    def _check_path(path: Any) -> str:
        try:
            p = os.fspath(path)
        except TypeError:
            raise KVArgumentError(f"path must be a str or os.PathLike, got {type(path).__name__}") from None
        text = os.fsdecode(p) if isinstance(p, bytes) else p
        if not text or "\0" in text:
            raise KVStateFileError(text, "empty path or NUL character in path")
        return text

    def _check_arrays(self, arrays: Any, *, for_load: bool) -> list[tuple[np.ndarray, int]]:
        if not isinstance(arrays, (list, tuple)):
            raise KVArgumentError(f"arrays must be a list of (array, cell_axis) pairs, got {type(arrays).__name__}")
        out = []
        for i, item in enumerate(arrays):
            if not isinstance(item, (list, tuple)) or len(item) != 2:
                raise KVArgumentError(f"arrays[{i}] must be an (array, cell_axis) pair, got {type(item).__name__}")
            arr, axis = item
            axis = self._check_array(arr, axis, i)
            if arr.dtype.hasobject:
                raise KVArgumentError(f"array {i} has dtype {arr.dtype}: only plain numeric arrays are saved")
            if for_load and not arr.flags.writeable:
                raise KVArgumentError(f"array {i} is read-only: loaded rows cannot be written into it")
            out.append((arr, axis))
        return out

    def _check_array(self, arr: np.ndarray, axis: int, i: int) -> int:
        if not isinstance(arr, np.ndarray):
            raise KVArgumentError(f"array {i} is not a numpy array")
        axis = _as_int(axis, f"axis of array {i}")
        if axis < 0:
            axis += arr.ndim
        if not 0 <= axis < arr.ndim or arr.shape[axis] != self.n_cells:
            raise KVArgumentError(f"array {i} of shape {arr.shape} has no axis {axis} of length "
                                  f"n_cells={self.n_cells}")
        return axis

    # ------------------------------------------------------------ observation
