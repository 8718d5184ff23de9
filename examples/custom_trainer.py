"""A custom trainer's side of tokcap: from finished rollouts to a training batch, by the policy.

A harness (a black box speaking the OpenAI API) has played each rollout through the gate;
the trainer knows each rollout's id, its group and its score. This module is everything
the trainer does after that, and it is the code `tokcap demo` and `tokcap train` run:

1. close every rollout with its reward (and the scorer's witness), keeping the ledger head;
2. fetch verified receipts from the control plane, checked against those heads;
3. send metadata-only reassembly requests to the Ray pool, with the rewards the *verified
   receipts* carry (the ledger is the one source of truth, never the harness's copy);
4. let the policy decide each group (accept, replace or drop) and train only accepted
   groups: read their rows and compute mask-aware GRPO advantages;
5. free every training row and release the rollouts on the gate (`finish`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokcap_core import (
    Accept,
    CaptureConfig,
    FinalizedGroup,
    ReassemblyRequest,
    Receipt,
    TokenSink,
    TrainingRow,
    decide_group,
    grpo,
)
from tokcap_core.rpc import GroupDecision
from tokcap_ray import ReassemblerPool
from tokcap_vllm import ControlPlaneClient


@dataclass(frozen=True, slots=True)
class Finished:
    """A rollout the harness finished: its group, its score and what the scorer saw."""

    rollout_id: str
    group_id: str
    reward: float
    response_id: str | None = None
    """The scored response's id (a witness naming the terminal call)."""
    content: str | None = None
    """Or the scored content itself (the gate fingerprints it)."""


@dataclass(slots=True)
class Batch:
    """One step's outcome: receipts, groups and their decisions, and the rows to train on."""

    receipts: dict[str, Receipt] = field(default_factory=dict)
    groups: list[FinalizedGroup] = field(default_factory=list)
    decisions: dict[str, GroupDecision] = field(default_factory=dict)
    rows: list[TrainingRow] = field(default_factory=list)
    """Rows of accepted groups only (placeholders included, with ``sample_mask == 0``)."""
    advantages: list[float] = field(default_factory=list)
    """One GRPO advantage per row (0.0 for placeholders)."""


async def collect(
    control: ControlPlaneClient,
    pool: ReassemblerPool,
    sink: TokenSink,
    finished: Sequence[Finished],
    capture: CaptureConfig,
) -> Batch:
    """Close, verify, reassemble and decide; return the accepted rows with their advantages."""
    batch = Batch()
    heads = {
        f.rollout_id: await control.close(
            f.rollout_id, reward=f.reward, response_id=f.response_id, content=f.content
        )
        for f in finished
    }
    receipts = await control.fetch_receipts(
        list(heads),
        expected_heads=heads,
        segments=capture.segments,  # type: ignore[arg-type]
    )
    batch.receipts = {r.rollout_id: r for r in receipts}
    members: dict[str, list[str]] = {}
    for f in finished:
        members.setdefault(f.group_id, []).append(f.rollout_id)
    requests = [
        ReassemblyRequest(
            group_id=group_id,
            rollout_ids=tuple(ids),
            receipts=tuple(batch.receipts[r] for r in ids),
            rewards=tuple(batch.receipts[r].reward for r in ids),
            max_seq_len=capture.max_seq_len,
        )
        for group_id, ids in members.items()
    ]
    async with pool.as_completed(requests) as results:
        async for group in results:
            batch.groups.append(group)
            batch.decisions[group.group_id] = decide_group(
                group, min_valid_fraction=capture.min_valid_fraction
            )
    batch.groups.sort(key=lambda g: g.group_id)
    accepted = [g for g in batch.groups if isinstance(batch.decisions[g.group_id], Accept)]
    rejected = [k for g in batch.groups if g not in accepted for k in g.training_keys]
    await sink.clear_rows(rejected)  # replaced or dropped groups never reach the trainer
    batch.rows = await sink.fetch([k for g in accepted for k in g.training_keys])
    group_of = {r: g.group_id for g in accepted for r in g.rollout_ids}
    batch.advantages = grpo(
        [row.reward or 0.0 for row in batch.rows],
        [group_of[row.rollout_id] for row in batch.rows],
        [row.sample_mask for row in batch.rows],
        rollout_ids_N=[row.rollout_id for row in batch.rows],
    )
    return batch


async def finish(control: ControlPlaneClient, sink: TokenSink, batch: Batch) -> None:
    """After the optimizer step: free the batch's rows and release its rollouts on the gate."""
    await sink.clear_rows([row.key for row in batch.rows])
    for rollout_id in batch.receipts:
        await control.release(rollout_id)
