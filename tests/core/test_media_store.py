"""Media blobs: an image's processed tensors stored once by digest, rows that name them,
and a trainer-side read that verifies every blob before use (`tokcap_core.sink.fetch_media`).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.core.test_media import item, two_calls
from tokcap_core import MemorySink, VerificationError, assemble_receipt, reassemble, verify_manifest
from tokcap_core.errors import MissingRows, ReassemblyError, SinkError
from tokcap_core.ledger import manifest_of
from tokcap_core.sink import MediaStore, TokenSink, fetch_media
from tokcap_core.staged import media_blob, media_tensors, tensors_digest, verify_media

PIXELS = bytes(range(48))
TENSORS = [
    ("pixel_values", "float32", (1, 3, 2, 2), PIXELS),
    ("pixel_attention_mask", "bool", (1, 2, 2), b"\x01\x01\x01\x00"),
]
DIGEST = tensors_digest(TENSORS)
BLOB = media_blob(TENSORS)


def flipped(blob: bytes, index: int) -> bytes:
    out = bytearray(blob)
    out[index] ^= 1
    return bytes(out)


def test_a_blob_holds_the_very_tensors_its_digest_names() -> None:
    decoded = media_tensors(BLOB)
    assert [t[0] for t in decoded] == sorted(t[0] for t in TENSORS)
    assert tensors_digest(decoded) == DIGEST
    assert {name: bytes(data) for name, _, _, data in decoded} == {t[0]: t[3] for t in TENSORS}
    assert media_blob(TENSORS[::-1]) == BLOB  # one blob per content, whatever the order


def test_one_flipped_pixel_byte_fails_verification_naming_the_digest() -> None:
    at = BLOB.index(PIXELS) + 17  # inside pixel_values
    with pytest.raises(VerificationError) as info:
        verify_media({DIGEST: flipped(BLOB, at)}, [DIGEST])
    assert info.value.code == "media_tensors_mismatch"
    assert DIGEST in str(info.value)


@pytest.mark.parametrize("index", [0, 9, 20])  # the magic, the header length, the header
def test_a_malformed_blob_fails_verification_naming_the_digest(index: int) -> None:
    with pytest.raises(VerificationError) as info:
        verify_media({DIGEST: flipped(BLOB, index)}, [DIGEST])
    assert info.value.code == "media_tensors_mismatch"
    assert DIGEST in str(info.value)


def test_a_blob_cut_short_or_padded_fails_verification() -> None:
    for bad in (BLOB[:-1], BLOB + b"\x00"):
        with pytest.raises(VerificationError) as info:
            verify_media({DIGEST: bad}, [DIGEST])
        assert info.value.code == "media_tensors_mismatch"


async def _stored(sink: TokenSink, blob: bytes) -> VerificationError:
    assert isinstance(sink, MediaStore)
    await sink.put_media({DIGEST: blob})
    with pytest.raises(VerificationError) as info:
        await fetch_media(sink, [DIGEST])
    return info.value


def test_the_memory_sink_serves_a_flipped_pixel_byte_and_the_trainer_refuses_it() -> None:
    error = asyncio.run(_stored(MemorySink(), flipped(BLOB, BLOB.index(PIXELS) + 5)))
    assert error.code == "media_tensors_mismatch"
    assert DIGEST in str(error)


def test_blobs_are_stored_once_and_a_different_one_under_a_held_digest_is_refused() -> None:
    async def main() -> None:
        sink = MemorySink()
        await sink.put_media({DIGEST: BLOB})
        await sink.put_media({DIGEST: BLOB})  # a sibling's put: a no-op
        assert await sink.media_keys() == [DIGEST]
        with pytest.raises(SinkError) as info:
            await sink.put_media({DIGEST: flipped(BLOB, len(BLOB) - 1)})
        assert info.value.code == "conflicting_put"
        got = await fetch_media(sink, [DIGEST, DIGEST])
        assert tensors_digest(got[DIGEST]) == DIGEST
        await sink.clear_media([DIGEST, "0" * 64])
        with pytest.raises(MissingRows) as missing:
            await fetch_media(sink, [DIGEST])
        assert missing.value.missing == (DIGEST,)

    asyncio.run(main())


def test_rows_name_their_images_where_they_lie() -> None:
    ledger, calls = two_calls()
    receipt = assemble_receipt(verify_manifest(manifest_of(ledger)))
    (row,) = reassemble(receipt, calls, max_seq_len=64)  # type: ignore[arg-type]
    assert row.media == (item(),)
    assert list(row.input_ids[row.media[0].offset : row.media[0].end]) == [9, 9, 9, 9]


def test_a_row_cut_inside_an_image_is_refused_and_one_cut_after_it_keeps_it() -> None:
    ledger, calls = two_calls()
    receipt = assemble_receipt(verify_manifest(manifest_of(ledger)))
    with pytest.raises(ReassemblyError) as info:
        reassemble(receipt, calls, max_seq_len=3)  # type: ignore[arg-type]
    assert info.value.code == "media_truncated"
    (row,) = reassemble(receipt, calls, max_seq_len=7)  # type: ignore[arg-type]
    assert row.truncated
    assert row.media == (item(),)
