"""Group reassembly: a `ReassemblyRequest` and the staged rows it names → rows + `FinalizedGroup`.

Pure: the caller (the Ray pool, or an in-process trainer) fetches the staged rows,
publishes the rows and clears staging; this module decides nothing about I/O. Exactly
one row per receipt segment of each valid rollout and one placeholder per invalid
rollout, in request order, so a group always yields a known number of rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ._errors import ReassemblyError
from ._reassembly import reassemble
from ._rows import TrainingRow, placeholder_row
from ._rpc import FinalizedGroup, ReassemblyRequest
from ._staged import StagedCall
from .ids import StagingKey, TrainingKey
from .metrics import failure_counts, terminal_selection_breakdown
from .reasons import MISSING_ROWS, REASSEMBLY_FAILED, make_reason

__all__ = ["GroupResult", "on_chain_keys", "reassemble_group"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupResult:
    """The rows to publish (by training key, request order) and the group's summary."""

    rows: dict[TrainingKey, TrainingRow]
    finalized: FinalizedGroup


def on_chain_keys(request: ReassemblyRequest) -> list[StagingKey]:
    """Staging keys of every call in every segment of the request's verified receipts."""
    return [
        call.staging_key for r in request.receipts if r.ok for seg in r.segments for call in seg
    ]


def reassemble_group(
    request: ReassemblyRequest,
    staged: Mapping[StagingKey, StagedCall],
    *,
    staging_cleared: bool,
    extra_metrics: Mapping[str, float] | None = None,
) -> GroupResult:
    """Reassemble every rollout of ``request`` from ``staged``; invalid ones become placeholders.

    A poisoned receipt keeps its reason; a staged row that is absent gives ``missing_rows``;
    any other mismatch gives ``reassembly_failed:<code>``. ``staging_cleared`` says whether
    the caller clears the group's staging keys itself (recorded in the `FinalizedGroup`).
    """
    per_rollout: list[list[TrainingRow] | str] = []
    for receipt, reward in zip(request.receipts, request.rewards, strict=True):
        if not receipt.ok:
            per_rollout.append(receipt.failure_reason or REASSEMBLY_FAILED)
            continue
        try:
            per_rollout.append(
                reassemble(receipt, staged, max_seq_len=request.max_seq_len, reward=reward)
            )
        except ReassemblyError as e:
            per_rollout.append(
                MISSING_ROWS if e.code == "missing_call" else make_reason(REASSEMBLY_FAILED, e.code)
            )
    like = next((rows[0] for rows in per_rollout if not isinstance(rows, str)), None)
    out: dict[TrainingKey, TrainingRow] = {}
    failures: list[tuple[str, str]] = []
    for rollout_id, reward, result in zip(
        request.rollout_ids, request.rewards, per_rollout, strict=True
    ):
        if isinstance(result, str):
            failures.append((rollout_id, result))
            result = [placeholder_row(rollout_id, result, like=like, reward=reward)]
        for row in result:
            out[row.key] = row
    valid = [row for row in out.values() if row.sample_mask == 1]
    metrics = {
        "rows/valid": float(len(valid)),
        "rows/total": float(len(out)),
        "rollouts/valid": float(len(request.rollout_ids) - len(failures)),
        "rollouts/total": float(len(request.rollout_ids)),
        "tokens/total": float(sum(len(r.input_ids) for r in valid)),
        "tokens/generated": float(sum(r.num_generated for r in valid)),
        "routes/backfilled_rows": float(sum(r.backfilled_route_rows for r in valid)),
        "rows/truncated": float(sum(r.truncated for r in valid)),
        **failure_counts(reason for _, reason in failures),
        **terminal_selection_breakdown(request.receipts),
        **(extra_metrics or {}),
    }
    versions = [
        v for r in valid for v in (r.weight_version_min, r.weight_version_max) if v is not None
    ]
    finalized = FinalizedGroup(
        group_id=request.group_id,
        rollout_ids=request.rollout_ids,
        valid_row_count=len(valid),
        total_row_count=len(out),
        training_keys=tuple(out),
        staging_keys=request.staging_keys,
        staging_cleared=staging_cleared,
        weight_version_min=min(versions) if versions else None,
        weight_version_max=max(versions) if versions else None,
        failures=tuple(failures),
        metrics=metrics,
    )
    return GroupResult(rows=out, finalized=finalized)
