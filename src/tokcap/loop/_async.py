"""``tokcap train --async``'s feed: a rollout pump and collectors beside the loop's steps.

The shape is NeMo-RL's single controller, with tokcap's custody in between:

- the **rollout pump** starts groups (G rollouts of one prompt each) while the staleness
  policy admits them (`StalenessPolicy.may_start`: at most ``(steps_done + K + 1) * G``
  live groups), a bounded number at a time, and hands every played group to
- the **collectors** (one task per group): the group is collected as soon as it has
  played, with the same `tokcap.compose.Stack.collect` as a lock-step run (close in one
  batch that declares the declared terminals too, one shared fsync; receipts verified
  against the closes' heads; reassembly on the Ray pool; the group
  policy; an accepted group's rows read and its advantages), off the loop's path; then the
  replay buffer (`tokcap_tq.TQGroupBuffer`) takes custody of its rows (``reserve``,
  ``commit_finalized``: READY, its staged calls cleared); a group the policy rejects is
  removed at once and a spare prompt starts in its place;
- the **train pump** is the loop itself: each step `Pumps.take` takes READY groups in
  commit order, discards a group holding a token sampled more than K versions behind the
  trainer (`StalenessPolicy.judge`, counted ``stale``, refilled) until it has G; once the
  step has trained and pushed, `Pumps.trained` removes the groups from the buffer (freeing
  their rows) and releases their rollouts in the background.

**Pushes land in flight** (``WeightSync.push(mode="recompute")``, ``FleetWeightSync(mode=
"recompute")``): generation pauses, the weights swap, the prefix cache resets with running
requests preempted, and in-flight calls *continue on the new weights* with their KV
recomputed. So a call can span two versions (its span's ``weight_version`` and
``weight_version_last`` differ; counted as ``calls_spanning_versions``) and no token is
conditioned on KV computed by older weights (``tokens_stale_kv`` is 0). Interrupting calls
and resuming them as partial rollouts was not chosen: the harness is a black box that
cannot resume a call, and an interrupted call would poison its whole rollout.

At the end (`pumping` exits) the rollout pump stops admitting, the groups in flight finish
and are collected, and every group still in the buffer is removed and its rollouts
released.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from tokcap_core import Accept
from tokcap_tq import TQGroupBuffer

from ..compose import Batch, Policy, clear_orphaned
from ._harness import Harness, finished
from ._staleness import SkipCount, StalenessPolicy
from ._step import Taken
from ._task import WITNESSES, DigitsEpisode, group_image, group_prompt

__all__ = ["Pumps", "pumping"]


@dataclass(slots=True)
class _Group:
    """One group on its way from the rollout pump to a training step."""

    index: int
    group_id: str
    episodes: list[DigitsEpisode]
    batch: Batch = field(default_factory=Batch)
    """Its collection: the accepted group's rows (read by its collector, off the loop's
    path) and advantages."""
    played_at: float = 0.0
    """When its last rollout finished playing (``time.perf_counter``)."""
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def rollout_ids(self) -> list[str]:
        return [e.rollout_id for e in self.episodes]


class Pumps:
    """The async feed (see the module): what the pumps and the steps share, all on one event
    loop (so no lock): admission, READY groups, the buffer. ``trainer`` is read for its
    version (what staleness is judged against)."""

    def __init__(self, harness: Harness, trainer: Policy, background: TaskGroup) -> None:
        config = harness.config
        self.harness, self.trainer, self.background = harness, trainer, background
        self.policy = StalenessPolicy(
            max_staleness=config.max_staleness,
            groups_per_step=config.groups,
            max_skipped=config.skip_bound,
        )
        self.skips = SkipCount(self.policy.max_skipped)
        self.buffer = TQGroupBuffer(harness.stack.sink)
        self.live = 0
        self.steps_done = 0
        self.stopping = False
        self.ready: deque[_Group] = deque()
        self._changed = anyio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def admit(self) -> bool:
        """Wait until one more group may start (True, counted live) or the run stops (False)."""
        while True:
            if self.stopping:
                return False
            if self.policy.may_start(live=self.live, steps_done=self.steps_done):
                self.live += 1
                return True
            await self._changed.wait()

    async def next_ready(self) -> _Group:
        """The oldest READY, accepted group (waits for one)."""
        while not self.ready:
            await self._changed.wait()
        return self.ready.popleft()

    def put_ready(self, group: _Group) -> None:
        self.ready.append(group)
        self._notify()

    def discard(self, reason: str) -> None:
        """A group will not train: count it (bounded) and let a spare prompt start."""
        self.live -= 1
        self._notify()
        self.skips.skip(reason)

    def stop(self) -> None:
        self.stopping = True
        self._notify()

    async def take(self, step: int) -> Taken:
        """G READY groups fresh enough for the version about to train (a stale one is
        discarded and freed), as one batch; what the step waited on, and their own seconds
        (overlapped: summed over the groups)."""
        groups_per_step = self.policy.groups_per_step
        seconds: dict[str, float] = {"wait": 0.0, "collect_wait": 0.0}
        taken: list[_Group] = []
        dropped_stale = 0
        while len(taken) < groups_per_step:
            waited = time.perf_counter()
            group = await self.next_ready()
            fetched = time.perf_counter()
            seconds["wait"] += fetched - waited
            # the part of the wait after this group had played: blocked on collecting it
            seconds["collect_wait"] += max(0.0, fetched - max(waited, group.played_at))
            reason = self.policy.judge(group.batch.rows, self.trainer.version)
            if reason is None:
                taken.append(group)
                continue
            dropped_stale += 1
            self.background.start_soon(self._free, [group.batch])
            self.discard(reason)
        for name in ("generate", "capture_verify", "reassemble"):
            seconds[name] = sum(g.seconds.get(name, 0.0) for g in taken)
        return Taken(
            episodes=[e for g in taken for e in g.episodes],
            batch=_joined([g.batch for g in taken]),
            seconds=seconds,
            dropped_stale=dropped_stale,
            skipped=self.skips.reasons,
        )

    def trained(self, taken: Taken) -> None:
        """A step is done (admission moves on); free its groups in the background."""
        self.steps_done += 1
        self._notify()
        self.background.start_soon(self._free, [taken.batch])

    async def _rollout_pump(self, send: MemoryObjectSendStream[_Group]) -> None:
        """Start groups while admitted, `LoopConfig.groups_in_flight` at a time."""
        in_flight = anyio.Semaphore(self.harness.config.groups_in_flight)
        async with send, anyio.create_task_group() as tg:
            index = 0
            while True:
                await in_flight.acquire()
                if not await self.admit():
                    in_flight.release()
                    break
                tg.start_soon(self._play_one, index, in_flight, send.clone())
                index += 1

    async def _play_one(
        self, index: int, in_flight: anyio.Semaphore, send: MemoryObjectSendStream[_Group]
    ) -> None:
        config = self.harness.config
        group_id = f"{config.tag}-a{index:05d}"
        group = _Group(
            index=index,
            group_id=group_id,
            episodes=[
                DigitsEpisode(
                    rollout_id=f"{group_id}-r{i:02d}",
                    group_id=group_id,
                    witness=WITNESSES[i % len(WITNESSES)],
                    prompt=group_prompt(config.seed, index),
                    image=group_image(config.seed, index) if config.images else None,
                )
                for i in range(config.rollouts)
            ],
        )
        async with send:
            try:
                start = time.perf_counter()
                await self.harness.play(group.episodes, index)
                group.played_at = time.perf_counter()
                group.seconds["generate"] = group.played_at - start
            finally:
                in_flight.release()
            await send.send(group)

    async def _collectors(self, played: MemoryObjectReceiveStream[_Group]) -> None:
        """Collect every played group (one task each) until the rollout pump is done."""
        async with played, anyio.create_task_group() as tg:
            async for group in played:
                tg.start_soon(self._collect, group)

    async def _collect(self, group: _Group) -> None:
        """`Stack.collect` the group, hand its rows to the buffer (READY), then let it train
        (accepted) or discard it."""
        start = time.perf_counter()
        batch = await self.harness.stack.collect([finished(e) for e in group.episodes])
        assert batch.timings is not None
        verified = start + batch.timings.close_s
        ids = group.rollout_ids
        await self.buffer.reserve(group.group_id, ids, self.trainer.version, self.steps_done)
        for finalized in batch.groups:
            await self.buffer.commit_finalized(finalized, receipts=batch.receipts.values())
        group.batch = batch
        group.seconds["capture_verify"] = batch.timings.close_s
        group.seconds["reassemble"] = time.perf_counter() - verified
        decision = batch.decisions[group.group_id]
        if isinstance(decision, Accept):
            self.put_ready(group)
            return
        await self._free([batch])
        self.discard(decision.reason)

    async def _free(self, batches: Sequence[Batch]) -> None:
        """Remove READY groups (their training rows cleared) and release their rollouts."""
        stack, fleet = self.harness.stack, self.harness.fleet
        await self.buffer.remove([g.group_id for b in batches for g in b.groups])
        if fleet is not None and fleet.lost():  # what a lost gate's rollouts staged
            await clear_orphaned(fleet, stack.sink)
        await stack.control.release_many([r for b in batches for r in b.receipts])

    async def _drain(self) -> None:
        """After the last step: free every group still READY (its rows, its rollouts)."""
        leftover = [g.batch for g in self.ready]
        self.ready.clear()
        if leftover:
            await self._free(leftover)


@contextlib.asynccontextmanager
async def pumping(harness: Harness, trainer: Policy, background: TaskGroup) -> AsyncIterator[Pumps]:
    """The pumps running (see the module); on exit the rollout pump stops, the groups in
    flight finish and are collected, and what is left READY is freed (shielded)."""
    pumps = Pumps(harness, trainer, background)
    played_send, played_recv = anyio.create_memory_object_stream[_Group](math.inf)
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pumps._rollout_pump, played_send)
            tg.start_soon(pumps._collectors, played_recv)
            try:
                yield pumps
            finally:
                pumps.stop()
    finally:
        with anyio.CancelScope(shield=True):
            await pumps._drain()


def _joined(batches: Sequence[Batch]) -> Batch:
    """The groups of ``batches`` as one batch, in order (advantages are per group)."""
    return Batch(
        receipts={k: r for b in batches for k, r in b.receipts.items()},
        groups=[g for b in batches for g in b.groups],
        decisions={k: d for b in batches for k, d in b.decisions.items()},
        rows=[row for b in batches for row in b.rows],
        advantages=[a for b in batches for a in b.advantages],
    )
