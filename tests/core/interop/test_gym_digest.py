"""Gym's digests, held to Gym's own published golden vectors (schema 2 and 3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokcap_core.interop import gym

DATA = Path(__file__).parent / "data"


def vectors(schema: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DATA / f"gym_golden_vectors_schema{schema}.json").read_text())
    return doc


@pytest.mark.parametrize("schema", [2, 3])
def test_gyms_published_golden_vectors_pass(schema: int) -> None:
    doc = vectors(schema)
    assert doc["staged_call"]["schema_version"] == schema
    assert gym.assert_gym_golden_vectors(doc) == 2
    assert gym.compute_extras_digest(doc["extras"]) == doc["extras_digest"]
    assert gym.compute_staging_digest(**doc["staged_call"]) == doc["staged_call_digest"]


def test_schema_3_differs_from_2_only_in_the_schema_byte() -> None:
    two, three = vectors(2), vectors(3)
    assert {**two["staged_call"], "schema_version": 3} == three["staged_call"]
    assert two["staged_call_digest"] != three["staged_call_digest"]


@pytest.mark.parametrize("schema", [2, 3])
def test_every_changed_input_changes_or_refuses_the_digest(schema: int) -> None:
    doc = vectors(schema)
    call, expected = doc["staged_call"], doc["staged_call_digest"]
    changes = {
        "rollout_id": "rollout-2",
        "model_call_id": "call-2",
        "parent_call_id": "parent-2",
        "prev_len": 4,
        "cum_len": 6,
        "weight_version": 8,
        "token_ids_delta": [10, 12],
        "token_mask_delta": [1.0, 1.0],
        "generation_log_probs_delta": [0.0, -0.5],
        "extras_digest": gym.EMPTY_EXTRAS_DIGEST,
        "chain_hash": "3" * 64,
        "cumulative_hash": "4" * 64,
    }
    for name, value in changes.items():
        try:
            digest = gym.compute_staging_digest(**{**call, name: value})
        except gym.GymFormatError:
            continue  # refused: also a detection
        assert digest != expected, name
    with pytest.raises(gym.GymFormatError, match="golden_mismatch"):
        gym.assert_gym_golden_vectors({**doc, "staged_call_digest": "0" * 64})
    with pytest.raises(gym.GymFormatError, match="golden_mismatch"):
        gym.assert_gym_golden_vectors({**doc, "extras": {}})


def test_documented_constants() -> None:
    assert (
        gym.hash_token_ids([]) == "17088fc6f8fd317bf02bd83e106f7ca2dfb7b9cfc63927c2387d4c87f29578ef"
    )
    assert (
        gym.EMPTY_EXTRAS_DIGEST
        == "a1edc33c107616cf344faf0103daa025cfb125f8e1c784ae5f6a49faf2b768b6"
    )
    assert gym.encode_token_ids([1]) != gym.encode_token_ids([1, 0])
    assert gym.encode_token_ids([2**64 - 1])[-8:] == b"\xff" * 8


def test_token_ids_are_big_endian_u64_and_floats_f32_with_signed_zero() -> None:
    assert gym.encode_token_ids([1]) == (1).to_bytes(8, "big") * 2
    call = vectors(2)["staged_call"]
    plus = gym.compute_staging_digest(**call)
    minus = gym.compute_staging_digest(**{**call, "generation_log_probs_delta": [-0.0, -0.25]})
    assert plus != minus  # -0.0 is a different float32 bit pattern
    for bad in ([2**64], [-1], [True]):
        with pytest.raises(gym.GymFormatError):
            gym.encode_token_ids(bad)


@pytest.mark.parametrize(
    ("name", "value", "code"),
    [
        ("schema_version", 1, "unsupported_schema"),
        ("digest_version", 1, "unsupported_digest"),
        ("extras_digest_version", 2, "unsupported_extras_digest"),
        ("mode", "text", "root_child_mismatch"),
        ("parent_call_id", None, "root_child_mismatch"),
        ("delta_len", 3, "length_mismatch"),
        ("token_mask_delta", [0.5, 1.0], "bad_mask"),
        ("generation_log_probs_delta", [-0.1, -0.25], "carry_logprob"),
        ("generation_log_probs_delta", [0.0, 1], "wrong_type"),
        ("generation_log_probs_delta", [0.0, 1e300], "out_of_range"),
        ("chain_hash", "A" * 64, "bad_hex"),
        ("rollout_id", "", "empty_identifier"),
        ("prev_len", -1, "out_of_range"),
    ],
)
def test_gym_preconditions_are_typed_refusals(name: str, value: Any, code: str) -> None:
    with pytest.raises(gym.GymFormatError) as info:
        gym.compute_staging_digest(**{**vectors(2)["staged_call"], name: value})
    assert info.value.code == code


scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=5)
    | st.floats(allow_nan=False, allow_infinity=False)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@given(st.dictionaries(st.text(max_size=6), json_values, max_size=5))
def test_the_extras_digest_ignores_key_order(extras: dict[str, Any]) -> None:
    reordered = dict(reversed(list(extras.items())))
    assert gym.compute_extras_digest(extras) == gym.compute_extras_digest(reordered)


@pytest.mark.parametrize("bad", [{"a": (1,)}, {"a": b"x"}, {"a": 2**63}, {"a": float("nan")}])
def test_extras_refuse_what_gym_refuses(bad: dict[str, Any]) -> None:
    with pytest.raises(gym.GymFormatError) as info:
        gym.compute_extras_digest(bad)
    assert info.value.code == "bad_extras"


def test_chain_hash_marks_roots_and_binds_the_parent() -> None:
    root = gym.compute_chain_hash(None, [1, 2])
    assert root != gym.compute_chain_hash("0" * 64, [1, 2])
    assert gym.compute_chain_hash(root, [3]) != gym.compute_chain_hash(None, [3])
    with pytest.raises(gym.GymFormatError):
        gym.compute_chain_hash("zz", [3])
