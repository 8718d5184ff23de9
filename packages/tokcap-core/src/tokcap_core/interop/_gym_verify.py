"""Gym's verifier: a receipt and its staged snapshots → one linearised terminal chain.

`linearize_gym_rollout` follows Gym's ``verify_and_linearize`` step by step, and raises
`GymVerificationError` with Gym's own code at the first failure:
1. versions (``unsupported_schema`` / ``_digest`` / ``_extras_digest``);
2. a failed or poisoned receipt (``rollout_failed``, ``capture_poisoned``), an empty
   manifest (``empty_manifest``);
3. unique call ids and staging keys (``duplicate_manifest_row``, ``duplicate_staging_key``);
4. one snapshot per manifest row, in manifest order (``row_count_mismatch``,
   ``duplicate_snapshot``, ``snapshot_identity_mismatch``, ``snapshot_order_mismatch``);
5. each snapshot equals its row field by field (``wrong_rollout``, ``wrong_<field>``) and
   its digest recomputes (``corrupt_digest``);
6. the parent graph: parents exist, ``parent.cum_len == prev_len``, no cycle
   (``missing_parent``, ``parent_length_mismatch``, ``lineage_cycle``);
7. the chain walked from the terminal, its chain hashes recomputed from the root
   (``missing_terminal``, ``chain_hash_mismatch``);
8. each delta's mask is carried zeros then generated ones (``invalid_mask_order``,
   ``empty_generation``, ``empty_training_row``);
9. the terminal's cumulative hash covers the whole linearised sequence
   (``cumulative_hash_mismatch``).
Rows off the terminal chain are tolerated; extras bytes are never read.

tokcap adds one check Gym leaves to the framework that assembled the receipt: a
``heuristic`` terminal must be the call Gym's own selection rule picks from the manifest
(``terminal_selection_mismatch``), so a receipt cannot quietly move a heuristic terminal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from ._gym_digest import check_versions, compute_chain_hash, hash_token_ids
from ._gym_errors import GymFormatError, GymVerificationError
from ._gym_records import GymCallRecord, GymReceipt, GymStagedRecord

__all__ = ["GymLinearizedRow", "linearize_gym_rollout", "select_gym_terminal"]

SNAPSHOT_FIELDS: Final = (
    "model_call_id", "parent_call_id", "mode", "prev_len", "delta_len", "cum_len",
    "weight_version", "digest", "extras_digest", "chain_hash", "cumulative_hash",
)  # fmt: skip
"""The fields a manifest row must repeat from its call's staged record."""
VERSION_FIELDS: Final = ("schema_version", "digest_version", "extras_digest_version")
"""The version fields a staged record, its manifest row and the receipt must share."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GymLinearizedRow:
    """Gym's ``LinearizedRow``: the verified terminal chain, root first.

    ``weight_version_spans`` are ``(model_call_id, start, end, weight_version)``,
    ``link_spans`` ``(model_call_id, carried, generated)``, ``extras_commitments``
    ``(model_call_id, extras_digest)``: what a consumer of extras must check them against.
    """

    rollout_id: str
    token_ids: tuple[int, ...]
    token_mask: tuple[float, ...]
    logprobs: tuple[float, ...]
    model_call_ids: tuple[str, ...]
    prompt_len: int
    weight_versions: tuple[int, ...]
    weight_version_spans: tuple[tuple[str, int, int, int], ...]
    link_spans: tuple[tuple[str, int, int], ...]
    extras_commitments: tuple[tuple[str, str], ...]


def _fail(code: str, message: str) -> GymVerificationError:
    return GymVerificationError(code, message)


def linearize_gym_rollout(
    receipt: GymReceipt, snapshots: Sequence[GymStagedRecord]
) -> GymLinearizedRow:
    """Verify ``snapshots`` (in manifest order) against ``receipt`` with Gym's rules."""
    try:
        check_versions(
            receipt.schema_version, receipt.digest_version, receipt.extras_digest_version
        )
    except GymFormatError as e:  # pragma: no cover - a GymReceipt checks its versions
        raise _fail(e.code, e.message) from None
    if receipt.failure_reason is not None:
        raise _fail("rollout_failed", receipt.failure_reason)
    if receipt.capture_poisoned:
        raise _fail("capture_poisoned", "the receipt marks token capture as poisoned")
    if not receipt.manifest:
        raise _fail("empty_manifest", "a successful receipt has no committed calls")
    records: dict[str, GymCallRecord] = {}
    keys: set[str] = set()
    for record in receipt.manifest:
        if record.model_call_id in records:
            raise _fail("duplicate_manifest_row", "model_call_id values are not unique")
        if record.staging_key in keys:
            raise _fail("duplicate_staging_key", "staging keys are not unique")
        records[record.model_call_id] = record
        keys.add(record.staging_key)
    if len(snapshots) != len(receipt.manifest):
        raise _fail(
            "row_count_mismatch", f"{len(snapshots)} snapshots for {len(records)} manifest rows"
        )
    by_id: dict[str, GymStagedRecord] = {}
    for record, snapshot in zip(receipt.manifest, snapshots, strict=True):
        call_id = snapshot.model_call_id
        if call_id in by_id:
            raise _fail("duplicate_snapshot", "model_call_id values are not unique")
        if call_id not in records:
            raise _fail("snapshot_identity_mismatch", f"snapshot {call_id} is not in the manifest")
        if call_id != record.model_call_id:
            raise _fail(
                "snapshot_order_mismatch", f"{record.staging_key} expected {record.model_call_id}"
            )
        by_id[call_id] = snapshot
        _compare(receipt, record, snapshot)
        if snapshot.compute_digest() != snapshot.digest:  # pragma: no cover - checked on creation
            raise _fail("corrupt_digest", f"call {call_id}: staged digest mismatch")
    _check_graph(records)
    chain = _terminal_chain(receipt, records)
    return _linearize(receipt.rollout_id, chain, by_id)


def _compare(receipt: GymReceipt, record: GymCallRecord, snapshot: GymStagedRecord) -> None:
    call_id = record.model_call_id
    if snapshot.rollout_id != receipt.rollout_id:
        raise _fail("wrong_rollout", f"snapshot {call_id} belongs to {snapshot.rollout_id}")
    for name in SNAPSHOT_FIELDS:
        if getattr(snapshot, name) != getattr(record, name):
            raise _fail(f"wrong_{name}", f"call {call_id}: snapshot and manifest differ")
    for name in VERSION_FIELDS:
        value = getattr(snapshot, name)
        if value != getattr(record, name) or value != getattr(receipt, name):
            raise _fail(f"wrong_{name}", f"call {call_id}: snapshot, manifest, receipt differ")


def _check_graph(records: dict[str, GymCallRecord]) -> None:
    for call_id, record in records.items():
        if record.parent_call_id is not None:
            parent = records.get(record.parent_call_id)
            if parent is None:
                raise _fail("missing_parent", f"{call_id} names absent {record.parent_call_id}")
            if parent.cum_len != record.prev_len:
                raise _fail("parent_length_mismatch", f"{call_id} does not start at its parent")
        seen: set[str] = set()
        cursor: GymCallRecord | None = record
        while cursor is not None:
            if cursor.model_call_id in seen:
                raise _fail("lineage_cycle", f"a cycle reaches {cursor.model_call_id}")
            seen.add(cursor.model_call_id)
            parent_id = cursor.parent_call_id
            cursor = records.get(parent_id) if parent_id is not None else None


def _terminal_chain(receipt: GymReceipt, records: dict[str, GymCallRecord]) -> list[GymCallRecord]:
    terminal = receipt.terminal_model_call_id
    cursor = records.get(terminal) if terminal is not None else None
    if cursor is None:
        raise _fail("missing_terminal", f"terminal {terminal} is not in the manifest")
    chain: list[GymCallRecord] = []
    while cursor is not None:
        chain.append(cursor)
        parent_id = cursor.parent_call_id
        cursor = records.get(parent_id) if parent_id is not None else None
    chain.reverse()
    if receipt.terminal_selection == "heuristic":
        picked, reason = select_gym_terminal(receipt.manifest)
        if picked != terminal:
            raise _fail(
                "terminal_selection_mismatch",
                f"Gym's selection rule picks {picked} ({reason}), the receipt names {terminal}",
            )
    return chain


def _carried(snapshot: GymStagedRecord) -> int:
    mask = snapshot.token_mask_delta
    boundary = 0
    while boundary < len(mask) and mask[boundary] == 0.0:
        boundary += 1
    if any(m != 1.0 for m in mask[boundary:]):
        raise _fail("invalid_mask_order", f"{snapshot.model_call_id}: not carry-then-generation")
    if boundary == len(mask):
        raise _fail("empty_generation", f"{snapshot.model_call_id}: no generated token")
    return boundary


def _linearize(
    rollout_id: str, chain: list[GymCallRecord], snapshots: dict[str, GymStagedRecord]
) -> GymLinearizedRow:
    ids: list[int] = []
    mask: list[float] = []
    logprobs: list[float] = []
    spans: list[tuple[str, int, int, int]] = []
    links: list[tuple[str, int, int]] = []
    prompt_len = 0
    running: str | None = None
    for index, record in enumerate(chain):
        snapshot = snapshots[record.model_call_id]
        running = compute_chain_hash(running, snapshot.token_ids_delta)
        if record.chain_hash != running:
            raise _fail("chain_hash_mismatch", f"{record.model_call_id} does not extend its parent")
        carried = _carried(snapshot)
        start = len(ids)
        ids.extend(snapshot.token_ids_delta)
        mask.extend(snapshot.token_mask_delta)
        logprobs.extend(snapshot.generation_log_probs_delta)
        if index == 0:
            prompt_len = carried
        spans.append((record.model_call_id, start, len(ids), record.weight_version))
        links.append((record.model_call_id, carried, record.delta_len - carried))
    if not any(mask):  # pragma: no cover - every call on the chain has a generated token
        raise _fail("empty_training_row", "the terminal chain has no generated tokens")
    if chain[-1].cumulative_hash != hash_token_ids(ids):
        raise _fail(
            "cumulative_hash_mismatch", "the terminal's cumulative hash misses the linearised row"
        )
    return GymLinearizedRow(
        rollout_id=rollout_id,
        token_ids=tuple(ids),
        token_mask=tuple(mask),
        logprobs=tuple(logprobs),
        model_call_ids=tuple(r.model_call_id for r in chain),
        prompt_len=prompt_len,
        weight_versions=tuple(r.weight_version for r in chain),
        weight_version_spans=tuple(spans),
        link_spans=tuple(links),
        extras_commitments=tuple((r.model_call_id, r.extras_digest) for r in chain),
    )


def select_gym_terminal(records: Sequence[GymCallRecord]) -> tuple[str | None, str]:
    """Gym's parent-link terminal selection: ``(call_id or None, reason)``.

    Roots that have children are preferred; among them the earliest by
    ``(admitted_at is None, admitted_at, manifest position)``. Then, level by level,
    children that have children are preferred over childless ones; one survivor goes on,
    several end in ``ambiguous_terminal``. Other reasons: ``no_records``,
    ``duplicate_call_id``, ``orphaned_row``, ``no_root``; ``selected`` on success.
    """
    if not records:
        return None, "no_records"
    by_id = {r.model_call_id: r for r in records}
    if len(by_id) != len(records):
        return None, "duplicate_call_id"
    if any(r.parent_call_id is not None and r.parent_call_id not in by_id for r in records):
        return None, "orphaned_row"
    children: dict[str, list[GymCallRecord]] = {}
    roots: list[GymCallRecord] = []
    for r in records:
        if r.parent_call_id is None:
            roots.append(r)
        else:
            children.setdefault(r.parent_call_id, []).append(r)
    if not roots:
        return None, "no_root"
    position = {r.model_call_id: i for i, r in enumerate(records)}

    def survivors(candidates: list[GymCallRecord]) -> list[GymCallRecord]:
        return [c for c in candidates if children.get(c.model_call_id)] or candidates

    node = min(
        survivors(roots),
        key=lambda r: (r.admitted_at is None, r.admitted_at or 0.0, position[r.model_call_id]),
    )
    while candidates := children.get(node.model_call_id):
        pool = survivors(candidates)
        if len(pool) > 1:
            return None, "ambiguous_terminal"
        node = pool[0]
    return node.model_call_id, "selected"
