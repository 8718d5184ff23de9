"""A step of ``tokcap train``'s loop: what it trains on (`Taken`, from a `Feed`) and its
record (`StepRecord`, in the run's `TrainRun`).

A feed hands the loop each step's collected batch: the lock-step one
(`tokcap.loop._sync.LockStep`) or the two pumps (`tokcap.loop._async`); both collect with
`tokcap.compose.Stack.collect`. `step_record` is the step's figures once it has trained
and pushed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokcap_vllm import GateFleet

from ..compose import Batch, Pushed, lost_receipts
from ._config import LoopConfig
from ._staleness import provenance
from ._task import DigitsEpisode

__all__ = ["Feed", "Observer", "StepRecord", "Taken", "TrainRun", "step_record"]


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
    images_sent: int = 0
    """Images the harness sent (one per rollout of a vision-language family; 0: text)."""
    images_bound: int = 0
    """Images the verified receipts' calls bind (distinct per rollout: the ledgers' view)."""
    images: int = 0
    """Images the step's valid rows name (their placeholders in the rows' ids)."""
    image_blobs: int = 0
    """Distinct blobs of processed tensors the trainer read back and verified for them."""
    placeholders: dict[str, int] = field(default_factory=dict)
    """Placeholder rows by failure bucket (why a receipt or reassembly failed)."""
    receipts_lost: dict[str, int] = field(default_factory=dict)
    """Receipts poisoned ``gate_unreachable`` by gate URL: rollouts lost with their gate
    (counted in ``receipts_total``, not failed verifications)."""
    calls_per_rollout: dict[str, int] = field(default_factory=dict)
    """How many rollouts made each number of calls (``"1"``, ``"2"``, ...): the shape played."""
    row_tokens: tuple[int, ...] = ()
    """Each trained row's length in tokens (placeholders left out), in row order."""
    terminals: dict[str, int] = field(default_factory=dict)
    """Verified receipts by how their terminal call was chosen (``declared``,
    ``response_id``, ``content``, ``heuristic``)."""
    declared: int = 0
    """Rollouts whose harness declared their terminal call (through their close)."""

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
            **(
                {
                    "images_sent": self.images_sent,
                    "images_bound": self.images_bound,
                    "images": self.images,
                    "image_blobs": self.image_blobs,
                }
                if self.images_sent
                else {}
            ),
            "placeholders": dict(self.placeholders),
            "receipts_lost": dict(self.receipts_lost),
            "calls_per_rollout": dict(self.calls_per_rollout),
            "row_tokens": list(self.row_tokens),
            "terminals": dict(self.terminals),
            "declared": self.declared,
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


Observer = Callable[[int, list[DigitsEpisode], Batch, Any], None]
"""``observe(step, episodes, batch, trainer)``: called after a step's rows are collected,
before its optimizer step (the trainer still holds the weights that sampled them)."""


@dataclass(slots=True, kw_only=True)
class Taken:
    """What a step trains on: its episodes, their collected batch (the accepted groups'
    rows and advantages), and the seconds it took to get them."""

    episodes: list[DigitsEpisode]
    batch: Batch
    seconds: dict[str, float]
    """The step's ``seconds`` so far (the loop adds ``train``, ``push``, ``total``)."""
    dropped_stale: int = 0
    """Groups discarded for staleness while taking these (async)."""
    skipped: Mapping[str, int] = field(default_factory=dict)
    """Groups discarded so far in the run, by reason (async: read when the step is recorded)."""


class Feed(Protocol):
    """Where the loop's steps get their rows: `take` a step's, and say when they trained."""

    async def take(self, step: int) -> Taken:
        """Step ``step``'s rows, played and collected."""
        ...

    def trained(self, taken: Taken) -> None:
        """``taken`` has trained and its weights are pushed: free its rows, release its
        rollouts (in the background, while the next step runs)."""
        ...


def step_record(
    run: TrainRun,
    fleet: GateFleet | None,
    step: int,
    taken: Taken,
    *,
    report: Any,
    trained_version: int,
    pushed: Pushed,
    loop_lag_ms_max: float,
    image_blobs: int = 0,
) -> StepRecord:
    """Step ``step``'s record from what it trained (``report``: a `tokcap.train.StepReport`
    of a step against ``trained_version``, on ``image_blobs`` blobs of processed tensors
    read back and verified), its sampled answers and (``fleet``: served gates) calls per
    gate noted in ``run``."""
    episodes, rows = taken.episodes, taken.batch.rows
    receipts = list(taken.batch.receipts.values())
    if step % 5 == 0 or step == run.config.steps - 1:
        run.samples.append((step, " | ".join(episodes[0].contents), episodes[0].reward))
    if fleet is not None:
        for receipt in receipts:
            url = fleet.gate_url(receipt.rollout_id)
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
        groups_accepted=len(taken.batch.accepted),
        tokens=report.tokens,
        loss=report.loss,
        clip_fraction=report.clip_fraction,
        grad_norm=report.grad_norm,
        seconds=taken.seconds,
        calls_spanning_versions=origin.calls_spanning_versions,
        tokens_stale=origin.tokens_stale,
        tokens_stale_kv=origin.tokens_stale_kv,
        dropped_stale=taken.dropped_stale,
        skipped=dict(taken.skipped),
        loop_lag_ms_max=loop_lag_ms_max,
        placeholders=dict(Counter(r.reason_bucket for r in rows if r.reason_bucket)),
        receipts_lost=lost_receipts(fleet, receipts) if fleet is not None else {},
        calls_per_rollout={
            str(k): v for k, v in sorted(Counter(len(e.response_ids) for e in episodes).items())
        },
        row_tokens=tuple(len(r.input_ids) for r in rows if r.sample_mask),
        parity_by_staleness={
            str(k): _parity_json(v) for k, v in sorted(report.parity_by_staleness.items())
        },
        images_sent=sum(e.image is not None for e in episodes),
        images_bound=sum(
            len({d for calls in r.segments for call in calls for d in call.media_digests or ()})
            for r in receipts
            if r.ok
        ),
        images=sum(len(r.media) for r in rows if r.sample_mask),
        image_blobs=image_blobs,
        terminals=dict(
            sorted(Counter(r.terminal_selection for r in receipts if r.terminal_selection).items())
        ),
        declared=sum(e.witness == "declared" and bool(e.response_ids) for e in episodes),
    )


def _parity_json(parity: Any) -> dict[str, float]:
    return {
        "tokens": parity.tokens,
        "mean_abs": parity.mean_abs,
        "max_abs": parity.max_abs,
        "k3": parity.k3,
    }
