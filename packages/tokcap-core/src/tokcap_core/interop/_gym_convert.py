"""A verified Gym rollout as tokcap sees it: a `Receipt`, a `TrainingRow`, Gym's reason.

The row is the linearised terminal chain: ``input_ids`` the token ids (u32; an id of
2**32 or more is ``token_id_out_of_range``), ``loss_mask`` 1 where Gym's mask is 1.0,
``logprobs`` as float32 (what Gym's digest commits to), one `CallSpan` per chain call
with its weight version, routes from each call's verified extras. Gym stores routes per
call in ``extras["routed_experts"]`` (an ``nrlre1`` envelope or nested lists), aligned to
the call's delta; a call's fragment is used as Gym's consumers use it: whole when it
covers carry and generation, its last generated rows when it covers at least those,
otherwise the span is unknown (-1). A chain call whose extras digest commits to extras
that were not sent (a base snapshot) is ``extras_not_loaded``: the row would silently
lose what they hold; `linearize_gym_rollout` alone never reads extras.

Optional extras keys, written by `export_gym_capture` and ignored by Gym, make a tokcap
capture survive the trip: ``tokcap_finish_reason`` (``"length"`` marks the row
truncated), ``tokcap_prefill_route`` (the engine's route for the parent's last generated
token, which backfills that unknown row exactly as tokcap's reassembly does),
``tokcap_weight_version_last`` (Gym keeps one weight version per call, the one at its
first generated token; a call generated across a weight push records its last one here)
and ``tokcap_splice_cause`` (a child tokcap formed by splicing, and why).

Gym records no ledger: the receipt's ``ledger_head`` is ``(manifest rows, terminal
chain hash)``, its ``finish_reason`` per call ``"unknown"`` unless the extras say, a
child's formation ``extend`` unless the extras name a splice cause, and every root
after the first counts as a ``no_parent_match`` break.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from .._digest import ZERO_HASH
from .._errors import RoutesError
from .._events import SPLICE_CAUSES
from .._receipt import Receipt, ReceiptCall, TerminalSelection
from .._rows import CallSpan, TrainingRow, placeholder_row
from ..ids import StagingKey
from ..routes import (
    Routes,
    concat_routes,
    decode_routes,
    routes_from_rows,
    unknown_routes,
    unknown_rows,
    widen,
)
from ._gym_digest import EMPTY_EXTRAS_DIGEST
from ._gym_errors import GymConversionError, gym_failure_reason
from ._gym_records import GymReceipt, GymStagedRecord
from ._gym_verify import GymLinearizedRow, linearize_gym_rollout

__all__ = [
    "GYM_UNKNOWN_FINISH",
    "ROUTED_EXPERTS_KEY",
    "TOKCAP_FINISH_REASON_KEY",
    "TOKCAP_PREFILL_ROUTE_KEY",
    "TOKCAP_SPLICE_CAUSE_KEY",
    "TOKCAP_WEIGHT_VERSION_LAST_KEY",
    "GymVerification",
    "verify_gym_rollout",
]

ROUTED_EXPERTS_KEY: Final = "routed_experts"
"""The extras key Gym's adapters put a call's routed experts under."""
TOKCAP_FINISH_REASON_KEY: Final = "tokcap_finish_reason"
"""An extras key tokcap's export adds (Gym ignores it): the call's finish reason."""
TOKCAP_PREFILL_ROUTE_KEY: Final = "tokcap_prefill_route"
"""An extras key tokcap's export adds: a child's leading route row (backfills its parent)."""
TOKCAP_WEIGHT_VERSION_LAST_KEY: Final = "tokcap_weight_version_last"
"""An extras key tokcap's export adds when a call spanned a weight push: its last version."""
TOKCAP_SPLICE_CAUSE_KEY: Final = "tokcap_splice_cause"
"""An extras key tokcap's export adds to a spliced child: its splice cause."""
GYM_UNKNOWN_FINISH: Final = "unknown"
"""The finish reason of a Gym call whose extras do not record one."""
_WIDTH: Final = {"int8": 0, "int16": 1, "int32": 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class GymVerification:
    """The outcome for one Gym rollout: a tokcap receipt and row, Gym's own reason kept."""

    receipt: Receipt
    row: TrainingRow
    """The linearised row, or a placeholder (``sample_mask == 0``) for a poisoned rollout."""
    gym_reason: str | None
    """Gym's failure reason for a poisoned receipt (``capture_poisoned`` when it gives none)."""
    linearized: GymLinearizedRow | None
    """Gym's own linearised row (u64 ids, float masks), None when poisoned."""

    @property
    def ok(self) -> bool:
        """True when the rollout verified and may be trained on."""
        return self.receipt.ok


def verify_gym_rollout(
    receipt: GymReceipt, snapshots: Sequence[GymStagedRecord]
) -> GymVerification:
    """Verify a Gym rollout with Gym's rules and convert it for tokcap.

    A receipt Gym marks failed or poisoned gives a poisoned result (no snapshot is read);
    its reason maps onto tokcap's buckets (`gym_failure_reason`). Data that fails Gym's
    verifier raises `GymVerificationError` (Gym's code); a verified row tokcap cannot
    hold, or one whose committed extras were not sent, raises `GymConversionError`.
    """
    base: dict[str, Any] = {
        "rollout_id": receipt.rollout_id,
        "reward": receipt.reward,
        "sink_keys": tuple(r.staging_key for r in receipt.manifest),
        "break_causes": ("no_parent_match",)
        * max(0, sum(r.parent_call_id is None for r in receipt.manifest) - 1),
    }
    if receipt.poisoned:
        gym_reason = receipt.failure_reason
        if gym_reason is None:
            gym_reason = "capture_poisoned"
        reason = gym_failure_reason(gym_reason)
        poisoned = Receipt(
            status="poisoned",
            failure_reason=reason,
            terminal_call_id=None,
            terminal_selection=None,
            segments=(),
            ledger_head=(len(receipt.manifest), ZERO_HASH),
            **base,
        )
        row = placeholder_row(receipt.rollout_id, reason, reward=receipt.reward)
        return GymVerification(receipt=poisoned, row=row, gym_reason=gym_reason, linearized=None)
    linearized = linearize_gym_rollout(receipt, snapshots)
    by_id = {s.model_call_id: s for s in snapshots}
    for call_id in linearized.model_call_ids:
        snapshot = by_id[call_id]
        if not snapshot.extras_loaded and snapshot.extras_digest != EMPTY_EXTRAS_DIGEST:
            raise GymConversionError(
                "extras_not_loaded", f"{call_id}: committed extras were not sent with the record"
            )
    records = {r.model_call_id: r for r in receipt.manifest}
    segment = tuple(
        ReceiptCall(
            call_id=call_id,
            staging_key=StagingKey(records[call_id].staging_key),
            parent_id=records[call_id].parent_call_id,
            prefix_len=records[call_id].prev_len,
            carry_len=carried,
            gen_len=generated,
            weight_version=records[call_id].weight_version,
            weight_version_last=_weight_version_last(by_id[call_id]),
            finish_reason=_finish_reason(by_id[call_id]),
            call_digest=records[call_id].digest,
            chain_hash=records[call_id].chain_hash,
            formation=_formation(by_id[call_id]),
            splice_cause=_splice_cause(by_id[call_id]),
        )
        for call_id, carried, generated in linearized.link_spans
    )
    selection: TerminalSelection | None = receipt.terminal_selection
    verified = Receipt(
        status="verified",
        failure_reason=None,
        terminal_call_id=receipt.terminal_model_call_id,
        terminal_selection=selection,
        segments=(segment,),
        ledger_head=(len(receipt.manifest), segment[-1].chain_hash),
        **base,
    )
    row = _training_row(receipt, linearized, segment, by_id)
    return GymVerification(receipt=verified, row=row, gym_reason=None, linearized=linearized)


def _extras(snapshot: GymStagedRecord) -> dict[str, Any]:
    return snapshot.extras if snapshot.extras_loaded and snapshot.extras else {}


def _finish_reason(snapshot: GymStagedRecord) -> str:
    value = _extras(snapshot).get(TOKCAP_FINISH_REASON_KEY)
    return value if value in ("stop", "length") else GYM_UNKNOWN_FINISH


def _weight_version_last(snapshot: GymStagedRecord) -> int:
    value = _extras(snapshot).get(TOKCAP_WEIGHT_VERSION_LAST_KEY)
    if type(value) is int and value >= 0:
        return value
    return snapshot.weight_version


def _splice_cause(snapshot: GymStagedRecord) -> str | None:
    value = _extras(snapshot).get(TOKCAP_SPLICE_CAUSE_KEY)
    if snapshot.parent_call_id is None or value not in SPLICE_CAUSES:
        return None
    return str(value)


def _formation(snapshot: GymStagedRecord) -> str:
    if snapshot.parent_call_id is None:
        return "root"
    return "splice" if _splice_cause(snapshot) is not None else "extend"


def _training_row(
    receipt: GymReceipt,
    lin: GymLinearizedRow,
    segment: tuple[ReceiptCall, ...],
    snapshots: dict[str, GymStagedRecord],
) -> TrainingRow:
    try:
        input_ids = array("I", lin.token_ids)
    except OverflowError:
        raise GymConversionError(
            "token_id_out_of_range", "a token id does not fit tokcap's u32 rows"
        ) from None
    spans = tuple(CallSpan.for_call(c) for c in segment)
    routes, backfilled = _chain_routes(segment, snapshots)
    return TrainingRow(
        rollout_id=lin.rollout_id,
        segment=0,
        input_ids=input_ids,
        loss_mask=array("B", (1 if m == 1.0 else 0 for m in lin.token_mask)),
        logprobs=array("f", lin.logprobs),
        routes=routes,
        prompt_len=lin.prompt_len,
        call_spans=spans,
        weight_version_min=min(lin.weight_versions),
        weight_version_max=max(max(lin.weight_versions), *(c.weight_version_last for c in segment)),
        truncated=segment[-1].finish_reason == "length",
        reward=receipt.reward,
        sample_mask=1,
        reason=None,
        terminal_call_id=segment[-1].call_id,
        backfilled_route_rows=backfilled,
    )


def _decode(payload: object, what: str) -> Routes:
    try:
        if isinstance(payload, str):
            return decode_routes(payload)
        if isinstance(payload, list):
            return routes_from_rows(payload)
    except RoutesError as e:
        raise GymConversionError("bad_routes", f"{what}: [{e.code}] {e.message}") from e
    raise GymConversionError("bad_routes", f"{what}: routes are an envelope or nested lists")


def _rows(routes: Routes, first: int, count: int) -> Routes:
    width = routes.shape[1] * routes.shape[2]
    data = routes.data[first * width : (first + count) * width]
    return Routes(dtype=routes.dtype, shape=(count, *routes.shape[1:]), data=data)


def _chain_routes(
    segment: tuple[ReceiptCall, ...], snapshots: dict[str, GymStagedRecord]
) -> tuple[Routes | None, int]:
    fragments: list[tuple[Routes | None, Routes | None]] = []
    for call in segment:
        extras = _extras(snapshots[call.call_id])
        payload = extras.get(ROUTED_EXPERTS_KEY)
        prefill = extras.get(TOKCAP_PREFILL_ROUTE_KEY)
        fragments.append(
            (
                None if payload is None else _decode(payload, call.call_id),
                None if prefill is None else _decode(prefill, call.call_id),
            )
        )
    known = [r for pair in fragments for r in pair if r is not None]
    if not any(r for r, _ in fragments):
        return None, 0
    dtype = max((r.dtype for r in known), key=_WIDTH.__getitem__)
    layers, topk = next(r for r, _ in fragments if r is not None).shape[1:]
    parts: list[Routes] = []
    backfilled = 0
    try:
        for call, (routes, prefill) in zip(segment, fragments, strict=True):
            part = _span_routes(call, routes, layers=layers, topk=topk, dtype=dtype)
            if prefill is not None and parts and prefill.shape[0] == 1:
                last = parts[-1].shape[0] - 1
                lead = widen(prefill, dtype)
                if unknown_rows(_rows(parts[-1], last, 1)) and not unknown_rows(lead):
                    parts[-1] = concat_routes([_rows(parts[-1], 0, last), lead])
                    backfilled += 1
            parts.append(part)
        return concat_routes(parts), backfilled
    except RoutesError as e:
        raise GymConversionError("bad_routes", f"[{e.code}] {e.message}") from e


def _span_routes(
    call: ReceiptCall, routes: Routes | None, *, layers: int, topk: int, dtype: str
) -> Routes:
    """Gym's span rule: ``full`` when the fragment covers the delta, ``tail`` when it covers
    at least the generated tokens (their last rows are used), else ``sentinel`` (unknown)."""
    total = call.carry_len + call.gen_len
    if routes is not None and routes.shape[0] == total:
        return widen(routes, dtype)
    if routes is not None and 0 < call.gen_len <= routes.shape[0]:
        gen = _rows(routes, routes.shape[0] - call.gen_len, call.gen_len)
        carry = unknown_routes(call.carry_len, layers=layers, topk=topk, dtype=routes.dtype)
        return widen(concat_routes([carry, gen]), dtype)
    return unknown_routes(total, layers=layers, topk=topk, dtype=dtype)
