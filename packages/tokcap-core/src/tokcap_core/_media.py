"""Media items of a captured call (capture format v4): what binds an image to the tokens.

The engine decides a multimodal prompt's expanded ids; a `MediaItem` records, for one item
(one image) whose placeholder tokens lie in a call's carried tokens: its modality, where
its placeholder sits in the call's prompt (``offset``, ``length``) and which of those
positions take the encoder's embeddings (``embed_digest``), the engine's multimodal
cache hash (``mm_hash``), a plain SHA-256 of the media bytes as the gate received them
(``bytes_sha256``: anyone holding the bytes can match it, without tokcap), a digest of the
processed tensors the encoder consumed (``tensors_digest``, `tensors_digest`) and the
processor's fingerprint (``processor``, `processor_fingerprint`). The call digest of a
format v4 call commits to every item; the ledger's ``Staged`` entry names each item's
``bytes_sha256``, so a manifest alone shows which images a call saw. Stdlib only.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ._digest import Canon
from ._errors import InvalidStagedCall

__all__ = [
    "MEDIA_MODALITIES",
    "MediaItem",
    "TensorBytes",
    "embed_mask_digest",
    "media_from_json",
    "media_to_json",
    "processor_fingerprint",
    "tensors_digest",
]

MEDIA_MODALITIES: Final = ("image",)
"""The modalities a media item may name."""
TENSORS_DOMAIN: Final = b"tokcap/media/tensors/v1"
EMBED_DOMAIN: Final = b"tokcap/media/embed/v1"
PROCESSOR_DOMAIN: Final = b"tokcap/media/processor/v1"
_HEX: Final = frozenset("0123456789abcdef")
_MAX_LABEL: Final = 256
_FIELDS: Final = (
    "modality", "offset", "length", "embed_digest", "mm_hash", "bytes_sha256",
    "tensors_digest", "processor",
)  # fmt: skip


def _bad(message: str) -> InvalidStagedCall:
    return InvalidStagedCall("bad_media", message)


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaItem:
    """One multimodal item of a call: placement, identity and the digests that bind it."""

    modality: str
    offset: int
    """Where the item's placeholder starts in the call's full prompt (parent's tokens first)."""
    length: int
    """How many prompt tokens the placeholder spans (its expanded length)."""
    embed_digest: str
    """`embed_mask_digest` of which placeholder positions take encoder embeddings."""
    mm_hash: str
    """The engine's multimodal cache hash of the item (vLLM's ``mm_hash``)."""
    bytes_sha256: str
    """Plain SHA-256 (hex) of the media bytes as received (a data URL's decoded payload)."""
    tensors_digest: str
    """`tensors_digest` of the processed tensors the encoder consumed."""
    processor: str
    """`processor_fingerprint` of the processor that made the tensors."""

    def __post_init__(self) -> None:
        if self.modality not in MEDIA_MODALITIES:
            raise _bad(f"modality must be one of {MEDIA_MODALITIES}")
        for name, least in (("offset", 0), ("length", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise _bad(f"{name} must be an int >= {least}, got {value!r}")
        for name in ("embed_digest", "bytes_sha256", "tensors_digest", "processor"):
            value = getattr(self, name)
            if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
                raise _bad(f"{name} must be 64 lowercase hex characters")
        if (
            not isinstance(self.mm_hash, str)
            or not 0 < len(self.mm_hash) <= _MAX_LABEL
            or not self.mm_hash.isprintable()
        ):
            raise _bad(f"mm_hash must be a printable string of 1..{_MAX_LABEL} characters")

    @property
    def end(self) -> int:
        """One past the placeholder's last token."""
        return self.offset + self.length

    def write(self, canon: Canon) -> None:
        """Write this item's canonical fields."""
        canon.text(self.modality).u64(self.offset).u64(self.length)
        canon.raw_hash(self.embed_digest).text(self.mm_hash).raw_hash(self.bytes_sha256)
        canon.raw_hash(self.tensors_digest).raw_hash(self.processor)


def check_media(media: Sequence[MediaItem], start: int, end: int) -> None:
    """Raise ``bad_media`` unless ``media`` are `MediaItem` in prompt order, apart, and each
    placeholder lies in the carried tokens ``[start, end)``."""
    previous = start
    for item in media:
        if not isinstance(item, MediaItem):
            raise _bad("media must be MediaItem values")
        if item.offset < previous or item.end > end:
            raise _bad(
                f"a media placeholder [{item.offset}, {item.end}) must lie in the carried "
                f"tokens [{start}, {end}), in order and apart"
            )
        previous = item.end


TensorBytes = tuple[str, str, Sequence[int], bytes | memoryview]
"""One processed tensor as ``(name, dtype, shape, little-endian C-order bytes)``."""


def tensors_digest(tensors: Iterable[TensorBytes]) -> str:
    """The digest of an item's processed tensors, in name order: each name, dtype (as the
    engine names it, e.g. ``float32``), shape and raw bytes. Names must be distinct."""
    items = sorted(tensors, key=lambda t: t[0])
    names = [t[0] for t in items]
    if len(set(names)) != len(names):
        raise _bad(f"tensor names must be distinct: {names}")
    canon = Canon(TENSORS_DOMAIN).u64(len(items))
    for name, dtype, shape, data in items:
        canon.text(name).text(dtype).u64(len(shape))
        for dim in shape:
            canon.u64(dim)
        view = memoryview(data).cast("B")
        canon.u64(len(view))
        canon.blob(view)
    return canon.hexdigest()


def embed_mask_digest(mask: Sequence[bool] | None, length: int) -> str:
    """The digest of a placeholder's embed mask (None: every position takes an embedding)."""
    bits = bytes([1] * length) if mask is None else bytes(int(bool(b)) for b in mask)
    if len(bits) != length:
        raise _bad(f"the embed mask has {len(bits)} positions, the placeholder {length}")
    return Canon(EMBED_DOMAIN).u64(length).blob(bits).hexdigest()


def processor_fingerprint(document: Mapping[str, Any]) -> str:
    """The digest of a processor description (library versions, processor config,
    ``mm_processor_kwargs``) as canonical JSON: sorted keys, compact, ASCII."""
    try:
        text = json.dumps(
            document, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except (TypeError, ValueError) as e:
        raise _bad(f"the processor description is not plain JSON: {e}") from e
    return Canon(PROCESSOR_DOMAIN).text(text).hexdigest()


def media_to_json(media: Sequence[MediaItem]) -> list[dict[str, Any]]:
    """JSON-ready dicts of ``media`` (every field, by name)."""
    return [{name: getattr(item, name) for name in _FIELDS} for item in media]


def media_from_json(value: object) -> tuple[MediaItem, ...]:
    """Strictly decode a media list (`InvalidStagedCall` ``bad_media`` on any deviation)."""
    if not isinstance(value, list):
        raise _bad("media must be a list")
    out = []
    for item in value:
        if not isinstance(item, dict) or set(item) != set(_FIELDS):
            raise _bad(f"a media item must have exactly the fields {sorted(_FIELDS)}")
        try:
            out.append(MediaItem(**item))
        except TypeError as e:
            raise _bad(str(e)) from e
    return tuple(out)
