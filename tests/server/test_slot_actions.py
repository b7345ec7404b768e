"""``POST /slots/{id}?action=save|restore|erase`` (llama-server's slot actions, ``--slot-save-path``) over HTTP.

One timing-only server per module with a slot save path (2 slots); the numerics test, the key rules and the
busy slot build their own. Shapes are checked against the real llama-server in
``test_parity_llama_server.py`` (also the 501 of a server without a slot save path); here: what each action
does to the slot's KV, and every refusal.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from calconsole.server.routes_slots import filename_problem
from sim_backend.compose import Pacing, PacingMode
from sim_backend.planes import ChatRequest
from tests.server.conftest import ADMIN_KEY, API_KEY, wait_until

PROMPT = "The quick brown fox jumps over the lazy dog and keeps on running"


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def srv(make_module_server, slot_dir: Path):
    return make_module_server(system_kw={"n_slots": 2}, slot_save_path=str(slot_dir))


def act(srv, slot, action, body=None, headers=None) -> httpx.Response:
    return httpx.post(f"{srv.url}/slots/{slot}", params={"action": action} if action else None, json=body,
                      headers=headers, timeout=60)


def complete(srv, prompt: str, **kw) -> dict:
    r = httpx.post(srv.url + "/completion", json={"prompt": prompt, "n_predict": 4, "seed": 3, **kw}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def error_of(r: httpx.Response, status: int, type_: str = "invalid_request_error") -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == type_ and err["code"] == status, err
    return str(err["message"])


def cached(srv, slot: int) -> int:
    return next(s for s in srv.system.observation.snapshot().slots if s.index == slot).cached_tokens


def test_save_erase_restore_and_the_next_request_reuses_the_restored_prefix(srv, slot_dir: Path):
    first = complete(srv, PROMPT, id_slot=0)
    assert first["id_slot"] == 0
    n = cached(srv, 0)
    assert n == first["timings"]["prompt_n"] + first["tokens_predicted"] - 1  # the last token is not fed
    saved = act(srv, 0, "save", {"filename": "s0.bin"}).json()
    assert saved["id_slot"] == 0 and saved["filename"] == "s0.bin" and saved["n_saved"] == n
    assert saved["n_written"] == (slot_dir / "s0.bin").stat().st_size and saved["timings"]["save_ms"] >= 0
    assert act(srv, 0, "erase").json() == {"id_slot": 0, "n_erased": n}
    assert cached(srv, 0) == 0
    # the prefix is gone: the same prompt prefills in full
    assert complete(srv, PROMPT + " away", id_slot=0)["timings"]["cache_n"] == 0
    assert act(srv, 0, "erase").status_code == 200
    restored = act(srv, 0, "restore", {"filename": "s0.bin"}).json()
    assert restored["id_slot"] == 0 and restored["n_restored"] == n and restored["n_read"] == saved["n_written"]
    assert set(restored["timings"]) == {"restore_ms"} and cached(srv, 0) == n
    # the restored cells serve the shared prefix (the prompt; the reply's tokens differ from the new prompt's)
    again = complete(srv, PROMPT + " away")
    assert again["id_slot"] == 0  # the slot the prefix chose, reported as llama-server reports it (not -1)
    assert again["timings"]["cache_n"] == first["timings"]["prompt_n"]
    # llama-server's tokens_cached: what the slot holds after the request (prompt and reply but its last token)
    assert again["tokens_cached"] == again["tokens_evaluated"] + again["tokens_predicted"] - 1
    # a state restores into another slot too (llama.cpp's seq_id of the file is not kept)
    assert act(srv, 1, "restore", {"filename": "s0.bin"}).json()["n_restored"] == n and cached(srv, 1) == n


def test_an_empty_slot_saves_and_restores_nothing(srv):
    assert act(srv, 1, "erase").status_code == 200
    assert act(srv, 1, "save", {"filename": "empty.bin"}).json()["n_saved"] == 0
    assert act(srv, 1, "restore", {"filename": "empty.bin"}).json()["n_restored"] == 0


@pytest.mark.parametrize("name", ["../escape.bin", "/tmp/abs.bin", "sub/x.bin", "a\\b", "", ".", "..", "x..y",
                                  " lead", "trail ", "dot.", "c:x", "nul\x00", "bell\x07", "a" * 256])
def test_a_name_that_is_not_a_plain_file_name_is_refused(srv, slot_dir: Path, name: str):
    before = sorted(os.listdir(slot_dir))
    for action in ("save", "restore"):
        assert error_of(act(srv, 0, action, {"filename": name}), 400).startswith("Invalid filename")
    assert sorted(os.listdir(slot_dir)) == before
    assert filename_problem(name) is not None and filename_problem("slot_0.bin") is None


def test_symlinks_in_the_slot_dir_are_never_followed(srv, slot_dir: Path, tmp_path: Path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not a slot file")
    (slot_dir / "link.bin").symlink_to(outside)
    complete(srv, PROMPT, id_slot=0)
    for action in ("save", "restore"):
        assert "symbolic link" in error_of(act(srv, 0, action, {"filename": "link.bin"}), 400)
    assert outside.read_bytes() == b"not a slot file" and (slot_dir / "link.bin").is_symlink()
    # a symlink planted at the temporary name a save writes first is not written through either
    (slot_dir / "t.bin.tmp").symlink_to(outside)
    assert "Unable to save" in error_of(act(srv, 0, "save", {"filename": "t.bin"}), 400)
    assert outside.read_bytes() == b"not a slot file" and not (slot_dir / "t.bin").exists()


def test_bad_slot_action_and_body_are_refused(srv):
    for slot in ("x", "2", "-1", "99999999999"):
        assert error_of(act(srv, slot, "erase"), 400).startswith("Invalid slot ID")
    assert error_of(act(srv, 0, "bogus"), 400) == "Invalid action"
    assert error_of(act(srv, 0, None), 400) == "Invalid action"
    assert "'filename' is required" in error_of(act(srv, 0, "save", {}), 400)
    assert "must be a string" in error_of(act(srv, 0, "save", {"filename": 5}), 400)
    assert "empty" in error_of(act(srv, 0, "save"), 400)
    assert error_of(act(srv, 0, "restore", {"filename": "missing.bin"}), 400).startswith("Unable to restore slot")
    # GET is not a slot action (llama-server: 404 for a known path with another method)
    assert httpx.get(srv.url + "/slots/0", params={"action": "erase"}).status_code == 404


def test_a_damaged_or_foreign_file_restores_nothing(srv, slot_dir: Path):
    complete(srv, PROMPT, id_slot=0)
    n = cached(srv, 0)
    (slot_dir / "junk.bin").write_bytes(b"PK\x03\x04 truncated")
    assert error_of(act(srv, 0, "restore", {"filename": "junk.bin"}), 400).startswith("Unable to restore slot")
    assert cached(srv, 0) == n  # all or nothing: the slot keeps its cells


def test_a_busy_slot_is_refused_and_keeps_its_request(make_server, tmp_path: Path):
    s = make_server(system_kw={"n_slots": 1, "pacing": Pacing(PacingMode.REALTIME, 0.5)}, slot_save_path=str(tmp_path))
    h = s.system.inference.submit(ChatRequest.from_prompt(PROMPT, max_tokens=400))
    try:
        assert wait_until(lambda: s.system.observation.snapshot().slots[0].state != "idle")
        for action, body in (("erase", None), ("save", {"filename": "b.bin"}), ("restore", {"filename": "b.bin"})):
            if action == "restore":
                (tmp_path / "b.bin").write_bytes(b"x")
            assert "busy" in error_of(act(s, 0, action, body), 503, "unavailable_error")
        assert not h.done
    finally:
        h.cancel("test over")


def test_no_slot_action_while_admission_is_stopped(srv):
    """Maintenance stops admission (drain, exclusive mode): a slot action then is refused like a request."""
    srv.system.engine.gate.pause("device in maintenance (test)")
    try:
        assert "maintenance" in error_of(act(srv, 0, "erase"), 503, "unavailable_error")
    finally:
        srv.system.engine.gate.resume()
    assert act(srv, 0, "erase").status_code == 200


def test_keys_follow_the_mutating_routes_admin_key_else_api_key(make_server, tmp_path: Path):
    api = {"Authorization": f"Bearer {API_KEY}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    only_api = make_server(api_key=API_KEY, slot_save_path=str(tmp_path / "a"))
    assert act(only_api, 0, "erase").status_code == 401
    assert act(only_api, 0, "erase", headers=api).json() == {"id_slot": 0, "n_erased": 0}
    both = make_server(api_key=API_KEY, admin_key=ADMIN_KEY, slot_save_path=str(tmp_path / "b"))
    assert act(both, 0, "erase", headers=api).status_code == 401
    assert act(both, 0, "save", {"filename": "k.bin"}, headers=admin).status_code == 200
    assert act(both, 0, "save", {"filename": "../k.bin"}, headers=admin).status_code == 400
    entries = both.system.maintenance.audit.entries()
    done = [(e["action"], e["status"]) for e in entries if e["action"].startswith("slot")]
    assert done == [("slot_save", "ok"), ("slot_save", "refused")]


def test_restored_values_give_the_same_reply_with_numerics(make_server, tmp_path: Path):
    """With numerics the file carries the K/V values: a restored prefix continues exactly as the original cells did."""
    s = make_server(system_kw={"numerics": True, "n_slots": 1}, slot_save_path=str(tmp_path))
    complete(s, PROMPT, id_slot=0)
    act(s, 0, "save", {"filename": "v.bin"})
    reference = complete(s, PROMPT + " far", n_predict=6, temperature=0)
    assert reference["timings"]["cache_n"] > 0
    assert act(s, 0, "erase").status_code == 200
    # another prompt's K/V now fills the freed cells: only the file's values can bring the prefix back
    complete(s, "Colourless green ideas sleep furiously while seven wild swans sing in the night", n_predict=8)
    assert act(s, 0, "erase").status_code == 200
    assert act(s, 0, "restore", {"filename": "v.bin"}).status_code == 200
    replay = complete(s, PROMPT + " far", n_predict=6, temperature=0)
    assert replay["timings"]["cache_n"] == reference["timings"]["cache_n"]
    assert replay["calconsole"]["tokens"] == reference["calconsole"]["tokens"]
