"""Golden vectors: fixed inputs and the digests, entry hashes and receipts they must give.

The vectors ship in ``golden/vectors_v4.json`` (capture format v4: the v3 cases and calls
that carry media items, images bound by their byte and tensor digests),
``golden/vectors.json`` (format v3: calls carry per-token weight and KV spans) and
``golden/vectors_v2.json`` (the format before); the older files are kept as written then,
so stored captures stay verifiable. `assert_golden_vectors` recomputes every value from
the stored inputs, so any change to canonical bytes, domains or terminal selection shows
up as ``golden_mismatch``. ``python -m tokcap_core.golden`` rewrites the v4 file (and the
shipped example) — only ever on purpose, with a format version bump; the v3 and v2 files
are never rewritten.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any, Final

from ._digest import chain_hash, genesis_hash
from ._errors import InvalidStagedCall, VerificationError
from ._events import Closed, TerminalDeclared, Witnesses
from ._ledger import Ledger, entry_hash
from ._manifest import decode_manifest, encode_manifest, manifest_of, verify_manifest
from ._media import MediaItem, embed_mask_digest, processor_fingerprint, tensors_digest
from ._reassembly import verify_staged
from ._receipt import SegmentMode, assemble_receipt
from ._staged import StagedCall
from ._staged_json import (
    STAGED_FORMAT,
    STAGED_FORMAT_V2,
    STAGED_FORMAT_V3,
    decode_staged_calls,
    encode_staged_calls,
)
from .provenance import VersionSpan
from .simulate import SimulatedRollout, admit_call, simulate_rollout, stage_call

__all__ = [
    "GOLDEN_FORMAT",
    "GOLDEN_FORMAT_V2",
    "GOLDEN_FORMAT_V3",
    "assert_golden_vectors",
    "build_golden_vectors",
]

GOLDEN_FORMAT: Final = "tokcap/golden/v4"
GOLDEN_FORMAT_V3: Final = "tokcap/golden/v3"
"""The vectors of capture format v3 (``golden/vectors.json``), still checked."""
GOLDEN_FORMAT_V2: Final = "tokcap/golden/v2"
"""The vectors of capture format v2 (``golden/vectors_v2.json``), still checked."""
_FILES: Final = {
    GOLDEN_FORMAT: "golden/vectors_v4.json",
    GOLDEN_FORMAT_V3: "golden/vectors.json",
    GOLDEN_FORMAT_V2: "golden/vectors_v2.json",
}
_STAGED_FORMATS: Final = {
    GOLDEN_FORMAT: STAGED_FORMAT,
    GOLDEN_FORMAT_V3: STAGED_FORMAT_V3,
    GOLDEN_FORMAT_V2: STAGED_FORMAT_V2,
}


def _two_turns(rollout_id: str, first: dict[str, Any], second: dict[str, Any]) -> SimulatedRollout:
    """A call and its child, as `stage_call` arguments ``first`` and ``second``: admitted at
    1 and 2 with request fingerprints ``req-<tag>1``/``2``, answered as ``resp-<tag>1``/``2``
    (``<tag>``: the id's last letter), closed with reward 1.0 on the child's response id."""
    tag = rollout_id[-1]
    ledger = Ledger(rollout_id)
    parent: StagedCall | None = None
    staged: dict[str, StagedCall] = {}
    for turn, arguments in enumerate((first, second), start=1):
        call_id = admit_call(
            ledger, parent, admitted_at=turn, request_fingerprint=f"req-{tag}{turn}"
        )
        parent = stage_call(ledger, call_id, parent, response_id=f"resp-{tag}{turn}", **arguments)
        staged[parent.key] = parent
    ledger.append(Closed(reward=1.0, witnesses=Witnesses(response_id=f"resp-{tag}2")))
    return SimulatedRollout(ledger=ledger, manifest=manifest_of(ledger), staged=staged)


def _pushed_in_flight() -> SimulatedRollout:
    """Two calls generated across pushes: the first under ``recompute`` (its KV follows
    its weights), the second under ``keep`` (tokens after the push sit on older KV)."""
    spans = (VersionSpan(version=3, start=0, end=2), VersionSpan(version=4, start=2, end=5))
    child_spans = (VersionSpan(version=4, start=0, end=3), VersionSpan(version=5, start=3, end=6))
    return _two_turns(
        "golden-e",
        {
            "prompt_ids": [1, 2, 3],
            "output_ids": [4, 5, 6, 7, 8],
            "logprobs": [-0.5, -1.0, -1.5, -2.0, -2.5],
            "weight_version": 3,
            "weight_versions": spans,
            "kv_versions": spans,
        },
        {
            "prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            "output_ids": [11, 12, 13, 14, 15, 16],
            "logprobs": [-0.25] * 6,
            "weight_version": 4,
            "weight_versions": child_spans,
            "kv_versions": (VersionSpan(version=4, start=0, end=6),),
        },
    )


def _media_inputs(index: int, length: int) -> dict[str, Any]:
    """The raw inputs of a synthetic image's digests (so the vectors need no image)."""
    return {
        "bytes": (b"golden image %d" % index).hex(),
        "tensors": [
            ["pixel_values", "float32", [1, 3, 2, 2], bytes(range(index, index + 48)).hex()],
            ["pixel_attention_mask", "bool", [1, 2, 2], bytes([1, 1, 1, 0]).hex()],
        ],
        "embed": [position % 3 != 0 for position in range(length)],
        "processor": {"processor": "golden", "versions": {"vllm": "0"}},
    }


def _media_digests(inputs: dict[str, Any]) -> dict[str, str]:
    """The digests of `_media_inputs`: bytes, tensors, embed mask, processor."""
    return {
        "bytes_sha256": hashlib.sha256(bytes.fromhex(inputs["bytes"])).hexdigest(),
        "tensors_digest": tensors_digest(
            (name, dtype, shape, bytes.fromhex(data))
            for name, dtype, shape, data in inputs["tensors"]
        ),
        "embed_digest": embed_mask_digest(inputs["embed"], len(inputs["embed"])),
        "processor": processor_fingerprint(inputs["processor"]),
    }


def _golden_image(index: int, offset: int, length: int) -> MediaItem:
    """A synthetic image item whose digests are those of `_media_inputs`."""
    digests = _media_digests(_media_inputs(index, length))
    return MediaItem(
        modality="image", offset=offset, length=length, mm_hash=f"golden-mm-{index}", **digests
    )


def _images_two_turns() -> SimulatedRollout:
    """An image in the first call's prompt, a second one in the second call's carry: each
    item is bound by the call that first carries it, and named in its ``Staged`` entry."""
    return _two_turns(
        "golden-f",
        {
            "prompt_ids": [1, 2, *[900] * 6, 3],
            "output_ids": [4, 5, 6],
            "logprobs": [-0.5, -1.0, -1.5],
            "weight_version": 2,
            "media": [_golden_image(1, offset=2, length=6)],
        },
        {
            "prompt_ids": [1, 2, *[900] * 6, 3, 4, 5, 6, 7, *[900] * 4, 8],
            "output_ids": [9, 10],
            "logprobs": [-0.25, -0.75],
            "weight_version": 2,
            "media": [_golden_image(2, offset=13, length=4)],
        },
    )


def build_golden_vectors() -> dict[str, Any]:
    """Compute the golden document from fixed synthetic inputs."""
    cases: list[tuple[str, SegmentMode, Any]] = [
        ("chain-declared-routes", "terminal",
            simulate_rollout("golden-a", seed=1, turns=3, routes=True)),
        ("forest-heuristic-all", "all", simulate_rollout(
            "golden-b", seed=2, turns=2, roots=2, offchain_failures=1, terminal="heuristic")),
        ("witness-content", "terminal",
            simulate_rollout("golden-c", seed=3, turns=2, terminal="content")),
    ]  # fmt: skip
    missing = simulate_rollout("golden-d", seed=4, turns=1, terminal="heuristic", reward=None)
    # rebuild golden-d with a declared terminal that names no call: the receipt must be poisoned
    ledger = type(missing.ledger)("golden-d")
    for entry in missing.ledger.entries[:-1]:
        ledger.append(entry.event)
    ledger.append(TerminalDeclared(by="call_id", value="c000099"))
    ledger.append(Closed(reward=0.5))
    cases.append(
        (
            "declared-missing",
            "terminal",
            type(missing)(ledger=ledger, manifest=manifest_of(ledger), staged=missing.staged),
        )
    )
    cases.append(("pushed-in-flight", "terminal", _pushed_in_flight()))
    cases.append(("images-two-turns", "terminal", _images_two_turns()))
    rollouts = []
    for name, mode, sim in cases:
        receipt = assemble_receipt(verify_manifest(sim.manifest), segments=mode)
        rollouts.append({
            "name": name,
            "segments": mode,
            "manifest": json.loads(encode_manifest(sim.manifest)),
            "staged": json.loads(encode_staged_calls(sim.calls))["calls"],
            "receipt": receipt.to_json(),
        })  # fmt: skip
    return {
        "format": GOLDEN_FORMAT,
        "media": [
            {"inputs": inputs, "digests": _media_digests(inputs)}
            for inputs in (_media_inputs(1, 6), _media_inputs(2, 4))
        ],
        "genesis": [
            {"rollout_id": r, "hash": genesis_hash(r)} for r in ("a", "golden-a", "R.1_x-2")
        ],
        "chain": [
            {
                "parent_chain_hash": None,
                "call_digest": "11" * 32,
                "chain_hash": chain_hash(None, "11" * 32),
            },
            {
                "parent_chain_hash": "22" * 32,
                "call_digest": "33" * 32,
                "chain_hash": chain_hash("22" * 32, "33" * 32),
            },
        ],
        "rollouts": rollouts,
    }


def _mismatch(what: str) -> VerificationError:
    return VerificationError("golden_mismatch", what)


def assert_golden_vectors(doc: dict[str, Any] | None = None) -> int:
    """Recompute every value of ``doc`` (None: every shipped file, v4, v3 and v2); return
    how many values were checked.

    Raises `VerificationError` (``golden_mismatch``) naming the first value that differs.
    """
    if doc is None:
        return sum(assert_golden_vectors(shipped_vectors(f)) for f in _FILES)
    if doc.get("format") not in _FILES:
        raise _mismatch("format")
    staged_format = _STAGED_FORMATS[doc["format"]]
    checked = 0
    for m in doc.get("media", ()):  # format v4: an image's digests from their inputs
        if _media_digests(m["inputs"]) != m["digests"]:
            raise _mismatch("media digests")
        checked += 1
    for g in doc["genesis"]:
        if genesis_hash(g["rollout_id"]) != g["hash"]:
            raise _mismatch(f"genesis of {g['rollout_id']!r}")
        checked += 1
    for c in doc["chain"]:
        if chain_hash(c["parent_chain_hash"], c["call_digest"]) != c["chain_hash"]:
            raise _mismatch("chain hash")
        checked += 1
    for r in doc["rollouts"]:
        name = r["name"]
        manifest = decode_manifest(json.dumps(r["manifest"]))
        for entry in manifest.entries:
            if entry_hash(entry.prev_hash, entry.event) != entry.hash:
                raise _mismatch(f"{name}: entry {entry.seq} hash")
            checked += 1
        try:
            staged = decode_staged_calls(
                json.dumps({"format": staged_format, "calls": r["staged"]})
            )
        except InvalidStagedCall as e:
            raise _mismatch(f"{name}: staged calls do not decode ({e.code})") from e
        chains = {c.call_id: c.chain_hash for c in staged}
        for call in staged:
            if call.compute_digest() != call.digest:
                raise _mismatch(f"{name}: digest of {call.call_id}")
            parent_chain = chains[call.parent_id] if call.parent_id else None
            if chain_hash(parent_chain, call.digest) != call.chain_hash:
                raise _mismatch(f"{name}: chain hash of {call.call_id}")
            checked += 2
        receipt = assemble_receipt(verify_manifest(manifest), segments=r["segments"])
        if receipt.to_json() != r["receipt"]:
            raise _mismatch(f"{name}: receipt")
        if receipt.ok:
            verify_staged(receipt, staged)
        checked += 1
    return checked


def shipped_vectors(golden_format: str = GOLDEN_FORMAT) -> dict[str, Any]:
    """The shipped golden document of ``golden_format`` (v4, `GOLDEN_FORMAT_V3` or
    `GOLDEN_FORMAT_V2`)."""
    path = _FILES[golden_format]
    return json.loads(resources.files("tokcap_core").joinpath(path).read_text("utf-8"))  # type: ignore[no-any-return]


def _write() -> None:  # pragma: no cover - maintenance entry point
    here = Path(__file__).parent
    doc = build_golden_vectors()
    (here / "golden" / "vectors_v4.json").write_text(json.dumps(doc, indent=1) + "\n", "utf-8")
    example = simulate_rollout(
        "example-rollout", seed=7, turns=4, roots=2, offchain_failures=1, routes=True
    )
    (here / "examples" / "manifest.json").write_bytes(encode_manifest(example.manifest) + b"\n")
    (here / "examples" / "staged.json").write_bytes(encode_staged_calls(example.calls) + b"\n")
    print(f"wrote golden vectors ({assert_golden_vectors(doc)} values) and the example")


if __name__ == "__main__":  # pragma: no cover
    _write()
