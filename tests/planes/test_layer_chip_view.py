"""The per-layer and per-chip figures an operator reads (snapshot, busy time) show the real
differences: chip0's embedding, the head after the last layer, a prefill router's per-layer
choices (numeric mode) or the expectation (timing-only, said so), a slow chip on that chip only,
and a link error costing the transfer it hit, not a step (simulated µs)."""

from __future__ import annotations

import numpy as np
import pytest

from sim_backend.planes import ChatRequest
from sim_backend.planes.snapshot import Snapshot

PROMPT = "Tell me about the weather in Paris today, please."


def _run(system, prompt=PROMPT, n=3):
    res = system.inference.generate(ChatRequest.from_prompt(prompt, max_tokens=n), timeout=120)
    assert res.status == "finished"
    return system.observation.snapshot()


def _check_step(step, nominal: bool = True) -> None:
    """Layers + embed + head = each chip's busy; busy + wait + submit = infer (per chip)."""
    n_chips = len(step.chip_busy_us)
    assert n_chips == 2 and [o.part for o in step.outside] == ["embed", "head"]
    for c in range(n_chips):
        rows = sum(layer.chip_us[c] for layer in step.layers) + sum(o.chip_us[c] for o in step.outside)
        assert rows == pytest.approx(step.chip_busy_us[c], rel=1e-9)
        assert step.chip_busy_us[c] + step.chip_wait_us[c] + step.submit_us == pytest.approx(step.infer_us, rel=1e-9)
    embed = step.outside[0]
    assert embed.ops[0] == "embedding" and embed.category_us["embedding"][1] == 0.0
    if nominal:  # chip0's embedding; a slow chip1's broadcast sync can outweigh it
        assert embed.chip_us[0] > embed.chip_us[1]
    assert step.outside[1].slowest_op == "lm_head"


@pytest.mark.parametrize("numerics", [True, False])
def test_snapshot_step_views_add_up_and_say_how_experts_were_priced(make_system, numerics):
    system = make_system(numerics=numerics)
    snap = _run(system)
    pre, dec = snap.last_prefill, snap.last_decode
    for step in (pre, dec):
        _check_step(step)
        assert len(step.experts_priced) == 48
    prefill_layers = np.array([layer.chip_us[0] for layer in pre.layers])
    if numerics:
        # the router's own per-layer choices reach the per-layer view
        assert pre.experts_rule == "per-layer counts" and len(set(pre.experts_touched)) > 1
        assert np.ptp(pre.experts_priced) > 0 and np.ptp(prefill_layers) > 0.02 * prefill_layers.mean()
        # the layer with the most experts priced is the costliest, the one with the fewest the cheapest
        assert prefill_layers.argmax() == int(np.argmax(pre.experts_priced))
        assert prefill_layers.argmin() == int(np.argmin(pre.experts_priced))
    else:
        # timing-only prices the expectation: the same in every layer, and it says so
        assert pre.experts_rule == "expectation" and pre.experts_touched == ()
        assert np.ptp(pre.experts_priced) == 0 and np.ptp(prefill_layers) == pytest.approx(0.0, abs=1e-9)
    assert list(dec.experts_priced) == [8.0] * 48  # one token: its top-8 in every layer
    # the wire form reads back the same
    assert Snapshot.from_dict(snap.to_dict()).last_prefill == pre


def test_chip0_is_busier_than_chip1_by_the_embedding(make_system):
    system = make_system(numerics=False)
    snap = _run(system)
    busy = [c.busy_us for c in snap.device.chiplets]
    steps = [s for s in (snap.last_prefill, snap.last_decode)]
    emb = [s.outside[0].category_us["embedding"][0] for s in steps]
    assert all(e > 0 for e in emb) and "embedding" not in {k for s in steps for k in s.outside[0].category_us
                                                        if s.outside[0].category_us[k][1] > 0}
    # 1 prefill + 2 decode steps (3 tokens: the prefill samples the first); chip1 never runs the embedding
    assert busy[0] - busy[1] == pytest.approx(emb[0] + 2 * emb[1], rel=1e-6)


def test_slow_chip1_changes_only_chip1s_figures(make_system):
    fast = make_system(numerics=False)
    ref = _run(fast).last_decode
    slow = make_system(numerics=False)
    slow.board.faults.slow_chip[1] = 4.0
    got = _run(slow).last_decode
    assert [layer.chip_us[0] for layer in got.layers] == [layer.chip_us[0] for layer in ref.layers]
    assert [o.chip_us[0] for o in got.outside] == [o.chip_us[0] for o in ref.outside]
    assert got.chip_busy_us[0] == pytest.approx(ref.chip_busy_us[0], rel=1e-12)
    for a, b in zip(got.layers, ref.layers, strict=True):
        assert a.chip_us[1] == pytest.approx(4.0 * b.chip_us[1], rel=1e-12)
    assert got.chip_wait_us[0] > ref.chip_wait_us[0] + 40_000  # chip0 waits for chip1 at the barriers
    _check_step(got, nominal=False)


def test_link_error_costs_the_failed_transfer_on_the_link_not_a_step(make_system):
    system = make_system(numerics=False)
    m = system.maintenance
    lease = m.enter_exclusive("alice")
    clock0, busy0 = system.board.clock.now_us, [c.busy_us for c in system.board.chiplets()]
    board0 = system.board.busy_us
    m.inject_fault(lease, "link_error")
    first = m.probe_request(lease, "hi", 2)
    assert first["status"] == "failed" and first["error"]["type"] == "LinkError"
    assert "embedding broadcast failed after" in first["error"]["message"]
    spent = system.board.busy_us - board0
    busy = [c.busy_us - b for c, b in zip(system.board.chiplets(), busy0, strict=True)]
    # what ran: H2D, submit, chip0's embedding and the broadcast it failed on; no layer, no D2H
    cm = system.board.cost_model
    step = cm.price_step(system.board.shape, "prefill", _probe_tokens(system), 0)
    sync = next(op.index for op in step.graph.ops if op.role == "embed_sync")
    infer, chips = step.until_op(sync)
    assert spent == pytest.approx(step.h2d_us + infer, rel=1e-9)
    np.testing.assert_allclose(busy, chips, rtol=1e-9)
    assert spent < 0.01 * step.total_us  # a fraction of the step it stopped
    assert system.board.clock.now_us >= clock0 + spent
    assert system.board.registers.read("D2D_LINK_ERR") == 1
    assert m.probe_request(lease, "hi", 2)["status"] == "finished"
    m.leave_exclusive(lease)


def _probe_tokens(system) -> int:
    """Prompt tokens of the maintenance probe "hi" (chat template included)."""
    return system.inference.count_prompt_tokens(ChatRequest.from_prompt("hi", max_tokens=2))


def test_the_link_error_has_one_name_everywhere(make_system):
    # the API armed "link_error" while the snapshot said "d2d_link_error x1" (armed) and "d2d_link_error"
    # (fired); one name now, the API's, and the old one still accepted as an alias
    system = make_system(numerics=False)
    m = system.maintenance
    lease = m.enter_exclusive("alice")
    for kind in ("link_error", "d2d_link_error"):
        rep = m.inject_fault(lease, kind)
        assert rep["armed"] == ["link_error x1"]
        assert system.observation.snapshot().device.faults_armed == ("link_error x1",)
        assert m.audit.entries()[-1]["args"]["kind"] == "link_error"  # audited as the kind it armed
        assert m.probe_request(lease, "hi", 2)["error"]["type"] == "LinkError"
        fired = system.observation.snapshot().device.faults_fired
        assert fired and {f.fault for f in fired} == {"link_error"}
    m.leave_exclusive(lease)


def test_a_request_failed_by_a_link_error_reports_the_device_time_it_used(make_system):
    """The failed job's simulated time shows in the request's device parts (it was h2d/infer 0 while
    prompt_ms held the 0.3 ms), so the parts still add up to what the clock moved."""
    system = make_system(numerics=False)
    m = system.maintenance
    lease = m.enter_exclusive("alice")
    m.inject_fault(lease, "link_error")
    m.leave_exclusive(lease)
    board0 = system.board.busy_us
    res = system.inference.generate(ChatRequest.from_prompt("hi", max_tokens=4), timeout=30)
    assert res.status == "failed" and res.error["type"] == "LinkError"
    spent_ms = (system.board.busy_us - board0) / 1e3
    dev = res.timings.device_ms
    assert dev["d2h"] == 0.0 and dev["h2d"] > 0 and dev["infer"] > 0
    assert sum(dev.values()) == pytest.approx(spent_ms, rel=1e-9)
