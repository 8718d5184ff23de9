"""Failure reasons: a closed set of buckets, optionally with a detail after a colon.

Metrics count per bucket (``reason_bucket``), never per templated string, so
cardinality stays bounded whatever detail an adapter attaches.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "AMBIGUOUS_TERMINAL",
    "DECLARED_TERMINAL_MISSING",
    "ENGINE_FAILED",
    "FAILURE_BUCKETS",
    "GATE_FAILED",
    "GATE_RESTARTED",
    "GATE_UNREACHABLE",
    "LEDGER_REFUSED",
    "LEDGER_WRITE_FAILED",
    "MANIFEST_INVALID",
    "MISSING_ROWS",
    "NOT_CLOSED",
    "NO_TERMINAL",
    "PARENT_UNRESOLVED",
    "PEER_POISONED",
    "REASSEMBLY_FAILED",
    "STAGE_FAILED",
    "UNCOMMITTED_CALL",
    "UNKNOWN_REASON",
    "WITNESS_DISAGREEMENT",
    "WITNESS_UNMATCHED",
    "make_reason",
    "reason_bucket",
]

PARENT_UNRESOLVED: Final = "parent_unresolved"
"""A child call's parent could not be resolved to a staged call."""
UNCOMMITTED_CALL: Final = "uncommitted_call"
"""A call was admitted but never staged nor failed when the rollout closed."""
STAGE_FAILED: Final = "stage_failed"
"""The sink write of a served call failed (detail: the sink's error code)."""
ENGINE_FAILED: Final = "engine_failed"
"""The engine failed after returning part of a completion."""
DECLARED_TERMINAL_MISSING: Final = "declared_terminal_missing"
"""The declared terminal names no staged call."""
WITNESS_DISAGREEMENT: Final = "witness_disagreement"
"""The close witnesses point at different calls."""
WITNESS_UNMATCHED: Final = "witness_unmatched"
"""A close witness matches no staged call."""
AMBIGUOUS_TERMINAL: Final = "ambiguous_terminal"
"""The heuristic found two equally deep leaves in the latest root."""
NO_TERMINAL: Final = "no_terminal"
"""The rollout has no staged call at all."""
NOT_CLOSED: Final = "not_closed"
"""A receipt was asked for a rollout that is still open."""
GATE_RESTARTED: Final = "gate_restarted"
"""The rollout was open when its gate crashed and restarted."""
GATE_UNREACHABLE: Final = "gate_unreachable"
"""The rollout's gate stopped answering while the rollout was open (a fleet client poisons
that gate's open rollouts only; detail: the transport error)."""
MISSING_ROWS: Final = "missing_rows"
"""The sink does not hold every staged row a receipt names."""
REASSEMBLY_FAILED: Final = "reassembly_failed"
"""Staged rows did not verify against the receipt (detail: the error code)."""
MANIFEST_INVALID: Final = "manifest_invalid"
"""The rollout's manifest could not be fetched, decoded or verified (detail: the code)."""
LEDGER_REFUSED: Final = "ledger_refused"
"""The gate's ledger refused a served call's commit (detail: the ledger's code, e.g.
``duplicate_response_id``); the call is failed and its rollout alone poisoned."""
LEDGER_WRITE_FAILED: Final = "ledger_write_failed"
"""The gate's ledger file could not record one of the rollout's entries (detail: errno
name); its rollout alone is poisoned."""
GATE_FAILED: Final = "gate_failed"
"""An unexpected failure inside the gate while capturing one of the rollout's calls
(detail: the error's code or type), contained to that rollout."""
PEER_POISONED: Final = "peer_poisoned"
"""A peer's capture (e.g. NeMo-Gym) poisoned the rollout for a reason outside this set
(detail: the peer's own reason code, kept verbatim)."""
UNKNOWN_REASON: Final = "unknown"
"""The bucket of a reason string outside the closed set."""

FAILURE_BUCKETS: Final[tuple[str, ...]] = (
    PARENT_UNRESOLVED,
    UNCOMMITTED_CALL,
    STAGE_FAILED,
    ENGINE_FAILED,
    DECLARED_TERMINAL_MISSING,
    WITNESS_DISAGREEMENT,
    WITNESS_UNMATCHED,
    AMBIGUOUS_TERMINAL,
    NO_TERMINAL,
    NOT_CLOSED,
    GATE_RESTARTED,
    MISSING_ROWS,
    REASSEMBLY_FAILED,
    MANIFEST_INVALID,
    LEDGER_REFUSED,
    LEDGER_WRITE_FAILED,
    GATE_FAILED,
    PEER_POISONED,
    GATE_UNREACHABLE,
)
"""Every failure bucket, in a stable order (metrics may use it as their key set)."""


def make_reason(bucket: str, detail: str | None = None) -> str:
    """``bucket`` or ``"bucket:detail"``; `ValueError` if ``bucket`` is not in the closed set."""
    if bucket not in FAILURE_BUCKETS:
        raise ValueError(f"unknown failure bucket: {bucket!r}")
    if detail is None or detail == "":
        return bucket
    return f"{bucket}:{detail}"


def reason_bucket(reason: str) -> str:
    """The bucket of a reason (text before the first colon), `UNKNOWN_REASON` if outside the set."""
    bucket = reason.split(":", 1)[0]
    return bucket if bucket in FAILURE_BUCKETS else UNKNOWN_REASON
