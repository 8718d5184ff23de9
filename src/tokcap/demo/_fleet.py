"""``tokcap demo --gates N`` / ``--gate URL``: the demo through gates in other processes.

The run starts Ray + TransferQueue as the in-process demo does (`tokcap.compose.services`),
then N ``tokcap-vllm serve`` gates with the real CLI (`tokcap.compose.fleet_gates`, as
``tokcap train --gates`` does: staging into that TransferQueue, ``--tokcap-require-open``,
``--tokcap-return-token-ids`` for the demo's check against the engine's own ids), or takes
gates someone else started (their token in ``TOKCAP_CONTROL_TOKEN``; what a dead demo or
trainer left on them is reclaimed first). Every rollout is opened through a
`tokcap_vllm.GateFleet` and played on its gate's URL; ``summary.json`` gains ``gates``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from tokcap_core import CaptureConfig, ConfigError
from tokcap_tq import TQSink
from tokcap_vllm import GateFleet
from tokcap_vllm.weights import FleetWeightSync

from .._stages import Stages
from ..compose import (
    Batch,
    FleetEndpoint,
    FleetGate,
    Stack,
    fleet_services,
    fleet_token,
    gate_entries,
    gate_versions,
    open_stack,
    reclaim_rollouts,
    served_model,
)

__all__ = ["run_fleet"]

Session = Callable[[Any, Stack, Stages, GateFleet], Awaitable[Batch]]
"""``session(run, stack, stages, fleet)``: the demo's play-and-collect on a running stack."""


def run_fleet(
    run: Any,
    sink: TQSink,
    capture: CaptureConfig,
    stages: Stages,
    vllm_args: Sequence[str],
    session: Session,
) -> None:
    """Start the services and the gates (or take ``run.config.gate_urls``), run, stop."""
    config = run.config
    if config.gate_urls and (config.gates or not config.ray_address):
        raise ConfigError(
            "bad_gates", "--gate URL needs --ray-address and no --gates (they are started)"
        )
    token = fleet_token(config.gate_urls, capture)
    with fleet_services(
        config.model,
        count=config.gates,
        urls=config.gate_urls,
        ray_address=config.ray_address,
        workers=config.workers,
        sink=sink.config,
        token=token,
        vllm_args=vllm_args,
        gate_options=["--tokcap-return-token-ids"],
        stage=stages.stage,
    ) as gates:
        anyio.run(_drive, run, gates, token, sink, capture, stages, session)


async def _drive(
    run: Any,
    gates: list[FleetGate],
    token: str,
    sink: TQSink,
    capture: CaptureConfig,
    stages: Stages,
    session: Session,
) -> None:
    config = run.config
    urls = [g.url for g in gates]
    async with (
        GateFleet(urls, token) as fleet,
        FleetWeightSync([(url, token) for url in urls]) as weights,
    ):
        if config.gate_urls:  # gates that outlive runs: take back what a dead one held
            reclaimed = await reclaim_rollouts(urls, token, sink)
            stages.log(f"reclaimed rollouts a previous run left: {reclaimed}")
        model = await served_model(urls[0]) if config.gate_urls else str(config.model)
        endpoint = FleetEndpoint(fleet, model, urls)
        async with open_stack(
            [endpoint],
            sink=sink,
            capture=capture,
            workers=config.workers,
            control=fleet,
            stage=stages.stage,
            label="Ray pool",
        ) as stack:
            await session(run, stack, stages, fleet)
        run.gates = gate_entries(fleet, gates, run.gate_calls, await gate_versions(fleet, weights))
