"""``tokcap train``'s loop: a closed GRPO loop through the whole product, every step.

Each step:

1. **generate**: the harness (`tokcap.loop._task`, the real ``openai`` client) plays G
   groups x N rollouts of a short chat through the gate; the gate stages every call's
   exact ids and logprobs into TransferQueue;
2. **capture + verify**: declared terminals, then `tokcap.compose.collect` closes every
   rollout with its reward and witness and fetches receipts verified against the returned
   ledger heads over the control plane;
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
from typing import Any

import anyio

from tokcap_core import CaptureConfig
from tokcap_tq import TQSink, TQSinkConfig
from tokcap_vllm import InProcessServer, WeightSync
from tokcap_vllm.weights import PushMode

from .._stages import Stages
from ..compose import Stack, run_in_process, tq_sink
from ..tiny import QWEN_VLLM_ARGS
from ._fleet import run_fleet
from ._run import Training
from ._step import (
    LoopConfig,
    Observer,
    Pushed,
    StepRecord,
    TrainRun,
    load_policy,
    preload_policy_imports,
)

__all__ = ["LoopConfig", "Observer", "StepRecord", "TrainRun", "load_policy", "run_loop"]

TRAIN_VLLM_ARGS = (
    *QWEN_VLLM_ARGS,
    "--worker-extension-cls", "tokcap_vllm.WeightSyncWorker",
)  # fmt: skip
# QWEN_VLLM_ARGS already turns chunked prefill off: the loop's seeded requests (32 chats of
# ~80 prompt tokens a step) would otherwise crash vLLM 0.32's CPU engine core.


def run_loop(
    config: LoopConfig,
    stages: Stages | None = None,
    on_step: Callable[[StepRecord], None] | None = None,
    observe: Observer | None = None,
) -> TrainRun:
    """Start everything, train ``config.steps`` steps, and shut everything down again.

    ``stages`` shows the progress (default: a fresh one on stderr); ``on_step`` gets each
    step's record; ``observe`` (for benchmarks) sees each step's rows before the step
    trains on them; its time is not counted in the step's.
    """
    if stages is None:
        with Stages() as own:
            return run_loop(config, own, on_step, observe)
    run = TrainRun(config)
    capture = CaptureConfig(
        segments="terminal", max_seq_len=config.max_seq_len, min_valid_fraction=0.5
    ).with_derived(environ=os.environ)
    # gates someone else started stage into their default partitions (--tokcap-*-partition)
    sink = TQSink(TQSinkConfig()) if config.gate_urls else tq_sink(config.tag)
    training = Training(run, stages, on_step, observe)
    preload_policy_imports()
    if config.gates or config.gate_urls:
        run_fleet(training, sink, capture)
        return run

    async def body(server: InProcessServer, stack: Stack) -> None:
        sync = await anyio.to_thread.run_sync(server.call, _watched_sync, server)

        async def push(trainer: Any) -> Pushed:
            return Pushed(
                await anyio.to_thread.run_sync(_push, server, sync, trainer, config.push_mode)
            )

        await training.train(stack, sync.state.version, push, None)

    run_in_process(
        config,
        sink,
        capture,
        body,
        vllm_args=TRAIN_VLLM_ARGS,
        alongside=[training.load_policy],
        stage=stages.stage,
        label="start vLLM + gate, Ray pool, trainer",
    )
    return run


async def _watched_sync(server: InProcessServer) -> WeightSync:
    """On the server's loop: a `WeightSync` for its engine, watched by its gate."""
    sync = await WeightSync.connect(server.engine_client)
    server.gate.watch_weights(sync)
    return sync


def _push(server: InProcessServer, sync: WeightSync, trainer: Any, mode: PushMode) -> str:
    """Push the trainer's weights if its version moved; the engine's version label after."""
    if trainer.version > sync.state.version:
        push = functools.partial(sync.push, mode=mode)
        server.call(push, trainer.weights(), trainer.version, timeout=600)
    return str(server.call(server.engine_client.get_weight_version))
