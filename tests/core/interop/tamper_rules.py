"""What a single-field change of a Gym capture may do, and why (the documented table).

Every change is *detected* (refused with a typed error, or the rollout poisoned) unless
it is listed here. The README's "Verifying NeMo-Gym captures" section shows this table.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Final

from tests.core.interop.gymkit import outcome

IRRELEVANT: Final[dict[str, str]] = {
    "reward": "bound by no Gym digest; carried through as the row's reward",
    "terminal_attribution_reason": "a diagnostic trail",
    "terminal_selection": "a label among valid methods; a heuristic terminal is re-checked",
    "response_id": "the attribution join key, read only when a receipt is assembled",
    "staging_key": "where the snapshot was fetched; identity is bound by call id and digest",
    "admitted_at": "orders roots for heuristic selection only, re-checked for heuristic receipts",
    "output_fingerprint": "an attribution witness",
    "continuation_fingerprint": "an attribution witness",
    "fingerprint_version": "an attribution witness's version",
    "logical_request_id": "a correlation header",
}
"""Receipt fields whose change leaves the trained tokens, mask, logprobs and routes alone."""

RESELECTED: Final[dict[str, str]] = {
    "terminal_model_call_id": (
        "Gym's receipt binds no witness: moving a declared/response_id/content terminal to "
        "another captured call yields that call's chain, verified in full and named as the "
        "terminal (a heuristic terminal is re-checked and refused)"
    ),
}
"""Receipt fields a change of which re-selects a different, fully verified chain."""

GYM_DEFAULTS: Final[dict[str, Any]] = {
    "parent_call_id": None,
    "extras": None,
    "extras_digest": "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6",
    "mode": "token_in",
    "capture_poisoned": False,
    "failure_reason": None,
    "terminal_selection": None,
    "terminal_attribution_reason": None,
    "admitted_at": None,
    "output_fingerprint": None,
    "continuation_fingerprint": None,
    "fingerprint_version": 0,
    "logical_request_id": None,
    "reward": None,
    "terminal_model_call_id": None,
    "manifest": [],
}
"""Gym's defaults: removing a key that holds its default is the same document."""

WITHHELD: Final = (
    "a record's extras removed: it becomes a base snapshot whose extras digest is still "
    "committed; on the terminal chain that is refused (extras_not_loaded), off it nothing "
    "is trained and Gym's verifier never reads extras"
)

_MARKERS = {"<removed>", "<added>", "<dropped>", "<repeated>"}


def _field(path: tuple[Any, ...]) -> str:
    return next((p for p in reversed(path) if isinstance(p, str) and p not in _MARKERS), "")


def _value_at(doc: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        doc = doc[step]
    return doc


def classify(
    path: tuple[Any, ...],
    original: Any,
    base: tuple[str, Any],
    result: tuple[str, Any],
    *,
    in_receipt: bool,
) -> str:
    """``detected``, ``equivalent``, ``withheld``, ``irrelevant`` or ``reselected``.

    Raises AssertionError for a change that verifies and is none of these."""
    kind, value = result
    if kind != "verified":
        return "detected"
    field = _field(path)
    if path[-1] == "<removed>" and value == base[1]:
        removed = _value_at(original, path[:-1])
        if field in GYM_DEFAULTS and removed == GYM_DEFAULTS[field]:
            return "equivalent"
    if not in_receipt and path[-2:] == ("extras", "<removed>") and value == base[1]:
        return "withheld"
    same_content = value[0] == base[1][0]
    if in_receipt and same_content and field in IRRELEVANT:
        return "irrelevant"
    if in_receipt and not same_content and field in RESELECTED:
        return "reselected"
    raise AssertionError(f"undetected tamper at {path}: {kind}")


def sweep(receipt: dict[str, Any], snapshots: list[dict[str, Any]], stranger: Any) -> Counter[str]:
    """Apply every single-field and list tamper; count each outcome class (see `classify`)."""
    from tests.core.interop.gymkit import list_tampers, tampers, vocabulary

    base = outcome(receipt, snapshots)
    assert base[0] == "verified", base
    counts: Counter[str] = Counter()
    vocab = vocabulary(receipt)
    for path, doc in tampers(receipt, vocab):
        counts[
            "receipt:" + classify(path, receipt, base, outcome(doc, snapshots), in_receipt=True)
        ] += 1
    for path, doc in tampers(snapshots, vocab):
        counts[
            "record:" + classify(path, snapshots, base, outcome(receipt, doc), in_receipt=False)
        ] += 1
    for label, docs in list_tampers(snapshots, stranger):
        kind = outcome(receipt, docs)[0]
        assert kind != "verified", f"undetected snapshot-list tamper: {label}"
        counts["list:detected"] += 1
    return counts
