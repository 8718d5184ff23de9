"""``tokcap demo --gates N`` / ``--gate URL``: the demo through gates in other processes.

The run starts Ray + TransferQueue as the in-process demo does (`tokcap.compose.services`),
then N ``tokcap-vllm serve`` gates with the real CLI (`tokcap.compose.run_on_fleet`, as
``tokcap train --gates`` does: staging into that TransferQueue, ``--tokcap-require-open``,
``--tokcap-return-token-ids`` for the demo's check against the engine's own ids), or takes
gates someone else started (their token in ``TOKCAP_CONTROL_TOKEN``; what a dead demo or
trainer left on them is reclaimed first). Every rollout is opened through a
`tokcap_vllm.GateFleet` and played on its gate's URL; ``summary.json`` gains ``gates``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tokcap_core import CaptureConfig, ConfigError
from tokcap_tq import TQSink
from tokcap_vllm import GateFleet

from .._stages import Stages
from ..compose import Batch, FleetRun, Stack, run_on_fleet

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

    async def body(on: FleetRun) -> None:
        await session(run, on.stack, stages, on.fleet)
        run.gates = await on.entries(run.gate_calls)

    run_on_fleet(
        config,
        sink,
        capture,
        body,
        vllm_args=vllm_args,
        gate_options=["--tokcap-return-token-ids"],
        label="Ray pool",
        stage=stages.stage,
        log=stages.log,
    )
