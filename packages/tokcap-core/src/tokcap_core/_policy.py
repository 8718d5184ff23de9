"""What the controller does with a finalized group: accept it, replace it, or drop it.

The reassembler reports (`FinalizedGroup`); the controller decides, here, purely from
that report. A group needs at least two valid rollouts: with one, the group baseline is
that rollout itself and every advantage is 0.0, so training on it teaches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, TypeAlias

from ._errors import ConfigError
from ._rpc import FinalizedGroup

__all__ = [
    "TOO_FEW_VALID",
    "UNKNOWN_OUTCOME",
    "Accept",
    "Drop",
    "GroupDecision",
    "Replace",
    "decide_group",
]

UNKNOWN_OUTCOME: Final = "unknown_outcome"
"""The pool cannot know whether the group was published (see `FinalizedGroup.outcome`)."""
TOO_FEW_VALID: Final = "too_few_valid"
"""Below ``min_valid_fraction`` valid rows, or fewer than two valid rollouts."""

RejectReason: TypeAlias = Literal["unknown_outcome", "too_few_valid"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Accept:
    """Train on the group as published."""

    group_id: str
    reason: Literal["ok"] = "ok"


@dataclass(frozen=True, slots=True, kw_only=True)
class Replace:
    """Discard the group and sample a fresh one in its place (the batch keeps its size)."""

    group_id: str
    reason: RejectReason


@dataclass(frozen=True, slots=True, kw_only=True)
class Drop:
    """Discard the group without a replacement (the batch shrinks)."""

    group_id: str
    reason: RejectReason


GroupDecision: TypeAlias = Accept | Replace | Drop
"""One of `Accept`, `Replace`, `Drop`."""


def decide_group(
    finalized: FinalizedGroup, min_valid_fraction: float, *, allow_replace: bool = True
) -> GroupDecision:
    """Accept, replace or drop a finalized group; pure, the controller acts on the result.

    - ``outcome="unknown"`` -> rejected with ``unknown_outcome`` whatever its counts say.
    - Accept needs ``valid_fraction >= min_valid_fraction`` (inclusive; the fraction is
      ``valid_row_count / total_row_count``) **and** at least two valid rollouts and two
      valid rows (rows of one rollout share one baseline, so they count once).
    - Otherwise rejected with ``too_few_valid`` -- even with ``min_valid_fraction=0``.
    - A rejection is `Replace` when ``allow_replace`` else `Drop`.
    ``min_valid_fraction`` must be a finite number in ``[0, 1]``, else `ConfigError`
    ``bad_min_valid_fraction`` (checked before anything else, so a bad setting never
    hides behind an unknown outcome).
    """
    check_min_valid_fraction(min_valid_fraction)
    reason: RejectReason
    if finalized.outcome == "unknown":
        reason = UNKNOWN_OUTCOME
    elif (
        finalized.valid_fraction >= min_valid_fraction
        and finalized.valid_rollout_count >= 2
        and finalized.valid_row_count >= 2
    ):
        return Accept(group_id=finalized.group_id)
    else:
        reason = TOO_FEW_VALID
    if allow_replace:
        return Replace(group_id=finalized.group_id, reason=reason)
    return Drop(group_id=finalized.group_id, reason=reason)


def check_min_valid_fraction(value: object) -> None:
    """Raise `ConfigError` ``bad_min_valid_fraction`` unless ``value`` is a number in [0, 1].

    NaN and infinities are outside; ``True``/``False`` are not numbers here. Shared with
    `CaptureConfig`, not exported.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ConfigError("bad_min_valid_fraction", f"must be a number in [0, 1]: {value!r}")
