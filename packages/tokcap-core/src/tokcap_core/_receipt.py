"""Receipts: the verified prefix chain(s) naming exactly which staged rows form a trajectory.

Terminal selection, in order (the first rule that applies decides; none falls back):
1. declared (`TerminalDeclared`): the named call must be STAGED, else the rollout is
   poisoned with ``declared_terminal_missing``;
2. witnesses of `Closed` (scored ``response_id``, output ``content`` fingerprint): each
   must match a staged call (``witness_unmatched``) and they must agree
   (``witness_disagreement``); a content fingerprint shared by several calls is
   ``ambiguous_terminal`` unless a response-id witness picks one of them;
3. heuristic: the deepest chain under the latest root; a tie is ``ambiguous_terminal``.
A served failure or a call left uncommitted poisons its own rollout; a call that
failed without ever being served (``Failed(served=False)``) is off-chain and does not.
A rewritten history is a forest: ``segments="all"`` adds, after segment 0 (which
ends at the terminal), one segment per other root: its deepest chain.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeAlias

from ._errors import VerificationError
from ._ledger import ADMITTED, CLOSED, FAILED, STAGED, CallRecord, RolloutState
from .ids import StagingKey, staging_key
from .provenance import Spans, spans_to_json
from .reasons import (
    AMBIGUOUS_TERMINAL,
    DECLARED_TERMINAL_MISSING,
    NO_TERMINAL,
    NOT_CLOSED,
    UNCOMMITTED_CALL,
    WITNESS_DISAGREEMENT,
    WITNESS_UNMATCHED,
)

__all__ = [
    "SEGMENT_MODES",
    "TERMINAL_SELECTIONS",
    "Receipt",
    "ReceiptCall",
    "SegmentMode",
    "TerminalSelection",
    "assemble_receipt",
]

TerminalSelection: TypeAlias = Literal["declared", "response_id", "content", "heuristic"]
TERMINAL_SELECTIONS: Final[tuple[TerminalSelection, ...]] = (
    "declared",
    "response_id",
    "content",
    "heuristic",
)
"""Every way a terminal can be selected, in priority order."""
SegmentMode: TypeAlias = Literal["terminal", "all"]
SEGMENT_MODES: Final[tuple[SegmentMode, ...]] = ("terminal", "all")
"""Segment modes: only the terminal's chain, or one extra chain per other root."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReceiptCall:
    """One call of a segment, as the ledger committed it (token-free)."""

    call_id: str
    staging_key: StagingKey
    parent_id: str | None
    prefix_len: int
    carry_len: int
    gen_len: int
    weight_version: int
    weight_version_last: int
    finish_reason: str
    call_digest: str
    chain_hash: str
    formation: str
    """How the ledger says its prompt was formed: ``root``, ``extend`` or ``splice``."""
    splice_cause: str | None
    weight_versions: Spans | None = None
    """Which weights sampled which generated tokens, as the ledger committed (format v3)."""
    kv_versions: Spans | None = None
    """The oldest weights whose KV each generated token was conditioned on (format v3)."""
    media_digests: tuple[str, ...] | None = None
    """The SHA-256 of each media item's bytes, as the ledger named them (format v4)."""

    @property
    def cum_len(self) -> int:
        """Cumulative length after this call."""
        return self.prefix_len + self.carry_len + self.gen_len


@dataclass(frozen=True, slots=True, kw_only=True)
class Receipt:
    """What a trainer may learn from for one rollout, and why."""

    rollout_id: str
    status: Literal["verified", "poisoned"]
    failure_reason: str | None
    terminal_call_id: str | None
    terminal_selection: TerminalSelection | None
    segments: tuple[tuple[ReceiptCall, ...], ...]
    ledger_head: tuple[int, str]
    reward: float | None
    sink_keys: tuple[StagingKey, ...]
    """Staging keys of every admitted call (on-chain or not): what cleanup must clear."""
    break_causes: tuple[str, ...]
    """Why each non-first root started (one entry per break)."""
    splice_causes: tuple[str, ...] = ()
    """Why each spliced call's parent turn rendered differently (one entry per splice)."""

    @property
    def ok(self) -> bool:
        """True for a verified receipt."""
        return self.status == "verified"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (for printing and reports)."""
        return {
            "rollout_id": self.rollout_id,
            "status": self.status,
            "failure_reason": self.failure_reason,
            "terminal_call_id": self.terminal_call_id,
            "terminal_selection": self.terminal_selection,
            "reward": self.reward,
            "ledger_head": {"seq": self.ledger_head[0], "hash": self.ledger_head[1]},
            "segments": [[_call_json(c) for c in seg] for seg in self.segments],
            "sink_keys": list(self.sink_keys),
            "break_causes": list(self.break_causes),
            "splice_causes": list(self.splice_causes),
        }


def _call_json(call: ReceiptCall) -> dict[str, Any]:
    out = {name: getattr(call, name) for name in ReceiptCall.__dataclass_fields__}
    for name in ("weight_versions", "kv_versions"):  # absent for a format v2 call
        value = out.pop(name)
        if value is not None:
            out[name] = spans_to_json(value)
    media = out.pop("media_digests")
    if media is not None:  # absent before format v4
        out["media_digests"] = list(media)
    return out


def _receipt_call(state: RolloutState, record: CallRecord) -> ReceiptCall:
    staged = record.staged
    assert staged is not None
    return ReceiptCall(
        call_id=record.call_id,
        staging_key=staging_key(state.rollout_id, record.call_id),
        parent_id=record.parent_id,
        prefix_len=record.admitted.prefix_len,
        carry_len=staged.carry_len,
        gen_len=staged.gen_len,
        weight_version=staged.weight_version,
        weight_version_last=staged.weight_version_last,
        finish_reason=staged.finish_reason,
        call_digest=staged.call_digest,
        chain_hash=staged.chain_hash,
        formation=record.admitted.formation,
        splice_cause=record.admitted.splice_cause,
        weight_versions=staged.weight_versions,
        kv_versions=staged.kv_versions,
        media_digests=staged.media_digests,
    )


def assemble_receipt(state: RolloutState, *, segments: SegmentMode = "terminal") -> Receipt:
    """Select the terminal and build the receipt of a replayed rollout (see module docstring)."""
    if segments not in SEGMENT_MODES:
        raise VerificationError("bad_segment_mode", f"segments must be one of {SEGMENT_MODES}")
    base: dict[str, Any] = {
        "rollout_id": state.rollout_id,
        "ledger_head": state.head,
        "reward": state.closed.reward if state.closed is not None else None,
        "sink_keys": tuple(staging_key(state.rollout_id, cid) for cid in state.calls),
        "break_causes": tuple(
            r.admitted.break_cause for r in state.calls.values() if r.admitted.break_cause
        ),
        "splice_causes": tuple(
            r.admitted.splice_cause for r in state.calls.values() if r.admitted.splice_cause
        ),
    }

    def poisoned(reason: str) -> Receipt:
        return Receipt(
            status="poisoned",
            failure_reason=reason,
            terminal_call_id=None,
            terminal_selection=None,
            segments=(),
            **base,
        )

    if state.status is not CLOSED:
        return poisoned(NOT_CLOSED)
    if state.poisoned is not None:
        return poisoned(state.poisoned.reason)
    for record in state.calls.values():
        if record.state is ADMITTED:
            return poisoned(UNCOMMITTED_CALL)
        if record.state is FAILED and record.failed is not None and record.failed.served:
            return poisoned(record.failed.reason)
    staged = {cid: r for cid, r in state.calls.items() if r.state is STAGED}
    if not staged:
        return poisoned(NO_TERMINAL)
    choice = _select_terminal(state, staged)
    if isinstance(choice, str):
        return poisoned(choice)
    terminal_id, selection = choice
    chains = [_chain(staged, terminal_id)]
    if segments == "all":
        terminal_root = chains[0][0].call_id
        for root_id in _roots(staged):
            if root_id != terminal_root:
                leaf = _deepest_leaves(staged, root_id)[-1]
                chains.append(_chain(staged, leaf))
    return Receipt(
        status="verified",
        failure_reason=None,
        terminal_call_id=terminal_id,
        terminal_selection=selection,
        segments=tuple(tuple(_receipt_call(state, r) for r in chain) for chain in chains),
        **base,
    )


def _select_terminal(
    state: RolloutState, staged: Mapping[str, CallRecord]
) -> tuple[str, TerminalSelection] | str:
    """``(call_id, selection)``, or a failure reason."""
    by_response = {
        r.staged.response_id: cid for cid, r in staged.items() if r.staged and r.staged.response_id
    }
    if state.terminal is not None:
        declared = state.terminal
        found = declared.value if declared.by == "call_id" else by_response.get(declared.value)
        if found is None or found not in staged:
            return DECLARED_TERMINAL_MISSING
        return found, "declared"
    witnesses = state.closed.witnesses if state.closed is not None else None
    picks: list[tuple[str, TerminalSelection]] = []
    if witnesses is not None and witnesses.response_id is not None:
        found = by_response.get(witnesses.response_id)
        if found is None:
            return WITNESS_UNMATCHED
        picks.append((found, "response_id"))
    if witnesses is not None and witnesses.content_fingerprint is not None:
        matches = [
            cid
            for cid, r in staged.items()
            if r.staged and r.staged.output_fingerprint == witnesses.content_fingerprint
        ]
        if not matches:
            return WITNESS_UNMATCHED
        if len(matches) > 1 and not picks:
            return AMBIGUOUS_TERMINAL
        if picks and picks[0][0] not in matches:
            return WITNESS_DISAGREEMENT
        if not picks:
            picks.append((matches[0], "content"))
    if picks:
        return picks[0]
    leaves = _deepest_leaves(staged, _roots(staged)[-1])
    if len(leaves) > 1 and _depth(staged, leaves[-1]) == _depth(staged, leaves[-2]):
        return AMBIGUOUS_TERMINAL
    return leaves[-1], "heuristic"


def _roots(staged: Mapping[str, CallRecord]) -> list[str]:
    """Staged roots in admission order."""
    return [cid for cid, r in staged.items() if r.parent_id is None]


def _depth(staged: Mapping[str, CallRecord], call_id: str) -> int:
    depth = 1
    parent = staged[call_id].parent_id
    while parent is not None:
        depth += 1
        parent = staged[parent].parent_id
    return depth


def _deepest_leaves(staged: Mapping[str, CallRecord], root_id: str) -> list[str]:
    """The calls under ``root_id`` sorted by (depth, cumulative length, admission order)."""
    order = {cid: i for i, cid in enumerate(staged)}
    members = [cid for cid in staged if _root_of(staged, cid) == root_id]
    return sorted(members, key=lambda cid: (_depth(staged, cid), staged[cid].cum_len, order[cid]))


def _root_of(staged: Mapping[str, CallRecord], call_id: str) -> str:
    while (parent := staged[call_id].parent_id) is not None:
        call_id = parent
    return call_id


def _chain(staged: Mapping[str, CallRecord], leaf_id: str) -> list[CallRecord]:
    chain = [staged[leaf_id]]
    while (parent := chain[-1].parent_id) is not None:
        chain.append(staged[parent])
    chain.reverse()
    return chain
