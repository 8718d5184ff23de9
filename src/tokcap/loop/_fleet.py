"""``tokcap train --gates N`` / ``--gate URL``: the loop through gates in other processes.

The run starts Ray + TransferQueue as the in-process loop does (`tokcap.compose.services`),
then N ``tokcap-vllm serve`` gates (`tokcap.compose.served_gates`: the real CLI, staging
into that TransferQueue, ``--tokcap-require-open``, weight pushes through vLLM's
weight-transfer API), or takes gates someone else started. Each step opens every rollout
through a `tokcap_vllm.GateFleet` (the gate with the fewest open rollouts), plays it on
that gate's URL, and the fleet routes closes, receipts and releases; the trainer pushes
through `tokcap_vllm.FleetWeightSync` and reads every gate's version after each push.

A gate that dies mid-run (its process killed) is lost to the run: its open rollouts are
poisoned ``gate_unreachable`` and counted, the other gates' train
(`tokcap.compose.push_to_live_gates`). The fleet's version is then the live gates' one:
a lost gate is dropped from the weight sync for good, so a push is complete, and releases
the fleet, when every gate still answering loads it; a lost gate's version is reported as
None. Before each push every gate is probed: in ``--async`` the gates keep serving during
a push, and a push that fails on a gate nobody knew was dead holds every gate (captured
calls answer 503) until it is pushed again without it; probing first leaves that to a
gate dying during the push itself.
"""

from __future__ import annotations

from typing import Any

from tokcap_core import CaptureConfig, ConfigError, TokcapError
from tokcap_tq import TQSink
from tokcap_vllm import GateFleet
from tokcap_vllm.weights import FleetWeightSync

from ..compose import FleetRun, drop_dead_gates, push_to_live_gates, run_on_fleet
from ..tiny import QWEN_VLLM_ARGS
from ._run import Training
from ._step import Pushed

__all__ = ["run_fleet"]


def run_fleet(training: Training, sink: TQSink, capture: CaptureConfig) -> None:
    """Start the services and the gates (or take ``config.gate_urls``), train, stop."""
    run, stages = training.run, training.stages

    async def body(on: FleetRun) -> None:
        fleet, weights = on.fleet, on.weights
        start = await _pushed(fleet, weights)
        if len(set(start.gate_versions)) != 1:
            raise ConfigError("bad_gates", f"gates at different versions: {start}")
        pushed = [start.gate_versions[0]]

        async def push(trainer: Any) -> Pushed:
            if trainer.version > pushed[-1]:
                await drop_dead_gates(fleet, weights)
                await push_to_live_gates(fleet, weights, trainer.weights(), trainer.version)
                pushed.append(trainer.version)
            return await _pushed(fleet, weights)

        await training.train(on.stack, pushed[0], push, fleet)
        run.gates = await on.entries(run.gate_calls)

    run_on_fleet(
        run.config,
        sink,
        capture,
        body,
        vllm_args=QWEN_VLLM_ARGS,
        push_mode=run.config.push_mode,
        alongside=[training.load_policy],
        label="Ray pool, trainer",
        stage=stages.stage,
        log=stages.log,
    )


async def _pushed(fleet: GateFleet, weights: FleetWeightSync) -> Pushed:
    """Every live gate's version now; the label is the engines' one label (else all). A
    gate that stopped answering since the push is dropped first."""
    try:
        infos = await weights.infos()
    except TokcapError:
        await drop_dead_gates(fleet, weights)
        infos = await weights.infos()
    labels = sorted({info.engine_version for info in infos})
    return Pushed(
        labels[0] if len(labels) == 1 else "|".join(labels),
        tuple(info.version for info in infos),
    )
