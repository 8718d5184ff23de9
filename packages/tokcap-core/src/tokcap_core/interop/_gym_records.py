"""Gym's wire records: staged call records, manifest call records, receipts, manifests.

Frozen dataclasses that validate in their constructor as Gym's pydantic models do
(``extra="forbid"``, strict types, a staged record's digest recomputed from its fields);
``to_json`` gives the same JSON as Gym's ``model_dump(mode="json")`` (the strict readers
live in ``_gym_decode``). A call record
may carry ``logical_request_id``, an optional correlation header some Gym versions add;
it is read, kept, written back only when set, and bound by no digest.

A staged record read without an ``extras`` key is a *base snapshot*: its extras digest
is a commitment only (``extras_loaded`` is False), exactly what Gym's verifier reads. With
an ``extras`` key (an object or null), the extras must hash to ``extras_digest``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeAlias

from ._gym_digest import (
    check_versions,
    compute_extras_digest,
    compute_staging_digest,
    is_hex_digest,
)
from ._gym_errors import GymFormatError

__all__ = [
    "GYM_TERMINAL_SELECTIONS",
    "GymCallRecord",
    "GymManifest",
    "GymManifestFailure",
    "GymReceipt",
    "GymStagedRecord",
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
GYM_MODES: Final = ("text", "token_in")
"""Gym's capture modes: a root is ``text``, a child ``token_in``."""


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
    if record.mode not in GYM_MODES:
        raise _bad("bad_mode", f"mode must be one of {GYM_MODES}, got {record.mode!r}")
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
