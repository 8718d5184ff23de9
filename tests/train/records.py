"""Train-step records and the printed summary, for the summary tests (no engine)."""

from __future__ import annotations

import io
from dataclasses import replace
from typing import Any

from rich.console import Console

from tokcap.loop import StepRecord, print_train_summary

__all__ = ["FRESH", "clean_step", "printed"]

FRESH = {"tokens": 10, "mean_abs": 1e-8, "max_abs": 1e-7, "k3": 1e-14}
"""Parity at float noise: the trainer's logprobs are the engine's."""


def clean_step(step: int, **changes: Any) -> StepRecord:
    """Step ``step`` of a clean sync run (version ``step`` sampled, ``step + 1`` pushed; 8
    verified rows, 80 tokens, 2 groups; parity `FRESH`), with ``changes`` applied."""
    record = StepRecord(
        step=step, reward_mean=0.5, reward_max=1.0, parity=dict(FRESH),
        sampled_version=step, weight_version=step + 1, engine_version=str(step + 1),
        staleness_max=0, rows_valid=8, rows_placeholder=0, receipts_verified=8,
        receipts_total=8, gate_versions=(), groups_accepted=2, tokens=80,
        loss=0.1, clip_fraction=0.0, grad_norm=1.0, seconds={"total": 1.0},
    )  # fmt: skip
    return replace(record, **changes)


def printed(summary: dict[str, Any], width: int = 120) -> str:
    """What `print_train_summary` prints of ``summary`` on a terminal ``width`` wide."""
    out = io.StringIO()
    print_train_summary(summary, Console(file=out, width=width))
    return out.getvalue()
