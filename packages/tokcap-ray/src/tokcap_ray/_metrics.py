"""`step_metrics`: one training step's metrics from its finalized groups, ``dict[str, float]``."""

from __future__ import annotations

from collections.abc import Iterable

from tokcap_core import FinalizedGroup
from tokcap_core.receipts import TERMINAL_SELECTIONS

__all__ = ["step_metrics"]


def step_metrics(groups: Iterable[FinalizedGroup]) -> dict[str, float]:
    """Aggregate per-group metrics over a step.

    Counts (``rows/*``, ``tokens/*``, ``failures/*``, ``terminal/*/count``, …) are
    summed; timings (``*_ms``) give ``…/mean`` and ``…/max`` over groups; terminal
    fractions are recomputed from the summed counts (not averaged). Adds
    ``groups/total``, ``groups/unknown_outcome`` and ``rows/valid_fraction``. Groups
    with ``outcome="unknown"`` count only in ``groups/*``: their rows may not exist.
    All 0.0 for no groups, except that keys only appear once some group has them.
    """
    groups = list(groups)
    known = [g for g in groups if g.outcome == "published"]
    sums: dict[str, float] = {}
    timings: dict[str, list[float]] = {}
    for group in known:
        for key, value in group.metrics.items():
            if key.endswith("_ms"):
                timings.setdefault(key, []).append(value)
            elif not key.endswith("/fraction"):
                sums[key] = sums.get(key, 0.0) + value
    out = dict(sums)
    for key, values in timings.items():
        out[f"{key}/mean"] = sum(values) / len(values)
        out[f"{key}/max"] = max(values)
    verified = sum(sums.get(f"terminal/{m}/count", 0.0) for m in TERMINAL_SELECTIONS)
    for method in TERMINAL_SELECTIONS:
        count = sums.get(f"terminal/{method}/count", 0.0)
        out[f"terminal/{method}/fraction"] = count / verified if verified else 0.0
    valid = sum(g.valid_row_count for g in known)
    total = sum(g.total_row_count for g in known)
    out["groups/total"] = float(len(groups))
    out["groups/unknown_outcome"] = float(len(groups) - len(known))
    out["rows/valid_fraction"] = valid / total if total else 0.0
    return out
