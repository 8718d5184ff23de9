"""Manifests: what a gate's control plane serves for a rollout (token-free), as strict JSON.

A manifest is the rollout id, its ledger entries and the head ``(seq, hash)``.
Decoding is strict: unknown or missing fields, wrong types (a bool is not an
int), duplicate keys, non-finite numbers and oversize inputs raise
`ManifestError` with a code. ``decode_manifest(encode_manifest(m)) == m`` and
``encode_manifest(decode_manifest(b)) == b`` for every ``b`` this module wrote.
Verifying a manifest is replaying it (`verify_manifest`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from ._errors import ManifestError, TokcapError, VerificationError
from ._events import Admitted, Closed, Event, Failed, Poisoned, Staged, TerminalDeclared, Witnesses
from ._ledger import Entry, Ledger, RolloutState, replay
from .ids import validate_rollout_id
from .provenance import spans_from_json, spans_to_json

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_FORMAT_V2",
    "MANIFEST_FORMAT_V3",
    "MAX_MANIFEST_BYTES",
    "Manifest",
    "decode_manifest",
    "encode_manifest",
    "manifest_of",
    "verify_manifest",
]

MANIFEST_FORMAT: Final = "tokcap/manifest/v4"
"""Capture format v4: ``staged`` events may also name ``media_digests`` (the SHA-256 of
each image's bytes); a manifest none of whose events does is encoded as v3 or v2."""
MANIFEST_FORMAT_V3: Final = "tokcap/manifest/v3"
"""Capture format v3: ``staged`` events may carry ``weight_versions`` and ``kv_versions``
(``[[version, start, end], ...]``); still decoded and verified."""
MANIFEST_FORMAT_V2: Final = "tokcap/manifest/v2"
"""Capture format v2 (no spans): still decoded and verified; a manifest none of whose
events carries spans is encoded in it, byte for byte as before."""
_SPAN_FIELDS: Final = ("weight_versions", "kv_versions")
_HEX64: Final = re.compile("[0-9a-f]{64}")
_FORMATS: Final = {MANIFEST_FORMAT_V2: 2, MANIFEST_FORMAT_V3: 3, MANIFEST_FORMAT: 4}
MAX_MANIFEST_BYTES: Final = 16 * 1024 * 1024
"""Default bound on an encoded manifest; larger inputs are rejected before parsing."""

_EVENTS: Final[dict[str, type[Event]]] = {
    cls.KIND: cls for cls in (Admitted, Staged, Failed, TerminalDeclared, Closed, Poisoned)
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """A rollout's token-free custody record: its entries and their head."""

    rollout_id: str
    entries: tuple[Entry, ...]
    head_seq: int
    head_hash: str

    @property
    def head(self) -> tuple[int, str]:
        """``(seq, hash)`` of the last entry."""
        return self.head_seq, self.head_hash


def manifest_of(ledger: Ledger) -> Manifest:
    """The manifest of a ledger as it stands."""
    seq, head = ledger.head
    return Manifest(
        rollout_id=ledger.rollout_id, entries=ledger.entries, head_seq=seq, head_hash=head
    )


def verify_manifest(
    manifest: Manifest, *, expected_head: tuple[int, str] | None = None
) -> RolloutState:
    """Replay a manifest and check its head (and the head the trainer kept at close, if given).

    Raises `VerificationError`: replay codes, ``head_mismatch`` (the manifest's own head
    is not its last entry) or ``unexpected_head`` (a shortened or rewritten history).
    """
    state = replay(manifest.rollout_id, manifest.entries)
    if state.head != manifest.head:
        raise VerificationError("head_mismatch", "the manifest head is not its last entry")
    if expected_head is not None and tuple(expected_head) != state.head:
        raise VerificationError(
            "unexpected_head", "the manifest does not end at the head kept at close"
        )
    return state


# ---- encoding ---------------------------------------------------------------------------


def _event_to_json(event: Event) -> dict[str, Any]:
    body: dict[str, Any] = {"type": event.KIND}
    for f in fields(event):
        value = getattr(event, f.name)
        if f.name == "media_digests":
            if value is None:
                continue  # an earlier format's event
            value = list(value)
        elif f.name in _SPAN_FIELDS:
            if value is None:
                continue  # a format v2 event
            value = spans_to_json(value)
        if isinstance(value, Witnesses):
            value = {
                "response_id": value.response_id,
                "content_fingerprint": value.content_fingerprint,
            }
        body[f.name] = value
    return body


def encode_manifest(manifest: Manifest) -> bytes:
    """Canonical JSON bytes (compact, ASCII, fields in a fixed order)."""
    staged = [e.event for e in manifest.entries if isinstance(e.event, Staged)]
    if any(event.media_digests is not None for event in staged):
        format_name = MANIFEST_FORMAT
    elif any(event.weight_versions for event in staged):
        format_name = MANIFEST_FORMAT_V3
    else:
        format_name = MANIFEST_FORMAT_V2
    doc = {
        "format": format_name,
        "rollout_id": manifest.rollout_id,
        "head": {"seq": manifest.head_seq, "hash": manifest.head_hash},
        "entries": [
            {
                "seq": e.seq,
                "prev_hash": e.prev_hash,
                "hash": e.hash,
                "event": _event_to_json(e.event),
            }
            for e in manifest.entries
        ],
    }
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode(
        "ascii"
    )


# ---- strict decoding ---------------------------------------------------------------------


def _reject_constant(name: str) -> float:
    raise ManifestError("non_finite", f"non-finite number {name} is not allowed")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # some key came twice: name the first repeat
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ManifestError("duplicate_key", f"duplicate key {key!r}")
            seen.add(key)
    return out


def _obj(value: object, where: str, keys: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError("wrong_type", f"{where} must be an object")
    if value.keys() == _key_set(keys):  # the common case, checked at C speed
        return value
    unknown = set(value) - set(keys)
    if unknown:
        raise ManifestError("unknown_field", f"{where}: unknown field(s) {sorted(unknown)}")
    missing = [k for k in keys if k not in value]
    if missing:
        raise ManifestError("missing_field", f"{where}: missing field(s) {missing}")
    return value


def _int(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError("wrong_type", f"{where} must be an integer")
    return value


def _str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ManifestError("wrong_type", f"{where} must be a string")
    return value


def _opt_str(value: object, where: str) -> str | None:
    return None if value is None else _str(value, where)


def _opt_float(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ManifestError("wrong_type", f"{where} must be a number or null")
    if not math.isfinite(value):
        raise ManifestError("non_finite", f"{where} must be finite")
    return float(value)


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ManifestError("wrong_type", f"{where} must be a boolean")
    return value


_FIELD_READERS: Final[dict[str, Callable[[object, str], object]]] = {
    "call_id": _str,
    "parent_id": _opt_str,
    "prefix_len": _int,
    "admitted_at": _int,
    "request_fingerprint": _str,
    "formation": _str,
    "break_cause": _opt_str,
    "splice_cause": _opt_str,
    "carry_len": _int,
    "gen_len": _int,
    "weight_version": _int,
    "weight_version_last": _int,
    "finish_reason": _str,
    "call_digest": _str,
    "chain_hash": _str,
    "response_id": _opt_str,
    "output_fingerprint": _opt_str,
    "reason": _str,
    "served": _bool,
    "by": _str,
    "value": _str,
    "reward": _opt_float,
}


@functools.cache
def _key_set(keys: tuple[str, ...]) -> frozenset[str]:
    return frozenset(keys)


@functools.cache
def _event_fields(kind: str, *, spans: bool, media: bool) -> tuple[str, ...]:
    """The fields an event of type ``kind`` carries in a manifest, with or without the
    per-token spans (format 3 on) and the media digests (format 4 on)."""
    names = tuple(f.name for f in fields(_EVENTS[kind]))
    if not spans:
        names = tuple(n for n in names if n not in _SPAN_FIELDS)
    if not media:
        names = tuple(n for n in names if n != "media_digests")
    return names


def _decode_event(value: object, where: str, *, version: int) -> Event:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ManifestError("wrong_type", f"{where} must be an object with a string 'type'")
    cls = _EVENTS.get(value["type"])
    if cls is None:
        raise ManifestError("unknown_event", f"{where}: unknown event type {value['type']!r}")
    names = _event_fields(
        value["type"],
        spans=version >= 3 and cls is Staged and "weight_versions" in value,
        media=version >= 4 and cls is Staged and "media_digests" in value,
    )
    body = _obj(value, where, ("type", *names))
    kwargs: dict[str, Any] = {}
    for name in names:
        if name in _SPAN_FIELDS:
            try:
                kwargs[name] = spans_from_json(body[name])
            except TokcapError as e:
                raise ManifestError("bad_event", f"{where}.{name}: {e.message}") from e
        elif name == "media_digests":
            digests = body[name]
            if not isinstance(digests, list):
                raise ManifestError("wrong_type", f"{where}.{name} must be a list")
            kwargs[name] = tuple(_hash(d, f"{where}.{name}") for d in digests)
        elif name == "witnesses":
            w = _obj(body[name], f"{where}.witnesses", ("response_id", "content_fingerprint"))
            kwargs[name] = Witnesses(
                response_id=_opt_str(w["response_id"], f"{where}.witnesses.response_id"),
                content_fingerprint=_opt_str(
                    w["content_fingerprint"], f"{where}.witnesses.content_fingerprint"
                ),
            )
        else:
            kwargs[name] = _FIELD_READERS[name](body[name], f"{where}.{name}")
    try:
        return cls(**kwargs)
    except TokcapError as e:
        raise ManifestError("bad_event", f"{where}: {e.message}") from e


def decode_manifest(data: bytes | str, *, max_bytes: int = MAX_MANIFEST_BYTES) -> Manifest:
    """Strictly decode manifest JSON; `ManifestError` with a code on any deviation.

    Inputs over ``max_bytes`` are rejected (``too_large``) before parsing.
    """
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise ManifestError("too_large", f"manifest is {len(raw)} bytes, bound is {max_bytes}")
    try:
        doc = json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except ManifestError:
        raise
    except (
        ValueError,
        RecursionError,
    ) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ManifestError("bad_json", f"not JSON: {e}") from None
    top = _obj(doc, "manifest", ("format", "rollout_id", "head", "entries"))
    version = _FORMATS.get(top["format"]) if isinstance(top["format"], str) else None
    if version is None:
        raise ManifestError(
            "bad_format", f"format must be {MANIFEST_FORMAT!r} (or an earlier: {sorted(_FORMATS)})"
        )
    rollout_id = _str(top["rollout_id"], "rollout_id")
    try:
        validate_rollout_id(rollout_id)
    except TokcapError as e:
        raise ManifestError("bad_rollout_id", e.message) from e
    head = _obj(top["head"], "head", ("seq", "hash"))
    if not isinstance(top["entries"], list):
        raise ManifestError("wrong_type", "entries must be a list")
    entries = []
    for i, item in enumerate(top["entries"]):
        where = f"entries[{i}]"
        body = _obj(item, where, ("seq", "prev_hash", "hash", "event"))
        entries.append(
            Entry(
                seq=_int(body["seq"], f"{where}.seq"),
                prev_hash=_hash(body["prev_hash"], f"{where}.prev_hash"),
                hash=_hash(body["hash"], f"{where}.hash"),
                event=_decode_event(body["event"], f"{where}.event", version=version),
            )
        )
    return Manifest(
        rollout_id=rollout_id,
        entries=tuple(entries),
        head_seq=_int(head["seq"], "head.seq"),
        head_hash=_hash(head["hash"], "head.hash"),
    )


def _hash(value: object, where: str) -> str:
    text = _str(value, where)
    if _HEX64.fullmatch(text) is None:
        raise ManifestError("bad_hash", f"{where} must be 64 lowercase hex characters")
    return text
