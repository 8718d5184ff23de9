"""Fuzzing every core decoder: a typed `TokcapError` or success, never another exception or hang.

Decoders and what follows them on success: `decode_manifest` → `verify_manifest` (replay) →
`assemble_receipt`; `decode_staged_calls` / `staged_from_json` → `verify_staged` and
`reassemble`; `decode_routes`. Inputs: arbitrary bytes and text, arbitrary JSON values
(``st.recursive``), JSON shaped like the real document with arbitrary leaves, and mutations
(byte edits, sub-value replacements) of valid documents. Where a mutated document is *accepted*
all the way, it must be the original (re-encodes to it / reassembles to the same rows).

Profiles (``tests/reliability/conftest.py``): ``ci`` by default; ``HYPOTHESIS_PROFILE=slow``
runs 10k inputs per test (>= 100k in all). Every test here is marked ``slow`` so a soak run
can select them with ``-m slow``; CI runs them in the ``ci`` profile.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.reliability.conftest import FUZZ_TIMEOUT_S, fuzz_settings
from tokcap_core import (
    StagedCall,
    TokcapError,
    assemble_receipt,
    decode_manifest,
    reassemble,
    verify_manifest,
    verify_staged,
)
from tokcap_core.ledger import MANIFEST_FORMAT, MAX_MANIFEST_BYTES, encode_manifest
from tokcap_core.routes import ENVELOPE_PREFIX, decode_routes, encode_routes
from tokcap_core.simulate import SimulatedRollout, simulate_rollout
from tokcap_core.staged import (
    STAGED_FORMAT,
    decode_staged_calls,
    encode_staged_calls,
    staged_from_json,
    staged_to_json,
)
from tokcap_core.testing import simulated_rollouts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(FUZZ_TIMEOUT_S)]
fuzz = fuzz_settings()
T = TypeVar("T")

_EVENT_TYPES = ("admitted", "staged", "failed", "terminal_declared", "closed", "poisoned")
_FIELD_NAMES = (
    "type", "call_id", "parent_id", "prefix_len", "admitted_at", "request_fingerprint",
    "formation", "break_cause", "splice_cause", "carry_len", "gen_len", "weight_version",
    "weight_version_last", "finish_reason", "call_digest", "chain_hash", "response_id",
    "output_fingerprint", "reason", "served", "by", "value", "reward", "witnesses",
    "content_fingerprint",
)  # fmt: skip
_HASH = "0123456789abcdef" * 4

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-(2**70), 2**70)
    | st.floats()  # NaN and +-inf too: json.dumps writes them as NaN / Infinity
    | st.text(max_size=12)
    | st.sampled_from(["c000001", "c000002", _HASH, "stop", "length", "call_id", "", "nrlre1"])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=6), inner, max_size=6)
    ),
    max_leaves=24,
)


def typed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
    """``fn(*args)``, or None when it raised a typed `TokcapError` (anything else propagates)."""
    try:
        return fn(*args, **kwargs)
    except TokcapError as e:
        error = e
    assert isinstance(error.code, str)
    assert error.code, "a typed error always carries a code"
    return None


def dumps(value: object) -> bytes:
    return json.dumps(value).encode("utf-8")


# ---- mutations -----------------------------------------------------------------------------


@st.composite
def byte_mutations(draw: Any, original: bytes) -> bytes:
    """1-4 edits: replace, delete, insert or duplicate a short span."""
    data = bytearray(original)
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        op = draw(st.sampled_from(["replace", "delete", "insert", "duplicate"]))
        span = draw(st.integers(1, 8))
        if op == "replace" and data:
            data[pos : pos + span] = draw(st.binary(min_size=1, max_size=span))
        elif op == "delete":
            del data[pos : pos + span]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=span) | st.sampled_from(
                [b"{", b"}", b"[", b"]", b",", b":", b'"', b"\\", b"0", b"-", b"e9", b"null"]
            ))  # fmt: skip
        else:
            data[pos:pos] = data[pos : pos + span]
    return bytes(data)


def _paths(value: object, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def value_mutations(draw: Any, doc: Any) -> Any:
    """The JSON document with one sub-value replaced, one key dropped or one key added."""
    doc = json.loads(json.dumps(doc))
    path = draw(st.sampled_from(_paths(doc)[1:]))
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    op = draw(st.sampled_from(["replace", "drop", "add"]))
    if op == "replace":
        parent[path[-1]] = draw(json_values)
    elif op == "drop" and isinstance(parent, dict):
        del parent[path[-1]]
    elif op == "drop":
        parent.pop(path[-1])
    elif isinstance(parent, dict):
        parent[draw(st.sampled_from(_FIELD_NAMES) | st.text(max_size=6))] = draw(json_values)
    else:
        parent.insert(path[-1], draw(json_values))
    return doc


small_rollouts = simulated_rollouts(max_turns=3, max_roots=2)


# ---- manifests ---------------------------------------------------------------------------------


def check_manifest(data: bytes | str, sim: SimulatedRollout | None = None) -> None:
    """Decode, verify, receipt: typed errors only; an accepted mutation must be the original."""
    manifest = typed(decode_manifest, data)
    if manifest is None:
        return
    head = sim.ledger.head if sim is not None else None
    state = typed(verify_manifest, manifest, expected_head=head)
    if state is None:
        return
    for segments in ("terminal", "all"):
        typed(assemble_receipt, state, segments=segments)
    if sim is not None:
        assert encode_manifest(manifest) == encode_manifest(sim.manifest)


@fuzz
@given(st.binary(max_size=2048))
def test_decode_manifest_arbitrary_bytes(data: bytes) -> None:
    check_manifest(data)


@fuzz
@given(json_values)
def test_decode_manifest_arbitrary_json(value: object) -> None:
    check_manifest(dumps(value))


@fuzz
@given(
    st.fixed_dictionaries(
        {
            "format": st.just(MANIFEST_FORMAT) | json_values,
            "rollout_id": st.just("r-1") | json_values,
            "head": st.fixed_dictionaries(
                {"seq": json_values, "hash": st.just(_HASH) | json_values}
            ),
            "entries": st.lists(
                st.fixed_dictionaries(
                    {
                        "seq": st.integers(-1, 4) | json_values,
                        "prev_hash": st.just(_HASH) | json_values,
                        "hash": st.just(_HASH) | json_values,
                        "event": st.dictionaries(
                            st.sampled_from(_FIELD_NAMES), json_values, max_size=10
                        ).flatmap(
                            lambda body: st.sampled_from(_EVENT_TYPES).map(
                                lambda kind: {**body, "type": kind}
                            )
                        ),
                    }
                ),
                max_size=4,
            ),
        }
    )
)
def test_decode_manifest_shaped_json(doc: dict[str, Any]) -> None:
    check_manifest(dumps(doc))


@fuzz
@given(st.data())
def test_decode_manifest_byte_mutations(data: st.DataObject) -> None:
    sim = data.draw(small_rollouts)
    check_manifest(data.draw(byte_mutations(encode_manifest(sim.manifest))), sim)


@fuzz
@given(st.data())
def test_decode_manifest_value_mutations(data: st.DataObject) -> None:
    sim = data.draw(small_rollouts)
    doc = json.loads(encode_manifest(sim.manifest))
    check_manifest(dumps(data.draw(value_mutations(doc))), sim)


def test_decode_manifest_deep_nesting_and_size_bound() -> None:
    for depth in (10, 1_000, 100_000):
        assert typed(decode_manifest, b"[" * depth + b"]" * depth) is None
        assert typed(decode_manifest, b'{"a":' * depth + b"0" + b"}" * depth) is None
    assert typed(decode_manifest, b" " * (MAX_MANIFEST_BYTES + 1)) is None


# ---- staged calls --------------------------------------------------------------------------


def check_staged_doc(data: bytes | str, sim: SimulatedRollout | None = None) -> None:
    """Decode rows, then verify and reassemble against the untampered receipt when given."""
    calls = typed(decode_staged_calls, data)
    if calls is None or sim is None:
        return
    receipt = assemble_receipt(verify_manifest(sim.manifest), segments="all")
    rows = {c.key: c for c in calls}
    verified = typed(verify_staged, receipt, rows)
    built = typed(reassemble, receipt, rows, max_seq_len=1 << 20)
    assert (verified is None) == (built is None), "verify_staged and reassemble disagree"
    if built is not None:
        expected = reassemble(receipt, sim.staged, max_seq_len=1 << 20)
        assert built == expected
        for segment in verified or []:
            for call in segment:
                assert staged_to_json(call) == staged_to_json(sim.staged[call.key])


@fuzz
@given(st.binary(max_size=2048) | st.text(max_size=512).map(str))
def test_decode_staged_calls_arbitrary_input(data: bytes | str) -> None:
    check_staged_doc(data)


@fuzz
@given(json_values)
def test_staged_from_json_arbitrary_json(value: object) -> None:
    typed(staged_from_json, value)
    typed(decode_staged_calls, dumps({"format": STAGED_FORMAT, "calls": [value]}))


@fuzz
@given(st.data())
def test_staged_from_json_field_mutations(data: st.DataObject) -> None:
    sim = data.draw(simulated_rollouts(max_turns=2, max_roots=1))
    call: StagedCall = data.draw(st.sampled_from(sim.calls))
    obj = staged_to_json(call)
    obj[data.draw(st.sampled_from(sorted(obj)))] = data.draw(json_values)
    decoded = typed(staged_from_json, obj)
    if decoded is not None and staged_to_json(decoded) != staged_to_json(call):
        receipt = assemble_receipt(verify_manifest(sim.manifest), segments="all")
        rows = {**sim.staged, call.key: decoded}
        assert typed(verify_staged, receipt, rows) is None, "a changed row was accepted"
        assert typed(reassemble, receipt, rows, max_seq_len=1 << 20) is None


@fuzz
@given(st.data())
def test_decode_staged_calls_mutations(data: st.DataObject) -> None:
    sim = data.draw(simulated_rollouts(max_turns=2, max_roots=2))
    original = encode_staged_calls(sim.calls)
    if data.draw(st.booleans()):
        mutated = data.draw(byte_mutations(original))
    else:
        mutated = dumps(data.draw(value_mutations(json.loads(original))))
    check_staged_doc(mutated, sim)


# ---- routes ------------------------------------------------------------------------------------


def check_envelope(envelope: object) -> None:
    routes = typed(decode_routes, envelope)  # type: ignore[arg-type]
    if routes is not None:
        assert encode_routes(routes) == envelope, "an envelope has exactly one accepted spelling"


@fuzz
@given(
    st.text(max_size=200)
    | st.from_regex(
        r"nrlre1:(int8|int16|int32|int64|uint8|)?:[0-9x]{0,14}:[A-Za-z0-9+/=]{0,48}",
        fullmatch=True,
    )
    | st.binary(max_size=32)
    | st.integers()
    | st.none()
)
def test_decode_routes_arbitrary_text(envelope: object) -> None:
    check_envelope(envelope)


@fuzz
@given(st.data())
def test_decode_routes_mutations(data: st.DataObject) -> None:
    sim = data.draw(simulated_rollouts(max_turns=2, max_roots=1, routes=True))
    call = data.draw(st.sampled_from(sim.calls))
    assert call.routes is not None
    envelope = encode_routes(call.routes)
    mutated = data.draw(byte_mutations(envelope.encode("ascii")))
    check_envelope(mutated.decode("latin-1"))
    check_envelope(mutated.decode("utf-8", errors="surrogateescape"))


def test_decode_routes_huge_declared_shapes_are_bounded() -> None:
    for shape in ("9999999999999999999x1x1", "1x9999999999999999999x9999999999999999999"):
        assert typed(decode_routes, f"{ENVELOPE_PREFIX}:int32:{shape}:AAAA") is None


def test_fixture_rollout_is_clean() -> None:
    """The harness itself: a valid rollout passes every check above unchanged."""
    sim = simulate_rollout("fz-1", seed=3, turns=3, roots=2, offchain_failures=1, routes=True)
    check_manifest(encode_manifest(sim.manifest), sim)
    check_staged_doc(encode_staged_calls(sim.calls), sim)
    for call in sim.calls:
        assert call.routes is not None
        check_envelope(encode_routes(call.routes))
