"""Golden vectors: the shipped digests, entry hashes and receipts are recomputed exactly."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import pytest

from tokcap_core import VerificationError, decode_manifest, verify_manifest
from tokcap_core.golden import (
    GOLDEN_FORMAT,
    GOLDEN_FORMAT_V2,
    GOLDEN_FORMAT_V3,
    assert_golden_vectors,
)
from tokcap_core.ledger import encode_manifest
from tokcap_core.provenance import receipt_staleness
from tokcap_core.receipts import assemble_receipt


def shipped(name: str = "vectors.json") -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        resources.files("tokcap_core").joinpath(f"golden/{name}").read_text("utf-8")
    )
    return doc


def test_shipped_golden_vectors_are_recomputed_exactly() -> None:
    v4 = assert_golden_vectors(shipped("vectors_v4.json"))
    v3, v2 = assert_golden_vectors(shipped()), assert_golden_vectors(shipped("vectors_v2.json"))
    assert assert_golden_vectors() == v4 + v3 + v2
    assert v4 > v3 > 0
    assert v2 > 0


def test_golden_vectors_v4_bind_images_and_keep_the_v3_cases() -> None:
    v4, v3 = shipped("vectors_v4.json"), shipped()
    assert v4["format"] == GOLDEN_FORMAT
    assert v3["format"] == GOLDEN_FORMAT_V3
    assert [r for r in v4["rollouts"] if r["name"] != "images-two-turns"] == v3["rollouts"]
    (case,) = [r for r in v4["rollouts"] if r["name"] == "images-two-turns"]
    assert case["manifest"]["format"] == "tokcap/manifest/v4"
    staged = [e["event"] for e in case["manifest"]["entries"] if e["event"]["type"] == "staged"]
    for call, event in zip(case["staged"], staged, strict=True):
        (item,) = call["media"]
        assert event["media_digests"] == [item["bytes_sha256"]]
        assert call["prefix_len"] <= item["offset"] < item["offset"] + item["length"]
    links = case["receipt"]["segments"][0]
    assert [c["media_digests"] for c in links] == [e["media_digests"] for e in staged]


def test_stored_format_v2_captures_still_verify_and_keep_their_bytes() -> None:
    doc = shipped("vectors_v2.json")
    assert doc["format"] == GOLDEN_FORMAT_V2
    for r in doc["rollouts"]:
        assert r["manifest"]["format"] == "tokcap/manifest/v2"
        assert all("weight_versions" not in c for c in r["staged"])
        manifest = decode_manifest(json.dumps(r["manifest"]))
        # re-encoded as written then: a v2 manifest stays v2, byte for byte
        assert json.loads(encode_manifest(manifest)) == r["manifest"]
        receipt = assemble_receipt(verify_manifest(manifest), segments=r["segments"])
        assert receipt.to_json() == r["receipt"]


def test_golden_vectors_v3_hold_both_push_modes() -> None:
    (case,) = [r for r in shipped()["rollouts"] if r["name"] == "pushed-in-flight"]
    recompute, keep = case["staged"]
    assert recompute["weight_versions"] == recompute["kv_versions"] == [[3, 0, 2], [4, 2, 5]]
    assert keep["weight_versions"] == [[4, 0, 3], [5, 3, 6]]
    assert keep["kv_versions"] == [[4, 0, 6]]  # three tokens sampled by 5 on KV of 4
    receipt = assemble_receipt(verify_manifest(decode_manifest(json.dumps(case["manifest"]))))
    staleness = receipt_staleness(receipt, trained_version=5)
    assert (staleness.tokens, staleness.staleness_max, staleness.stale_kv_tokens) == (11, 2, 3)
    assert (staleness.stale_tokens, staleness.calls_spanning_versions) == (8, 2)


def test_golden_vectors_cover_every_terminal_path_in_the_spec() -> None:
    doc = shipped()
    receipts = {r["name"]: r["receipt"] for r in doc["rollouts"]}
    assert {r["terminal_selection"] for r in receipts.values()} >= {
        "declared",
        "heuristic",
        "content",
    }
    assert any(r["status"] == "poisoned" for r in receipts.values())
    assert any(len(r["segments"]) > 1 for r in receipts.values())


def test_golden_vectors_cover_splices_and_calls_spanning_a_weight_push() -> None:
    doc = shipped()
    links = [c for r in doc["rollouts"] for seg in r["receipt"]["segments"] for c in seg]
    assert {c["formation"] for c in links} == {"root", "extend", "splice"}
    assert any(r["receipt"]["splice_causes"] for r in doc["rollouts"])
    assert any(c["weight_version_last"] > c["weight_version"] for c in links)
    assert any(c["weight_version_last"] == c["weight_version"] for c in links)


# (module, constant) as each module looks it up at call time
DOMAINS = [
    ("tokcap_core._staged", "CALL_DOMAIN"),
    ("tokcap_core._digest", "CHAIN_DOMAIN"),
    ("tokcap_core._digest", "GENESIS_DOMAIN"),
    ("tokcap_core._ledger", "LEDGER_DOMAIN"),
    ("tokcap_core._events", "STAGED_ENTRY_DOMAIN"),
    ("tokcap_core._staged", "CALL_DOMAIN_V2"),
    ("tokcap_core._staged", "CALL_DOMAIN_V3"),
    ("tokcap_core._events", "STAGED_ENTRY_DOMAIN_V3"),
    ("tokcap_core._media", "TENSORS_DOMAIN"),
    ("tokcap_core._media", "EMBED_DOMAIN"),
    ("tokcap_core._media", "PROCESSOR_DOMAIN"),
    ("tokcap_core._events", "LEDGER_DOMAIN"),
]


@pytest.mark.parametrize(("module", "name"), DOMAINS)
def test_a_changed_domain_string_breaks_the_golden_vectors(
    monkeypatch: pytest.MonkeyPatch, module: str, name: str
) -> None:
    monkeypatch.setattr(f"{module}.{name}", b"tokcap/changed/v1")
    with pytest.raises(VerificationError) as info:
        assert_golden_vectors()
    assert info.value.code == "golden_mismatch"


EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "format": lambda d: d.update(format="tokcap/golden/v0"),
    "genesis hash": lambda d: d["genesis"][0].update(hash="00" * 32),
    "chain hash": lambda d: d["chain"][1].update(chain_hash="00" * 32),
    "receipt status": lambda d: d["rollouts"][0]["receipt"].update(status="poisoned"),
    "receipt terminal": lambda d: d["rollouts"][1]["receipt"].update(terminal_call_id="c000001"),
    "staged digest": lambda d: d["rollouts"][0]["staged"][0].update(digest="00" * 32),
    "staged token": lambda d: d["rollouts"][0]["staged"][0]["tokens"].__setitem__(0, 12345),
    "staged last weight version": lambda d: d["rollouts"][0]["staged"][0].update(
        weight_version_last=d["rollouts"][0]["staged"][0]["weight_version_last"] + 1
    ),
    "staged weight span": lambda d: _pushed(d)["staged"][1]["weight_versions"][0].__setitem__(2, 2),
    "staged kv span": lambda d: _pushed(d)["staged"][1].update(kv_versions=[[4, 0, 3], [5, 3, 6]]),
    "manifest kv span": lambda d: _staged_events(d)[-1]["event"].update(
        kv_versions=[[4, 0, 3], [5, 3, 6]]
    ),
    "admitted formation": lambda d: _admitted(d, "splice")[0]["event"].update(
        formation="extend", splice_cause=None
    ),
    "admitted splice cause": lambda d: _admitted(d, "splice")[0]["event"].update(
        splice_cause="other"
        if _admitted(d, "splice")[0]["event"]["splice_cause"] != "other"
        else "whitespace"
    ),
    "receipt splice causes": lambda d: d["rollouts"][0]["receipt"].update(splice_causes=[]),
    "receipt call formation": lambda d: d["rollouts"][0]["receipt"]["segments"][0][1].update(
        formation="root"
    ),
}


def _pushed(doc: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in doc["rollouts"] if r["name"] == "pushed-in-flight")


def _staged_events(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in _pushed(doc)["manifest"]["entries"] if e["event"]["type"] == "staged"]


def _admitted(doc: dict[str, Any], formation: str) -> list[dict[str, Any]]:
    """The manifest entries (all rollouts) that admitted a call with ``formation``."""
    return [
        e
        for r in doc["rollouts"]
        for e in r["manifest"]["entries"]
        if e["event"]["type"] == "admitted" and e["event"]["formation"] == formation
    ]


def _images(doc: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in doc["rollouts"] if r["name"] == "images-two-turns")


MEDIA_EDITS: dict[str, Callable[[dict[str, Any]], None]] = {
    "media input bytes": lambda d: d["media"][0]["inputs"].update(bytes="00"),
    "media tensor byte": lambda d: d["media"][1]["inputs"]["tensors"][0].__setitem__(3, "00" * 48),
    "media embed mask": lambda d: d["media"][0]["inputs"]["embed"].__setitem__(0, True),
    "media processor": lambda d: d["media"][0]["inputs"]["processor"].update(extra=1),
    "staged media byte digest": lambda d: _images(d)["staged"][1]["media"][0].update(
        bytes_sha256="00" * 32
    ),
    "staged media offset": lambda d: _images(d)["staged"][1]["media"][0].update(offset=14),
    "manifest media digest": lambda d: next(
        e for e in _images(d)["manifest"]["entries"] if e["event"]["type"] == "staged"
    )["event"].update(media_digests=["00" * 32]),
}


@pytest.mark.parametrize("edit", list(MEDIA_EDITS))
def test_an_edited_golden_media_value_is_a_golden_mismatch(edit: str) -> None:
    doc = copy.deepcopy(shipped("vectors_v4.json"))
    MEDIA_EDITS[edit](doc)
    with pytest.raises(VerificationError) as info:
        assert_golden_vectors(doc)
    assert info.value.code == "golden_mismatch"


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_golden_value_is_a_golden_mismatch(edit: str) -> None:
    doc = copy.deepcopy(shipped())
    EDITS[edit](doc)
    with pytest.raises(VerificationError) as info:
        assert_golden_vectors(doc)
    assert info.value.code == "golden_mismatch"
