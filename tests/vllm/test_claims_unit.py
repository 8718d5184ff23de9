"""What a call holds in its rollout and what its leaving frees, with no engine.

A call holds its idempotency key and its request id from its claim until it is dropped or
abandoned; leaving frees only what it holds itself. A retry under a held key is answered
again when the holder settled with a recorded answer (committed or failed), waits while
the holder runs, and takes the key over once the holder left without one (dropped,
abandoned). An abandoned call's flag is set, so the driver ends its request. An OPEN
rollout none of whose calls was served is forgotten when vLLM refuses a call of it.
"""

from __future__ import annotations

import pytest

from tests.vllm._rules import Flag, NoLock
from tokcap_core.ledger import Admitted, Failed, Staged, chain_hash
from tokcap_vllm.errors import RolloutConflict, RolloutNotFound
from tokcap_vllm.gate._records import GateCall, RolloutRecord
from tokcap_vllm.gate._rollouts import OPEN, RolloutBook


def _book() -> RolloutBook:
    return RolloutBook(max_open=4, flag=Flag, lock=NoLock)


def _call(book: RolloutBook, record: RolloutRecord, **claims: str) -> GateCall:
    call = book.begin(record, kind="chat", body_fingerprint="b", **claims)
    assert call is not None
    return call


def _admit(book: RolloutBook, call: GateCall, *ops: str) -> GateCall:
    """Admit ``call`` (its entry appended), then move it by ``ops``."""
    record = call.rollout
    call_id = record.ledger.next_call_id()
    record.ledger.append(
        Admitted(
            call_id=call_id,
            parent_id=None,
            prefix_len=0,
            admitted_at=1,
            request_fingerprint="fp",
            formation="root",
        )
    )
    book.advance(record, "append")
    call.call_id = call_id  # type: ignore[assignment]
    for op in ("admit", *ops):
        book.step(call, op)
    return call


# ---- idempotency keys ---------------------------------------------------------------------------


def test_a_retry_of_a_call_committed_with_an_answer_is_answered_again() -> None:
    book = _book()
    record = book.join("k1")
    first = _call(book, record, idempotency_key="key")
    assert book.claim(first) is None
    _admit(book, first, "finish", "respond", "commit")
    first.answer = ({"type": "http.response.start", "status": 200}, [b"{}"])
    assert book.claim(_call(book, record, idempotency_key="key")) is first


@pytest.mark.parametrize("leave", [("drop",), ("admit", "abandon")])
def test_a_key_whose_holder_left_without_an_answer_is_taken_over(leave: tuple[str, ...]) -> None:
    book = _book()
    record = book.join("k2")
    first = _call(book, record, idempotency_key="key", request_id="req")
    assert book.claim(first) is None
    if leave == ("drop",):
        book.step(first, "drop")
    else:
        _admit(book, first, "abandon")
    assert (record.keys, record.request_ids) == ({}, {})  # leaving freed both
    retry = _call(book, record, idempotency_key="key", request_id="req")
    assert book.claim(retry) is None
    assert (record.keys["key"], record.request_ids["req"]) == (retry, retry)


def test_a_retry_that_leaves_while_waiting_leaves_the_key_with_its_holder() -> None:
    book = _book()
    record = book.join("k3")
    first = _call(book, record, idempotency_key="key")
    assert book.claim(first) is None
    waiting = _call(book, record, idempotency_key="key")
    assert book.claim(waiting) is first
    book.step(waiting, "drop")  # the harness went away while it waited
    assert record.keys == {"key": first}


def test_a_request_id_refused_as_a_duplicate_stays_with_the_call_that_used_it() -> None:
    book = _book()
    record = book.join("k4")
    first = _call(book, record, request_id="req")
    assert book.claim(first) is None
    second = _call(book, record, request_id="req")
    with pytest.raises(RolloutConflict) as refused:
        book.claim(second)
    assert refused.value.code == "duplicate_request_id"
    book.step(second, "drop")
    assert record.request_ids == {"req": first}
    plain = _call(book, record)  # no key, no request id: holds nothing, frees nothing
    assert book.claim(plain) is None
    book.step(plain, "drop")
    assert (record.keys, record.request_ids) == ({}, {"req": first})


# ---- abandoning ---------------------------------------------------------------------------------


def test_an_abandoned_call_is_signalled_and_leaves() -> None:
    book = _book()
    record = book.join("a1")
    call = _admit(book, _call(book, record), "finish")
    assert call.abandoned is not None
    assert not call.abandoned.is_set()
    book.step(call, "abandon")
    assert call.abandoned.is_set()
    assert call.settled.is_set()
    assert call not in record.live


# ---- rollouts vLLM refused ----------------------------------------------------------------------


def test_a_rollout_none_of_whose_calls_was_served_is_forgotten() -> None:
    book = _book()
    record = book.join("u1")
    call = _admit(book, _call(book, record))
    record.ledger.append(Failed(call_id=call.call_id or "", reason="engine_failed", served=False))
    assert not book.forget_unserved(record)  # its call is still live
    record.live.discard(call)
    assert book.forget_unserved(record)
    with pytest.raises(RolloutNotFound):
        book.open_record("u1")
    assert book.join("u1") is not record  # the id is free again


def test_a_rollout_with_a_served_call_is_kept() -> None:
    book = _book()
    served = book.join("u2")
    call = _admit(book, _call(book, served))
    served.ledger.append(Failed(call_id=call.call_id or "", reason="engine_failed", served=True))
    served.live.discard(call)
    assert not book.forget_unserved(served)
    assert book.open_record("u2") is served
    staged = book.join("u3")
    call = _admit(book, _call(book, staged), "finish", "respond")
    staged.ledger.append(
        Staged(
            call_id=call.call_id or "",
            carry_len=1,
            gen_len=1,
            weight_version=0,
            weight_version_last=0,
            finish_reason="stop",
            call_digest="d1" * 32,
            chain_hash=chain_hash(None, "d1" * 32),
        )
    )
    staged.live.discard(call)
    assert not book.forget_unserved(staged)
    assert staged.phase is OPEN
