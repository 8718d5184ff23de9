"""``tokcap train --gates``'s summary, checks and report, from records (no engine)."""

from __future__ import annotations

import io
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from tokcap.loop import (
    LoopConfig,
    StepRecord,
    TrainRun,
    build_train_summary,
    print_train_summary,
    render_train_report,
    train_problems,
)


def _record(step: int, gate_versions: tuple[int, ...]) -> StepRecord:
    return StepRecord(
        step=step, reward_mean=0.5, reward_max=1.0,
        parity={"tokens": 10, "mean_abs": 1e-8, "max_abs": 1e-7, "k3": 1e-14},
        sampled_version=step, weight_version=step + 1, engine_version=str(step + 1),
        staleness_max=0, rows_valid=8, rows_placeholder=0, receipts_verified=8,
        receipts_total=8, gate_versions=gate_versions, groups_accepted=2, tokens=80,
        loss=0.1, clip_fraction=0.0, grad_norm=1.0, seconds={"total": 1.0},
    )  # fmt: skip


def _run(last_versions: tuple[int, ...], rollouts: tuple[int, int]) -> TrainRun:
    run = TrainRun(LoopConfig(model=Path("tiny"), steps=2, gates=2), params=10)
    run.steps = [_record(0, (1, 1)), _record(1, last_versions)]
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
    out = io.StringIO()
    print_train_summary(summary, Console(file=out, width=120))
    assert "gates (tokcap-vllm serve)" in out.getvalue()
    assert "http://127.0.0.1:8001" in out.getvalue()
    assert "Fleet: 2 gates" in render_train_report(summary)


def test_a_gate_behind_the_push_or_idle_is_a_problem() -> None:
    summary = build_train_summary(_run((2, 1), (16, 0)), {})
    problems = train_problems(summary)
    assert "step 1: gates at versions [2, 1] after the push" in problems
    assert "gate http://127.0.0.1:8001 served no rollout" in problems


def test_the_in_process_run_has_no_fleet() -> None:
    run = _run((2, 2), (8, 8))
    run.steps = [_record(0, ()), _record(1, ())]
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
    out = io.StringIO()
    print_train_summary(summary, Console(file=out, width=200))
    assert "4 lost with their gate, gate_unreachable: http://127.0.0.1:8001 4" in out.getvalue()
    assert "4 lost with their gate" in render_train_report(summary)


def test_receipts_lost_on_a_gate_that_answers_are_a_problem() -> None:
    summary = build_train_summary(_lost_gate_run(alive=True), {})
    problems = train_problems(summary)
    assert "step 1: 4 receipts lost on gate http://127.0.0.1:8001, which still answers" in problems
    assert "step 1: 4 receipts fail ({})" in problems
