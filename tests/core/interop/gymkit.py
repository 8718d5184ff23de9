"""Gym captures built from Gym's documented rules, and the single-field tamper enumerator.

`build_capture` writes staged records and a receipt the way Gym's worker and NeMo-RL's
receipt assembler do (GYM_FORMAT.md §3-§9): a delta is the carried prompt tokens (mask
0.0, logprob 0.0) then the generated ones (mask 1.0), the chain hash runs along parent
links, the cumulative hash covers the whole sequence up to the call.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tokcap_core import TokcapError
from tokcap_core.interop import gym
from tokcap_core.testing import single_field_tampers


def f32(value: float) -> float:
    """``value`` rounded to float32, as Gym's fixtures store logprobs."""
    rounded: float = struct.unpack(">f", struct.pack(">f", value))[0]
    return rounded


@dataclass(frozen=True)
class CallSpec:
    """One model call: its parent, the prompt tokens it adds and what it generated."""

    call_id: str
    parent: str | None
    carry: tuple[int, ...]
    generated: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_version: int = 0
    extras: dict[str, Any] | None = None
    admitted_at: float | None = None


def build_capture(
    rollout_id: str,
    calls: Sequence[CallSpec],
    *,
    terminal: str | None,
    selection: str | None = "declared",
    reward: float | None = 1.0,
    schema_version: int = 2,
    poisoned: bool = False,
    failure_reason: str | None = None,
) -> gym.GymCapture:
    """Staged records (extras sent) and a receipt for ``calls``, in this order."""
    cumulative: dict[str, list[int]] = {}
    chains: dict[str, str] = {}
    lengths: dict[str, int] = {}
    snapshots: list[gym.GymStagedRecord] = []
    records: list[gym.GymCallRecord] = []
    for spec in calls:
        delta = [*spec.carry, *spec.generated]
        prev = lengths[spec.parent] if spec.parent else 0
        cumulative[spec.call_id] = (cumulative[spec.parent] if spec.parent else []) + delta
        chains[spec.call_id] = gym.compute_chain_hash(
            chains[spec.parent] if spec.parent else None, delta
        )
        lengths[spec.call_id] = prev + len(delta)
        fields: dict[str, Any] = {
            "schema_version": schema_version,
            "digest_version": 2,
            "extras_digest_version": 1,
            "rollout_id": rollout_id,
            "model_call_id": spec.call_id,
            "parent_call_id": spec.parent,
            "mode": "token_in" if spec.parent else "text",
            "prev_len": prev,
            "delta_len": len(delta),
            "cum_len": prev + len(delta),
            "weight_version": spec.weight_version,
            "token_ids_delta": tuple(delta),
            "token_mask_delta": (0.0,) * len(spec.carry) + (1.0,) * len(spec.generated),
            "generation_log_probs_delta": (0.0,) * len(spec.carry) + spec.logprobs,
            "extras_digest": gym.compute_extras_digest(spec.extras),
            "chain_hash": chains[spec.call_id],
            "cumulative_hash": gym.hash_token_ids(cumulative[spec.call_id]),
        }
        digest = gym.compute_staging_digest(**fields)
        snapshot = gym.GymStagedRecord(**fields, digest=digest, extras=spec.extras)
        snapshots.append(snapshot)
        records.append(
            gym.GymCallRecord(
                **{k: fields[k] for k in _RECORD_FIELDS},
                digest=digest,
                staging_key=f"{rollout_id}/{spec.call_id}",
                response_id=f"chatcmpl-{spec.call_id}",
                admitted_at=spec.admitted_at,
            )
        )
    receipt = gym.GymReceipt(
        schema_version=schema_version,
        digest_version=2,
        extras_digest_version=1,
        rollout_id=rollout_id,
        reward=reward,
        terminal_model_call_id=terminal,
        manifest=tuple(records),
        capture_poisoned=poisoned,
        failure_reason=failure_reason,
        terminal_selection=selection,  # type: ignore[arg-type]
    )
    return gym.GymCapture(receipt=receipt, snapshots=tuple(snapshots))


_RECORD_FIELDS = (
    "schema_version", "digest_version", "extras_digest_version", "model_call_id",
    "parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version", "extras_digest",
    "mode", "chain_hash", "cumulative_hash",
)  # fmt: skip


def worked_example(rollout_id: str = "g7_r0", **kw: Any) -> gym.GymCapture:
    """NeMo-RL's fixture recipe: root c1 ``[10,11 | 12,13]``, child c2 ``[20 | 21,22]``."""
    calls = [
        CallSpec("c1", None, (10, 11), (12, 13), (f32(-0.1), f32(-0.2)), weight_version=3),
        CallSpec("c2", "c1", (20,), (21, 22), (f32(-0.3), f32(-0.4)), weight_version=4),
    ]
    return build_capture(rollout_id, calls, terminal="c2", **kw)


def capture_json(capture: gym.GymCapture) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The receipt and snapshots as the JSON objects Gym writes."""
    return capture.receipt.to_json(), [s.to_json() for s in capture.snapshots]


# ---- outcomes -------------------------------------------------------------------------


def outcome(receipt_doc: Any, snapshot_docs: Any) -> tuple[str, Any]:
    """``("refused", code)``, ``("poisoned", gym_reason)`` or ``("verified", content)``.

    The content is what a trainer learns from (tokens, mask, logprobs, spans, routes,
    terminal, truncation); the reward is reported apart (Gym binds it to nothing).
    """
    try:
        receipt = gym.decode_gym_receipt(json.dumps(receipt_doc))
        snapshots = [] if receipt.poisoned else gym.decode_gym_snapshots(json.dumps(snapshot_docs))
        result = gym.verify_gym_rollout(receipt, snapshots)
    except TokcapError as e:
        return "refused", e.code
    if not result.ok:
        return "poisoned", result.gym_reason
    row = result.row
    content = (
        row.input_ids.tolist(),
        row.loss_mask.tolist(),
        row.logprobs.tobytes(),
        row.call_spans,
        row.routes,
        row.terminal_call_id,
        row.truncated,
        row.prompt_len,
    )
    return "verified", (content, row.reward)


# ---- single-field tampers -------------------------------------------------------------


def _alternatives(value: Any) -> Iterator[Any]:
    if isinstance(value, bool):
        yield not value
    elif isinstance(value, int):
        yield value + 1
        if value > 0:
            yield value - 1
    elif isinstance(value, float):
        yield value + 0.5
        yield -value  # 0.0 becomes -0.0: a different float32 bit pattern
    elif isinstance(value, str):
        if len(value) == 64 and all(c in "0123456789abcdef" for c in value):
            yield ("1" if value[0] == "0" else "0") + value[1:]
        yield value + "x"
    elif value is None:
        yield "x"
        yield 1.0


def vocabulary(receipt: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Plausible substitutes per key: other call ids, selections and modes Gym accepts."""
    ids = tuple(r["model_call_id"] for r in receipt["manifest"])
    return {
        "terminal_model_call_id": ids,
        "model_call_id": ids,
        "parent_call_id": ids,
        "terminal_selection": gym.GYM_TERMINAL_SELECTIONS,
        "mode": ("text", "token_in"),
    }


def tampers(
    doc: Any, vocab: dict[str, tuple[Any, ...]] | None = None
) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every single-field change of a JSON document: ``(path, changed document)``, as
    `tokcap_core.testing.single_field_tampers` walks it, with Gym's leaf alternatives:
    type-preserving ones and, for keys in ``vocab``, every other plausible value."""
    known = vocab or {}

    def leaf(path: tuple[Any, ...], value: Any) -> list[Any]:
        key = next((step for step in reversed(path) if isinstance(step, str)), "")
        return [*_alternatives(value), *(v for v in known.get(key, ()) if v != value)]

    return single_field_tampers(doc, alternatives=leaf)


def list_tampers(snapshots: list[dict[str, Any]], stranger: dict[str, Any]) -> Iterator[Any]:
    """Changes of the snapshot list itself: drop, repeat, swap, reverse, a stranger's row."""
    for i in range(len(snapshots)):
        yield f"drop {i}", snapshots[:i] + snapshots[i + 1 :]
        yield f"repeat {i}", [*snapshots[: i + 1], snapshots[i], *snapshots[i + 1 :]]
        yield f"replace {i} with a stranger", [*snapshots[:i], stranger, *snapshots[i + 1 :]]
    for i in range(len(snapshots) - 1):
        swapped = list(snapshots)
        swapped[i], swapped[i + 1] = swapped[i + 1], swapped[i]
        yield f"swap {i},{i + 1}", swapped
    yield "empty", []
