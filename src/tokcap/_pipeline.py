"""The whole capture pipeline on one machine: the composition a custom trainer copies.

1. a TransferQueue sink on a local (loopback) Ray;
2. vLLM's OpenAI server with the tokcap gate, staging every call into that sink;
3. a black-box harness (the real ``openai`` client) playing G groups x N rollouts;
4. the trainer closes each rollout with its reward and witnesses over the control plane,
   keeps the returned ledger head, and fetches verified receipts against those heads;
5. metadata-only `ReassemblyRequest`s go to a Ray `ReassemblerPool`, which publishes
   training rows (placeholders for invalid rollouts) into the sink's training partition;
6. the trainer reads the rows and computes mask-aware GRPO advantages.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import openai

from tokcap_core import (
    FinalizedGroup,
    Manifest,
    ReassemblyRequest,
    Receipt,
    TrainingRow,
    decide_group,
    grpo,
)
from tokcap_ray import ReassemblerPool
from tokcap_tq import TQSink, TQSinkConfig, local_tq
from tokcap_vllm import ControlPlaneClient, Gate, GateConfig, InProcessServer

from ._harness import BEHAVIOURS, Episode, Task, run_episode
from ._stages import Stages

__all__ = ["DemoConfig", "DemoRun", "run_pipeline"]

VLLM_ARGS = (
    "--enforce-eager",
    "--distributed-executor-backend", "uni",
    "--max-model-len", "4096",
    "--dtype", "float32",
    "--disable-log-stats",
    "--max-num-seqs", "64",
)  # fmt: skip


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


def run_pipeline(config: DemoConfig, stages: Stages) -> DemoRun:
    """Start everything, run the rollouts, reassemble, and shut everything down again."""
    run = DemoRun(config)
    tag = config.tag.replace("-", "_")
    sink = TQSink(
        TQSinkConfig(staging_partition=f"{tag}_staging", training_partition=f"{tag}_rows")
    )
    token = secrets.token_urlsafe(32)  # the control plane's bearer token (never printed)
    gate = Gate(GateConfig(parent_commit_timeout_s=60, control_token=token), sink=sink)
    server = InProcessServer(str(config.model), gate=gate, vllm_args=VLLM_ARGS)
    with tempfile.TemporaryDirectory(prefix="tokcap-") as tmp, contextlib.ExitStack() as stack:
        with stages.stage("start Ray + TransferQueue"):
            stack.enter_context(local_tq(tmp, storage_units=1, extra_cpus=config.workers))
        stack.callback(_stop, server)  # exits first: the engine and its sink writes before TQ
        anyio.run(_drive, run, server, sink, token, stages)
    return run


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
    run: DemoRun, server: InProcessServer, sink: TQSink, token: str, stages: Stages
) -> None:
    config = run.config
    factory = functools.partial(TQSink.connect, sink.config)
    pool = ReassemblerPool(config.workers, factory, num_cpus=1.0)
    try:
        with stages.stage("start vLLM + gate, Ray pool"):
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(anyio.to_thread.run_sync, server.start))
                await pool.start()
        await _rollouts(run, server, stages)
        async with ControlPlaneClient(server.base_url, token) as control:
            await _custody(run, control, stages)
        with stages.stage("reassemble on the Ray pool", total=config.groups) as advance:
            async with pool.as_completed(_requests(run)) as results:
                async for finalized in results:
                    run.groups.append(finalized)
                    run.decisions[finalized.group_id] = type(
                        decide_group(finalized, min_valid_fraction=0.5)
                    ).__name__
                    advance(1)
        with stages.stage("read rows, advantages"):
            run.groups.sort(key=lambda g: g.group_id)
            keys = [key for g in run.groups for key in g.training_keys]
            run.rows = await sink.fetch(keys)
            group_of = {rid: g.group_id for g in run.groups for rid in g.rollout_ids}
            run.advantages = grpo(
                [r.reward or 0.0 for r in run.rows],
                [group_of[r.rollout_id] for r in run.rows],
                [r.sample_mask for r in run.rows],
                rollout_ids_N=[r.rollout_id for r in run.rows],
            )
            await sink.clear_rows(keys)  # a trainer frees its rows once it has batched them
    finally:
        with anyio.CancelScope(shield=True):
            pool.close()


async def _rollouts(run: DemoRun, server: InProcessServer, stages: Stages) -> None:
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
                await run_episode(
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


async def _custody(run: DemoRun, control: ControlPlaneClient, stages: Stages) -> None:
    """Close every rollout (reward + witnesses), keep the heads, fetch verified receipts."""
    heads: dict[str, tuple[int, str]] = {}
    with stages.stage("close rollouts", total=len(run.episodes)) as advance:
        for episode in run.episodes:
            final = episode.final
            response_id = (
                final.response_id if episode.behaviour in ("response_id", "rewrite") else None
            )
            content = final.content if episode.behaviour == "content" else None
            if episode.behaviour == "declared":
                await control.declare_terminal(episode.rollout_id, response_id=final.response_id)
            heads[episode.rollout_id] = await control.close(
                episode.rollout_id, reward=episode.reward, response_id=response_id, content=content
            )
            advance(1)
    ids = [e.rollout_id for e in run.episodes]
    with stages.stage("fetch manifests, receipts", total=len(ids)) as advance:
        receipts = await control.fetch_receipts(
            ids,
            expected_heads=heads,
            segments=run.config.segments,  # type: ignore[arg-type]
        )
        run.receipts = {r.rollout_id: r for r in receipts}
        for rollout_id in ids:
            # Only for the demo's engine-parity check (call id -> response id) and its report.
            run.manifests[rollout_id] = await control.manifest(rollout_id)
            await control.release(rollout_id)
            advance(1)


def _requests(run: DemoRun) -> list[ReassemblyRequest]:
    by_group: dict[int, list[Episode]] = {}
    for episode in run.episodes:
        by_group.setdefault(episode.group, []).append(episode)
    return [
        ReassemblyRequest(
            group_id=f"{run.config.tag}-g{g:02d}",
            rollout_ids=tuple(e.rollout_id for e in episodes),
            receipts=tuple(run.receipts[e.rollout_id] for e in episodes),
            rewards=tuple(e.reward for e in episodes),
            max_seq_len=run.config.max_seq_len,
        )
        for g, episodes in sorted(by_group.items())
    ]
