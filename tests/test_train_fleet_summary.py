"""``tokcap train --gates``'s summary, checks and report, from records (no engine)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from tests.train.records import clean_step, printed
from tokcap.loop import (
    LoopConfig,
    TrainRun,
    build_train_summary,
    render_train_report,
    train_problems,
)


def _run(last_versions: tuple[int, ...], rollouts: tuple[int, int]) -> TrainRun:
    run = TrainRun(LoopConfig(model=Path("tiny"), steps=2, gates=2), params=10)
    run.steps = [clean_step(0, gate_versions=(1, 1)), clean_step(1, gate_versions=last_versions)]
    run.gates = [
        {"url": f"http://127.0.0.1:800{i}", "pid": 100 + i, "rollouts": n, "calls": n,
         "weight_version": last_versions[i]}
        for i, n in enumerate(rollouts)
    ]  # fmt: skip
    return run


def test_the_summary_lists_the_gates_and_the_report_shows_the_fleet() -> None:
    summary = build_train_summary(_run((2, 2), (8, 8)), {})
    assert [g["pid"] for g in summary["gates"]] == [100, 101]
    assert summary["train"]["steps"][1]["gate_versions"] == [2, 2]
    assert train_problems(summary) == []
    out = printed(summary)
    assert "gates (tokcap-vllm serve)" in out
    assert "http://127.0.0.1:8001" in out
    assert "Fleet: 2 gates" in render_train_report(summary)


def test_a_gate_behind_the_push_or_idle_is_a_problem() -> None:
    summary = build_train_summary(_run((2, 1), (16, 0)), {})
    problems = train_problems(summary)
    assert "step 1: gates at versions [2, 1] after the push" in problems
    assert "gate http://127.0.0.1:8001 served no rollout" in problems


def test_the_in_process_run_has_no_fleet() -> None:
    run = _run((2, 2), (8, 8))
    run.steps = [clean_step(0), clean_step(1)]
    run.gates = []
    summary = build_train_summary(run, {})
    assert summary["gates"] == []
    assert "gate_versions" not in summary["train"]["steps"][1]
    assert "Fleet" not in render_train_report(summary)


def _lost_gate_run(alive: bool) -> TrainRun:
    """Gate 1 stopped answering in step 1: its 4 rollouts' receipts poisoned
    ``gate_unreachable`` (the step trained on gate 0's), then it was dropped from pushes."""
    run = _run((2, 2), (8, 4))
    lost = "http://127.0.0.1:8001"
    run.steps[1] = replace(
        run.steps[1], receipts_verified=4, rows_valid=4, rows_placeholder=4,
        gate_versions=(2,), receipts_lost={lost: 4},
    )  # fmt: skip
    run.gates[1].update(weight_version=None, alive=alive, unreachable=4)
    return run


def test_receipts_lost_with_a_dead_gate_are_counted_by_gate_and_pass() -> None:
    summary = build_train_summary(_lost_gate_run(alive=False), {})
    train = summary["train"]
    assert (train["receipts_verified"], train["receipts_total"]) == (12, 16)
    assert train["receipts_lost"] == 4
    assert train["receipts_lost_by_gate"] == {"http://127.0.0.1:8001": 4}
    assert train_problems(summary) == []  # `tokcap train` exits 0
    out = printed(summary, width=200)
    assert "4 lost with their gate, gate_unreachable: http://127.0.0.1:8001 4" in out
    assert "4 lost with their gate" in render_train_report(summary)


def test_receipts_lost_on_a_gate_that_answers_are_a_problem() -> None:
    summary = build_train_summary(_lost_gate_run(alive=True), {})
    problems = train_problems(summary)
    assert "step 1: 4 receipts lost on gate http://127.0.0.1:8001, which still answers" in problems
    assert "step 1: 4 receipts fail ({})" in problems
