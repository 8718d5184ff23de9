"""``tokcap train``'s lock-step feed: a step plays its chats, then collects them all at once.

`LockStep.take` plays the step's G x N chats, then collects every group in one collection
(`tokcap.compose.Stack.collect`: one batch close whose answer carries the manifests,
receipts verified, one reassembly bundle per reassembler actor, each group's rows read as
soon as its bundle is done); once the step has trained and pushed, `LockStep.trained`
leaves `finish` (free the rows, release the rollouts) to run while the next step
generates. Nothing is pushed before a step trains, so every row is sampled by the version
being trained (staleness 0).

Why one collection after the last answer rather than each group as soon as it has
played: a sync step trains on every group at once, so collecting early can only hide
work behind the generation still running. On ``tokcap train``'s task the groups finish
within tens of milliseconds of each other and that overlap measured 0.3 % of a step,
while every group collected on its own paid its own close (waiting for calls still being
staged), reassembly and read, all at once on the same cores. `bench/bench_train.py`
measured the work left after the last answer at 0.18 s collecting group by group (four
collections at once, quiet box; and one at a time in a group commit, loaded box) against
0.12-0.14 s in one collection (quiet box) on an earlier machine; one collection now
takes about 40 ms (close 15, while the pool's actor reads the staged calls ahead; the
one bundle 18-19; reading every row at once 7). An
asynchronous run (`tokcap.loop._async`) collects each group as soon as it has played,
with the same `Stack.collect`.
"""

from __future__ import annotations

import time

from anyio.abc import TaskGroup

from ..compose import Batch, CollectTimings, Stack
from ._harness import Harness, finished
from ._step import Taken
from ._task import WITNESSES, DigitsEpisode, group_image, group_prompt

__all__ = ["LockStep", "StepTail"]


class LockStep:
    """The lock-step feed: ``harness`` plays each step's chats on its run's gates; each
    step's `finish` runs in ``background``."""

    def __init__(self, harness: Harness, background: TaskGroup) -> None:
        self.harness, self.background = harness, background

    async def take(self, step: int) -> Taken:
        """Play step ``step``'s chats, then collect them all in one collection (`StepTail`):
        what blocks the step is the work left once the last answer came back."""
        config = self.harness.config
        started = time.perf_counter()
        episodes = [
            DigitsEpisode(
                rollout_id=f"{config.tag}-s{step:04d}-g{g:02d}-r{i:02d}",
                group_id=f"{config.tag}-s{step:04d}-g{g:02d}",
                witness=WITNESSES[i % len(WITNESSES)],
                prompt=group_prompt(config.seed, g),
                image=group_image(config.seed, g) if config.images else None,
            )
            for g in range(config.groups)
            for i in range(config.rollouts)
        ]
        tail = StepTail(started, episodes)
        await self.harness.play(episodes, step, played=tail.played)
        batch = await tail.collect(self.harness.stack)
        return Taken(episodes=episodes, batch=batch, seconds=tail.seconds(time.perf_counter()))

    def trained(self, taken: Taken) -> None:
        """Free the step's rows and release its rollouts while the next step generates."""
        self.background.start_soon(_finish, self.harness.stack, taken.batch, taken.seconds)


class StepTail:
    """A sync step's rollouts as they finish playing, their one collection, and the timing
    of what was left to do after the last answer.

    Stages are wall-clock segments of the step: ``generate`` ends when the harness got its
    last answer; ``capture_verify`` runs from there until every receipt is verified (the
    batch close, which declares the ``declared`` rollouts' terminals too);
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
        batch = await stack.collect([finished(e) for e in self.episodes])
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


async def _finish(stack: Stack, batch: Batch, seconds: dict[str, float]) -> None:
    """`Stack.finish` on ``batch``, its time added to the step's ``seconds`` (``finish``)."""
    start = time.perf_counter()
    try:
        await stack.finish(batch)
    finally:
        seconds["finish"] = seconds.get("finish", 0.0) + time.perf_counter() - start
