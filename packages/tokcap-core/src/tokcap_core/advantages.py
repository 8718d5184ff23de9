"""Mask-aware advantage estimators: invalid rows never move a valid row's advantage."""

from ._advantages import (
    AdvantageInputError,
    dr_grpo,
    grpo,
    masked_mean,
    reinforce_pp,
    rloo,
)

__all__ = [
    "AdvantageInputError",
    "dr_grpo",
    "grpo",
    "masked_mean",
    "reinforce_pp",
    "rloo",
]
