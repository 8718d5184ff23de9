"""Verification of staged calls against a receipt: every mismatch has its own code."""

from __future__ import annotations

import dataclasses
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcap_core import (
    Ledger,
    Receipt,
    StagedCall,
    VerificationError,
    assemble_receipt,
    verify_manifest,
    verify_staged,
)
from tokcap_core.ledger import Closed, Witnesses, chain_hash
from tokcap_core.routes import Routes
from tokcap_core.simulate import SimulatedRollout, simulate_rollout
from tokcap_core.testing import simulated_rollouts

from ._versions import shifted


def receipt_of(sim: SimulatedRollout, segments: str = "all") -> Receipt:
    return assemble_receipt(verify_manifest(sim.manifest), segments=segments)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def sim() -> SimulatedRollout:
    return simulate_rollout("v-1", seed=21, turns=3, roots=2, offchain_failures=1, routes=True)


def tampered(sim: SimulatedRollout, index: int, **change: object) -> dict[str, StagedCall]:
    """The rollout's staged calls with the ``index``-th on-chain call altered."""
    receipt = receipt_of(sim)
    key = [link.staging_key for seg in receipt.segments for link in seg][index]
    staged = dict(sim.staged)
    staged[key] = dataclasses.replace(staged[key], **change)  # type: ignore[arg-type]
    return staged


def assert_code(sim: SimulatedRollout, staged: object, code: str) -> None:
    with pytest.raises(VerificationError) as info:
        verify_staged(receipt_of(sim), staged)  # type: ignore[arg-type]
    assert info.value.code == code


@settings(max_examples=30, deadline=None)
@given(sim=simulated_rollouts())
def test_staged_calls_of_a_simulated_rollout_verify(sim: SimulatedRollout) -> None:
    receipt = receipt_of(sim)
    assert receipt.ok
    segments = verify_staged(receipt, sim.staged)
    assert [[c.key for c in seg] for seg in segments] == [
        [link.staging_key for link in seg] for seg in receipt.segments
    ]
    assert verify_staged(receipt, sim.calls) == segments  # an iterable works as well as a mapping


def test_a_poisoned_receipt_cannot_be_verified() -> None:
    ledger = Ledger("p")
    ledger.append(Closed(reward=None, witnesses=Witnesses()))
    with pytest.raises(VerificationError) as info:
        verify_staged(assemble_receipt(ledger.state), {})
    assert info.value.code == "receipt_poisoned"


def test_a_missing_call_is_reported(sim: SimulatedRollout) -> None:
    staged = dict(sim.staged)
    del staged[receipt_of(sim).segments[0][-1].staging_key]
    assert_code(sim, staged, "missing_call")


def test_a_call_of_another_rollout_under_the_right_key_is_an_identity_mismatch(
    sim: SimulatedRollout,
) -> None:
    other = simulate_rollout("v-2", seed=21, turns=3, roots=2, offchain_failures=1, routes=True)
    key = receipt_of(sim).segments[0][0].staging_key
    swapped = dict(sim.staged)
    swapped[key] = other.staged[key.replace("v-1/", "v-2/")]
    assert_code(sim, swapped, "identity_mismatch")


def test_a_call_under_another_calls_key_is_an_identity_mismatch(sim: SimulatedRollout) -> None:
    first, second = receipt_of(sim).segments[0][:2]
    swapped = dict(sim.staged)
    swapped[first.staging_key] = sim.staged[second.staging_key]
    assert_code(sim, swapped, "identity_mismatch")


def test_a_different_parent_is_a_parent_mismatch(sim: SimulatedRollout) -> None:
    assert_code(sim, tampered(sim, 1, parent_id="c000099"), "parent_mismatch")


def test_different_lengths_are_a_length_mismatch(sim: SimulatedRollout) -> None:
    call = sim.staged[receipt_of(sim).segments[0][1].staging_key]
    assert_code(sim, tampered(sim, 1, prefix_len=call.prefix_len + 1), "length_mismatch")


@pytest.mark.parametrize("field", ["weight_version", "finish_reason"])
def test_different_metadata_is_a_metadata_mismatch(sim: SimulatedRollout, field: str) -> None:
    call = sim.staged[receipt_of(sim).segments[0][0].staging_key]
    if field == "weight_version":
        staged = dict(sim.staged)
        staged[call.key] = shifted(call, 1)
    else:
        staged = tampered(
            sim, 0, finish_reason="length" if call.finish_reason == "stop" else "stop"
        )
    assert_code(sim, staged, "metadata_mismatch")


def test_a_changed_token_is_a_digest_mismatch_even_with_the_claimed_digest_intact(
    sim: SimulatedRollout,
) -> None:
    call = sim.staged[receipt_of(sim).segments[0][0].staging_key]
    tokens = array("I", call.tokens)
    tokens[0] ^= 1
    assert_code(sim, tampered(sim, 0, tokens=tokens), "digest_mismatch")


def test_a_changed_claimed_digest_is_a_digest_mismatch(sim: SimulatedRollout) -> None:
    assert_code(sim, tampered(sim, 0, digest="00" * 32), "digest_mismatch")


def test_a_changed_chain_hash_is_a_chain_mismatch(sim: SimulatedRollout) -> None:
    assert_code(sim, tampered(sim, 1, chain_hash=chain_hash(None, "00" * 32)), "chain_mismatch")


def test_calls_of_other_rollouts_in_the_input_are_ignored(sim: SimulatedRollout) -> None:
    other = simulate_rollout("v-2", seed=5, turns=2)
    assert verify_staged(receipt_of(sim), {**sim.staged, **other.staged}) == verify_staged(
        receipt_of(sim), sim.staged
    )


@settings(max_examples=40, deadline=None)
@given(sim=simulated_rollouts(max_turns=4, max_roots=2, routes=True), data=st.data())
def test_altering_any_token_logprob_or_route_of_a_segment_is_caught(
    sim: SimulatedRollout, data: st.DataObject
) -> None:
    receipt = receipt_of(sim)
    links = [link for seg in receipt.segments for link in seg]
    key = data.draw(st.sampled_from(links)).staging_key
    call = sim.staged[key]
    what = data.draw(st.sampled_from(["token", "logprob", "route"]))
    if what == "token":
        tokens = array("I", call.tokens)
        i = data.draw(st.integers(0, len(tokens) - 1))
        tokens[i] = data.draw(st.integers(0, 2**32 - 1).filter(lambda t: t != call.tokens[i]))
        altered = dataclasses.replace(call, tokens=tokens)
    elif what == "logprob":
        logprobs = array("f", call.logprobs)
        i = data.draw(st.integers(0, len(logprobs) - 1))
        logprobs[i] = data.draw(
            st.floats(width=32, max_value=0.0, allow_nan=False).filter(
                lambda x: x != call.logprobs[i]
            )
        )
        altered = dataclasses.replace(call, logprobs=logprobs)
    else:
        assert call.routes is not None
        values = array(call.routes.data.typecode, call.routes.data)
        i = data.draw(st.integers(0, len(values) - 1))
        old = values[i]
        values[i] = data.draw(st.integers(-1, 127).filter(lambda v: v != old))
        altered = dataclasses.replace(
            call, routes=Routes(dtype=call.routes.dtype, shape=call.routes.shape, data=values)
        )
    with pytest.raises(VerificationError) as info:
        verify_staged(receipt, {**sim.staged, key: altered})
    assert info.value.code == "digest_mismatch"


def _with_segments(receipt: Receipt, *segments: tuple[object, ...]) -> Receipt:
    return dataclasses.replace(receipt, segments=segments)  # type: ignore[arg-type]


def test_a_segment_with_a_gap_is_out_of_parent_order(sim: SimulatedRollout) -> None:
    receipt = receipt_of(sim, "terminal")
    chain = receipt.segments[0]
    assert len(chain) == 3
    with pytest.raises(VerificationError) as info:
        verify_staged(_with_segments(receipt, (chain[0], chain[2])), sim.staged)
    assert info.value.code == "parent_order"


def test_an_empty_segment_is_out_of_parent_order(sim: SimulatedRollout) -> None:
    receipt = receipt_of(sim, "terminal")
    with pytest.raises(VerificationError) as info:
        verify_staged(_with_segments(receipt, receipt.segments[0], ()), sim.staged)
    assert info.value.code == "parent_order"


def test_segment_zero_must_end_at_the_terminal(sim: SimulatedRollout) -> None:
    receipt = receipt_of(sim, "terminal")
    with pytest.raises(VerificationError) as info:
        verify_staged(_with_segments(receipt, receipt.segments[0][:-1]), sim.staged)
    assert info.value.code == "terminal_mismatch"
