"""Capture metrics as plain ``dict[str, float]``, ready for any logger.

Every function returns the same key set whatever its input (zeros included), so
dashboards keep stable series; key sets derive from the closed tuples
(`FAILURE_BUCKETS`, `TERMINAL_SELECTIONS`, `BREAK_CAUSES`,
`SPLICE_CAUSES`), never from the data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from ._events import BREAK_CAUSES, SPLICE_CAUSES
from ._receipt import TERMINAL_SELECTIONS, Receipt
from .reasons import FAILURE_BUCKETS, UNKNOWN_REASON, reason_bucket

__all__ = [
    "break_cause_counts",
    "calls_per_rollout",
    "failure_counts",
    "splice_cause_counts",
    "terminal_selection_breakdown",
]


def failure_counts(reasons: Iterable[str | None]) -> dict[str, float]:
    """``failures/<bucket>`` counts for every bucket and ``failures/unknown``.

    Counted per `reason_bucket` (``"stage_failed:timeout"`` counts as ``stage_failed``);
    None entries (no failure) are skipped; a reason outside the set counts as unknown.
    """
    counts = Counter(reason_bucket(r) for r in reasons if r is not None)
    return {f"failures/{b}": float(counts[b]) for b in (*FAILURE_BUCKETS, UNKNOWN_REASON)}


def terminal_selection_breakdown(receipts: Iterable[Receipt]) -> dict[str, float]:
    """``terminal/<method>/count`` and ``/fraction`` for every method in `TERMINAL_SELECTIONS`.

    Fractions are over verified receipts (poisoned ones have no terminal); all 0.0
    when there are none.
    """
    verified = [r.terminal_selection for r in receipts if r.ok]
    counts = Counter(verified)
    metrics: dict[str, float] = {}
    for method in TERMINAL_SELECTIONS:
        metrics[f"terminal/{method}/count"] = float(counts[method])
        metrics[f"terminal/{method}/fraction"] = counts[method] / len(verified) if verified else 0.0
    return metrics


def calls_per_rollout(receipts: Iterable[Receipt]) -> dict[str, float]:
    """Mean/min/max per rollout of admitted calls and of on-chain (segment) calls.

    ``calls/admitted/*`` counts every sink key (off-chain failures included);
    ``calls/on_chain/*`` counts calls in segments (0 for a poisoned receipt). All 0.0
    for no receipts.
    """
    admitted: list[int] = []
    on_chain: list[int] = []
    for receipt in receipts:
        admitted.append(len(receipt.sink_keys))
        on_chain.append(sum(len(segment) for segment in receipt.segments))
    return _stats("calls/admitted", admitted) | _stats("calls/on_chain", on_chain)


def break_cause_counts(receipts: Iterable[Receipt]) -> dict[str, float]:
    """``breaks/<cause>`` for every cause in `BREAK_CAUSES`, and ``breaks/total``.

    A break is a later root of a rollout (a call that extended no parent). The total
    counts every break, including a cause outside `BREAK_CAUSES` (none can be recorded
    today: the ledger refuses them).
    """
    counts = Counter(cause for receipt in receipts for cause in receipt.break_causes)
    metrics = {f"breaks/{cause}": float(counts[cause]) for cause in BREAK_CAUSES}
    metrics["breaks/total"] = float(sum(counts.values()))
    return metrics


def splice_cause_counts(receipts: Iterable[Receipt]) -> dict[str, float]:
    """``splices/<cause>`` for every cause in `SPLICE_CAUSES`, and ``splices/total``.

    A splice is a call that kept its parent's exact ids although the chat template
    renders the parent's turn differently (it is on the parent's chain, not a break).
    """
    counts = Counter(cause for receipt in receipts for cause in receipt.splice_causes)
    metrics = {f"splices/{cause}": float(counts[cause]) for cause in SPLICE_CAUSES}
    metrics["splices/total"] = float(sum(counts.values()))
    return metrics


def _stats(prefix: str, values: Sequence[int]) -> dict[str, float]:
    if not values:
        return {f"{prefix}/mean": 0.0, f"{prefix}/min": 0.0, f"{prefix}/max": 0.0}
    return {
        f"{prefix}/mean": sum(values) / len(values),
        f"{prefix}/min": float(min(values)),
        f"{prefix}/max": float(max(values)),
    }
