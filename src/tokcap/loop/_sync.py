"""The lock-step ``tokcap train`` step: generate, collect, train, push (see `tokcap.loop`).

`run_step` plays the step's chats, then collects every group in one collection
(`tokcap.compose.collect`: one batch close whose answer carries the manifests, receipts
verified, one reassembly bundle per reassembler actor, one read of the rows), trains,
pushes, and leaves `_finish` (free the rows, release the rollouts) to run while the next
step generates.

Why one collection after the last answer rather than each group as soon as it has
played: a sync step trains on every group at once, so collecting early can only hide
work behind the generation still running. On ``tokcap train``'s task the groups finish
within tens of milliseconds of each other and that overlap measured 0.3 % of a step,
while every group collected on its own paid its own close (waiting for calls still being
staged), reassembly and read, all at once on the same cores. `bench/bench_train.py`
measured the work left after the last answer at 0.18 s collecting group by group (four
collections at once, quiet box; and one at a time in a group commit, loaded box) against
0.12-0.14 s in one collection (quiet box). An asynchronous run (`tokcap.loop._async`)
collects each group as soon as it has played.
"""

from __future__ import annotations

import time

import anyio

from ..compose import Batch, CollectTimings, Finished, Stack
from ._step import StepContext, StepRecord, _Clock, play_group, step_record
from ._task import WITNESSES, DigitsEpisode, group_prompt

__all__ = ["run_step"]


async def run_step(loop: StepContext, step: int) -> StepRecord:
    """Play, collect, train and push one step; its record (``finish`` left running).

    Once every rollout has played, all groups are collected in one collection
    (`StepTail.collect`): what blocks the step is the work left once the last answer came
    back. Nothing is pushed before the step trains, so every row is still sampled by the
    version being trained.
    """
    config = loop.run.config
    clock = _Clock()
    started = time.perf_counter()
    episodes = [
        DigitsEpisode(
            rollout_id=f"{config.tag}-s{step:04d}-g{g:02d}-r{i:02d}",
            group_id=f"{config.tag}-s{step:04d}-g{g:02d}",
            witness=WITNESSES[i % len(WITNESSES)],
            prompt=group_prompt(config.seed, g),
        )
        for g in range(config.groups)
        for i in range(config.rollouts)
    ]
    tail = StepTail(started, episodes)
    await play_group(loop, episodes, step, played=tail.played)
    batch = await tail.collect(loop.stack)
    clock.seconds.update(tail.seconds(time.perf_counter()))
    if loop.observe is not None:
        observed = time.perf_counter()
        loop.observe(step, episodes, batch, loop.trainer)
        started += time.perf_counter() - observed
    trained_version = loop.trainer.version
    with clock.time("train"):
        report = await anyio.to_thread.run_sync(loop.trainer.step, batch.rows, batch.advantages)
    with clock.time("push"):
        pushed = await loop.push(loop.trainer)
    clock.seconds["total"] = time.perf_counter() - started
    loop.background.start_soon(_finish, loop, batch, clock)
    return step_record(
        loop,
        step,
        episodes=episodes,
        rows=batch.rows,
        receipts=list(batch.receipts.values()),
        report=report,
        pushed=pushed,
        trained_version=trained_version,
        seconds=clock.seconds,
        groups_accepted=len(batch.accepted),
    )


class StepTail:
    """A sync step's rollouts as they finish playing, their one collection, and the timing
    of what was left to do after the last answer.

    Stages are wall-clock segments of the step: ``generate`` ends when the harness got its
    last answer (a ``declared`` rollout's declaration comes after it: tokcap's work);
    ``capture_verify`` runs from there until every receipt is verified (the batch close);
    ``reassemble`` until every row is read. The collection's parts are given too:
    ``close`` (receipts verified from its answer), ``fetch_receipts`` (any it left out),
    ``pool`` (the reassemblers' bundles) and ``read_rows``.
    """

    def __init__(self, started: float, episodes: list[DigitsEpisode]) -> None:
        self.started = started
        self.last_answer = started
        self.episodes = episodes
        self.timings: CollectTimings | None = None
        """The collection's timings, once it ran."""
        self.collect_started = started
        """When the collection started (``perf_counter``)."""

    def played(self, episode: DigitsEpisode, answered: float) -> None:
        """Note a rollout done, its last answer at ``answered``."""
        self.last_answer = max(self.last_answer, answered)

    async def collect(self, stack: Stack) -> Batch:
        """Every group in one collection (`tokcap.compose.collect`), its rows in group order
        (each group's advantages against its own baseline, as GRPO's are)."""
        self.collect_started = time.perf_counter()
        batch = await stack.collect([_finished(e) for e in self.episodes])
        assert batch.timings is not None
        self.timings = batch.timings
        return batch

    def seconds(self, collected: float) -> dict[str, float]:
        """The step's stages up to ``collected`` (every row read), and the collection's parts."""
        t = self.timings or CollectTimings(
            close_s=0.0, receipts_s=0.0, reassemble_s=0.0, rows_s=0.0
        )
        verified = max(self.last_answer, self.collect_started + t.close_s + t.receipts_s)
        return {
            "generate": self.last_answer - self.started,
            "capture_verify": verified - self.last_answer,
            "reassemble": collected - verified,
            "close": t.close_s,
            "fetch_receipts": t.receipts_s,
            "pool": t.reassemble_s,
            "read_rows": t.rows_s,
        }


def _finished(e: DigitsEpisode) -> Finished:
    """What the scorer hands over for ``e``: its reward and witness. A rollout whose gate was
    lost mid-play has no answer: it closes without a witness (its receipt is poisoned
    ``gate_unreachable``) and trains no row."""
    return Finished(
        rollout_id=e.rollout_id,
        group_id=e.group_id,
        reward=e.reward,
        response_id=_last(e.response_ids) if e.scored == "response_id" else None,
        content=_last(e.contents) if e.scored == "content" else None,
    )


def _last(answers: list[str]) -> str | None:
    return answers[-1] if answers else None


async def _finish(loop: StepContext, batch: Batch, clock: _Clock) -> None:
    """Free the step's rows and release its rollouts (while the next step generates)."""
    with clock.time("finish"):
        await loop.stack.finish(batch)
