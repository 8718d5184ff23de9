"""What every step of ``tokcap train``'s loop shares: its records, its context, the harness's
play (`play_group`) and the step's record (`step_record`); the lock-step step itself is
`tokcap.loop._sync.run_step`, the two pumps `tokcap.loop._async`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from anyio.abc import TaskGroup

from tokcap_core import Receipt, TrainingRow
from tokcap_vllm import GateFleet

from ..compose import Stack, lost_receipts, play_rollouts
from ._config import LoopConfig
from ._meters import BusyMeter
from ._staleness import provenance
from ._task import DigitsEpisode, play_digits

__all__ = [
    "LoopConfig",
    "Observer",
    "Pushed",
    "StepContext",
    "StepRecord",
    "TrainRun",
    "load_policy",
    "new_trainer",
    "play_group",
    "preload_policy_imports",
    "step_record",
]


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
    calls_spanning_versions: int = 0
    """Calls whose generated tokens were sampled by two or more versions."""
    tokens_stale: int = 0
    """Loss tokens sampled one or more versions behind the version trained."""
    tokens_stale_kv: int = 0
    """Tokens conditioned on KV computed by older weights (0: pushes recompute KV)."""
    dropped_stale: int = 0
    """Groups the train pump discarded this step for a token more than K versions behind."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Groups discarded so far in the run, by reason (async)."""
    loop_lag_ms_max: float = 0.0
    """The driver's largest event-loop lag during the step (ms)."""
    parity_by_staleness: dict[str, dict[str, float]] = field(default_factory=dict)
    """Parity over rows by their staleness (``"0"``, ``"1"``, ...)."""
    placeholders: dict[str, int] = field(default_factory=dict)
    """Placeholder rows by failure bucket (why a receipt or reassembly failed)."""
    receipts_lost: dict[str, int] = field(default_factory=dict)
    """Receipts poisoned ``gate_unreachable`` by gate URL: rollouts lost with their gate
    (counted in ``receipts_total``, not failed verifications)."""
    calls_per_rollout: dict[str, int] = field(default_factory=dict)
    """How many rollouts made each number of calls (``"1"``, ``"2"``, ...): the shape played."""
    row_tokens: tuple[int, ...] = ()
    """Each trained row's length in tokens (placeholders left out), in row order."""

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
            "calls_spanning_versions": self.calls_spanning_versions,
            "tokens_stale": self.tokens_stale,
            "tokens_stale_kv": self.tokens_stale_kv,
            "dropped_stale": self.dropped_stale,
            "skipped": dict(self.skipped),
            "loop_lag_ms_max": round(self.loop_lag_ms_max, 3),
            "parity_by_staleness": self.parity_by_staleness,
            "placeholders": dict(self.placeholders),
            "receipts_lost": dict(self.receipts_lost),
            "calls_per_rollout": dict(self.calls_per_rollout),
            "row_tokens": list(self.row_tokens),
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
    loop_lag_ms_max: float = 0.0
    """The driver's largest event-loop lag over the run (ms)."""


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
    http: Any = None
    """The harness's shared HTTP client (``httpx.AsyncClient``; set by ``train_steps``)."""
    busy: BusyMeter = field(default_factory=BusyMeter)
    """Rollouts playing at once, over time (`tokcap.loop._meters`)."""


async def play_group(
    loop: StepContext,
    episodes: list[DigitsEpisode],
    index: int,
    *,
    played: Callable[[DigitsEpisode, float], None] | None = None,
) -> None:
    """Play ``episodes``; ``index`` (step or group) seeds them.

    Served gates: every rollout is opened first (its URL is its gate's). A ``declared``
    rollout names its terminal call as soon as it ends, as a harness would, while the
    others still play. ``played(episode, answered)`` is called once each rollout is done
    (also when it failed), ``answered`` being when its last answer came back.
    """
    config = loop.run.config
    control = loop.stack.control

    async def play(client: openai.AsyncOpenAI, model: str, episode: DigitsEpisode, n: int) -> None:
        seed = (config.seed * 10_000 + index) * 1_000 + n
        answered = time.perf_counter()
        try:
            loop.busy.enter()
            try:
                await play_digits(
                    client,
                    model,
                    episode,
                    turns=config.turns,
                    max_tokens=config.max_tokens,
                    seed=seed,
                    task=config.task,
                    api=config.harness_api,
                )
            finally:
                loop.busy.leave()
            answered = time.perf_counter()
            if episode.witness == "declared" and episode.response_ids:
                await control.declare_terminal(
                    episode.rollout_id, response_id=episode.response_ids[-1]
                )
        finally:
            if played is not None:
                played(episode, answered)

    if loop.fleet is not None:  # before playing: a rollout's URL is its gate's, set at open
        for episode in episodes:
            await loop.fleet.open(episode.rollout_id)
    await play_rollouts(
        loop.stack.gate, episodes, play, concurrency=config.concurrency, http_client=loop.http
    )


def step_record(
    loop: StepContext,
    step: int,
    *,
    episodes: list[DigitsEpisode],
    rows: Sequence[TrainingRow],
    receipts: Sequence[Receipt],
    report: Any,
    pushed: Pushed,
    trained_version: int,
    seconds: dict[str, float],
    groups_accepted: int,
    dropped_stale: int = 0,
    skipped: dict[str, int] | None = None,
    loop_lag_ms_max: float = 0.0,
) -> StepRecord:
    """A step's record from what it trained (``report``: a `tokcap.train.StepReport`)."""
    run = loop.run
    if step % 5 == 0 or step == run.config.steps - 1:
        run.samples.append((step, " | ".join(episodes[0].contents), episodes[0].reward))
    if loop.fleet is not None:
        for receipt in receipts:
            url = loop.fleet.gate_url(receipt.rollout_id)
            run.gate_calls[url] = run.gate_calls.get(url, 0) + len(receipt.sink_keys)
    versions = [
        r.weight_version_max for r in rows if r.sample_mask and r.weight_version_max is not None
    ]
    origin = provenance(rows, trained_version)
    rewards = [e.reward for e in episodes]
    return StepRecord(
        step=step,
        reward_mean=sum(rewards) / len(rewards),
        reward_max=max(rewards),
        parity=_parity_json(report.parity),
        sampled_version=max(versions) if versions else None,
        weight_version=report.version,
        engine_version=pushed.label,
        staleness_max=origin.staleness_max,
        rows_valid=report.rows_valid,
        rows_placeholder=report.rows_placeholder,
        receipts_verified=sum(r.ok for r in receipts),
        receipts_total=len(receipts),
        gate_versions=pushed.gate_versions,
        groups_accepted=groups_accepted,
        tokens=report.tokens,
        loss=report.loss,
        clip_fraction=report.clip_fraction,
        grad_norm=report.grad_norm,
        seconds=seconds,
        calls_spanning_versions=origin.calls_spanning_versions,
        tokens_stale=origin.tokens_stale,
        tokens_stale_kv=origin.tokens_stale_kv,
        dropped_stale=dropped_stale,
        skipped=skipped or {},
        loop_lag_ms_max=loop_lag_ms_max,
        placeholders=dict(Counter(r.reason_bucket for r in rows if r.reason_bucket)),
        receipts_lost=lost_receipts(loop.fleet, receipts) if loop.fleet is not None else {},
        calls_per_rollout={
            str(k): v for k, v in sorted(Counter(len(e.response_ids) for e in episodes).items())
        },
        row_tokens=tuple(len(r.input_ids) for r in rows if r.sample_mask),
        parity_by_staleness={
            str(k): _parity_json(v) for k, v in sorted(report.parity_by_staleness.items())
        },
    )


def _parity_json(parity: Any) -> dict[str, float]:
    return {
        "tokens": parity.tokens,
        "mean_abs": parity.mean_abs,
        "max_abs": parity.max_abs,
        "k3": parity.k3,
    }


def preload_policy_imports() -> None:
    """Import what `load_policy` needs, on this thread, before a run starts its threads.

    With ``accelerate`` installed (TRL brings it), transformers' generation module imports
    it, and two threads importing accelerate's circular package at once fail ("partially
    initialized module 'accelerate.hooks'"): the policy loads in a worker thread while the
    in-process engine starts in another.
    """
    from transformers import AutoModelForCausalLM  # noqa: F401


def load_policy(model: Path, seed: int) -> Any:
    """The trainer's copy of the engine's model: fp32, eval mode (no dropout)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    policy = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    policy.train(False)  # eval mode: no dropout
    return policy


def new_trainer(model: Any, lr: float, version: int, *, decoupled: bool = False) -> Any:
    """A `tokcap.train.Trainer` of ``model`` (AdamW at ``lr``, temperature 1) at ``version``;
    ``decoupled``: decoupled PPO with TIS/MIS (`tokcap.train.TrainConfig.decoupled`)."""
    import torch

    from ..train import TrainConfig, Trainer

    return Trainer(
        model,
        torch.optim.AdamW(model.parameters(), lr=lr),
        config=TrainConfig(
            temperature=1.0, pad_token_id=model.config.pad_token_id or 0, decoupled=decoupled
        ),
        version=version,
    )
