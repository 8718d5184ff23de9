"""The capture path of the gate's driver: one call from its request to its commit.

`CapturePath` waits, writes and tells; what may happen is the tables'
(`tokcap_vllm.gate._rollouts`, `tokcap_vllm.gate._lifecycle`), and what a call returned and how the
next one attaches is the rollout's `tokcap_vllm.gate._planning.ParentIndex`.

Per captured request: `enter` joins the rollout, holds the call's idempotency key and
request id (or finds the earlier call to answer again), plans it against the parent index and
appends ``Admitted``; the engine runs on the admitted ids (`CaptureHost`);
`engine_finished` starts the sink write at once (`StageWriter` batches the writes of calls
that finish together); `respond` (just before the response's last byte) makes the call a
parent and schedules its commit, which appends ``Staged`` once the sink acknowledged, or
``Failed(served=True)`` if it did not. A call whose response never completed is
`abandon`-ed (``Failed(served=False)``, its staged row cleared).

Containment: nothing that goes wrong with one call reaches the task group the gate
serves. A sink failure, a ledger refusal (``ledger_refused``) or an unexpected error
(``gate_failed``) fails that call and poisons its rollout; a ledger-file write failure
(``ledger_write_failed``) poisons its rollout (``Poisoned`` at close); each is logged with
its code and counted. Every other rollout goes on capturing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import TaskGroup

from tokcap_core import Entry, LedgerProtocolError, TokcapError
from tokcap_core.ids import CallId
from tokcap_core.ledger import OPEN, Admitted, Closed, Event, Failed, Poisoned
from tokcap_core.reasons import (
    GATE_FAILED,
    LEDGER_REFUSED,
    LEDGER_WRITE_FAILED,
    STAGE_FAILED,
    UNCOMMITTED_CALL,
    make_reason,
)
from tokcap_core.sink import SinkHealth, TokenSink

from ..errors import (
    CallNotServed,
    GateError,
    RolloutConflict,
    SinkUnavailable,
    WeightsUnavailable,
)
from ..persist import GateHooks, LedgerFileError
from ..transfer import WeightPhase, WeightState
from ._config import GateConfig
from ._host import EngineResult
from ._lifecycle import ABANDONED, COMMITTED, FINISHED, PLANNING
from ._metrics import GateMetrics
from ._planning import ChatPlan, Observed, ParentIndex, PlannedRequest
from ._records import GateCall, answerable
from ._responses import ResponsesTurn
from ._rollouts import UNCAPTURED, RolloutBook, RolloutRecord, check_not_poisoned
from ._stage_writer import StageWriter
from ._staging import staged_call, staged_entry

__all__ = ["CapturePath", "check_accepting"]

_log = logging.getLogger("tokcap_vllm.gate")


class CapturePath:
    """The gate's calls: admitted against the book, staged into the sink, committed."""

    def __init__(
        self,
        config: GateConfig,
        sink: TokenSink,
        book: RolloutBook,
        telemetry: GateMetrics,
        observers: list[GateHooks],
    ) -> None:
        self.config = config
        self.sink = sink
        self.book = book
        self.telemetry = telemetry
        self.observers = observers
        self.tg: TaskGroup | None = None
        """The task group of the gate's `serve` (None: not serving)."""
        self.weights: WeightState | None = None
        """The watched weight state (`Gate.watch_weights`)."""
        self.kv_kept: set[int] = set()
        """Versions whose push let calls in flight keep their older KV (push mode ``keep``)."""
        self.stager = StageWriter(sink, config.capture.stage_timeout_s, self._written)
        """Writes staged calls to the sink, batching those that finish together."""

    async def enter(
        self,
        rollout_id: str,
        *,
        kind: str,
        request: Callable[[], PlannedRequest],
        idempotency_key: str | None = None,
        body_fingerprint: str = "",
        request_id: str | None = None,
        thread: ResponsesTurn | None = None,
    ) -> GateCall:
        """Admit a captured request: the ADMITTED call, or the earlier call to answer again.

        A rollout that already failed refuses it (``rollout_poisoned``). A settled call: a
        retry under its idempotency key (its answer is sent again). One key is one call: a
        retry waits for the holder (bounded) and takes the key over if it never completed;
        a different body is refused (``idempotency_key_reused``), a request id another call
        of the rollout used too (``duplicate_request_id``). ``request`` binds the body to
        the tokenizer (after the claim, so a retry is answered again without re-planning). A request
        refused on the way leaves nothing behind. ``thread``: a Responses call's items.
        """
        record = self.book.join(rollout_id, require_open=self.config.require_open)
        call = self.book.begin(
            record,
            kind=kind,
            idempotency_key=idempotency_key,
            body_fingerprint=body_fingerprint,
            request_id=request_id,
        )
        call.thread = thread
        try:
            earlier = await self._claim(call)
            if earlier is not None:
                self.book.step(call, "drop")
                return earlier
            await self._admit(call, request())
        except Exception:
            if call.phase is PLANNING:
                self.book.step(call, "drop")
            raise
        return call

    async def _claim(self, call: GateCall) -> GateCall | None:
        while True:
            holder = self.book.claim(call)
            if holder is None or answerable(holder):
                return holder
            with anyio.move_on_after(self.config.parent_commit_timeout_s):
                await holder.settled.wait()
            if not holder.final:
                raise RolloutConflict(
                    "retry_in_flight", "the call holding this Idempotency-Key is still running"
                )
            check_accepting(call.rollout)

    async def _admit(self, call: GateCall, request: PlannedRequest) -> None:
        """Plan in a worker thread under the rollout's lock; if the parent has not committed
        yet, release the lock, await it (bounded) and plan again. If the ledger file could
        not record the admission, the call is abandoned and refused (`CallNotServed`
        ``ledger_write_failed``): it would be served into a rollout that cannot verify."""
        record = call.rollout
        call.request = request
        while True:
            async with record.lock:
                check_accepting(record)
                made = await anyio.to_thread.run_sync(record.parents.planner(request))
                check_accepting(record)
                self._check_serving()
                parent = record.calls.get(CallId(made.parent_id)) if made.parent_id else None
                if parent is None or parent.phase is COMMITTED:
                    self._admitted(call, made, parent)
                    break
            with anyio.move_on_after(self.config.parent_commit_timeout_s):
                await parent.settled.wait()
            if parent.phase is not COMMITTED:
                raise RolloutConflict(
                    "parent_not_committed", f"parent {parent.call_id} did not commit"
                )
        if record.phase is UNCAPTURED:  # its Admitted could not be written to the file
            await self.abandon(call, "ledger_write_failed")
            raise CallNotServed(
                "ledger_write_failed",
                f"the gate's ledger file could not record this call ({record.poison})",
            )

    def _check_serving(self) -> None:
        """Refuse a call the gate could not vouch for: a sink that cannot stage it
        (`tokcap_core.sink.SinkHealth`), weights FAILED (or an engine asleep)."""
        problem = self.sink.problem if isinstance(self.sink, SinkHealth) else None
        if problem is not None:
            raise SinkUnavailable(
                "sink_unavailable",
                f"the sink cannot take staged calls ({problem}): captured calls are refused "
                "until it can",
            )
        state = self.weights
        if state is not None and state.phase is WeightPhase.FAILED and state.error == "asleep":
            raise WeightsUnavailable(
                "weights_unavailable",
                "the engine is asleep (/sleep): captured calls are refused until /wake_up",
            )
        if state is not None and state.phase is WeightPhase.FAILED:
            raise WeightsUnavailable(
                "weights_unavailable",
                f"a weight push to version {state.target} failed ({state.error}); the engine "
                "may hold half-updated weights: captured calls are refused until a full push "
                "succeeds",
            )

    def _admitted(self, call: GateCall, plan: ChatPlan, parent: GateCall | None) -> None:
        record = call.rollout
        call_id = CallId(record.ledger.next_call_id())
        event = Admitted(
            call_id=call_id,
            parent_id=plan.parent_id,
            prefix_len=plan.prefix_len,
            admitted_at=time.time_ns(),
            request_fingerprint=plan.request_fingerprint,
            formation=plan.formation,
            break_cause=plan.break_cause,
            splice_cause=plan.splice_cause,
        )
        try:
            self.append(record, event)
        except LedgerProtocolError as e:
            raise RolloutConflict(e.code, e.message) from e
        call.call_id, call.plan, call.parent = call_id, plan, parent
        self.book.step(call, "admit")

    def engine_finished(self, call: GateCall, result: EngineResult) -> None:
        """The engine produced the final output: build the staged call and start the sink write."""
        try:
            if self.book.step(call, "finish") is ABANDONED:
                return  # the harness left (or the rollout closed) while it generated
            call.result = result
            call.staged = staged_call(
                call, result, self.config.capture.capture_routes, kv_kept=self.kv_kept
            )
        except TokcapError as e:
            call.stage_error = e.code
        except Exception as e:  # containment: never let one call's bug reach the engine
            call.stage_error = type(e).__name__
            _log.exception("tokcap gate: building the staged call of %s failed", call.call_id)
        if call.staged is None or self.tg is None:
            call.stage_error = call.stage_error or "gate_not_serving"
            call.sink_done.set()
            return
        self.stager.write(call, self.tg)

    async def _written(self, calls: list[GateCall], seconds: float) -> None:
        """Tell the observers each call's sink write (a failing observer: that rollout's)."""

        async def tell(call: GateCall) -> None:
            assert call.staged is not None
            for hook in self.observers:
                hook.on_sink_write(call.staged, seconds, call.stage_error)

        for call in calls:
            await self._guarded(tell, call)

    def respond(self, call: GateCall, seen: Observed) -> None:
        """The harness got the whole response (``seen``): index the call as a parent, commit
        it later. Indexing that fails is logged; the call still commits, as no parent."""
        if call.phase is not FINISHED:
            self.book.step(call, "respond")  # ignored once abandoned; refused otherwise
            return
        call.response_id = seen.response_id
        try:
            assert call.request is not None
            assert call.plan is not None
            assert call.result is not None
            assert call.call_id is not None
            learned = ParentIndex.learn(
                call.request,
                call_id=call.call_id,
                kind=call.kind,
                plan=call.plan,
                result=call.result,
                seen=seen,
            )
        except Exception:  # containment: the harness still gets its answer
            _log.exception("tokcap gate: indexing call %s failed", call.call_id)
        else:
            call.output_fp, call.answer = learned.output_fp, seen.answer
            call.prior = learned.prior if call.staged is not None else None
        self.book.step(call, "respond")
        if self.tg is None:
            call.stage_error = call.stage_error or "gate_not_serving"
            self._settle(call)
            return
        self.tg.start_soon(self._guarded, self._commit, call)

    def completion_refusal(self, call: GateCall) -> GateError | None:
        """Why ``call``'s response must not complete (None: the ledger will hold it as served).

        Asked just before the response's last byte (or a stream's ``[DONE]``): a call
        abandoned while it generated (its rollout closed) is ``rollout_closed``; one whose
        engine output cannot be staged (aborted by a weight push or vLLM's ``/pause``, or a
        capture failure) is `CallNotServed`. The harness then gets that error and the call
        is abandoned (``Failed(served=False)``, off-chain). A sink write that fails once the
        staged call is built does not refuse: the call is served, ``Failed(served=True)``.
        """
        if call.phase is ABANDONED:
            return RolloutConflict(
                "rollout_closed", f"{call.rollout_id} was closed while this call was generating"
            )
        if call.phase is FINISHED and call.staged is not None:
            return None
        if call.result is not None and call.result.finish_reason == "abort":
            return CallNotServed(
                "call_aborted", "the engine aborted this call (a weight push or a pause); retry it"
            )
        return CallNotServed(
            "capture_failed", f"this call could not be captured ({call.stage_error}); retry it"
        )

    def forget_if_unserved(self, call: GateCall) -> None:
        """After vLLM refused ``call`` itself (its own 4xx): forget the rollout if none of its
        calls was served, so requests vLLM refuses leave no rollout behind, like those the
        gate refuses (the observers hear a release: the ledger file records one)."""
        record = call.rollout
        if not self.book.forget_unserved(record):
            return
        for hook in self.observers:
            try:
                hook.on_release(record.rollout_id)
            except Exception as e:  # memory holds; the file keeps the stale entries
                _log.warning("tokcap gate: forgetting %s was not persisted: %s", call.rollout_id, e)

    async def _commit(self, call: GateCall) -> None:
        await call.sink_done.wait()
        self._settle(call)

    def _settle(self, call: GateCall) -> None:
        """Commit a responded call, or fail it (served) with the reason it could not commit."""
        record = call.rollout
        if call.stage_error is None and call.staged is not None:
            try:
                self.append(record, staged_entry(call.staged, call.response_id, call.output_fp))
            except LedgerProtocolError as e:
                _log.warning(
                    "tokcap gate: the ledger refused call %s of %s (%s); the rollout is poisoned",
                    call.call_id,
                    record.rollout_id,
                    e.code,
                )
                self.telemetry.contained.labels(e.code).inc()
                self._fail_served(call, make_reason(LEDGER_REFUSED, e.code))
                return
            self.book.step(call, "commit")
            return
        self._fail_served(call, make_reason(STAGE_FAILED, call.stage_error))

    def _fail_served(self, call: GateCall, reason: str) -> None:
        self.book.step(call, "fail")
        assert call.call_id is not None
        if call.rollout.ledger.status is OPEN:
            self.append(call.rollout, Failed(call_id=call.call_id, reason=reason, served=True))

    async def abandon(self, call: GateCall, detail: str) -> None:
        """The response never completed: ``Failed(served=False)``, and clear any staged row."""
        if call.phase is PLANNING:
            self.book.step(call, "drop")
            return
        if not call.in_flight:
            return
        was_finished = call.phase is FINISHED
        self.book.step(call, "abandon")
        assert call.call_id is not None
        if call.rollout.ledger.status is OPEN:
            reason = make_reason(UNCOMMITTED_CALL, detail)
            self.append(call.rollout, Failed(call_id=call.call_id, reason=reason, served=False))
        if was_finished:
            with anyio.CancelScope(shield=True):
                await self._clear_orphan(call)

    async def _clear_orphan(self, call: GateCall) -> None:
        """Free the staged row of a call no ledger commits (best effort, counted)."""
        await call.sink_done.wait()
        if call.stage_error is not None or call.staged is None:
            return
        try:
            with anyio.fail_after(self.config.capture.stage_timeout_s):
                await self.sink.clear([call.staged.key])
        except Exception:  # the key is named by no receipt; a sweep of the sink finds it
            self.telemetry.orphan_clears.labels("failed").inc()
            return
        self.telemetry.orphan_clears.labels("ok").inc()

    async def _guarded(self, step: Callable[[GateCall], Awaitable[None]], call: GateCall) -> None:
        """Run a background step of one call; any failure stays with that call's rollout."""
        try:
            await step(call)
        except Exception as e:
            code = e.code if isinstance(e, TokcapError) else type(e).__name__
            _log.error(
                "tokcap gate: call %s of %s failed inside the gate (%s); the rollout is poisoned",
                call.call_id,
                call.rollout_id,
                code,
                exc_info=e,
            )
            self.telemetry.contained.labels(code).inc()
            self.book.contain(call, make_reason(GATE_FAILED, code))

    # ---- ledger entries and their observers -------------------------------------------

    def append(self, record: RolloutRecord, event: Event) -> Entry:
        """Append to a rollout's ledger, move the rollout on and tell the observers.

        `LedgerProtocolError` (the ledger refused the event) propagates and changes nothing.
        An observer's failure (the ledger file could not write) poisons the rollout.
        """
        entry = record.ledger.append(event)
        closing = isinstance(event, (Closed, Poisoned))
        self.book.advance(record, "closed" if closing else "append")
        for hook in self.observers:
            try:
                hook.on_entry(record.rollout_id, entry)
            except Exception as e:  # a LedgerFileError above all; never the caller's problem
                detail = e.detail if isinstance(e, LedgerFileError) else type(e).__name__
                if record.poison is None:
                    _log.warning(
                        "tokcap gate: %s could not be persisted (%s); the rollout is poisoned",
                        record.rollout_id,
                        e,
                    )
                    self.telemetry.ledger_write_failures.inc()
                self.book.advance(record, "fail", poison=make_reason(LEDGER_WRITE_FAILED, detail))
        return entry


def check_accepting(record: RolloutRecord) -> None:
    """`RolloutConflict` (``rollout_closed``, ``rollout_poisoned``) unless ``record`` admits
    new calls."""
    if not record.accepting:
        raise RolloutConflict("rollout_closed", f"{record.rollout_id} is closed")
    check_not_poisoned(record)
