"""Media blobs: an image's processed tensors as one content-addressed byte string.

A sink stores each image's processed tensors once, under the item's ``tensors_digest``
(`MediaStore`): group siblings and later turns that carry the same image name the same
blob. A blob is self-describing (`media_blob`): the magic ``TKMEDIA1``, a u64 header
length, a JSON header listing each tensor's name, dtype, shape and byte count in name
order, then the tensors' raw bytes, back to back. `media_tensors` decodes it without
copying; `verify_media` decodes it and checks `tensors_digest` of what it holds against
the digest it is stored under, so a trainer never uses tensors the receipt does not bind
(a single flipped byte fails with `VerificationError` ``media_tensors_mismatch``, naming
the digest). Stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

from ._errors import VerificationError
from ._media import TensorBytes, tensors_digest

__all__ = ["media_blob", "media_tensors", "verify_media"]

_MAGIC: Final = b"TKMEDIA1"
_HEAD: Final = len(_MAGIC) + 8


def media_blob(tensors: Iterable[TensorBytes]) -> bytes:
    """The blob of an item's processed tensors (name order; names must be distinct)."""
    items = sorted(tensors, key=lambda t: t[0])
    header = [
        [name, dtype, [int(d) for d in shape], memoryview(data).nbytes]
        for name, dtype, shape, data in items
    ]
    if len({h[0] for h in header}) != len(header):
        raise ValueError(f"tensor names must be distinct: {[h[0] for h in header]}")
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode()
    parts: list[bytes | memoryview] = [_MAGIC, len(text).to_bytes(8, "little"), text]
    parts += [memoryview(data).cast("B") for *_, data in items]
    return b"".join(parts)


def _broken(digest: str, why: str) -> VerificationError:
    return VerificationError(
        "media_tensors_mismatch", f"the media blob stored under {digest} {why}"
    )


def media_tensors(blob: bytes | memoryview, digest: str = "?") -> tuple[TensorBytes, ...]:
    """The tensors of ``blob`` (views into it, no copy); `VerificationError`
    ``media_tensors_mismatch`` naming ``digest`` if it is not a well-formed blob."""
    view = memoryview(blob).cast("B")
    if len(view) < _HEAD or bytes(view[: len(_MAGIC)]) != _MAGIC:
        raise _broken(digest, "is not a media blob")
    size = int.from_bytes(view[len(_MAGIC) : _HEAD], "little")
    try:
        header = json.loads(bytes(view[_HEAD : _HEAD + size]))
        rows = [(str(n), str(t), tuple(int(d) for d in s), int(b)) for n, t, s, b in header]
    except (ValueError, TypeError) as e:
        raise _broken(digest, f"has a bad header ({e})") from None
    at, out = _HEAD + size, []
    for name, dtype, shape, nbytes in rows:
        if nbytes < 0 or at + nbytes > len(view):
            raise _broken(digest, "is shorter than its header says")
        out.append((name, dtype, shape, view[at : at + nbytes]))
        at += nbytes
    if at != len(view):
        raise _broken(digest, "is longer than its header says")
    return tuple(out)


def verify_media(
    blobs: Mapping[str, bytes], digests: Sequence[str]
) -> dict[str, tuple[TensorBytes, ...]]:
    """The tensors of each of ``digests`` from ``blobs`` (by digest), each checked against
    its digest: `VerificationError` ``media_tensors_mismatch`` naming the first digest whose
    blob is malformed or holds other tensors, ``media_missing`` for one not in ``blobs``."""
    out: dict[str, tuple[TensorBytes, ...]] = {}
    for digest in dict.fromkeys(digests):
        blob = blobs.get(digest)
        if blob is None:
            raise VerificationError("media_missing", f"no media blob for {digest}")
        tensors = media_tensors(blob, digest)
        try:
            found = tensors_digest(tensors)
        except ValueError as e:
            raise _broken(digest, f"holds bad tensors ({e})") from None
        if found != digest:
            raise _broken(digest, f"holds tensors whose digest is {found}")
        out[digest] = tensors
    return out
