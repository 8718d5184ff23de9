"""The lock-step ``tokcap train`` step: generate, collect, train, push (see `tokcap.loop`).

`run_step` plays the step's chats and collects each group (`tokcap.compose.collect`: one
batch close, receipts verified, reassembly, rows read) as soon as its rollouts have played,
while the other groups still generate; then trains, pushes, and leaves `_finish` (free the
rows, release the rollouts) to run while the next step generates.
"""

from __future__ import annotations

import time

import anyio

from ..compose import Batch, Finished, Stack
from ._step import StepContext, StepRecord, _Clock, play_group, step_record
from ._task import WITNESSES, DigitsEpisode, group_prompt

__all__ = ["run_step"]

_WORK = ("close", "fetch_receipts", "pool", "read_rows")
"""The collecting work a sync step sums over its groups (seconds): closing (receipts
verified from the reply), fetching receipts the closes did not answer, the Ray pool's
reassembly, and reading the accepted rows (`tokcap.compose.CollectTimings`)."""


async def run_step(loop: StepContext, step: int) -> StepRecord:
    """Play, collect, train and push one step; its record (``finish`` left running).

    Each group is collected (closed in one batch whose answer carries the manifests,
    receipts verified, reassembled, its rows read) as soon as its last rollout has played,
    while the other groups still generate: what blocks the step is only the work left once
    the last answer came back (`StepTail`). Nothing is pushed before the step trains, so
    every row is still sampled by the version being trained.
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
    async with anyio.create_task_group() as collectors:

        def played(episode: DigitsEpisode, answered: float) -> None:
            group = tail.played(episode, answered)
            if group is not None:
                collectors.start_soon(tail.collect, loop.stack, group)

        await play_group(loop, episodes, step, played=played)
    batch = tail.batch()
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
    """A sync step's groups, each collected once its rollouts have played, and the timing
    of what was left to do after the last answer.

    Stages are wall-clock segments of the step: ``generate`` ends when the harness got its
    last answer; ``capture_verify`` runs from there until every group's receipts are
    verified (declares, closes, receipts still pending); ``reassemble`` until every group's
    rows are read. The per-group work done while other groups were still generating is
    summed apart (``overlapped``; ``close`` and ``fetch_receipts`` are summed per group:
    ``close`` verifies the receipts its answer carried, ``fetch_receipts`` any it left out).
    """

    def __init__(self, started: float, episodes: list[DigitsEpisode]) -> None:
        self.started = started
        self.last_answer = started
        self.groups: dict[str, list[DigitsEpisode]] = {}
        for episode in episodes:
            self.groups.setdefault(episode.group_id, []).append(episode)
        self._left = {g: len(members) for g, members in self.groups.items()}
        self._batches: dict[str, Batch] = {}
        self._verified: list[float] = []
        self._spans: list[tuple[float, float]] = []
        self._work: dict[str, float] = dict.fromkeys(_WORK, 0.0)

    def played(self, episode: DigitsEpisode, answered: float) -> str | None:
        """Note a rollout done (its last answer at ``answered``); its group id once the
        group's last rollout is done."""
        self.last_answer = max(self.last_answer, answered)
        self._left[episode.group_id] -= 1
        return episode.group_id if self._left[episode.group_id] == 0 else None

    async def collect(self, stack: Stack, group_id: str) -> None:
        """Close, verify and reassemble one group (`tokcap.compose.collect`)."""
        start = time.perf_counter()
        batch = await stack.collect([_finished(e) for e in self.groups[group_id]])
        done = time.perf_counter()
        assert batch.timings is not None
        t = batch.timings
        self._batches[group_id] = batch
        self._verified.append(start + t.close_s + t.receipts_s)
        self._work["close"] += t.close_s
        self._work["fetch_receipts"] += t.receipts_s
        self._work["pool"] += t.reassemble_s
        self._work["read_rows"] += t.rows_s
        self._spans.append((start, done))

    def batch(self) -> Batch:
        """Every group's batch in one, in group order (GRPO's advantages are per group)."""
        out = Batch()
        for group_id in sorted(self._batches):
            part = self._batches[group_id]
            out.receipts.update(part.receipts)
            out.groups.extend(part.groups)
            out.decisions.update(part.decisions)
            out.rows.extend(part.rows)
            out.advantages.extend(part.advantages)
        return out

    def seconds(self, collected: float) -> dict[str, float]:
        """The step's stages up to ``collected`` (all groups read), and the summed work."""
        verified = max([self.last_answer, *self._verified])
        return {
            "generate": self.last_answer - self.started,
            "capture_verify": verified - self.last_answer,
            "reassemble": collected - verified,
            "overlapped": sum(max(0.0, min(b, self.last_answer) - a) for a, b in self._spans),
            **self._work,
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
