"""Gym's per-rollout lineage file (``<rollout_id>.lineage.jsonl``) and the manifest it yields.

Each line is one row, written by Gym as sorted compact JSON: a *commit row* (one staged
call: lineage fingerprints plus the custody columns of its manifest record) or a
*failure row* ``{"model_call_id", "failure_reason"}``. Gym keeps no hash chain over rows;
each row's ``chain_hash`` is the call's own chained digest.

Building the manifest follows Gym: failure rows become failures; a commit row without a
``response_id`` becomes the failure ``ledger_row_missing_response_id``, one without a
``chain_hash`` or ``cumulative_hash`` the failure ``ledger_row_missing_chain_hash``;
every other commit row becomes a call record. Columns older writers did not have
(``admitted_at``, ``staging_chain``, the chain digests, ``response_id``, fingerprints)
may be absent; any other unknown key is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from ._gym_digest import GYM_DIGEST_VERSION, GYM_EXTRAS_DIGEST_VERSION
from ._gym_errors import GymFormatError
from ._gym_json import FieldReader, load_json_lines, read_fields
from ._gym_records import GymCallRecord, GymManifest, GymManifestFailure

__all__ = [
    "GymLineageCommit",
    "GymLineageFailure",
    "decode_gym_lineage",
    "gym_manifest_from_lineage",
]

MISSING_RESPONSE_ID: Final = "ledger_row_missing_response_id"
MISSING_CHAIN_HASH: Final = "ledger_row_missing_chain_hash"


@dataclass(frozen=True, slots=True, kw_only=True)
class GymLineageCommit:
    """A commit row: one staged call's lineage fingerprints and custody columns."""

    model_call_id: str
    fingerprint: str | None
    context_len: int
    context_digest: str | None
    digest: str | None
    """The lineage digest: the call's cumulative hash."""
    custody: dict[str, Any]
    """The custody columns as written (``staging_digest`` is the staged-call digest)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GymLineageFailure:
    """A failure row: the call's capture did not complete, for ``failure_reason``."""

    model_call_id: str
    failure_reason: str


GymLineageRow = GymLineageCommit | GymLineageFailure


def _commit(fields: FieldReader) -> GymLineageCommit:
    custody = {
        "parent_call_id": fields.identifier("parent_call_id", null=True),
        "staging_key": fields.identifier("staging_key"),
        "weight_version": fields.uint("weight_version"),
        "prev_len": fields.uint("prev_len"),
        "delta_len": fields.uint("delta_len"),
        "cum_len": fields.uint("cum_len"),
        "staging_digest": fields.hexdigest("staging_digest"),
        "extras_digest": fields.hexdigest("extras_digest"),
        "mode": fields.choice("mode", ("text", "token_in")),
        "admitted_at": fields.number("admitted_at", null=True, default=None),
        "staging_chain": fields.items("staging_chain", _key, default=()),
        "chain_hash": fields.hexdigest("chain_hash", null=True, default=None),
        "cumulative_hash": fields.hexdigest("cumulative_hash", null=True, default=None),
        "response_id": fields.text("response_id", null=True, default=None),
        "output_fingerprint": fields.hexdigest("output_fingerprint", null=True, default=None),
        "continuation_fingerprint": fields.hexdigest(
            "continuation_fingerprint", null=True, default=None
        ),
        "fingerprint_version": fields.uint("fingerprint_version", default=0),
        "logical_request_id": fields.identifier("logical_request_id", null=True, default=None),
    }
    return GymLineageCommit(
        model_call_id=fields.identifier("model_call_id"),
        fingerprint=fields.text("fingerprint", null=True),
        context_len=fields.uint("context_len"),
        context_digest=fields.text("context_digest", null=True),
        digest=fields.text("digest", null=True),
        custody=custody,
    )


def _key(value: object) -> str:
    if type(value) is not str or not value:
        raise GymFormatError("wrong_type", "staging_chain holds non-empty strings")
    return value


def lineage_row_from_json(obj: object) -> GymLineageRow:
    """Strictly read one lineage row (commit or failure)."""
    with read_fields(obj, "lineage row") as fields:
        if fields.has("failure_reason"):
            return GymLineageFailure(
                model_call_id=fields.identifier("model_call_id"),
                failure_reason=fields.identifier("failure_reason"),
            )
        if fields.has("staging_key"):
            return _commit(fields)
        raise GymFormatError("unknown_row", "a lineage row is a commit or a failure row")


def decode_gym_lineage(data: bytes | str) -> list[GymLineageRow]:
    """Read a ``<rollout_id>.lineage.jsonl`` file: its rows, in file order.

    A model call id may appear once as a commit (Gym's writes are idempotent per call);
    a second, different commit row for one call is refused (``conflicting_row``).
    """
    rows = [lineage_row_from_json(obj) for obj in load_json_lines(data)]
    commits: dict[str, GymLineageCommit] = {}
    for row in rows:
        if isinstance(row, GymLineageCommit):
            held = commits.setdefault(row.model_call_id, row)
            if held != row:
                raise GymFormatError("conflicting_row", f"two commit rows for {row.model_call_id}")
    return rows


def gym_manifest_from_lineage(
    rollout_id: str, rows: list[GymLineageRow], *, schema_version: int = 2
) -> GymManifest:
    """The manifest Gym's control plane would serve for these lineage rows (see module doc).

    A commit row whose columns break a call record's invariants raises `GymFormatError`
    (Gym's manifest route answers 400; a framework records ``invalid_manifest_row``).
    """
    records: list[GymCallRecord] = []
    failures: list[GymManifestFailure] = []
    for row in rows:
        if isinstance(row, GymLineageFailure):
            failures.append(_failure(schema_version, row.model_call_id, row.failure_reason))
            continue
        c = row.custody
        if not c["response_id"]:
            failures.append(_failure(schema_version, row.model_call_id, MISSING_RESPONSE_ID))
            continue
        if not c["chain_hash"] or not c["cumulative_hash"]:
            failures.append(_failure(schema_version, row.model_call_id, MISSING_CHAIN_HASH))
            continue
        records.append(
            GymCallRecord(
                schema_version=schema_version,
                digest_version=GYM_DIGEST_VERSION,
                extras_digest_version=GYM_EXTRAS_DIGEST_VERSION,
                model_call_id=row.model_call_id,
                parent_call_id=c["parent_call_id"],
                prev_len=c["prev_len"],
                delta_len=c["delta_len"],
                cum_len=c["cum_len"],
                weight_version=c["weight_version"],
                digest=c["staging_digest"],
                extras_digest=c["extras_digest"],
                staging_key=c["staging_key"],
                mode=c["mode"],
                chain_hash=c["chain_hash"],
                cumulative_hash=c["cumulative_hash"],
                response_id=c["response_id"],
                admitted_at=c["admitted_at"],
                output_fingerprint=c["output_fingerprint"],
                continuation_fingerprint=c["continuation_fingerprint"],
                fingerprint_version=c["fingerprint_version"],
                logical_request_id=c["logical_request_id"],
            )
        )
    return GymManifest(
        schema_version=schema_version,
        rollout_id=rollout_id,
        records=tuple(records),
        failures=tuple(failures),
    )


def _failure(schema_version: int, call_id: str, reason: str) -> GymManifestFailure:
    return GymManifestFailure(schema_version=schema_version, model_call_id=call_id, reason=reason)
