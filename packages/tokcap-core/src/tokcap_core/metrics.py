"""Plain ``dict[str, float]`` metrics over receipts, ready for any logger."""

from ._metrics import (
    break_cause_counts,
    calls_per_rollout,
    failure_counts,
    splice_cause_counts,
    terminal_selection_breakdown,
)

__all__ = [
    "break_cause_counts",
    "calls_per_rollout",
    "failure_counts",
    "splice_cause_counts",
    "terminal_selection_breakdown",
]
