"""``tokcap train``'s loop: a closed GRPO loop through the whole product, in one function.

`run_loop` places the run (`tokcap.compose.place`: Ray and TransferQueue, and one gate in
this process or a fleet of served gates) and runs `train` on its event loop. `train` is
the loop; each step:

1. **generate**: the harness (`tokcap.loop._harness`, the real ``openai`` client) plays
   G groups x N rollouts of a short chat through the gate; the gate stages every call's
   exact ids and logprobs into TransferQueue;
2. **capture + verify**: `tokcap.compose.Stack.collect` closes every rollout with its
   reward and witness and verifies each receipt against the returned ledger head;
3. **reassemble**: in the same `collect`, metadata-only requests to the Ray pool, the
   group policy, the accepted rows read from TransferQueue and GRPO advantages;
4. **train**: one `tokcap.train.Trainer` step, whose parity report compares the trainer's
   pre-update logprobs with the engine's on exactly these rows (rows with images: the
   processed tensors the engine's encoder consumed, read back from the sink and verified
   against their digests first, `tokcap_core.sink.fetch_media`);
5. **push**: the full state dict into every engine (`tokcap.compose.Run.push`) under the
   next version; the gate watches the push and would refuse captured calls if it failed;
   then the step's rows are freed and its rollouts released while the next step runs.

Steps 1-3 are the feed's (`Feed.take`): lock-step (``sync``, `tokcap.loop._sync`: play the
step's groups, then collect them at once; staleness 0) or two pumps (``async``,
`tokcap.loop._async`: groups play all the time, each collected as soon as it has played,
pushes landing in flight, at most ``max_staleness`` versions stale). Both collect with the
same `Stack.collect`.

The engine samples at temperature 1 and reports raw logprobs, so an fp32 trainer that
holds the engine's weights agrees to ~1e-14 (K3): a step whose K3 exceeds
`tokcap.loop._summary.PARITY_K3` means the previous push did not land.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
from anyio.abc import TaskGroup
from rich.markup import escape

from tokcap_core import CaptureConfig, TrainingRow
from tokcap_core.sink import MediaStore, fetch_media
from tokcap_core.staged import TensorBytes
from tokcap_tq import TQSink, TQSinkConfig

from .._stages import Stages
from ..compose import Policy, Site, place, tq_sink
from ..tiny import QWEN_VLLM_ARGS, VLM_VLLM_ARGS
from ._async import pumping
from ._config import LoopConfig
from ._harness import Harness, harness_on
from ._meters import Meters
from ._policy import PolicyLoad, new_trainer, preload_policy_imports
from ._step import Feed, Observer, StepRecord, TrainRun, step_record
from ._sync import LockStep

__all__ = ["run_loop", "train"]

OnStep = Callable[[StepRecord], None]


def run_loop(
    config: LoopConfig,
    stages: Stages | None = None,
    on_step: OnStep | None = None,
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
    preload_policy_imports()
    # QWEN_VLLM_ARGS turn chunked prefill off: the loop's seeded requests (32 chats of ~80
    # prompt tokens a step) would otherwise crash vLLM 0.32's CPU engine core.
    with place(
        config,
        sink,
        capture,
        vllm_args=VLM_VLLM_ARGS if config.images else QWEN_VLLM_ARGS,
        push_mode=config.push_mode,
        stage=stages.stage,
        log=stages.log,
    ) as site:
        anyio.run(train, site, run, stages, on_step, observe)
    return run


async def train(
    site: Site,
    run: TrainRun,
    stages: Stages,
    on_step: OnStep | None = None,
    observe: Observer | None = None,
) -> None:
    """Open ``site`` and train ``run.config.steps`` steps on it, each recorded in ``run``."""
    config = run.config
    policy = PolicyLoad(config.model, config.seed, vision=config.images)  # while the stack starts
    async with site.open(alongside=[policy.load], label=f"{site.label}, trainer") as placed:
        trainer = new_trainer(policy.policy, config.lr, placed.version, decoupled=config.decoupled)
        run.params = sum(p.numel() for p in policy.policy.parameters())
        meters = Meters(log=lambda line: stages.log(escape(f"[tokcap] {line}")))
        async with (
            anyio.create_task_group() as background,  # where each step's freeing runs
            meters.watching(),
            harness_on(config, placed, meters.busy) as harness,
            _feed(harness, trainer, background, stages) as (feed, advance),
        ):
            for step in range(config.steps):
                started = time.perf_counter()
                taken = await feed.take(step)  # played, collected: verified, reassembled
                if observe is not None:
                    observed = time.perf_counter()
                    observe(step, taken.episodes, taken.batch, trainer)
                    started += time.perf_counter() - observed
                version, seconds = trainer.version, taken.seconds
                start = time.perf_counter()
                rows, advantages = taken.batch.rows, taken.batch.advantages
                media = await _verified_media(placed.stack.sink, rows)
                report = await anyio.to_thread.run_sync(
                    functools.partial(trainer.step, rows, advantages, media=media)
                )
                seconds["train"] = time.perf_counter() - start
                pushed = await placed.push(trainer)
                seconds["push"] = time.perf_counter() - start - seconds["train"]
                seconds["total"] = time.perf_counter() - started
                feed.trained(taken)  # its rows freed, its rollouts released, in the background
                record = step_record(
                    run, placed.fleet, step, taken, report=report, trained_version=version,
                    pushed=pushed, loop_lag_ms_max=meters.lag.take(),
                    image_blobs=len(media or {}),
                )  # fmt: skip
                record.seconds.update(await meters.take())
                run.steps.append(record)
                if on_step is not None:
                    on_step(record)
                advance(1)
        run.loop_lag_ms_max = meters.lag.run_ms
        run.gates = await placed.gate_entries(run.gate_calls)


async def _verified_media(
    sink: object, rows: Sequence[TrainingRow]
) -> dict[str, tuple[TensorBytes, ...]] | None:
    """The processed tensors of the images ``rows`` name, read from ``sink`` and verified
    against their digests (`fetch_media`); None when no row names one."""
    digests = [item.tensors_digest for row in rows for item in row.media]
    if not digests:
        return None
    assert isinstance(sink, MediaStore)
    return await fetch_media(sink, digests)


@contextlib.asynccontextmanager
async def _feed(
    harness: Harness, trainer: Policy, background: TaskGroup, stages: Stages
) -> AsyncIterator[tuple[Feed, Callable[[int], None]]]:
    """The run's feed, inside the train stage (and how to advance it): the two pumps
    (``async``: the stage ends once the groups still in flight are collected) or lock-step."""
    config = harness.config
    label = f"train ({config.steps} steps{', async' if config.mode == 'async' else ''})"
    with stages.stage(label, total=config.steps) as advance:
        if config.mode != "async":
            yield LockStep(harness, background), advance
            return
        async with pumping(harness, trainer, background) as pumps:
            yield pumps, advance
