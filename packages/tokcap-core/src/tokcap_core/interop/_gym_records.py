"""Gym's wire records: staged call records, manifest call records, receipts, manifests.

Frozen dataclasses that validate in their constructor as Gym's pydantic models do
(``extra="forbid"``, strict types, a staged record's digest recomputed from its fields),
and strict JSON readers/writers that give the same JSON as Gym's
``model_dump(mode="json")``. Readers require the version triple (a reader of schema 2
and 3 cannot default it); every other field Gym defaults may be omitted. A call record
may carry ``logical_request_id``, an optional correlation header some Gym versions add;
it is read, kept, written back only when set, and bound by no digest.

A staged record read without an ``extras`` key is a *base snapshot*: its extras digest
is a commitment only (``extras_loaded`` is False), exactly what Gym's verifier reads. With
an ``extras`` key (an object or null), the extras must hash to ``extras_digest``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

from ._gym_digest import (
    EMPTY_EXTRAS_DIGEST,
    check_versions,
    compute_extras_digest,
    compute_staging_digest,
    is_hex_digest,
)
from ._gym_errors import GymFormatError
from ._gym_json import FieldReader, load_json, load_json_lines

__all__ = [
    "GYM_TERMINAL_SELECTIONS",
    "GymCallRecord",
    "GymManifest",
    "GymManifestFailure",
    "GymReceipt",
    "GymStagedRecord",
    "decode_gym_manifest",
    "decode_gym_receipt",
    "decode_gym_snapshots",
    "decode_gym_staged_record",
    "encode_gym_json",
    "gym_staging_key",
]

GymMode: TypeAlias = Literal["text", "token_in"]
GymTerminalSelection: TypeAlias = Literal["declared", "response_id", "content", "heuristic"]
GYM_TERMINAL_SELECTIONS: Final[tuple[str, ...]] = (
    "declared",
    "response_id",
    "content",
    "heuristic",
)
"""How a Gym receipt's terminal may have been selected (Gym 0.7 vocabulary)."""
_MODES: Final = ("text", "token_in")


def gym_staging_key(rollout_id: str, model_call_id: str) -> str:
    """Gym's default staging key, ``"{rollout_id}/{model_call_id}"``."""
    return f"{rollout_id}/{model_call_id}"


def _bad(code: str, message: str) -> GymFormatError:
    return GymFormatError(code, message)


def _check_identity(*named: tuple[str, object], optional: tuple[str, object] | None = None) -> None:
    for name, value in named:
        if type(value) is not str or not value:
            raise _bad("empty_identifier", f"{name} must be a non-empty string")
    if optional is not None and optional[1] is not None:
        _check_identity(optional)


def _check_shape(record: GymStagedRecord | GymCallRecord) -> None:
    """Gym's root/child invariants, shared by staged and manifest records."""
    for name in ("prev_len", "delta_len", "cum_len", "weight_version"):
        value = getattr(record, name)
        if type(value) is not int or not 0 <= value < 2**64:
            raise _bad("out_of_range", f"{name} must be an unsigned 64-bit integer")
    if record.mode not in _MODES:
        raise _bad("bad_mode", f"mode must be one of {_MODES}, got {record.mode!r}")
    root = record.parent_call_id is None
    if root != (record.prev_len == 0) or root != (record.mode == "text"):
        raise _bad("root_child_mismatch", "a root is text-mode with prev_len 0; a child token_in")
    if record.delta_len == 0 or record.cum_len != record.prev_len + record.delta_len:
        raise _bad("length_mismatch", "lengths must describe a non-empty contiguous delta")
    for name in ("digest", "extras_digest", "chain_hash", "cumulative_hash"):
        if not is_hex_digest(getattr(record, name)):
            raise _bad("bad_hex", f"{name} must be 64 lowercase hex characters")


@dataclass(frozen=True, slots=True, kw_only=True)
class GymStagedRecord:
    """One staged call delta (Gym's ``StagedCallRecord`` / base snapshot); validated on creation."""

    schema_version: int
    digest_version: int
    extras_digest_version: int
    rollout_id: str
    model_call_id: str
    parent_call_id: str | None
    mode: GymMode
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    token_ids_delta: tuple[int, ...]
    token_mask_delta: tuple[float, ...]
    generation_log_probs_delta: tuple[float, ...]
    extras_digest: str
    chain_hash: str
    cumulative_hash: str
    extras: dict[str, Any] | None = None
    extras_loaded: bool = True
    """False for a base snapshot: ``extras`` was not sent, ``extras_digest`` is a commitment."""

    def __post_init__(self) -> None:
        check_versions(self.schema_version, self.digest_version, self.extras_digest_version)
        _check_identity(
            ("rollout_id", self.rollout_id),
            ("model_call_id", self.model_call_id),
            optional=("parent_call_id", self.parent_call_id),
        )
        _check_shape(self)
        for name in ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta"):
            if type(getattr(self, name)) is not tuple:
                raise _bad("wrong_type", f"{name} must be a tuple")
        if self.extras_loaded and compute_extras_digest(self.extras) != self.extras_digest:
            raise _bad("extras_digest_mismatch", f"{self.model_call_id}: extras do not match")
        if not self.extras_loaded and self.extras is not None:
            raise _bad("bad_extras", "a base snapshot carries no extras")
        if self.compute_digest() != self.digest:
            raise _bad("corrupt_digest", f"{self.model_call_id}: digest does not match contents")

    @property
    def staging_key(self) -> str:
        """Gym's default staging key of this call."""
        return gym_staging_key(self.rollout_id, self.model_call_id)

    def compute_digest(self) -> str:
        """Recompute the staged-call digest from the fields (ignores the claimed ``digest``)."""
        return compute_staging_digest(
            **{name: getattr(self, name) for name in _DIGEST_FIELDS if name != "digest"}
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object Gym writes (``extras`` only when loaded)."""
        out = {name: getattr(self, name) for name in _DIGEST_FIELDS}
        for name in ("token_ids_delta", "token_mask_delta", "generation_log_probs_delta"):
            out[name] = list(out[name])
        if self.extras_loaded:
            out["extras"] = self.extras
        return out


_DIGEST_FIELDS: Final = (
    "schema_version", "digest_version", "extras_digest_version", "rollout_id", "model_call_id",
    "parent_call_id", "mode", "prev_len", "delta_len", "cum_len", "weight_version", "digest",
    "token_ids_delta", "token_mask_delta", "generation_log_probs_delta", "extras_digest",
    "chain_hash", "cumulative_hash",
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class GymCallRecord:
    """One token-free manifest row (Gym's ``CallRecord``); validated on creation."""

    schema_version: int
    digest_version: int
    extras_digest_version: int
    model_call_id: str
    parent_call_id: str | None
    prev_len: int
    delta_len: int
    cum_len: int
    weight_version: int
    digest: str
    extras_digest: str
    staging_key: str
    mode: GymMode
    chain_hash: str
    cumulative_hash: str
    response_id: str
    admitted_at: float | None = None
    output_fingerprint: str | None = None
    continuation_fingerprint: str | None = None
    fingerprint_version: int = 0
    logical_request_id: str | None = None

    def __post_init__(self) -> None:
        check_versions(self.schema_version, self.digest_version, self.extras_digest_version)
        _check_identity(
            ("model_call_id", self.model_call_id),
            ("staging_key", self.staging_key),
            ("response_id", self.response_id),
            optional=("parent_call_id", self.parent_call_id),
        )
        if self.logical_request_id is not None:
            _check_identity(("logical_request_id", self.logical_request_id))
        _check_shape(self)
        for name in ("output_fingerprint", "continuation_fingerprint"):
            value = getattr(self, name)
            if value is not None and not is_hex_digest(value):
                raise _bad("bad_hex", f"{name} must be 64 lowercase hex characters or null")
        if type(self.fingerprint_version) is not int or self.fingerprint_version < 0:
            raise _bad("out_of_range", "fingerprint_version must be a non-negative int")
        if self.admitted_at is not None and type(self.admitted_at) is not float:
            raise _bad("wrong_type", "admitted_at must be a float or null")

    def to_json(self) -> dict[str, Any]:
        """The JSON object Gym writes (``logical_request_id`` only when set)."""
        out = {name: getattr(self, name) for name in _CALL_FIELDS}
        if self.logical_request_id is not None:
            out["logical_request_id"] = self.logical_request_id
        return out


_CALL_FIELDS: Final = (
    "schema_version", "digest_version", "extras_digest_version", "model_call_id",
    "parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version", "digest",
    "extras_digest", "staging_key", "mode", "chain_hash", "cumulative_hash", "response_id",
    "admitted_at", "output_fingerprint", "continuation_fingerprint", "fingerprint_version",
)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class GymReceipt:
    """Gym's ``RolloutReceipt``: the token-free manifest a framework assembles at rollout end.

    Exactly three states are valid: unpoisoned (no failure reason; a terminal and its
    selection named), no selection (no terminal; poisoned with a reason), or poisoned
    naming a terminal anyway.
    """

    schema_version: int
    digest_version: int
    extras_digest_version: int
    rollout_id: str
    reward: float | None
    terminal_model_call_id: str | None
    manifest: tuple[GymCallRecord, ...]
    capture_poisoned: bool = False
    failure_reason: str | None = None
    terminal_selection: GymTerminalSelection | None = None
    terminal_attribution_reason: str | None = None

    def __post_init__(self) -> None:
        check_versions(self.schema_version, self.digest_version, self.extras_digest_version)
        _check_identity(("rollout_id", self.rollout_id))
        if self.reward is not None and (
            type(self.reward) is not float or not math.isfinite(self.reward)
        ):
            raise _bad("wrong_type", "reward must be a finite float or null")
        if type(self.capture_poisoned) is not bool:
            raise _bad("wrong_type", "capture_poisoned must be a bool")
        ids = [r.model_call_id for r in self.manifest]
        if len(set(ids)) != len(ids):
            raise _bad("duplicate_manifest_row", "model_call_id values are not unique")
        terminal = self.terminal_model_call_id
        if terminal is not None and terminal not in ids:
            raise _bad("missing_terminal", f"terminal {terminal} is not in the manifest")
        if self.terminal_selection not in (None, *GYM_TERMINAL_SELECTIONS):
            raise _bad("bad_value", f"terminal_selection {self.terminal_selection!r}")
        if not self.capture_poisoned and (
            self.failure_reason is not None or terminal is None or self.terminal_selection is None
        ):
            raise _bad("bad_receipt_state", "an unpoisoned receipt names a terminal, no failure")
        unselected = self.terminal_selection is None
        if unselected and (terminal is not None or self.failure_reason is None):
            raise _bad("bad_receipt_state", "no selection means no terminal and a failure reason")

    @property
    def poisoned(self) -> bool:
        """Whether Gym's rules refuse to train on this rollout (poisoned or failed)."""
        return self.capture_poisoned or self.failure_reason is not None

    def to_json(self) -> dict[str, Any]:
        """The JSON object Gym writes."""
        return {
            "schema_version": self.schema_version,
            "digest_version": self.digest_version,
            "extras_digest_version": self.extras_digest_version,
            "rollout_id": self.rollout_id,
            "reward": self.reward,
            "terminal_model_call_id": self.terminal_model_call_id,
            "manifest": [r.to_json() for r in self.manifest],
            "capture_poisoned": self.capture_poisoned,
            "failure_reason": self.failure_reason,
            "terminal_selection": self.terminal_selection,
            "terminal_attribution_reason": self.terminal_attribution_reason,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class GymManifestFailure:
    """A call whose capture did not complete (Gym's ``ManifestFailure``)."""

    schema_version: int
    model_call_id: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        """The JSON object Gym writes."""
        return {
            "schema_version": self.schema_version,
            "model_call_id": self.model_call_id,
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class GymManifest:
    """The manifest Gym's control plane serves (``RolloutManifest``): records and failures."""

    schema_version: int
    rollout_id: str
    records: tuple[GymCallRecord, ...] = field(default=())
    failures: tuple[GymManifestFailure, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        """The JSON object Gym writes."""
        return {
            "schema_version": self.schema_version,
            "rollout_id": self.rollout_id,
            "records": [r.to_json() for r in self.records],
            "failures": [f.to_json() for f in self.failures],
        }


def _versions(fields: FieldReader) -> dict[str, int]:
    return {
        "schema_version": fields.version("schema_version"),
        "digest_version": fields.version("digest_version"),
        "extras_digest_version": fields.version("extras_digest_version"),
    }


def staged_record_from_json(obj: object) -> GymStagedRecord:
    """Strictly read one staged record (an object already parsed from JSON)."""
    fields = FieldReader(obj, "staged record")
    versions = _versions(fields)
    loaded = fields.has("extras")
    extras = fields.raw("extras", default=None)
    if extras is not None and not isinstance(extras, dict):
        raise _bad("wrong_type", "staged record.extras must be an object or null")
    record = GymStagedRecord(
        **versions,
        rollout_id=fields.identifier("rollout_id"),
        model_call_id=fields.identifier("model_call_id"),
        parent_call_id=fields.identifier("parent_call_id", null=True, default=None),
        mode=fields.choice("mode", _MODES),
        prev_len=fields.uint("prev_len"),
        delta_len=fields.uint("delta_len"),
        cum_len=fields.uint("cum_len"),
        weight_version=fields.uint("weight_version"),
        digest=fields.hexdigest("digest"),
        token_ids_delta=fields.int_column("token_ids_delta"),
        token_mask_delta=fields.float_column("token_mask_delta"),
        generation_log_probs_delta=fields.float_column("generation_log_probs_delta"),
        extras_digest=fields.hexdigest("extras_digest", default=EMPTY_EXTRAS_DIGEST),
        chain_hash=fields.hexdigest("chain_hash"),
        cumulative_hash=fields.hexdigest("cumulative_hash"),
        extras=extras,
        extras_loaded=loaded,
    )
    fields.finish()
    return record


def call_record_from_json(obj: object) -> GymCallRecord:
    """Strictly read one manifest call record."""
    fields = FieldReader(obj, "call record")
    record = GymCallRecord(
        **_versions(fields),
        model_call_id=fields.identifier("model_call_id"),
        parent_call_id=fields.identifier("parent_call_id", null=True, default=None),
        prev_len=fields.uint("prev_len"),
        delta_len=fields.uint("delta_len"),
        cum_len=fields.uint("cum_len"),
        weight_version=fields.uint("weight_version"),
        digest=fields.hexdigest("digest"),
        extras_digest=fields.hexdigest("extras_digest"),
        staging_key=fields.identifier("staging_key"),
        mode=fields.choice("mode", _MODES, default="token_in"),
        chain_hash=fields.hexdigest("chain_hash"),
        cumulative_hash=fields.hexdigest("cumulative_hash"),
        response_id=fields.identifier("response_id"),
        admitted_at=fields.number("admitted_at", null=True, default=None),
        output_fingerprint=fields.hexdigest("output_fingerprint", null=True, default=None),
        continuation_fingerprint=fields.hexdigest(
            "continuation_fingerprint", null=True, default=None
        ),
        fingerprint_version=fields.uint("fingerprint_version", default=0),
        logical_request_id=fields.identifier("logical_request_id", null=True, default=None),
    )
    fields.finish()
    return record


def receipt_from_json(obj: object) -> GymReceipt:
    """Strictly read a ``RolloutReceipt`` object."""
    fields = FieldReader(obj, "receipt")
    receipt = GymReceipt(
        **_versions(fields),
        rollout_id=fields.identifier("rollout_id"),
        reward=fields.number("reward", null=True, default=None),
        terminal_model_call_id=fields.identifier("terminal_model_call_id", null=True, default=None),
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
    fields.finish()
    return receipt


def _failure_from_json(obj: object) -> GymManifestFailure:
    fields = FieldReader(obj, "manifest failure")
    failure = GymManifestFailure(
        schema_version=fields.version("schema_version"),
        model_call_id=fields.identifier("model_call_id"),
        reason=fields.identifier("reason"),
    )
    fields.finish()
    check_versions(failure.schema_version, 2, 1)
    return failure


def manifest_from_json(obj: object) -> GymManifest:
    """Strictly read a ``RolloutManifest`` object (the control plane's body)."""
    fields = FieldReader(obj, "manifest")
    manifest = GymManifest(
        schema_version=fields.version("schema_version"),
        rollout_id=fields.identifier("rollout_id"),
        records=fields.items("records", call_record_from_json, default=()),
        failures=fields.items("failures", _failure_from_json, default=()),
    )
    fields.finish()
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
