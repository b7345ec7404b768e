"""What the maintenance pane writes and checks as text: the slot file names it accepts (llama-server's own
rule), its audit line, and one log line per action result (simulated device time said "sim", host time
"wall")."""

from __future__ import annotations

import json
import os

#: characters llama.cpp's ``fs_validate_filename`` (common/common.cpp) refuses in a slot file name, besides
#: control characters: the path separators and the characters Windows reserves
SLOT_FILENAME_FORBIDDEN = set('/\\:*?"<>|')
#: its length bound, in UTF-8 bytes
SLOT_FILENAME_MAX_BYTES = 255


def slot_filename_problem(name: str) -> str | None:
    """Why llama-server would refuse ``name`` as a slot file name (its ``fs_validate_filename``, checked by
    ``/slots/{id}?action=save|restore`` before any file is touched), or None when it is acceptable: empty;
    longer than 255 UTF-8 bytes; a control character (U+0000-U+001F, U+007F-U+009F); a path separator or
    Windows-reserved character (``/ \\ : * ? " < > |``); a leading or trailing space; a trailing dot; "." or
    ".." (its Unicode look-alike separators are refused here too: U+2215, U+2216, U+2044, U+FF0E)."""
    if not name:
        return "empty"
    if len(name.encode("utf-8", "surrogatepass")) > SLOT_FILENAME_MAX_BYTES:
        return f"longer than {SLOT_FILENAME_MAX_BYTES} bytes"
    for c in name:
        if ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F:
            return f"a control character (U+{ord(c):04X})"
        if c in SLOT_FILENAME_FORBIDDEN or c in "\u2215\u2216\u2044\uff0e":
            return f"the character {c!r} (no paths: a plain file name in --slot-save-path)"
    if name in (".", ".."):
        return "'.' and '..' are not file names"
    if name[0] == " " or name[-1] == " ":
        return "a leading or trailing space"
    if name[-1] == ".":
        return "a trailing dot"
    return None


def audit_line(path: str | os.PathLike[str]) -> str:
    """The pane's first log line: the audit file's name, then its directory (``~`` for the home directory), so
    a narrow pane wraps between them, not inside a word (at 80x24 it read ``…/aud`` / ``it.jsonl``)."""
    from pathlib import Path

    p = Path(str(path))
    directory = str(p.parent)
    try:
        rel = p.parent.relative_to(Path.home())
        directory = "~" if rel == Path(".") else f"~/{rel}"  # the home directory itself reads "~", not "~/."
    except (ValueError, RuntimeError):  # not under home, or no home
        pass
    return f"audit log: {p.name}" if directory == "." else f"audit log: {p.name} in {directory}"


def summarize_result(action: str, r: object) -> str:
    """One log line for an action's result dict (units: sim = simulated device, wall = host)."""
    if not isinstance(r, dict):
        return str(r)
    if action in ("reset", "reload_model", "health_check"):
        h = r.get("health", r)
        extra = f"failed jobs {r['failed_jobs']}, calbin {r['calbin']}, resets {r['resets']}; " if "calbin" in r else ""
        if "sim_us" not in h:  # a server without a simulated clock (llama-server /health): wall only
            return f"health {'ok' if h.get('ok') else 'FAILED'}: {h.get('detail')} ({h.get('wall_ms', 0):.0f} wall ms)"
        return (f"{extra}health {'ok' if h.get('ok') else 'FAILED'}: {h.get('detail')} "
                f"({h.get('sim_us', 0) / 1e3:.1f} sim ms, {h.get('wall_ms', 0):.0f} wall ms)")
    if action == "self_test":
        if r.get("top1_match") is None:  # nothing was compared (no inference ran, or no logits)
            return str(r.get("detail"))
        return (f"{r.get('detail')} · top-1 {'match' if r.get('top1_match') else 'differs'} · "
                f"{r.get('sim_ms', 0):.1f} sim ms")
    if action == "acknowledge_faults":
        acked = r.get("acknowledged", [])
        return ("acknowledged: " + "; ".join(f"{a['fault']} ({a['detail']})" for a in acked)) if acked \
            else "nothing to acknowledge"
    if action == "probe_request":
        if r.get("status") == "finished":
            return f"request finished: {r['n_tokens']} tokens in {r['sim_ms']:.1f} sim ms"
        e = r.get("error") or {}
        return f"request failed: {e.get('type')}: {e.get('message')}"
    if action in ("inject_fault", "clear_faults"):
        return f"armed: {', '.join(r.get('armed', [])) or 'none'}" if "armed" in r else \
            f"disarmed: {', '.join(r.get('disarmed', [])) or 'none'}"
    if action == "read_register":
        return f"{r['name']} ({r['address']}) = {r['value']} ({r['hex']}){' writable' if r['writable'] else ''}"
    if action == "write_register":
        return f"{r['name']}: {r['old']} -> {r['new']}"
    if action == "dump_registers":
        return " ".join(f"{k}={v:#x}" for k, v in r["registers"].items())
    if action == "dump":
        return f"wrote {r['path']} ({r['bytes']} bytes, {r['steps']} steps)"
    if action == "clear_kv":
        return f"freed {r['freed_tokens']} KV tokens"
    if action == "clear_device_memory":
        return "DRAM and SRAM zeroed; inference refused until the model is reloaded (Reload, key o)"
    return json.dumps(r, default=str)
