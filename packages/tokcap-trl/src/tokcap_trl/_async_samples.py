"""One group's verified training rows as TRL ``RolloutSample``s (pure, no I/O).

What each field is, for ``AsyncGRPOTrainer``'s loss (``coef = exp(logp - old_log_probs)``,
clipped, times ``advantage``, over ``completion_mask``):

- ``input_ids``: the row's ids, exactly what the engine saw and produced (reassembled
  from staged calls whose digests the receipt verified), never re-tokenised text;
- ``completion_mask``: the row's loss mask (1 exactly on generated tokens; tool and user
  turns of a multi-turn rollout are 0);
- ``old_log_probs``: the engine's sampled-token logprobs, aligned to ``input_ids`` (0.0
  where the mask is 0): the behaviour policy that really sampled each token;
- ``advantage``: `tokcap_core.grpo` over the group (sample std, mask-aware: a poisoned
  rollout neither gets an advantage nor moves the others'; a rollout's segments share
  one);
- ``model_version``: TRL's number for the oldest weights that sampled any of the row's
  tokens (the row's ``weight_version_min``, mapped by `PolicyVersions`), so TRL's
  ``max_staleness`` drops what it should;
- ``group_id``: the int the worker gave the group.

Tensors are torch's (int64, int64, float32); TRL's consumers use only ``len``,
``.sum()`` and ``.tolist()`` on them, as on the numpy arrays its own worker makes.
Placeholder rows (poisoned rollouts) become no sample: they are counted by reason bucket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tokcap_core import TrainingRow, grpo

__all__ = ["GroupSamples", "group_samples"]

BEFORE_TRAINING = "sampled_before_training"
"""A valid row sampled by weights older than TRL's version 0 (gates pushed to elsewhere)."""


@dataclass(frozen=True, slots=True)
class GroupSamples:
    """What one group gave TRL: its samples and what was left out, by reason bucket."""

    samples: list[Any]
    left_out: dict[str, int] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    """The rewards of the rows that became samples."""


def group_samples(
    rows: Sequence[TrainingRow],
    *,
    group_id: int,
    base_version: int,
    prompt: Sequence[Mapping[str, Any]],
    sample_type: Any,
) -> GroupSamples:
    """``rows`` (one group's, placeholders included) as ``sample_type`` instances (TRL's
    ``RolloutSample``); ``base_version`` is the gates' version that is TRL's version 0."""
    valid_N = [row.sample_mask == 1 for row in rows]
    rewards_N = [row.reward if row.reward is not None else 0.0 for row in rows]
    advantages_N = grpo(
        rewards_N,
        [group_id] * len(rows),
        valid_N,
        rollout_ids_N=[row.rollout_id for row in rows],
    )
    left_out: dict[str, int] = {}
    samples: list[Any] = []
    rewards: list[float] = []
    for row, valid, reward, advantage in zip(rows, valid_N, rewards_N, advantages_N, strict=True):
        if not valid:
            bucket = row.reason_bucket or "unknown"
            left_out[bucket] = left_out.get(bucket, 0) + 1
            continue
        assert row.weight_version_min is not None  # a valid row has generated tokens
        version = row.weight_version_min - base_version
        if version < 0:
            left_out[BEFORE_TRAINING] = left_out.get(BEFORE_TRAINING, 0) + 1
            continue
        samples.append(
            sample_type(
                prompt=list(prompt),
                completion=[],
                input_ids=torch.tensor(row.input_ids, dtype=torch.int64),
                completion_mask=torch.tensor(row.loss_mask, dtype=torch.int64),
                old_log_probs=torch.tensor(row.logprobs, dtype=torch.float32),
                advantage=float(advantage),
                model_version=version,
                group_id=group_id,
                metrics={"reward": float(reward)},
            )
        )
        rewards.append(float(reward))
    return GroupSamples(samples, left_out, rewards)
