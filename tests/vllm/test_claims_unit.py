"""What a call holds in its rollout and what its leaving frees, with no engine.

A call holds its idempotency key and its request id from its claim until it is dropped or
abandoned; leaving frees only what it holds itself. A retry under a held key is answered
again when the holder committed with a recorded answer, waits while the holder runs, and
takes the key over once the holder left without one (dropped, abandoned); a holder that
failed after its answer left its rollout UNCAPTURED, so the retry is refused
(``rollout_poisoned``). An abandoned call's flag is set, so the driver ends its request;
when vLLM's handler returns, a call still in flight is abandoned, and one abandoned before
ends its response ``rollout_closed``.
An OPEN rollout none of whose calls was served is forgotten when vLLM refuses a call of
it; one with a committed call is kept, and so is one a served call failed in (that
failure left it UNCAPTURED).
"""

from __future__ import annotations

import pytest

from tests.vllm._rules import REQUEST, Flag, NoLock, plan, result
from tokcap_core import Entry
from tokcap_core.ledger import Failed, Staged
from tokcap_vllm.errors import RolloutConflict, RolloutNotFound
from tokcap_vllm.gate._lifecycle import Holder
from tokcap_vllm.gate._planning import Observed, ParentIndex
from tokcap_vllm.gate._records import FINISHED, RESPONDED, GateCall
from tokcap_vllm.gate._rollouts import OPEN, UNCAPTURED, RolloutBook
from tokcap_vllm.gate._staging import staged_call

ANSWER = ({"type": "http.response.start", "status": 200}, [b"{}"])


def _book() -> RolloutBook:
    return RolloutBook(max_open=4, flag=Flag, lock=NoLock)


def _call(
    book: RolloutBook,
    rollout_id: str,
    *,
    idempotency_key: str | None = None,
    request_id: str | None = None,
) -> GateCall:
    """A call of ``rollout_id`` received with its claims (not claimed yet)."""
    return book.call_received(
        rollout_id,
        kind="chat",
        idempotency_key=idempotency_key,
        body_fingerprint="b",
        request_id=request_id,
    )


def _claimed(book: RolloutBook, rollout_id: str, **claims: str) -> GateCall:
    """A call of ``rollout_id`` received with its claims and holding them (none was held)."""
    call = _call(book, rollout_id, **claims)
    assert book.call_claimed(call) is None
    return call


def _admit(book: RolloutBook, call: GateCall) -> GateCall:
    """Plan ``call`` as a root: the book appends its ``Admitted`` entry."""
    book.call_planning(call, REQUEST)
    assert isinstance(book.call_planned(call, plan(), admitted_at=1, unserved=None), Entry)
    return call


def _respond(book: RolloutBook, call: GateCall) -> GateCall:
    """The engine finishes ``call``, its row is staged, and the harness gets the whole
    response, recorded (``ANSWER``) for a retry under its key."""
    assert book.call_finished(call, result())
    call.staged = staged_call(call, result(), False)
    seen = Observed(f"resp-{call.call_id}", "xy", None, ANSWER)
    assert call.plan is not None
    assert call.result is not None
    assert call.call_id is not None
    learned = ParentIndex.learn(
        REQUEST, call_id=call.call_id, kind="chat", plan=call.plan, result=call.result, seen=seen
    )
    assert book.call_responded(call, seen, learned)
    assert call.phase is RESPONDED
    return call


# ---- idempotency keys ---------------------------------------------------------------------------


def test_a_retry_of_a_call_committed_with_an_answer_is_answered_again() -> None:
    book = _book()
    first = _claimed(book, "k1", idempotency_key="key")
    _respond(book, _admit(book, first))
    retry = _call(book, "k1", idempotency_key="key")
    assert book.call_claimed(retry) == Holder(first, None)  # responded, not settled: wait
    entry, refused = book.call_committed(first)
    assert entry is not None
    assert isinstance(entry.event, Staged)
    assert refused is None
    held = book.call_claimed(retry, waited=first)
    assert held == Holder(first, ANSWER)
    assert held is not None
    assert held.call is first
    late = _call(book, "k1", idempotency_key="key")
    assert book.call_claimed(late) == Holder(first, ANSWER)
    assert first.rollout.keys["key"] is first  # answering again takes nothing over


def test_a_retry_of_a_call_that_failed_after_its_answer_is_refused_as_poisoned() -> None:
    """The holder failed (served: its sink write failed), so its rollout is UNCAPTURED: a
    retry waiting for it, or arriving later, is refused rather than answered again."""
    book = _book()
    first = _claimed(book, "k5", idempotency_key="key")
    _respond(book, _admit(book, first))
    retry = _call(book, "k5", idempotency_key="key")
    assert book.call_claimed(retry) == Holder(first, None)
    first.stage_error = "injected_put_failure"
    entry, refused = book.call_committed(first)
    assert entry is not None
    assert isinstance(entry.event, Failed)
    assert refused is None
    assert (first.answer, first.rollout.phase) == (ANSWER, UNCAPTURED)
    with pytest.raises(RolloutConflict) as waited:
        book.call_claimed(retry, waited=first)
    assert waited.value.code == "rollout_poisoned"
    with pytest.raises(RolloutConflict) as late:
        _call(book, "k5", idempotency_key="key")
    assert late.value.code == "rollout_poisoned"
    assert first.rollout.keys["key"] is first


@pytest.mark.parametrize("leave", ["drop", "abandon"])
def test_a_key_whose_holder_left_without_an_answer_is_taken_over(leave: str) -> None:
    book = _book()
    book.opened("k2")  # held: dropping its only call does not forget it
    first = _claimed(book, "k2", idempotency_key="key", request_id="req")
    record = first.rollout
    assert (record.keys, record.request_ids) == ({"key": first}, {"req": first})
    if leave == "drop":
        book.call_dropped(first)
    else:
        abandoned = book.call_abandoned(_admit(book, first), "client_left")
        assert abandoned is not None
        assert abandoned.entry is not None
    assert (record.keys, record.request_ids) == ({}, {})  # leaving freed both
    retry = _claimed(book, "k2", idempotency_key="key", request_id="req")
    assert retry.rollout is record
    assert (record.keys["key"], record.request_ids["req"]) == (retry, retry)


def test_a_retry_that_leaves_while_waiting_leaves_the_key_with_its_holder() -> None:
    book = _book()
    first = _claimed(book, "k3", idempotency_key="key")
    record = first.rollout
    waiting = _call(book, "k3", idempotency_key="key")
    assert book.call_claimed(waiting) == Holder(first, None)
    book.call_dropped(waiting)  # the harness went away while it waited
    assert record.keys == {"key": first}


def test_a_request_id_refused_as_a_duplicate_stays_with_the_call_that_used_it() -> None:
    book = _book()
    first = _claimed(book, "k4", request_id="req")
    record = first.rollout
    second = _call(book, "k4", request_id="req")
    with pytest.raises(RolloutConflict) as refused:
        book.call_claimed(second)
    assert refused.value.code == "duplicate_request_id"
    book.call_refused(second)  # refused on its way: dropped
    assert record.request_ids == {"req": first}
    plain = _claimed(book, "k4")  # no key, no request id: holds nothing, frees nothing
    book.call_dropped(plain)
    assert (record.keys, record.request_ids) == ({}, {"req": first})


# ---- abandoning ---------------------------------------------------------------------------------


def test_an_abandoned_call_is_signalled_and_leaves() -> None:
    book = _book()
    call = _admit(book, _call(book, "a1"))
    record = call.rollout
    assert book.call_finished(call, result())
    assert call.phase is FINISHED
    assert call.abandoned is not None
    assert not call.abandoned.is_set()
    abandoned = book.call_abandoned(call, "client_left")
    assert abandoned is not None
    assert abandoned.entry is not None
    assert abandoned.entry.event == Failed(
        call_id=call.call_id or "", reason="uncommitted_call:client_left", served=False
    )
    assert call.abandoned.is_set()
    assert call.settled.is_set()
    assert call not in record.live


def test_vllms_return_abandons_a_call_still_in_flight_and_ends_one_abandoned_before() -> None:
    book = _book()
    running = _admit(book, _call(book, "a2"))
    refusal, abandoned = book.call_ended(running, "client_left")
    assert refusal is None  # nothing to end: the response is vLLM's own
    assert abandoned is not None
    assert abandoned.entry is not None
    assert abandoned.entry.event == Failed(
        call_id=running.call_id or "", reason="uncommitted_call:client_left", served=False
    )
    left = _admit(book, _call(book, "a3"))
    assert book.call_abandoned(left, "rollout_closed") is not None  # its rollout closed
    refusal, abandoned = book.call_ended(left, "client_left")
    assert abandoned is None  # abandoned once, not twice
    assert isinstance(refusal, RolloutConflict)
    assert refusal.code == "rollout_closed"  # the unfinished response ends with it


# ---- rollouts vLLM refused ----------------------------------------------------------------------


def test_a_rollout_none_of_whose_calls_was_served_is_forgotten() -> None:
    book = _book()
    call = _admit(book, _call(book, "u1"))
    record = call.rollout
    assert not book.call_unserved(call)  # its call is still live
    abandoned = book.call_abandoned(call, "engine_failed")  # vLLM answered a 4xx
    assert abandoned is not None
    assert abandoned.entry is not None
    assert isinstance(abandoned.entry.event, Failed)
    assert not abandoned.entry.event.served
    assert book.call_unserved(call)
    with pytest.raises(RolloutNotFound):
        book.open_record("u1")
    assert book.join("u1") is not record  # the id is free again


def test_a_rollout_with_a_served_call_is_kept() -> None:
    """The served call failed (``Failed(served=True)``): its rollout is UNCAPTURED and kept.
    The served call committed (``Staged``): its rollout is OPEN and kept."""
    book = _book()
    served = _respond(book, _admit(book, _call(book, "u2")))
    served.stage_error = "injected_put_failure"
    entry, _ = book.call_committed(served)
    assert entry is not None
    assert isinstance(entry.event, Failed)
    assert entry.event.served
    assert served.rollout.phase is UNCAPTURED
    refused = _admit(book, _call(book, "u3"))
    staged = _respond(book, _admit(book, _call(book, "u3")))
    assert book.call_committed(staged)[1] is None
    assert book.call_abandoned(refused, "engine_failed") is not None  # vLLM answered a 4xx
    for call, phase in ((served, UNCAPTURED), (refused, OPEN)):
        assert not call.rollout.live
        assert not book.call_unserved(call)
        assert book.open_record(call.rollout_id) is call.rollout
        assert call.rollout.phase is phase
