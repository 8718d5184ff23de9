"""tokcap capture → Gym records and receipt → Gym's rules → back to tokcap: the same rows."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.interop.gymkit import CallSpec, build_capture, worked_example
from tokcap_core import TokcapError, assemble_receipt, reassemble
from tokcap_core.interop import gym
from tokcap_core.routes import decode_routes, encode_routes, routes_from_rows
from tokcap_core.simulate import simulate_rollout
from tokcap_core.testing import simulated_rollouts


def _without_spans(row: Any) -> Any:
    """Gym's format keeps a call's first and last weight version only, not tokcap's spans."""
    spans = tuple(
        dataclasses.replace(s, weight_versions=None, kv_versions=None) for s in row.call_spans
    )
    return dataclasses.replace(row, call_spans=spans)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(simulated_rollouts(max_turns=5, max_roots=3), st.sampled_from([2, 3]))
def test_export_is_accepted_by_gyms_rules_and_imports_back_to_the_same_row(
    rollout: Any, schema: int
) -> None:
    receipt = assemble_receipt(rollout.ledger.state)
    if not receipt.ok:
        with pytest.raises(gym.GymConversionError, match="receipt_poisoned"):
            gym.export_gym_capture(receipt, rollout.calls)
        return
    capture = gym.export_gym_capture(
        receipt, rollout.calls, state=rollout.ledger.state, schema_version=schema
    )
    # what a NeMo-RL trainer would receive: JSON, read strictly, checked with Gym's rules
    wire_receipt = gym.decode_gym_receipt(gym.encode_gym_json(capture.receipt))
    wire_snapshots = gym.decode_gym_snapshots(gym.encode_gym_json(list(capture.snapshots)))
    linear = gym.linearize_gym_rollout(wire_receipt, wire_snapshots)
    assert linear.model_call_ids[-1] == receipt.terminal_call_id
    result = gym.verify_gym_rollout(wire_receipt, wire_snapshots)
    (original,) = reassemble(receipt, rollout.calls, max_seq_len=1 << 30)
    assert result.row == _without_spans(original)
    assert result.receipt.terminal_call_id == receipt.terminal_call_id
    assert [c.call_digest for c in result.receipt.segments[0]] == [
        r.digest for r in capture.receipt.manifest if r.model_call_id in linear.model_call_ids
    ]


def test_routes_and_truncation_survive_the_round_trip() -> None:
    for seed in range(40):
        rollout = simulate_rollout(f"rt{seed}", seed=seed, turns=4, routes=True)
        receipt = assemble_receipt(rollout.ledger.state)
        capture = gym.export_gym_capture(receipt, rollout.calls)
        row = gym.verify_gym_rollout(capture.receipt, capture.snapshots).row
        (original,) = reassemble(receipt, rollout.calls, max_seq_len=1 << 30)
        assert row == _without_spans(original)
        assert row.routes is not None
        assert row.backfilled_route_rows == original.backfilled_route_rows
        assert row.truncated == (
            rollout.staged[receipt.segments[0][-1].staging_key].finish_reason == "length"
        )


def test_splices_and_weight_version_spans_survive_the_round_trip() -> None:
    spliced = spanning = 0
    for seed in range(40):
        rollout = simulate_rollout(f"sv{seed}", seed=seed, turns=4)
        receipt = assemble_receipt(rollout.ledger.state)
        capture = gym.export_gym_capture(receipt, rollout.calls)
        result = gym.verify_gym_rollout(capture.receipt, capture.snapshots)
        links = receipt.segments[0]
        by_id = {s.model_call_id: s for s in capture.snapshots}
        for link in links:
            # Gym's one version per call is the one the call's sampling started under
            assert by_id[link.call_id].weight_version == link.weight_version
        assert [
            (c.formation, c.splice_cause, c.weight_version, c.weight_version_last)
            for c in result.receipt.segments[0]
        ] == [(c.formation, c.splice_cause, c.weight_version, c.weight_version_last) for c in links]
        assert result.row.weight_version_max == max(c.weight_version_last for c in links)
        spliced += sum(c.formation == "splice" for c in links)
        spanning += sum(c.weight_version_last != c.weight_version for c in links)
    assert spliced, "the simulated rollouts splice"
    assert spanning, "the simulated rollouts span weight pushes"


def test_export_labels_a_heuristic_terminal_gyms_rule_would_not_pick_as_declared() -> None:
    # tokcap's heuristic takes the deepest chain of the latest root; Gym's the earliest root
    rollout = simulate_rollout("forest", seed=5, turns=2, roots=2, terminal="heuristic")
    receipt = assemble_receipt(rollout.ledger.state, segments="all")  # both roots exported
    capture = gym.export_gym_capture(receipt, rollout.calls, state=rollout.ledger.state)
    picked, _ = gym.select_gym_terminal(capture.receipt.manifest)
    assert picked != receipt.terminal_call_id
    assert capture.receipt.terminal_selection == "declared"
    assert gym.verify_gym_rollout(capture.receipt, capture.snapshots).ok
    single = simulate_rollout("chain", seed=5, turns=3, terminal="heuristic")
    chain_receipt = assemble_receipt(single.ledger.state)
    assert gym.export_gym_capture(chain_receipt, single.calls).receipt.terminal_selection == (
        "heuristic"
    )


def routes_call(call_id: str, parent: str | None, routes: Any, carry: int = 1) -> CallSpec:
    return CallSpec(
        call_id,
        parent,
        tuple(range(carry)),
        (7, 8),
        (-0.5, -0.25),
        extras=None if routes is None else {"routed_experts": routes},
    )


def test_gym_route_spans_full_tail_and_sentinel() -> None:
    full = routes_from_rows([[[1, 2]], [[3, 4]], [[5, 6]]], dtype="int8")  # carry 1 + gen 2
    tail = routes_from_rows([[[9, 9]], [[8, 8]]], dtype="int16")  # only the generated rows
    calls = [
        routes_call("c1", None, encode_routes(full)),
        routes_call("c2", "c1", encode_routes(tail)),
        routes_call("c3", "c2", None),
        routes_call("c4", "c3", [[[5, 5]], [[6, 6]], [[7, 7]]]),  # legacy nested lists
    ]
    capture = build_capture("spans", calls, terminal="c4")
    row = gym.verify_gym_rollout(capture.receipt, capture.snapshots).row
    assert row.routes is not None
    assert row.routes.dtype == "int16"
    rows = [row.routes.data[2 * t : 2 * t + 2].tolist() for t in range(row.routes.shape[0])]
    assert rows == [
        [1, 2], [3, 4], [5, 6],  # full
        [-1, -1], [9, 9], [8, 8],  # tail: carried row unknown
        [-1, -1], [-1, -1], [-1, -1],  # sentinel: no fragment
        [5, 5], [6, 6], [7, 7],
    ]  # fmt: skip


def test_committed_extras_must_be_sent_to_build_a_row() -> None:
    routes = encode_routes(routes_from_rows([[[1]], [[2]], [[3]]], dtype="int8"))
    capture = build_capture("base", [routes_call("c1", None, routes)], terminal="c1")
    doc = capture.snapshots[0].to_json()
    del doc["extras"]
    base = gym.decode_gym_staged_record(json.dumps(doc))
    assert gym.linearize_gym_rollout(capture.receipt, [base]).token_ids == (0, 7, 8)
    with pytest.raises(gym.GymConversionError, match="extras_not_loaded"):
        gym.verify_gym_rollout(capture.receipt, [base])


def test_conversion_refusals() -> None:
    big = build_capture("big", [CallSpec("c1", None, (2**32,), (1,), (-1.0,))], terminal="c1")
    with pytest.raises(gym.GymConversionError, match="token_id_out_of_range"):
        gym.verify_gym_rollout(big.receipt, big.snapshots)
    assert gym.linearize_gym_rollout(big.receipt, big.snapshots).token_ids == (2**32, 1)
    bad = build_capture("bad", [routes_call("c1", None, "nrlre1:int8:1x1x1:AA")], terminal="c1")
    with pytest.raises(gym.GymConversionError, match="bad_routes"):
        gym.verify_gym_rollout(bad.receipt, bad.snapshots)


def test_conversion_errors_are_tokcap_errors_and_the_envelope_is_tokcaps() -> None:
    assert issubclass(gym.GymConversionError, TokcapError)
    assert decode_routes("nrlre1:int8:1x1x2:AQI=").data.tolist() == [1, 2]
    assert worked_example().receipt.rollout_id == "g7_r0"
