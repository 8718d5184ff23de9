"""Strict JSON readers for Gym's wire records (and the compact writer).

Readers require the version triple (a reader of schema 2 and 3 cannot default it);
every other field Gym defaults may be omitted. A staged record read without an
``extras`` key is a base snapshot (see `GymStagedRecord`).
"""

from __future__ import annotations

import json
from typing import Any

from ._gym_digest import EMPTY_EXTRAS_DIGEST, check_versions
from ._gym_errors import GymFormatError
from ._gym_json import FieldReader, load_json, load_json_lines, read_fields
from ._gym_records import (
    GYM_MODES,
    GYM_TERMINAL_SELECTIONS,
    GymCallRecord,
    GymManifest,
    GymManifestFailure,
    GymReceipt,
    GymStagedRecord,
)

__all__ = [
    "decode_gym_manifest",
    "decode_gym_receipt",
    "decode_gym_snapshots",
    "decode_gym_staged_record",
    "encode_gym_json",
]


def _bad(code: str, message: str) -> GymFormatError:
    return GymFormatError(code, message)


def _versions(fields: FieldReader) -> dict[str, int]:
    return {
        "schema_version": fields.version("schema_version"),
        "digest_version": fields.version("digest_version"),
        "extras_digest_version": fields.version("extras_digest_version"),
    }


def _call_fields(fields: FieldReader) -> dict[str, Any]:
    """What a staged record and a manifest call record share, read by the same rules: the
    version triple, the call's ids, lengths and weight version, and its three hashes."""
    return {
        **_versions(fields),
        "model_call_id": fields.identifier("model_call_id"),
        "parent_call_id": fields.identifier("parent_call_id", null=True, default=None),
        "prev_len": fields.uint("prev_len"),
        "delta_len": fields.uint("delta_len"),
        "cum_len": fields.uint("cum_len"),
        "weight_version": fields.uint("weight_version"),
        "digest": fields.hexdigest("digest"),
        "chain_hash": fields.hexdigest("chain_hash"),
        "cumulative_hash": fields.hexdigest("cumulative_hash"),
    }


def staged_record_from_json(obj: object) -> GymStagedRecord:
    """Strictly read one staged record (an object already parsed from JSON)."""
    with read_fields(obj, "staged record") as fields:
        shared = _call_fields(fields)
        loaded = fields.has("extras")
        extras = fields.raw("extras", default=None)
        if extras is not None and not isinstance(extras, dict):
            raise _bad("wrong_type", "staged record.extras must be an object or null")
        return GymStagedRecord(
            **shared,
            rollout_id=fields.identifier("rollout_id"),
            mode=fields.choice("mode", GYM_MODES),
            token_ids_delta=fields.int_column("token_ids_delta"),
            token_mask_delta=fields.float_column("token_mask_delta"),
            generation_log_probs_delta=fields.float_column("generation_log_probs_delta"),
            extras_digest=fields.hexdigest("extras_digest", default=EMPTY_EXTRAS_DIGEST),
            extras=extras,
            extras_loaded=loaded,
        )


def call_record_from_json(obj: object) -> GymCallRecord:
    """Strictly read one manifest call record."""
    with read_fields(obj, "call record") as fields:
        return GymCallRecord(
            **_call_fields(fields),
            extras_digest=fields.hexdigest("extras_digest"),
            staging_key=fields.identifier("staging_key"),
            mode=fields.choice("mode", GYM_MODES, default="token_in"),
            response_id=fields.identifier("response_id"),
            admitted_at=fields.number("admitted_at", null=True, default=None),
            output_fingerprint=fields.hexdigest("output_fingerprint", null=True, default=None),
            continuation_fingerprint=fields.hexdigest(
                "continuation_fingerprint", null=True, default=None
            ),
            fingerprint_version=fields.uint("fingerprint_version", default=0),
            logical_request_id=fields.identifier("logical_request_id", null=True, default=None),
        )


def receipt_from_json(obj: object) -> GymReceipt:
    """Strictly read a ``RolloutReceipt`` object."""
    with read_fields(obj, "receipt") as fields:
        return GymReceipt(
            **_versions(fields),
            rollout_id=fields.identifier("rollout_id"),
            reward=fields.number("reward", null=True, default=None),
            terminal_model_call_id=fields.identifier(
                "terminal_model_call_id", null=True, default=None
            ),
            manifest=fields.items("manifest", call_record_from_json, default=()),
            capture_poisoned=fields.boolean("capture_poisoned", default=False),
            failure_reason=fields.text("failure_reason", null=True, default=None),
            terminal_selection=fields.choice(
                "terminal_selection", GYM_TERMINAL_SELECTIONS, null=True, default=None
            ),
            terminal_attribution_reason=fields.text(
                "terminal_attribution_reason", null=True, default=None
            ),
        )


def _failure_from_json(obj: object) -> GymManifestFailure:
    with read_fields(obj, "manifest failure") as fields:
        failure = GymManifestFailure(
            schema_version=fields.version("schema_version"),
            model_call_id=fields.identifier("model_call_id"),
            reason=fields.identifier("reason"),
        )
    check_versions(failure.schema_version, 2, 1)
    return failure


def manifest_from_json(obj: object) -> GymManifest:
    """Strictly read a ``RolloutManifest`` object (the control plane's body)."""
    with read_fields(obj, "manifest") as fields:
        manifest = GymManifest(
            schema_version=fields.version("schema_version"),
            rollout_id=fields.identifier("rollout_id"),
            records=fields.items("records", call_record_from_json, default=()),
            failures=fields.items("failures", _failure_from_json, default=()),
        )
    check_versions(manifest.schema_version, 2, 1)
    return manifest


def decode_gym_staged_record(data: bytes | str) -> GymStagedRecord:
    """Read one staged record from JSON text; `GymFormatError` on any deviation."""
    return staged_record_from_json(load_json(data))


def decode_gym_snapshots(data: bytes | str) -> list[GymStagedRecord]:
    """Read staged records from a JSON array or from JSON Lines (one record a line)."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    if text.lstrip().startswith("["):
        doc = load_json(data)
        if not isinstance(doc, list):  # pragma: no cover - a leading '[' parses to a list
            raise _bad("wrong_type", "snapshots must be a JSON array")
        return [staged_record_from_json(item) for item in doc]
    return [staged_record_from_json(item) for item in load_json_lines(data)]


def decode_gym_receipt(data: bytes | str) -> GymReceipt:
    """Read a ``RolloutReceipt`` from JSON text."""
    return receipt_from_json(load_json(data))


def decode_gym_manifest(data: bytes | str) -> GymManifest:
    """Read a ``RolloutManifest`` (the control plane's manifest body) from JSON text."""
    return manifest_from_json(load_json(data))


def encode_gym_json(value: Any) -> bytes:
    """Compact JSON of a record, receipt, manifest or a list of them (``-0.0`` kept)."""
    if isinstance(value, (list, tuple)):
        value = [v.to_json() for v in value]
    elif hasattr(value, "to_json"):
        value = value.to_json()
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("utf-8")
