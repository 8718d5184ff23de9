"""A trainer's receipts from manifest bytes: decoded, replayed and checked against the head
kept at close, or poisoned with the reason (never dropped).

Both doors a manifest comes through use it: ``GET …/manifest`` (`ControlPlaneClient.receipt`)
and a batch close that answers each closed rollout's manifest (``close_many(receipts=…)``).
"""

from __future__ import annotations

from typing import Literal

from tokcap_core import (
    Manifest,
    Receipt,
    VerificationError,
    assemble_receipt,
    decode_manifest,
    verify_manifest,
)
from tokcap_core.ids import StagingKey, staging_key
from tokcap_core.ledger import Admitted, genesis_hash
from tokcap_core.reasons import make_reason

from ..api import MANIFEST_FAILURE_BUCKET

__all__ = ["manifest_failure", "poisoned_receipt", "verified_receipt"]


def verified_receipt(
    rollout_id: str,
    data: bytes,
    *,
    expected_head: tuple[int, str] | None,
    segments: Literal["terminal", "all"],
    max_bytes: int,
) -> Receipt:
    """The receipt ``data`` (a manifest's bytes) gives ``rollout_id`` once it decodes, is
    that rollout's, replays, and ends at ``expected_head``; poisoned
    (``manifest_invalid:<code>``) otherwise."""
    manifest = None
    try:
        manifest = decode_manifest(data, max_bytes=max_bytes)
        if manifest.rollout_id != rollout_id:
            raise VerificationError("wrong_rollout", "the gate served another rollout")
        state = verify_manifest(manifest, expected_head=expected_head)
    except VerificationError as e:
        return manifest_failure(rollout_id, e.code, manifest)
    return assemble_receipt(state, segments=segments)


def manifest_failure(rollout_id: str, code: str, manifest: Manifest | None = None) -> Receipt:
    """A poisoned receipt for a rollout whose manifest is missing or does not verify."""
    return poisoned_receipt(rollout_id, make_reason(MANIFEST_FAILURE_BUCKET, code), manifest)


def poisoned_receipt(rollout_id: str, reason: str, manifest: Manifest | None = None) -> Receipt:
    """A poisoned receipt with ``reason`` for a rollout whose manifest cannot be trusted.

    Its ``sink_keys`` are the staging keys the (unverified) manifest admitted, if any, so
    cleanup can still free them (clearing an absent key is harmless).
    """
    keys: tuple[StagingKey, ...] = ()
    head = (0, genesis_hash(rollout_id))
    if manifest is not None and manifest.rollout_id == rollout_id:
        keys = tuple(
            staging_key(rollout_id, e.event.call_id)
            for e in manifest.entries
            if isinstance(e.event, Admitted)
        )
        head = manifest.head
    return Receipt(
        rollout_id=rollout_id,
        status="poisoned",
        failure_reason=reason,
        terminal_call_id=None,
        terminal_selection=None,
        segments=(),
        ledger_head=head,
        reward=None,
        sink_keys=keys,
        break_causes=(),
    )
