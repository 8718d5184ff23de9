"""Advantage estimators: the laws every estimator obeys, then exact worked examples."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from functools import partial

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tokcap_core.advantages import (
    AdvantageInputError,
    dr_grpo,
    grpo,
    masked_mean,
    reinforce_pp,
    rloo,
)

Estimator = Callable[..., list[float]]

ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo,
    "grpo_no_std": partial(grpo, normalize_std=False),
    "grpo_loo": partial(grpo, leave_one_out=True),
    "grpo_loo_no_std": partial(grpo, normalize_std=False, leave_one_out=True),
    "rloo": rloo,
    "dr_grpo": dr_grpo,
    "reinforce_pp": reinforce_pp,
}
every_estimator = pytest.mark.parametrize("estimator", ESTIMATORS.values(), ids=ESTIMATORS.keys())
EPS = 1e-6
ZERO = (0.0).hex()


@dataclass(frozen=True)
class Batch:
    rewards_N: list[float]
    group_ids_N: list[Hashable]
    valid_N: list[bool | int]
    rollout_ids_N: list[str] | None

    def rollout_key(self, row: int) -> Hashable:
        return row if self.rollout_ids_N is None else self.rollout_ids_N[row]

    def rows_of(self, row: int) -> list[int]:
        """Every row of the rollout that `row` belongs to."""
        return [
            i for i in range(len(self.rewards_N)) if self.rollout_key(i) == self.rollout_key(row)
        ]


rewards = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 0.1, 0.2, 0.3, 1e-3, 1e6]),
    st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
)


@st.composite
def batches(draw: st.DrawFn, *, segmented: bool | None = None) -> Batch:
    """Rows of up to 12 rollouts in up to 4 groups, shuffled; segmented rollouts span 1-3 rows."""
    if segmented is None:
        segmented = draw(st.booleans())
    rows: list[tuple[float, Hashable, bool | int, str]] = []
    for index in range(draw(st.integers(0, 12))):
        group = draw(st.sampled_from(["g0", "g1", 2, 3]))
        rollout = (draw(rewards), group, draw(st.sampled_from([True, False, 1, 0])))
        rows += [(*rollout, f"r{index}")] * (draw(st.integers(1, 3)) if segmented else 1)
    rows = [rows[i] for i in draw(st.permutations(range(len(rows))))]
    return Batch(
        rewards_N=[row[0] for row in rows],
        group_ids_N=[row[1] for row in rows],
        valid_N=[row[2] for row in rows],
        rollout_ids_N=[row[3] for row in rows] if segmented else None,
    )


def run(estimator: Estimator, batch: Batch) -> list[float]:
    return estimator(
        batch.rewards_N, batch.group_ids_N, batch.valid_N, rollout_ids_N=batch.rollout_ids_N
    )


def bits(values: list[float]) -> list[str]:
    """Bit-for-bit view: tells -0.0 from 0.0."""
    return [value.hex() for value in values]


# --- Laws, for every estimator -------------------------------------------------


@every_estimator
@given(batch=batches())
def test_invalid_row_gets_exactly_zero(estimator: Estimator, batch: Batch) -> None:
    advantages_N = run(estimator, batch)
    assert [a.hex() for a, ok in zip(advantages_N, batch.valid_N, strict=True) if not ok] == [
        ZERO
    ] * batch.valid_N.count(False)


@every_estimator
@given(batch=batches(), data=st.data())
def test_invalid_row_reward_never_changes_other_rows(
    estimator: Estimator, batch: Batch, data: st.DataObject
) -> None:
    invalid_rows = [i for i, ok in enumerate(batch.valid_N) if not ok]
    assume(invalid_rows)
    row = data.draw(st.sampled_from(invalid_rows))
    new_reward = data.draw(st.floats(allow_nan=False, allow_infinity=False))
    changed = list(batch.rewards_N)
    for i in batch.rows_of(row):
        changed[i] = new_reward
    assert bits(run(estimator, replace(batch, rewards_N=changed))) == bits(run(estimator, batch))


@every_estimator
@given(batch=batches())
def test_group_with_at_most_one_valid_rollout_is_all_zero(
    estimator: Estimator, batch: Batch
) -> None:
    advantages_N = run(estimator, batch)
    for group in set(batch.group_ids_N):
        rows = [i for i, g in enumerate(batch.group_ids_N) if g == group]
        if len({batch.rollout_key(i) for i in rows if batch.valid_N[i]}) <= 1:
            assert [advantages_N[i].hex() for i in rows] == [ZERO] * len(rows)


@every_estimator
@given(batch=batches(segmented=True), data=st.data())
def test_extra_segment_of_a_rollout_counts_once_and_shares_its_advantage(
    estimator: Estimator, batch: Batch, data: st.DataObject
) -> None:
    assume(batch.rewards_N)
    n = len(batch.rewards_N)
    row, at = data.draw(st.integers(0, n - 1)), data.draw(st.integers(0, n))
    assert batch.rollout_ids_N is not None

    def with_copy(column: list[object]) -> list[object]:
        return [*column[:at], column[row], *column[at:]]

    columns = (batch.rewards_N, batch.group_ids_N, batch.valid_N, batch.rollout_ids_N)
    duplicated = Batch(*(with_copy(column) for column in columns))  # type: ignore[arg-type]
    before_N, after_N = run(estimator, batch), run(estimator, duplicated)
    assert bits(after_N[:at] + after_N[at + 1 :]) == bits(before_N)
    assert after_N[at].hex() == before_N[row].hex()


@every_estimator
@given(batch=batches(), data=st.data())
def test_permuting_rows_permutes_advantages_exactly(
    estimator: Estimator, batch: Batch, data: st.DataObject
) -> None:
    order = data.draw(st.permutations(range(len(batch.rewards_N))))

    def permuted(column: list[object] | None) -> list[object] | None:
        return None if column is None else [column[i] for i in order]

    columns = (batch.rewards_N, batch.group_ids_N, batch.valid_N, batch.rollout_ids_N)
    shuffled = Batch(*(permuted(column) for column in columns))  # type: ignore[arg-type]
    assert bits(run(estimator, shuffled)) == bits([run(estimator, batch)[i] for i in order])


@every_estimator
@given(batch=batches(), reward=rewards, data=st.data())
def test_all_equal_rewards_in_a_group_give_exact_zero(
    estimator: Estimator, batch: Batch, reward: float, data: st.DataObject
) -> None:
    assume(batch.group_ids_N)
    group = data.draw(st.sampled_from(batch.group_ids_N))
    rows = [i for i, g in enumerate(batch.group_ids_N) if g == group]
    equal = [reward if i in rows else r for i, r in enumerate(batch.rewards_N)]
    advantages_N = run(estimator, replace(batch, rewards_N=equal))
    assert [advantages_N[i].hex() for i in rows] == [ZERO] * len(rows)


@every_estimator
def test_empty_input_gives_empty_output(estimator: Estimator) -> None:
    assert estimator([], [], []) == []
    assert estimator([], [], [], rollout_ids_N=[]) == []


@every_estimator
@pytest.mark.parametrize(
    ("rewards_N", "group_ids_N", "valid_N", "rollout_ids_N"),
    [
        ([1.0, 0.0], ["g"], [1, 1], None),
        ([1.0], ["g"], [1, 1], None),
        ([1.0, 0.0], ["g", "g"], [1, 1], ["a"]),
    ],
)
def test_length_mismatch_raises(
    estimator: Estimator,
    rewards_N: list[float],
    group_ids_N: list[str],
    valid_N: list[int],
    rollout_ids_N: list[str] | None,
) -> None:
    with pytest.raises(AdvantageInputError) as caught:
        estimator(rewards_N, group_ids_N, valid_N, rollout_ids_N=rollout_ids_N)
    assert caught.value.code == "length_mismatch"


@every_estimator
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("valid", [True, False])
def test_non_finite_reward_raises_even_on_an_invalid_row(
    estimator: Estimator, bad: float, valid: bool
) -> None:
    with pytest.raises(AdvantageInputError) as caught:
        estimator([1.0, bad], ["g", "g"], [True, valid])
    assert caught.value.code == "non_finite_reward"


@every_estimator
@pytest.mark.parametrize(
    ("rewards_N", "group_ids_N", "valid_N"),
    [
        ([1.0, 0.0], ["g", "g"], [1, 1]),
        ([1.0, 1.0], ["g", "g"], [1, 0]),
        ([1.0, 1.0], ["g", "h"], [1, 1]),
    ],
    ids=["reward", "validity", "group"],
)
def test_segments_of_one_rollout_that_disagree_raise(
    estimator: Estimator, rewards_N: list[float], group_ids_N: list[str], valid_N: list[int]
) -> None:
    with pytest.raises(AdvantageInputError) as caught:
        estimator(rewards_N, group_ids_N, valid_N, rollout_ids_N=["a", "a"])
    assert caught.value.code == "inconsistent_rollout"


@every_estimator
@pytest.mark.parametrize("flag", [2, 0.5, "1", None])
def test_valid_flag_must_be_bool_or_0_1(estimator: Estimator, flag: object) -> None:
    with pytest.raises(AdvantageInputError) as caught:
        estimator([1.0, 0.0], ["g", "g"], [1, flag])
    assert caught.value.code == "bad_valid_flag"


@pytest.mark.parametrize("estimator", [grpo, reinforce_pp])
@pytest.mark.parametrize("eps", [0.0, -1e-6, math.nan, math.inf])
def test_eps_must_be_finite_and_positive(estimator: Estimator, eps: float) -> None:
    with pytest.raises(AdvantageInputError) as caught:
        estimator([1.0, 0.0], ["g", "g"], [1, 1], eps=eps)
    assert caught.value.code == "bad_eps"


# --- Worked examples, exact numbers --------------------------------------------


def test_grpo_divides_by_the_sample_std_of_the_group() -> None:
    a = 0.5 / (math.sqrt(1 / 3) + EPS)
    assert grpo([1.0, 0.0, 0.0, 1.0], ["g"] * 4, [1, 1, 1, 1]) == [a, -a, -a, a]


def test_invalid_row_is_left_out_of_its_groups_statistics() -> None:
    rewards_N, group_ids_N, valid_N = [2.0, 0.0, 1.0, 99.0], ["g"] * 4, [1, 1, 1, 0]
    # Statistics of the three valid rows: mean 1, sample std 1.
    assert grpo(rewards_N, group_ids_N, valid_N) == [1 / (1 + EPS), -1 / (1 + EPS), 0.0, 0.0]
    assert dr_grpo(rewards_N, group_ids_N, valid_N) == [1.0, -1.0, 0.0, 0.0]
    assert rloo(rewards_N, group_ids_N, valid_N) == [1.5, -1.5, 0.0, 0.0]
    assert grpo(rewards_N, group_ids_N, valid_N, leave_one_out=True) == [
        1.5 / (1 + EPS),
        -1.5 / (1 + EPS),
        0.0,
        0.0,
    ]


def test_prior_art_segments_do_not_inflate_the_baseline() -> None:
    """slime #1918: a rollout fanned out into three rows made the baseline 0.75 instead of 0.5."""
    rewards_N, group_ids_N, valid_N = [1.0, 1.0, 1.0, 0.0], ["g"] * 4, [1, 1, 1, 1]
    assert dr_grpo(rewards_N, group_ids_N, valid_N, rollout_ids_N=["a", "a", "a", "b"]) == [
        0.5,
        0.5,
        0.5,
        -0.5,
    ]
    # Without rollout ids each row is its own rollout, and the baseline is 0.75.
    assert dr_grpo(rewards_N, group_ids_N, valid_N) == [0.25, 0.25, 0.25, -0.75]


def test_reinforce_pp_centres_per_group_then_divides_by_the_batch_std() -> None:
    rewards_N = [1.0, 0.0, 3.0, 3.0, 5.0, 50.0]
    group_ids_N = ["a", "a", "b", "b", "c", "a"]
    # Centred values of the 5 valid rollouts: 0.5, -0.5, 0, 0, 0 -> std = sqrt(0.5 / 4).
    a = 0.5 / (math.sqrt(0.125) + EPS)
    assert reinforce_pp(rewards_N, group_ids_N, [1, 1, 1, 1, 1, 0]) == [a, -a, 0.0, 0.0, 0.0, 0.0]


@every_estimator
def test_never_returns_negative_zero(estimator: Estimator) -> None:
    # Mean exactly 0.0, so the -0.0 reward's raw advantage would be -0.0 - 0.0 == -0.0.
    advantages_N = estimator([-1.0, 1.0, -0.0], ["g"] * 3, [1, 1, 1])
    assert advantages_N[2].hex() == ZERO


@every_estimator
def test_one_valid_row_gives_zero(estimator: Estimator) -> None:
    assert estimator([3.0], ["g"], [True]) == [0.0]
    assert estimator([3.0, 7.0], ["g", "g"], [True, False]) == [0.0, 0.0]


def test_masked_mean_weights_values_and_skips_weight_zero() -> None:
    assert masked_mean([1.0, 3.0, math.nan], [1, 3, 0]) == 2.5
    assert masked_mean([1.0, 2.0], [False, True]) == 2.0


@pytest.mark.parametrize(("values_N", "weights_N"), [([], []), ([5.0, 7.0], [0, 0])])
def test_masked_mean_is_zero_when_the_weight_sum_is_zero(
    values_N: list[float], weights_N: list[int]
) -> None:
    assert masked_mean(values_N, weights_N) == 0.0


@pytest.mark.parametrize(
    ("values_N", "weights_N", "code"),
    [
        ([1.0], [1, 1], "length_mismatch"),
        ([1.0, 2.0], [1, -1], "bad_weight"),
        ([1.0], [math.nan], "bad_weight"),
        ([math.inf], [1], "non_finite_value"),
    ],
)
def test_masked_mean_rejects_bad_input(
    values_N: list[float], weights_N: list[float], code: str
) -> None:
    with pytest.raises(AdvantageInputError) as caught:
        masked_mean(values_N, weights_N)
    assert caught.value.code == code
