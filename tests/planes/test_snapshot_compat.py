"""A console reads the snapshot of a newer server: fields it does not know are left out (and named), the
fields it knows are checked as strictly as ever."""

from __future__ import annotations

import msgspec
import pytest

from sim_backend.compose import build_system
from sim_backend.planes import ChatRequest, SamplingParams, Snapshot
from sim_backend.planes.snapshot import decode_snapshot_json


@pytest.fixture(scope="module")
def wire(tmp_path_factory: pytest.TempPathFactory) -> dict:
    with build_system(numerics=False, n_slots=2, audit_path=tmp_path_factory.mktemp("compat") / "a.jsonl") as s:
        s.inference.generate(ChatRequest.from_prompt("hi", max_tokens=3, sampling=SamplingParams(seed=1)), 60)
        return s.observation.snapshot().to_dict()


def test_a_snapshot_of_this_version_decodes_as_it_is(wire: dict) -> None:
    ignored: set[str] = set()
    snap = decode_snapshot_json(msgspec.json.encode(wire), ignored)
    assert snap == Snapshot.from_dict(wire) and ignored == set()


def test_fields_a_newer_server_adds_are_left_out_at_every_depth_and_named(wire: dict) -> None:
    newer = msgspec.json.decode(msgspec.json.encode(wire))
    newer["fleet_id"] = "rack-3"
    newer["device"]["numerics_warmup"] = {"stage": 2}
    newer["device"]["chiplets"][1]["temperature_c"] = 61.5
    newer["slots"][0]["speculative"] = True
    newer["kv"]["evictions"] = 0
    with pytest.raises(msgspec.ValidationError, match="unknown field"):  # the strict form refuses it
        Snapshot.from_dict(newer)
    ignored: set[str] = set()
    snap = decode_snapshot_json(msgspec.json.encode(newer), ignored)
    assert snap == Snapshot.from_dict(wire)
    assert ignored == {"fleet_id", "device.numerics_warmup", "device.chiplets[].temperature_c",
                       "slots[].speculative", "kv.evictions"}


def test_a_known_field_of_the_wrong_type_or_missing_is_still_refused(wire: dict) -> None:
    bad = msgspec.json.decode(msgspec.json.encode(wire))
    bad["newer"] = 1  # takes the tolerant path, which still checks the known fields
    bad["kv"]["used_tokens"] = "many"
    with pytest.raises(msgspec.ValidationError, match="used_tokens"):
        decode_snapshot_json(msgspec.json.encode(bad))
    gone = msgspec.json.decode(msgspec.json.encode(wire))
    gone["newer"] = 1
    del gone["device"]["name"]
    with pytest.raises(msgspec.ValidationError, match="name"):
        decode_snapshot_json(msgspec.json.encode(gone))
    with pytest.raises(msgspec.DecodeError):
        decode_snapshot_json(b"{not json")
