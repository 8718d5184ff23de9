"""The demo's run on one machine: the services, the black-box harness, then the trainer.

1. a TransferQueue sink on a local (loopback) Ray and vLLM's OpenAI server with the
   tokcap gate, started concurrently (the engine builds while Ray and TransferQueue start:
   `tokcap.compose.place`), or ``tokcap-vllm serve`` gates (``--gates N``, started with
   ``--tokcap-return-token-ids`` for the check against the engine's own ids) or gates
   someone else started (``--gate URL``: their token in ``TOKCAP_CONTROL_TOKEN``; what a
   dead run left on them is reclaimed first), each rollout opened through a
   `tokcap_vllm.GateFleet` and ``summary.json`` gaining ``gates``;
2. a black-box harness (the real ``openai`` client) plays G groups x N rollouts;
3. the trainer's side is `tokcap.compose`, as `examples/custom_trainer.py` uses it: close
   with rewards and witnesses, verified receipts, the Ray pool, the group policy,
   advantages for accepted groups only, then free the rows and release the rollouts.

What is demo-only (the harness behaviours, the manifests kept for the report's checks)
stays here.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import openai

from tokcap_core import CaptureConfig, FinalizedGroup, Manifest, Receipt, TrainingRow
from tokcap_tq import TQSink, TQSinkConfig
from tokcap_vllm import GateFleet

from .._stages import Stages
from ..compose import (
    Batch,
    ControlPlane,
    Finished,
    GateEndpoint,
    Site,
    Stack,
    place,
    play_rollouts,
    tq_sink,
)
from ..tiny import QWEN_VLLM_ARGS
from ._clients import run_episode
from ._families import episode_api
from ._harness import BEHAVIOURS, Episode, HarnessOptions, Task

__all__ = ["DemoConfig", "DemoRun", "run_pipeline"]


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
    gates: int = 0
    """Start this many ``tokcap-vllm serve`` gates (0: one gate in this process)."""
    gate_urls: tuple[str, ...] = ()
    """Gates someone else started (``--tokcap-sink tq`` on ``ray_address``'s cluster)."""


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
    gates: list[dict[str, Any]] = field(default_factory=list)
    """Served gates only: ``summary.json``'s ``gates`` (`tokcap.compose.gate_entries`)."""
    gate_calls: dict[str, int] = field(default_factory=dict)
    """Captured calls per gate URL (those its receipts name)."""


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
    vllm_args: tuple[str, ...] = QWEN_VLLM_ARGS,
    force_tools: Callable[[int], dict[str, Any]] | None = None,
    tools_every_turn: bool = False,
    images: bool = False,
) -> DemoRun:
    """Start everything, run the rollouts, reassemble, and shut everything down again.

    ``vllm_args`` serve ``config.model``; ``force_tools``, ``tools_every_turn`` and
    ``images`` are the harness's (`tokcap.demo._harness.HarnessOptions`; default: the Hermes
    structural tag, every other turn, no images).
    """
    options = HarnessOptions(
        turns=config.turns,
        max_tokens=config.max_tokens,
        force_tools=force_tools,
        tools_every_turn=tools_every_turn,
        images=images,
    )
    harness = functools.partial(run_episode, options=options)
    run = DemoRun(config)
    capture = capture_config(config)
    # gates someone else started stage into their default partitions (--tokcap-*-partition)
    sink = TQSink(TQSinkConfig()) if config.gate_urls else tq_sink(config.tag)
    # a served gate returns the engine's ids too: the demo checks every row against them
    served = ["--tokcap-return-token-ids"]
    with place(
        config,
        sink,
        capture,
        vllm_args=vllm_args,
        gate_options=served,
        stage=stages.stage,
        log=stages.log,
    ) as site:
        anyio.run(_play_on, site, harness, run, stages)
    return run


async def _play_on(
    site: Site, harness: Callable[..., Awaitable[Episode]], run: DemoRun, stages: Stages
) -> None:
    """`play` on the site's gates, then (served gates) each gate's figures."""
    async with site.open() as on:
        await play(harness, run, on.stack, stages, on.fleet)
        run.gates = await on.gate_entries(run.gate_calls)


async def play(
    harness: Callable[..., Awaitable[Episode]],
    run: DemoRun,
    stack: Stack,
    stages: Stages,
    fleet: GateFleet | None = None,
) -> Batch:
    """The demo on a running stack: the harness plays every rollout (each opened through
    ``fleet`` first, if any), then close, receipts, the pool, the policy, the manifests
    for the checks, and everything freed; the step's batch."""
    config = run.config
    episodes(run)
    if fleet is not None:
        for episode in run.episodes:
            await fleet.open(episode.rollout_id)
    await _rollouts(run, stack.gate, stages, harness)
    await _declare_terminals(run, stack.control)
    finished = [
        Finished(
            rollout_id=e.rollout_id,
            group_id=f"{config.tag}-g{e.group:02d}",
            reward=e.reward,
            response_id=e.final.response_id if e.behaviour in ("response_id", "rewrite") else None,
            content=e.final.content if e.behaviour == "content" else None,
        )
        for e in run.episodes
    ]
    with stages.stage("close, receipts, Ray pool, policy"):
        batch = await stack.collect(finished)
    run.receipts, run.groups = batch.receipts, batch.groups
    run.decisions = {g: type(d).__name__ for g, d in batch.decisions.items()}
    run.rows, run.advantages = batch.rows, batch.advantages
    await _manifests(run, stack, stages)
    if fleet is not None:
        for receipt in batch.receipts.values():
            url = fleet.gate_url(receipt.rollout_id)
            run.gate_calls[url] = run.gate_calls.get(url, 0) + len(receipt.sink_keys)
    await stack.finish(batch)
    return batch


async def _manifests(run: DemoRun, stack: Stack, stages: Stages) -> None:
    """Every rollout's manifest: only for the engine-parity check and the report."""
    with stages.stage("manifests for the checks", total=len(run.episodes)) as advance:
        for episode in run.episodes:
            run.manifests[episode.rollout_id] = await stack.control.manifest(episode.rollout_id)
            advance(1)


def episodes(run: DemoRun) -> None:
    """The run's G x N episodes (the behaviours in `BEHAVIOURS` order, then plain)."""
    config = run.config
    for g in range(config.groups):
        task = Task.for_group(config.seed, g)
        for i in range(config.rollouts):
            behaviour = BEHAVIOURS[i] if i < len(BEHAVIOURS) else "plain"
            rollout_id = f"{config.tag}-g{g:02d}-r{i:02d}"
            api = episode_api(config.family, g, i)
            run.episodes.append(Episode(rollout_id, g, behaviour, task, api=api))


async def _rollouts(
    run: DemoRun,
    gate: GateEndpoint,
    stages: Stages,
    harness: Callable[..., Awaitable[Episode]],
) -> None:
    config = run.config
    with stages.stage("rollouts (harness)", total=len(run.episodes)) as advance:

        async def play(client: openai.AsyncOpenAI, model: str, episode: Episode, n: int) -> None:
            await harness(client, model, episode, seed=config.seed * 100_000 + n)

        done = functools.partial(advance, 1)
        await play_rollouts(gate, run.episodes, play, concurrency=config.concurrency, done=done)


async def _declare_terminals(run: DemoRun, control: ControlPlane) -> None:
    """The ``declared`` behaviour: the harness names its terminal before the trainer closes."""
    for episode in run.episodes:
        if episode.behaviour == "declared":
            await control.declare_terminal(
                episode.rollout_id, response_id=episode.final.response_id
            )
