"""The format conformance kit: captures another implementation wrote, held to tokcap's rules.

A *sample* is one rollout as JSON documents: ``(manifest, staged)``, the manifest as a
control plane serves it and the staged calls as ``tokcap/staged/v2``. `check_capture_format`
checks that a gate's samples verify (the manifest replays, the receipt assembles, its
staged rows verify and reassemble) and that **every single-field change** of either
document is refused with a typed error, or leaves the result unchanged for a documented
reason (`irrelevant` says which). The verifier is pluggable: by default tokcap's own
(pinned first by `tokcap_core.golden.assert_golden_vectors`); another implementation of the
*verifier* passes ``verify=`` and runs `golden_samples` (tokcap's golden rollouts) through
it. The same function checks a reader of a peer's format (the NeMo-Gym reader runs
through it in tokcap's tests).
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ._errors import TokcapError
from ._manifest import decode_manifest, verify_manifest
from ._reassembly import reassemble
from ._receipt import assemble_receipt
from ._staged_json import STAGED_FORMAT, STAGED_FORMAT_V2, decode_staged_calls
from .golden import GOLDEN_FORMAT, GOLDEN_FORMAT_V2, assert_golden_vectors, shipped_vectors

__all__ = [
    "FormatReport",
    "Sample",
    "check_capture_format",
    "golden_samples",
    "single_field_tampers",
    "tokcap_irrelevant",
    "verify_tokcap_sample",
]

Sample: TypeAlias = tuple[bytes, bytes]
"""One rollout: ``(manifest JSON, staged JSON)`` (or a peer's two documents)."""
Verify: TypeAlias = Callable[[bytes, bytes], object]
Irrelevant: TypeAlias = Callable[[int, tuple[Any, ...], Sample], "str | None"]
Alternatives: TypeAlias = Callable[[tuple[Any, ...], Any], Iterable[Any]]
"""``(path, value) -> other values`` a leaf at ``path`` takes in `single_field_tampers`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FormatReport:
    """What a format check did: samples verified, tampers tried, and how each ended."""

    samples: int
    tampers: int
    detected: int
    irrelevant: Counter[str]
    """Changes that verified, by documented reason; `` (result changed)`` is appended to
    the reason of one whose result differs from the untouched sample's."""


def verify_tokcap_sample(manifest: bytes, staged: bytes) -> object:
    """tokcap's verifier on one sample: the receipt, and its rows when verified."""
    receipt = assemble_receipt(verify_manifest(decode_manifest(manifest)), segments="all")
    if not receipt.ok:
        return receipt.to_json(), None
    return receipt.to_json(), reassemble(receipt, decode_staged_calls(staged), max_seq_len=1 << 30)


def tokcap_irrelevant(document: int, path: tuple[Any, ...], sample: Sample) -> str | None:
    """Why a change of a tokcap sample may verify: a staged call that no receipt segment
    names is never read (a sink's extra row), a call listed twice is one call, and a
    poisoned receipt reads no staged row at all.
    Nothing else in a tokcap capture is unbound."""
    if document != 1:
        return None
    result = verify_tokcap_sample(*sample)
    assert isinstance(result, tuple)
    receipt: dict[str, Any] = result[0]
    if receipt["status"] != "verified":
        return "a poisoned receipt reads no staged row"
    if len(path) < 2 or path[0] != "calls":
        return None
    calls = json.loads(sample[1])["calls"]
    if path[1] == "<repeated>":
        return "an identical staged call listed twice"
    index = len(calls) - 1 if path[1] == "<dropped>" else path[1]
    if not isinstance(index, int):
        return None
    call = calls[index]
    named = {c["call_id"] for segment in receipt["segments"] for c in segment}
    return None if call["call_id"] in named else "staged call outside every receipt segment"


def golden_samples() -> list[Sample]:
    """tokcap's golden rollouts, of capture formats v4 (which holds the v3 cases) and v2,
    as samples (for checking another verifier implementation)."""
    out = []
    for golden, staged in ((GOLDEN_FORMAT, STAGED_FORMAT), (GOLDEN_FORMAT_V2, STAGED_FORMAT_V2)):
        for r in shipped_vectors(golden)["rollouts"]:
            calls = json.dumps({"format": staged, "calls": r["staged"]}).encode()
            out.append((json.dumps(r["manifest"]).encode(), calls))
    return out


def _alternatives(value: Any) -> Iterator[Any]:
    if isinstance(value, bool):
        yield not value
    elif isinstance(value, int):
        yield value + 1
    elif isinstance(value, float):
        yield value + 0.5
        yield -value
    elif isinstance(value, str):
        yield value + "x"
        if value:
            yield ("0" if value[0] != "0" else "1") + value[1:]
    elif value is None:
        yield "x"


def single_field_tampers(
    doc: Any,
    path: tuple[Any, ...] = (),
    *,
    alternatives: Alternatives | None = None,
) -> Iterator[tuple[Any, Any]]:
    """``(path, changed document)`` for every single-field change of a JSON document.

    Scalars take other values of their type (or, with ``alternatives``, the values
    ``alternatives(path, value)`` gives), objects lose each key and gain an unknown
    one, arrays lose and repeat their last item; in arrays of more than four scalars only
    the first, middle and last items are changed.
    """
    node = _parent(doc, path)
    if isinstance(node, dict):
        for key in node:
            yield from single_field_tampers(doc, (*path, key), alternatives=alternatives)
            changed = copy.deepcopy(doc)
            _parent(changed, path).pop(key)
            yield (*path, key, "<removed>"), changed
        changed = copy.deepcopy(doc)
        _parent(changed, path)["unknown_field"] = 1
        yield (*path, "<added>"), changed
    elif isinstance(node, list):
        indices: Sequence[int] = range(len(node))
        if len(node) > 4 and not any(isinstance(i, (dict, list)) for i in node):
            indices = sorted({0, len(node) // 2, len(node) - 1})
        for index in indices:
            yield from single_field_tampers(doc, (*path, index), alternatives=alternatives)
        if node:
            for edit in ("<dropped>", "<repeated>"):
                changed = copy.deepcopy(doc)
                items = _parent(changed, path)
                items.append(copy.deepcopy(items[-1])) if edit == "<repeated>" else items.pop()
                yield (*path, edit), changed
    else:
        values = _alternatives(node) if alternatives is None else alternatives(path, node)
        for alternative in values:
            changed = copy.deepcopy(doc)
            _parent(changed, path[:-1])[path[-1]] = alternative
            yield path, changed


def _parent(doc: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def _result(verify: Verify, manifest: bytes, staged: bytes) -> tuple[bool, object]:
    try:
        return True, verify(manifest, staged)
    except TokcapError as e:
        return False, e.code


def check_capture_format(
    samples: Sequence[Sample],
    *,
    verify: Verify = verify_tokcap_sample,
    irrelevant: Irrelevant = tokcap_irrelevant,
) -> FormatReport:
    """Every sample verifies and every single-field change of it is detected (module doc).

    ``verify(first, second)`` returns a comparable result, or raises a `TokcapError` for
    data it refuses (a poisoned rollout included); ``irrelevant(document, path, sample)``
    (document 0 or 1) names why a change that still verifies is harmless, or returns None.
    Raises AssertionError naming the first sample that fails or change that went through
    undocumented; the caller decides which ``(result changed)`` reasons it accepts.
    """
    if verify is verify_tokcap_sample:
        assert_golden_vectors()
    tried = detected = 0
    reasons: Counter[str] = Counter()
    for number, sample in enumerate(samples):
        ok, base = _result(verify, *sample)
        assert ok, f"sample {number} does not verify: {base}"
        for document in (0, 1):
            parsed = json.loads(sample[document])
            for path, changed in single_field_tampers(parsed):
                text = json.dumps(changed).encode()
                tampered = (text, sample[1]) if document == 0 else (sample[0], text)
                tried += 1
                ok, result = _result(verify, *tampered)
                if not ok:
                    detected += 1
                    continue
                reason = irrelevant(document, path, sample)
                assert reason, f"sample {number}: undetected change of document {document} {path}"
                reasons[reason if result == base else f"{reason} (result changed)"] += 1
    return FormatReport(samples=len(samples), tampers=tried, detected=detected, irrelevant=reasons)
