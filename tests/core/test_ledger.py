"""The custody ledger: its transition table, guards, replay, and tamper evidence of manifests."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokcap_core import (
    Entry,
    Ledger,
    LedgerProtocolError,
    Manifest,
    VerificationError,
    decode_manifest,
    verify_manifest,
)
from tokcap_core.errors import ManifestError
from tokcap_core.ids import call_id_for
from tokcap_core.ledger import (
    ADMITTED,
    CLOSED,
    FAILED,
    FORMATIONS,
    OPEN,
    STAGED,
    Admitted,
    CallState,
    Closed,
    Event,
    Failed,
    Poisoned,
    RolloutState,
    RolloutStatus,
    Staged,
    TerminalDeclared,
    apply,
    chain_hash,
    encode_manifest,
    entry_hash,
    genesis_hash,
    manifest_of,
    replay,
)
from tokcap_core.simulate import SimulatedRollout, simulate_rollout
from tokcap_core.testing import simulated_rollouts

C1, C2, C3 = call_id_for(1), call_id_for(2), call_id_for(3)
DIGEST = "d1" * 32


def admit(call_id: str, parent_id: str | None = None, prefix_len: int = 0) -> Admitted:
    return Admitted(
        call_id=call_id,
        parent_id=parent_id,
        prefix_len=prefix_len,
        admitted_at=1,
        request_fingerprint="req",
        formation="root" if parent_id is None else "extend",
    )


def stage(
    call_id: str,
    *,
    parent_chain: str | None = None,
    digest: str = DIGEST,
    carry_len: int = 2,
    gen_len: int = 3,
    response_id: str | None = None,
) -> Staged:
    return Staged(
        call_id=call_id,
        carry_len=carry_len,
        gen_len=gen_len,
        weight_version=0,
        weight_version_last=0,
        finish_reason="stop",
        call_digest=digest,
        chain_hash=chain_hash(parent_chain, digest),
        response_id=response_id,
    )


def snapshot(state: RolloutState) -> dict[str, Any]:
    """Every field of a state, with the calls mapping copied (so later mutation would show)."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(state)}
    fields["calls"] = dict(state.calls)
    return fields


def assert_refused(ledger: Ledger, event: Event, code: str) -> None:
    """``event`` is illegal now: `apply` and `Ledger.append` raise ``code`` and change nothing."""
    state = ledger.state
    before = snapshot(state)
    entries, head = ledger.entries, ledger.head
    with pytest.raises(LedgerProtocolError) as info:
        apply(state, event)
    assert info.value.code == code
    assert snapshot(state) == before
    with pytest.raises(LedgerProtocolError) as info:
        ledger.append(event)
    assert info.value.code == code
    assert ledger.entries == entries
    assert ledger.head == head
    assert snapshot(ledger.state) == before


# ---- the transition table ----------------------------------------------------------------

CALL_STATES: dict[str, CallState | None] = {
    "absent": None,
    "ADMITTED": ADMITTED,
    "STAGED": STAGED,
    "FAILED": FAILED,
}

EVENTS: dict[str, Callable[[], Event]] = {
    "Admitted": lambda: admit(C1),
    "Staged": lambda: stage(C1),
    "Failed": lambda: Failed(call_id=C1, reason="engine_failed", served=False),
    "TerminalDeclared": lambda: TerminalDeclared(by="call_id", value=C1),
    "Closed": lambda: Closed(reward=1.0),
    "Poisoned": lambda: Poisoned(reason="gate_restarted"),
}

# {call state of c000001: {event: next call state, or the refusal code}} while the rollout is OPEN.
OPEN_TABLE: dict[str, dict[str, str]] = {
    "absent": {"Admitted": "ADMITTED", "Staged": "unknown_call", "Failed": "unknown_call"},
    "ADMITTED": {"Admitted": "duplicate_call", "Staged": "STAGED", "Failed": "FAILED"},
    "STAGED": {
        "Admitted": "duplicate_call",
        "Staged": "call_already_final",
        "Failed": "call_already_final",
    },
    "FAILED": {
        "Admitted": "duplicate_call",
        "Staged": "call_already_final",
        "Failed": "call_already_final",
    },
}
ROLLOUT_EVENTS = {"TerminalDeclared": OPEN, "Closed": CLOSED, "Poisoned": CLOSED}


def ledger_where_c1_is(call_state: str, status: RolloutStatus) -> Ledger:
    ledger = Ledger("table")
    if call_state != "absent":
        ledger.append(admit(C1))
    if call_state == "STAGED":
        ledger.append(stage(C1))
    if call_state == "FAILED":
        ledger.append(Failed(call_id=C1, reason="engine_failed", served=False))
    if status is CLOSED:
        ledger.append(Closed(reward=None))
    return ledger


@pytest.mark.parametrize("status", [OPEN, CLOSED], ids=repr)
@pytest.mark.parametrize("event_name", list(EVENTS))
@pytest.mark.parametrize("call_state", list(CALL_STATES))
def test_transition_table(call_state: str, event_name: str, status: RolloutStatus) -> None:
    ledger = ledger_where_c1_is(call_state, status)
    event = EVENTS[event_name]()
    if status is CLOSED:
        assert_refused(ledger, event, "rollout_closed")
        return
    expected = OPEN_TABLE[call_state].get(event_name)
    if expected is not None and expected not in CALL_STATES:
        assert_refused(ledger, event, expected)
        return
    state = ledger.state
    before = snapshot(state)
    after = apply(state, event)
    assert snapshot(state) == before  # apply is pure
    next_call = CALL_STATES[expected] if expected is not None else CALL_STATES[call_state]
    assert (after.calls[C1].state if C1 in after.calls else None) is next_call
    assert after.status is ROLLOUT_EVENTS.get(event_name, OPEN)
    assert after.head_seq == state.head_seq + 1
    entry = ledger.append(event)
    assert (entry.seq, entry.prev_hash, entry.hash) == (
        after.head_seq,
        state.head_hash,
        after.head_hash,
    )
    assert snapshot(ledger.state) == snapshot(after)


def test_the_table_covers_every_call_state_and_event() -> None:
    assert set(OPEN_TABLE) == set(CALL_STATES)
    for row in OPEN_TABLE.values():
        assert set(row) | set(ROLLOUT_EVENTS) == set(EVENTS)


def test_poisoned_closes_the_rollout() -> None:
    ledger = Ledger("r")
    ledger.append(Poisoned(reason="gate_restarted"))
    assert ledger.state.status is CLOSED
    assert_refused(ledger, Closed(reward=1.0), "rollout_closed")


def test_an_object_that_is_not_an_event_is_refused() -> None:
    ledger = Ledger("r")
    assert_refused(ledger, object(), "unknown_event")  # type: ignore[arg-type]


# ---- guards -------------------------------------------------------------------------------


def test_child_of_a_never_admitted_parent_is_refused_unknown_parent() -> None:
    assert_refused(Ledger("r"), admit(C1, parent_id=C3, prefix_len=5), "unknown_parent")


def test_child_of_an_admitted_parent_is_refused_parent_not_staged() -> None:
    ledger = Ledger("r")
    ledger.append(admit(C1))
    assert_refused(ledger, admit(C2, parent_id=C1, prefix_len=5), "parent_not_staged")


def test_child_of_a_failed_parent_is_refused_parent_not_staged() -> None:
    ledger = Ledger("r")
    ledger.append(admit(C1))
    ledger.append(Failed(call_id=C1, reason="engine_failed", served=False))
    assert_refused(ledger, admit(C2, parent_id=C1, prefix_len=5), "parent_not_staged")


@pytest.mark.parametrize("prefix_len", [1, 4, 6, 100])
def test_child_must_start_at_its_parents_cumulative_length(prefix_len: int) -> None:
    ledger = Ledger("r")
    ledger.append(admit(C1))
    ledger.append(stage(C1, carry_len=2, gen_len=3))
    assert_refused(ledger, admit(C2, parent_id=C1, prefix_len=prefix_len), "prefix_mismatch")
    ledger.append(admit(C2, parent_id=C1, prefix_len=5))
    assert ledger.state.calls[C2].state is ADMITTED


def test_call_ids_must_follow_the_gates_sequence() -> None:
    ledger = Ledger("r")
    assert_refused(ledger, admit(C2), "call_id_out_of_order")
    ledger.append(admit(C1))
    assert ledger.next_call_id() == C2
    assert_refused(ledger, admit(C3), "call_id_out_of_order")


def test_root_chain_hash_must_link_to_the_zero_hash() -> None:
    ledger = Ledger("r")
    ledger.append(admit(C1))
    assert_refused(ledger, stage(C1, parent_chain="11" * 32), "chain_hash_mismatch")


def test_child_chain_hash_must_link_to_its_parents() -> None:
    ledger = Ledger("r")
    ledger.append(admit(C1))
    parent = stage(C1)
    ledger.append(parent)
    ledger.append(admit(C2, parent_id=C1, prefix_len=5))
    assert_refused(ledger, stage(C2, parent_chain=None, digest="e2" * 32), "chain_hash_mismatch")
    ledger.append(stage(C2, parent_chain=parent.chain_hash, digest="e2" * 32))
    assert ledger.state.calls[C2].state is STAGED


def test_a_response_id_names_one_call_only() -> None:
    ledger = Ledger("r")
    for call_id in (C1, C2):
        ledger.append(admit(call_id))
    ledger.append(stage(C1, response_id="resp-1"))
    assert_refused(ledger, stage(C2, response_id="resp-1"), "duplicate_response_id")


def test_a_response_id_stays_taken_after_rebuilding_from_entries() -> None:
    ledger = Ledger("r")
    for call_id in (C1, C2):
        ledger.append(admit(call_id))
    ledger.append(stage(C1, response_id="resp-1"))
    rebuilt = Ledger.from_entries("r", ledger.entries)
    assert_refused(rebuilt, stage(C2, response_id="resp-1"), "duplicate_response_id")


def test_a_terminal_is_declared_at_most_once() -> None:
    ledger = Ledger("r")
    ledger.append(TerminalDeclared(by="call_id", value=C1))
    assert_refused(
        ledger, TerminalDeclared(by="response_id", value="resp-9"), "terminal_already_declared"
    )


ROOT_ADMITTED, CHILD_ADMITTED = admit(C1), admit(C2, C1, prefix_len=3)


@pytest.mark.parametrize(
    "make",
    [
        lambda: dataclasses.replace(ROOT_ADMITTED, prefix_len=3),
        lambda: dataclasses.replace(CHILD_ADMITTED, prefix_len=0),
        lambda: dataclasses.replace(CHILD_ADMITTED, break_cause="history_rewritten"),
        lambda: dataclasses.replace(ROOT_ADMITTED, break_cause="whim"),
        lambda: dataclasses.replace(ROOT_ADMITTED, admitted_at=-1),
        lambda: dataclasses.replace(ROOT_ADMITTED, request_fingerprint=""),
        lambda: dataclasses.replace(ROOT_ADMITTED, request_fingerprint="x" * 257),
        lambda: dataclasses.replace(ROOT_ADMITTED, request_fingerprint="tab\t"),
        lambda: dataclasses.replace(stage(C1), gen_len=0),
        lambda: dataclasses.replace(stage(C1), finish_reason="abort"),
        lambda: dataclasses.replace(stage(C1), call_digest="D1" * 32),
        lambda: Failed(call_id=C1, reason="x", served=1),  # type: ignore[arg-type]
        lambda: TerminalDeclared(by="index", value="1"),  # type: ignore[arg-type]
        lambda: Closed(reward=float("nan")),
        lambda: Closed(reward=float("inf")),
        lambda: Closed(reward=True),
        lambda: Poisoned(reason=""),
    ],
)
def test_events_validate_their_own_fields(make: Callable[[], Event]) -> None:
    with pytest.raises(LedgerProtocolError) as info:
        make()
    assert info.value.code == "bad_event_field"


# (parent_id, formation, break_cause, splice_cause): how an Admitted records its prompt
FORMATIONS_ALLOWED = [
    (None, "root", None, None),
    (None, "root", "history_rewritten", None),
    (C1, "extend", None, None),
    (C1, "splice", None, "special_tokens"),
    (C1, "splice", None, "tool_call_format"),
]
FORMATIONS_REFUSED = [
    (None, "extend", None, None),  # a root is formed as a root
    (None, "splice", None, "whitespace"),
    (C1, "root", None, None),  # a child is not a root
    (C1, "splice", None, None),  # a splice says why
    (C1, "extend", None, "whitespace"),  # only a splice has a splice cause
    (None, "root", None, "whitespace"),
    (C1, "splice", None, "made_up"),  # causes are a closed set
    (C1, "splice", "history_rewritten", "whitespace"),  # a child never breaks
    (C1, "grafted", None, None),
]


def _formed(parent: str | None, formation: str, broke: str | None, spliced: str | None) -> Admitted:
    return Admitted(
        call_id=C2,
        parent_id=parent,
        prefix_len=3 if parent else 0,
        admitted_at=0,
        request_fingerprint="f",
        formation=formation,
        break_cause=broke,
        splice_cause=spliced,
    )


@pytest.mark.parametrize(("parent", "formation", "broke", "spliced"), FORMATIONS_ALLOWED)
def test_admitted_records_how_the_prompt_was_formed(
    parent: str | None, formation: str, broke: str | None, spliced: str | None
) -> None:
    event = _formed(parent, formation, broke, spliced)
    assert (event.formation, event.splice_cause) == (formation, spliced)
    assert event.formation in FORMATIONS


@pytest.mark.parametrize(("parent", "formation", "broke", "spliced"), FORMATIONS_REFUSED)
def test_a_formation_that_contradicts_the_parent_or_causes_is_refused(
    parent: str | None, formation: str, broke: str | None, spliced: str | None
) -> None:
    with pytest.raises(LedgerProtocolError) as info:
        _formed(parent, formation, broke, spliced)
    assert info.value.code == "bad_event_field"


def test_formation_and_versions_are_hashed_into_the_entry() -> None:
    extend = admit(C2, C1, 3)
    splice = dataclasses.replace(extend, formation="splice", splice_cause="whitespace")
    other = dataclasses.replace(splice, splice_cause="invalid_utf8")
    prev = "ab" * 32
    assert len({entry_hash(prev, e) for e in (extend, splice, other)}) == 3
    staged = stage(C1)
    pushed = dataclasses.replace(staged, weight_version_last=staged.weight_version + 1)
    assert entry_hash(prev, staged) != entry_hash(prev, pushed)


# ---- replay -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(rollout=simulated_rollouts())
def test_replaying_a_history_reproduces_the_ledger_state(rollout: SimulatedRollout) -> None:
    ledger = rollout.ledger
    assert snapshot(replay(ledger.rollout_id, ledger.entries)) == snapshot(ledger.state)
    assert snapshot(Ledger.from_entries(ledger.rollout_id, ledger.entries).state) == snapshot(
        ledger.state
    )


def test_replay_refuses_an_illegal_event_even_with_correct_hashes() -> None:
    ledger = Ledger("r")
    ledger.append(Closed(reward=None))
    late = admit(C1)
    forged = Entry(
        seq=2, event=late, prev_hash=ledger.head[1], hash=entry_hash(ledger.head[1], late)
    )
    with pytest.raises(VerificationError) as info:
        replay("r", [*ledger.entries, forged])
    assert info.value.code == "illegal_event:rollout_closed"


def test_an_empty_ledger_has_its_head_at_genesis() -> None:
    ledger = Ledger("r")
    assert ledger.head == (0, genesis_hash("r"))
    assert verify_manifest(manifest_of(ledger)).head == (0, genesis_hash("r"))


# ---- tamper evidence -------------------------------------------------------------------


def _rejected(data: bytes, manifest: Manifest) -> bool:
    """True if ``data`` fails to decode or verify against the head kept at close.

    A change that decodes *and* verifies must be a mere respelling (e.g. ``1.0`` -> ``1e0``)
    that decodes to exactly the original manifest.
    """
    try:
        decoded = decode_manifest(data)
        verify_manifest(decoded, expected_head=manifest.head)
    except (ManifestError, VerificationError):
        return True
    assert decoded == manifest, "a tampered manifest verified"
    return False


def test_every_single_byte_change_of_a_small_manifest_is_rejected() -> None:
    rollout = simulate_rollout(
        "t",
        seed=3,
        turns=2,
        roots=2,
        offchain_failures=1,
        terminal="content",
        reward=0.5,
        max_delta=2,
    )
    manifest = rollout.manifest
    data = encode_manifest(manifest)
    kinds = {type(e.event) for e in manifest.entries}
    assert {Admitted, Staged, Failed, Closed} <= kinds
    for position in range(len(data)):
        for flip in (0x01, 0x20):
            tampered = bytearray(data)
            tampered[position] ^= flip
            assert _rejected(bytes(tampered), manifest), f"byte {position} ^ {flip:#x} was accepted"


@settings(max_examples=50, deadline=None)
@given(rollout=simulated_rollouts(max_turns=3, max_roots=2), data=st.data())
def test_a_single_byte_change_anywhere_is_rejected_or_meaningless(
    rollout: SimulatedRollout, data: st.DataObject
) -> None:
    encoded = encode_manifest(rollout.manifest)
    position = data.draw(st.integers(0, len(encoded) - 1))
    replacement = data.draw(st.integers(0, 255).filter(lambda b: b != encoded[position]))
    tampered = bytearray(encoded)
    tampered[position] = replacement
    _rejected(bytes(tampered), rollout.manifest)


def test_a_changed_fingerprint_is_caught_by_the_entry_hash() -> None:
    manifest = simulate_rollout("t", seed=1, turns=2).manifest
    data = encode_manifest(manifest)
    at = data.index(b'"request_fingerprint":"req-') + len(b'"request_fingerprint":"req-')
    tampered = data[:at] + (b"0" if data[at : at + 1] != b"0" else b"1") + data[at + 1 :]
    decoded = decode_manifest(tampered)  # still valid JSON and a valid event
    with pytest.raises(VerificationError) as info:
        verify_manifest(decoded)
    assert info.value.code == "bad_entry_hash"


def _with_entries(manifest: Manifest, entries: list[Entry], *, keep_head: bool = True) -> Manifest:
    head = manifest.head if keep_head else (entries[-1].seq, entries[-1].hash)
    return Manifest(
        rollout_id=manifest.rollout_id, entries=tuple(entries), head_seq=head[0], head_hash=head[1]
    )


@pytest.fixture
def manifest() -> Manifest:
    return simulate_rollout("victim", seed=5, turns=3).manifest


def test_a_dropped_entry_breaks_the_sequence(manifest: Manifest) -> None:
    entries = list(manifest.entries)
    del entries[2]
    with pytest.raises(VerificationError) as info:
        verify_manifest(_with_entries(manifest, entries))
    assert info.value.code == "bad_seq"


def test_swapped_entries_break_the_sequence(manifest: Manifest) -> None:
    entries = list(manifest.entries)
    entries[1], entries[2] = entries[2], entries[1]
    with pytest.raises(VerificationError) as info:
        verify_manifest(_with_entries(manifest, entries))
    assert info.value.code == "bad_seq"


def test_swapped_entries_renumbered_break_the_links(manifest: Manifest) -> None:
    entries = list(manifest.entries)
    entries[1], entries[2] = (
        dataclasses.replace(entries[2], seq=2),
        dataclasses.replace(entries[1], seq=3),
    )
    with pytest.raises(VerificationError) as info:
        verify_manifest(_with_entries(manifest, entries))
    assert info.value.code == "broken_link"


def test_an_edited_event_breaks_its_entry_hash(manifest: Manifest) -> None:
    entries = list(manifest.entries)
    closed = entries[-1].event
    assert isinstance(closed, Closed)
    entries[-1] = dataclasses.replace(entries[-1], event=dataclasses.replace(closed, reward=2.0))
    with pytest.raises(VerificationError) as info:
        verify_manifest(_with_entries(manifest, entries))
    assert info.value.code == "bad_entry_hash"


def test_entries_cannot_move_to_another_rollout(manifest: Manifest) -> None:
    moved = dataclasses.replace(manifest, rollout_id="thief")
    with pytest.raises(VerificationError) as info:
        verify_manifest(moved)
    assert info.value.code == "broken_link"


def test_a_head_that_is_not_the_last_entry_is_rejected(manifest: Manifest) -> None:
    with pytest.raises(VerificationError) as info:
        verify_manifest(_with_entries(manifest, list(manifest.entries[:-1])))
    assert info.value.code == "head_mismatch"


def test_a_shortened_history_is_caught_by_the_head_kept_at_close(manifest: Manifest) -> None:
    shortened = _with_entries(manifest, list(manifest.entries[:-1]), keep_head=False)
    verify_manifest(shortened)  # self-consistent on its own
    with pytest.raises(VerificationError) as info:
        verify_manifest(shortened, expected_head=manifest.head)
    assert info.value.code == "unexpected_head"
    assert verify_manifest(manifest, expected_head=manifest.head).head == manifest.head


@given(simulated_rollouts(max_roots=1))
def test_staged_for_call_commits_exactly_the_calls_coordinates(rollout: SimulatedRollout) -> None:
    call = rollout.calls[-1]
    event = Staged.for_call(call, response_id="resp-1", output_fingerprint="out-1")
    assert (event.call_id, event.carry_len, event.gen_len) == (
        call.call_id,
        call.carry_len,
        call.gen_len,
    )
    assert (event.weight_version, event.weight_version_last, event.finish_reason) == (
        call.weight_version,
        call.weight_version_last,
        call.finish_reason,
    )
    assert (event.call_digest, event.chain_hash) == (call.digest, call.chain_hash)
    assert (event.response_id, event.output_fingerprint) == ("resp-1", "out-1")
    assert Staged.for_call(call).response_id is None
