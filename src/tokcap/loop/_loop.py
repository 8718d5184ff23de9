"""``tokcap train``'s loop: a closed GRPO loop through the whole product, every step.

Each step:

1. **generate**: the harness (`tokcap.loop._task`, the real ``openai`` client) plays G
   groups x N rollouts of a short chat through the gate; the gate stages every call's
   exact ids and logprobs into TransferQueue;
2. **capture + verify**: declared terminals, then `examples/custom_trainer.collect`
   (unchanged) closes every rollout with its reward and witness and fetches receipts
   verified against the returned ledger heads over the control plane;
3. **reassemble**: in the same `collect`, metadata-only requests to the Ray pool, the
   group policy, the accepted rows read from TransferQueue and GRPO advantages;
4. **train**: one `tokcap.train.Trainer` step, whose parity report compares the trainer's
   pre-update logprobs with the engine's on exactly these rows;
5. **push**: the full state dict into the running engine (`tokcap_vllm.WeightSync`)
   under the next version; the gate watches the push and would refuse captured calls if
   it failed. `finish` (free the rows, release the rollouts) runs while the next step
   generates, outside the step's time. The step itself is `tokcap.loop._step.run_step`.

The engine samples at temperature 1 and reports raw logprobs, so an fp32 trainer that
holds the engine's weights agrees to ~1e-14 (K3): a step whose K3 exceeds
`tokcap.loop._summary.PARITY_K3` means the previous push did not land.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from tokcap_core import CaptureConfig
from tokcap_ray import ReassemblerPool
from tokcap_tq import TQSink, TQSinkConfig
from tokcap_vllm import ControlPlaneClient, Gate, GateConfig, InProcessServer, WeightSync

from .._examples import load_example
from .._stages import Stages
from ..demo._pipeline import VLLM_ARGS, services
from ._step import LoopConfig, Observer, StepContext, StepRecord, TrainRun, run_step

__all__ = ["LoopConfig", "Observer", "StepRecord", "TrainRun", "load_policy", "run_loop"]

TRAIN_VLLM_ARGS = (
    *VLLM_ARGS,
    "--worker-extension-cls", "tokcap_vllm.WeightSyncWorker",
)  # fmt: skip
# VLLM_ARGS already turns chunked prefill off: the loop's seeded requests (32 chats of ~80
# prompt tokens a step) would otherwise crash vLLM 0.32's CPU engine core.


def run_loop(
    config: LoopConfig,
    stages: Stages,
    on_step: Callable[[StepRecord], None] | None = None,
    observe: Observer | None = None,
) -> TrainRun:
    """Start everything, train ``config.steps`` steps, and shut everything down again.

    ``on_step`` gets each step's record; ``observe`` (for benchmarks) sees each step's
    rows before the step trains on them; its time is not counted in the step's.
    """
    run = TrainRun(config)
    tag = config.tag.replace("-", "_")
    capture = CaptureConfig(
        segments="terminal", max_seq_len=config.max_seq_len, min_valid_fraction=0.5
    ).with_derived(environ=os.environ)
    sink = TQSink(
        TQSinkConfig(staging_partition=f"{tag}_staging", training_partition=f"{tag}_rows")
    )
    gate = Gate(GateConfig(parent_commit_timeout_s=60, capture=capture), sink=sink)
    server = InProcessServer(str(config.model), gate=gate, vllm_args=TRAIN_VLLM_ARGS)
    with services(server, stages, workers=config.workers, ray_address=config.ray_address):
        anyio.run(_drive, run, server, sink, capture, stages, on_step, observe)
    return run


def load_policy(model: Path, seed: int) -> Any:
    """The trainer's copy of the engine's model: fp32, eval mode (no dropout)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy.train(False)  # eval mode: no dropout
    return policy


async def _watched_sync(server: InProcessServer) -> WeightSync:
    """On the server's loop: a `WeightSync` for its engine, watched by its gate."""
    sync = await WeightSync.connect(server.engine_client)
    server.gate.watch_weights(sync)
    return sync


async def _drive(
    run: TrainRun,
    server: InProcessServer,
    sink: TQSink,
    capture: CaptureConfig,
    stages: Stages,
    on_step: Callable[[StepRecord], None] | None,
    observe: Observer | None,
) -> None:
    import torch

    from ..train import TrainConfig, Trainer

    config = run.config
    factory = functools.partial(TQSink.connect, sink.config)
    pool = ReassemblerPool(config.workers, factory, num_cpus=1.0)
    try:
        with stages.stage("start vLLM + gate, Ray pool, trainer"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(anyio.to_thread.run_sync, server.wait_ready))
                tg.start_soon(pool.start)
                model = await anyio.to_thread.run_sync(load_policy, config.model, config.seed)
            sync = await anyio.to_thread.run_sync(server.call, _watched_sync, server)
        run.params = sum(p.numel() for p in model.parameters())
        trainer = Trainer(
            model,
            torch.optim.AdamW(model.parameters(), lr=config.lr),
            config=TrainConfig(temperature=1.0, pad_token_id=model.config.pad_token_id or 0),
            version=sync.state.version,
        )
        assert capture.control_token is not None
        async with (
            ControlPlaneClient(server.base_url, capture.control_token) as control,
            anyio.create_task_group() as background,
        ):
            loop = StepContext(
                run=run,
                server=server,
                control=control,
                pool=pool,
                sink=sink,
                capture=capture,
                trainer=trainer,
                sync=sync,
                example=load_example("custom_trainer"),
                background=background,
                observe=observe,
            )
            with stages.stage(f"train ({config.steps} steps)", total=config.steps) as advance:
                for step in range(config.steps):
                    record = await run_step(loop, step)
                    run.steps.append(record)
                    if on_step is not None:
                        on_step(record)
                    advance(1)
    finally:
        with anyio.CancelScope(shield=True):
            pool.close()
