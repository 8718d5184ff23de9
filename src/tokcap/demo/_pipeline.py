"""The demo's run on one machine: the services, the black-box harness, then the trainer.

1. a TransferQueue sink on a local (loopback) Ray and vLLM's OpenAI server with the
   tokcap gate, started concurrently (the engine builds while Ray and TransferQueue start);
2. a black-box harness (the real ``openai`` client) plays G groups x N rollouts;
3. the trainer's side is `examples/custom_trainer.py`, unchanged: close with rewards and
   witnesses, verified receipts, the Ray pool, the group policy, advantages for accepted
   groups only, then free the rows and release the rollouts.

What is demo-only (the harness behaviours, the manifests kept for the report's checks)
stays here; the composition a trainer copies lives in the example.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import openai

from tokcap_core import CaptureConfig, FinalizedGroup, Manifest, Receipt, TrainingRow
from tokcap_ray import ReassemblerPool
from tokcap_tq import TQSink, TQSinkConfig, connect_tq, local_tq
from tokcap_vllm import ControlPlaneClient, Gate, GateConfig, InProcessServer

from .._examples import load_example
from .._stages import Stages
from ..tiny._qwen import CHATML_TOOLS_TEMPLATE
from ._families import ENGINE_ARGS, chatml_tool_args
from ._harness import BEHAVIOURS, Episode, Task, run_episode

__all__ = ["VLLM_ARGS", "DemoConfig", "DemoRun", "run_pipeline", "services"]

VLLM_ARGS = (*ENGINE_ARGS, *chatml_tool_args(CHATML_TOOLS_TEMPLATE))
"""The engine options of the default (``qwen``) family: `tokcap demo` and `tokcap train`."""


SERVER_THREAD = "tokcap-vllm-server"  # the name InProcessServer gives its thread


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """What to run: G groups x N rollouts of ``turns`` calls each."""

    model: Path
    groups: int = 4
    rollouts: int = 6
    turns: int = 4
    max_tokens: int = 24
    segments: str = "terminal"
    workers: int = 2
    concurrency: int = 8
    seed: int = 0
    tag: str = "demo"
    max_seq_len: int = 4096
    ray_address: str | None = None
    """An existing Ray cluster to run TransferQueue and the pool on (None: start one here)."""
    family: str = "qwen"
    """The model family served (`tokcap.demo._families`; recorded in the summary)."""


@dataclass(slots=True)
class DemoRun:
    """Everything the run produced, for the summary and the report."""

    config: DemoConfig
    episodes: list[Episode] = field(default_factory=list)
    manifests: dict[str, Manifest] = field(default_factory=dict)
    receipts: dict[str, Receipt] = field(default_factory=dict)
    groups: list[FinalizedGroup] = field(default_factory=list)
    decisions: dict[str, str] = field(default_factory=dict)
    rows: list[TrainingRow] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)


def capture_config(config: DemoConfig) -> CaptureConfig:
    """The demo's one configuration, shared by the gate and the trainer (token minted here).

    ``return_token_ids``: the demo's independent check compares every row with the ids the
    engine itself returned to the harness.
    """
    return CaptureConfig(
        segments=config.segments,
        max_seq_len=config.max_seq_len,
        min_valid_fraction=0.5,
        return_token_ids=True,
    ).with_derived(environ=os.environ)


def run_pipeline(
    config: DemoConfig,
    stages: Stages,
    *,
    vllm_args: tuple[str, ...] = VLLM_ARGS,
    force_tools: Callable[[int], dict[str, Any]] | None = None,
    tools_every_turn: bool = False,
) -> DemoRun:
    """Start everything, run the rollouts, reassemble, and shut everything down again.

    ``vllm_args`` serve ``config.model``; ``force_tools`` and ``tools_every_turn`` go to
    `tokcap.demo._harness.run_episode` (default: the Hermes structural tag, every other turn).
    """
    harness = functools.partial(
        run_episode, force_tools=force_tools, tools_every_turn=tools_every_turn
    )
    run = DemoRun(config)
    tag = config.tag.replace("-", "_")
    capture = capture_config(config)
    sink = TQSink(
        TQSinkConfig(staging_partition=f"{tag}_staging", training_partition=f"{tag}_rows")
    )
    gate = Gate(GateConfig(parent_commit_timeout_s=60, capture=capture), sink=sink)
    server = InProcessServer(str(config.model), gate=gate, vllm_args=vllm_args)
    with services(server, stages, workers=config.workers, ray_address=config.ray_address):
        anyio.run(_drive, run, server, sink, capture, stages, harness)
    return run


@contextlib.contextmanager
def services(
    server: InProcessServer, stages: Stages, *, workers: int, ray_address: str | None = None
) -> Iterator[None]:
    """Start a loopback Ray + TransferQueue (room for ``workers`` pool actors), or connect to
    the cluster at ``ray_address`` and start TransferQueue on it, and launch ``server`` as
    soon as Ray is up, so its engine builds while TransferQueue starts; on exit stop the
    engine, then TransferQueue and Ray (a cluster given by address keeps running).

    Not before Ray's node is up: Ray 2.60's raylet gives its dashboard agent 15 s to report
    its ports and aborts the start when it is late, and on a loaded 2-core box an engine
    building at the same moment made it late in 6 of 7 starts (load 10-30); a start that
    failed so is tried once more (the agent's imports are in the page cache by then).
    `InProcessServer.wait_ready` is the caller's (overlap it with other start-up work).
    Shared by `tokcap demo` and `tokcap train`.
    """
    with tempfile.TemporaryDirectory(prefix="tokcap-") as tmp, contextlib.ExitStack() as ray:
        where = f"connect to Ray at {ray_address}" if ray_address else "start Ray"
        with stages.stage(f"{where} + TransferQueue (vLLM building)"):
            cancel, launched = threading.Event(), threading.Event()
            launcher = threading.Thread(
                target=_launch_once_ray_is_up, args=(server, cancel, launched)
            )
            launcher.start()
            try:
                if ray_address:
                    ray.enter_context(connect_tq(ray_address, init_timeout_s=300.0))
                else:
                    _enter_local_tq(ray, tmp, workers)
            except BaseException:
                cancel.set()
                launcher.join()
                if launched.is_set():
                    _stop(server)
                raise
            launcher.join()
        try:  # the engine and its sink writes stop before TransferQueue does
            yield
        finally:
            _stop(server)


def _enter_local_tq(stack: contextlib.ExitStack, tmp: str, workers: int) -> None:
    """Enter `local_tq` on ``stack``; once more if Ray's node timed out starting.

    TransferQueue's start gets 300 s, not 120: on a loaded 2-core box it took longer.
    """
    start = functools.partial(local_tq, tmp, storage_units=1, extra_cpus=workers)
    try:
        stack.enter_context(start(init_timeout_s=300.0))
    except Exception as e:
        if "timed out during startup" not in str(e):
            raise
        stack.enter_context(start(init_timeout_s=300.0))


def _launch_once_ray_is_up(
    server: InProcessServer, cancel: threading.Event, launched: threading.Event
) -> None:
    import ray

    while not cancel.is_set():
        if ray.is_initialized():
            server.launch()
            launched.set()
            return
        time.sleep(0.05)


def _stop(server: InProcessServer, timeout_s: float = 180.0) -> None:
    """Stop the server, also when Ctrl-C came while its engine was still being built.

    `InProcessServer.stop` can only ask a server that is already up to exit, so ask again
    until the server's thread has ended.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        server.stop(timeout=2.0)
        if not any(t.name == SERVER_THREAD and t.is_alive() for t in threading.enumerate()):
            return


async def _drive(
    run: DemoRun,
    server: InProcessServer,
    sink: TQSink,
    capture: CaptureConfig,
    stages: Stages,
    harness: Callable[..., Awaitable[Episode]],
) -> None:
    trainer: Any = load_example("custom_trainer")
    config = run.config
    factory = functools.partial(TQSink.connect, sink.config)
    pool = ReassemblerPool(config.workers, factory, num_cpus=1.0)
    try:
        with stages.stage("start vLLM + gate, Ray pool"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(anyio.to_thread.run_sync, server.wait_ready))
                await pool.start()
        await _rollouts(run, server, stages, harness)
        assert capture.control_token is not None
        async with ControlPlaneClient(server.base_url, capture.control_token) as control:
            await _declare_terminals(run, control)
            finished = [
                trainer.Finished(
                    rollout_id=e.rollout_id,
                    group_id=f"{config.tag}-g{e.group:02d}",
                    reward=e.reward,
                    response_id=e.final.response_id
                    if e.behaviour in ("response_id", "rewrite")
                    else None,
                    content=e.final.content if e.behaviour == "content" else None,
                )
                for e in run.episodes
            ]
            with stages.stage("close, receipts, Ray pool, policy"):
                batch = await trainer.collect(control, pool, sink, finished, capture)
            run.receipts, run.groups = batch.receipts, batch.groups
            run.decisions = {g: type(d).__name__ for g, d in batch.decisions.items()}
            run.rows, run.advantages = batch.rows, batch.advantages
            with stages.stage("manifests for the checks", total=len(run.episodes)) as advance:
                for episode in run.episodes:  # only for the engine-parity check and the report
                    run.manifests[episode.rollout_id] = await control.manifest(episode.rollout_id)
                    advance(1)
            await trainer.finish(control, sink, batch)
    finally:
        with anyio.CancelScope(shield=True):
            pool.close()


async def _rollouts(
    run: DemoRun,
    server: InProcessServer,
    stages: Stages,
    harness: Callable[..., Awaitable[Episode]],
) -> None:
    config = run.config
    for g in range(config.groups):
        task = Task.for_group(config.seed, g)
        for i in range(config.rollouts):
            behaviour = BEHAVIOURS[i] if i < len(BEHAVIOURS) else "plain"
            rollout_id = f"{config.tag}-g{g:02d}-r{i:02d}"
            run.episodes.append(Episode(rollout_id, g, behaviour, task))
    limit = anyio.Semaphore(config.concurrency)
    with stages.stage("rollouts (harness)", total=len(run.episodes)) as advance:

        async def play(episode: Episode, seed: int) -> None:
            async with (
                limit,
                openai.AsyncOpenAI(
                    base_url=server.rollout_url(episode.rollout_id), api_key="unused", max_retries=0
                ) as client,
            ):
                await harness(
                    client,
                    server.model,
                    episode,
                    turns=config.turns,
                    max_tokens=config.max_tokens,
                    seed=seed,
                )
            advance(1)

        async with anyio.create_task_group() as tg:
            for n, episode in enumerate(run.episodes):
                tg.start_soon(play, episode, config.seed * 100_000 + n)


async def _declare_terminals(run: DemoRun, control: ControlPlaneClient) -> None:
    """The ``declared`` behaviour: the harness names its terminal before the trainer closes."""
    for episode in run.episodes:
        if episode.behaviour == "declared":
            await control.declare_terminal(
                episode.rollout_id, response_id=episode.final.response_id
            )
