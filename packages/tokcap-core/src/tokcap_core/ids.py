"""Rollout ids, call ids and staging keys.

A rollout id is chosen by the harness (``^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$``); a
call id is minted by the gate, deterministic per rollout (``c000001``, ...); a
staging key names one staged call in a sink: ``"{rollout_id}/{call_id}"``; a training
key names one row: ``"{rollout_id}/s{segment:03d}"``.

The types are `typing.NewType`s over ``str``: a type checker refuses a `TrainingKey` where a
`StagingKey` is expected (clearing training rows from the staging partition), at no
run-time cost.
"""

from __future__ import annotations

import re
from typing import NewType

from ._errors import InvalidId, InvalidStagedCall

__all__ = [
    "CallId",
    "GroupId",
    "RolloutId",
    "StagingKey",
    "TrainingKey",
    "call_id_for",
    "parse_staging_key",
    "staging_key",
    "training_key",
    "validate_call_id",
    "validate_rollout_id",
]

RolloutId = NewType("RolloutId", str)
"""A validated rollout id (chosen by the harness)."""
CallId = NewType("CallId", str)
"""A validated call id (minted by the gate: ``c000001``, ...)."""
StagingKey = NewType("StagingKey", str)
"""A key of the sink's staging partition: ``"{rollout_id}/{call_id}"``."""
TrainingKey = NewType("TrainingKey", str)
"""A key of the sink's training partition: ``"{rollout_id}/s{segment:03d}"``."""
GroupId = NewType("GroupId", str)
"""A GRPO group's id (chosen by the trainer; names a group slot)."""

_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_CALL_ID = re.compile(r"c[0-9]{6,12}")


def validate_rollout_id(rollout_id: object) -> RolloutId:
    """Return ``rollout_id`` unchanged, or raise `InvalidId` (code ``bad_rollout_id``)."""
    if not isinstance(rollout_id, str) or _ROLLOUT_ID.fullmatch(rollout_id) is None:
        raise InvalidId("bad_rollout_id", f"not a rollout id: {_show(rollout_id)}")
    return RolloutId(rollout_id)


def validate_call_id(call_id: object) -> CallId:
    """Return ``call_id`` unchanged, or raise `InvalidId` (code ``bad_call_id``)."""
    if not isinstance(call_id, str) or _CALL_ID.fullmatch(call_id) is None:
        raise InvalidId("bad_call_id", f"not a call id: {_show(call_id)}")
    return CallId(call_id)


def call_id_for(seq: int) -> CallId:
    """The call id the gate mints for the ``seq``-th call of a rollout (1-based)."""
    if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq < 10**12:
        raise InvalidId("bad_call_seq", f"call sequence number out of range: {_show(seq)}")
    return CallId(f"c{seq:06d}")


def staging_key(rollout_id: str, call_id: str) -> StagingKey:
    """The sink key of one staged call: ``"{rollout_id}/{call_id}"``, both ids validated."""
    return StagingKey(f"{validate_rollout_id(rollout_id)}/{validate_call_id(call_id)}")


def parse_staging_key(key: object) -> tuple[RolloutId, CallId]:
    """``(rollout_id, call_id)`` of a staging key; `InvalidId` ``bad_staging_key`` if malformed."""
    if not isinstance(key, str) or key.count("/") != 1:
        raise InvalidId("bad_staging_key", f"not a staging key: {_show(key)}")
    rollout_id, call_id = key.split("/")
    try:
        return validate_rollout_id(rollout_id), validate_call_id(call_id)
    except InvalidId as e:
        raise InvalidId("bad_staging_key", f"not a staging key: {_show(key)}") from e


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def training_key(rollout_id: str, segment: int) -> TrainingKey:
    """The training key of a rollout's ``segment``-th row: ``"{rollout_id}/s{segment:03d}"``."""
    if isinstance(segment, bool) or not isinstance(segment, int) or not 0 <= segment < 1000:
        raise InvalidStagedCall("bad_segment", f"segment index must be in [0, 1000): {segment!r}")
    return TrainingKey(f"{validate_rollout_id(rollout_id)}/s{segment:03d}")
