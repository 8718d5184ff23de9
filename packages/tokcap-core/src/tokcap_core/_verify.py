"""Verification of staged calls against a receipt.

Every call of every segment must be present, be the call the ledger committed
(identity, parent, lengths, weight versions and their spans, finish reason), hash to the
committed digest, and link by chain hash to the call before it; segment 0 must
end at the terminal. Any mismatch is a `VerificationError` with a stable code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ._digest import chain_hash
from ._errors import VerificationError
from ._receipt import Receipt, ReceiptCall
from ._staged import StagedCall
from .ids import StagingKey

__all__ = ["verify_staged"]


def verify_staged(
    receipt: Receipt, staged_calls: Mapping[StagingKey, StagedCall] | Iterable[StagedCall]
) -> list[list[StagedCall]]:
    """Check staged calls against ``receipt``; return them per segment, root first.

    ``staged_calls`` is a mapping from staging key or any iterable of calls (extra
    calls are ignored). Codes: ``receipt_poisoned``, ``missing_call``,
    ``identity_mismatch``, ``parent_mismatch``, ``length_mismatch``,
    ``metadata_mismatch``, ``media_mismatch``, ``digest_mismatch``, ``chain_mismatch``,
    ``parent_order``, ``terminal_mismatch``.
    """
    if not receipt.ok:
        raise VerificationError(
            "receipt_poisoned", f"{receipt.rollout_id}: {receipt.failure_reason}"
        )
    by_key = staged_calls if isinstance(staged_calls, Mapping) else {c.key: c for c in staged_calls}
    out: list[list[StagedCall]] = []
    for index, segment in enumerate(receipt.segments):
        if not segment:
            raise VerificationError("parent_order", f"segment {index} is empty")
        calls: list[StagedCall] = []
        previous: ReceiptCall | None = None
        for link in segment:
            call = by_key.get(link.staging_key)
            if call is None:
                raise VerificationError("missing_call", f"no staged row for {link.staging_key}")
            _check_call(receipt, link, call, previous)
            calls.append(call)
            previous = link
        out.append(calls)
    if receipt.segments and receipt.segments[0][-1].call_id != receipt.terminal_call_id:
        raise VerificationError("terminal_mismatch", "segment 0 does not end at the terminal")
    return out


def _check_call(
    receipt: Receipt, link: ReceiptCall, call: StagedCall, previous: ReceiptCall | None
) -> None:
    where = link.staging_key
    if call.rollout_id != receipt.rollout_id or call.call_id != link.call_id:
        raise VerificationError("identity_mismatch", f"{where}: row names {call.key}")
    if call.parent_id != link.parent_id:
        raise VerificationError(
            "parent_mismatch", f"{where}: parent {call.parent_id} != {link.parent_id}"
        )
    if (call.prefix_len, call.carry_len, call.gen_len) != (
        link.prefix_len,
        link.carry_len,
        link.gen_len,
    ):
        raise VerificationError("length_mismatch", f"{where}: lengths differ from the ledger")
    if (
        call.weight_version,
        call.weight_version_last,
        call.finish_reason,
        call.weight_versions,
        call.kv_versions,
    ) != (
        link.weight_version,
        link.weight_version_last,
        link.finish_reason,
        link.weight_versions,
        link.kv_versions,
    ):
        raise VerificationError(
            "metadata_mismatch", f"{where}: weight versions or finish reason differ"
        )
    media = None if call.media is None else tuple(m.bytes_sha256 for m in call.media)
    if media != link.media_digests:
        raise VerificationError(
            "media_mismatch", f"{where}: media byte digests differ from the ledger's"
        )
    if call.digest != link.call_digest or call.compute_digest() != link.call_digest:
        raise VerificationError("digest_mismatch", f"{where}: digest does not match the ledger")
    expected_parent_id = previous.call_id if previous is not None else None
    if link.parent_id != expected_parent_id or link.prefix_len != (
        previous.cum_len if previous else 0
    ):
        raise VerificationError("parent_order", f"{where}: does not extend the call before it")
    expected_chain = chain_hash(previous.chain_hash if previous else None, link.call_digest)
    if call.chain_hash != link.chain_hash or link.chain_hash != expected_chain:
        raise VerificationError(
            "chain_mismatch", f"{where}: chain hash does not link to its parent"
        )
