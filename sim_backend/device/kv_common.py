"""Constants and argument checks shared by the KV manager and its state files (one home each)."""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np

from sim_backend.errors import KVArgumentError, KVExhausted, KVStateFileError, RequestCancelled  # noqa: F401

#: Largest number of distinct sequence ids (ids 0..63): one bit each in a uint64 mask.
N_SEQ_MAX = 64

#: Identifier and version written into every saved sequence-state file.
KV_STATE_FORMAT = "calconsole-kv-seq-state"
KV_STATE_VERSION = 1

# Back-off of a waiting apply (host wall seconds): 1 ms doubling to 50 ms.
# Any free() notifies the Condition, so the back-off only bounds how late a
# cancel Event is noticed (Event.set() cannot notify our Condition).
_BACKOFF_START_S = 0.001
_BACKOFF_MAX_S = 0.050

#: Longest wait an ``apply`` / ``load_seq_state`` accepts (host wall seconds):
#: 30x the engine's 120 s step timeout; anything longer is a hang, not a wait.
MAX_TIMEOUT_S = 3600.0

#: Largest cache: 2**22 = 4,194,304 cells, 32x the 131,072-token ceiling the
#: bundle loader accepts for a context (102x the calbin's 40960); metadata is
#: 24 B a cell, so at most 96 MiB.
MAX_CELLS = 1 << 22

_POS_INF = np.iinfo(np.int64).max
_EMPTY = np.int64(-1)
_ZERO = np.uint64(0)


def _bit(seq_id: int) -> np.uint64:
    return np.uint64(1) << np.uint64(seq_id)


def _show(v: Any) -> str:
    """Short repr for an error message (a garbage argument may be huge)."""
    try:
        r = repr(v)
    except Exception:  # e.g. an int beyond sys.get_int_max_str_digits()
        r = f"<{type(v).__name__}>"
    return r if len(r) <= 60 else r[:57] + "..."


def _as_int(v: Any, name: str) -> int:
    """``v`` as a Python int; only int / numpy integer, not bool (a bool is almost surely a bug)."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise KVArgumentError(f"{name} must be an int, got {type(v).__name__} {_show(v)}")
    return int(v)


def _norm_range(p0: Any, p1: Any) -> tuple[int, int]:
    """llama.cpp's negative-bound convention: p0 < 0 -> 0, p1 < 0 -> +infinity.

    Both must be ints (any size); bounds above int64 are clamped to it, which
    changes nothing since every position is < n_ctx.
    """
    p0 = _as_int(p0, "p0")
    p1 = _as_int(p1, "p1")
    p0 = 0 if p0 < 0 else min(p0, _POS_INF)
    p1 = _POS_INF if p1 < 0 else min(p1, _POS_INF)
    return p0, p1


def _reason(e: BaseException) -> str:
    """``Type: message`` without the (possibly huge) file name an OSError repeats."""
    msg = getattr(e, "strerror", None) or _show(str(e))
    return f"{type(e).__name__}: {msg}"


def _check_timeout(v: Any) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise KVArgumentError(f"timeout must be a number of seconds, got {type(v).__name__} {_show(v)}")
    t = float(v)
    if not (math.isfinite(t) and 0.0 <= t <= MAX_TIMEOUT_S):
        raise KVArgumentError(f"timeout must be finite seconds in 0..{MAX_TIMEOUT_S:g}, got {_show(v)}")
    return t


def _check_cancel(v: Any) -> threading.Event | None:
    if v is not None and not isinstance(v, threading.Event):
        raise KVArgumentError(f"cancel must be a threading.Event or None, got {type(v).__name__}")
    return v
