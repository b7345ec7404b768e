"""Options shared by the console and headless commands, and building the system from them."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from sim_backend.device import Pacing, PacingMode


# Defaults of the shared options. Sub-command parsers register the options with
# SUPPRESS so a value given before the sub-command (``calconsole --bundle D
# snapshot``) is not overwritten by the sub-parser's default; ``finalize``
# fills in whatever is still missing.
COMMON_DEFAULTS = {"bundle": None, "speed": 1.0, "timing_only": False, "slots": 4, "audit_log": None}


def add_common_options(p: argparse.ArgumentParser, *, default_pacing: str, top_level: bool = False) -> None:
    def d(name: str):
        return COMMON_DEFAULTS[name] if top_level else argparse.SUPPRESS

    g = p.add_argument_group("simulator")
    g.add_argument("--bundle", metavar="DIR", default=d("bundle"),
                   help="calbin bundle directory (default: the built-in Qwen3-30B-A3B simulator bundle)")
    g.add_argument("--pacing", choices=[m.value for m in PacingMode], default=None if top_level else argparse.SUPPRESS,
                   help=f"map simulated device time to wall time: realtime or fast (default: {default_pacing})")
    g.add_argument("--speed", type=float, default=d("speed"),
                   help="with --pacing realtime: simulated seconds per wall second (default 1.0)")
    g.add_argument("--timing-only", action="store_true", default=d("timing_only"),
                   help="skip the numerics (no logits; tokens from a seeded generator). Steps are priced the same way, "
                        "but prefill uses the expected number of experts touched instead of the router's choices")
    g.add_argument("--slots", type=int, default=d("slots"), help="concurrent request slots (default 4)")
    g.add_argument("--audit-log", metavar="PATH", default=d("audit_log"),
                   help="maintenance audit log (default: $CALCONSOLE_AUDIT_LOG or the user state dir)")
    p.set_defaults(preferred_pacing=default_pacing)


def finalize(args: argparse.Namespace) -> argparse.Namespace:
    """Fill shared options not given anywhere; pacing defaults per command (console: realtime, headless: fast)."""
    for k, v in COMMON_DEFAULTS.items():
        if not hasattr(args, k):
            setattr(args, k, v)
    if getattr(args, "pacing", None) is None:
        args.pacing = getattr(args, "preferred_pacing", "realtime")
    return args


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
