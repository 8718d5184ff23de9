"""``tokcap train --gates N`` / ``--gate URL``: the loop through gates in other processes.

The run starts Ray + TransferQueue as the in-process loop does (`tokcap.compose.services`),
then N ``tokcap-vllm serve`` gates (`tokcap.compose.served_gates`: the real CLI, staging
into that TransferQueue, ``--tokcap-require-open``, weight pushes through vLLM's
weight-transfer API), or takes gates someone else started. Each step opens every rollout
through a `tokcap_vllm.GateFleet` (the gate with the fewest open rollouts), plays it on
that gate's URL, and the fleet routes closes, receipts and releases; the trainer pushes
through `tokcap_vllm.FleetWeightSync` and reads every gate's version after each push.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from tokcap_core import CaptureConfig, ConfigError
from tokcap_tq import TQSink
from tokcap_vllm import GateFleet
from tokcap_vllm.weights import FleetWeightSync

from .._stages import Stages
from ..compose import (
    FleetEndpoint,
    FleetGate,
    fleet_services,
    fleet_token,
    gate_entries,
    gate_versions,
    open_stack,
    push_to_live_gates,
    reclaim_rollouts,
    served_model,
)
from ..demo import QWEN_VLLM_ARGS
from ._run import train_steps
from ._step import (
    Observer,
    Pushed,
    StepContext,
    StepRecord,
    TrainRun,
    load_policy,
    new_trainer,
)

__all__ = ["run_fleet"]


def run_fleet(
    run: TrainRun,
    sink: TQSink,
    capture: CaptureConfig,
    stages: Stages,
    on_step: Callable[[StepRecord], None] | None,
    observe: Observer | None,
) -> None:
    """Start the services and the gates (or take ``config.gate_urls``), train, stop."""
    config = run.config
    token = fleet_token(config.gate_urls, capture)
    with fleet_services(
        config.model,
        count=config.gates,
        urls=config.gate_urls,
        ray_address=config.ray_address,
        workers=config.workers,
        sink=sink.config,
        token=token,
        vllm_args=QWEN_VLLM_ARGS,
        stage=stages.stage,
    ) as gates:
        anyio.run(_drive, run, gates, token, sink, capture, stages, on_step, observe)


async def _drive(
    run: TrainRun,
    gates: list[FleetGate],
    token: str,
    sink: TQSink,
    capture: CaptureConfig,
    stages: Stages,
    on_step: Callable[[StepRecord], None] | None,
    observe: Observer | None,
) -> None:
    config = run.config
    urls = [g.url for g in gates]
    policy: list[Any] = []

    async def load() -> None:
        policy.append(await anyio.to_thread.run_sync(load_policy, config.model, config.seed))

    async with (
        GateFleet(urls, token) as fleet,
        FleetWeightSync([(url, token) for url in urls], mode=config.push_mode) as weights,
    ):
        if config.gate_urls:  # gates that outlive trainers: take back what a dead one held
            reclaimed = await reclaim_rollouts(urls, token, sink)
            stages.log(f"reclaimed rollouts a previous trainer left: {reclaimed}")
        model = await served_model(urls[0]) if config.gate_urls else str(config.model)
        endpoint = FleetEndpoint(fleet, model, urls)
        async with open_stack(
            [endpoint],
            sink=sink,
            capture=capture,
            workers=config.workers,
            control=fleet,
            alongside=[load],
            stage=stages.stage,
            label="Ray pool, trainer",
        ) as stack:
            (model,) = policy
            start = await _pushed(fleet, weights)
            if len(set(start.gate_versions)) != 1:
                raise ConfigError("bad_gates", f"gates at different versions: {start}")
            run.params = sum(p.numel() for p in model.parameters())
            trainer = new_trainer(
                model, config.lr, start.gate_versions[0], decoupled=config.decoupled
            )
            pushed = [start.gate_versions[0]]

            async def push(trainer: Any) -> Pushed:
                if trainer.version > pushed[-1]:
                    await push_to_live_gates(fleet, weights, trainer.weights(), trainer.version)
                    pushed.append(trainer.version)
                return await _pushed(fleet, weights)

            async with anyio.create_task_group() as background:
                loop = StepContext(
                    run=run,
                    stack=stack,
                    trainer=trainer,
                    push=push,
                    fleet=fleet,
                    background=background,
                    observe=observe,
                )
                await train_steps(loop, stages, on_step)
            run.gates = gate_entries(
                fleet, gates, run.gate_calls, await gate_versions(fleet, weights)
            )


async def _pushed(fleet: GateFleet, weights: FleetWeightSync) -> Pushed:
    """Every live gate's version now; the label is the engines' one label (else all)."""
    infos = await weights.infos()
    labels = sorted({info.engine_version for info in infos})
    return Pushed(
        labels[0] if len(labels) == 1 else "|".join(labels),
        tuple(info.version for info in infos),
    )
