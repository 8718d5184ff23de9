"""Golden vectors: the shipped digests, entry hashes and receipts are recomputed exactly."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from importlib import resources
from typing import Any

import pytest

from tokcap_core import VerificationError
from tokcap_core.golden import assert_golden_vectors


def shipped() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        resources.files("tokcap_core").joinpath("golden/vectors.json").read_text("utf-8")
    )
    return doc


def test_shipped_golden_vectors_are_recomputed_exactly() -> None:
    assert assert_golden_vectors() == assert_golden_vectors(shipped()) > 0


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


def _admitted(doc: dict[str, Any], formation: str) -> list[dict[str, Any]]:
    """The manifest entries (all rollouts) that admitted a call with ``formation``."""
    return [
        e
        for r in doc["rollouts"]
        for e in r["manifest"]["entries"]
        if e["event"]["type"] == "admitted" and e["event"]["formation"] == formation
    ]


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_golden_value_is_a_golden_mismatch(edit: str) -> None:
    doc = copy.deepcopy(shipped())
    EDITS[edit](doc)
    with pytest.raises(VerificationError) as info:
        assert_golden_vectors(doc)
    assert info.value.code == "golden_mismatch"
