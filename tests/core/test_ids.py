"""Ids: the rollout id grammar, gate-minted call ids, and staging keys."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokcap_core import InvalidId, TokcapError
from tokcap_core.ids import (
    call_id_for,
    parse_staging_key,
    staging_key,
    validate_call_id,
    validate_rollout_id,
)
from tokcap_core.testing import rollout_ids


@pytest.mark.parametrize(
    "rollout_id",
    ["a", "0", "R.1_x-2", "run-7.attempt_3", "A" * 128, "a" + "._-" * 42 + "z"],
)
def test_valid_rollout_ids_are_returned_unchanged(rollout_id: str) -> None:
    assert validate_rollout_id(rollout_id) is rollout_id


@pytest.mark.parametrize(
    "rollout_id",
    [
        "",
        "A" * 129,
        ".hidden",
        "-dash",
        "_under",
        "has space",
        "slash/inside",
        "colon:inside",
        "abc\n",
        "\nabc",
        "tab\tinside",
        "ünïcode",
        "٣",  # a non-ASCII digit
        None,
        7,
        b"abc",
    ],
)
def test_invalid_rollout_ids_raise_bad_rollout_id(rollout_id: object) -> None:
    with pytest.raises(InvalidId) as info:
        validate_rollout_id(rollout_id)
    assert info.value.code == "bad_rollout_id"


def test_rollout_id_is_at_most_128_characters() -> None:
    assert validate_rollout_id("x" * 128) == "x" * 128
    with pytest.raises(InvalidId):
        validate_rollout_id("x" * 129)


def test_rollout_id_with_trailing_newline_is_rejected() -> None:
    # `$` in a Python regex matches before a final newline; the grammar must not.
    with pytest.raises(InvalidId):
        validate_rollout_id("rollout-1\n")


@pytest.mark.parametrize(
    ("seq", "call_id"), [(1, "c000001"), (42, "c000042"), (999_999, "c999999"), (10**6, "c1000000")]
)
def test_call_ids_are_minted_from_a_one_based_sequence(seq: int, call_id: str) -> None:
    assert call_id_for(seq) == call_id
    assert validate_call_id(call_id) == call_id


@pytest.mark.parametrize("seq", [0, -1, 10**12, True, 1.0, "1"])
def test_call_sequence_numbers_out_of_range_raise_bad_call_seq(seq: object) -> None:
    with pytest.raises(InvalidId) as info:
        call_id_for(seq)  # type: ignore[arg-type]
    assert info.value.code == "bad_call_seq"


@pytest.mark.parametrize(
    "call_id",
    ["", "c", "c1", "c00001", "C000001", "x000001", "c000001\n", "c0000000000001", None, 1],
)
def test_invalid_call_ids_raise_bad_call_id(call_id: object) -> None:
    with pytest.raises(InvalidId) as info:
        validate_call_id(call_id)
    assert info.value.code == "bad_call_id"


def test_staging_key_is_rollout_slash_call() -> None:
    assert staging_key("run-1", "c000003") == "run-1/c000003"


def test_staging_key_validates_both_ids() -> None:
    with pytest.raises(InvalidId) as info:
        staging_key("bad id", "c000001")
    assert info.value.code == "bad_rollout_id"
    with pytest.raises(InvalidId) as info:
        staging_key("run-1", "call-1")
    assert info.value.code == "bad_call_id"


@given(rollout_id=rollout_ids(), seq=st.integers(1, 10**12 - 1))
def test_staging_keys_round_trip(rollout_id: str, seq: int) -> None:
    call_id = call_id_for(seq)
    assert parse_staging_key(staging_key(rollout_id, call_id)) == (rollout_id, call_id)


@pytest.mark.parametrize(
    "key",
    [
        "",
        "run-1",
        "run-1/",
        "/c000001",
        "run-1/c000001/x",
        "run 1/c000001",
        "run-1/c1",
        "run-1/c000001\n",
        5,
    ],
)
def test_malformed_staging_keys_raise_bad_staging_key(key: object) -> None:
    with pytest.raises(InvalidId) as info:
        parse_staging_key(key)
    assert info.value.code == "bad_staging_key"


def test_invalid_id_is_a_picklable_value_error_with_a_code() -> None:
    with pytest.raises(InvalidId) as info:
        validate_rollout_id("")
    error = info.value
    assert isinstance(error, ValueError)
    assert isinstance(error, TokcapError)
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is InvalidId
    assert (clone.code, clone.message) == (error.code, error.message)
