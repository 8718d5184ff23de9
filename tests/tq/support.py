"""Helpers shared by the TransferQueue tests."""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from tokcap_core import TrainingRow, assemble_receipt, placeholder_row, reassemble
from tokcap_core.simulate import SimulatedRollout


def fresh_tq_sink(*, op_timeout_s: float = 60.0) -> Any:
    """A `TQSink` on partitions no other test touches (TQ outlives each test)."""
    from tokcap_tq import TQSink, TQSinkConfig

    tag = uuid.uuid4().hex[:12]
    config = TQSinkConfig(
        staging_partition=f"stg_{tag}",
        training_partition=f"trn_{tag}",
        media_partition=f"med_{tag}",
        op_timeout_s=op_timeout_s,
    )
    return TQSink(config)


def rows_of(rollout: SimulatedRollout) -> list[TrainingRow]:
    """The training rows of a simulated rollout (a placeholder when its receipt fails)."""
    receipt = assemble_receipt(rollout.ledger.state, segments="all")
    if not receipt.ok:
        return [placeholder_row(receipt.rollout_id, receipt.failure_reason or "unknown")]
    return reassemble(receipt, rollout.staged, max_seq_len=1 << 20)


async def max_loop_lag(work: Callable[[], Awaitable[None]], *, settle_s: float = 0.01) -> float:
    """The longest a 1 ms ticker on this loop waited beyond its period while ``work`` ran
    (a figure for the benches; tests count turns instead, `loop_turns_during`)."""
    lag = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal lag
        while not done.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.001)
            lag = max(lag, time.perf_counter() - start - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(settle_s)
        await work()
        done.set()
    return lag


async def loop_turns_during(work: Callable[[], Awaitable[None]]) -> int:
    """How many times another task on this loop ran while ``work`` was in flight: 0 when
    ``work`` blocks the loop from start to end. Counted, not timed: a loaded box slows both
    sides alike and cannot turn a blocking call into a free loop or back."""
    turns = 0
    done = anyio.Event()

    async def other_task() -> None:
        nonlocal turns
        while not done.is_set():
            turns += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_task)
        await anyio.sleep(0.01)
        before = turns
        await work()
        during = turns - before
        done.set()
    return during
