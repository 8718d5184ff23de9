"""Staged calls as strict JSON (examples, golden vectors, debug dumps; sinks use their own layout).

A document is ``{"format": "tokcap/staged/v4", "calls": [...]}``; each call lists every
`StagedCall` field, tokens and logprobs as JSON arrays, routes as an ``nrlre1`` envelope
or null, ``weight_versions`` and ``kv_versions`` as ``[[version, start, end], ...]``,
``media`` (format v4) as a list of `MediaItem` objects. ``tokcap/staged/v3`` (spans, no
media) and ``tokcap/staged/v2`` (no spans) documents still decode; calls of those formats
are encoded in them, as before. Logprobs are f32 values written as the shortest decimal
that reads back the same.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable
from typing import Any, Final

from ._errors import InvalidStagedCall, TokcapError
from ._media import media_from_json, media_to_json
from ._staged import StagedCall
from .provenance import spans_from_json, spans_to_json
from .routes import decode_routes, encode_routes

__all__ = [
    "MAX_STAGED_BYTES",
    "STAGED_FORMAT",
    "STAGED_FORMAT_V2",
    "STAGED_FORMAT_V3",
    "decode_staged_calls",
    "encode_staged_calls",
    "staged_from_json",
    "staged_to_json",
]

STAGED_FORMAT: Final = "tokcap/staged/v4"
STAGED_FORMAT_V3: Final = "tokcap/staged/v3"
"""The format before media: read, and written when no call carries media."""
STAGED_FORMAT_V2: Final = "tokcap/staged/v2"
"""The format before per-token provenance: read, and written for calls without spans."""
MAX_STAGED_BYTES: Final = 256 * 1024 * 1024
"""The largest staged-calls document `decode_staged_calls` reads by default."""
_FIELDS: Final = (
    "rollout_id", "call_id", "parent_id", "prefix_len", "carry_len", "gen_len", "weight_version",
    "weight_version_last", "finish_reason", "tokens", "logprobs", "routes", "digest", "chain_hash",
)  # fmt: skip
_SPAN_FIELDS: Final = ("weight_versions", "kv_versions")


def staged_to_json(call: StagedCall) -> dict[str, Any]:
    """A JSON-ready dict of one staged call (with its spans if it has them: format v3)."""
    out: dict[str, Any] = {
        "rollout_id": call.rollout_id,
        "call_id": call.call_id,
        "parent_id": call.parent_id,
        "prefix_len": call.prefix_len,
        "carry_len": call.carry_len,
        "gen_len": call.gen_len,
        "weight_version": call.weight_version,
        "weight_version_last": call.weight_version_last,
        "finish_reason": call.finish_reason,
        "tokens": call.tokens.tolist(),
        "logprobs": call.logprobs.tolist(),
        "routes": None if call.routes is None else encode_routes(call.routes),
        "digest": call.digest,
        "chain_hash": call.chain_hash,
    }
    if call.weight_versions is not None:
        out["weight_versions"] = spans_to_json(call.weight_versions)
        out["kv_versions"] = spans_to_json(call.kv_versions)
    if call.media is not None:
        out["media"] = media_to_json(call.media)
    return out


def staged_from_json(obj: object, *, v3: bool = True, v4: bool = True) -> StagedCall:
    """Strictly decode one staged call; `InvalidStagedCall` with a code on any deviation.

    ``v3``/``v4``: whether the document's format allows spans / media."""
    if not isinstance(obj, dict):
        raise InvalidStagedCall("wrong_type", "a staged call must be an object")
    names = {*_FIELDS, *_SPAN_FIELDS} if v3 and "weight_versions" in obj else set(_FIELDS)
    if v3 and v4 and "media" in obj:
        names.add("media")
    if set(obj) != names:
        raise InvalidStagedCall("bad_fields", f"fields must be exactly {sorted(names)}")
    ints = ("prefix_len", "carry_len", "gen_len", "weight_version", "weight_version_last")
    if any(isinstance(obj[k], bool) or not isinstance(obj[k], int) for k in ints):
        raise InvalidStagedCall("wrong_type", f"{ints} must be integers")
    tokens, logprobs = obj["tokens"], obj["logprobs"]
    if not isinstance(tokens, list) or any(
        isinstance(t, bool) or not isinstance(t, int) for t in tokens
    ):
        raise InvalidStagedCall("wrong_type", "tokens must be a list of integers")
    if not isinstance(logprobs, list) or any(
        isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
        for x in logprobs
    ):
        raise InvalidStagedCall("wrong_type", "logprobs must be a list of finite numbers")
    try:
        routes = None if obj["routes"] is None else decode_routes(obj["routes"])
        return StagedCall(
            rollout_id=obj["rollout_id"],
            call_id=obj["call_id"],
            parent_id=obj["parent_id"],
            prefix_len=obj["prefix_len"],
            carry_len=obj["carry_len"],
            gen_len=obj["gen_len"],
            weight_version=obj["weight_version"],
            weight_version_last=obj["weight_version_last"],
            finish_reason=obj["finish_reason"],
            tokens=array("I", tokens),
            logprobs=array("f", logprobs),
            routes=routes,
            digest=obj["digest"],
            chain_hash=obj["chain_hash"],
            weight_versions=spans_from_json(obj.get("weight_versions")),
            kv_versions=spans_from_json(obj.get("kv_versions")),
            media=media_from_json(obj["media"]) if "media" in names else None,
        )
    except InvalidStagedCall:
        raise
    except TokcapError as e:
        raise InvalidStagedCall(e.code, e.message) from e
    except (OverflowError, TypeError, AttributeError) as e:
        raise InvalidStagedCall("wrong_type", str(e)) from e


def encode_staged_calls(calls: Iterable[StagedCall]) -> bytes:
    """A staged-calls JSON document (format v3 when no call carries media, v2 when none
    carries spans)."""
    items = [staged_to_json(c) for c in calls]
    if any("media" in c for c in items):
        format_name = STAGED_FORMAT
    elif any("weight_versions" in c for c in items):
        format_name = STAGED_FORMAT_V3
    else:
        format_name = STAGED_FORMAT_V2
    doc = {"format": format_name, "calls": items}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("ascii")


def decode_staged_calls(
    data: bytes | str, *, max_bytes: int = MAX_STAGED_BYTES
) -> list[StagedCall]:
    """Strictly decode a staged-calls document (``too_large``, ``bad_json``, ``bad_format``...)."""
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise InvalidStagedCall("too_large", f"{len(raw)} bytes exceeds {max_bytes}")
    try:
        doc = json.loads(raw, parse_constant=_reject)
    except InvalidStagedCall:
        raise
    except (ValueError, RecursionError) as e:
        raise InvalidStagedCall("bad_json", f"not JSON: {e}") from None
    if (
        not isinstance(doc, dict)
        or set(doc) != {"format", "calls"}
        or doc["format"] not in (STAGED_FORMAT, STAGED_FORMAT_V3, STAGED_FORMAT_V2)
    ):
        raise InvalidStagedCall(
            "bad_format", f"expected {{'format': {STAGED_FORMAT!r}, 'calls': [...]}}"
        )
    if not isinstance(doc["calls"], list):
        raise InvalidStagedCall("wrong_type", "calls must be a list")
    v3 = doc["format"] != STAGED_FORMAT_V2
    v4 = doc["format"] == STAGED_FORMAT
    return [staged_from_json(c, v3=v3, v4=v4) for c in doc["calls"]]


def _reject(name: str) -> float:
    raise InvalidStagedCall("non_finite", f"non-finite number {name} is not allowed")
