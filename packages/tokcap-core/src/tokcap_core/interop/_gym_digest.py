"""NeMo-Gym's staging digests (staged schema versions 2 and 3), from Gym's published layout.

Every digest is lowercase hex SHA-256 over ``domain || payload``; the domain is a raw ASCII
prefix (no length, no separator). Integers and lengths are big-endian u64, token ids
unsigned 64-bit big-endian, float columns IEEE-754 float32 big-endian (finite Python
floats only; ``-0.0`` and ``0.0`` differ), strings a u64 byte length then UTF-8.

- prefix: ``H("nemo-gym-staging-prefix-v2" || u64 n || ids)`` (a call's cumulative hash);
- chain: ``H("nemo-gym-staging-chain-v1" || 0x00 | 0x01 parent || u64 n || delta ids)``;
- extras: ``H("nemo-gym-staging-extras-v1" || u8 1 || typed encoding)``;
- staged call: ``H("nemo-gym-staging-call-v2" || versions || identity || lengths ||
  bytes(ids) || bytes(mask) || bytes(logprobs) || extras digest || 0x01 chain || 0x01 cum)``.

Schema version 3 changes only the schema byte. Gym's published golden vectors for both
versions ship as test data; `assert_gym_golden_vectors` recomputes them.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ._gym_errors import GymFormatError

__all__ = [
    "EMPTY_EXTRAS_DIGEST",
    "GYM_DIGEST_VERSION",
    "GYM_EXTRAS_DIGEST_VERSION",
    "GYM_SCHEMA_VERSIONS",
    "assert_gym_golden_vectors",
    "compute_chain_hash",
    "compute_extras_digest",
    "compute_staging_digest",
    "encode_token_ids",
    "hash_token_ids",
]

GYM_SCHEMA_VERSIONS: Final[tuple[int, ...]] = (2, 3)
"""Staged schema versions read and written (3 differs from 2 only in the schema byte)."""
GYM_DIGEST_VERSION: Final = 2
"""The staged-call digest version read and written."""
GYM_EXTRAS_DIGEST_VERSION: Final = 1
"""The extras digest version read and written."""

_CALL_DOMAIN: Final = b"nemo-gym-staging-call-v2"
_EXTRAS_DOMAIN: Final = b"nemo-gym-staging-extras-v1"
_PREFIX_DOMAIN: Final = b"nemo-gym-staging-prefix-v2"
_CHAIN_DOMAIN: Final = b"nemo-gym-staging-chain-v1"
_U64_MAX: Final = 2**64 - 1
_HEX: Final = frozenset("0123456789abcdef")


def _bad(code: str, message: str) -> GymFormatError:
    return GymFormatError(code, message)


def is_hex_digest(value: object) -> bool:
    """True for 64 lowercase hex characters (Gym's ``DigestHex``)."""
    return isinstance(value, str) and len(value) == 64 and _HEX.issuperset(value)


def _u64(value: int, what: str) -> bytes:
    if type(value) is not int or not 0 <= value <= _U64_MAX:
        raise _bad("out_of_range", f"{what} must be an unsigned 64-bit integer, got {value!r}")
    return struct.pack(">Q", value)


def _bytes(data: bytes) -> bytes:
    return struct.pack(">Q", len(data)) + data


def _text(value: str) -> bytes:
    return _bytes(value.encode("utf-8"))


def encode_token_ids(token_ids: Sequence[int]) -> bytes:
    """``u64 n`` then each id as an unsigned 64-bit big-endian integer."""
    if any(type(t) is not int for t in token_ids):
        raise _bad("wrong_type", "token ids must be ints")
    try:
        return struct.pack(f">Q{len(token_ids)}Q", len(token_ids), *token_ids)
    except struct.error:
        raise _bad("out_of_range", "token ids must lie in [0, 2**64)") from None


def hash_token_ids(token_ids: Sequence[int]) -> str:
    """Gym's prefix hash of one exact cumulative token sequence (a call's cumulative hash)."""
    return hashlib.sha256(_PREFIX_DOMAIN + encode_token_ids(token_ids)).hexdigest()


def compute_chain_hash(parent_chain_hash: str | None, token_ids_delta: Sequence[int]) -> str:
    """Gym's per-call chain hash: the parent's chain hash (or a root marker) and this delta."""
    if parent_chain_hash is None:
        marker = b"\x00"
    elif is_hex_digest(parent_chain_hash):
        marker = b"\x01" + bytes.fromhex(parent_chain_hash)
    else:
        raise _bad("bad_hex", "the parent chain hash must be 64 lowercase hex characters")
    return hashlib.sha256(_CHAIN_DOMAIN + marker + encode_token_ids(token_ids_delta)).hexdigest()


def _f32_column(values: Sequence[float], what: str) -> bytes:
    if any(type(v) is not float or not math.isfinite(v) for v in values):
        raise _bad("wrong_type", f"{what} must hold finite Python floats")
    try:
        return struct.pack(f">Q{len(values)}f", len(values), *values)
    except OverflowError:
        raise _bad("out_of_range", f"{what} holds a value float32 cannot represent") from None


def _extra(value: Any, out: list[bytes]) -> None:
    kind = type(value)
    if value is None:
        out.append(b"N")
    elif kind is bool:
        out.append(b"B\x01" if value else b"B\x00")
    elif kind is int:
        if not -(2**63) <= value < 2**63:
            raise _bad("bad_extras", f"extras int {value} is outside the signed 64-bit range")
        out.append(b"I" + struct.pack(">q", value))
    elif kind is float:
        if not math.isfinite(value):
            raise _bad("bad_extras", "extras floats must be finite")
        out.append(b"F" + struct.pack(">d", value))
    elif kind is str:
        out.append(b"S" + _text(value))
    elif kind is list:
        out.append(b"L" + struct.pack(">Q", len(value)))
        for item in value:
            _extra(item, out)
    elif kind is dict:
        if any(type(k) is not str for k in value):
            raise _bad("bad_extras", "extras objects must have string keys")
        out.append(b"D" + struct.pack(">Q", len(value)))
        for key in sorted(value, key=lambda k: k.encode("utf-8")):
            out.append(_text(key))
            _extra(value[key], out)
    else:
        raise _bad("bad_extras", f"extras cannot hold a {kind.__name__}")


def compute_extras_digest(extras: Mapping[str, Any] | None) -> str:
    """Gym's extras digest: a typed encoding of None, bool, int, float, str, list, dict."""
    if extras is not None and not isinstance(extras, Mapping):
        raise _bad("bad_extras", "extras must be an object or null")
    out = [_EXTRAS_DOMAIN, bytes([GYM_EXTRAS_DIGEST_VERSION])]
    try:
        _extra(None if extras is None else dict(extras), out)
    except RecursionError:
        raise _bad("bad_extras", "extras nest too deeply") from None
    return hashlib.sha256(b"".join(out)).hexdigest()


EMPTY_EXTRAS_DIGEST: Final = compute_extras_digest(None)
"""The extras digest of a call without extras."""


def check_versions(schema_version: int, digest_version: int, extras_digest_version: int) -> None:
    """Refuse a version triple this reader does not implement (Gym's verifier codes)."""
    if type(schema_version) is not int or schema_version not in GYM_SCHEMA_VERSIONS:
        raise _bad("unsupported_schema", f"staged schema version {schema_version!r}")
    if type(digest_version) is not int or digest_version != GYM_DIGEST_VERSION:
        raise _bad("unsupported_digest", f"digest version {digest_version!r}")
    if type(extras_digest_version) is not int or extras_digest_version != GYM_EXTRAS_DIGEST_VERSION:
        raise _bad("unsupported_extras_digest", f"extras digest version {extras_digest_version!r}")


def compute_staging_digest(
    *,
    schema_version: int,
    digest_version: int,
    extras_digest_version: int,
    rollout_id: str,
    model_call_id: str,
    parent_call_id: str | None,
    mode: str,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    weight_version: int,
    token_ids_delta: Sequence[int],
    token_mask_delta: Sequence[float],
    generation_log_probs_delta: Sequence[float],
    extras_digest: str,
    chain_hash: str,
    cumulative_hash: str,
) -> str:
    """Gym's staged-call digest; the keywords are those of Gym's golden ``staged_call``.

    Checks what Gym checks before hashing (versions, root/child shape, lengths, mask
    values, zero logprobs on carried tokens) and raises `GymFormatError` otherwise.
    """
    check_versions(schema_version, digest_version, extras_digest_version)
    for name, value in (("rollout_id", rollout_id), ("model_call_id", model_call_id)):
        if type(value) is not str or not value:
            raise _bad("empty_identifier", f"{name} must be a non-empty string")
    if parent_call_id is not None and (type(parent_call_id) is not str or not parent_call_id):
        raise _bad("empty_identifier", "parent_call_id must be a non-empty string or null")
    if mode not in ("text", "token_in"):
        raise _bad("bad_mode", f"mode must be 'text' or 'token_in', got {mode!r}")
    lengths = b"".join(
        _u64(value, name)
        for name, value in (
            ("prev_len", prev_len),
            ("delta_len", delta_len),
            ("cum_len", cum_len),
            ("weight_version", weight_version),
        )
    )
    root = parent_call_id is None
    if root != (prev_len == 0) or root != (mode == "text"):
        raise _bad("root_child_mismatch", "a root is text-mode with prev_len 0; a child token_in")
    n = len(token_ids_delta)
    if delta_len == 0 or delta_len != n:
        raise _bad("length_mismatch", f"delta_len {delta_len} for {n} token ids (needs >= 1)")
    if len(token_mask_delta) != n or len(generation_log_probs_delta) != n:
        raise _bad("length_mismatch", "ids, mask and logprobs must have equal lengths")
    if any(m not in (0.0, 1.0) for m in token_mask_delta):
        raise _bad("bad_mask", "token_mask_delta holds only 0.0 or 1.0")
    pairs = zip(token_mask_delta, generation_log_probs_delta, strict=True)
    if any(m == 0.0 and lp != 0.0 for m, lp in pairs):
        raise _bad("carry_logprob", "a carried token (mask 0.0) must have logprob 0.0")
    if cum_len != prev_len + delta_len:
        raise _bad("length_mismatch", "cum_len must equal prev_len + delta_len")
    for name, value in (
        ("extras_digest", extras_digest),
        ("chain_hash", chain_hash),
        ("cumulative_hash", cumulative_hash),
    ):
        if not is_hex_digest(value):
            raise _bad("bad_hex", f"{name} must be 64 lowercase hex characters")
    payload = b"".join(
        (
            _CALL_DOMAIN,
            bytes((schema_version, digest_version, extras_digest_version)),
            _text(rollout_id),
            _text(model_call_id),
            b"\x00" if parent_call_id is None else b"\x01" + _text(parent_call_id),
            _text(mode),
            lengths,
            _bytes(encode_token_ids(token_ids_delta)),
            _bytes(_f32_column(token_mask_delta, "token_mask_delta")),
            _bytes(_f32_column(generation_log_probs_delta, "generation_log_probs_delta")),
            bytes.fromhex(extras_digest),
            b"\x01" + bytes.fromhex(chain_hash),
            b"\x01" + bytes.fromhex(cumulative_hash),
        )
    )
    return hashlib.sha256(payload).hexdigest()


def assert_gym_golden_vectors(doc: Mapping[str, Any]) -> int:
    """Recompute a Gym ``golden_vectors.json`` document; return how many values were checked.

    Checks what Gym's own ``assert_golden_vectors`` checks (the extras digest and the
    staged-call digest) and raises `GymFormatError` (``golden_mismatch``) on a difference.
    """
    extras = compute_extras_digest(doc["extras"])
    if extras != doc["extras_digest"]:
        raise _bad("golden_mismatch", f"extras digest mismatch: {extras}")
    call = compute_staging_digest(**doc["staged_call"])
    if call != doc["staged_call_digest"]:
        raise _bad("golden_mismatch", f"staged call digest mismatch: {call}")
    return 2
