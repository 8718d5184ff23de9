"""The async loop's staleness rules without an engine: admission, the group check, skips,
provenance, the lag watch. A hypothesis simulation drives the two pumps' bookkeeping."""

from __future__ import annotations

from array import array
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcap.loop import (
    STALE,
    DigitsEpisode,
    LagWatch,
    LoopError,
    SkipCount,
    StalenessPolicy,
    provenance,
)
from tokcap_core import ConfigError, TrainingRow, placeholder_row
from tokcap_core.rows import CallSpan


def row(spans: list[tuple[int, int, int]], *, name: str = "r") -> TrainingRow:
    """A valid row of calls ``(gen_len, first_version, last_version)``, one carried token each."""
    ids: list[int] = []
    mask: list[int] = []
    call_spans = []
    for n, (gen, first, last) in enumerate(spans):
        call_spans.append(
            CallSpan(
                call_id=f"c{n}",
                start=len(ids),
                carry_len=1,
                gen_len=gen,
                weight_version=first,
                weight_version_last=last,
            )
        )
        ids += [1] * (1 + gen)
        mask += [0] + [1] * gen
    return TrainingRow(
        rollout_id=name,
        segment=0,
        input_ids=array("I", ids),
        loss_mask=array("B", mask),
        logprobs=array("f", [0.0] * len(ids)),
        routes=None,
        prompt_len=1,
        call_spans=tuple(call_spans),
        weight_version_min=min(s[1] for s in spans),
        weight_version_max=max(s[2] for s in spans),
        truncated=False,
        reward=0.0,
        sample_mask=1,
        reason=None,
        terminal_call_id=f"c{len(spans) - 1}",
    )


# ---- admission -----------------------------------------------------------------------------


@given(
    k=st.integers(0, 4),
    g=st.integers(1, 6),
    live=st.integers(0, 60),
    done=st.integers(0, 10),
)
def test_admission_is_exactly_the_groups_that_train_within_k_steps(
    k: int, g: int, live: int, done: int
) -> None:
    policy = StalenessPolicy(max_staleness=k, groups_per_step=g, max_skipped=0)
    # the next group's position is `live`; taken in order it trains in step live // g
    assert policy.may_start(live=live, steps_done=done) == (live // g - done <= k)


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(0, 3),
    g=st.integers(1, 4),
    steps=st.integers(1, 6),
    in_order=st.booleans(),
    choices=st.lists(st.integers(0, 1_000), max_size=300),
)
def test_a_simulated_run_never_trains_beyond_k_and_in_order_never_drops(
    k: int, g: int, steps: int, in_order: bool, choices: list[int]
) -> None:
    """The pumps' bookkeeping, event by event: the rollout pump starts a group if admitted;
    a group in flight finishes (the oldest, or any); the train pump judges the oldest READY
    group at the trainer's version, and trains once it holds G."""
    policy = StalenessPolicy(max_staleness=k, groups_per_step=g, max_skipped=10_000)
    skips = SkipCount(policy.max_skipped)
    live = done = 0  # live: groups started and not discarded, trained ones included
    playing: list[int] = []  # the version each group in flight started at
    ready: deque[int] = deque()
    batch: list[int] = []
    trained: list[int] = []  # the staleness of every trained group
    moves = iter(choices)
    for tick in range(10_000):
        if done == steps:
            break
        choice = next(moves, tick)
        if choice % 3 == 0 and policy.may_start(live=live, steps_done=done):
            live += 1
            playing.append(done)
        elif choice % 3 == 1 and playing:
            ready.append(playing.pop(0 if in_order else choice % len(playing)))
        elif choice % 3 == 2 and ready:
            version = ready.popleft()
            if policy.judge([row([(1, version, version)])], done) == STALE:
                live -= 1
                skips.skip(STALE)
            else:
                batch.append(done - version)
            if len(batch) == g:
                trained += batch
                batch, done = [], done + 1
    assert done == steps
    assert all(0 <= s <= k for s in trained)
    if in_order:
        assert skips.total == 0


def test_the_policy_refuses_bad_settings() -> None:
    with pytest.raises(ConfigError) as info:
        StalenessPolicy(max_staleness=-1, groups_per_step=1, max_skipped=0)
    assert info.value.code == "bad_max_staleness"
    with pytest.raises(ConfigError) as info:
        StalenessPolicy(max_staleness=0, groups_per_step=0, max_skipped=0)
    assert info.value.code == "bad_groups_per_step"


# ---- the group check -----------------------------------------------------------------------


def test_a_group_is_stale_past_k_not_at_k() -> None:
    policy = StalenessPolicy(max_staleness=2, groups_per_step=1, max_skipped=0)
    fresh, at_k, past_k = row([(3, 5, 5)]), row([(3, 3, 4)]), row([(2, 2, 3), (2, 4, 4)])
    assert policy.judge([fresh], 5) is None
    assert policy.judge([fresh, at_k], 5) is None
    assert policy.judge([fresh, at_k, past_k], 5) == STALE  # one row makes the group stale


def test_placeholders_never_make_a_group_stale() -> None:
    policy = StalenessPolicy(max_staleness=0, groups_per_step=1, max_skipped=0)
    assert policy.judge([placeholder_row("x", "stage_failed:y")], 9) is None
    assert policy.judge([placeholder_row("x", "stage_failed:y"), row([(1, 9, 9)])], 9) is None


def test_skips_are_counted_by_reason_up_to_the_bound() -> None:
    skips = SkipCount(2)
    skips.skip(STALE)
    skips.skip("too_few_valid")
    assert (skips.total, dict(skips.reasons)) == (2, {STALE: 1, "too_few_valid": 1})
    with pytest.raises(LoopError) as info:
        skips.skip(STALE)
    assert info.value.code == "too_many_skipped"
    assert "stale 2" in info.value.message


# ---- provenance ----------------------------------------------------------------------------


def test_provenance_counts_tokens_by_staleness_and_calls_across_a_push() -> None:
    rows = [
        row([(4, 3, 3), (2, 4, 5)]),  # the second call spans a push
        row([(5, 5, 5)]),
        placeholder_row("x", "stage_failed:y"),
    ]
    origin = provenance(rows, 5)
    assert origin.tokens_by_staleness == {0: 5, 1: 2, 2: 4}
    assert (origin.staleness_max, origin.tokens_stale, origin.calls_spanning_versions) == (2, 6, 1)


def test_provenance_of_no_valid_row_is_empty() -> None:
    origin = provenance([placeholder_row("x", "stage_failed:y")], 3)
    assert (origin.staleness_max, origin.tokens_stale, origin.calls_spanning_versions) == (
        None,
        0,
        0,
    )


def test_the_lag_watch_keeps_the_window_and_run_maxima() -> None:
    watch = LagWatch()
    watch.note(3.0)
    watch.note(1.0)
    assert watch.take() == 3.0
    watch.note(2.0)
    assert (watch.take(), watch.take(), watch.run_ms) == (2.0, 0.0, 3.0)


def test_a_content_witness_repeating_an_earlier_answer_names_the_response_instead() -> None:
    episode = DigitsEpisode(rollout_id="r", group_id="g", witness="content", prompt="p")
    episode.contents = ["1111", "2222"]
    assert episode.scored == "content"
    episode.contents = ["1111", "1111"]  # one fingerprint, two calls: ambiguous at the gate
    assert episode.scored == "response_id"
    episode.witness = "none"
    assert episode.scored == "none"
