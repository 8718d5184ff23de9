"""``tokcap train --async``: a rollout pump and a train pump on one event loop.

The shape is NeMo-RL's single controller, with tokcap's custody in between:

- the **rollout pump** starts groups (G rollouts of one prompt each) while the staleness
  policy admits them (`StalenessPolicy.may_start`: at most ``(steps_done + K + 1) * G``
  live groups), a bounded number at a time, and hands every played group to
- the **collectors** (one task per group, in the train pump's task group; the harness has
  declared terminals as each rollout ended): close the group's rollouts in one batch (one
  shared fsync), fetch receipts verified against the closes' heads,
  ``reserve`` a slot in the replay buffer (`tokcap_tq.TQGroupBuffer`), reassemble on the
  Ray pool, ``commit_finalized`` (READY), and let the group policy decide; an accepted
  group's rows are read here, off the train pump's path; a group the policy rejects is
  removed at once and a spare prompt starts in its place;
- the **train pump** takes READY groups in commit order, discards a group
  holding a token sampled more than K versions behind the trainer (`StalenessPolicy.judge`,
  counted ``stale``, refilled), trains on G groups, pushes the weights, and removes the
  groups from the buffer (freeing their rows) and releases their rollouts in the background.

**Pushes land in flight** (``WeightSync.push(mode="recompute")``, ``FleetWeightSync(mode=
"recompute")``): generation pauses, the weights swap, the prefix cache resets with running
requests preempted, and in-flight calls *continue on the new weights* with their KV
recomputed. So a call can span two versions (its span's ``weight_version`` and
``weight_version_last`` differ; counted as ``calls_spanning_versions``) and no token is
conditioned on KV computed by older weights (``tokens_stale_kv`` is 0). Interrupting calls
and resuming them as partial rollouts was not chosen: the harness is a black box that
cannot resume a call, and an interrupted call would poison its whole rollout.

At the end the rollout pump stops admitting, the groups in flight finish and are
collected, and every group still in the buffer is removed and its rollouts released.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from tokcap_core import (
    Accept,
    FinalizedGroup,
    ReassemblyRequest,
    Receipt,
    TrainingRow,
    decide_group,
    grpo,
)
from tokcap_tq import TQGroupBuffer
from tokcap_vllm import RolloutClose

from .._stages import Stages
from ..compose import Batch, clear_orphaned, close_verified
from ._staleness import SkipCount, StalenessPolicy
from ._step import StepContext, StepRecord, play_group, step_record
from ._task import WITNESSES, DigitsEpisode, group_prompt
from ._watchdog import LagWatch

__all__ = ["async_steps"]


@dataclass(slots=True)
class _Group:
    """One group on its way from the rollout pump to a training step."""

    index: int
    group_id: str
    episodes: list[DigitsEpisode]
    receipts: list[Receipt] = field(default_factory=list)
    finalized: FinalizedGroup | None = None
    rows: list[TrainingRow] = field(default_factory=list)
    """The accepted group's rows, read by its collector (off the train pump's path)."""
    played_at: float = 0.0
    """When its last rollout finished playing (``time.perf_counter``)."""
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def rollout_ids(self) -> list[str]:
        return [e.rollout_id for e in self.episodes]


class _Pumps:
    """What the pumps share (all on one event loop, so no lock): admission and READY groups."""

    def __init__(self, policy: StalenessPolicy) -> None:
        self.policy = policy
        self.skips = SkipCount(policy.max_skipped)
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

    def step_done(self) -> None:
        self.steps_done += 1
        self._notify()

    def stop(self) -> None:
        self.stopping = True
        self._notify()


async def async_steps(
    loop: StepContext,
    stages: Stages,
    on_step: Callable[[StepRecord], None] | None,
    lag: LagWatch,
    stamp: Callable[[StepRecord], Awaitable[StepRecord]],
) -> None:
    """Train ``config.steps`` steps with the two pumps; record each step in ``loop.run``."""
    config = loop.run.config
    pumps = _Pumps(
        StalenessPolicy(
            max_staleness=config.max_staleness,
            groups_per_step=config.groups,
            max_skipped=config.skip_bound,
        )
    )
    buffer = TQGroupBuffer(loop.stack.sink)
    played_send, played_recv = anyio.create_memory_object_stream[_Group](math.inf)
    try:
        with stages.stage(f"train ({config.steps} steps, async)", total=config.steps) as advance:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_rollout_pump, loop, pumps, played_send)
                tg.start_soon(_collectors, loop, pumps, buffer, played_recv)
                try:
                    for step in range(config.steps):
                        record = await stamp(await _train_step(loop, pumps, buffer, step, lag))
                        loop.run.steps.append(record)
                        if on_step is not None:
                            on_step(record)
                        advance(1)
                finally:
                    pumps.stop()
    finally:
        with anyio.CancelScope(shield=True):
            await _drain(loop, pumps, buffer)


async def _rollout_pump(
    loop: StepContext, pumps: _Pumps, send: MemoryObjectSendStream[_Group]
) -> None:
    """Start groups while admitted, `LoopConfig.groups_in_flight` at a time."""
    config = loop.run.config
    in_flight = anyio.Semaphore(config.groups_in_flight)
    async with send, anyio.create_task_group() as tg:
        index = 0
        while True:
            await in_flight.acquire()
            if not await pumps.admit():
                in_flight.release()
                break
            tg.start_soon(_play_one, loop, index, in_flight, send.clone())
            index += 1


async def _play_one(
    loop: StepContext,
    index: int,
    in_flight: anyio.Semaphore,
    send: MemoryObjectSendStream[_Group],
) -> None:
    config = loop.run.config
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
            )
            for i in range(config.rollouts)
        ],
    )
    async with send:
        try:
            start = time.perf_counter()
            await play_group(loop, group.episodes, index)
            group.played_at = time.perf_counter()
            group.seconds["generate"] = group.played_at - start
        finally:
            in_flight.release()
        await send.send(group)


async def _collectors(
    loop: StepContext,
    pumps: _Pumps,
    buffer: TQGroupBuffer,
    played: MemoryObjectReceiveStream[_Group],
) -> None:
    """Collect every played group (one task each) until the rollout pump is done."""
    async with played, anyio.create_task_group() as tg:
        async for group in played:
            tg.start_soon(_collect, loop, pumps, buffer, group)


async def _collect(loop: StepContext, pumps: _Pumps, buffer: TQGroupBuffer, group: _Group) -> None:
    """Close, verify, reserve, reassemble, commit, decide: the group READY or discarded."""
    stack, capture = loop.stack, loop.stack.capture
    start = time.perf_counter()
    closes = [
        RolloutClose(
            rollout_id=e.rollout_id,
            reward=e.reward,
            # a rollout whose gate was lost mid-play has no answer: no witness, poisoned
            response_id=next(reversed(e.response_ids), None) if e.scored == "response_id" else None,
            content=next(reversed(e.contents), None) if e.scored == "content" else None,
        )
        for e in group.episodes
    ]
    # one request per gate, one shared fsync (group commit); the receipts come with it
    by_id = await close_verified(stack.control, closes, capture)
    ids = group.rollout_ids
    group.receipts = [by_id[r] for r in ids]
    verified = time.perf_counter()
    group.seconds["capture_verify"] = verified - start
    await buffer.reserve(group.group_id, ids, loop.trainer.version, pumps.steps_done)
    group.finalized = await stack.pool.submit(
        ReassemblyRequest(
            group_id=group.group_id,
            rollout_ids=tuple(ids),
            receipts=tuple(by_id[r] for r in ids),
            rewards=tuple(by_id[r].reward for r in ids),
            max_seq_len=capture.max_seq_len,
        )
    )
    await buffer.commit_finalized(group.finalized, receipts=group.receipts)
    group.seconds["reassemble"] = time.perf_counter() - verified
    decision = decide_group(group.finalized, min_valid_fraction=capture.min_valid_fraction)
    if isinstance(decision, Accept):
        group.rows = await stack.sink.fetch(group.finalized.training_keys)
        group.seconds["reassemble"] = time.perf_counter() - verified
        pumps.put_ready(group)
        return
    await _free(loop, buffer, [group])
    pumps.discard(decision.reason)


async def _free(loop: StepContext, buffer: TQGroupBuffer, groups: list[_Group]) -> None:
    """Remove READY groups (their training rows cleared) and release their rollouts."""
    await buffer.remove([g.group_id for g in groups])
    if loop.fleet is not None and loop.fleet.lost():  # what a lost gate's rollouts staged
        await clear_orphaned(loop.fleet, loop.stack.sink)
    await loop.stack.control.release_many([r for g in groups for r in g.rollout_ids])


async def _train_step(
    loop: StepContext, pumps: _Pumps, buffer: TQGroupBuffer, step: int, lag: LagWatch
) -> StepRecord:
    """Take G fresh-enough groups, train, push; the step's record."""
    config, trainer = loop.run.config, loop.trainer
    started = time.perf_counter()
    seconds: dict[str, float] = {"wait": 0.0, "collect_wait": 0.0}
    taken: list[tuple[_Group, list[TrainingRow]]] = []
    dropped_stale = 0
    while len(taken) < config.groups:
        waited = time.perf_counter()
        group = await pumps.next_ready()
        fetched = time.perf_counter()
        rows = group.rows  # read by its collector, while other groups generated
        seconds["wait"] += fetched - waited
        # the part of the wait after this group had played: blocked on collecting it
        seconds["collect_wait"] += max(0.0, fetched - max(waited, group.played_at))
        reason = pumps.policy.judge(rows, trainer.version)
        if reason is None:
            taken.append((group, rows))
            continue
        dropped_stale += 1
        loop.background.start_soon(_free, loop, buffer, [group])
        pumps.discard(reason)
    groups = [g for g, _ in taken]
    rows = [row for _, group_rows in taken for row in group_rows]
    group_of = {r: g.group_id for g in groups for r in g.rollout_ids}
    advantages = grpo(
        [row.reward or 0.0 for row in rows],
        [group_of[row.rollout_id] for row in rows],
        [row.sample_mask for row in rows],
        rollout_ids_N=[row.rollout_id for row in rows],
    )
    for name in ("generate", "capture_verify", "reassemble"):  # overlapped, per group summed
        seconds[name] = sum(g.seconds.get(name, 0.0) for g in groups)
    episodes = [e for g in groups for e in g.episodes]
    if loop.observe is not None:
        observed = time.perf_counter()
        loop.observe(step, episodes, Batch(rows=rows, advantages=advantages), trainer)
        started += time.perf_counter() - observed
    trained_version = trainer.version
    start = time.perf_counter()
    report = await anyio.to_thread.run_sync(trainer.step, rows, advantages)
    seconds["train"] = time.perf_counter() - start
    pushed = await loop.push(trainer)
    seconds["push"] = time.perf_counter() - start - seconds["train"]
    pumps.step_done()
    loop.background.start_soon(_free, loop, buffer, groups)
    seconds["total"] = time.perf_counter() - started
    return step_record(
        loop,
        step,
        episodes=episodes,
        rows=rows,
        receipts=[r for g in groups for r in g.receipts],
        report=report,
        pushed=pushed,
        trained_version=trained_version,
        seconds=seconds,
        groups_accepted=len(groups),
        dropped_stale=dropped_stale,
        skipped=dict(pumps.skips.reasons),
        loop_lag_ms_max=lag.take(),
    )


async def _drain(loop: StepContext, pumps: _Pumps, buffer: TQGroupBuffer) -> None:
    """After the last step: free every group still READY (its rows, its rollouts)."""
    leftover = list(pumps.ready)
    pumps.ready.clear()
    if leftover:
        await _free(loop, buffer, leftover)
