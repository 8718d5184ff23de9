"""The gate's rules alone: the rollout and call tables driven by a hypothesis state machine.

No engine, no server, no event loop (as h11 tests its ``ConnectionState`` without a
socket). The machine plays the driver (`tokcap_vllm.gate._capture.CapturePath`): it appends
the ledger entries the driver would and asks the `RolloutBook` for each step, while a
plain model written here from the module docstrings says what must have happened: which
calls hold which keys and request ids, which are live, which are parents, the rollout's
phase and pending poison, what is held and counted. A step the tables refuse must raise
`CallStateError` and change nothing.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.vllm._rules import Flag, NoLock
from tokcap_core.ledger import OPEN as LEDGER_OPEN
from tokcap_core.ledger import Admitted, Closed, Failed, Poisoned, Witnesses
from tokcap_vllm.errors import RolloutConflict, RolloutNotFound, TooManyRollouts
from tokcap_vllm.gate._lifecycle import (
    ABANDONED,
    ADMITTED,
    COMMITTED,
    DROPPED,
    FAILED,
    FINISHED,
    PLANNING,
    RESPONDED,
    CallStateError,
)
from tokcap_vllm.gate._planning import ChatPlan, PriorCall
from tokcap_vllm.gate._records import GateCall, answerable
from tokcap_vllm.gate._rollouts import (
    CLOSED,
    CLOSING,
    CLOSING_UNCAPTURED,
    EMPTY,
    OPEN,
    UNCAPTURED,
    RolloutBook,
    RolloutRecord,
)

ROLLOUTS = ("ra", "rb", "rc")
KEYS = (None, "k1", "k2")
REQUEST_IDS = (None, "q1", "q2")
OPS = ("admit", "drop", "finish", "respond", "commit", "fail", "abandon")
MAX_OPEN = 2


# The call table as the module docstring draws it, written out independently.
EXPECTED_CALL = {
    (PLANNING, "admit"): ADMITTED,
    (PLANNING, "drop"): DROPPED,
    (ADMITTED, "finish"): FINISHED,
    (ADMITTED, "abandon"): ABANDONED,
    (FINISHED, "respond"): RESPONDED,
    (FINISHED, "abandon"): ABANDONED,
    (RESPONDED, "commit"): COMMITTED,
    (RESPONDED, "fail"): FAILED,
    (ABANDONED, "finish"): ABANDONED,
    (ABANDONED, "respond"): ABANDONED,
}
FINAL = {COMMITTED, FAILED, DROPPED, ABANDONED}


@dataclass
class ModelRollout:
    phase: Any = EMPTY
    poison: str | None = None
    keys: dict[str, GateCall] = field(default_factory=dict)
    request_ids: dict[str, GateCall] = field(default_factory=dict)
    live: set[GateCall] = field(default_factory=set)
    parents: list[GateCall] = field(default_factory=list)


def _snapshot(book: RolloutBook, record: RolloutRecord, call: GateCall) -> tuple[Any, ...]:
    return (
        call.phase,
        call.settled.is_set(),
        record.phase,
        record.poison,
        dict(record.keys),
        dict(record.request_ids),
        set(record.live),
        record.parents.snapshot(),
        book.counts(),
        book.states(),
    )


class GateTables(RuleBasedStateMachine):
    """The driver's side of the conversation with the tables, checked against a model."""

    @initialize()
    def start(self) -> None:
        self.book = RolloutBook(max_open=MAX_OPEN, flag=Flag, lock=NoLock)
        self.model: dict[str, ModelRollout] = {}
        self.records: dict[str, RolloutRecord] = {}
        self.closed: set[str] = set()
        self.calls: list[GateCall] = []
        self.contained: set[GateCall] = set()

    # ---- helpers -----------------------------------------------------------------------

    def _model_of(self, call: GateCall) -> ModelRollout | None:
        """The model of the call's rollout, None once it closed (its id may be reused)."""
        rid = call.rollout_id
        return self.model[rid] if self.records.get(rid) is call.rollout else None

    def _forget_if_idle(self, rid: str) -> None:
        model = self.model[rid]
        if model.phase is EMPTY and not model.live:
            del self.model[rid]
            del self.records[rid]

    def _append_failed(self, call: GateCall, served: bool) -> None:
        record = call.rollout
        if record.ledger.status is LEDGER_OPEN and call.call_id is not None:
            record.ledger.append(Failed(call_id=call.call_id, reason="x:y", served=served))
            self.book.advance(record, "append")

    def _model_fail(self, rid: str, poison: str | None) -> None:
        model = self.model.get(rid)
        if model is None:
            return  # the rollout closed: a late failure changes nothing
        if model.phase in (EMPTY, OPEN, UNCAPTURED):
            model.phase = UNCAPTURED
        elif model.phase in (CLOSING, CLOSING_UNCAPTURED):
            model.phase = CLOSING_UNCAPTURED
        if poison is not None and model.poison is None:
            model.poison = poison

    def _step(self, call: GateCall, op: str) -> None:
        self.book.step(call, op)

    # ---- rules -------------------------------------------------------------------------

    @rule(
        rid=st.sampled_from(ROLLOUTS),
        key=st.sampled_from(KEYS),
        request_id=st.sampled_from(REQUEST_IDS),
        body=st.sampled_from(("b1", "b2")),
    )
    def enter(self, rid: str, key: str | None, request_id: str | None, body: str) -> None:
        model = self.model.get(rid)
        if rid in self.closed or (
            model is not None and model.phase in (CLOSING, CLOSING_UNCAPTURED)
        ):
            with pytest.raises(RolloutConflict) as e:
                self.book.join(rid)
            assert e.value.code == "rollout_closed"
            return
        if model is None and len(self.model) >= MAX_OPEN:
            with pytest.raises(TooManyRollouts):
                self.book.join(rid)
            return
        record = self.book.join(rid)
        if model is None:
            assert record.phase is EMPTY
            model = self.model[rid] = ModelRollout()
            self.records[rid] = record
        assert record is self.records[rid]
        if model.phase is UNCAPTURED:  # a poisoned rollout refuses its later calls
            with pytest.raises(RolloutConflict) as refused:
                self.book.begin(record, kind="chat", idempotency_key=key, body_fingerprint=body)
            assert refused.value.code == "rollout_poisoned"
            return
        call = self.book.begin(
            record, kind="chat", idempotency_key=key, body_fingerprint=body, request_id=request_id
        )
        assert call.phase is PLANNING
        assert call.rollout is record
        model.live.add(call)
        self.calls.append(call)
        holder = model.keys.get(key) if key is not None else None
        live_holder = holder is not None and holder.phase not in (ABANDONED, DROPPED)
        expect: Any = None
        if live_holder and holder is not None:
            if holder.body_fingerprint != body:
                expect = "idempotency_key_reused"
            elif holder.phase not in FINAL or (
                holder.answer is not None and holder.phase in (COMMITTED, FAILED)
            ):
                expect = holder
        if expect is None and request_id is not None:
            other = model.request_ids.get(request_id)
            if other is not None:
                expect = "duplicate_request_id"
        if isinstance(expect, str):
            with pytest.raises(RolloutConflict) as e:
                self.book.claim(call)
            assert e.value.code == expect
            if expect == "duplicate_request_id" and key is not None:
                model.keys[key] = call  # the key was taken before the request id was checked
        else:
            assert self.book.claim(call) is expect
            if expect is None:
                if key is not None:
                    model.keys[key] = call
                if request_id is not None:
                    model.request_ids[request_id] = call
            else:
                assert not expect.final or answerable(expect)

    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        planning = [c for c in self.calls if c.phase is PLANNING]
        if not planning:
            return
        call = data.draw(st.sampled_from(planning))
        rid = call.rollout_id
        model = self._model_of(call)
        self._step(call, "drop")
        if model is None:  # a call left planning when its rollout closed (refused later)
            return
        model.live.discard(call)
        for table in (model.keys, model.request_ids):
            for k in [k for k, v in table.items() if v is call]:
                del table[k]
        self._forget_if_idle(rid)

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        planning = [c for c in self.calls if c.phase is PLANNING and c.rollout.accepting]
        if not planning:
            return
        call = data.draw(st.sampled_from(planning))
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
        self.book.advance(record, "append")
        model = self.model[call.rollout_id]
        if model.phase is EMPTY:
            model.phase = OPEN
        call.call_id = call_id  # type: ignore[assignment]
        call.plan = ChatPlan(None, 0, [1, 2], "prompt")
        self._step(call, "admit")
        assert record.calls[call.call_id] is call

    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        movable = [c for c in self.calls if c.phase in (ADMITTED, ABANDONED)]
        if movable:
            call = data.draw(st.sampled_from(movable))
            expected = EXPECTED_CALL[(call.phase, "finish")]
            assert self.book.step(call, "finish") is expected

    @rule(data=st.data(), parent=st.booleans(), answer=st.booleans())
    def respond(self, data: st.DataObject, parent: bool, answer: bool) -> None:
        movable = [c for c in self.calls if c.phase in (FINISHED, ABANDONED)]
        if not movable:
            return
        call = data.draw(st.sampled_from(movable))
        was = call.phase
        if was is FINISHED and parent:
            assert call.call_id is not None
            call.prior = PriorCall(call.call_id, "chat", "prompt+out", array("I", [1, 2, 3]))
        if was is FINISHED and answer:
            call.answer = ({"type": "http.response.start"}, [b"{}"])
        self._step(call, "respond")
        model = self._model_of(call)
        if was is FINISHED and parent and model is not None:
            model.parents.append(call)

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        responded = [c for c in self.calls if c.phase is RESPONDED and c not in self.contained]
        if responded:
            call = data.draw(st.sampled_from(responded))
            self._step(call, "commit")
            model = self._model_of(call)
            if model is not None:
                model.live.discard(call)

    @rule(data=st.data())
    def fail_served(self, data: st.DataObject) -> None:
        responded = [c for c in self.calls if c.phase is RESPONDED and c not in self.contained]
        if not responded:
            return
        call = data.draw(st.sampled_from(responded))
        self._step(call, "fail")
        self._append_failed(call, served=True)
        model = self._model_of(call)
        if model is not None:
            model.live.discard(call)
            if call in model.parents:
                model.parents.remove(call)
            self._model_fail(call.rollout_id, None)

    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        flying = [c for c in self.calls if c.in_flight]
        if flying:
            self._abandon(data.draw(st.sampled_from(flying)))

    def _abandon(self, call: GateCall) -> None:
        self._step(call, "abandon")
        self._append_failed(call, served=False)
        model = self._model_of(call)
        if model is None:
            return
        model.live.discard(call)
        for table in (model.keys, model.request_ids):
            for k in [k for k, v in table.items() if v is call]:
                del table[k]

    @rule(data=st.data())
    def contain(self, data: st.DataObject) -> None:
        admitted = [c for c in self.calls if c.call_id is not None and not c.final]
        if not admitted:
            return
        call = data.draw(st.sampled_from(admitted))
        self.book.contain(call, "gate_failed:Boom")
        assert call.settled.is_set()
        assert call.sink_done.is_set()
        model = self._model_of(call)
        self.contained.add(call)
        if model is not None:
            model.live.discard(call)
            self._model_fail(call.rollout_id, "gate_failed:Boom")

    @rule(rid=st.sampled_from(ROLLOUTS))
    def persistence_fails(self, rid: str) -> None:
        model = self.model.get(rid)
        if model is None or model.phase is EMPTY:
            return
        self.book.advance(self.records[rid], "fail", poison="ledger_write_failed:disk")
        self._model_fail(rid, "ledger_write_failed:disk")

    @rule(rid=st.sampled_from(ROLLOUTS), refused=st.booleans(), reward=st.sampled_from((1.0, None)))
    def close(self, rid: str, refused: bool, reward: float | None) -> None:
        model = self.model.get(rid)
        if model is None or model.phase is EMPTY:
            expected: type[Exception] = RolloutConflict if rid in self.closed else RolloutNotFound
            with pytest.raises(expected):
                self.book.open_record(rid)
            return
        record = self.book.open_record(rid)
        was = model.phase
        self.book.advance(record, "close")
        model.phase = CLOSING if was is OPEN else CLOSING_UNCAPTURED
        assert not record.accepting
        with pytest.raises(RolloutConflict):
            self.book.join(rid)
        if refused:  # the close failed on the way: the rollout is as it was
            self.book.advance(record, "reopen")
            model.phase = was
            return
        for call in list(record.live):
            if call.in_flight:
                self._abandon(call)
        for call in list(record.live):
            if call.phase is RESPONDED:
                self._step(call, "commit")
                model.live.discard(call)
        poison = record.poison
        assert poison == model.poison
        event = Poisoned(reason=poison) if poison else Closed(reward=reward, witnesses=Witnesses())
        record.ledger.append(event)
        self.book.advance(record, "closed")
        assert record.phase is CLOSED
        del self.model[rid]
        del self.records[rid]
        self.closed.add(rid)

    @rule(rid=st.sampled_from(ROLLOUTS))
    def release(self, rid: str) -> None:
        if rid in self.closed:
            self.book.release(rid)  # the id may start a new, unrelated rollout
            self.closed.discard(rid)
            return
        model = self.model.get(rid)
        expected: type[Exception] = RolloutNotFound
        if model is not None and model.phase is not EMPTY:
            expected = RolloutConflict
        with pytest.raises(expected):
            self.book.release(rid)

    @rule(data=st.data(), op=st.sampled_from(OPS))
    def refused_step(self, data: st.DataObject, op: str) -> None:
        """Any step the table does not allow raises and changes nothing."""
        if not self.calls:
            return
        call = data.draw(st.sampled_from(self.calls))
        if (call.phase, op) in EXPECTED_CALL:
            return
        before = _snapshot(self.book, call.rollout, call)
        with pytest.raises(CallStateError):
            self.book.step(call, op)
        assert _snapshot(self.book, call.rollout, call) == before

    # ---- invariants --------------------------------------------------------------------

    @invariant()
    def the_book_matches_the_model(self) -> None:
        held = {rid for rid, m in self.model.items() if m.phase is not EMPTY}
        assert self.book.counts() == (len(held), len(self.closed))
        assert self.book.states() == {
            **dict.fromkeys(self.closed, "closed"),
            **dict.fromkeys(held, "open"),
        }
        assert {r.rollout_id for r in self.book.records()} == set(self.model)
        for rid, model in self.model.items():
            record = self.records[rid]
            assert record.phase is model.phase, (rid, record.phase, model.phase)
            assert record.poison == model.poison
            assert record.keys == model.keys
            assert record.request_ids == model.request_ids
            assert record.live == model.live
            priors, gen_starts = record.parents.snapshot()
            assert [p.call_id for p in priors] == [c.call_id for c in model.parents]
            assert set(gen_starts) >= {c.call_id for c in model.parents}
            assert record.accepting is (model.phase in (EMPTY, OPEN, UNCAPTURED))
            assert record.held is (model.phase is not EMPTY)
            assert self.book.ledger(rid) is record.ledger if record.held else True

    @invariant()
    def calls_settle_once_on_reaching_a_final_phase(self) -> None:
        for call in self.calls:
            if call in self.contained:
                assert call.settled.is_set()
            else:
                assert call.settled.count == (1 if call.phase in FINAL else 0), call
            assert call.final is (call.phase in FINAL)
            assert call.in_flight is (call.phase in (ADMITTED, FINISHED))


GateTables.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_gate_tables = GateTables.TestCase


def test_a_refused_rollout_step_names_its_code_and_changes_nothing() -> None:
    book = RolloutBook(max_open=1, flag=Flag, lock=NoLock)
    record = book.join("r1")
    for op, code in (("close", "not_open"), ("closed", "not_open"), ("reopen", "not_open")):
        with pytest.raises(CallStateError) as e:
            book.advance(record, op)
        assert (e.value.code, record.phase) == (code, EMPTY)
    book.advance(record, "append")
    with pytest.raises(CallStateError) as e:
        book.advance(record, "closed")
    assert (e.value.code, record.phase) == ("not_closing", OPEN)
