"""The lifecycle of a gate's captured calls: the events the capture path tells the book.

`CallEvents` is the half of `tokcap_vllm.gate._rollouts.RolloutBook` the capture path
(`tokcap_vllm.gate._capture.CapturePath`) drives, one method per event of a call, from its
request to its commit: each checks what the tables (`tokcap_vllm.gate._records`) allow,
appends its own ledger entry and moves the call and its rollout on in one step, or raises
and changes nothing, and answers what the driver does next. No I/O, no clock, no task
group. Every refusal of a captured call is raised here (a `GateError` with its code), from
facts the driver brings (the sink's and the weights' state: `CapturePath.serving_refusal`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from tokcap_core import Entry, Ledger, LedgerProtocolError
from tokcap_core.ids import CallId, RolloutId, validate_rollout_id
from tokcap_core.ledger import OPEN as LEDGER_OPEN
from tokcap_core.ledger import Admitted, Closed, Event, Failed, Poisoned, Staged
from tokcap_core.reasons import LEDGER_REFUSED, STAGE_FAILED, UNCOMMITTED_CALL, make_reason

from ..errors import CallNotServed, GateError, RolloutConflict, RolloutNotFound, TooManyRollouts
from ._host import EngineResult
from ._planning import ChatPlan, Learned, Observed, PlannedRequest
from ._records import (
    ABANDONED,
    ADMITTED,
    CLOSED,
    COMMITTED,
    CONTAINED,
    EFFECTS,
    EMPTY,
    FINAL,
    FINISHED,
    IN_CLOSE,
    PLANNING,
    REFUSALS,
    ROLLOUT_REFUSALS,
    ROLLOUT_TRANSITIONS,
    TRANSITIONS,
    UNCAPTURED,
    CallPhase,
    Flag,
    GateCall,
    ResponsesTurn,
    RolloutRecord,
    answerable,
    gone,
    next_phase,
)

__all__ = ["Abandoned", "CallEvents", "Holder"]


@dataclass(frozen=True, slots=True)
class Abandoned:
    """An abandoned call: the entry to tell (None once its ledger closed), and whether its
    staged row (written, named by no receipt) is to be cleared from the sink."""

    entry: Entry | None
    clear_row: bool


@dataclass(frozen=True, slots=True)
class Holder:
    """The call holding the key another call claims: its recorded ``answer`` to send again,
    or None: wait for it to settle, then claim again."""

    call: GateCall
    answer: tuple[dict[str, Any], list[bytes]] | None


class CallEvents:
    """A gate's open and closed rollouts, and the events of their calls."""

    def __init__(
        self,
        *,
        max_open: int,
        flag: Callable[[], Flag],
        lock: Callable[[], AbstractAsyncContextManager[Any]],
    ) -> None:
        self.max_open = max_open
        self._flag = flag
        self._lock = lock
        self._open: dict[RolloutId, RolloutRecord] = {}
        self._closed: dict[RolloutId, Ledger] = {}

    def join(self, rollout_id: str, *, require_open: bool = False) -> RolloutRecord:
        """A request of ``rollout_id`` arrived: the open record it joins, made on first use.

        `RolloutConflict` (409) if the id names a closed (or closing) rollout;
        `TooManyRollouts` (503) when ``max_open`` records are open already; with
        ``require_open``, `RolloutNotFound` (``unknown_rollout``) unless it was opened.
        """
        rid = validate_rollout_id(rollout_id)
        if rid in self._closed:
            raise RolloutConflict("rollout_closed", f"{rid} is closed; start a new rollout id")
        record = self._open.get(rid)
        if require_open and (record is None or record.phase is EMPTY):
            raise RolloutNotFound(
                "unknown_rollout",
                f"{rid} was not opened on this gate (POST /tokcap/v1/rollouts/{rid}/open)",
            )
        if record is None:
            if len(self._open) >= self.max_open:
                raise TooManyRollouts(
                    "too_many_open_rollouts",
                    f"{self.max_open} rollouts are open; close some before starting more",
                )
            record = self._open[rid] = RolloutRecord(rid, Ledger(rid), self._lock())
        elif record.phase in IN_CLOSE:
            raise RolloutConflict("rollout_closed", f"{rid} is closing")
        return record

    def append(self, record: RolloutRecord, event: Event) -> Entry:
        """Append ``event`` to the rollout's ledger and move the rollout on, in one step (each
        event appends through it). `LedgerProtocolError` (refused) changes nothing."""
        op = "closed" if isinstance(event, (Closed, Poisoned)) else "append"
        next_phase(record.phase, op, ROLLOUT_TRANSITIONS, ROLLOUT_REFUSALS)  # refused: no entry
        entry = record.ledger.append(event)
        self._advance(record, op)
        return entry

    # ---- the events of a call, in the order they come ------------------------------

    def call_received(
        self,
        rollout_id: str,
        *,
        kind: str,
        require_open: bool = False,
        idempotency_key: str | None = None,
        body_fingerprint: str = "",
        request_id: str | None = None,
        thread: ResponsesTurn | None = None,
    ) -> GateCall:
        """A captured request arrived: a new live call of its rollout (`join`'s refusals;
        `RolloutConflict` ``rollout_poisoned`` when the rollout already failed)."""
        record = self.join(rollout_id, require_open=require_open)
        if record.phase is UNCAPTURED:
            raise _poisoned(record)
        call = GateCall(
            record,
            kind,
            self._flag(),
            self._flag(),
            idempotency_key=idempotency_key,
            body_fingerprint=body_fingerprint,
            request_id=request_id,
            abandoned=self._flag(),
            thread=thread,
        )
        record.live.add(call)
        return call

    def call_claimed(self, call: GateCall, *, waited: GateCall | None = None) -> Holder | None:
        """The call claims its key and request id: None once it holds them; else the key's
        `Holder`, to answer again if it settled with an answer, or to wait for and claim
        again with ``waited`` (`RolloutConflict` ``retry_in_flight`` if it still has not
        settled; ``rollout_closed`` or ``rollout_poisoned`` if its rollout stopped
        admitting calls meanwhile)."""
        record = call.rollout
        if waited is not None:
            if waited.phase not in FINAL:
                raise RolloutConflict(
                    "retry_in_flight", "the call holding this Idempotency-Key is still running"
                )
            _check_accepting(record)
        key = call.idempotency_key
        holder = record.keys.get(key) if key is not None else None
        if holder is not None and holder is not call and not gone(holder):
            if holder.body_fingerprint != call.body_fingerprint:
                raise RolloutConflict(
                    "idempotency_key_reused",
                    "this Idempotency-Key was used with a different request body",
                )
            if answerable(holder):
                return Holder(holder, holder.answer)
            if holder.phase not in FINAL:
                return Holder(holder, None)
        if key is not None:
            record.keys[key] = call
        if call.request_id is not None:
            other = record.request_ids.get(call.request_id)
            if other is not None and other is not call:
                raise RolloutConflict(
                    "duplicate_request_id",
                    f"request id {call.request_id!r} was already used in this rollout",
                )
            record.request_ids[call.request_id] = call
        return None

    def call_dropped(self, call: GateCall) -> None:
        """The call left before its admission (answered again, or refused on the way): its
        claims are freed, and its rollout forgotten if nothing else made it."""
        self._step(call, "drop")

    def call_refused(self, call: GateCall) -> None:
        """The call was refused on its way to admission: dropped if it is still planning."""
        if call.phase is PLANNING:
            self._step(call, "drop")

    def call_planning(self, call: GateCall, request: PlannedRequest) -> None:
        """The call is about to be planned (under its rollout's lock): refused if the
        rollout stopped admitting calls."""
        _check_accepting(call.rollout)
        call.request = request

    def call_planned(
        self, call: GateCall, plan: ChatPlan, *, admitted_at: int, unserved: GateError | None
    ) -> Entry | GateCall:
        """The call was planned: its ``Admitted`` entry, or the parent to wait for (planned
        on a parent not committed yet: wait for it, `parent_waited`, plan again). Refused
        if the rollout stopped admitting calls, or with ``unserved``: why the gate cannot
        vouch for a call now (`CapturePath.serving_refusal`)."""
        record = call.rollout
        self._allowed(call, "admit")
        _check_accepting(record)
        if unserved is not None:
            raise unserved
        parent = record.calls.get(CallId(plan.parent_id)) if plan.parent_id else None
        if parent is not None and parent.phase is not COMMITTED:
            return parent
        call_id = CallId(record.ledger.next_call_id())
        event = Admitted(
            call_id=call_id,
            parent_id=plan.parent_id,
            prefix_len=plan.prefix_len,
            admitted_at=admitted_at,
            request_fingerprint=plan.request_fingerprint,
            formation=plan.formation,
            break_cause=plan.break_cause,
            splice_cause=plan.splice_cause,
        )
        try:
            entry = self.append(record, event)
        except LedgerProtocolError as e:
            raise RolloutConflict(e.code, e.message) from e
        call.call_id, call.plan, call.parent = call_id, plan, parent
        self._step(call, "admit")
        return entry

    def parent_waited(self, parent: GateCall) -> None:
        """The wait for a call's parent is over: `RolloutConflict` ``parent_not_committed``
        unless it committed."""
        if parent.phase is not COMMITTED:
            raise RolloutConflict("parent_not_committed", f"parent {parent.call_id} did not commit")

    def call_finished(self, call: GateCall, result: EngineResult) -> bool:
        """The engine produced the call's final output: True if it is to be staged (False:
        the call left while it generated)."""
        if self._step(call, "finish") is not FINISHED:
            return False
        call.result = result
        return True

    def call_completing(self, call: GateCall) -> GateError | None:
        """The response is about to complete: why it must not (None: the ledger will hold it
        as served). A call abandoned while it generated (its rollout closed) is
        ``rollout_closed``; one contained, ``rollout_poisoned``; one whose engine output
        cannot be staged (aborted by a weight push or vLLM's ``/pause``, or a capture
        failure) is `CallNotServed`. A sink write that fails once the staged call is built
        does not refuse: the call is served, ``Failed(served=True)``."""
        if call.phase is ABANDONED:
            return RolloutConflict(
                "rollout_closed",
                f"{call.rollout.rollout_id} was closed while this call was generating",
            )
        if call.phase is CONTAINED:
            return _poisoned(call.rollout)
        if call.phase is FINISHED and call.staged is not None:
            return None
        if call.result is not None and call.result.finish_reason == "abort":
            return CallNotServed(
                "call_aborted", "the engine aborted this call (a weight push or a pause); retry it"
            )
        return CallNotServed(
            "capture_failed", f"this call could not be captured ({call.stage_error}); retry it"
        )

    def call_ended(self, call: GateCall, detail: str) -> tuple[GateError | None, Abandoned | None]:
        """vLLM's handler returned: the error to end a response it left unfinished with (the
        call was abandoned while it generated: ``rollout_closed``), and the abandonment of
        a call still in flight (why: ``detail``)."""
        if call.phase is ABANDONED:
            return self.call_completing(call), None
        return None, self.call_abandoned(call, detail)

    def call_responded(self, call: GateCall, seen: Observed, learned: Learned | None) -> bool:
        """The harness got the whole response (``seen``; ``learned``: what the parent index
        learned of it, None if indexing failed): the call becomes a parent, unless it left
        meanwhile. True if its commit is to follow."""
        if call.phase is not FINISHED:
            self._step(call, "respond")  # ignored once abandoned or contained
            return False
        call.response_id = seen.response_id
        if learned is not None:
            call.output_fp, call.answer = learned.output_fp, seen.answer
            call.prior = learned.prior if call.staged is not None else None
        self._step(call, "respond")
        return True

    def call_committed(self, call: GateCall) -> tuple[Entry | None, str | None]:
        """The responded call's sink write is over: ``Staged`` (COMMITTED), or
        ``Failed(served=True)`` with why it could not commit (the sink's error, or the
        ledger refusing it). Returns the entry (None: the ledger closed meanwhile) and the
        ledger's refusal code."""
        staged = call.staged
        if call.stage_error is not None or staged is None:
            return self._fail_served(call, make_reason(STAGE_FAILED, call.stage_error)), None
        self._allowed(call, "commit")
        event = Staged.for_call(
            staged, response_id=call.response_id, output_fingerprint=call.output_fp
        )
        try:
            entry = self.append(call.rollout, event)
        except LedgerProtocolError as e:
            return self._fail_served(call, make_reason(LEDGER_REFUSED, e.code)), e.code
        self._step(call, "commit")
        return entry, None

    def call_abandoned(self, call: GateCall, detail: str) -> Abandoned | None:
        """The call's response never completed: ``Failed(served=False)`` (off-chain). None
        when there was nothing to abandon (a call still planning is dropped)."""
        if call.phase is PLANNING:
            self._step(call, "drop")
            return None
        if call.phase is not ADMITTED and call.phase is not FINISHED:
            return None  # not in flight
        clear_row = call.phase is FINISHED
        self._step(call, "abandon")
        if call.rollout.ledger.status is not LEDGER_OPEN:
            return Abandoned(None, clear_row)
        assert call.call_id is not None
        reason = make_reason(UNCOMMITTED_CALL, detail)
        failed = Failed(call_id=call.call_id, reason=reason, served=False)
        return Abandoned(self.append(call.rollout, failed), clear_row)

    def call_contained(self, call: GateCall, reason: str) -> None:
        """A step of the call failed inside the gate: its rollout is poisoned with
        ``reason`` and the call leaves, CONTAINED (a call already settled stays as it is)."""
        self._allowed(call, "contain")
        self._advance(call.rollout, "fail", poison=reason)
        self._step(call, "contain")

    # ---- the tables, applied ---------------------------------------------------------

    def _advance(self, record: RolloutRecord, op: str, *, poison: str | None = None) -> None:
        was = record.phase
        nxt = next_phase(was, op, ROLLOUT_TRANSITIONS, ROLLOUT_REFUSALS)
        record.phase = nxt
        if poison is not None and record.poison is None:
            record.poison = poison
        if nxt is CLOSED and was is not CLOSED:  # a late failure never brings a released id back
            if self._open.get(record.rollout_id) is record:
                del self._open[record.rollout_id]
            self._closed[record.rollout_id] = record.ledger

    @staticmethod
    def _allowed(call: GateCall, op: str) -> None:
        """`CallStateError` unless the call table allows ``op`` now (checked before an
        entry is appended, so a refused event changes nothing)."""
        next_phase(call.phase, op, TRANSITIONS, REFUSALS)

    def _step(self, call: GateCall, op: str) -> CallPhase:
        was = call.phase
        nxt: CallPhase = next_phase(was, op, TRANSITIONS, REFUSALS)
        if nxt is was:
            return nxt  # the engine or the response went on after the call left: ignored
        call.phase = nxt
        record = call.rollout
        for effect in EFFECTS[op]:
            if effect == "leave":
                record.live.discard(call)
            elif effect == "release_claims":
                key, rid = call.idempotency_key, call.request_id
                if key is not None and record.keys.get(key) is call:
                    del record.keys[key]
                if rid is not None and record.request_ids.get(rid) is call:
                    del record.request_ids[rid]
            elif effect == "forget_if_idle":
                idle = record.phase is EMPTY and not record.live
                if idle and self._open.get(record.rollout_id) is record:
                    del self._open[record.rollout_id]
            elif effect == "index_call":
                assert call.call_id is not None
                record.calls[call.call_id] = call
            elif effect == "index_parent":
                if call.prior is not None and call.plan is not None:
                    record.parents.add(call.prior, len(call.plan.prompt_text))
            elif effect == "unindex_parent":
                if call.prior is not None:
                    record.parents.forget(call.prior)
            elif effect == "uncapture":
                self._advance(record, "fail")
            elif effect == "signal_abandoned" and call.abandoned is not None:
                call.abandoned.set()
            elif effect == "signal_sink_done":
                call.sink_done.set()
        if nxt in FINAL:
            call.settled.set()
        return nxt

    def _fail_served(self, call: GateCall, reason: str) -> Entry | None:
        self._step(call, "fail")
        if call.rollout.ledger.status is not LEDGER_OPEN:
            return None
        assert call.call_id is not None
        return self.append(call.rollout, Failed(call_id=call.call_id, reason=reason, served=True))


def _check_accepting(record: RolloutRecord) -> None:
    if record.phase in IN_CLOSE or record.ledger.status is not LEDGER_OPEN:
        raise RolloutConflict("rollout_closed", f"{record.rollout_id} is closed")
    if record.phase is UNCAPTURED:
        raise _poisoned(record)


def _poisoned(record: RolloutRecord) -> RolloutConflict:
    """A captured path never answers a call its ledger would not hold."""
    return RolloutConflict(
        "rollout_poisoned",
        f"{record.rollout_id} failed ({record.poison or 'a call failed'}) and cannot "
        "verify; its calls are refused: close it and start a new rollout",
    )
