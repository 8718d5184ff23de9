"""Collected rollouts in the shape TRL's ``GRPOTrainer`` takes from a ``rollout_func``.

One row per rollout, in the order TRL asked (its prompts, each repeated
``num_generations`` times):

- ``prompt_ids``: the row's tokens before the first generated token (the prompt exactly
  as the engine saw it: chat template and all);
- ``completion_ids``: every token after it: the model's turns and, in a multi-turn
  rollout, the environment's turns between them;
- ``env_mask``: the row's loss mask over the completion: 1 on tokens the engine sampled,
  0 on the environment's (TRL multiplies it into its loss mask);
- ``logprobs``: the engine's sampled-token logprobs over the completion (0.0 where
  ``env_mask`` is 0). TRL recomputes logprobs itself; these reach its loss only through
  the off-policy mask (``off_policy_mask_threshold``) and its sampling metrics;
- extra keys, which TRL hands its reward functions as keyword arguments, one value per
  row: `REWARD_KEY` (the verified receipt's reward; None for an invalid rollout),
  `VALID_KEY`, `ROLLOUT_KEY`, `REASON_KEY`, `WEIGHT_VERSION_KEY` (the oldest weight
  version that sampled any of the row's tokens, from its verified calls).

An invalid rollout becomes a **dummy row** TRL cannot learn from: one pad token as prompt,
one pad token as completion, ``env_mask`` [0] (so every loss and KL term on it is
multiplied by 0), logprob 0.0, and reward None from `receipt_reward`: when every reward
function returns None for a row, TRL leaves it out of its group's mean and standard
deviation and sets its advantage to 0, so the dummy moves neither the gradient nor any
other row's advantage. (A reward function of your own that scores it anyway would move
its group's baseline: return None where ``tokcap_valid`` is False.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._collect import Collected

__all__ = [
    "METRICS_KEY",
    "REASON_KEY",
    "REWARD_KEY",
    "ROLLOUT_KEY",
    "VALID_KEY",
    "WEIGHT_VERSION_KEY",
    "receipt_reward",
    "trl_rollout_output",
]

REWARD_KEY = "tokcap_reward"
"""The extra key carrying each row's reward from its verified receipt (None: invalid)."""
VALID_KEY = "tokcap_valid"
"""The extra key saying whether each row is a verified rollout (False: a dummy row)."""
ROLLOUT_KEY = "tokcap_rollout_id"
"""The extra key carrying each row's rollout id (find it in the gates' ledgers)."""
REASON_KEY = "tokcap_reason"
"""The extra key carrying why a row is a dummy (None for a valid row)."""
WEIGHT_VERSION_KEY = "tokcap_weight_version"
"""The extra key carrying the oldest weight version that sampled the row (None: dummy)."""
METRICS_KEY = "tokcap_metrics"
"""The extra key carrying the batch's ``tokcap/...`` metrics (one dict, which TRL hands
every row): `receipt_reward` logs them through TRL's ``log_metric``."""


def trl_rollout_output(
    collected: Sequence[Collected], *, pad_token_id: int
) -> dict[str, list[Any]]:
    """The ``rollout_func`` return value for ``collected`` (see the module)."""
    out: dict[str, list[Any]] = {
        key: []
        for key in (
            "prompt_ids",
            "completion_ids",
            "logprobs",
            "env_mask",
            REWARD_KEY,
            VALID_KEY,
            ROLLOUT_KEY,
            REASON_KEY,
            WEIGHT_VERSION_KEY,
        )
    }
    for c in collected:
        row = c.row
        if c.valid:
            cut = row.prompt_len
            out["prompt_ids"].append(list(row.input_ids[:cut]))
            out["completion_ids"].append(list(row.input_ids[cut:]))
            out["logprobs"].append(list(row.logprobs[cut:]))
            out["env_mask"].append(list(row.loss_mask[cut:]))
        else:
            out["prompt_ids"].append([pad_token_id])
            out["completion_ids"].append([pad_token_id])
            out["logprobs"].append([0.0])
            out["env_mask"].append([0])
        out[REWARD_KEY].append(c.reward)
        out[VALID_KEY].append(c.valid)
        out[ROLLOUT_KEY].append(c.rollout_id)
        out[REASON_KEY].append(c.reason)
        out[WEIGHT_VERSION_KEY].append(row.weight_version_min if c.valid else None)
    return out


def receipt_reward(
    *,
    tokcap_reward: Sequence[float | None],
    tokcap_metrics: Sequence[Mapping[str, float]] = (),
    log_metric: Callable[[str, float], object] | None = None,
    **_: Any,
) -> list[float | None]:
    """A TRL reward function: each row's reward as its verified receipt records it (the
    score the harness closed the rollout with, read back from the gate's ledger), None for
    a dummy row (TRL then gives it advantage 0 and leaves it out of its group's baseline).
    Logs ``tokcap/valid_fraction`` and the batch's `METRICS_KEY` metrics through TRL's
    ``log_metric`` (TRL averages them over each logging step)."""
    if log_metric is not None and tokcap_reward:
        valid = sum(r is not None for r in tokcap_reward)
        log_metric("tokcap/valid_fraction", valid / len(tokcap_reward))
        for name, value in (tokcap_metrics[0] if tokcap_metrics else {}).items():
            log_metric(name, float(value))
    return [None if r is None else float(r) for r in tokcap_reward]
