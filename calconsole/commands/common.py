"""Options shared by the console and headless commands, and building the system from them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sim_backend.device import Pacing, PacingMode


def add_common_options(p: argparse.ArgumentParser, *, default_pacing: str) -> None:
    g = p.add_argument_group("simulator")
    g.add_argument("--bundle", metavar="DIR", default=None,
                   help="calbin bundle directory (default: the built-in Qwen3-30B-A3B simulator bundle)")
    g.add_argument("--pacing", choices=[m.value for m in PacingMode], default=default_pacing,
                   help=f"map simulated device time to wall time: realtime or fast (default: {default_pacing})")
    g.add_argument("--speed", type=float, default=1.0,
                   help="with --pacing realtime: simulated seconds per wall second (default 1.0)")
    g.add_argument("--timing-only", action="store_true",
                   help="skip the numerics (no logits; tokens from a seeded generator); timings unchanged")
    g.add_argument("--slots", type=int, default=4, help="concurrent request slots (default 4)")
    g.add_argument("--audit-log", metavar="PATH", default=None,
                   help="maintenance audit log (default: $CALCONSOLE_AUDIT_LOG or the user state dir)")


def build_from_args(args: argparse.Namespace, *, maintenance: bool = True, **kw: Any):
    """Build the System from common options. Raises ManifestError / ValueError on bad input."""
    from sim_backend.system import build_system

    if args.speed <= 0:
        raise ValueError(f"--speed must be > 0, got {args.speed}")
    if not 1 <= args.slots <= 32:
        raise ValueError(f"--slots must be in 1..32, got {args.slots}")
    return build_system(args.bundle, pacing=Pacing(PacingMode(args.pacing), args.speed),
                        numerics=not args.timing_only, n_slots=args.slots, maintenance=maintenance,
                        audit_path=args.audit_log, **kw)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str, ensure_ascii=False)
    sys.stdout.write("\n")


def fail(msg: str, code: int = 2) -> int:
    print(f"calconsole: error: {msg}", file=sys.stderr)
    return code
