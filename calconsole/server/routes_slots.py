"""llama-server's slot actions: ``POST /slots/{id_slot}?action=save|restore|erase``.

Offered only with ``--slot-save-path DIR`` (``ServeConfig.slot_save_path``); without it every action is
llama-server's 501 ``not_supported_error`` "This server does not support slots action. Start it with
`--slot-save-path`" (erase too, as the llama-server build the suite tests against answers).

- ``save`` ``{"filename": NAME}``: the idle slot's cached prompt KV (its cells' positions, the prompt
  tokens they hold and, when the device computes them, the K/V values) to ``DIR/NAME``;
  ``{"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}``.
- ``restore`` ``{"filename": NAME}``: replaces the slot's KV with the file's (all or nothing); the next
  request sharing that prefix reuses it (``timings.cache_n``);
  ``{"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}``.
- ``erase``: frees the slot's cached KV; ``{"id_slot", "n_erased"}``.

``n_written`` / ``n_read`` are file bytes; ``*_ms`` host wall ms, as llama-server's. Errors (400
``invalid_request_error`` unless said): "Invalid slot ID" (not an integer, or no such slot: this is
stricter than llama-server, which answers 200 with nothing saved for a slot it does not have),
"Invalid action", a missing or non-string ``filename``, "Invalid filename" (llama.cpp's
``fs_validate_filename`` rules: empty, over 255 bytes, a control, path-separator or reserved character,
``..``, a leading or trailing space, a trailing dot; and here also a name that is a symbolic link, so no
file outside DIR is ever read or written), "Unable to restore slot: ..." (missing, damaged or foreign
file; not enough free KV cells); 503 ``unavailable_error`` while the slot serves a request or maintenance
stops admission (llama-server defers the action until the slot is idle; here the caller retries); 501 for
a backend without slot actions.

Keys, as the face's other mutating routes: with an admin key configured the actions need it (they change
KV that other clients' requests reuse); otherwise the API key, as llama-server. Every action, done or
refused, is written to the audit log when the face has one, with the caller's address and key label.
"""

from __future__ import annotations

import os
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sim_backend.planes import CalError, SlotActions, audit_origin

from . import wire
from .context import remote_of
from .wire import HTTPError

if TYPE_CHECKING:
    from .context import RouteSpec, ServingFace

ACTIONS = ("save", "restore", "erase")
NOT_OFFERED = "This server does not support slots action. Start it with `--slot-save-path`"
#: characters llama.cpp's fs_validate_filename refuses besides the control ranges
_RESERVED = set(':*?"<>|/\\') | {"\uff0e", "\u2215", "\u2216", "\ufffd", "\ufeff"}


def routes(face: ServingFace) -> list[RouteSpec]:
    """The slot-action route; it needs the admin key when one is configured, else the API key."""
    kind = "admin" if face.config.admin_keys is not None else "api"
    return [("/slots/{id_slot}", partial(slot_action, face), ["POST"], kind)]


def filename_problem(name: str) -> str | None:
    """Why ``name`` is not a plain file name (llama.cpp ``fs_validate_filename``, no subdirectories), or None."""
    if not name:
        return "empty"
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return "longer than 255 bytes"
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or 0xD800 <= c <= 0xDFFF or ch in _RESERVED:
            return f"holds the character {ch!r} (a path separator, a control or a reserved character)"
    if name[0] == " " or name[-1] == " " or name[-1] == ".":
        return "begins or ends with a space, or ends with a dot"
    if ".." in name:
        return "holds '..'"
    return None


def confined_path(slot_dir: str, name: Any) -> str:
    """``slot_dir/name`` for a plain file name that is not a symbolic link; 400 otherwise."""
    if not isinstance(name, str):
        raise wire.bad_request("'filename' must be a string: a file name in the server's slot save path"
                               if name is not None else "'filename' is required: a file name in the server's "
                               "slot save path")
    why = filename_problem(name)
    if why is not None:
        raise wire.bad_request(f"Invalid filename: {why}")
    path = os.path.join(slot_dir, name)
    if os.path.islink(path):
        raise wire.bad_request("Invalid filename: it is a symbolic link (slot files never leave the slot save path)")
    if os.path.dirname(os.path.realpath(path)) != slot_dir:  # belt and braces: nothing resolves outside
        raise wire.bad_request("Invalid filename: it resolves outside the slot save path")
    return path


def _slot_id(raw: str) -> int:
    s = raw[1:] if raw.startswith("-") else raw
    if not (s.isascii() and s.isdigit()) or len(s) > 9:
        raise wire.bad_request("Invalid slot ID")
    return int(raw)


async def slot_action(face: ServingFace, request: Request) -> Response:
    action = request.query_params.get("action")
    args: dict[str, Any] = {"id_slot": request.path_params.get("id_slot")}
    t0 = time.perf_counter()
    try:
        out = await _run(face, request, action, args)
    except (HTTPError, CalError) as e:
        err = e if isinstance(e, HTTPError) else wire.from_cal_error(e)
        await _audit(face, request, action, args, False, err.message, t0)
        raise err from None
    await _audit(face, request, action, args, True, out, t0)
    return JSONResponse(out)


async def _run(face: ServingFace, request: Request, action: str | None, args: dict[str, Any]) -> dict[str, Any]:
    plane = face.inference
    if face.slot_dir is None:
        raise HTTPError(501, "not_supported_error", NOT_OFFERED)
    if not isinstance(plane, SlotActions):
        raise HTTPError(501, "not_supported_error", "this backend has no slot actions")
    idx = _slot_id(str(args["id_slot"]))
    args["id_slot"] = idx
    if action not in ACTIONS:
        raise wire.bad_request("Invalid action")
    if action == "erase":
        res = await face.call(plane.erase_slot, idx)
        return {"id_slot": idx, "n_erased": int(res["n_erased"])}
    body = await face.read_json(request)
    name = body.get("filename")
    args["filename"] = name if isinstance(name, str) else None
    path = confined_path(face.slot_dir, name)
    if action == "save":
        res = await face.call(plane.save_slot, idx, path)
        return {"id_slot": idx, "filename": name, "n_saved": int(res["n_saved"]), "n_written": int(res["n_written"]),
                "timings": {"save_ms": round(float(res["save_ms"]), 3)}}
    if not os.path.isfile(path):
        raise wire.bad_request("Unable to restore slot: No available space in KV cache or invalid slot save file "
                               "(no such file in the slot save path)")
    res = await face.call(plane.restore_slot, idx, path)
    return {"id_slot": idx, "filename": name, "n_restored": int(res["n_restored"]), "n_read": int(res["n_read"]),
            "timings": {"restore_ms": round(float(res["restore_ms"]), 3)}}


async def _audit(face: ServingFace, request: Request, action: str | None, args: dict[str, Any], ok: bool,
                 result: Any, t0: float) -> None:
    """One audit record of a slot action (done or refused), off the event loop; never raises."""
    audit = face.audit
    if audit is None:
        return
    origin = {"remote": remote_of(request), "key": getattr(request.state, "key_label", "?"), "via": "http"}
    name = f"slot_{action}" if action in ACTIONS else "slot_action"

    def write() -> None:
        with audit_origin(origin):
            audit.event(name, dict(args), granted=ok, ok=ok, result=result,
                        duration_ms=(time.perf_counter() - t0) * 1e3)

    try:
        await face.call(write)
    except Exception as e:  # noqa: BLE001 - the action stands; say the record is missing
        import logging

        logging.getLogger("calconsole.serve").error("audit log write failed for %s: %s", name, e)
