"""Export: a verified tokcap capture as Gym staged records and a Gym receipt.

Every call of the receipt's segments (checked first with tokcap's own `verify_staged`)
becomes one Gym staged record, in admission order: the delta is the call's carried and
generated tokens (mask 0.0 then 1.0, logprob 0.0 on carried tokens), the chain and
cumulative hashes are Gym's, recomputed along the parent links. Extras carry the routes
Gym's way (``routed_experts``: the delta's rows as an ``nrlre1`` envelope) plus keys
Gym ignores and tokcap reads back: ``tokcap_finish_reason``; for a child with routes,
``tokcap_prefill_route`` (its leading route row); for a call generated across a weight
push, ``tokcap_weight_version_last`` (Gym's ``weight_version`` is the call's first one,
the version its sampling started under, so Gym's staleness stays conservative); for a
spliced child, ``tokcap_splice_cause``. Importing the export with `verify_gym_rollout`
therefore gives back tokcap's own segment-0 row.

The receipt names tokcap's terminal. tokcap's selection label is kept, except that a
``heuristic`` terminal Gym's own rule would not pick is exported as ``declared``: the
exporter declares the terminal tokcap's rules chose, rather than claim Gym's heuristic.
Response ids and admission times come from the replayed ledger when it is given
(``state``); otherwise a call's response id is its staging key and ``admitted_at`` null.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._ledger import RolloutState
from .._reassembly import verify_staged
from .._receipt import Receipt
from .._staged import StagedCall
from ..ids import StagingKey
from ..routes import Routes, encode_routes
from ._gym_convert import (
    ROUTED_EXPERTS_KEY,
    TOKCAP_FINISH_REASON_KEY,
    TOKCAP_PREFILL_ROUTE_KEY,
    TOKCAP_SPLICE_CAUSE_KEY,
    TOKCAP_WEIGHT_VERSION_LAST_KEY,
)
from ._gym_digest import (
    GYM_DIGEST_VERSION,
    GYM_EXTRAS_DIGEST_VERSION,
    compute_chain_hash,
    compute_extras_digest,
    compute_staging_digest,
    hash_token_ids,
)
from ._gym_errors import GymConversionError
from ._gym_records import GymCallRecord, GymReceipt, GymStagedRecord
from ._gym_verify import SNAPSHOT_FIELDS, VERSION_FIELDS, select_gym_terminal

__all__ = ["GymCapture", "export_gym_capture"]


@dataclass(frozen=True, slots=True, kw_only=True)
class GymCapture:
    """A rollout in Gym's formats: its receipt and its staged records in manifest order."""

    receipt: GymReceipt
    snapshots: tuple[GymStagedRecord, ...]


def export_gym_capture(
    receipt: Receipt,
    staged: Mapping[StagingKey, StagedCall] | Iterable[StagedCall],
    *,
    state: RolloutState | None = None,
    schema_version: int = 2,
) -> GymCapture:
    """Write a verified tokcap rollout as a Gym receipt and staged records (module doc).

    Raises `GymConversionError` (``receipt_poisoned``) for a poisoned receipt and the
    core's `VerificationError` when ``staged`` does not verify against ``receipt``.
    """
    if not receipt.ok or receipt.terminal_call_id is None:
        raise GymConversionError("receipt_poisoned", f"{receipt.rollout_id} is not verified")
    order = {key: i for i, key in enumerate(receipt.sink_keys)}
    calls = {c.call_id: c for segment in verify_staged(receipt, staged) for c in segment}
    splices = {
        c.call_id: c.splice_cause for segment in receipt.segments for c in segment if c.splice_cause
    }
    ordered = sorted(calls.values(), key=lambda c: order.get(c.key, len(order)))
    cumulative: dict[str, list[int]] = {}
    chains: dict[str, str] = {}
    snapshots: list[GymStagedRecord] = []
    records: list[GymCallRecord] = []
    for call in ordered:
        parent = call.parent_id
        tokens = call.tokens.tolist()
        cumulative[call.call_id] = (cumulative[parent] if parent else []) + tokens
        chains[call.call_id] = compute_chain_hash(chains[parent] if parent else None, tokens)
        snapshot = _snapshot(
            call,
            schema_version,
            chains[call.call_id],
            hash_token_ids(cumulative[call.call_id]),
            splices.get(call.call_id),
        )
        snapshots.append(snapshot)
        records.append(_record(snapshot, state))
    selection = receipt.terminal_selection
    if selection == "heuristic" and select_gym_terminal(records)[0] != receipt.terminal_call_id:
        selection = "declared"
    gym_receipt = GymReceipt(
        schema_version=schema_version,
        digest_version=GYM_DIGEST_VERSION,
        extras_digest_version=GYM_EXTRAS_DIGEST_VERSION,
        rollout_id=receipt.rollout_id,
        reward=None if receipt.reward is None else float(receipt.reward),
        terminal_model_call_id=receipt.terminal_call_id,
        manifest=tuple(records),
        terminal_selection=selection,
    )
    return GymCapture(receipt=gym_receipt, snapshots=tuple(snapshots))


def _route_rows(routes: Routes, first: int) -> Routes:
    width = routes.shape[1] * routes.shape[2]
    data = routes.data[first * width :]
    return Routes(dtype=routes.dtype, shape=(len(data) // width, *routes.shape[1:]), data=data)


def _extras(call: StagedCall, splice_cause: str | None) -> dict[str, Any]:
    extras: dict[str, Any] = {TOKCAP_FINISH_REASON_KEY: call.finish_reason}
    if call.weight_version_last != call.weight_version:
        extras[TOKCAP_WEIGHT_VERSION_LAST_KEY] = call.weight_version_last
    if splice_cause is not None:
        extras[TOKCAP_SPLICE_CAUSE_KEY] = splice_cause
    if call.routes is not None:
        lead = 0 if call.parent_id is None else 1
        extras[ROUTED_EXPERTS_KEY] = encode_routes(_route_rows(call.routes, lead))
        if lead:
            first = Routes(
                dtype=call.routes.dtype,
                shape=(1, *call.routes.shape[1:]),
                data=call.routes.data[: call.routes.shape[1] * call.routes.shape[2]],
            )
            extras[TOKCAP_PREFILL_ROUTE_KEY] = encode_routes(first)
    return extras


def _snapshot(
    call: StagedCall,
    schema_version: int,
    chain_hash: str,
    cumulative_hash: str,
    splice_cause: str | None,
) -> GymStagedRecord:
    extras = _extras(call, splice_cause)
    fields: dict[str, Any] = {
        "schema_version": schema_version,
        "digest_version": GYM_DIGEST_VERSION,
        "extras_digest_version": GYM_EXTRAS_DIGEST_VERSION,
        "rollout_id": call.rollout_id,
        "model_call_id": call.call_id,
        "parent_call_id": call.parent_id,
        "mode": "text" if call.parent_id is None else "token_in",
        "prev_len": call.prefix_len,
        "delta_len": call.carry_len + call.gen_len,
        "cum_len": call.cum_len,
        "weight_version": call.weight_version,
        "token_ids_delta": tuple(call.tokens.tolist()),
        "token_mask_delta": (0.0,) * call.carry_len + (1.0,) * call.gen_len,
        "generation_log_probs_delta": (0.0,) * call.carry_len + tuple(call.logprobs.tolist()),
        "extras_digest": compute_extras_digest(extras),
        "chain_hash": chain_hash,
        "cumulative_hash": cumulative_hash,
    }
    digest = compute_staging_digest(**fields)
    return GymStagedRecord(**fields, digest=digest, extras=extras, extras_loaded=True)


def _record(snapshot: GymStagedRecord, state: RolloutState | None) -> GymCallRecord:
    ledger_call = state.calls.get(snapshot.model_call_id) if state is not None else None
    response_id = snapshot.staging_key
    admitted_at = None
    if ledger_call is not None:
        admitted_at = ledger_call.admitted.admitted_at / 1e9
        if ledger_call.staged is not None and ledger_call.staged.response_id:
            response_id = ledger_call.staged.response_id
    repeated = {name: getattr(snapshot, name) for name in (*VERSION_FIELDS, *SNAPSHOT_FIELDS)}
    return GymCallRecord(
        **repeated,
        staging_key=snapshot.staging_key,
        response_id=response_id,
        admitted_at=admitted_at,
    )
