"""The ``long-tail`` task's shape (`tokcap.loop.long_tail_shape`): seeded, bounded, heavy-tailed.

Four rollouts in five make 1 or 2 calls of the run's ``max_tokens``; the fifth makes 6 to
10 calls of four times as many tokens. The engine-run half (the async loop on this task,
every receipt verified within the staleness bound) is in tests/e2e/test_train.py. Each
step records the shapes it played, and the report draws them.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tokcap.loop import (
    TASKS,
    LoopConfig,
    StepRecord,
    TrainRun,
    build_train_summary,
    long_tail_shape,
    render_train_report,
)

SEEDS = st.integers(min_value=0, max_value=2**40)
MAX_TOKENS = st.integers(min_value=1, max_value=512)


@given(SEEDS, MAX_TOKENS)
def test_a_seed_always_gives_the_same_shape(seed: int, max_tokens: int) -> None:
    assert long_tail_shape(seed, max_tokens) == long_tail_shape(seed, max_tokens)


@given(SEEDS, MAX_TOKENS)
def test_a_rollout_is_short_or_in_the_tail_never_between(seed: int, max_tokens: int) -> None:
    calls, tokens = long_tail_shape(seed, max_tokens)
    assert (calls in (1, 2) and tokens == max_tokens) or (
        6 <= calls <= 10 and tokens == 4 * max_tokens
    )


def test_one_rollout_in_five_is_in_the_tail_and_every_length_is_played() -> None:
    shapes = [long_tail_shape(seed, 16) for seed in range(20_000)]
    calls = Counter(c for c, _ in shapes)
    assert set(calls) == {1, 2, 6, 7, 8, 9, 10}
    tail = sum(n for c, n in calls.items() if c >= 6) / len(shapes)
    assert 0.19 < tail < 0.21
    # the tail holds most of the work: far more tokens than its share of rollouts
    tokens = [c * t for c, t in shapes]
    tail_tokens = sum(c * t for c, t in shapes if c >= 6) / sum(tokens)
    assert tail_tokens > 0.7


def test_the_loop_takes_the_task_with_any_turns() -> None:
    assert "long-tail" in TASKS
    config = LoopConfig(model=Path("model"), task="long-tail", turns=1)
    assert config.task == "long-tail"


def _run(**shapes: Any) -> dict[str, Any]:
    """A two-step run's summary; ``shapes`` are extra `StepRecord` fields of both steps."""
    config = LoopConfig(model=Path("tiny"), steps=2, groups=1, rollouts=5, task="long-tail")
    run = TrainRun(config, params=10)
    record = functools.partial(
        StepRecord,
        reward_mean=0.5, reward_max=1.0, parity=PARITY, engine_version="1", staleness_max=0,
        rows_valid=5, rows_placeholder=0, receipts_verified=5, receipts_total=5,
        gate_versions=(), groups_accepted=1, tokens=80, loss=0.1, clip_fraction=0.0,
        grad_norm=1.0, **shapes,
    )  # fmt: skip
    run.steps = [
        record(
            step=step,
            sampled_version=step,
            weight_version=step + 1,
            seconds={"total": 2.0, "generate": 1.5, "in_flight": 3.5 - step},
        )
        for step in range(2)
    ]
    return build_train_summary(run, {})


PARITY = {"tokens": 10, "mean_abs": 1e-8, "max_abs": 1e-7, "k3": 1e-14}


def test_the_report_shows_the_shapes_played_and_the_engines_batch() -> None:
    summary = _run(calls_per_rollout={"1": 2, "2": 2, "8": 1}, row_tokens=(40, 41, 60, 62, 480))
    steps = summary["train"]["steps"]
    assert steps[0]["calls_per_rollout"] == {"1": 2, "2": 2, "8": 1}
    assert steps[1]["row_tokens"] == [40, 41, 60, 62, 480]
    page = render_train_report(summary)
    assert "Rollout shapes and the engine's batch" in page
    assert "1: 4 (40%)" in page
    assert "8: 2 (20%)" in page
    assert "calls in flight when busy" in page


def test_a_run_that_recorded_no_shapes_has_no_shapes_section() -> None:
    assert "Rollout shapes" not in render_train_report(_run())
