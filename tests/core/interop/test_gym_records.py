"""Strict readers for Gym's staged records, receipts, manifests and lineage files."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.core.interop.gymkit import capture_json, worked_example
from tokcap_core.interop import gym


def record_doc() -> dict[str, Any]:
    return worked_example().snapshots[1].to_json()


def receipt_doc() -> dict[str, Any]:
    return worked_example().receipt.to_json()


def code_of(fn: Any, doc: Any) -> str:
    with pytest.raises(gym.GymFormatError) as info:
        fn(json.dumps(doc) if not isinstance(doc, (str, bytes)) else doc)
    return info.value.code


def test_records_and_receipts_read_back_exactly() -> None:
    capture = worked_example()
    receipt, snapshots = capture_json(capture)
    assert gym.decode_gym_receipt(json.dumps(receipt)) == capture.receipt
    assert tuple(gym.decode_gym_snapshots(json.dumps(snapshots))) == capture.snapshots
    lines = "\n".join(json.dumps(s) for s in snapshots) + "\n"
    assert tuple(gym.decode_gym_snapshots(lines)) == capture.snapshots
    assert gym.encode_gym_json(capture.receipt) == gym.encode_gym_json(
        gym.decode_gym_receipt(gym.encode_gym_json(capture.receipt))
    )


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda d: d.update(unexpected=1), "unknown_field"),
        (lambda d: d.pop("digest"), "missing_field"),
        (lambda d: d.pop("schema_version"), "missing_field"),
        (lambda d: d.update(schema_version=4), "unsupported_schema"),
        (lambda d: d.update(schema_version=1), "unsupported_schema"),
        (lambda d: d.update(digest_version=1), "unsupported_digest"),
        (lambda d: d.update(extras_digest_version=2), "unsupported_extras_digest"),
        (lambda d: d.update(prev_len="4"), "wrong_type"),
        (lambda d: d.update(prev_len=4.0), "wrong_type"),
        (lambda d: d.update(prev_len=True), "wrong_type"),
        (lambda d: d.update(prev_len=-1), "out_of_range"),
        (lambda d: d.update(token_ids_delta=[20, 21, "22"]), "wrong_type"),
        (lambda d: d.update(token_ids_delta=[20, 21, -22]), "out_of_range"),
        (lambda d: d.update(token_mask_delta=[0.0, 1.0, "1"]), "wrong_type"),
        (lambda d: d.update(mode="tokens"), "bad_value"),
        (lambda d: d.update(rollout_id=""), "empty_identifier"),
        (lambda d: d.update(digest="A" * 64), "bad_hex"),
        (lambda d: d.update(digest="0" * 64), "corrupt_digest"),
        (lambda d: d.update(extras={"routed_experts": []}), "extras_digest_mismatch"),
        (lambda d: d.update(extras=[1]), "wrong_type"),
        (lambda d: d.update(parent_call_id=None), "root_child_mismatch"),
    ],
)
def test_a_staged_record_refuses_with_a_typed_code(edit: Any, code: str) -> None:
    doc = record_doc()
    edit(doc)
    assert code_of(gym.decode_gym_staged_record, doc) == code


def test_json_itself_is_strict() -> None:
    text = json.dumps(record_doc())
    assert code_of(gym.decode_gym_staged_record, text.replace("}", ', "digest": "x"}', 1)) in {
        "duplicate_key"
    }
    assert code_of(gym.decode_gym_staged_record, text.replace("-0.3", "NaN")) == "non_finite"
    assert code_of(gym.decode_gym_staged_record, "{") == "bad_json"
    assert code_of(gym.decode_gym_staged_record, b"\xff") == "bad_json"


def test_negative_zero_survives_reading_and_is_bound_by_the_digest() -> None:
    doc = record_doc()
    fields = {k: doc[k] for k in doc if k not in ("digest", "extras")}
    fields["generation_log_probs_delta"] = [-0.0, *doc["generation_log_probs_delta"][1:]]
    fields["token_ids_delta"] = tuple(fields["token_ids_delta"])
    fields["token_mask_delta"] = tuple(fields["token_mask_delta"])
    fields["generation_log_probs_delta"] = tuple(fields["generation_log_probs_delta"])
    record = gym.GymStagedRecord(**fields, digest=gym.compute_staging_digest(**fields))
    text = gym.encode_gym_json(record)
    assert b"-0.0" in text
    back = gym.decode_gym_staged_record(text)
    assert str(back.generation_log_probs_delta[0]) == "-0.0"
    assert back.digest != record_doc()["digest"]


def test_integers_in_float_columns_read_as_gym_reads_them() -> None:
    doc = record_doc()
    doc["token_mask_delta"] = [0, 1, 1]  # Gym's strict floats accept JSON integers
    assert gym.decode_gym_staged_record(json.dumps(doc)).token_mask_delta == (0.0, 1.0, 1.0)


def test_a_base_snapshot_has_no_extras_and_keeps_the_commitment() -> None:
    doc = record_doc()
    del doc["extras"]
    record = gym.decode_gym_staged_record(json.dumps(doc))
    assert not record.extras_loaded
    assert "extras" not in record.to_json()


def test_call_records_tolerate_logical_request_id() -> None:
    doc = receipt_doc()
    doc["manifest"][0]["logical_request_id"] = "req-7"
    receipt = gym.decode_gym_receipt(json.dumps(doc))
    assert receipt.manifest[0].logical_request_id == "req-7"
    assert receipt.manifest[0].to_json()["logical_request_id"] == "req-7"
    assert "logical_request_id" not in receipt.manifest[1].to_json()
    doc["manifest"][0]["logical_request_id"] = ""
    assert code_of(gym.decode_gym_receipt, doc) == "empty_identifier"


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda d: d.update(failure_reason="unresolved_parent"), "bad_receipt_state"),
        (lambda d: d.update(terminal_selection=None), "bad_receipt_state"),
        (lambda d: d.update(terminal_model_call_id="c9"), "missing_terminal"),
        (lambda d: d.update(terminal_selection="guessed"), "bad_value"),
        (lambda d: d.update(capture_poisoned="false"), "wrong_type"),
        (lambda d: d.update(reward="1.0"), "wrong_type"),
        (lambda d: d["manifest"].append(d["manifest"][0]), "duplicate_manifest_row"),
        (lambda d: d["manifest"][0].update(response_id=None), "wrong_type"),
        (lambda d: d["manifest"][0].pop("response_id"), "missing_field"),
        (lambda d: d["manifest"][0].update(admitted_at="now"), "wrong_type"),
    ],
)
def test_a_receipt_refuses_with_a_typed_code(edit: Any, code: str) -> None:
    doc = receipt_doc()
    edit(doc)
    assert code_of(gym.decode_gym_receipt, doc) == code


def test_the_three_receipt_states() -> None:
    doc = receipt_doc()
    gym.decode_gym_receipt(json.dumps(doc))  # unpoisoned, terminal and selection named
    poisoned = {**doc, "capture_poisoned": True, "failure_reason": "worker_capture_failed"}
    assert gym.decode_gym_receipt(json.dumps(poisoned)).poisoned  # poisoned naming a terminal
    unselected = {**poisoned, "terminal_model_call_id": None, "terminal_selection": None}
    assert gym.decode_gym_receipt(json.dumps(unselected)).poisoned


def lineage_lines(capture: gym.GymCapture) -> list[dict[str, Any]]:
    rows = []
    for record in capture.receipt.manifest:
        custody = record.to_json()
        rows.append(
            {
                "model_call_id": record.model_call_id,
                "fingerprint": "f" * 64,
                "context_len": 1,
                "context_digest": "e" * 64,
                "digest": record.cumulative_hash,
                "parent_call_id": record.parent_call_id,
                "staging_key": record.staging_key,
                "weight_version": record.weight_version,
                "prev_len": record.prev_len,
                "delta_len": record.delta_len,
                "cum_len": record.cum_len,
                "staging_digest": record.digest,
                "extras_digest": record.extras_digest,
                "mode": record.mode,
                "admitted_at": custody["admitted_at"],
                "staging_chain": [],
                "chain_hash": record.chain_hash,
                "cumulative_hash": record.cumulative_hash,
                "response_id": record.response_id,
                "output_fingerprint": None,
                "continuation_fingerprint": None,
                "fingerprint_version": 0,
            }
        )
    return rows


def jsonl(rows: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n" for r in rows)


def test_a_lineage_file_yields_the_manifest_gym_would_serve() -> None:
    capture = worked_example()
    rows = lineage_lines(capture)
    rows.append({"model_call_id": "c3", "failure_reason": "worker_capture_failed"})
    manifest = gym.gym_manifest_from_lineage("g7_r0", gym.decode_gym_lineage(jsonl(rows)))
    assert manifest.records == capture.receipt.manifest
    assert [(f.model_call_id, f.reason) for f in manifest.failures] == [
        ("c3", "worker_capture_failed")
    ]
    assert gym.decode_gym_manifest(gym.encode_gym_json(manifest)) == manifest


def test_lineage_rows_missing_custody_digests_become_failures() -> None:
    rows = lineage_lines(worked_example())
    rows[0]["response_id"] = None
    del rows[1]["chain_hash"]
    manifest = gym.gym_manifest_from_lineage("g7_r0", gym.decode_gym_lineage(jsonl(rows)))
    assert manifest.records == ()
    assert [f.reason for f in manifest.failures] == [
        "ledger_row_missing_response_id",
        "ledger_row_missing_chain_hash",
    ]


@pytest.mark.parametrize(
    ("edit", "code"),
    [
        (lambda rows: rows[0].update(surprise=1), "unknown_field"),
        (lambda rows: rows[0].pop("staging_digest"), "missing_field"),
        (lambda rows: rows.append({"model_call_id": "c9"}), "unknown_row"),
        (lambda rows: rows.append({**rows[0], "weight_version": 9}), "conflicting_row"),
        (lambda rows: rows[0].update(staging_chain=[1]), "wrong_type"),
    ],
)
def test_lineage_rows_refuse_with_typed_codes(edit: Any, code: str) -> None:
    rows = lineage_lines(worked_example())
    edit(rows)
    with pytest.raises(gym.GymFormatError) as info:
        gym.decode_gym_lineage(jsonl(rows))
    assert info.value.code == code
