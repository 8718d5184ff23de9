"""The steps of a ``tokcap train`` run: lock-step or with two pumps, under a lag watchdog."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import openai
from rich.markup import escape

from tokcap_vllm import GateFleet

from .._stages import Stages
from ..compose import Stack
from ._async import async_steps
from ._meters import CpuMeter
from ._step import (
    Observer,
    Pushed,
    StepContext,
    StepRecord,
    TrainRun,
    load_policy,
    new_trainer,
)
from ._sync import run_step
from ._watchdog import LagWatch

__all__ = ["Training", "train_steps"]


@dataclass(frozen=True, slots=True)
class Training:
    """A ``tokcap train`` run and who watches it (``on_step``, ``observe``): what the
    in-process wiring (`tokcap.loop._loop`) and the fleet's (`tokcap.loop._fleet`) share."""

    run: TrainRun
    stages: Stages
    on_step: Callable[[StepRecord], None] | None
    observe: Observer | None
    _policy: list[Any] = field(default_factory=list, init=False, repr=False)

    async def load_policy(self) -> None:
        """Load the trainer's policy in a worker thread (`load_policy`): an ``alongside``
        for `tokcap.compose.open_stack`, so it loads while the stack starts."""
        config = self.run.config
        self._policy.append(await anyio.to_thread.run_sync(load_policy, config.model, config.seed))

    async def train(
        self,
        stack: Stack,
        version: int,
        push: Callable[[Any], Awaitable[Pushed]],
        fleet: GateFleet | None,
    ) -> None:
        """A trainer of the loaded policy at the engines' ``version`` (`new_trainer`), then
        `train_steps` on ``stack`` with a task group for each step's `finish`."""
        run, (model,) = self.run, self._policy
        run.params = sum(p.numel() for p in model.parameters())
        trainer = new_trainer(model, run.config.lr, version, decoupled=run.config.decoupled)
        async with anyio.create_task_group() as background:
            loop = StepContext(
                run=run,
                stack=stack,
                trainer=trainer,
                push=push,
                fleet=fleet,
                background=background,
                observe=self.observe,
            )
            await train_steps(loop, self.stages, self.on_step)


async def train_steps(
    loop: StepContext, stages: Stages, on_step: Callable[[StepRecord], None] | None
) -> None:
    """Run every step of ``loop`` (sync or async, `LoopConfig.mode`), recording each one,
    with a watchdog on the event loop's lag."""
    lag, cpu = LagWatch(log=lambda line: stages.log(escape(f"[tokcap] {line}"))), CpuMeter()

    async def stamp(record: StepRecord) -> StepRecord:
        """Add the step's engine-busy seconds, calls in flight and CPU seconds."""
        record.seconds.update(loop.busy.take())
        record.seconds.update(await cpu.take())
        return record

    async with _harness_http() as loop.http, anyio.create_task_group() as watch:
        watch.start_soon(lag.run)
        await cpu.start()
        loop.busy.take()
        if loop.run.config.mode == "async":
            await async_steps(loop, stages, on_step, lag, stamp)
        else:
            await _sync_steps(loop, stages, on_step, lag, stamp)
        watch.cancel_scope.cancel()
    loop.run.loop_lag_ms_max = lag.run_ms
    stages.log(escape(f"[tokcap] {lag.summary()}"))


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


HARNESS_KEEPALIVE_S = 2.0
"""How long the harness keeps an idle connection to a gate: shorter than the gate's own
keep-alive (vLLM's default 5 s), so it never sends a call on a connection the gate is
closing (a reset, taken for a dead gate)."""


def _harness_http() -> openai.DefaultAsyncHttpxClient:
    """The harness's shared HTTP client: openai's defaults, idle connections kept less long."""
    limits = openai.DEFAULT_CONNECTION_LIMITS
    return openai.DefaultAsyncHttpxClient(
        limits=type(limits)(
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=HARNESS_KEEPALIVE_S,
        )
    )
