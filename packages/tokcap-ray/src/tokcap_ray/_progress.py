"""Progress records: how far each group got, kept outside the actors that may die.

A reassembler records ``publishing`` (with the `FinalizedGroup` it is about to
publish) *before* its first write to the training partition, and ``published`` after
publishing and clearing staging. A replacement actor reads the record to decide:
none -> nothing was written, start over; ``published`` -> return it; ``publishing`` ->
check the training partition (see ``RolloutReassemblerActor``); ``unknown`` -> the
check was inconclusive once and stays so. Records are metadata only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from tokcap_core import FinalizedGroup

__all__ = ["GroupRecord", "ProgressActor", "RecordState"]

RecordState: TypeAlias = Literal["publishing", "published", "unknown"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupRecord:
    """A group's progress and the `FinalizedGroup` it has (or would have) produced."""

    state: RecordState
    finalized: FinalizedGroup


class ProgressActor:
    """Holds the `GroupRecord` of every group the pool has started (run as a Ray actor).

    A plain dict behind Ray's one-call-at-a-time actor semantics; ``forget`` frees
    records once the controller no longer needs retries to be idempotent.
    """

    def __init__(self) -> None:
        self._records: dict[str, GroupRecord] = {}

    def get(self, group_id: str) -> GroupRecord | None:
        """The record of ``group_id``, or None if no attempt reached publishing."""
        return self._records.get(group_id)

    def put(self, group_id: str, record: GroupRecord) -> None:
        """Record progress of ``group_id`` (replaces the previous record)."""
        self._records[group_id] = record

    def put_many(self, records: Mapping[str, GroupRecord]) -> None:
        """Record progress of several groups at once (one call for a bundle)."""
        self._records.update(records)

    def forget(self, group_ids: Sequence[str]) -> int:
        """Drop records; how many were held."""
        return sum(self._records.pop(g, None) is not None for g in group_ids)
