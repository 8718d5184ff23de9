"""The report's inline SVG plots (pure functions, no engine): every value drawn, nothing
fetched, empty input handled."""

from __future__ import annotations

import re

from tokcap.demo import group_strips, histogram


def test_group_strips_draw_one_dot_per_value_and_one_mean_per_group() -> None:
    svg = group_strips("reward", "reward per group", [("g0", [0.0, 1.0, 0.5]), ("g1", [2.0])])
    assert svg.startswith('<svg class="plot" data-plot="reward"')
    assert svg.count("<circle") == 4
    assert len(re.findall(r'stroke-width="2"', svg)) == 2
    assert "g0: mean 0.5" in svg
    assert "http" not in svg


def test_a_histogram_counts_every_value_once() -> None:
    values = [-0.5 * i for i in range(100)]
    svg = histogram("logprob", "logprob", values, bins=10)
    counts = [int(c) for c in re.findall(r"\): (\d+)</title>", svg)]
    assert sum(counts) == 100
    assert len(counts) == 10


def test_empty_and_constant_inputs_still_draw_a_frame() -> None:
    assert 'data-plot="x"' in histogram("x", "empty", [])
    assert histogram("x", "constant", [1.0, 1.0]).count("<rect") == 24
    assert group_strips("y", "no values", [("g0", [])]).count("<circle") == 0
