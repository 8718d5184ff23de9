"""A trainer's side of tokcap: from finished rollouts to a training batch, by the policy.

A harness (a black box speaking the OpenAI API) has played each rollout through a gate;
the trainer knows each rollout's id, its group and its score. `collect` is everything the
trainer does after that, `finish` what it does after its optimizer step:

1. close every rollout with its reward (and the scorer's witness) in one batch per gate,
   sharing one durable ledger write (group commit), keeping the ledger heads;
2. verify each rollout's receipt against its head, from the manifest the close answered
   with (no second round trip; fetched for any the gate left out);
3. send metadata-only reassembly requests to the Ray pool, with the rewards the *verified
   receipts* carry (the ledger is the one source of truth, never the harness's copy); the
   pool's actors read the staged calls ahead, while 1 and 2 run (`ReassemblerPool.prefetch`:
   nothing read early is trusted before its receipt is verified);
4. let the policy decide each group (accept, replace or drop) and train only accepted
   groups: read their rows and compute mask-aware GRPO advantages;
5. free every training row and release the rollouts on the gate, concurrently (`finish`).

Each call reports how long each of its stages took (`CollectTimings`, `FinishTimings`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream

from tokcap_core import (
    Accept,
    CaptureConfig,
    FinalizedGroup,
    Manifest,
    ReassemblyRequest,
    Receipt,
    TokenSink,
    TrainingRow,
    decide_group,
    grpo,
)
from tokcap_core.rpc import GroupDecision
from tokcap_ray import ReassemblerPool
from tokcap_vllm import CloseResult, RolloutClose

__all__ = [
    "Batch",
    "CollectTimings",
    "ControlPlane",
    "FinishTimings",
    "Finished",
    "clear_orphaned",
    "close_verified",
    "collect",
    "finish",
]


class ControlPlane(Protocol):
    """What `collect` and `finish` need from the gates' control plane.

    `tokcap_vllm.ControlPlaneClient` (one gate) is one; a client over several gates that
    routes each rollout id to the gate that owns it is another.
    """

    async def close(
        self,
        rollout_id: str,
        *,
        reward: float | None = None,
        response_id: str | None = None,
        content: str | None = None,
    ) -> tuple[int, str]:
        """Close ``rollout_id`` with its reward and witness; its ledger head."""
        ...

    async def close_many(
        self,
        closes: Sequence[RolloutClose],
        *,
        receipts: Literal["terminal", "all"] | None = None,
    ) -> list[CloseResult]:
        """Close many rollouts with one durable write per gate; one result per rollout
        (with ``receipts``: each closed one's receipt, verified against its head)."""
        ...

    async def release_many(self, rollout_ids: Iterable[str]) -> None:
        """Release many closed rollouts, concurrently."""
        ...

    async def fetch_receipts(
        self,
        rollout_ids: Iterable[str],
        *,
        expected_heads: Mapping[str, tuple[int, str]] | None = None,
        segments: Literal["terminal", "all"] = "terminal",
    ) -> list[Receipt]:
        """One receipt per id, verified against ``expected_heads``."""
        ...

    async def release(self, rollout_id: str) -> None:
        """Make the owning gate forget a closed rollout."""
        ...

    async def declare_terminal(
        self, rollout_id: str, *, call_id: str | None = None, response_id: str | None = None
    ) -> tuple[int, str]:
        """Name a rollout's terminal call before it is closed; its ledger head."""
        ...

    async def manifest(self, rollout_id: str) -> Manifest:
        """The decoded (not yet verified) manifest of ``rollout_id``."""
        ...


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
    terminal_response_id: str | None = None
    """The terminal call the harness declared, by its response id: declared by the close
    itself (`tokcap_vllm.RolloutClose.terminal_response_id`), not by a request of its own."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectTimings:
    """Seconds `collect` spent in each of its stages."""

    close_s: float
    """Closing every rollout on its gate, and verifying the receipts the closes answered."""
    receipts_s: float
    """A separate receipt round trip: 0.0 in `collect`, whose closes answer the receipts
    (`close_verified`; fetching any they left out is counted in ``close_s``)."""
    reassemble_s: float
    """The Ray pool's reassembly and the policy's decisions."""
    rows_s: float
    """Reading the accepted groups' rows (and freeing the rejected ones') once the pool's
    last group is done, and advantages: each group's rows are read as soon as its bundle is
    done, so this is the last bundle's read."""

    @property
    def total_s(self) -> float:
        """All of `collect`."""
        return self.close_s + self.receipts_s + self.reassemble_s + self.rows_s


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishTimings:
    """Seconds `finish` spent in each of its stages."""

    free_s: float
    """Clearing the batch's training rows from the sink."""
    release_s: float
    """Releasing the batch's rollouts on their gates."""


@dataclass(slots=True)
class Batch:
    """One step's outcome: receipts, groups and their decisions, and the rows to train on."""

    receipts: dict[str, Receipt] = field(default_factory=dict)
    groups: list[FinalizedGroup] = field(default_factory=list)
    decisions: dict[str, GroupDecision] = field(default_factory=dict)
    """Group id → `Accept`, `Replace` or `Drop` (`tokcap_core.decide_group`)."""
    rows: list[TrainingRow] = field(default_factory=list)
    """Rows of accepted groups only (placeholders included, with ``sample_mask == 0``)."""
    advantages: list[float] = field(default_factory=list)
    """One GRPO advantage per row (0.0 for placeholders)."""
    timings: CollectTimings | None = None
    """How long `collect` took, by stage."""

    @property
    def accepted(self) -> list[str]:
        """The ids of the groups the policy accepted, in group order."""
        return [g.group_id for g in self.groups if isinstance(self.decisions[g.group_id], Accept)]

    @property
    def receipts_verified(self) -> int:
        """How many receipts verified (``ok``)."""
        return sum(r.ok for r in self.receipts.values())


async def close_verified(
    control: ControlPlane, closes: Sequence[RolloutClose], capture: CaptureConfig
) -> dict[str, Receipt]:
    """Close ``closes`` in one batch and return every rollout's receipt by id, each
    verified against the head its close answered: the receipts come in the close's reply,
    and any the control plane did not answer (a manifest over the gate's bound, or a
    control plane that answers none) are fetched and verified the same way."""
    segments: Literal["terminal", "all"] = capture.segments  # type: ignore[assignment]
    closed = await control.close_many(closes, receipts=segments)
    heads = {r.rollout_id: r.head_or_raise() for r in closed}
    receipts = {r.rollout_id: r.receipt for r in closed if r.receipt is not None}
    left = [rid for rid in heads if rid not in receipts]
    if left:
        fetched = await control.fetch_receipts(
            left, expected_heads={rid: heads[rid] for rid in left}, segments=segments
        )
        receipts.update((r.rollout_id, r) for r in fetched)
    return receipts


async def collect(
    control: ControlPlane,
    pool: ReassemblerPool,
    sink: TokenSink,
    finished: Sequence[Finished],
    capture: CaptureConfig,
) -> Batch:
    """Close, verify, reassemble and decide; return the accepted rows with their advantages."""
    batch = Batch()
    t0 = time.perf_counter()
    closes = [
        RolloutClose(
            rollout_id=f.rollout_id,
            reward=f.reward,
            response_id=f.response_id,
            content=f.content,
            terminal_response_id=f.terminal_response_id,
        )
        for f in finished
    ]
    members: dict[str, list[str]] = {}
    for f in finished:
        members.setdefault(f.group_id, []).append(f.rollout_id)
    pool.prefetch(members)  # the staged calls are read while the rollouts are closed
    batch.receipts = await close_verified(control, closes, capture)
    t1 = time.perf_counter()
    requests = [
        ReassemblyRequest(
            group_id=group_id,
            rollout_ids=tuple(ids),
            receipts=tuple(batch.receipts[r] for r in ids),
            rewards=tuple(batch.receipts[r].reward for r in ids),
            max_seq_len=capture.max_seq_len,
            clear_staging=False,  # `finish` clears them, off the step's blocking path
        )
        for group_id, ids in members.items()
    ]
    # Each bundle's groups are settled as soon as it is done, while the other bundles are
    # still being reassembled: the accepted groups' rows read in one fetch, the rejected
    # groups' rows freed in one clear. What is left after the pool's last bundle is that
    # bundle's own read (one sink round trip, not one per group).
    read: dict[str, list[TrainingRow]] = {}
    failed: list[Exception] = []

    async def settle(groups: list[FinalizedGroup]) -> None:
        accepted = [g for g in groups if isinstance(batch.decisions[g.group_id], Accept)]
        refused = [k for g in groups if g not in accepted for k in g.training_keys]
        try:
            keys = [k for g in accepted for k in g.training_keys]
            rows = await sink.fetch(keys) if keys else []
            for g in accepted:
                n = len(g.training_keys)
                read[g.group_id], rows = rows[:n], rows[n:]
            if refused:
                await sink.clear_rows(refused)  # replaced or dropped groups never reach the trainer
        except Exception as e:  # raised below as is, not wrapped in the task group's group
            failed.append(e)

    async with anyio.create_task_group() as settling:
        async with pool.as_completed(requests) as results:
            async for group in results:
                arrived = [group, *_delivered(results)]
                for g in arrived:
                    batch.groups.append(g)
                    batch.decisions[g.group_id] = decide_group(
                        g, min_valid_fraction=capture.min_valid_fraction
                    )
                settling.start_soon(settle, arrived)
        t3 = time.perf_counter()
    if failed:
        raise failed[0]
    batch.groups.sort(key=lambda g: g.group_id)
    batch.rows = [row for g in batch.groups if g.group_id in read for row in read[g.group_id]]
    group_of = {r: g.group_id for g in batch.groups for r in g.rollout_ids}
    batch.advantages = grpo(
        [row.reward or 0.0 for row in batch.rows],
        [group_of[row.rollout_id] for row in batch.rows],
        [row.sample_mask for row in batch.rows],
        rollout_ids_N=[row.rollout_id for row in batch.rows],
    )
    batch.timings = CollectTimings(
        close_s=t1 - t0,
        receipts_s=0.0,
        reassemble_s=t3 - t1,
        rows_s=time.perf_counter() - t3,
    )
    return batch


def _delivered(results: MemoryObjectReceiveStream[FinalizedGroup]) -> list[FinalizedGroup]:
    """The groups already in ``results`` (the rest of a bundle just received), not waiting."""
    out = []
    while True:
        try:
            out.append(results.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            return out


async def clear_orphaned(control: ControlPlane, sink: TokenSink) -> int:
    """Clear the staged calls that rollouts of a lost gate left in ``sink`` (over a fleet:
    a ``control`` with ``orphaned_keys``, `tokcap_vllm.GateFleet`; call it before those
    rollouts are released, which forgets them); how many keys were cleared."""
    orphaned = getattr(control, "orphaned_keys", None)
    if orphaned is None:
        return 0
    keys = orphaned(await sink.staged_keys())
    if keys:
        await sink.clear(keys)
    return len(keys)


async def finish(control: ControlPlane, sink: TokenSink, batch: Batch) -> FinishTimings:
    """After the optimizer step: free the batch's rows and the staged calls they were
    reassembled from, and release its rollouts on the gate. `collect` leaves the staged
    calls to this (the pool's actors do not clear them): a clear is a TransferQueue round
    trip per group that would otherwise sit between the last answer and the rows.

    Over a fleet (a ``control`` with ``orphaned_keys``, `tokcap_vllm.GateFleet`), the
    staged calls that rollouts of a lost gate left in the sink are cleared too: no receipt
    names them, so nothing else would.
    """
    t0 = time.perf_counter()
    await sink.clear_rows([row.key for row in batch.rows])
    await sink.clear([k for g in batch.groups if not g.staging_cleared for k in g.staging_keys])
    await clear_orphaned(control, sink)
    t1 = time.perf_counter()
    await control.release_many(list(batch.receipts))
    return FinishTimings(free_s=t1 - t0, release_s=time.perf_counter() - t1)
