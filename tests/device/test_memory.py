"""Memory plan against facts.md F4 (report §7)."""

import json

import pytest

from sim_backend.bundle.shapes import ModelShape
from sim_backend.device.memory import GiB, MemoryPlan, MiB


@pytest.fixture(scope="module")
def plan():
    return MemoryPlan.for_bundle(ModelShape())


def r3(x):
    return round(x, 3)


def test_parameters(plan):
    assert r3(plan.region(0, "parameters").used_bytes / GiB) == 8.745
    assert r3(plan.region(1, "parameters").used_bytes / GiB) == 8.165
    assert r3(sum(plan.region(c, "parameters").used_bytes for c in (0, 1)) / GiB) == 16.910
    assert [r3(b / GiB) for b in plan.param_file_bytes] == [8.759, 8.179]
    assert r3(sum(plan.param_file_bytes) / GiB) == 16.938
    # chip0 - chip1 is the BF16 embedding table (derived): 0.580 GiB
    diff = plan.region(0, "parameters").used_bytes - plan.region(1, "parameters").used_bytes
    assert diff == 151936 * 2048 * 2
    # the model-derived estimate agrees with the taken figure within 0.5 %
    for c in (0, 1):
        assert plan.param_estimate_bytes[c] == pytest.approx(plan.region(c, "parameters").used_bytes, rel=5e-3)


def test_sram(plan):
    for c in (0, 1):
        assert r3(plan.region(c, "param_window").reserved_bytes / MiB) == 14.381
        assert r3(plan.reserved_bytes(c, "sram") / MiB) == 16.844
        assert plan.reserved_bytes(c, "sram") < plan.region(c, "param_window").physical_bytes == 18 * MiB
    assert r3(2 * plan.reserved_bytes(0, "sram") / MiB) == 33.688
    assert r3(2 * plan.region(0, "param_window").reserved_bytes / MiB) == 28.762


def test_kv_derived_exactly(plan):
    kv = plan.region(0, "kv_cache").reserved_bytes
    assert kv == 48 * 2 * 2 * 128 * 2 * 40960
    assert kv / GiB == 1.875
    assert plan.region(1, "kv_cache").reserved_bytes == kv
    assert r3(2 * kv / GiB) == 3.750


def test_dram_reservation_and_unions(plan):
    for c in (0, 1):
        assert r3(plan.reserved_bytes(c, "dram") / GiB) == 14.075
        assert plan.region(c, "workspace").reserved_bytes > 0
    assert r3(2 * plan.reserved_bytes(0, "dram") / GiB) == 28.150
    assert r3(plan.address_union_bytes["decode"] / GiB) == 10.634
    assert r3(plan.address_union_bytes["prefill"] / GiB) == 14.091
    # prefill union ~ DRAM + SRAM reservation (facts.md F4: "basically closes")
    closure = plan.reserved_bytes(0, "dram") + plan.reserved_bytes(0, "sram")
    assert r3(closure / GiB) == 14.091
    assert plan.logits_bytes_per_token == 303_872


def test_kv_used_follows_tokens(plan):
    assert plan.region(0, "kv_cache").used_bytes == 0
    p2 = plan.with_kv_used(1000)
    assert p2.region(1, "kv_cache").used_bytes == 1000 * 49_152
    assert plan.region(0, "kv_cache").used_bytes == 0   # immutable
    assert p2.with_kv_used(40960).region(0, "kv_cache").used_bytes == p2.region(0, "kv_cache").reserved_bytes
    with pytest.raises(ValueError):
        plan.with_kv_used(40961)


def test_to_dict_bytes(plan):
    d = json.loads(json.dumps(plan.with_kv_used(27).to_dict()))
    assert d["unit"] == "bytes" and len(d["chips"]) == 2
    kv = next(r for r in d["chips"][0]["regions"] if r["name"] == "kv_cache")
    assert kv["used_bytes"] == 27 * 49_152 and kv["kind"] == "dram"
    assert {r["kind"] for r in d["chips"][1]["regions"]} == {"dram", "sram"}
