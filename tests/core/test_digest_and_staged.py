"""Staged calls and their digests: invariants, zero-copy buffers, and what a digest commits to."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import struct
from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcap_core import StagedCall
from tokcap_core.errors import InvalidStagedCall
from tokcap_core.ledger import ZERO_HASH, Admitted, chain_hash, entry_hash, genesis_hash
from tokcap_core.provenance import VersionSpan, single_span
from tokcap_core.routes import Routes, routes_from_rows
from tokcap_core.staged import compute_call_digest, logprob_array, token_array
from tokcap_core.testing import staged_calls

from ._versions import shifted

ROUTE_MAX = {"int8": 2**7 - 1, "int16": 2**15 - 1, "int32": 2**31 - 1}


def _stage(**overrides: Any) -> StagedCall:
    """A small valid child call built from engine output, with some arguments overridden."""
    args: dict[str, Any] = {
        "rollout_id": "run-1",
        "call_id": "c000002",
        "parent_id": "c000001",
        "parent_cum_len": 3,
        "parent_chain_hash": "ab" * 32,
        "prompt_ids": [5, 6, 7, 8, 9],
        "output_ids": [10, 11],
        "logprobs": [-0.5, -1.25],
        "finish_reason": "stop",
        "weight_version": 1,
        "weight_versions": (
            VersionSpan(version=1, start=0, end=1),
            VersionSpan(version=2, start=1, end=2),
        ),
    }
    args.update(overrides)
    return StagedCall.from_engine_output(**args)


def _fields(call: StagedCall) -> dict[str, Any]:
    return {f.name: getattr(call, f.name) for f in dataclasses.fields(call)}


# ---- invariants -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"parent_id": None}, "parent_prefix_mismatch"),  # a root with a prefix
        ({"prefix_len": 0}, "parent_prefix_mismatch"),  # a child with no prefix
        ({"gen_len": 0, "carry_len": 4, "logprobs": array("f")}, "empty_generation"),
        ({"tokens": array("I", [1, 2, 3])}, "token_count_mismatch"),
        ({"logprobs": array("f", [-1.0])}, "logprob_count_mismatch"),
        ({"logprobs": array("f", [-1.0, math.nan])}, "bad_logprobs"),
        ({"logprobs": array("f", [math.inf, -1.0])}, "bad_logprobs"),
        ({"logprobs": array("f", [math.inf, -math.inf])}, "bad_logprobs"),
        ({"logprobs": [-1.0, -2.0]}, "bad_logprobs"),  # a list, not array('f')
        ({"tokens": [5, 6, 10, 11]}, "bad_tokens"),
        ({"finish_reason": "abort"}, "bad_finish_reason"),
        ({"finish_reason": "STOP"}, "bad_finish_reason"),
        ({"digest": "AB" * 32}, "bad_hash"),
        ({"digest": "ab" * 31}, "bad_hash"),
        ({"chain_hash": "zz" * 32}, "bad_hash"),
        ({"carry_len": -1}, "bad_length"),
        ({"weight_version": True}, "bad_length"),
        ({"routes": routes_from_rows([[[1]]] * 4, dtype="int8")}, "route_count_mismatch"),
    ],
)
def test_staged_call_invariants_raise_with_their_code(change: dict[str, Any], code: str) -> None:
    with pytest.raises(InvalidStagedCall) as info:
        dataclasses.replace(_stage(), **change)
    assert info.value.code == code


def test_negative_infinity_logprob_is_allowed() -> None:
    call = dataclasses.replace(_stage(), logprobs=array("f", [-math.inf, -1.0]))
    assert call.logprobs[0] == -math.inf


def test_route_rows_of_a_child_include_the_parents_last_token() -> None:
    # a child carries one route row more than its tokens:
    # the prefill route of the parent's last token
    call = _stage(routes=routes_from_rows([[[i % 4]] for i in range(6)], dtype="int8"))
    assert len(call.tokens) == 4
    assert call.routes is not None
    assert call.routes.shape[0] == call.route_rows == 5
    root = _stage(
        parent_id=None,
        parent_cum_len=0,
        parent_chain_hash=None,
        routes=routes_from_rows([[[1]]] * 6, dtype="int8"),
    )
    assert root.routes is not None
    assert root.routes.shape[0] == root.route_rows == 7


def test_a_root_built_from_engine_output_rejects_a_parent_length() -> None:
    with pytest.raises(InvalidStagedCall) as info:
        _stage(parent_id=None, parent_cum_len=2)
    assert info.value.code == "parent_prefix_mismatch"


def test_engine_routes_of_the_wrong_length_raise_route_count_mismatch() -> None:
    with pytest.raises(InvalidStagedCall) as info:
        _stage(routes=routes_from_rows([[[1]]] * 3, dtype="int8"))
    assert info.value.code == "route_count_mismatch"


# ---- construction from engine output ----------------------------------------------------


def test_from_engine_output_splits_prompt_into_prefix_and_carry() -> None:
    call = _stage()
    assert (call.prefix_len, call.carry_len, call.gen_len) == (3, 2, 2)
    assert call.tokens.tolist() == [8, 9, 10, 11]
    assert bytes(call.generated) == array("I", [10, 11]).tobytes()
    assert call.cum_len == 7
    assert call.key == "run-1/c000002"


def test_from_engine_output_digest_and_chain_hash_are_reproducible() -> None:
    call = _stage(routes=routes_from_rows([[[i % 4, 3]] for i in range(6)], dtype="int16"))
    assert call.compute_digest() == call.digest
    assert call.chain_hash == chain_hash("ab" * 32, call.digest)
    root = _stage(parent_id=None, parent_cum_len=0, parent_chain_hash=None)
    assert root.chain_hash == chain_hash(None, root.compute_digest())


@settings(max_examples=50, deadline=None)
@given(call=staged_calls())
def test_generated_calls_carry_the_digest_they_compute(call: StagedCall) -> None:
    assert call.compute_digest() == call.digest


# ---- zero-copy buffers ------------------------------------------------------------------


def test_token_and_logprob_buffers_are_zero_copy() -> None:
    tokens = array("I", [1, 2, 3])
    logprobs = array("f", [-0.5])
    assert token_array(tokens) is tokens
    assert logprob_array(logprobs) is logprobs
    call = StagedCall(
        rollout_id="r",
        call_id="c000001",
        parent_id=None,
        prefix_len=0,
        carry_len=2,
        gen_len=1,
        weight_version=0,
        weight_version_last=0,
        finish_reason="stop",
        tokens=tokens,
        logprobs=logprobs,
        routes=None,
        digest="00" * 32,
        chain_hash="00" * 32,
    )
    assert call.tokens is tokens
    assert call.logprobs is logprobs
    view = memoryview(call.tokens)
    assert (view.format, view.itemsize, view.tolist()) == ("I", 4, [1, 2, 3])
    assert memoryview(call.logprobs).format == "f"
    assert call.generated.obj is tokens  # a view, not a copy


def test_token_ids_outside_u32_are_rejected() -> None:
    with pytest.raises(InvalidStagedCall) as info:
        token_array([2**32])
    assert info.value.code == "bad_tokens"
    with pytest.raises(InvalidStagedCall) as info:
        token_array([-1])
    assert info.value.code == "bad_tokens"


# ---- what a digest commits to -----------------------------------------------------------


def _other_id(rng: st.DataObject, old: str, pattern: str) -> str:
    return rng.draw(st.from_regex(pattern, fullmatch=True).filter(lambda v: v != old))


def _altered(call: StagedCall, field: str, data: st.DataObject) -> StagedCall | None:
    """``call`` with exactly one field changed, or None where that change cannot be constructed."""
    if field == "token":
        i = data.draw(st.integers(0, len(call.tokens) - 1))
        tokens = array("I", call.tokens)
        tokens[i] = data.draw(st.integers(0, 2**32 - 1).filter(lambda t: t != call.tokens[i]))
        return dataclasses.replace(call, tokens=tokens)
    if field == "logprob":
        i = data.draw(st.integers(0, len(call.logprobs) - 1))
        logprobs = array("f", call.logprobs)
        new = data.draw(
            st.floats(width=32, allow_nan=False, max_value=0.0).filter(
                lambda x: x != call.logprobs[i]
            )
        )
        logprobs[i] = new
        return dataclasses.replace(call, logprobs=logprobs)
    if field == "route":
        if call.routes is None:
            return None
        r = call.routes
        i = data.draw(st.integers(0, len(r.data) - 1))
        values = array(r.data.typecode, r.data)
        values[i] = data.draw(st.integers(-1, ROUTE_MAX[r.dtype]).filter(lambda v: v != r.data[i]))
        return dataclasses.replace(call, routes=Routes(dtype=r.dtype, shape=r.shape, data=values))
    if field == "routes_dropped":
        return None if call.routes is None else dataclasses.replace(call, routes=None)
    if field == "prefix_len":
        if call.parent_id is None:
            return None
        return dataclasses.replace(
            call, prefix_len=data.draw(st.integers(1, 10**6).filter(lambda n: n != call.prefix_len))
        )
    if field == "parent_id":
        if call.parent_id is None:
            return None
        return dataclasses.replace(call, parent_id=_other_id(data, call.parent_id, r"c[0-9]{6}"))
    if field == "weight_version":
        return shifted(call, data.draw(st.integers(1, 5)))
    if field == "kv_versions":
        kv = single_span(call.weight_version, call.gen_len)
        return None if kv == call.kv_versions else dataclasses.replace(call, kv_versions=kv)
    if field == "span_boundary":
        spans = call.weight_versions
        if spans is None or len(spans) < 2 or spans[1].length < 2:
            return None
        a, b = spans[0], spans[1]
        moved = (
            dataclasses.replace(a, end=a.end + 1),
            dataclasses.replace(b, start=b.start + 1),
            *spans[2:],
        )
        return dataclasses.replace(call, weight_versions=moved, kv_versions=moved)
    if field == "finish_reason":
        return dataclasses.replace(
            call, finish_reason="length" if call.finish_reason == "stop" else "stop"
        )
    if field == "rollout_id":
        return dataclasses.replace(
            call, rollout_id=_other_id(data, call.rollout_id, r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}")
        )
    if field == "call_id":
        return dataclasses.replace(call, call_id=_other_id(data, call.call_id, r"c[0-9]{6}"))
    raise AssertionError(field)


ALTERABLE = [
    "token",
    "logprob",
    "route",
    "routes_dropped",
    "prefix_len",
    "parent_id",
    "weight_version",
    "kv_versions",
    "span_boundary",
    "finish_reason",
    "rollout_id",
    "call_id",
]


@settings(max_examples=50, deadline=None)
@given(call=staged_calls(), field=st.sampled_from(ALTERABLE), data=st.data())
def test_altering_any_single_field_changes_the_digest(
    call: StagedCall, field: str, data: st.DataObject
) -> None:
    altered = _altered(call, field, data)
    if altered is None:
        return  # not constructible for this call (e.g. a root has no parent to change)
    assert altered.compute_digest() != call.compute_digest()


@pytest.mark.parametrize("field", ALTERABLE)
def test_each_alteration_is_constructible_for_a_routed_child(field: str) -> None:
    # guards the property above against silently skipping a field on every example
    call = _stage(routes=routes_from_rows([[[1, 2]]] * 6, dtype="int8"))
    if field == "span_boundary":  # a second span of two tokens, so its start can move
        call = _stage(
            output_ids=[10, 11, 12],
            logprobs=[-0.5, -1.25, -2.0],
            routes=routes_from_rows([[[1, 2]]] * 7, dtype="int8"),
            weight_versions=(
                VersionSpan(version=1, start=0, end=1),
                VersionSpan(version=2, start=1, end=3),
            ),
        )

    @settings(max_examples=3, deadline=None)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        altered = _altered(call, field, data)
        assert altered is not None
        assert altered.compute_digest() != call.compute_digest()

    check()


@settings(max_examples=50, deadline=None)
@given(
    call=staged_calls(),
    field=st.sampled_from(["prefix_len", "carry_len", "gen_len"]),
    bump=st.integers(1, 100),
)
def test_call_digest_commits_to_every_length_field(call: StagedCall, field: str, bump: int) -> None:
    # carry_len / gen_len alone are not constructible (len(tokens) pins their sum);
    # the digest still commits to them
    fields = _fields(call)
    del fields["digest"], fields["chain_hash"]
    fields[field] += bump
    assert compute_call_digest(**fields) != call.digest


def test_moving_the_prompt_generation_boundary_changes_the_digest() -> None:
    call = _stage(weight_versions=None, weight_version_last=None)
    spans = single_span(1, 1)
    moved = dataclasses.replace(
        call,
        carry_len=call.carry_len + 1,
        gen_len=call.gen_len - 1,
        logprobs=call.logprobs[1:],
        weight_versions=spans,
        kv_versions=spans,
    )
    assert moved.tokens == call.tokens
    assert moved.compute_digest() != call.digest


def test_tokens_and_logprobs_cannot_trade_elements() -> None:
    # u64 element counts separate adjacent buffers
    base = _stage(output_ids=[1], logprobs=[-1.0], prompt_ids=[0, 0, 0, 2], weight_versions=None)
    fields = _fields(base)
    del fields["digest"], fields["chain_hash"]
    shifted = dict(fields, tokens=array("I", [2]), carry_len=0, gen_len=1)
    assert compute_call_digest(**shifted) != compute_call_digest(**fields)


# ---- canonical bytes and domain separation ----------------------------------------------


def _h(domain: bytes, *parts: bytes) -> str:
    return hashlib.sha256(struct.pack("<Q", len(domain)) + domain + b"".join(parts)).hexdigest()


def _text(value: str) -> bytes:
    data = value.encode()
    return struct.pack("<Q", len(data)) + data


def test_chain_hash_is_the_documented_hash_over_parent_and_digest() -> None:
    digest = "11" * 32
    assert chain_hash(None, digest) == _h(b"tokcap/chain/v1", bytes(32), bytes.fromhex(digest))
    assert chain_hash(ZERO_HASH, digest) == chain_hash(None, digest)
    assert chain_hash("22" * 32, digest) == _h(
        b"tokcap/chain/v1", bytes.fromhex("22" * 32), bytes.fromhex(digest)
    )


def test_genesis_hash_is_bound_to_the_rollout_id() -> None:
    assert genesis_hash("run-1") == _h(b"tokcap/genesis/v1", _text("run-1"))
    assert genesis_hash("run-1") != genesis_hash("run-2")


def test_call_digest_is_the_documented_canonical_encoding() -> None:
    call = _stage(routes=routes_from_rows([[[1, 2]]] * 6, dtype="int16"))
    assert call.routes is not None
    u64 = struct.Struct("<Q").pack
    expected = _h(
        b"tokcap/call/v3",
        _text("run-1"),
        _text("c000002"),
        b"\x01" + _text("c000001"),
        u64(3), u64(2), u64(2), u64(1), u64(2),
        _text("stop"),
        u64(4) + struct.pack("<4I", 8, 9, 10, 11),
        u64(2) + struct.pack("<2f", -0.5, -1.25),
        u64(1) + _text("int16") + u64(5) + u64(1) + u64(2),
        # rows 2..6 of the aligned engine routes: four reported rows, then the unreported last token
        u64(10) + struct.pack("<10h", *([1, 2] * 4), -1, -1),
        # format v3: weight spans, then KV spans, each a count and (version, start, end)s
        u64(2) + u64(1) + u64(0) + u64(1) + u64(2) + u64(1) + u64(2),
        u64(2) + u64(1) + u64(0) + u64(1) + u64(2) + u64(1) + u64(2),
    )  # fmt: skip
    assert call.digest == expected
    v2 = dataclasses.replace(call, weight_versions=None, kv_versions=None)
    assert v2.compute_digest() == _h(
        b"tokcap/call/v2", *_v2_parts(call)
    )  # a stored format v2 call hashes as it always did


def _v2_parts(call: StagedCall) -> list[bytes]:
    u64 = struct.Struct("<Q").pack
    assert call.routes is not None
    return [
        _text(call.rollout_id), _text(call.call_id), b"\x01" + _text(call.parent_id or ""),
        u64(call.prefix_len), u64(call.carry_len), u64(call.gen_len),
        u64(call.weight_version), u64(call.weight_version_last), _text(call.finish_reason),
        u64(len(call.tokens)) + call.tokens.tobytes(),
        u64(len(call.logprobs)) + call.logprobs.tobytes(),
        u64(1) + _text(call.routes.dtype) + b"".join(u64(d) for d in call.routes.shape),
        u64(len(call.routes.data)) + call.routes.data.tobytes(),
    ]  # fmt: skip


def test_digest_domains_are_separated() -> None:
    # the same 64 payload bytes hashed as a chain link, a ledger link and a genesis
    # differ by their domain alone
    payload = bytes(32) + bytes.fromhex("11" * 32)
    link = chain_hash(None, "11" * 32)
    assert link == _h(b"tokcap/chain/v1", payload)
    assert link != _h(b"tokcap/call/v2", payload)
    assert link != _h(b"tokcap/ledger/v2", payload)
    assert link != _h(b"tokcap/genesis/v1", payload)
    event = Admitted(
        call_id="c000001",
        parent_id=None,
        prefix_len=0,
        admitted_at=0,
        request_fingerprint="f",
        formation="root",
    )
    expected_entry = _h(
        b"tokcap/ledger/v2", bytes(32), _text("admitted"), _text("c000001"), b"\x00",
        struct.pack("<QQ", 0, 0), _text("f"), _text("root"), b"\x00", b"\x00",
    )  # fmt: skip
    assert entry_hash(ZERO_HASH, event) == expected_entry
    assert len({link, expected_entry, genesis_hash("r"), _stage().digest}) == 4
