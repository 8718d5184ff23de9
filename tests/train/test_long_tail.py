"""The ``long-tail`` task's shape (`tokcap.loop.long_tail_shape`): seeded, bounded, heavy-tailed.

Four rollouts in five make 1 or 2 calls of the run's ``max_tokens``; the fifth makes 6 to
10 calls of four times as many tokens. The engine-run half (the async loop on this task,
every receipt verified within the staleness bound) is in tests/e2e/test_train.py.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from tokcap.loop import TASKS, LoopConfig, long_tail_shape

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
