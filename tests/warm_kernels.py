"""Compile (or load from numba's disk cache) the numerics kernels once for a test run on several workers.

``python -m tests.warm_kernels FD_MOE FD_DENSE``, started by ``tests/conftest.py`` in the pytest-xdist
controller before the workers start: it holds an exclusive ``flock`` on two lock files (inherited file
descriptors), warms the synthetic-weights model's kernels (``ShardedModel.warm_up``: the decode and prefill
steps) and closes the first, then the dense pilot's (``DenseShardedModel.warm_up``) and closes the second.
A worker's first numba compilation of a kernel from either family waits for its lock (conftest
``_wait_for_warm_kernels``), then finds the kernels in numba's cache instead of compiling the same ones
beside the other worker: on a fresh checkout each worker compiled the MoE kernels alone (23-24 s CPU each
in the suite, 2-core host under load) and the dense ones again.

Failures are silent (exit 1): a lock is released when this process ends however it ends, and a worker
that does not find a kernel in the cache compiles it itself, as without this warm-up.
"""

from __future__ import annotations

import os
import sys


def _warm(bundle_dir: str | None) -> None:
    from sim_backend.bundle.manifest import load_bundle
    from sim_backend.model.families import build_numerics

    b = load_bundle(bundle_dir)
    model = build_numerics(b.shape, b.numeric, 256)
    try:
        model.warm_up()
    finally:
        if hasattr(model, "close"):
            model.close()


def main(argv: list[str]) -> int:
    fd_moe, fd_dense = int(argv[0]), int(argv[1])
    from pathlib import Path

    pilot = str(Path(__file__).resolve().parents[1] / "sim_backend" / "bundles" / "smollm2-135m-pilot")
    rc = 0
    for fd, bundle_dir in ((fd_moe, None), (fd_dense, pilot)):
        try:
            _warm(bundle_dir)
        except Exception:  # noqa: BLE001 - the workers compile what is missing themselves
            rc = 1
        finally:
            os.close(fd)  # releases this lock: the workers waiting for these kernels go on
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
