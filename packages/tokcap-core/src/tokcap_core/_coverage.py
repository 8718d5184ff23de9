"""Coverage: what a rollout recorded or staged that its receipt's segments do not cover.

A verified receipt vouches for its segments only. Everything else the ledger recorded
(a call that failed before it was served, a branch off a root's deepest chain, a root the
segment mode leaves out) and everything the sink holds that the ledger never recorded is
*uncovered*: nothing checks it when rows are built. `uncovered_calls` names each such
call and why, and for each staged one whether it still matches the ledger's digest, so
a verifier can report it (and a strict one refuse it). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from ._ledger import FAILED, STAGED, CallRecord, RolloutState
from ._receipt import Receipt
from ._staged import StagedCall
from .ids import staging_key

__all__ = ["UNCOVERED_REASONS", "StagedMatch", "Uncovered", "UncoveredReason", "uncovered_calls"]

UncoveredReason: TypeAlias = Literal[
    "not_recorded", "failed_before_served", "other_root", "off_chain_branch"
]
UNCOVERED_REASONS: Final[dict[UncoveredReason, str]] = {
    "not_recorded": "staged, but no ledger entry of this rollout names it",
    "failed_before_served": "recorded as failed before it was served (never on a chain)",
    "other_root": "on a root the segment mode leaves out (--segments all covers it)",
    "off_chain_branch": "a branch off its root's deepest chain (a retry or abandoned turn)",
}
"""Why a call is uncovered, each with the sentence a report prints."""
StagedMatch: TypeAlias = Literal["absent", "matches_ledger", "differs_from_ledger", "unrecorded"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Uncovered:
    """One call no segment of the receipt covers."""

    call_id: str
    staging_key: str
    reason: UncoveredReason
    staged: StagedMatch
    """``absent`` (no staged row given), ``matches_ledger`` / ``differs_from_ledger``
    (its digest against the ledger's record), ``unrecorded`` (nothing to compare with)."""

    @property
    def holds_tokens(self) -> bool:
        """False only for a call that failed before it was served and has no staged row:
        nothing of it could be trained, so a strict verifier reports it without failing."""
        return not (self.reason == "failed_before_served" and self.staged == "absent")

    def to_json(self) -> dict[str, str]:
        """A JSON-ready dict, with the reason's sentence as ``why``."""
        return {
            "call_id": self.call_id,
            "staging_key": self.staging_key,
            "reason": self.reason,
            "why": UNCOVERED_REASONS[self.reason],
            "staged": self.staged,
        }


def uncovered_calls(
    state: RolloutState, receipt: Receipt, staged: Iterable[StagedCall] = ()
) -> tuple[Uncovered, ...]:
    """Recorded and staged calls outside ``receipt``'s segments, ledger order then sink order.

    A poisoned receipt covers nothing and trains nothing: it returns ``()``. ``staged``
    may hold calls of other rollouts (reported as ``not_recorded``).
    """
    if not receipt.ok:
        return ()
    covered = {call.call_id for segment in receipt.segments for call in segment}
    by_key = {call.key: call for call in staged}
    trained_roots = {segment[0].call_id for segment in receipt.segments}
    out: list[Uncovered] = []
    for call_id, record in state.calls.items():
        if call_id in covered:
            continue
        key = staging_key(state.rollout_id, call_id)
        row = by_key.pop(key, None)
        out.append(
            Uncovered(
                call_id=call_id,
                staging_key=key,
                reason=_reason(state, record, trained_roots),
                staged=_match(record, row),
            )
        )
    out.extend(
        Uncovered(call_id=call.call_id, staging_key=key, reason="not_recorded", staged="unrecorded")
        for key, call in by_key.items()
        if call.rollout_id != state.rollout_id or call.call_id not in covered
    )
    return tuple(out)


def _reason(state: RolloutState, record: CallRecord, trained_roots: set[str]) -> UncoveredReason:
    if record.state is FAILED:
        return "failed_before_served"
    root = record
    while root.parent_id is not None and root.parent_id in state.calls:
        root = state.calls[root.parent_id]
    return "off_chain_branch" if root.call_id in trained_roots else "other_root"


def _match(record: CallRecord, row: StagedCall | None) -> StagedMatch:
    if row is None:
        return "absent"
    if record.state is not STAGED or record.staged is None:
        return "unrecorded"  # the ledger committed no digest for it
    digest = record.staged.call_digest
    same = row.digest == digest and row.compute_digest() == digest
    return "matches_ledger" if same else "differs_from_ledger"
