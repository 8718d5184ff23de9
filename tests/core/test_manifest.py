"""Manifests: strict decoding with coded errors, and exact encode/decode round trips."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings

from tokcap_core import Manifest, VerificationError, decode_manifest
from tokcap_core.errors import ManifestError
from tokcap_core.ledger import MAX_MANIFEST_BYTES, encode_manifest
from tokcap_core.simulate import simulate_rollout
from tokcap_core.testing import manifests

Doc = dict[str, Any]


@pytest.fixture(scope="module")
def manifest() -> Manifest:
    return simulate_rollout(
        "m-1", seed=11, turns=2, offchain_failures=1, terminal="response_id"
    ).manifest


def _doc(manifest: Manifest) -> Doc:
    doc: Doc = json.loads(encode_manifest(manifest))
    return doc


def _first(doc: Doc, kind: str) -> Doc:
    event: Doc = next(e["event"] for e in doc["entries"] if e["event"]["type"] == kind)
    return event


def _decode_error(data: bytes | str, **kwargs: Any) -> str:
    with pytest.raises(ManifestError) as info:
        decode_manifest(data, **kwargs)
    return info.value.code


EDITS: dict[str, tuple[Callable[[Doc], None], str]] = {
    "unknown top-level field": (lambda d: d.update(extra=1), "unknown_field"),
    "unknown entry field": (lambda d: d["entries"][0].update(note="x"), "unknown_field"),
    "unknown event field": (lambda d: _first(d, "staged").update(tokens=[1, 2]), "unknown_field"),
    "unknown witness field": (
        lambda d: _first(d, "closed")["witnesses"].update(score=1),
        "unknown_field",
    ),
    "missing top-level field": (lambda d: d.pop("head"), "missing_field"),
    "missing head hash": (lambda d: d["head"].pop("hash"), "missing_field"),
    "missing event field": (lambda d: _first(d, "admitted").pop("admitted_at"), "missing_field"),
    "optional field omitted instead of null": (
        lambda d: _first(d, "admitted").pop("break_cause"),
        "missing_field",
    ),
    "bool where int (seq)": (lambda d: d["entries"][0].update(seq=True), "wrong_type"),
    "bool where int (prefix_len)": (
        lambda d: _first(d, "admitted").update(prefix_len=False),
        "wrong_type",
    ),
    "float where int": (lambda d: _first(d, "staged").update(gen_len=3.0), "wrong_type"),
    "string where int": (lambda d: d["head"].update(seq="1"), "wrong_type"),
    "int where bool": (lambda d: _first(d, "failed").update(served=0), "wrong_type"),
    "bool where float": (lambda d: _first(d, "closed").update(reward=True), "wrong_type"),
    "int where string": (
        lambda d: _first(d, "admitted").update(request_fingerprint=7),
        "wrong_type",
    ),
    "entries not a list": (lambda d: d.update(entries={}), "wrong_type"),
    "event not an object": (lambda d: d["entries"][0].update(event="admitted"), "wrong_type"),
    "unknown event type": (
        lambda d: d["entries"][0]["event"].update(type="deleted"),
        "unknown_event",
    ),
    "wrong format tag": (lambda d: d.update(format="tokcap/manifest/v9"), "bad_format"),
    "format v1 (before splices)": (lambda d: d.update(format="tokcap/manifest/v1"), "bad_format"),
    "bad rollout id": (lambda d: d.update(rollout_id="no spaces"), "bad_rollout_id"),
    "uppercase hash": (
        lambda d: d["entries"][0].update(hash=d["entries"][0]["hash"].upper()),
        "bad_hash",
    ),
    "short hash": (lambda d: d["head"].update(hash="ab" * 31), "bad_hash"),
    "non-hex hash": (lambda d: d["entries"][0].update(prev_hash="g" * 64), "bad_hash"),
    "invalid event field": (
        lambda d: _first(d, "staged").update(finish_reason="abort"),
        "bad_event",
    ),
    "invalid call id": (lambda d: _first(d, "admitted").update(call_id="call-1"), "bad_event"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_strict_decoding_rejects_with_a_code(manifest: Manifest, edit: str) -> None:
    change, code = EDITS[edit]
    doc = _doc(manifest)
    change(doc)
    assert _decode_error(json.dumps(doc)) == code


def test_a_duplicate_key_is_rejected(manifest: Manifest) -> None:
    data = encode_manifest(manifest)
    assert data.startswith(b'{"format":')
    duplicated = b'{"format":"x",' + data[1:]
    assert _decode_error(duplicated) == "duplicate_key"


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_numbers_are_rejected(manifest: Manifest, constant: bytes) -> None:
    data = encode_manifest(manifest)
    assert b'"reward":1.0' in data
    assert _decode_error(data.replace(b'"reward":1.0', b'"reward":' + constant)) == "non_finite"


def test_oversize_input_is_rejected_before_parsing(manifest: Manifest) -> None:
    data = encode_manifest(manifest)
    assert _decode_error(data, max_bytes=len(data) - 1) == "too_large"
    assert decode_manifest(data, max_bytes=len(data)) == manifest
    assert _decode_error(b"x" * (MAX_MANIFEST_BYTES + 1)) == "too_large"


@pytest.mark.parametrize("data", [b"", b"{", b"not json", b"\xff\xfe", b"[1, 2", '{"a": }'])
def test_input_that_is_not_json_is_rejected(data: bytes | str) -> None:
    assert _decode_error(data) == "bad_json"


@pytest.mark.parametrize("data", [b"[]", b"null", b"3", b'"manifest"'])
def test_a_document_that_is_not_an_object_is_rejected(data: bytes) -> None:
    assert _decode_error(data) == "wrong_type"


def test_deeply_nested_input_is_rejected_not_crashed() -> None:
    assert _decode_error(b"[" * 100_000 + b"]" * 100_000) in {"bad_json", "wrong_type"}


def test_manifest_errors_are_verification_errors() -> None:
    with pytest.raises(VerificationError):
        decode_manifest(b"{}")


def test_decoding_accepts_text_as_well_as_bytes(manifest: Manifest) -> None:
    assert decode_manifest(encode_manifest(manifest).decode("ascii")) == manifest


@settings(max_examples=40, deadline=None)
@given(manifest=manifests())
def test_decode_after_encode_is_identity(manifest: Manifest) -> None:
    assert decode_manifest(encode_manifest(manifest)) == manifest


@settings(max_examples=40, deadline=None)
@given(manifest=manifests())
def test_encode_after_decode_gives_back_the_same_bytes(manifest: Manifest) -> None:
    data = encode_manifest(manifest)
    assert encode_manifest(decode_manifest(data)) == data


def test_encoding_is_compact_ascii_with_a_fixed_field_order(manifest: Manifest) -> None:
    data = encode_manifest(manifest)
    assert data.isascii()
    assert b" " not in data
    assert list(json.loads(data)) == ["format", "rollout_id", "head", "entries"]
