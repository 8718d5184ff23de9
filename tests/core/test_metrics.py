"""Capture metrics: stable key sets from the closed tuples, counts per bucket."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tokcap_core import Receipt, assemble_receipt, verify_manifest
from tokcap_core.ledger import BREAK_CAUSES, SPLICE_CAUSES
from tokcap_core.metrics import (
    break_cause_counts,
    calls_per_rollout,
    failure_counts,
    splice_cause_counts,
    terminal_selection_breakdown,
)
from tokcap_core.reasons import FAILURE_BUCKETS, UNKNOWN_REASON
from tokcap_core.receipts import TERMINAL_SELECTIONS
from tokcap_core.simulate import simulate_rollout
from tokcap_core.testing import simulated_rollouts


def receipt_of(rollout_id: str, **kwargs: Any) -> Receipt:
    sim = simulate_rollout(rollout_id, **kwargs)
    return assemble_receipt(verify_manifest(sim.manifest))


def poisoned(receipt: Receipt) -> Receipt:
    return dataclasses.replace(
        receipt,
        status="poisoned",
        failure_reason="no_terminal",
        terminal_call_id=None,
        terminal_selection=None,
        segments=(),
    )


FAILURE_KEYS = {f"failures/{b}" for b in FAILURE_BUCKETS} | {f"failures/{UNKNOWN_REASON}"}


def test_failure_counts_has_every_bucket_even_when_empty() -> None:
    metrics = failure_counts([])
    assert set(metrics) == FAILURE_KEYS
    assert set(metrics.values()) == {0.0}


def test_failures_are_counted_per_bucket_never_per_detail() -> None:
    metrics = failure_counts(["stage_failed:timeout", "stage_failed:conn", "stage_failed"])
    assert metrics["failures/stage_failed"] == 3.0
    assert set(metrics) == FAILURE_KEYS


def test_none_reasons_are_skipped_and_strangers_are_unknown() -> None:
    metrics = failure_counts([None, "no_terminal", None, "made_up:x", "Stage_failed"])
    assert metrics["failures/no_terminal"] == 1.0
    assert metrics["failures/unknown"] == 2.0
    assert sum(metrics.values()) == 3.0


@given(st.lists(st.one_of(st.none(), st.sampled_from(FAILURE_BUCKETS), st.text(max_size=12))))
def test_failure_counts_add_up_to_the_non_none_reasons(reasons: list[str | None]) -> None:
    metrics = failure_counts(reasons)
    assert set(metrics) == FAILURE_KEYS
    assert sum(metrics.values()) == sum(r is not None for r in reasons)


def test_terminal_keys_derive_from_the_selection_tuple() -> None:
    expected = {
        f"terminal/{m}/{kind}" for m in TERMINAL_SELECTIONS for kind in ("count", "fraction")
    }
    assert set(terminal_selection_breakdown([])) == expected


def test_terminal_fractions_are_over_verified_receipts() -> None:
    receipts = [
        receipt_of("a", seed=1, terminal="declared"),
        receipt_of("b", seed=2, terminal="declared"),
        receipt_of("c", seed=3, terminal="response_id"),
        receipt_of("d", seed=4, terminal="content"),
        poisoned(receipt_of("e", seed=5, terminal="heuristic")),
    ]
    metrics = terminal_selection_breakdown(receipts)
    assert metrics["terminal/declared/count"] == 2.0
    assert metrics["terminal/declared/fraction"] == 0.5
    assert metrics["terminal/response_id/fraction"] == 0.25
    assert metrics["terminal/content/count"] == 1.0
    assert metrics["terminal/heuristic/count"] == 0.0


def test_terminal_fractions_are_zero_without_verified_receipts() -> None:
    metrics = terminal_selection_breakdown([poisoned(receipt_of("a", seed=1))])
    assert set(metrics.values()) == {0.0}


@given(st.lists(simulated_rollouts(max_turns=3, max_roots=2), max_size=5))
def test_verified_fractions_sum_to_one(sims: list[Any]) -> None:
    receipts = [assemble_receipt(verify_manifest(s.manifest)) for s in sims]
    fractions = [v for k, v in terminal_selection_breakdown(receipts).items() if "fraction" in k]
    assert abs(sum(fractions) - (1.0 if any(r.ok for r in receipts) else 0.0)) < 1e-9


def test_calls_per_rollout_counts_admitted_and_on_chain_calls() -> None:
    chain = receipt_of("a", seed=1, turns=3)
    with_failures = receipt_of("b", seed=2, turns=3, offchain_failures=2)
    assert len(chain.sink_keys) == 3
    assert len(with_failures.sink_keys) == 5
    metrics = calls_per_rollout([chain, with_failures, poisoned(chain)])
    assert metrics == {
        "calls/admitted/mean": (3 + 5 + 3) / 3,
        "calls/admitted/min": 3.0,
        "calls/admitted/max": 5.0,
        "calls/on_chain/mean": (3 + 3 + 0) / 3,
        "calls/on_chain/min": 0.0,
        "calls/on_chain/max": 3.0,
    }


def test_calls_per_rollout_is_all_zeros_for_no_receipts() -> None:
    metrics = calls_per_rollout([])
    assert len(metrics) == 6
    assert set(metrics.values()) == {0.0}


def test_break_keys_derive_from_the_cause_tuple() -> None:
    expected = {f"breaks/{c}" for c in BREAK_CAUSES} | {"breaks/total"}
    assert set(break_cause_counts([])) == expected


def test_breaks_are_counted_by_cause_with_a_total() -> None:
    receipts = [
        receipt_of("a", seed=1, roots=2),
        receipt_of("b", seed=2, roots=3),
        receipt_of("c", seed=3, roots=1),
    ]
    metrics = break_cause_counts(receipts)
    assert metrics["breaks/history_rewritten"] == 3.0
    assert metrics["breaks/total"] == 3.0
    assert metrics["breaks/no_parent_match"] == 0.0


def test_splice_keys_derive_from_the_cause_tuple() -> None:
    expected = {f"splices/{c}" for c in SPLICE_CAUSES} | {"splices/total"}
    assert set(splice_cause_counts([])) == expected


def test_splices_are_counted_by_cause_with_a_total() -> None:
    receipts = [receipt_of(f"s{i}", seed=i, turns=6, roots=2) for i in range(4)]
    metrics = splice_cause_counts(receipts)
    causes = [c for r in receipts for c in r.splice_causes]
    assert causes, "the simulated rollouts splice"
    assert metrics["splices/total"] == float(len(causes))
    for cause in SPLICE_CAUSES:
        assert metrics[f"splices/{cause}"] == float(causes.count(cause))


def test_every_metric_value_is_a_float() -> None:
    receipts = [receipt_of("a", seed=1, roots=2)]
    for metrics in (
        failure_counts(["stage_failed"]),
        terminal_selection_breakdown(receipts),
        calls_per_rollout(receipts),
        break_cause_counts(receipts),
        splice_cause_counts(receipts),
    ):
        assert all(type(v) is float for v in metrics.values())
