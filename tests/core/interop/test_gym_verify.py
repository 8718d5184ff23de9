"""Gym's verifier semantics: each check, its code, terminal selection, poisoned receipts."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.core.interop.gymkit import CallSpec, build_capture, f32, worked_example
from tokcap_core.interop import gym
from tokcap_core.reasons import reason_bucket


def resign(capture: gym.GymCapture, call_id: str, **changes: Any) -> gym.GymCapture:
    """``changes`` applied to a call's snapshot *and* its manifest row, digest recomputed:
    what a forger who controls both could write."""
    snapshots = []
    records = []
    for snapshot, record in zip(capture.snapshots, capture.receipt.manifest, strict=True):
        if snapshot.model_call_id == call_id:
            fields = {
                f.name: getattr(snapshot, f.name)
                for f in dataclasses.fields(snapshot)
                if f.name not in ("digest", "extras", "extras_loaded")
            }
            fields.update(changes)
            digest = gym.compute_staging_digest(**fields)
            snapshot = gym.GymStagedRecord(**fields, digest=digest, extras=snapshot.extras)
            shared = {k: v for k, v in changes.items() if hasattr(record, k)}
            record = dataclasses.replace(record, **shared, digest=digest)
        snapshots.append(snapshot)
        records.append(record)
    receipt = dataclasses.replace(capture.receipt, manifest=tuple(records))
    return gym.GymCapture(receipt=receipt, snapshots=tuple(snapshots))


def code(capture: gym.GymCapture, snapshots: Any = None) -> str:
    with pytest.raises(gym.GymVerificationError) as info:
        gym.linearize_gym_rollout(
            capture.receipt, capture.snapshots if snapshots is None else snapshots
        )
    return info.value.code


def test_the_worked_example_linearises_as_gym_documents() -> None:
    capture = worked_example()
    row = gym.linearize_gym_rollout(capture.receipt, capture.snapshots)
    assert row.token_ids == (10, 11, 12, 13, 20, 21, 22)
    assert row.token_mask == (0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0)
    assert row.prompt_len == 2
    assert row.weight_versions == (3, 4)
    assert row.weight_version_spans == (("c1", 0, 4, 3), ("c2", 4, 7, 4))
    assert row.link_spans == (("c1", 2, 2), ("c2", 1, 2))
    result = gym.verify_gym_rollout(capture.receipt, capture.snapshots)
    assert result.ok
    assert result.gym_reason is None
    assert result.receipt.terminal_call_id == "c2"
    assert result.receipt.terminal_selection == "declared"
    assert [c.call_id for c in result.receipt.segments[0]] == ["c1", "c2"]
    assert result.receipt.ledger_head == (2, capture.receipt.manifest[1].chain_hash)
    assert result.row.input_ids.tolist() == [10, 11, 12, 13, 20, 21, 22]
    assert result.row.loss_mask.tolist() == [0, 0, 1, 1, 0, 1, 1]
    assert result.row.logprobs.tolist() == [
        0.0,
        0.0,
        f32(-0.1),
        f32(-0.2),
        0.0,
        f32(-0.3),
        f32(-0.4),
    ]
    assert (result.row.weight_version_min, result.row.weight_version_max) == (3, 4)
    assert [s.weight_version for s in result.row.call_spans] == [3, 4]
    assert result.row.routes is None
    assert not result.row.truncated


def test_snapshot_list_codes() -> None:
    capture = worked_example()
    one, two = capture.snapshots
    stranger = worked_example("other").snapshots[0]
    assert code(capture, [one]) == "row_count_mismatch"
    assert code(capture, [two, one]) == "snapshot_order_mismatch"
    assert code(capture, [one, one]) == "duplicate_snapshot"
    unknown = build_capture("g7_r0", [CallSpec("c9", None, (1,), (2,), (-0.5,))], terminal="c9")
    assert code(capture, [one, unknown.snapshots[0]]) == "snapshot_identity_mismatch"
    assert code(capture, [stranger, two]) == "wrong_rollout"


@pytest.mark.parametrize(
    "field", ["weight_version", "digest", "extras_digest", "chain_hash", "cumulative_hash"]
)
def test_each_manifest_field_is_compared_with_its_snapshot(field: str) -> None:
    capture = worked_example()
    record = capture.receipt.manifest[1]
    value: Any = getattr(record, field)
    changed: Any = (
        value + 1 if isinstance(value, int) else ("0" if value[0] != "0" else "1") + value[1:]
    )
    manifest = (capture.receipt.manifest[0], dataclasses.replace(record, **{field: changed}))
    tampered = dataclasses.replace(
        capture, receipt=dataclasses.replace(capture.receipt, manifest=manifest)
    )
    assert code(tampered) == f"wrong_{field}"


def test_forged_consistent_rows_are_caught_by_the_chain_and_cumulative_hashes() -> None:
    capture = worked_example()
    assert code(resign(capture, "c2", chain_hash="5" * 64)) == "chain_hash_mismatch"
    assert code(resign(capture, "c2", cumulative_hash="5" * 64)) == "cumulative_hash_mismatch"
    swapped = resign(capture, "c2", token_ids_delta=(20, 21, 23))
    assert code(swapped) == "chain_hash_mismatch"
    assert (
        code(
            resign(
                capture,
                "c2",
                token_mask_delta=(1.0, 0.0, 1.0),
                generation_log_probs_delta=(-0.3, 0.0, -0.4),
            )
        )
        == "invalid_mask_order"
    )
    assert (
        code(
            resign(
                capture,
                "c2",
                token_mask_delta=(0.0, 0.0, 0.0),
                generation_log_probs_delta=(0.0, 0.0, 0.0),
            )
        )
        == "empty_generation"
    )


def test_graph_codes() -> None:
    capture = worked_example()
    assert code(resign(capture, "c2", prev_len=3, cum_len=6)) == "parent_length_mismatch"
    assert code(resign(capture, "c2", parent_call_id="c9")) == "missing_parent"
    cyclic = resign(
        resign(capture, "c1", parent_call_id="c2", mode="token_in", prev_len=7, cum_len=11),
        "c2",
        prev_len=11,
        cum_len=14,
    )
    assert code(cyclic) in {"lineage_cycle", "parent_length_mismatch"}
    keys = capture.receipt.manifest
    dup = (keys[0], dataclasses.replace(keys[1], staging_key=keys[0].staging_key))
    assert code(
        dataclasses.replace(capture, receipt=dataclasses.replace(capture.receipt, manifest=dup))
    ) == ("duplicate_staging_key")


def test_off_chain_rows_are_tolerated() -> None:
    calls = [
        CallSpec("c1", None, (1,), (2,), (-0.5,)),
        CallSpec("c2", "c1", (3,), (4,), (-0.5,)),
        CallSpec("c3", "c1", (5,), (6, 7), (-0.5, -0.25)),
    ]
    result = gym.verify_gym_rollout(*_parts(build_capture("fork", calls, terminal="c3")))
    assert result.row.input_ids.tolist() == [1, 2, 5, 6, 7]
    assert result.receipt.sink_keys == ("fork/c1", "fork/c2", "fork/c3")


def _parts(capture: gym.GymCapture) -> tuple[gym.GymReceipt, tuple[gym.GymStagedRecord, ...]]:
    return capture.receipt, capture.snapshots


def spec(call_id: str, parent: str | None, at: float | None = None) -> CallSpec:
    return CallSpec(call_id, parent, (1,) if parent is None else (), (2,), (-1.0,), admitted_at=at)


def records(*specs: CallSpec) -> tuple[gym.GymCallRecord, ...]:
    return build_capture("sel", specs, terminal=specs[0].call_id).receipt.manifest


def test_gym_terminal_selection_rules() -> None:
    assert gym.select_gym_terminal(()) == (None, "no_records")
    assert gym.select_gym_terminal(records(spec("a", None), spec("b", "a"))) == ("b", "selected")
    # a root with children beats a childless one, whatever their admission order
    assert (
        gym.select_gym_terminal(records(spec("a", None), spec("b", None), spec("c", "b")))[0] == "c"
    )
    # among roots with children, the earliest admitted wins; unstamped ones sort last
    chosen = records(spec("a", None, 5.0), spec("b", "a"), spec("c", None, 1.0), spec("d", "c"))
    assert gym.select_gym_terminal(chosen)[0] == "d"
    unstamped = records(spec("a", None), spec("b", "a"), spec("c", None, 9.0), spec("d", "c"))
    assert gym.select_gym_terminal(unstamped)[0] == "d"
    # a child with descendants beats a childless sibling; two such children are ambiguous
    fork = records(spec("a", None), spec("b", "a"), spec("c", "a"), spec("d", "c"))
    assert gym.select_gym_terminal(fork)[0] == "d"
    twin = records(spec("a", None), spec("b", "a"), spec("c", "a"))
    assert gym.select_gym_terminal(twin) == (None, "ambiguous_terminal")
    orphan = (records(spec("a", None), spec("b", "a"))[1],)
    assert gym.select_gym_terminal(orphan) == (None, "orphaned_row")


def test_a_heuristic_terminal_must_be_the_one_gyms_rule_picks() -> None:
    calls = [spec("a", None), spec("b", "a"), spec("c", "b")]
    good = build_capture("heur", calls, terminal="c", selection="heuristic")
    assert gym.verify_gym_rollout(*_parts(good)).ok
    moved = build_capture("heur", calls, terminal="b", selection="heuristic")
    assert code(moved) == "terminal_selection_mismatch"
    declared = build_capture("heur", calls, terminal="b", selection="declared")
    assert gym.verify_gym_rollout(*_parts(declared)).row.terminal_call_id == "b"


@pytest.mark.parametrize(
    ("gym_reason", "bucket"),
    [
        ("unresolved_parent", "parent_unresolved"),
        ("request_finished_without_staged_coordinates", "uncommitted_call"),
        ("worker_capture_failed", "stage_failed"),
        ("ledger_row_missing_chain_hash", "manifest_invalid"),
        ("ambiguous_terminal", "ambiguous_terminal"),
        ("declared_terminal_not_captured", "declared_terminal_missing"),
        ("witness_disagreement[declared=c1;response_id=c2]", "witness_disagreement"),
        ("response_id_no_match,no_content_match", "witness_unmatched"),
        ("something_new", "peer_poisoned"),
    ],
)
def test_a_poisoned_receipt_maps_gyms_reason_onto_a_tokcap_bucket(
    gym_reason: str, bucket: str
) -> None:
    capture = worked_example(poisoned=True, failure_reason=gym_reason)
    result = gym.verify_gym_rollout(capture.receipt, ())
    assert not result.ok
    assert result.gym_reason == gym_reason
    assert result.receipt.status == "poisoned"
    assert result.receipt.failure_reason == f"{bucket}:{gym_reason}"
    assert reason_bucket(result.receipt.failure_reason) == bucket
    assert result.row.sample_mask == 0
    assert result.row.reason == result.receipt.failure_reason
    with pytest.raises(gym.GymVerificationError, match="rollout_failed"):
        gym.linearize_gym_rollout(capture.receipt, capture.snapshots)


def test_capture_poisoned_without_a_reason() -> None:
    capture = worked_example(poisoned=True)
    result = gym.verify_gym_rollout(capture.receipt, capture.snapshots)
    assert result.gym_reason == "capture_poisoned"
    assert result.receipt.failure_reason == "peer_poisoned:capture_poisoned"
    with pytest.raises(gym.GymVerificationError, match="capture_poisoned"):
        gym.linearize_gym_rollout(capture.receipt, capture.snapshots)


def test_verifier_codes_map_onto_buckets() -> None:
    assert gym.gym_failure_reason("wrong_digest", verifier=True) == "reassembly_failed:wrong_digest"
    assert (
        gym.gym_failure_reason("lineage_cycle", verifier=True) == "manifest_invalid:lineage_cycle"
    )


def test_gym_errors_pickle_with_their_code() -> None:
    import pickle

    for cls in (gym.GymFormatError, gym.GymVerificationError, gym.GymConversionError):
        error = pickle.loads(pickle.dumps(cls("some_code", "detail")))
        assert type(error) is cls
        assert error.code == "some_code"
        assert error.args == ("some_code", "detail")
