"""Bounded staleness for ``tokcap train --async``: which groups may start, which may train.

Pure (no I/O, no clock, no torch): the asynchronous driver (`tokcap.loop._async`) asks,
and acts on the answer.

- **Admission** (`StalenessPolicy.may_start`): the rollout pump may start a group only while
  the groups started and not discarded are at most ``(steps_done + K + 1) * G``. A group
  started when ``steps_done == d`` samples every token at version ``>= v0 + d`` and, taken
  in order, is trained by step ``<= d + K``: at most K versions stale.
- **Training** (`StalenessPolicy.judge`): groups do not finish in order, and discarded
  groups push later ones back, so the train pump checks each group against the version it
  is about to train: a group any of whose rows holds a token sampled more than K versions
  behind is discarded *as a group* (GRPO's baseline is per group) and a spare prompt is
  started in its place.
- **Skips** (`SkipCount`): every discarded group is counted by reason; past
  ``max_skipped`` the run stops with `LoopError` ``too_many_skipped`` rather than train on
  ever fewer prompts.

Token staleness reads what rows carry: each call span's per-token ``weight_versions`` and
``kv_versions`` (capture format v3); a v2 call only has its first and last versions, and
its tokens all count at the first (an upper bound on their staleness).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tokcap_core import ConfigError, TokcapError, TrainingRow
from tokcap_core.provenance import row_staleness

__all__ = [
    "STALE",
    "LoopError",
    "Provenance",
    "SkipCount",
    "StalenessPolicy",
    "provenance",
]

STALE = "stale"
"""The reason a group is discarded for holding a token sampled more than K versions behind."""


class LoopError(TokcapError, RuntimeError):
    """The loop cannot go on: ``too_many_skipped`` (more groups discarded than the bound)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StalenessPolicy:
    """K (``max_staleness``), G (``groups_per_step``) and the skip bound of an async run."""

    max_staleness: int
    groups_per_step: int
    max_skipped: int

    def __post_init__(self) -> None:
        for name in ("max_staleness", "groups_per_step", "max_skipped"):
            value = getattr(self, name)
            low = 1 if name == "groups_per_step" else 0
            if type(value) is not int or value < low:
                raise ConfigError(f"bad_{name}", f"{name} must be an int >= {low}: {value!r}")

    def may_start(self, *, live: int, steps_done: int) -> bool:
        """Whether one more group may start while ``live`` groups (started, not discarded)
        exist and ``steps_done`` steps have pushed their weights."""
        return live < (steps_done + self.max_staleness + 1) * self.groups_per_step

    def judge(self, rows: Sequence[TrainingRow], trained_version: int) -> str | None:
        """None to train ``rows`` (one group) at ``trained_version``; else `STALE`.

        Placeholder rows carry no tokens and never make a group stale; a group of only
        placeholders is not stale either (the group policy rejects it for its own reason).
        """
        oldest = _oldest_version(rows)
        if oldest is not None and trained_version - oldest > self.max_staleness:
            return STALE
        return None


def _oldest_version(rows: Iterable[TrainingRow]) -> int | None:
    versions = [
        row.weight_version_min
        for row in rows
        if row.sample_mask and row.weight_version_min is not None
    ]
    return min(versions, default=None)


@dataclass(slots=True)
class SkipCount:
    """Discarded groups by reason, against the run's bound."""

    max_skipped: int
    reasons: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        """Groups discarded so far."""
        return sum(self.reasons.values())

    def skip(self, reason: str) -> None:
        """Count one discarded group; `LoopError` ``too_many_skipped`` past the bound."""
        self.reasons[reason] += 1
        if self.total > self.max_skipped:
            counts = ", ".join(f"{k} {v}" for k, v in sorted(self.reasons.items()))
            raise LoopError(
                "too_many_skipped",
                f"{self.total} groups discarded (bound {self.max_skipped}): {counts}",
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class Provenance:
    """Which versions sampled the loss tokens of a batch trained at one version."""

    staleness_max: int | None
    """Trained version minus the oldest version that sampled a loss token (None: none)."""
    tokens_by_staleness: dict[int, int]
    """Loss tokens per staleness (trained version minus the version that sampled them)."""
    calls_spanning_versions: int
    """Calls whose generated tokens were sampled by more than one version."""
    tokens_stale_kv: int = 0
    """Loss tokens conditioned on KV computed by weights older than those that sampled them."""

    @property
    def tokens_stale(self) -> int:
        """Loss tokens sampled one or more versions behind."""
        return sum(n for s, n in self.tokens_by_staleness.items() if s > 0)


def provenance(rows: Iterable[TrainingRow], trained_version: int) -> Provenance:
    """The `Provenance` of valid ``rows`` trained at ``trained_version``.

    Per token where a call carries its version spans (capture format v3; stale-KV tokens
    from `tokcap_core.provenance.row_staleness`); a format v2 call's tokens all count at its
    first version (an upper bound on their staleness), and it spans versions when its first
    and last differ.
    """
    by_staleness: Counter[int] = Counter()
    spanning = stale_kv = 0
    for row in rows:
        if not row.sample_mask:
            continue
        stale_kv += row_staleness(row, trained_version).stale_kv_tokens
        for span in row.call_spans:
            if span.weight_versions is None:
                by_staleness[trained_version - span.weight_version] += span.gen_len
                spanning += span.weight_version != span.weight_version_last
                continue
            for part in span.weight_versions:
                by_staleness[trained_version - part.version] += part.length
            spanning += len({part.version for part in span.weight_versions}) > 1
    return Provenance(
        staleness_max=max(by_staleness, default=None),
        tokens_by_staleness=dict(sorted(by_staleness.items())),
        calls_spanning_versions=spanning,
        tokens_stale_kv=stale_kv,
    )
