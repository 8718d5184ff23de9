"""Reassembly: staged calls verified against a receipt, laid out as training rows, by
rollout and by group.

Verification (`verify_staged`). Every call of every segment must be present, be the call the
ledger committed (identity, parent, lengths, weight versions and their spans, finish
reason), hash to the committed digest, and link by chain hash to the call before it; segment
0 must end at the terminal. Any mismatch is a `VerificationError` with a stable code.

Rows (`reassemble`). A segment's calls are root→end and each call carries the tokens after
its parent's cumulative length, so the row is their concatenation: carried tokens get mask 0
and logprob 0.0, generated tokens mask 1 and their sampled logprob. Routes concatenate along
the chain; a call's leading route row (the engine's prefill route for the parent's last
generated token) backfills that token's unknown row. Rows longer than ``max_seq_len`` are
cut (tokens, routes and call spans alike) and marked truncated; the weight versions are
those of the generated tokens kept (each call's first and last, so a call generated across a
weight push widens the range).

Groups (`reassemble_group`). Pure: the caller (the Ray pool, or an in-process trainer)
fetches the staged rows, publishes the rows and clears staging; this module decides nothing
about I/O. Exactly one row per receipt segment of each valid rollout and one placeholder per
invalid rollout, in request order, so a group always yields a known number of rows.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from ._digest import chain_hash
from ._errors import ReassemblyError, RoutesError, VerificationError
from ._receipt import Receipt, ReceiptCall
from ._rows import CallSpan, TrainingRow, placeholder_row
from ._rpc import FinalizedGroup, ReassemblyRequest
from ._staged import StagedCall
from .ids import StagingKey, TrainingKey
from .metrics import failure_counts, terminal_selection_breakdown
from .provenance import clip_spans
from .reasons import MISSING_ROWS, REASSEMBLY_FAILED, make_reason
from .routes import Routes, concat_routes, unknown_rows

__all__ = ["GroupResult", "on_chain_keys", "reassemble", "reassemble_group", "verify_staged"]


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


def reassemble(
    receipt: Receipt,
    staged: Mapping[StagingKey, StagedCall] | Iterable[StagedCall],
    *,
    max_seq_len: int,
    reward: float | None = None,
) -> list[TrainingRow]:
    """Verify ``staged`` against ``receipt`` and build one row per segment.

    ``reward`` overrides the receipt's reward. Raises `ReassemblyError` with the
    verification code (``missing_call``, ``digest_mismatch``, ...) or ``routes_partial``,
    ``chain_shape_mismatch``, ``chain_dtype_mismatch``, ``no_generated_tokens``,
    ``media_truncated``, ``bad_max_seq_len``.
    """
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1:
        raise ReassemblyError(
            "bad_max_seq_len", f"max_seq_len must be a positive int: {max_seq_len!r}"
        )
    try:
        segments = verify_staged(receipt, staged)
    except ReassemblyError:
        raise
    except VerificationError as e:
        raise ReassemblyError(e.code, e.message) from e
    row_reward = receipt.reward if reward is None else reward
    return [
        _segment_row(receipt, index, calls, max_seq_len=max_seq_len, reward=row_reward)
        for index, calls in enumerate(segments)
    ]


def _segment_row(
    receipt: Receipt, index: int, calls: list[StagedCall], *, max_seq_len: int, reward: float | None
) -> TrainingRow:
    input_ids = array("I")
    loss_mask = array("B")
    logprobs = array("f")
    spans = [CallSpan.for_call(call) for call in calls]
    for call in calls:
        input_ids.extend(call.tokens)
        loss_mask.frombytes(bytes(call.carry_len))
        loss_mask.frombytes(b"\x01" * call.gen_len)
        logprobs.frombytes(bytes(4 * call.carry_len))  # 0.0 in f32 is four zero bytes
        logprobs.extend(call.logprobs)
    routes, backfilled = _chain_routes(calls)
    media = tuple(item for call in calls for item in call.media or ())
    truncated = calls[-1].finish_reason == "length"
    if len(input_ids) > max_seq_len:
        if any(item.offset < max_seq_len < item.end for item in media):
            raise ReassemblyError(
                "media_truncated", f"{receipt.rollout_id}: max_seq_len cuts an image's tokens"
            )
        media = tuple(item for item in media if item.end <= max_seq_len)
        truncated = True
        del input_ids[max_seq_len:], loss_mask[max_seq_len:], logprobs[max_seq_len:]
        if routes is not None:
            routes = _rows(routes, 0, max_seq_len)
        spans = _clip_spans(spans, max_seq_len)
    prompt_len = calls[0].carry_len
    if prompt_len >= len(input_ids):
        raise ReassemblyError(
            "no_generated_tokens", f"{receipt.rollout_id}: max_seq_len leaves no generated token"
        )
    versions = [v for s in spans if s.gen_len for v in (s.weight_version, s.weight_version_last)]
    return TrainingRow(
        rollout_id=receipt.rollout_id,
        segment=index,
        input_ids=input_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        routes=routes,
        prompt_len=prompt_len,
        call_spans=tuple(spans),
        weight_version_min=min(versions),
        weight_version_max=max(versions),
        truncated=truncated,
        reward=reward,
        sample_mask=1,
        reason=None,
        terminal_call_id=calls[-1].call_id if index == 0 else None,
        backfilled_route_rows=backfilled,
        media=media,
    )


def _clip_spans(spans: list[CallSpan], length: int) -> list[CallSpan]:
    """The spans of a row cut to ``length`` tokens: calls past the cut go, the last is clipped."""
    clipped = []
    for span in spans:
        if span.start >= length:
            break
        carry = min(span.carry_len, length - span.start)
        gen = min(span.gen_len, length - span.start - carry)
        clipped.append(
            replace(
                span,
                carry_len=carry,
                gen_len=gen,
                weight_versions=clip_spans(span.weight_versions, gen),
                kv_versions=clip_spans(span.kv_versions, gen),
            )
        )
    return clipped


def _chain_routes(calls: list[StagedCall]) -> tuple[Routes | None, int]:
    """Concatenate per-call routes along the chain, backfilling each parent's last row."""
    with_routes = [c.routes is not None for c in calls]
    if not any(with_routes):
        return None, 0
    if not all(with_routes):
        raise ReassemblyError(
            "routes_partial", "some calls of a segment carry routes and some do not"
        )
    parts: list[Routes] = []
    backfilled = 0
    for call in calls:
        routes = call.routes
        assert routes is not None
        if call.parent_id is not None:
            lead = _rows(routes, 0, 1)
            previous = parts[-1]
            last = previous.shape[0] - 1
            try:
                if unknown_rows(_rows(previous, last, 1)) and not unknown_rows(lead):
                    parts[-1] = concat_routes([_rows(previous, 0, last), lead])
                    backfilled += 1
            except RoutesError as e:
                raise ReassemblyError(e.code, e.message) from e
            routes = _rows(routes, 1, routes.shape[0] - 1)
        parts.append(routes)
    try:
        return concat_routes(parts), backfilled
    except RoutesError as e:
        raise ReassemblyError(e.code, e.message) from e


def _rows(routes: Routes, first: int, count: int) -> Routes:
    _, layers, topk = routes.shape
    width = layers * topk
    return Routes(
        dtype=routes.dtype,
        shape=(count, layers, topk),
        data=routes.data[first * width : (first + count) * width],
    )


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
