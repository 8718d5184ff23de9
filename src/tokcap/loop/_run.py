"""The steps of a ``tokcap train`` run: lock-step or with two pumps, under a lag watchdog."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

import anyio
import openai

from .._stages import Stages
from ._async import async_steps
from ._meters import CpuMeter
from ._step import StepContext, StepRecord
from ._sync import run_step
from ._watchdog import LagWatch

__all__ = ["train_steps"]


async def train_steps(
    loop: StepContext, stages: Stages, on_step: Callable[[StepRecord], None] | None
) -> None:
    """Run every step of ``loop`` (sync or async, `LoopConfig.mode`), recording each one,
    with a watchdog on the event loop's lag."""
    lag, cpu = LagWatch(), CpuMeter()

    async def stamp(record: StepRecord) -> StepRecord:
        """Add the step's engine-busy seconds, calls in flight and CPU seconds."""
        record.seconds.update(loop.busy.take())
        record.seconds.update(await cpu.take())
        return record

    async with openai.DefaultAsyncHttpxClient() as loop.http, anyio.create_task_group() as watch:
        watch.start_soon(lag.run)
        await cpu.start()
        loop.busy.take()
        if loop.run.config.mode == "async":
            await async_steps(loop, stages, on_step, lag, stamp)
        else:
            await _sync_steps(loop, stages, on_step, lag, stamp)
        watch.cancel_scope.cancel()
    loop.run.loop_lag_ms_max = lag.run_ms


async def _sync_steps(
    loop: StepContext,
    stages: Stages,
    on_step: Callable[[StepRecord], None] | None,
    lag: LagWatch,
    stamp: Callable[[StepRecord], Awaitable[StepRecord]],
) -> None:
    steps = loop.run.config.steps
    with stages.stage(f"train ({steps} steps)", total=steps) as advance:
        for step in range(steps):
            record = dataclasses.replace(await run_step(loop, step), loop_lag_ms_max=lag.take())
            record = await stamp(record)
            loop.run.steps.append(record)
            if on_step is not None:
                on_step(record)
            advance(1)
