"""The gate's metrics, counted from real ledger entries and staged rows, no engine.

`GateMetrics` counts what the ledger records (calls admitted with their break or splice
cause, staged, failed by reason bucket and whether served, rollouts poisoned) and what the
sink acknowledged (bytes of tokens, logprobs and routes; one latency sample per write,
``ok`` or ``error``). ``as_dict`` shows every counter and gauge, never a counter's
``_created`` timestamp, and a histogram only as its count of writes.
"""

from __future__ import annotations

from array import array
from typing import Any

from tokcap_core import Ledger, StagedCall
from tokcap_core.ledger import Admitted, Failed, Poisoned, Staged
from tokcap_core.routes import Routes
from tokcap_vllm.extend import GateMetrics


def _metrics(held: tuple[int, int] = (2, 1)) -> GateMetrics:
    return GateMetrics(lambda: held)


def _admitted(call_id: str, **how: Any) -> Admitted:
    fields: dict[str, Any] = {"parent_id": None, "prefix_len": 0, "formation": "root"}
    return Admitted(call_id=call_id, admitted_at=1, request_fingerprint="fp", **{**fields, **how})


def _row(routes: Routes | None = None, rollout_id: str = "m1") -> StagedCall:
    return StagedCall.from_engine_output(
        rollout_id=rollout_id,
        call_id="c000001",
        parent_id=None,
        parent_cum_len=0,
        parent_chain_hash=None,
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        logprobs=[-0.5, -0.25],
        finish_reason="stop",
        weight_version=0,
        routes=routes,
    )


def test_each_entry_counts_its_kind_and_the_call_outcome_it_records() -> None:
    metrics, ledger = _metrics(), Ledger("m1")
    first, second = ledger.next_call_id(), "c000002"
    for event in (
        _admitted(first),
        _admitted(second, break_cause="no_parent_match"),
        Failed(call_id=first, reason="engine_failed", served=True),
        Poisoned(reason="gate_restarted"),
    ):
        metrics.on_entry("m1", ledger.append(event))
    counts = metrics.as_dict()
    assert counts["tokcap/calls_admitted"] == 2
    assert counts["tokcap/breaks/no_parent_match"] == 1
    assert "tokcap/splices/whitespace" not in counts  # no call of that cause yet
    assert counts["tokcap/calls_failed/engine_failed/true"] == 1
    assert counts["tokcap/rollouts_poisoned/gate_restarted"] == 1
    assert counts["tokcap/ledger_entries/admitted"] == 2
    assert counts["tokcap/rollouts/open"] == 2
    assert counts["tokcap/rollouts/closed"] == 1
    assert not any(key.endswith("_created") for key in counts)


def test_a_splice_is_counted_by_its_cause_and_a_commit_as_staged() -> None:
    metrics, ledger, row = _metrics(), Ledger("m2"), _row(rollout_id="m2")
    staged = Staged(
        call_id="c000001",
        carry_len=3,
        gen_len=2,
        weight_version=0,
        weight_version_last=0,
        finish_reason="stop",
        call_digest=row.digest,
        chain_hash=row.chain_hash,
    )
    splice = _admitted(
        "c000002", parent_id="c000001", prefix_len=5, formation="splice", splice_cause="whitespace"
    )
    for event in (_admitted("c000001"), staged, splice):
        metrics.on_entry("m2", ledger.append(event))
    counts = metrics.as_dict()
    assert counts["tokcap/splices/whitespace"] == 1
    assert not any(key.startswith("tokcap/breaks/") for key in counts)
    assert (counts["tokcap/calls_staged"], counts["tokcap/ledger_entries/staged"]) == (1, 1)


def test_an_acknowledged_write_counts_its_bytes_and_a_failed_one_only_its_latency() -> None:
    metrics = _metrics()
    plain = _row()
    routed = _row(Routes(dtype="int8", shape=(5, 2, 2), data=array("b", [0] * 20)))
    metrics.on_sink_write(plain, 0.01, None)
    metrics.on_sink_write(routed, 0.02, None)
    metrics.on_sink_write(plain, 0.03, "sink_down")
    counts = metrics.as_dict()
    tokens_and_logprobs = 2 * (5 * 4 + 2 * 4)  # 5 int32 tokens, 2 float32 logprobs
    assert counts["tokcap/staged_bytes"] == tokens_and_logprobs + 20
    assert (counts["tokcap/stage_writes/ok"], counts["tokcap/stage_writes/error"]) == (2, 1)
    assert not any(key.startswith("tokcap/stage_seconds") for key in counts)
    assert b'tokcap_stage_seconds_count{outcome="error"} 1.0' in metrics.render()
