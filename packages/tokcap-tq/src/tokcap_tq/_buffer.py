"""`TQGroupBuffer`: the core's `GroupSlots` state machine driving a sink's clears.

Locking: each transition runs under one anyio Lock and is all-or-nothing (``GroupSlots``
either applies or raises and changes nothing). The transition hands its keys out in
exactly one `ClearPlan`, so of two concurrent removes of a group one gets the plan and the
other ``SlotError`` — a key is cleared once. The clear runs *after* the lock is
released (no I/O under the lock) and under a shield; before the lock is released the plan's
keys are recorded as owed, and only a successful clear settles them. A clear that fails
(or is somehow skipped) leaves them owed, and `sweep` retries them: no key is ever lost.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import anyio
import anyio.lowlevel
import attrs

from tokcap_core import FinalizedGroup, Receipt
from tokcap_core.ids import StagingKey, TrainingKey
from tokcap_core.slots import READY, ClearPlan, GroupSlots, Slot

from ._sink import TQSink

__all__ = ["SweepResult", "TQGroupBuffer"]


@attrs.frozen(kw_only=True)
class SweepResult:
    """What a `TQGroupBuffer.sweep` did: groups aborted (RESERVED), removed (READY), keys freed."""

    aborted: tuple[str, ...]
    removed: tuple[str, ...]
    freed_keys: int


def _receipt_keys(receipts: Iterable[Receipt]) -> list[StagingKey]:
    return [key for receipt in receipts for key in receipt.sink_keys]


class TQGroupBuffer:
    """Group slots by group id over a `TQSink`; each key it takes custody of is freed once."""

    def __init__(self, sink: TQSink) -> None:
        self.sink = sink
        self._slots = GroupSlots()
        self._lock = anyio.Lock()
        self._owed_staging: set[StagingKey] = set()
        self._owed_training: set[TrainingKey] = set()

    async def reserve(
        self, group_id: str, rollout_ids: Sequence[str], weight_version: int, target_step: int
    ) -> Slot:
        """Open a RESERVED slot for a group about to be reassembled."""
        async with self._lock:
            return self._slots.reserve(group_id, rollout_ids, weight_version, target_step)

    async def commit_finalized(
        self, group: FinalizedGroup, *, receipts: Iterable[Receipt] = ()
    ) -> None:
        """RESERVED → READY: hold ``group.training_keys``; clear the staged rows now.

        Staged rows cleared: ``group.staging_keys`` unless the reassembler cleared them
        (``staging_cleared``), plus every ``sink_keys`` of ``receipts`` (off-chain calls
        included), which a reassembler that only consumed on-chain calls leaves behind.
        A group whose ``outcome`` is ``"unknown"`` is held the same way: clearing a key that
        was never published is harmless, leaking one that was is not.
        """
        cleared = set(group.staging_keys) if group.staging_cleared else set()
        staging = [
            k
            for k in dict.fromkeys([*group.staging_keys, *_receipt_keys(receipts)])
            if k not in cleared
        ]
        async with self._lock:
            plan = self._slots.commit_finalized(
                group.group_id, training_keys=group.training_keys, staging_keys=staging
            )
            self._owe(plan)
        await self._settle(plan)

    async def abort(
        self,
        group_id: str,
        *,
        staging_keys: Sequence[StagingKey] = (),
        receipts: Iterable[Receipt] = (),
    ) -> None:
        """Drop a RESERVED slot; clear ``staging_keys`` and the receipts' ``sink_keys``."""
        staging = list(dict.fromkeys([*staging_keys, *_receipt_keys(receipts)]))
        async with self._lock:
            plan = self._slots.abort(group_id, staging_keys=staging)
            self._owe(plan)
        await self._settle(plan)

    async def remove(self, group_ids: Iterable[str]) -> None:
        """Remove READY groups (consumed by training), all or none; clear their training rows."""
        ids = tuple(group_ids)
        async with self._lock:
            plan = self._slots.remove(ids)
            self._owe(plan)
        await self._settle(plan)

    async def sweep(self, current_step: int, max_age: int) -> SweepResult:
        """Free groups older than ``max_age`` steps, and retry clears that failed before.

        READY groups are removed. RESERVED groups are aborted and their staged rows found by
        listing the staging partition for their rollout ids (their keys were never reported).
        """
        listed = await self.sink.staged_keys()
        async with self._lock:
            stale = self._slots.stale(current_step, max_age)
            ready = tuple(g for g in stale if self._slots.slot(g).state is READY)
            aborted = tuple(g for g in stale if g not in ready)
            plans = [self._slots.remove(ready)] if ready else []
            for group_id in aborted:
                rollouts = set(self._slots.slot(group_id).rollout_ids)
                keys = [k for k in listed if k.partition("/")[0] in rollouts]
                plans.append(self._slots.abort(group_id, staging_keys=keys))
            for plan in plans:
                self._owe(plan)
            owed = ClearPlan(
                training_keys=tuple(self._owed_training), staging_keys=tuple(self._owed_staging)
            )
        await self._settle(owed)
        return SweepResult(
            aborted=aborted,
            removed=ready,
            freed_keys=len(owed.training_keys) + len(owed.staging_keys),
        )

    def ready(self) -> tuple[str, ...]:
        """READY group ids, in commit order."""
        return self._slots.ready()

    def slot(self, group_id: str) -> Slot:
        """The live slot of ``group_id`` (``SlotError`` ``unknown_group`` if none)."""
        return self._slots.slot(group_id)

    @property
    def owed_keys(self) -> int:
        """Keys handed out by a transition whose clear has not succeeded yet."""
        return len(self._owed_staging) + len(self._owed_training)

    def __len__(self) -> int:
        return len(self._slots)

    def _owe(self, plan: ClearPlan) -> None:
        self._owed_staging.update(plan.staging_keys)
        self._owed_training.update(plan.training_keys)

    async def _settle(self, plan: ClearPlan) -> None:
        """Clear a plan's keys, shielded; settle them only once the sink has freed them."""
        with anyio.CancelScope(shield=True):
            if plan.staging_keys:
                await self.sink.clear(plan.staging_keys)
                self._owed_staging.difference_update(plan.staging_keys)
            if plan.training_keys:
                await self.sink.clear_rows(plan.training_keys)
                self._owed_training.difference_update(plan.training_keys)
        await anyio.lowlevel.checkpoint_if_cancelled()
