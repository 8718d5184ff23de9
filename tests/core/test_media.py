"""Capture format v4: media items bind images to a call; every binding is checked."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from tokcap_core import VerificationError, assemble_receipt, verify_manifest, verify_staged
from tokcap_core.errors import InvalidStagedCall, ManifestError
from tokcap_core.ledger import Closed, Ledger, decode_manifest, encode_manifest, manifest_of
from tokcap_core.simulate import admit_call, stage_call
from tokcap_core.staged import (
    MediaItem,
    decode_staged_calls,
    embed_mask_digest,
    encode_staged_calls,
    processor_fingerprint,
    tensors_digest,
)

PIXELS = bytes(range(48))


def item(offset: int = 1, length: int = 4, image: bytes = b"png bytes") -> MediaItem:
    return MediaItem(
        modality="image",
        offset=offset,
        length=length,
        embed_digest=embed_mask_digest(None, length),
        mm_hash="mm-1",
        bytes_sha256=hashlib.sha256(image).hexdigest(),
        tensors_digest=tensors_digest([("pixel_values", "float32", (1, 3, 2, 2), PIXELS)]),
        processor=processor_fingerprint({"vllm": "0.32.0"}),
    )


def test_one_flipped_tensor_byte_changes_the_tensor_digest() -> None:
    flipped = bytearray(PIXELS)
    flipped[17] ^= 1
    digests = {
        tensors_digest([("pixel_values", "float32", (1, 3, 2, 2), data)])
        for data in (PIXELS, bytes(flipped))
    }
    assert len(digests) == 2
    # the shape, the dtype and the name are bound too
    assert tensors_digest([("pixel_values", "float32", (1, 3, 4, 1), PIXELS)]) not in digests
    assert tensors_digest([("pixel_values", "bfloat16", (1, 3, 2, 2), PIXELS)]) not in digests
    assert tensors_digest([("pixels", "float32", (1, 3, 2, 2), PIXELS)]) not in digests


def test_tensor_digests_do_not_depend_on_the_order_tensors_are_given() -> None:
    a = ("a", "int64", (1,), b"\x01" * 8)
    b = ("b", "bool", (2,), b"\x01\x00")
    assert tensors_digest([a, b]) == tensors_digest([b, a])
    with pytest.raises(InvalidStagedCall):
        tensors_digest([a, a])


def test_the_embed_mask_and_processor_fingerprint_are_bound() -> None:
    assert embed_mask_digest(None, 3) == embed_mask_digest([True, True, True], 3)
    assert embed_mask_digest([True, False, True], 3) != embed_mask_digest(None, 3)
    with pytest.raises(InvalidStagedCall):
        embed_mask_digest([True], 3)
    assert processor_fingerprint({"a": 1, "b": 2}) == processor_fingerprint({"b": 2, "a": 1})
    assert processor_fingerprint({"a": 1}) != processor_fingerprint({"a": 2})


@pytest.mark.parametrize(
    "change",
    [
        {"modality": "audio"},
        {"offset": -1},
        {"length": 0},
        {"bytes_sha256": "AB" * 32},
        {"mm_hash": ""},
        {"mm_hash": "x\n"},
    ],
)
def test_a_malformed_media_item_is_refused(change: dict[str, object]) -> None:
    with pytest.raises(InvalidStagedCall) as info:
        dataclasses.replace(item(), **change)  # type: ignore[arg-type]
    assert info.value.code == "bad_media"


def two_calls() -> tuple[Ledger, list[object]]:
    ledger = Ledger("media-r")
    first = admit_call(ledger, None, admitted_at=1, request_fingerprint="f1")
    parent = stage_call(
        ledger,
        first,
        None,
        prompt_ids=[1, 9, 9, 9, 9, 2],
        output_ids=[3, 4],
        logprobs=[-1.0, -2.0],
        media=[item()],
    )
    second = admit_call(ledger, parent, admitted_at=2, request_fingerprint="f2")
    child = stage_call(
        ledger,
        second,
        parent,
        prompt_ids=[1, 9, 9, 9, 9, 2, 3, 4, 5],
        output_ids=[6],
        logprobs=[-1],
    )
    ledger.append(Closed(reward=1.0))
    return ledger, [parent, child]


def test_a_v4_capture_round_trips_and_verifies() -> None:
    ledger, calls = two_calls()
    parent, child = calls
    assert parent.format == 4  # type: ignore[attr-defined]
    assert child.format == 3  # type: ignore[attr-defined]
    data = encode_staged_calls(calls)  # type: ignore[arg-type]
    assert json.loads(data)["format"] == "tokcap/staged/v4"
    assert decode_staged_calls(data) == calls
    manifest = manifest_of(ledger)
    encoded = encode_manifest(manifest)
    assert json.loads(encoded)["format"] == "tokcap/manifest/v4"
    assert decode_manifest(encoded) == manifest
    receipt = assemble_receipt(verify_manifest(manifest))
    links = receipt.segments[0]
    assert links[0].media_digests == (item().bytes_sha256,)
    assert links[1].media_digests is None
    verify_staged(receipt, calls)  # type: ignore[arg-type]


def test_media_stripped_from_a_stored_call_fail_verification() -> None:
    ledger, calls = two_calls()
    receipt = assemble_receipt(verify_manifest(manifest_of(ledger)))
    stripped = dataclasses.replace(calls[0], media=None)  # type: ignore[type-var]
    with pytest.raises(VerificationError) as info:
        verify_staged(receipt, [stripped, calls[1]])  # type: ignore[list-item]
    assert info.value.code == "media_mismatch"
    other = dataclasses.replace(calls[0], media=(item(image=b"other bytes"),))  # type: ignore[type-var]
    with pytest.raises(VerificationError) as info:
        verify_staged(receipt, [other, calls[1]])  # type: ignore[list-item]
    assert info.value.code == "media_mismatch"


def test_media_outside_the_carried_tokens_are_refused() -> None:
    ledger = Ledger("media-s")
    call_id = admit_call(ledger, None, admitted_at=1, request_fingerprint="f")
    with pytest.raises(InvalidStagedCall) as info:
        stage_call(
            ledger,
            call_id,
            None,
            prompt_ids=[1, 2, 3],
            output_ids=[4],
            logprobs=[-1.0],
            media=[item(offset=1, length=4)],
        )
    assert info.value.code == "bad_media"


def test_a_v3_manifest_does_not_read_media_digests() -> None:
    ledger, _ = two_calls()
    doc = json.loads(encode_manifest(manifest_of(ledger)))
    doc["format"] = "tokcap/manifest/v3"
    with pytest.raises(ManifestError) as info:
        decode_manifest(json.dumps(doc))
    assert info.value.code == "unknown_field"
