"""The gate's rules alone: the rollout book told its events by a hypothesis state machine.

No engine, no server, no event loop (as h11 tests its ``ConnectionState`` without a
socket). The machine tells the `RolloutBook` the events a gate hears, in any order, and
never does the book's work for it: each rule is one event (a call received and claiming
its key, planned, finished, responded, committed, abandoned, contained; a rollout opened,
its terminal declared, closed, released; an entry the ledger file could not write). A
plain model written here from the module docstrings says what must have happened: which
calls hold which keys and request ids, which are live, which are parents, the rollout's
phase and pending poison, what is held and counted. An event the tables refuse raises
`CallStateError` and changes nothing.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.vllm._rules import REQUEST, Flag, NoLock, plan, result
from tokcap_core import Entry, LedgerProtocolError
from tokcap_core.ledger import Closed, Failed, Poisoned, Staged, TerminalDeclared
from tokcap_vllm.errors import (
    CallStateError,
    InvalidBody,
    RolloutConflict,
    RolloutNotFound,
    SinkUnavailable,
    TooManyRollouts,
)
from tokcap_vllm.gate._lifecycle import Holder
from tokcap_vllm.gate._planning import ChatPlan, Learned, Observed, PriorCall
from tokcap_vllm.gate._records import (
    ABANDONED,
    ADMITTED,
    CLOSED,
    CLOSING,
    CLOSING_UNCAPTURED,
    COMMITTED,
    CONTAINED,
    DROPPED,
    EMPTY,
    FAILED,
    FINISHED,
    OPEN,
    PLANNING,
    RESPONDED,
    UNCAPTURED,
    GateCall,
    RolloutRecord,
)
from tokcap_vllm.gate._rollouts import Abandon, RolloutBook, Settle
from tokcap_vllm.gate._staging import staged_call

ROLLOUTS = ("ra", "rb", "rc")
KEYS = (None, "k1", "k2")
REQUEST_IDS = (None, "q1", "q2")
MAX_OPEN = 2
BOOM = "gate_failed:Boom"


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
    (CONTAINED, "finish"): CONTAINED,
    (CONTAINED, "respond"): CONTAINED,
}
FINAL = {COMMITTED, FAILED, DROPPED, ABANDONED, CONTAINED}
CONTAINABLE = {ADMITTED, FINISHED, RESPONDED}


@dataclass
class ModelRollout:
    phase: Any = EMPTY
    poison: str | None = None
    keys: dict[str, GateCall] = field(default_factory=dict)
    request_ids: dict[str, GateCall] = field(default_factory=dict)
    live: set[GateCall] = field(default_factory=set)
    parents: list[GateCall] = field(default_factory=list)
    unserved_only: bool = True
    """Every entry so far ``Admitted`` or ``Failed(served=False)``."""
    terminal: bool = False


def _snapshot(book: RolloutBook, record: RolloutRecord, call: GateCall) -> tuple[Any, ...]:
    return (
        call.phase,
        call.settled.is_set(),
        record.phase,
        record.poison,
        len(record.ledger.entries),
        dict(record.keys),
        dict(record.request_ids),
        set(record.live),
        record.parents.snapshot(),
        book.counts(),
        book.states(),
    )


def _child_plan(parent: GateCall) -> ChatPlan:
    assert parent.result is not None
    cum = list(parent.result.prompt_ids) + list(parent.result.output_ids)
    return ChatPlan(
        parent.call_id, len(cum), [*cum, 9], "prompt+", request_fingerprint="fp", formation="extend"
    )


class GateTables(RuleBasedStateMachine):
    """The events a gate hears, told to the book, checked against a model."""

    @initialize()
    def start(self) -> None:
        self.book = RolloutBook(max_open=MAX_OPEN, flag=Flag, lock=NoLock)
        self.model: dict[str, ModelRollout] = {}
        self.records: dict[str, RolloutRecord] = {}
        self.closed: set[str] = set()
        self.calls: list[GateCall] = []
        self.waiting: dict[GateCall, GateCall] = {}  # a call -> the key holder it waits for

    # ---- the model ---------------------------------------------------------------------

    def _model_of(self, call: GateCall) -> ModelRollout | None:
        """The model of the call's rollout, None once it closed (its id may be reused)."""
        rid = call.rollout_id
        return self.model[rid] if self.records.get(rid) is call.rollout else None

    def _forget_if_idle(self, rid: str) -> None:
        model = self.model[rid]
        if model.phase is EMPTY and not model.live:
            del self.model[rid]
            del self.records[rid]

    def _model_fail(self, rid: str, poison: str | None) -> None:
        model = self.model.get(rid)
        if model is None:
            return  # the rollout closed: a late failure changes nothing it holds
        if model.phase in (EMPTY, OPEN, UNCAPTURED):
            model.phase = UNCAPTURED
        elif model.phase in (CLOSING, CLOSING_UNCAPTURED):
            model.phase = CLOSING_UNCAPTURED
        if poison is not None and model.poison is None:
            model.poison = poison

    def _release_claims(self, model: ModelRollout, call: GateCall) -> None:
        for table in (model.keys, model.request_ids):
            for k in [k for k, v in table.items() if v is call]:
                del table[k]

    def _expect_claim(self, call: GateCall, waited: GateCall | None) -> None:
        """Claim (again, after waiting for ``waited``) and check the answer."""
        model = self._model_of(call)
        assert model is not None
        record = call.rollout
        expect: Any = None
        if waited is not None and waited.phase not in FINAL:
            expect = "retry_in_flight"
        elif waited is not None and not record.accepting:
            expect = "rollout_closed"
        elif waited is not None and record.phase is UNCAPTURED:
            expect = "rollout_poisoned"
        key, request_id = call.idempotency_key, call.request_id
        holder = model.keys.get(key) if key is not None else None
        if expect is None and holder is not None and holder is not call:
            if holder.phase in (ABANDONED, DROPPED):
                pass  # gone: its key is free
            elif holder.body_fingerprint != call.body_fingerprint:
                expect = "idempotency_key_reused"
            elif holder.answer is not None and holder.phase in (COMMITTED, FAILED):
                expect = Holder(holder, holder.answer)
            elif holder.phase not in FINAL:
                expect = Holder(holder, None)
        if expect is None and request_id is not None:
            other = model.request_ids.get(request_id)
            if other is not None and other is not call:
                expect = "duplicate_request_id"
        if isinstance(expect, str):
            with pytest.raises(RolloutConflict) as e:
                self.book.call_claimed(call, waited=waited)
            assert e.value.code == expect
            if expect == "duplicate_request_id" and key is not None:
                model.keys[key] = call  # the key was taken before the request id was checked
            return
        held = self.book.call_claimed(call, waited=waited)
        assert held == expect
        if held is None:
            self.waiting.pop(call, None)
            if key is not None:
                model.keys[key] = call
            if request_id is not None:
                model.request_ids[request_id] = call
        else:
            self.waiting[call] = held.call

    def _draw_rollout(self, data: st.DataObject) -> str:
        """A rollout id, most often one the book holds open."""
        held = sorted(rid for rid, m in self.model.items() if m.phase is not EMPTY)
        busy = sorted({c.rollout_id for m in self.model.values() for c in m.live if c.call_id})
        return data.draw(st.sampled_from([*held, *busy, *busy, *sorted(self.closed), *ROLLOUTS]))

    # ---- the events of a call ----------------------------------------------------------

    @rule(
        rid=st.sampled_from(ROLLOUTS),
        key=st.sampled_from(KEYS),
        request_id=st.sampled_from(REQUEST_IDS),
        body=st.sampled_from(("b1", "b2")),
    )
    def call_received(self, rid: str, key: str | None, request_id: str | None, body: str) -> None:
        model = self.model.get(rid)
        claims = {"idempotency_key": key, "body_fingerprint": body, "request_id": request_id}
        if rid in self.closed or (
            model is not None and model.phase in (CLOSING, CLOSING_UNCAPTURED)
        ):
            with pytest.raises(RolloutConflict) as e:
                self.book.call_received(rid, kind="chat", **claims)  # type: ignore[arg-type]
            assert e.value.code == "rollout_closed"
            return
        if model is None and len(self.model) >= MAX_OPEN:
            with pytest.raises(TooManyRollouts):
                self.book.call_received(rid, kind="chat", **claims)  # type: ignore[arg-type]
            return
        if model is not None and model.phase is UNCAPTURED:  # it refuses its later calls
            with pytest.raises(RolloutConflict) as refused:
                self.book.call_received(rid, kind="chat", **claims)  # type: ignore[arg-type]
            assert refused.value.code == "rollout_poisoned"
            return
        call = self.book.call_received(rid, kind="chat", **claims)  # type: ignore[arg-type]
        if model is None:
            assert call.rollout.phase is EMPTY
            model = self.model[rid] = ModelRollout()
            self.records[rid] = call.rollout
        assert call.rollout is self.records[rid]
        assert call.phase is PLANNING
        model.live.add(call)
        self.calls.append(call)
        self._expect_claim(call, None)

    @rule(data=st.data())
    def call_claimed_after_waiting(self, data: st.DataObject) -> None:
        waiting = [c for c in self.waiting if c.phase is PLANNING and self._model_of(c)]
        if waiting:
            call = data.draw(st.sampled_from(waiting))
            self._expect_claim(call, self.waiting[call])

    @rule(data=st.data(), refused=st.booleans())
    def call_dropped(self, data: st.DataObject, refused: bool) -> None:
        """Answered again (dropped), or refused on the way (dropped if still planning)."""
        pool = self.calls if refused else [c for c in self.calls if c.phase is PLANNING]
        if not pool:
            return
        call = data.draw(st.sampled_from(pool))
        was = call.phase
        if refused:
            self.book.call_refused(call)
        else:
            self.book.call_dropped(call)
        model = self._model_of(call)
        if was is not PLANNING:
            return  # refused after its admission: nothing to drop
        assert call.phase is DROPPED
        self.waiting.pop(call, None)
        if model is not None:
            model.live.discard(call)
            self._release_claims(model, call)
            self._forget_if_idle(call.rollout_id)

    @rule(data=st.data(), parent=st.booleans(), unserved=st.sampled_from((False, False, True)))
    def call_planned(self, data: st.DataObject, parent: bool, unserved: bool) -> None:
        call = self._draw_planning(data)
        if call is not None:
            self._plan(call, self._draw_parent(data, call) if parent else None, unserved)

    def _draw_planning(self, data: st.DataObject) -> GateCall | None:
        """A planning call, most often one whose rollout admits calls."""
        planning = [c for c in self.calls if c.phase is PLANNING]
        accepting = [c for c in planning if c.rollout.accepting]
        accepting = [c for c in accepting if c.rollout.phase is not UNCAPTURED]
        return data.draw(st.sampled_from(accepting or planning)) if planning else None

    def _draw_parent(self, data: st.DataObject, call: GateCall) -> GateCall | None:
        """An earlier call of the rollout with a staged row, most often a committed one."""
        staged = [c for c in call.rollout.calls.values() if c.staged is not None]
        committed = [c for c in staged if c.phase is COMMITTED]
        return data.draw(st.sampled_from([*committed, *committed, *staged])) if staged else None

    def _plan(self, call: GateCall, named: GateCall | None, unserved: bool) -> bool:
        """The call is planned (on ``named``): True once admitted."""
        record = call.rollout
        if not record.accepting or record.phase is UNCAPTURED:
            code = "rollout_closed" if not record.accepting else "rollout_poisoned"
            with pytest.raises(RolloutConflict) as e:
                self.book.call_planning(call, REQUEST)
            assert e.value.code == code
            return False
        self.book.call_planning(call, REQUEST)
        before = _snapshot(self.book, record, call)
        if unserved:
            refusal = SinkUnavailable("sink_unavailable", "x")
            with pytest.raises(SinkUnavailable):
                self.book.call_planned(call, plan(), admitted_at=1, unserved=refusal)
            assert _snapshot(self.book, record, call) == before
            return False
        made = _child_plan(named) if named is not None else plan()
        admitted = self.book.call_planned(call, made, admitted_at=1, unserved=None)
        if named is not None and named.phase is not COMMITTED:
            assert admitted is named  # wait for it, then plan again
            assert _snapshot(self.book, record, call) == before
            with pytest.raises(RolloutConflict) as e:
                self.book.parent_waited(named)
            assert e.value.code == "parent_not_committed"
            return False
        assert isinstance(admitted, Entry)
        model = self.model[call.rollout_id]
        if model.phase is EMPTY:
            model.phase = OPEN
        assert call.phase is ADMITTED
        assert call.parent is named
        assert call.call_id is not None
        assert record.calls[call.call_id] is call
        return True

    @rule(data=st.data(), staged=st.booleans())
    def call_finished(self, data: st.DataObject, staged: bool) -> None:
        movable = [c for c in self.calls if c.phase in (ADMITTED, ABANDONED, CONTAINED)]
        if movable:
            self._finish(data.draw(st.sampled_from(movable)), staged)

    def _finish(self, call: GateCall, staged: bool) -> bool:
        """The engine's final output: True if the call is to be staged (then it is written,
        or fails to be, as the capture path would)."""
        expected = EXPECTED_CALL[(call.phase, "finish")]
        assert call.plan is not None
        engine = result(prompt_ids=call.plan.prompt_ids)
        assert self.book.call_finished(call, engine) is (expected is FINISHED)
        assert call.phase is expected
        if expected is not FINISHED:
            return False
        if staged:
            call.staged = staged_call(call, engine, False)
        else:
            call.stage_error = "injected_put_failure"
        return True

    @rule(data=st.data(), learned=st.booleans(), answer=st.booleans())
    def call_responded(self, data: st.DataObject, learned: bool, answer: bool) -> None:
        movable = [c for c in self.calls if c.phase in (FINISHED, ABANDONED, CONTAINED)]
        if movable:
            self._respond(data.draw(st.sampled_from(movable)), learned, answer)

    def _respond(self, call: GateCall, learned: bool, answer: bool) -> bool:
        was = call.phase
        assert call.call_id is not None
        seen = Observed(f"resp-{call.call_id}", None, None, ({}, [b"{}"]) if answer else None)
        prior = PriorCall(call.call_id, "chat", "prompt+out", array("I", [1, 2, 3]))
        commits = self.book.call_responded(call, seen, Learned("fp", prior) if learned else None)
        assert commits is (was is FINISHED)
        assert call.phase is EXPECTED_CALL[(was, "respond")]
        model = self._model_of(call)
        if was is FINISHED and learned and call.staged is not None and model is not None:
            model.parents.append(call)
        if was is FINISHED:
            assert call.answer == (seen.answer if learned else None)
        return commits

    @rule(
        data=st.data(),
        parent=st.booleans(),
        staged=st.sampled_from((True, True, False)),
        learned=st.booleans(),
        answer=st.booleans(),
        until=st.sampled_from(("admitted", "finished", "responded", "settled", "settled")),
    )
    def call_served(
        self,
        data: st.DataObject,
        parent: bool,
        staged: bool,
        learned: bool,
        answer: bool,
        until: str,
    ) -> None:
        """One call's events from its plan on, one after the other, up to ``until``."""
        call = self._draw_planning(data)
        if call is None:
            return
        named = self._draw_parent(data, call) if parent else None
        if not self._plan(call, named, False) or until == "admitted":
            return
        if not self._finish(call, staged) or until == "finished":
            return
        if self._respond(call, learned, answer) and until == "settled":
            self._commit(call)

    @rule(data=st.data())
    def call_committed(self, data: st.DataObject) -> None:
        responded = [c for c in self.calls if c.phase is RESPONDED]
        if responded:
            self._commit(data.draw(st.sampled_from(responded)))

    def _commit(self, call: GateCall) -> None:
        """The responded call's sink write is over (what its commit task tells the book)."""
        failing = call.staged is None or call.stage_error is not None
        entry, refused = self.book.call_committed(call)
        assert refused is None
        model = self._model_of(call)
        if failing:
            assert call.phase is FAILED
            assert entry is not None
            assert isinstance(entry.event, Failed)
            assert entry.event.served
        else:
            assert call.phase is COMMITTED
            assert entry is not None
            assert isinstance(entry.event, Staged)
        if model is None:
            return
        model.live.discard(call)
        model.unserved_only = False
        if failing:
            if call in model.parents:
                model.parents.remove(call)
            self._model_fail(call.rollout_id, None)

    @rule(data=st.data())
    def call_abandoned(self, data: st.DataObject) -> None:
        if self.calls:
            self._abandon(data.draw(st.sampled_from(self.calls)), "client_disconnected")

    def _abandon(self, call: GateCall, detail: str) -> None:
        was = call.phase
        abandoned = self.book.call_abandoned(call, detail)
        model = self._model_of(call)
        if was is PLANNING:  # nothing to abandon: dropped
            assert abandoned is None
            assert call.phase is DROPPED
            self.waiting.pop(call, None)
            if model is not None:
                model.live.discard(call)
                self._release_claims(model, call)
                self._forget_if_idle(call.rollout_id)
            return
        if was not in (ADMITTED, FINISHED):
            assert abandoned is None
            assert call.phase is was
            return
        assert abandoned is not None
        assert call.phase is ABANDONED
        assert call.abandoned is not None
        assert call.abandoned.is_set()
        assert abandoned.clear_row is (was is FINISHED)
        if abandoned.entry is not None:
            assert isinstance(abandoned.entry.event, Failed)
            assert not abandoned.entry.event.served
        if model is not None:
            model.live.discard(call)
            self._release_claims(model, call)

    @rule(data=st.data())
    def call_contained(self, data: st.DataObject) -> None:
        admitted = [c for c in self.calls if c.call_id is not None]
        if not admitted:
            return
        call = data.draw(st.sampled_from(admitted))
        was = call.phase
        self.book.call_contained(call, BOOM)
        assert call.phase is (CONTAINED if was in CONTAINABLE else was)
        assert call.settled.is_set()
        assert call.sink_done.is_set() or was not in CONTAINABLE
        model = self._model_of(call)
        if model is not None:
            model.live.discard(call)
            self._model_fail(call.rollout_id, BOOM)

    @rule(data=st.data())
    def call_unserved(self, data: st.DataObject) -> None:
        """vLLM refused the call itself: its rollout is forgotten if nothing of it was served."""
        if not self.calls:
            return
        call = data.draw(st.sampled_from(self.calls))
        model = self._model_of(call)
        forget = (
            model is not None
            and model.phase is OPEN
            and model.poison is None
            and not model.live
            and model.unserved_only
        )
        assert self.book.call_unserved(call) is forget
        if forget:
            del self.model[call.rollout_id]
            del self.records[call.rollout_id]

    # ---- the events of a rollout -------------------------------------------------------

    @rule(rid=st.sampled_from(ROLLOUTS))
    def opened(self, rid: str) -> None:
        model = self.model.get(rid)
        if rid in self.closed or (
            model is not None and model.phase in (CLOSING, CLOSING_UNCAPTURED)
        ):
            with pytest.raises(RolloutConflict):
                self.book.opened(rid)
            return
        if model is None and len(self.model) >= MAX_OPEN:
            with pytest.raises(TooManyRollouts):
                self.book.opened(rid)
            return
        self.book.opened(rid)
        if model is None:
            model = self.model[rid] = ModelRollout()
            self.records[rid] = self.book.open_record(rid)
        if model.phase is EMPTY:
            model.phase = OPEN

    @rule(data=st.data())
    def terminal_declared(self, data: st.DataObject) -> None:
        rid = self._draw_rollout(data)
        model = self.model.get(rid)
        if model is None or model.phase not in (OPEN, UNCAPTURED):
            with pytest.raises((RolloutNotFound, RolloutConflict)):
                self.book.terminal_declared(rid, call_id="c000001")
            return
        record = self.records[rid]
        answered = [i for i, c in record.calls.items() if c.phase in (RESPONDED, COMMITTED, FAILED)]
        named = data.draw(st.sampled_from([*answered, *record.calls, "c999999"]))
        answered = named in record.calls and record.calls[named].phase in (
            RESPONDED,
            COMMITTED,
            FAILED,
        )
        if not answered:
            before = len(record.ledger.entries)
            with pytest.raises(InvalidBody) as e:
                self.book.terminal_declared(rid, call_id=named)
            assert e.value.code == "unknown_terminal"
            assert len(record.ledger.entries) == before
            return
        if model.terminal:  # the ledger takes one terminal
            before = len(record.ledger.entries)
            with pytest.raises(LedgerProtocolError) as twice:
                self.book.terminal_declared(rid, call_id=named)
            assert twice.value.code == "terminal_already_declared"
            assert len(record.ledger.entries) == before
            return
        held, entry = self.book.terminal_declared(rid, call_id=named)
        model.terminal = True
        assert held is record
        assert entry.event == TerminalDeclared(by="call_id", value=named)
        model.unserved_only = False

    @rule(rid=st.sampled_from(ROLLOUTS))
    def entry_unpersisted(self, rid: str) -> None:
        model = self.model.get(rid)
        if model is None or model.phase is EMPTY:
            return
        first = model.poison is None
        assert self.book.unpersisted(self.records[rid], "ledger_write_failed:disk") is first
        self._model_fail(rid, "ledger_write_failed:disk")

    @rule(data=st.data(), refused=st.booleans(), reward=st.sampled_from((1.0, None)))
    def closed(self, data: st.DataObject, refused: bool, reward: float | None) -> None:
        rid = self._draw_rollout(data)
        model = self.model.get(rid)
        if model is None or model.phase is EMPTY:
            expected: type[Exception] = RolloutConflict if rid in self.closed else RolloutNotFound
            with pytest.raises(expected):
                self.book.close_requested(rid)
            return
        record = self.book.close_requested(rid)
        assert record is self.records[rid]
        was = model.phase
        model.phase = CLOSING if was is OPEN else CLOSING_UNCAPTURED
        assert not record.accepting
        with pytest.raises(RolloutConflict):
            self.book.call_received(rid, kind="chat")
        if refused:  # the close stopped on the way: the rollout is as it was
            self.book.close_failed(record)
            model.phase = was
            return
        while (step := self.book.close_next(record)) is not None:
            if isinstance(step, Abandon):
                assert step.call.in_flight
                self._abandon(step.call, "closed_in_flight")
            else:
                assert isinstance(step, Settle)
                assert step.call.phase is RESPONDED
                self._commit(step.call)  # what its commit task would tell the book
        assert not any(c.in_flight or c.phase is RESPONDED for c in record.live)
        poison = record.poison
        assert poison == model.poison
        entry = self.book.closed(record, reward=reward, witnesses=None)
        assert entry.event == Poisoned(reason=poison) if poison else isinstance(entry.event, Closed)
        assert record.phase is CLOSED
        del self.model[rid]
        del self.records[rid]
        self.closed.add(rid)

    @rule(data=st.data())
    def released(self, data: st.DataObject) -> None:
        rid = self._draw_rollout(data)
        if rid in self.closed:
            self.book.released(rid)  # the id may start a new, unrelated rollout
            self.closed.discard(rid)
            return
        model = self.model.get(rid)
        expected: type[Exception] = RolloutNotFound
        if model is not None and model.phase is not EMPTY:
            expected = RolloutConflict
        with pytest.raises(expected):
            self.book.released(rid)

    # ---- what the tables refuse --------------------------------------------------------

    @rule(data=st.data(), op=st.sampled_from(("admit", "drop", "finish", "respond", "commit")))
    def refused_event(self, data: st.DataObject, op: str) -> None:
        """An event the call table does not allow now raises and changes nothing."""
        if not self.calls:
            return
        call = data.draw(st.sampled_from(self.calls))
        taken = "fail" if op == "commit" and call.staged is None else op
        if (call.phase, taken) in EXPECTED_CALL or (op == "respond" and call.phase is FINISHED):
            return
        events = {
            "admit": lambda: self.book.call_planned(call, plan(), admitted_at=1, unserved=None),
            "drop": lambda: self.book.call_dropped(call),
            "finish": lambda: self.book.call_finished(call, result()),
            "respond": lambda: self.book.call_responded(call, Observed("r", None, None), None),
            "commit": lambda: self.book.call_committed(call),
        }
        before = _snapshot(self.book, call.rollout, call)
        with pytest.raises(CallStateError):
            events[op]()
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
            assert call.settled.count == (1 if call.phase in FINAL else 0), call  # type: ignore[attr-defined]
            assert call.final is (call.phase in FINAL)
            assert call.in_flight is (call.phase in (ADMITTED, FINISHED))


GateTables.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_gate_tables = GateTables.TestCase


def test_a_rollout_event_its_table_refuses_names_its_code_and_changes_nothing() -> None:
    book = RolloutBook(max_open=1, flag=Flag, lock=NoLock)
    record = book.join("r1")
    with pytest.raises(CallStateError) as e:
        book.close_failed(record)  # no close began: there is nothing to take back
    assert (e.value.code, record.phase) == ("not_open", EMPTY)
    book.opened("r1")
    for event in (
        lambda: book.close_failed(record),
        lambda: book.closed(record, reward=1.0, witnesses=None),
    ):
        with pytest.raises(CallStateError) as e:
            event()
        assert (e.value.code, record.phase, len(record.ledger.entries)) == ("not_closing", OPEN, 0)
    assert book.close_requested("r1") is record
    assert isinstance(book.closed(record, reward=1.0, witnesses=None).event, Closed)
    assert record.phase is CLOSED
    with pytest.raises(RolloutConflict) as closed:
        book.opened("r1")
    assert closed.value.code == "rollout_closed"
