"""One step of ``tokcap train``'s loop, and the records it keeps (see `tokcap.loop`).

`run_step` plays the step's chats, runs `tokcap.compose.collect` (whose stage timings
split closing and fetching receipts from reassembly), trains, pushes, and leaves `finish`
to run while the next step generates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import openai
from anyio.abc import TaskGroup

from tokcap_core import ConfigError
from tokcap_vllm import GateFleet

from .._stages import Stages
from ..compose import Batch, Finished, GateEndpoint, Stack, play_rollouts
from ._task import WITNESSES, DigitsEpisode, group_prompt, play_digits

__all__ = [
    "LoopConfig",
    "Observer",
    "Pushed",
    "StepContext",
    "StepRecord",
    "TrainRun",
    "load_policy",
    "new_trainer",
    "run_step",
    "train_steps",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopConfig:
    """What to train: ``steps`` steps of ``groups`` x ``rollouts`` chats of ``turns`` calls."""

    model: Path
    steps: int = 40
    groups: int = 4
    rollouts: int = 8
    turns: int = 1
    max_tokens: int = 16
    lr: float = 1e-2
    seed: int = 0
    workers: int = 2
    concurrency: int = 32
    tag: str = "train"
    max_seq_len: int = 4096
    ray_address: str | None = None
    """An existing Ray cluster to run TransferQueue and the pool on (None: start one here)."""
    gates: int = 0
    """Start this many ``tokcap-vllm serve`` gates (0: one gate in this process)."""
    gate_urls: tuple[str, ...] = ()
    """Gates someone else started (``--tokcap-sink tq`` on ``ray_address``'s cluster)."""

    def __post_init__(self) -> None:
        for name in ("steps", "groups", "rollouts", "turns", "max_tokens", "workers"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"bad_{name}", f"{name} must be an int >= 1: {value!r}")
        if self.rollouts < 2:
            raise ConfigError("bad_rollouts", "GRPO needs >= 2 rollouts per group")
        if type(self.gates) is not int or self.gates < 0:
            raise ConfigError("bad_gates", f"gates must be an int >= 0: {self.gates!r}")
        if self.gate_urls and (self.gates or not self.ray_address):
            raise ConfigError(
                "bad_gates", "--gate URL needs --ray-address and no --gates (they are started)"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError("bad_lr", f"lr must be finite and > 0: {self.lr!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One step's figures (``summary.json``'s ``train.steps[i]``)."""

    step: int
    reward_mean: float
    reward_max: float
    parity: dict[str, float]
    """The trainer's pre-update recompute vs the engine: tokens, mean_abs, max_abs, k3."""
    sampled_version: int | None
    """The newest weight version that sampled a row of this step."""
    weight_version: int
    """The version the trainer pushed after this step."""
    engine_version: str
    """The label the engine reports after the push."""
    staleness_max: int | None
    rows_valid: int
    rows_placeholder: int
    receipts_verified: int
    receipts_total: int
    gate_versions: tuple[int, ...]
    """Each served gate's weight version after the push (empty: the in-process gate)."""
    groups_accepted: int
    tokens: int
    loss: float
    clip_fraction: float
    grad_norm: float | None
    seconds: dict[str, float]

    def as_json(self) -> dict[str, Any]:
        """A plain JSON object (floats rounded for reading)."""
        return {
            "step": self.step,
            "reward_mean": round(self.reward_mean, 6),
            "reward_max": round(self.reward_max, 6),
            "parity": self.parity,
            "sampled_version": self.sampled_version,
            "weight_version": self.weight_version,
            "engine_version": self.engine_version,
            "staleness_max": self.staleness_max,
            "rows_valid": self.rows_valid,
            "rows_placeholder": self.rows_placeholder,
            "receipts_verified": self.receipts_verified,
            "receipts_total": self.receipts_total,
            **({"gate_versions": list(self.gate_versions)} if self.gate_versions else {}),
            "groups_accepted": self.groups_accepted,
            "tokens": self.tokens,
            "loss": self.loss,
            "clip_fraction": self.clip_fraction,
            "grad_norm": self.grad_norm,
            "seconds": {k: round(v, 4) for k, v in self.seconds.items()},
        }


@dataclass(slots=True)
class TrainRun:
    """What a run produced."""

    config: LoopConfig
    params: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    samples: list[tuple[int, str, float]] = field(default_factory=list)
    """``(step, answer, reward)``: the first rollout's answer of some steps, for the report."""
    gates: list[dict[str, Any]] = field(default_factory=list)
    """Served gates only: ``url``, ``pid`` (None: started elsewhere), ``rollouts``,
    ``calls``, ``weight_version`` (``summary.json``'s ``gates``)."""
    gate_calls: dict[str, int] = field(default_factory=dict)
    """Captured calls per gate URL (those its receipts name)."""


Observer = Callable[[int, list[DigitsEpisode], Any, Any], None]
"""``observe(step, episodes, batch, trainer)``: called after a step's rows are collected,
before its optimizer step (the trainer still holds the weights that sampled them)."""


class _Clock:
    """Seconds per named part of one step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def time(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)


@dataclass(frozen=True, slots=True)
class Pushed:
    """After a push: the engine's version label, and each served gate's version."""

    label: str
    gate_versions: tuple[int, ...] = ()


@dataclass(slots=True, kw_only=True)
class StepContext:
    """What every step uses."""

    run: TrainRun
    stack: Stack
    trainer: Any
    push: Callable[[Any], Awaitable[Pushed]]
    """``push(trainer)``: its weights into every engine if its version moved."""
    fleet: GateFleet | None
    """Served gates: each rollout is opened through the fleet before it plays."""
    background: TaskGroup
    """Where each step's `finish` runs, overlapping the next step."""
    observe: Observer | None = None


async def run_step(loop: StepContext, step: int) -> StepRecord:
    """Play, collect, train and push one step; its record (``finish`` left running)."""
    config, stack = loop.run.config, loop.stack
    clock = _Clock()
    started = time.perf_counter()
    episodes = [
        DigitsEpisode(
            rollout_id=f"{config.tag}-s{step:04d}-g{g:02d}-r{i:02d}",
            group_id=f"{config.tag}-s{step:04d}-g{g:02d}",
            witness=WITNESSES[i % len(WITNESSES)],
            prompt=group_prompt(config.seed, g),
        )
        for g in range(config.groups)
        for i in range(config.rollouts)
    ]
    with clock.time("generate"):
        if loop.fleet is not None:
            for episode in episodes:
                await loop.fleet.open(episode.rollout_id)
        await _play(stack.gate, episodes, config, step)
    if step % 5 == 0 or step == config.steps - 1:
        loop.run.samples.append((step, " | ".join(episodes[0].contents), episodes[0].reward))
    with clock.time("capture_verify"):
        for episode in episodes:
            if episode.witness == "declared" and episode.response_ids:
                await stack.control.declare_terminal(
                    episode.rollout_id, response_id=episode.response_ids[-1]
                )
    # A rollout whose gate was lost mid-play has no answer: it closes without a witness
    # (its receipt is poisoned gate_unreachable) and trains no row.
    finished = [
        Finished(
            rollout_id=e.rollout_id,
            group_id=e.group_id,
            reward=e.reward,
            response_id=_last(e.response_ids) if e.witness == "response_id" else None,
            content=_last(e.contents) if e.witness == "content" else None,
        )
        for e in episodes
    ]
    batch = await stack.collect(finished)
    assert batch.timings is not None
    clock.add("capture_verify", batch.timings.close_s + batch.timings.receipts_s)
    clock.add("close", batch.timings.close_s)
    clock.add("fetch_receipts", batch.timings.receipts_s)
    clock.add("reassemble", batch.timings.reassemble_s + batch.timings.rows_s)
    if loop.fleet is not None:
        for receipt in batch.receipts.values():
            url = loop.fleet.gate_url(receipt.rollout_id)
            loop.run.gate_calls[url] = loop.run.gate_calls.get(url, 0) + len(receipt.sink_keys)
    if loop.observe is not None:
        observed = time.perf_counter()
        loop.observe(step, episodes, batch, loop.trainer)
        started += time.perf_counter() - observed
    with clock.time("train"):
        report = await anyio.to_thread.run_sync(loop.trainer.step, batch.rows, batch.advantages)
    with clock.time("push"):
        pushed = await loop.push(loop.trainer)
    clock.seconds["total"] = time.perf_counter() - started
    loop.background.start_soon(_finish, loop, batch, clock)
    versions = [
        r.weight_version_max
        for r in batch.rows
        if r.sample_mask and r.weight_version_max is not None
    ]
    rewards = [e.reward for e in episodes]
    return StepRecord(
        step=step,
        reward_mean=sum(rewards) / len(rewards),
        reward_max=max(rewards),
        parity={
            "tokens": report.parity.tokens,
            "mean_abs": report.parity.mean_abs,
            "max_abs": report.parity.max_abs,
            "k3": report.parity.k3,
        },
        sampled_version=max(versions) if versions else None,
        weight_version=report.version,
        engine_version=pushed.label,
        staleness_max=report.staleness_max,
        rows_valid=report.rows_valid,
        rows_placeholder=report.rows_placeholder,
        receipts_verified=batch.receipts_verified,
        receipts_total=len(batch.receipts),
        gate_versions=pushed.gate_versions,
        groups_accepted=len(batch.accepted),
        tokens=report.tokens,
        loss=report.loss,
        clip_fraction=report.clip_fraction,
        grad_norm=report.grad_norm,
        seconds=clock.seconds,
    )


def _last(answers: list[str]) -> str | None:
    return answers[-1] if answers else None


def load_policy(model: Path, seed: int) -> Any:
    """The trainer's copy of the engine's model: fp32, eval mode (no dropout)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy.train(False)  # eval mode: no dropout
    return policy


def new_trainer(model: Any, lr: float, version: int) -> Any:
    """A `tokcap.train.Trainer` of ``model`` (AdamW at ``lr``, temperature 1) at ``version``."""
    import torch

    from ..train import TrainConfig, Trainer

    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=lr),
        config=TrainConfig(temperature=1.0, pad_token_id=model.config.pad_token_id or 0),
        version=version,
    )


async def train_steps(
    loop: StepContext, stages: Stages, on_step: Callable[[StepRecord], None] | None
) -> None:
    """Run every step of ``loop``, recording each one."""
    steps = loop.run.config.steps
    with stages.stage(f"train ({steps} steps)", total=steps) as advance:
        for step in range(steps):
            record = await run_step(loop, step)
            loop.run.steps.append(record)
            if on_step is not None:
                on_step(record)
            advance(1)


async def _finish(loop: StepContext, batch: Batch, clock: _Clock) -> None:
    """Free the step's rows and release its rollouts (while the next step generates)."""
    with clock.time("finish"):
        await loop.stack.finish(batch)


async def _play(
    gate: GateEndpoint, episodes: list[DigitsEpisode], config: LoopConfig, step: int
) -> None:
    async def play(client: openai.AsyncOpenAI, model: str, episode: DigitsEpisode, n: int) -> None:
        seed = (config.seed * 10_000 + step) * 1_000 + n
        await play_digits(
            client, model, episode, turns=config.turns, max_tokens=config.max_tokens, seed=seed
        )

    await play_rollouts(gate, episodes, play, concurrency=config.concurrency)
