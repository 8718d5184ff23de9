"""Canonical bytes and domain-separated, versioned SHA-256 digests.

Canonical encoding: lengths and non-negative integers as little-endian u64;
strings as u64 byte length + UTF-8; optional values as one presence byte
(0/1) then the value; token ids as little-endian u32 and logprobs as
little-endian f32, hashed straight from their buffers (no per-token loop);
scalar floats (rewards) as little-endian f64. Every digest starts with its
domain string, so a digest of one kind can never be passed off as another.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from typing import Final

__all__ = [
    "CALL_DOMAIN",
    "CALL_DOMAIN_V2",
    "CALL_DOMAIN_V3",
    "CHAIN_DOMAIN",
    "GENESIS_DOMAIN",
    "LEDGER_DOMAIN",
    "STAGED_ENTRY_DOMAIN",
    "STAGED_ENTRY_DOMAIN_V3",
    "ZERO_HASH",
    "Canon",
    "chain_hash",
    "genesis_hash",
]

CALL_DOMAIN: Final = b"tokcap/call/v4"
"""Capture format v4: the call digest commits to the call's media items (images) too."""
CALL_DOMAIN_V3: Final = b"tokcap/call/v3"
"""Capture format v3 calls (per-token weight and KV spans, no media): still verifiable."""
CALL_DOMAIN_V2: Final = b"tokcap/call/v2"
"""Capture format v2 calls (first and last weight version only): still verifiable."""
CHAIN_DOMAIN: Final = b"tokcap/chain/v1"
LEDGER_DOMAIN: Final = b"tokcap/ledger/v2"
"""Ledger entries; unchanged in format v3 except for `STAGED_ENTRY_DOMAIN`."""
STAGED_ENTRY_DOMAIN: Final = b"tokcap/ledger/staged/v4"
"""The entry hash of a format v4 ``Staged`` event (one that names its media's byte
digests): media cannot be stripped from a ledger entry without changing its hash."""
STAGED_ENTRY_DOMAIN_V3: Final = b"tokcap/ledger/staged/v3"
"""The entry hash of a format v3 ``Staged`` event (one that carries spans): a v2 entry
and a v3 entry can never hash alike, so spans cannot be stripped from a ledger."""
GENESIS_DOMAIN: Final = b"tokcap/genesis/v1"
ZERO_HASH: Final = "0" * 64
"""The chain hash a root call links to (32 zero bytes, hex)."""

_LITTLE: Final = sys.byteorder == "little"
_U64: Final = struct.Struct("<Q")
_F64: Final = struct.Struct("<d")
_ABSENT: Final = b"\x00"  # the presence byte of an optional field
_PRESENT: Final = b"\x01"


class Canon:
    """An incremental SHA-256 over canonical fields, started with a domain string.

    Small fields collect in a list and reach the hash in one update; large buffers are
    hashed straight from their memory (no copy, no per-element loop).
    """

    __slots__ = ("_h", "_parts")

    def __init__(self, domain: bytes) -> None:
        prepared = _PREPARED.get(domain)
        if prepared is None:
            prepared = _PREPARED[domain] = hashlib.sha256(_U64.pack(len(domain)) + domain)
        self._h = prepared.copy()
        self._parts: list[bytes] = []

    def u64(self, value: int) -> Canon:
        """Append a non-negative integer (also bools, as 0/1)."""
        self._parts.append(_U64.pack(value))
        return self

    def f64(self, value: float) -> Canon:
        """Append a scalar float as little-endian f64."""
        self._parts.append(_F64.pack(value))
        return self

    def text(self, value: str) -> Canon:
        """Append a string: u64 length, then UTF-8 bytes."""
        data = value.encode("utf-8")
        self._parts.append(_U64.pack(len(data)))
        self._parts.append(data)
        return self

    def opt_text(self, value: str | None) -> Canon:
        """Append an optional string: presence byte, then the string."""
        self._parts.append(_ABSENT if value is None else _PRESENT)
        return self if value is None else self.text(value)

    def opt_f64(self, value: float | None) -> Canon:
        """Append an optional scalar float: presence byte, then f64."""
        self._parts.append(_ABSENT if value is None else _PRESENT)
        return self if value is None else self.f64(value)

    def raw_hash(self, hex_digest: str) -> Canon:
        """Append a 32-byte hash given as 64 hex characters."""
        self._parts.append(bytes.fromhex(hex_digest))
        return self

    def buffer(self, values: array[int] | array[float]) -> Canon:
        """Append a typed buffer (u32 tokens, f32 logprobs, small-int routes) little-endian.

        The element count goes first, so adjacent buffers cannot trade elements.
        """
        self._parts.append(_U64.pack(len(values)))
        self._flush()
        if _LITTLE:
            self._h.update(memoryview(values))
        else:
            swapped = array(values.typecode, values)
            swapped.byteswap()
            self._h.update(memoryview(swapped))
        return self

    def blob(self, data: bytes | memoryview) -> Canon:
        """Append raw bytes as they are (the caller writes their length first)."""
        self._flush()
        self._h.update(data)
        return self

    def _flush(self) -> None:
        if self._parts:
            self._h.update(b"".join(self._parts))
            self._parts.clear()

    def hexdigest(self) -> str:
        """The SHA-256 digest so far, as 64 lowercase hex characters."""
        self._flush()
        return self._h.hexdigest()


_PREPARED: dict[bytes, hashlib._Hash] = {}


def chain_hash(parent_chain_hash: str | None, call_digest: str) -> str:
    """``H(chain domain ‖ parent chain hash or 32 zero bytes ‖ call digest)``.

    A terminal call's chain hash therefore commits to its whole root→terminal path.
    """
    return (
        Canon(CHAIN_DOMAIN)
        .raw_hash(parent_chain_hash or ZERO_HASH)
        .raw_hash(call_digest)
        .hexdigest()
    )


def genesis_hash(rollout_id: str) -> str:
    """The ``prev_hash`` of a rollout's first ledger entry, bound to its rollout id."""
    return Canon(GENESIS_DOMAIN).text(rollout_id).hexdigest()
