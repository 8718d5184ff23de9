"""``tokcap train --async``'s summary and checks, from records (no engine): the staleness bound
replaces staleness 0, and the parity limit applies to rows of the trained version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.train.records import FRESH, clean_step, printed
from tokcap.loop import (
    LoopConfig,
    StepRecord,
    TrainRun,
    build_train_summary,
    render_train_report,
    tokcap_share,
    train_problems,
)

STALE = {"tokens": 30, "mean_abs": 0.2, "max_abs": 0.9, "k3": 0.05}


def _record(step: int, *, sampled: int, staleness: int, fresh: dict[str, Any] | None) -> StepRecord:
    buckets = {"0": fresh} if fresh else {}
    buckets[str(staleness)] = STALE if staleness else (fresh or FRESH)
    return clean_step(
        step, parity=STALE, sampled_version=sampled, staleness_max=staleness,
        seconds={"total": 2.0, "fetch_rows": 0.1, "wait": 0.5, "train": 0.2},
        calls_spanning_versions=3, tokens_stale=30, dropped_stale=1, skipped={"stale": 1},
        loop_lag_ms_max=4.0, parity_by_staleness=buckets,
    )  # fmt: skip


def _summary(mode: str, *records: StepRecord) -> dict[str, Any]:
    config = LoopConfig(model=Path("tiny"), steps=len(records), mode=mode, max_staleness=2)  # type: ignore[arg-type]
    run = TrainRun(config, params=10)
    run.steps = list(records)
    run.loop_lag_ms_max = 4.0
    return build_train_summary(run, {})


def _problems_after_a_good_step(
    mode: str, *, sampled: int, staleness: int, fresh: dict[str, Any]
) -> list[str]:
    """`train_problems` of a run whose step 0 is clean and whose step 1 is as given."""
    first = _record(0, sampled=0, staleness=0, fresh=FRESH)
    second = _record(1, sampled=sampled, staleness=staleness, fresh=fresh)
    return train_problems(_summary(mode, first, second))


def test_an_async_run_within_its_bound_has_no_problem_and_reports_what_it_trained() -> None:
    summary = _summary(
        "async",
        _record(0, sampled=0, staleness=0, fresh=FRESH),
        _record(1, sampled=0, staleness=1, fresh=None),
        _record(2, sampled=1, staleness=2, fresh=FRESH),
    )
    train = summary["train"]
    assert (train["mode"], train["max_staleness"], train["importance"]) == ("async", 2, True)
    assert (train["staleness_max"], train["tokens_stale"], train["dropped_stale"]) == (2, 90, 3)
    assert (train["calls_spanning_versions"], train["tokens_stale_kv"]) == (9, 0)
    assert train["parity_k3_max"] == 1e-14  # rows of the trained version only
    assert train["parity_k3_max_all_rows"] == 0.05
    assert train["samples_per_s"] == pytest.approx(3 * 32 / 6.0, abs=1e-3)
    assert train_problems(summary) == []
    assert "mode async: staleness max 2 (bound 2)" in printed(summary)
    assert "Event-loop lag" in render_train_report(summary)


def test_an_async_run_past_its_bound_or_ahead_of_the_push_is_a_problem() -> None:
    bad_fresh = {**FRESH, "k3": 1e-3}
    problems = _problems_after_a_good_step("async", sampled=2, staleness=3, fresh=bad_fresh)
    assert "step 1: stale rows (staleness 3 > 2)" in problems
    assert any("step 1: rows sampled by version 2" in p for p in problems)
    assert any("step 1: parity K3 1.00e-03" in p for p in problems)


def test_a_sync_run_keeps_its_guarantees() -> None:
    summary = _summary("sync", _record(0, sampled=0, staleness=0, fresh=FRESH))
    assert summary["train"]["mode"] == "sync"
    assert summary["train"]["max_staleness"] == 0
    problems = _problems_after_a_good_step("sync", sampled=0, staleness=1, fresh=FRESH)
    assert "step 1: stale rows (staleness 1 > 0)" in problems
    assert any("parity K3" in p for p in problems)  # sync checks every row's parity
    assert any("rows sampled by version 0" in p for p in problems)


def test_tokcap_share_is_collect_in_sync_and_row_reads_in_async() -> None:
    assert tokcap_share({"total": 4.0, "capture_verify": 1.0, "reassemble": 0.5}) == 0.375
    assert tokcap_share({"total": 2.0, "fetch_rows": 0.1, "capture_verify": 9.0}) == 0.05
    assert tokcap_share({}) == 0.0
