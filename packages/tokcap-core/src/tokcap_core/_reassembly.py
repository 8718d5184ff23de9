"""Reassembly: verified staged calls → one training row per receipt segment.

A segment's calls are root→end and each call carries the tokens after its
parent's cumulative length, so the row is their concatenation: carried tokens
get mask 0 and logprob 0.0, generated tokens mask 1 and their sampled logprob.
Routes concatenate along the chain; a call's leading route row (the engine's
prefill route for the parent's last generated token) backfills that token's
unknown row. Rows longer than ``max_seq_len`` are cut (tokens, routes and call spans alike)
and marked truncated; the weight versions are those of the generated tokens kept (each
call's first and last, so a call generated across a weight push widens the range).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from dataclasses import replace

from ._errors import ReassemblyError, RoutesError, VerificationError
from ._receipt import Receipt
from ._rows import CallSpan, TrainingRow
from ._staged import StagedCall
from ._verify import verify_staged
from .ids import StagingKey
from .provenance import clip_spans
from .routes import Routes, concat_routes, unknown_rows

__all__ = ["reassemble"]


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
