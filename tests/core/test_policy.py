"""decide_group: the controller's accept / replace / drop rule, edge by edge."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokcap_core import ConfigError
from tokcap_core.rpc import Accept, Drop, FinalizedGroup, Replace, decide_group


def group(
    *, rollouts: int = 4, failed: int = 0, extra_valid_rows: int = 0, outcome: str = "published"
) -> FinalizedGroup:
    """``rollouts`` rollouts, the first ``failed`` of them invalid (one placeholder row each)."""
    ids = tuple(f"r{i}" for i in range(rollouts))
    valid = rollouts - failed + extra_valid_rows
    total = rollouts + extra_valid_rows
    return FinalizedGroup(
        group_id="g",
        rollout_ids=ids,
        valid_row_count=valid,
        total_row_count=total,
        training_keys=tuple(f"t/g/{i}" for i in range(total)),
        staging_keys=(),
        staging_cleared=True,
        weight_version_min=0 if valid else None,
        weight_version_max=1 if valid else None,
        failures=tuple((rid, "no_terminal") for rid in ids[:failed]),
        metrics={},
        outcome=outcome,  # type: ignore[arg-type]
    )


def test_a_fully_valid_group_is_accepted_with_reason_ok() -> None:
    assert decide_group(group(), 0.5) == Accept(group_id="g", reason="ok")


def test_the_fraction_threshold_is_inclusive() -> None:
    assert isinstance(decide_group(group(rollouts=4, failed=2), 0.5), Accept)
    assert decide_group(group(rollouts=4, failed=3), 0.5) == Replace(
        group_id="g", reason="too_few_valid"
    )


def test_an_exact_decimal_threshold_is_met_by_the_matching_fraction() -> None:
    # 7/10 and 0.7 round to the same float, so the boundary group is accepted.
    assert isinstance(decide_group(group(rollouts=10, failed=3), 0.7), Accept)


def test_one_valid_rollout_has_no_baseline_even_at_fraction_zero() -> None:
    decision = decide_group(group(rollouts=4, failed=3), 0.0)
    assert decision == Replace(group_id="g", reason="too_few_valid")


def test_a_group_of_one_rollout_is_never_accepted() -> None:
    assert isinstance(decide_group(group(rollouts=1), 0.0), Replace)


def test_segments_of_one_rollout_count_once_for_the_baseline() -> None:
    # one valid rollout with three valid segment rows: three valid rows, still no baseline
    decision = decide_group(group(rollouts=2, failed=1, extra_valid_rows=2), 0.0)
    assert decision.reason == "too_few_valid"


def test_no_valid_row_is_too_few() -> None:
    assert decide_group(group(rollouts=3, failed=3), 0.0).reason == "too_few_valid"


def test_an_unknown_outcome_is_replaced_whatever_its_counts() -> None:
    decision = decide_group(group(outcome="unknown"), 0.0)
    assert decision == Replace(group_id="g", reason="unknown_outcome")


def test_without_replacement_rejections_are_drops_with_the_same_reason() -> None:
    assert decide_group(group(outcome="unknown"), 0.5, allow_replace=False) == Drop(
        group_id="g", reason="unknown_outcome"
    )
    assert decide_group(group(failed=4), 0.5, allow_replace=False) == Drop(
        group_id="g", reason="too_few_valid"
    )
    assert isinstance(decide_group(group(), 0.5, allow_replace=False), Accept)


@pytest.mark.parametrize("bad", [-0.01, 1.01, float("nan"), float("inf"), True, "0.5", None])
def test_min_valid_fraction_outside_zero_one_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError) as e:
        decide_group(group(), bad)  # type: ignore[arg-type]
    assert e.value.code == "bad_min_valid_fraction"


def test_a_bad_fraction_is_reported_even_for_an_unknown_outcome() -> None:
    with pytest.raises(ConfigError):
        decide_group(group(outcome="unknown"), 2.0)


@pytest.mark.parametrize("edge", [0, 0.0, 1, 1.0])
def test_the_bounds_themselves_are_allowed(edge: float) -> None:
    assert isinstance(decide_group(group(), edge), Accept)


groups = st.integers(1, 12).flatmap(
    lambda n: st.builds(
        group,
        rollouts=st.just(n),
        failed=st.integers(0, n),
        extra_valid_rows=st.integers(0, 3),
        outcome=st.sampled_from(["published", "unknown"]),
    )
)
fractions = st.floats(0.0, 1.0)


@given(groups, fractions)
def test_accept_exactly_when_published_enough_and_two_valid(g: FinalizedGroup, m: float) -> None:
    accepted = isinstance(decide_group(g, m), Accept)
    enough = g.valid_row_count / g.total_row_count >= m
    two = g.valid_rollout_count >= 2 and g.valid_row_count >= 2
    assert accepted == (g.outcome == "published" and enough and two)


@given(groups, fractions, fractions)
def test_raising_the_threshold_never_turns_a_rejection_into_an_accept(
    g: FinalizedGroup, a: float, b: float
) -> None:
    low, high = sorted((a, b))
    if isinstance(decide_group(g, high), Accept):
        assert isinstance(decide_group(g, low), Accept)


@given(groups, fractions)
def test_allow_replace_only_chooses_between_replace_and_drop(g: FinalizedGroup, m: float) -> None:
    with_replace = decide_group(g, m)
    without = decide_group(g, m, allow_replace=False)
    assert with_replace.reason == without.reason
    assert isinstance(with_replace, Accept) == isinstance(without, Accept)
    assert not isinstance(with_replace, Drop)
    assert not isinstance(without, Replace)
