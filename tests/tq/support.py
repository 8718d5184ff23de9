"""Helpers shared by the TransferQueue tests."""

from __future__ import annotations

import uuid
from typing import Any

from tokcap_core import TrainingRow, assemble_receipt, placeholder_row, reassemble
from tokcap_core.simulate import SimulatedRollout


def fresh_tq_sink(*, op_timeout_s: float = 60.0) -> Any:
    """A `TQSink` on partitions no other test touches (TQ outlives each test)."""
    from tokcap_tq import TQSink, TQSinkConfig

    tag = uuid.uuid4().hex[:12]
    config = TQSinkConfig(
        staging_partition=f"stg_{tag}", training_partition=f"trn_{tag}", op_timeout_s=op_timeout_s
    )
    return TQSink(config)


def rows_of(rollout: SimulatedRollout) -> list[TrainingRow]:
    """The training rows of a simulated rollout (a placeholder when its receipt fails)."""
    receipt = assemble_receipt(rollout.ledger.state, segments="all")
    if not receipt.ok:
        return [placeholder_row(receipt.rollout_id, receipt.failure_reason or "unknown")]
    return reassemble(receipt, rollout.staged, max_seq_len=1 << 20)
