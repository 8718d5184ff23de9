"""TQGroupBuffer over real TQ: every key it takes custody of is cleared exactly once, none leak."""

from __future__ import annotations

import dataclasses
from typing import Any

import anyio
import pytest

from tests.tq.support import fresh_tq_sink, rows_of
from tokcap_core import FinalizedGroup, assemble_receipt
from tokcap_core.errors import SlotError
from tokcap_core.simulate import SimulatedRollout, simulate_rollout

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("tq_cluster")]


async def _stage_group(
    sink: Any, group_id: str, size: int = 2
) -> tuple[list[SimulatedRollout], FinalizedGroup]:
    """Stage a group and publish its rows; staging_keys are the terminal chain's calls only."""
    rollouts = [simulate_rollout(f"{group_id}-r{i}", seed=i, turns=4, roots=2) for i in range(size)]
    await sink.put([c for r in rollouts for c in r.calls])
    rows = {row.key: row for r in rollouts for row in rows_of(r)}
    await sink.publish(rows)
    on_chain = tuple(
        link.staging_key
        for r in rollouts
        for segment in assemble_receipt(r.ledger.state).segments
        for link in segment
    )
    group = FinalizedGroup(
        group_id=group_id,
        rollout_ids=tuple(r.ledger.rollout_id for r in rollouts),
        valid_row_count=len(rows),
        total_row_count=len(rows),
        training_keys=tuple(rows),
        staging_keys=on_chain,
        staging_cleared=False,
        weight_version_min=0,
        weight_version_max=0,
        failures=(),
        metrics={},
    )
    return rollouts, group


def _fresh_buffer() -> tuple[Any, Any]:
    """A `TQGroupBuffer` over a fresh `TQSink` (partitions no other test touches)."""
    from tokcap_tq import TQGroupBuffer

    sink = fresh_tq_sink()
    return sink, TQGroupBuffer(sink)


def _receipts(rollouts: list[SimulatedRollout]) -> list[Any]:
    return [assemble_receipt(r.ledger.state) for r in rollouts]


@pytest.mark.anyio
async def test_reserve_commit_remove_clears_exactly_the_groups_keys() -> None:
    sink, buffer = _fresh_buffer()
    kept, kept_group = await _stage_group(sink, "keep")
    rollouts, group = await _stage_group(sink, "g1")
    assert len({k for r in rollouts for k in r.staged}) > len(
        group.staging_keys
    )  # off-chain calls exist

    await buffer.reserve(
        "g1", [r.ledger.rollout_id for r in rollouts], weight_version=0, target_step=1
    )
    await buffer.commit_finalized(group, receipts=_receipts(rollouts))
    assert buffer.ready() == ("g1",)
    # g1's staged rows (off-chain too) are gone, its training rows held; "keep" is untouched.
    assert sorted(await sink.staged_keys()) == sorted(k for r in kept for k in r.staged)
    assert sorted(await sink.row_keys()) == sorted(group.training_keys + kept_group.training_keys)

    await buffer.remove(["g1"])
    assert sorted(await sink.row_keys()) == sorted(kept_group.training_keys)
    assert len(buffer) == 0
    assert buffer.owed_keys == 0


@pytest.mark.anyio
async def test_concurrent_removes_of_one_group_clear_once() -> None:
    sink, buffer = _fresh_buffer()
    rollouts, group = await _stage_group(sink, "race")
    await buffer.reserve("race", [r.ledger.rollout_id for r in rollouts], 0, 1)
    await buffer.commit_finalized(group, receipts=_receipts(rollouts))

    cleared: list[tuple[str, ...]] = []
    clear_rows = sink.clear_rows

    async def counting_clear_rows(keys: Any) -> None:
        cleared.append(tuple(keys))
        await clear_rows(keys)

    sink.clear_rows = counting_clear_rows  # type: ignore[method-assign]
    outcomes: list[str] = []

    async def remove() -> None:
        try:
            await buffer.remove(["race"])
            outcomes.append("removed")
        except SlotError as e:
            outcomes.append(e.code)

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(remove)
    assert sorted(outcomes) == ["removed", "unknown_group", "unknown_group", "unknown_group"]
    assert cleared == [group.training_keys]
    assert await sink.row_keys() == []
    assert await sink.staged_keys() == []


@pytest.mark.anyio
async def test_abort_clears_every_staged_call_of_the_group() -> None:
    sink, buffer = _fresh_buffer()
    rollouts, group = await _stage_group(sink, "ab")
    await sink.clear_rows(list(group.training_keys))
    await buffer.reserve("ab", [r.ledger.rollout_id for r in rollouts], 0, 1)
    await buffer.abort("ab", receipts=_receipts(rollouts))
    assert await sink.staged_keys() == []
    with pytest.raises(SlotError):
        await buffer.abort("ab")


@pytest.mark.anyio
async def test_commit_of_staging_the_reassembler_cleared_only_clears_the_rest() -> None:
    sink, buffer = _fresh_buffer()
    rollouts, group = await _stage_group(sink, "rc")
    await sink.clear(group.staging_keys)
    await buffer.reserve("rc", [r.ledger.rollout_id for r in rollouts], 0, 1)
    await buffer.commit_finalized(
        dataclasses.replace(group, staging_cleared=True), receipts=_receipts(rollouts)
    )
    assert await sink.staged_keys() == []


@pytest.mark.anyio
async def test_sweep_frees_abandoned_groups_in_either_state() -> None:
    sink, buffer = _fresh_buffer()
    old_ready, ready_group = await _stage_group(sink, "old-ready")
    old_reserved, reserved_group = await _stage_group(sink, "old-reserved")
    fresh, fresh_group = await _stage_group(sink, "fresh")
    await sink.clear_rows(list(reserved_group.training_keys))
    for rollouts, step in ((old_ready, 1), (old_reserved, 2), (fresh, 9)):
        group_id = rollouts[0].ledger.rollout_id.rsplit("-r", 1)[0]
        await buffer.reserve(group_id, [r.ledger.rollout_id for r in rollouts], 0, step)
    await buffer.commit_finalized(ready_group, receipts=_receipts(old_ready))

    result = await buffer.sweep(current_step=10, max_age=3)

    assert result.removed == ("old-ready",)
    assert result.aborted == ("old-reserved",)
    assert sorted(await sink.staged_keys()) == sorted(k for r in fresh for k in r.staged)
    assert sorted(await sink.row_keys()) == sorted(fresh_group.training_keys)
    assert len(buffer) == 1
    assert buffer.owed_keys == 0
