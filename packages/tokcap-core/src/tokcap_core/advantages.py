"""Group-baseline advantage estimators over per-row rewards (pure, stdlib only).

Every estimator takes ``rewards_N``, ``group_ids_N`` and ``valid_N`` (one entry
per training row) and returns one advantage per row. Statistics are taken per
*rollout*, not per row: rows sharing an id in ``rollout_ids_N`` (segments of one
rollout) count once in their group and all get that rollout's advantage; without
rollout ids each row is its own rollout. Laws shared by every estimator:

- an invalid row gets exactly ``0.0``, and its reward never reaches any statistic;
- a group with at most one valid rollout, or whose valid rewards are all equal,
  gives ``0.0`` on every row; no estimator ever returns ``-0.0``;
- empty input gives ``[]``; permuting rows permutes the output bit-for-bit,
  because every sum is a ``math.fsum`` (exact, hence order-independent).

Rewards are assumed to be of ordinary magnitude (their squares must not overflow).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple

from tokcap_core._errors import TokcapError

__all__ = [
    "AdvantageInputError",
    "dr_grpo",
    "grpo",
    "masked_mean",
    "reinforce_pp",
    "rloo",
]


class AdvantageInputError(TokcapError, ValueError):
    """Bad estimator input: mismatched lengths, a non-finite number, a bad flag or parameter."""


class _Rollout(NamedTuple):
    group_id: Hashable
    reward: float
    valid: bool


def _rollouts(
    rewards_N: Sequence[float],
    group_ids_N: Sequence[Hashable],
    valid_N: Sequence[bool | int],
    rollout_ids_N: Sequence[Hashable] | None,
) -> tuple[list[Hashable], dict[Hashable, _Rollout]]:
    """Validate the rows and fold them into one record per rollout: (key per row, records)."""
    columns = [group_ids_N, valid_N] + ([] if rollout_ids_N is None else [rollout_ids_N])
    if any(len(column) != len(rewards_N) for column in columns):
        lengths = [len(rewards_N)] + [len(column) for column in columns]
        raise AdvantageInputError(
            "length_mismatch", f"per-row sequences differ in length: {lengths}"
        )
    keys_N: list[Hashable] = (
        list(range(len(rewards_N))) if rollout_ids_N is None else list(rollout_ids_N)
    )
    records: dict[Hashable, _Rollout] = {}
    for key, reward, group_id, flag in zip(keys_N, rewards_N, group_ids_N, valid_N, strict=True):
        if not math.isfinite(reward):
            raise AdvantageInputError("non_finite_reward", f"reward {reward!r} of rollout {key!r}")
        if flag not in (0, 1):
            raise AdvantageInputError("bad_valid_flag", f"valid flag {flag!r} is not a bool or 0/1")
        record = _Rollout(group_id, float(reward), bool(flag))
        if records.setdefault(key, record) != record:
            raise AdvantageInputError(
                "inconsistent_rollout",
                f"rows of rollout {key!r} disagree: {records[key]} vs {record}",
            )
    return keys_N, records


def _valid_members(
    records: dict[Hashable, _Rollout],
) -> dict[Hashable, list[tuple[Hashable, float]]]:
    """Group the valid rollouts: group id -> [(rollout key, reward)]."""
    groups: dict[Hashable, list[tuple[Hashable, float]]] = {}
    for key, record in records.items():
        if record.valid:
            groups.setdefault(record.group_id, []).append((key, record.reward))
    return groups


def _is_degenerate(rewards: list[float]) -> bool:
    # Equal rewards are special-cased: fsum(rewards) / n need not give back the reward exactly.
    return len(rewards) < 2 or min(rewards) == max(rewards)


def _sample_std(values: list[float], mean: float) -> float:
    return math.sqrt(math.fsum((value - mean) ** 2 for value in values) / (len(values) - 1))


def _check_eps(eps: float) -> None:
    if not (math.isfinite(eps) and eps > 0):
        raise AdvantageInputError("bad_eps", f"eps must be finite and > 0, got {eps!r}")


def _per_row(keys_N: list[Hashable], advantage_by_key: dict[Hashable, float]) -> list[float]:
    # `+ 0.0` turns -0.0 (e.g. reward -0.0 minus baseline 0.0) into 0.0.
    return [advantage_by_key.get(key, 0.0) + 0.0 for key in keys_N]


def grpo(
    rewards_N: Sequence[float],
    group_ids_N: Sequence[Hashable],
    valid_N: Sequence[bool | int],
    *,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    rollout_ids_N: Sequence[Hashable] | None = None,
    eps: float = 1e-6,
) -> list[float]:
    """GRPO: ``(r - baseline) / (std + eps)`` over each group's n valid rollouts.

    The baseline is the group mean, or with ``leave_one_out`` the mean of the
    other n-1 rollouts; std is the sample (n-1) std of the group's rewards,
    skipped when ``normalize_std`` is false. Empty in, empty out; a group with one
    valid rollout, or all-equal rewards, gives 0.0.
    """
    _check_eps(eps)
    keys_N, records = _rollouts(rewards_N, group_ids_N, valid_N, rollout_ids_N)
    advantage_by_key: dict[Hashable, float] = {}
    for members in _valid_members(records).values():
        rewards = [reward for _, reward in members]
        if _is_degenerate(rewards):
            continue
        n, total = len(rewards), math.fsum(rewards)
        mean = total / n
        scale = _sample_std(rewards, mean) + eps if normalize_std else 1.0
        for key, reward in members:
            baseline = (total - reward) / (n - 1) if leave_one_out else mean
            advantage_by_key[key] = (reward - baseline) / scale
    return _per_row(keys_N, advantage_by_key)


def rloo(
    rewards_N: Sequence[float],
    group_ids_N: Sequence[Hashable],
    valid_N: Sequence[bool | int],
    *,
    rollout_ids_N: Sequence[Hashable] | None = None,
) -> list[float]:
    """RLOO: ``r - mean(other valid rollouts of the group)``, no std normalisation.

    Empty in, empty out; a group with one valid rollout, or all-equal rewards, gives 0.0.
    """
    return grpo(
        rewards_N,
        group_ids_N,
        valid_N,
        normalize_std=False,
        leave_one_out=True,
        rollout_ids_N=rollout_ids_N,
    )


def dr_grpo(
    rewards_N: Sequence[float],
    group_ids_N: Sequence[Hashable],
    valid_N: Sequence[bool | int],
    *,
    rollout_ids_N: Sequence[Hashable] | None = None,
) -> list[float]:
    """Dr. GRPO: ``r - mean(valid rollouts of the group)``, no std normalisation.

    Empty in, empty out; a group with one valid rollout, or all-equal rewards, gives 0.0.
    """
    return grpo(rewards_N, group_ids_N, valid_N, normalize_std=False, rollout_ids_N=rollout_ids_N)


def reinforce_pp(
    rewards_N: Sequence[float],
    group_ids_N: Sequence[Hashable],
    valid_N: Sequence[bool | int],
    *,
    rollout_ids_N: Sequence[Hashable] | None = None,
    eps: float = 1e-6,
) -> list[float]:
    """REINFORCE++ with group baseline: ``c / (global_std + eps)``, ``c = r - group mean``.

    ``c`` is 0.0 for a rollout whose group has one valid rollout or all-equal
    rewards. ``global_std = sqrt(sum(c**2) / (m - 1))`` over all m valid rollouts
    of the batch, about zero (group-centred values already have mean zero, so the
    batch is not re-centred; that keeps lone groups at exactly 0.0). Invalid
    rollouts never enter it. Empty in, empty out; fewer than two valid rollouts give all 0.0.
    """
    _check_eps(eps)
    keys_N, records = _rollouts(rewards_N, group_ids_N, valid_N, rollout_ids_N)
    centred_by_key: dict[Hashable, float] = {}
    for members in _valid_members(records).values():
        rewards = [reward for _, reward in members]
        degenerate = _is_degenerate(rewards)
        mean = 0.0 if degenerate else math.fsum(rewards) / len(rewards)
        for key, reward in members:
            centred_by_key[key] = 0.0 if degenerate else reward - mean
    if len(centred_by_key) < 2:
        return _per_row(keys_N, {})
    scale = _sample_std(list(centred_by_key.values()), 0.0) + eps
    return _per_row(keys_N, {key: centred / scale for key, centred in centred_by_key.items()})


def masked_mean(values_N: Sequence[float], weights_N: Sequence[float]) -> float:
    """``sum(w * v) / sum(w)`` over rows with nonzero weight (e.g. train/reward over valid rows).

    Returns 0.0 when the weight sum is 0 (empty input, all rows masked). Rows with
    weight 0 are skipped, so their values may be anything, even NaN. Weights must
    be finite and >= 0; values with nonzero weight must be finite.
    """
    if len(values_N) != len(weights_N):
        raise AdvantageInputError(
            "length_mismatch", f"{len(values_N)} values vs {len(weights_N)} weights"
        )
    pairs = [
        (float(value), float(weight))
        for value, weight in zip(values_N, weights_N, strict=True)
        if weight != 0
    ]
    for value, weight in pairs:
        if not (math.isfinite(weight) and weight > 0):
            raise AdvantageInputError("bad_weight", f"weight {weight!r} is not finite and >= 0")
        if not math.isfinite(value):
            raise AdvantageInputError("non_finite_value", f"value {value!r} has weight {weight!r}")
    weight_sum = math.fsum(weight for _, weight in pairs)
    if weight_sum == 0:
        return 0.0
    return math.fsum(value * weight for value, weight in pairs) / weight_sum
