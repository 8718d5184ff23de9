"""Errors for NeMo-Gym interop, and Gym's reason codes mapped onto tokcap's failure buckets.

Three errors, split like the core's: `GymFormatError` (a Gym document cannot be read:
JSON, unknown or missing keys, types, versions, a record's own digest),
`GymVerificationError` (the documents read but Gym's verifier rejects the rollout; its
``code`` is Gym's own verifier code, e.g. ``wrong_digest``, ``chain_hash_mismatch``) and
`GymConversionError` (a verified Gym row cannot become a tokcap row, or a tokcap capture
cannot be written in Gym's format). All keep the core's ``args == (code, message)``, so
they pickle.
"""

from __future__ import annotations

from typing import Final

from .._errors import ManifestError, ReassemblyError, VerificationError
from ..reasons import (
    AMBIGUOUS_TERMINAL,
    DECLARED_TERMINAL_MISSING,
    MANIFEST_INVALID,
    NO_TERMINAL,
    PARENT_UNRESOLVED,
    PEER_POISONED,
    REASSEMBLY_FAILED,
    STAGE_FAILED,
    UNCOMMITTED_CALL,
    WITNESS_DISAGREEMENT,
    WITNESS_UNMATCHED,
    make_reason,
)

__all__ = [
    "GYM_UNCOMMITTED_CALL_REASON",
    "GymConversionError",
    "GymFormatError",
    "GymVerificationError",
    "gym_failure_reason",
]


class GymFormatError(ManifestError):
    """A Gym staged record, call record, receipt, manifest or lineage row is malformed."""


class GymVerificationError(VerificationError):
    """Gym's verifier rejects the rollout; ``code`` is Gym's verifier code."""


class GymConversionError(ReassemblyError):
    """A Gym row cannot become a tokcap row, or a tokcap capture cannot be exported."""


GYM_UNCOMMITTED_CALL_REASON: Final = "request_finished_without_staged_coordinates"
"""Gym's failure row for a call that never staged: it does not poison on its own."""

# Gym's poison, selection and attribution reasons (a wire contract Gym never repurposes).
_POISON_BUCKETS: Final[dict[str, str]] = {
    "unresolved_parent": PARENT_UNRESOLVED,
    GYM_UNCOMMITTED_CALL_REASON: UNCOMMITTED_CALL,
    "ledger_row_missing_response_id": MANIFEST_INVALID,
    "ledger_row_missing_chain_hash": MANIFEST_INVALID,
    "worker_response_missing_commit_coordinates": STAGE_FAILED,
    "worker_capture_failed": STAGE_FAILED,
    "invalid_worker_commit_coordinates": STAGE_FAILED,
    "no_records": NO_TERMINAL,
    "missing_terminal_row": NO_TERMINAL,
    "duplicate_call_id": MANIFEST_INVALID,
    "orphaned_row": PARENT_UNRESOLVED,
    "no_root": MANIFEST_INVALID,
    "ambiguous_terminal": AMBIGUOUS_TERMINAL,
    "invalid_manifest_row": MANIFEST_INVALID,
    "explicit_terminal_not_captured": DECLARED_TERMINAL_MISSING,
    "declared_terminal_not_captured": DECLARED_TERMINAL_MISSING,
    "declared_ambiguous": AMBIGUOUS_TERMINAL,
    "response_id_ambiguous": AMBIGUOUS_TERMINAL,
    "content_ambiguous": AMBIGUOUS_TERMINAL,
    "response_id_no_match": WITNESS_UNMATCHED,
    "no_content_match": WITNESS_UNMATCHED,
}

# Verifier codes about the receipt or its manifest (the rest are about the staged rows).
_MANIFEST_CODES: Final = frozenset(
    {
        "unsupported_schema",
        "unsupported_digest",
        "unsupported_extras_digest",
        "empty_manifest",
        "duplicate_manifest_row",
        "duplicate_staging_key",
        "missing_parent",
        "parent_length_mismatch",
        "lineage_cycle",
        "missing_terminal",
        "terminal_selection_mismatch",
    }
)


def gym_failure_reason(gym_code: str, *, verifier: bool = False) -> str:
    """The tokcap failure reason (``bucket:gym_code``) for a Gym reason or verifier code.

    With ``verifier=False`` ``gym_code`` is a receipt's ``failure_reason`` (or
    ``capture_poisoned``): Gym's known poison, selection and attribution reasons map to
    their tokcap bucket, ``witness_disagreement[...]`` to ``witness_disagreement``, any
    other reason to ``peer_poisoned``. With ``verifier=True`` it is a verifier code:
    receipt and manifest codes map to ``manifest_invalid``, staged-row codes to
    ``reassembly_failed``. The Gym code is always kept verbatim as the detail.
    """
    if verifier:
        bucket = MANIFEST_INVALID if gym_code in _MANIFEST_CODES else REASSEMBLY_FAILED
    elif gym_code.startswith("witness_disagreement"):
        bucket = WITNESS_DISAGREEMENT
    else:
        # An attribution trail joins its tokens with commas; the first one decides.
        bucket = _POISON_BUCKETS.get(gym_code.split(",", 1)[0], PEER_POISONED)
    return make_reason(bucket, gym_code)
